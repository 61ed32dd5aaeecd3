"""mlx_engine: an inference engine on Apple's MLX.

The public API (``mlx_engine.load``, ``mlx_engine.generate``, ...) lives in :mod:`mlx_engine.api` and is offered here
lazily, so that importing ``mlx_engine.ml`` from a model never pulls ``models/`` back in.
"""

from mlx_engine.version import __version__

_API = ("load", "generate", "stream", "chat", "ChatSession", "ChatReply", "Answer", "Thinking", "ToolCall", "Model",
        "EmbeddingModel",
        "GenerationStats", "GenerationOptions",
        "generate_image", "save_image", "read_image_parameters", "open_init_image",
        "load_image_model")


def __getattr__(name: str):
    if name in _API:
        from mlx_engine import api

        return getattr(api, name)
    raise AttributeError(f"module 'mlx_engine' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_API))
