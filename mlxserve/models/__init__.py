"""Load model directories and build tiny synthetic checkpoints."""

from mlxserve.models.load import load
from mlxserve.models.loaded import LoadedModel, ModelLoadError

__all__ = ["LoadedModel", "ModelLoadError", "load"]
