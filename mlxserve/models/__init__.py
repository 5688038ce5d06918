"""Load model directories: generic loading here, DeepSeek-V4 and V4.1 in
`deepseek_v4/`, the checkpoints the product ships in `tiny/`."""

from mlxserve.models.load import load
from mlxserve.models.loaded import LoadedModel, ModelLoadError

__all__ = ["LoadedModel", "ModelLoadError", "load"]
