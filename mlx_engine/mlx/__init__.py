"""The MLX implementation of ``mlx_engine.ml``: the one package that imports ``mlx``."""

from mlx_engine.mlx.backend import MLXBackend, MLXContext
from mlx_engine.mlx.runtime import blas_description, select_device
from mlx_engine.mlx.tensor import MLXQuantizedTensor, MLXTensor

__all__ = ["MLXBackend", "MLXContext", "MLXTensor", "MLXQuantizedTensor", "blas_description", "select_device"]
