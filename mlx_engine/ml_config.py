"""What a backend is set up with and says of itself, below the interfaces of :mod:`mlx_engine.ml` (which re-exports
both): the activations its quantized products may take, and how it wants KV caches laid out."""

from __future__ import annotations

from dataclasses import dataclass

from mlx_engine.dtype import DType

__all__ = ["ACTIVATIONS", "CacheConfig"]

#: What a backend's quantized products on the CPU may do with x (``mlx_engine.load(..., activations=)``):
#: ``"float32"``, the exact product with the dequantized weight; ``"int8"``, x quantized as llama.cpp does for the
#: weight's type (per 32 elements, its Q8_0; per 256 for K-quants, its Q8_K) and integer dot products; ``"int16"``, x quantized per 32 elements to 16 bits and the same
#: integer dot products (x rounded 257x finer than int8's: float32's numerics to a few 1e-5).
ACTIVATIONS = ("float32", "int8", "int16")


@dataclass(frozen=True)
class CacheConfig:
    """How a backend wants KV caches laid out (ollama's ``ml.CacheConfig``).

    Attributes:
        padding: the number of cells a cache rounds its used range up to, so attention kernels see aligned sizes.
        mask_dtype: dtype of the additive mask returned by ``Cache.get``.
        step: the number of cells a growing cache allocates at a time (when not reserving the whole capacity).
    """

    padding: int = 1
    mask_dtype: DType = DType.FLOAT32
    step: int = 256
