"""mlxserve: an OpenAI-compatible LLM inference server on MLX."""

__version__ = "0.1.0"
