"""Weight readers: GGUF and safetensors, giving named host arrays (NumPy) plus typed metadata.

``open_weights(path)`` picks the reader; the backend uploads tensors to the device one by one. This package imports
NumPy, ``gguf`` and nothing of ``mlx``.
"""

from mlx_engine.weights.base import Metadata, QuantizedArray, WeightFile
from mlx_engine.weights.gguf import GGUFFile, GGUFTensorInfo
from mlx_engine.weights.loader import open_weights
from mlx_engine.weights.safetensors import SafetensorsFile, SafetensorsTensorInfo

__all__ = [
    "GGUFFile",
    "GGUFTensorInfo",
    "Metadata",
    "QuantizedArray",
    "SafetensorsFile",
    "SafetensorsTensorInfo",
    "WeightFile",
    "open_weights",
]
