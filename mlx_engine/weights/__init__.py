"""Weight readers: GGUF and safetensors, giving named host arrays plus metadata."""

from mlx_engine.weights.base import Metadata, QuantizedArray, WeightFile

__all__ = ["Metadata", "QuantizedArray", "WeightFile", "open_weights"]


def open_weights(path) -> WeightFile:  # replaced by the real dispatcher in mlx_engine/weights/loader.py
    from mlx_engine.weights.loader import open_weights as _open

    return _open(path)
