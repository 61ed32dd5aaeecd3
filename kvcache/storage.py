"""The device storage of a KV cache's layers, apart from the cells' bookkeeping (:mod:`mlx_engine.kvcache.causal`).

Each layer keeps keys ``[1, H_kv, cells, Dk]`` and values ``[1, H_kv, cells, Dv]``, allocated on the layer's first
write and grown a few cells at a time, in one of three forms:

- float, in the compute dtype (``kv_bits`` None);
- 16-bit floats (``kv_bits`` 16): float16, or bfloat16 where the compute dtype is bfloat16 (nothing changes where it
  is float16), rounded to nearest even as they are written: llama.cpp's and ollama's default cache type, half the
  bytes a float32 decode step reads;
- affine-quantized along the head dimension (``kv_bits`` 2-8, MLX's ``quantize``: groups of ``kv_group_size``,
  scales and biases in the compute dtype); ``Dk`` and ``Dv`` must be multiples of the group size.

Reads return keys and values in the compute dtype (dequantized or widened).

With ``shared_values`` (multi-head latent attention's cache) no value is stored: a layer's values are the last ``Dv``
features of its keys, read as a slice of them (DeepSeek's latent is both the key's content part and the value).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import numpy as np

from mlx_engine.errors import CacheError
from mlx_engine.kvcache.base import ShiftFn
from mlx_engine.ml import Context, DType, Tensor

KV_BITS = (2, 3, 4, 5, 6, 8)  # the bit widths a quantized cache may use
HALF_KV_BITS = 16  # kv_bits for a cache of 16-bit floats

# Writes rows into a stored tensor at the cells a caller chose: ``write(dst, src)``.
RowWriter = Callable[[Tensor, Tensor], None]


def round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def stored_dtype(kv_bits: Optional[int], dtype: DType) -> DType:
    """What a cache of ``kv_bits`` keeps keys and values as under the compute ``dtype`` (a quantized cache: the
    dtype of its scales and biases)."""
    if kv_bits == HALF_KV_BITS and dtype not in (DType.FLOAT16, DType.BFLOAT16):
        return DType.FLOAT16
    return dtype


class LayerStorage:
    """Device storage of one layer: ``k`` and ``v`` are ``[tensor]`` (float) or ``[packed, scales, biases]`` (``v``
    ``[]`` where the values are the keys' last features); ``size`` cells; ``shape`` ``(H_kv, Dk, Dv)``."""

    __slots__ = ("k", "v", "size", "shape")

    def __init__(self, k: list[Tensor], v: list[Tensor], size: int, shape: tuple[int, int, int]):
        self.k, self.v, self.size, self.shape = k, v, size, shape

    def tensors(self) -> list[Tensor]:
        return self.k + self.v


class KVStorage:
    """The layers' keys and values in one of the forms above (``layers``: layer index -> :class:`LayerStorage`).

    Args:
        kv_bits: None (float), 16 (16-bit floats) or one of :data:`KV_BITS` (quantized).
        kv_group_size: elements per quantization group (32, 64 or 128).
        shared_values: store keys only; a layer's values are its keys' last ``Dv`` features (module docstring).

    Raises ``ValueError`` for any other ``kv_bits`` or group size.
    """

    def __init__(self, kv_bits: Optional[int], kv_group_size: int, shared_values: bool = False):
        if kv_bits is not None and kv_bits not in KV_BITS + (HALF_KV_BITS,):
            raise ValueError(f"kv_bits must be one of {KV_BITS + (HALF_KV_BITS,)} or None, not {kv_bits!r}")
        if kv_group_size not in (32, 64, 128):
            raise ValueError(f"kv_group_size must be 32, 64 or 128, not {kv_group_size!r}")
        self.kv_bits, self.kv_group_size, self.shared_values = kv_bits, kv_group_size, shared_values
        self.quantized = kv_bits is not None and kv_bits != HALF_KV_BITS
        self.layers: dict[int, LayerStorage] = {}
        self.dtype = self.store_dtype = DType.FLOAT32

    def configure(self, dtype: DType) -> None:
        """Compute in ``dtype`` (which then also holds a quantized cache's scales and biases); drops every layer.
        Raises ``ValueError`` for a quantized or 16-bit cache of a dtype that is not a float."""
        if self.kv_bits is not None and not dtype.is_floating:
            raise ValueError(f"a quantized or 16-bit cache needs a float dtype, not {dtype.value}")
        self.dtype = dtype
        self.store_dtype = stored_dtype(self.kv_bits, dtype)
        self.layers = {}

    def nbytes(self) -> int:
        return sum(t.nbytes for st in self.layers.values() for t in st.tensors())

    def allocated_cells(self) -> int:
        return max((st.size for st in self.layers.values()), default=0)

    def _alloc(self, ctx: Context, shape: tuple[int, int, int], size: int) -> tuple[list[Tensor], list[Tensor]]:
        hk, dk, dv = shape
        if self.shared_values:
            if dv > dk:
                raise ValueError(f"values that are the keys' last features need Dv <= Dk, not {dv} > {dk}")
            dv = 0  # nothing stored apart
        if not self.quantized:
            return ([ctx.zeros((1, hk, size, dk), self.store_dtype)],
                    [ctx.zeros((1, hk, size, dv), self.store_dtype)] if dv else [])
        b, g = self.kv_bits, self.kv_group_size
        for name, d in (("key", dk), ("value", dv)) if dv else (("key", dk),):
            if d % g or (d * b) % 32:
                raise ValueError(f"a {b}-bit KV cache with group size {g} needs a {name} head size that is a multiple "
                                 f"of {g}, not {d}")

        def q(d: int) -> list[Tensor]:
            return [ctx.zeros((1, hk, size, d * b // 32), DType.UINT32), ctx.zeros((1, hk, size, d // g), self.dtype),
                    ctx.zeros((1, hk, size, d // g), self.dtype)]
        return q(dk), q(dv) if dv else []

    def layer(self, ctx: Context, layer: int, shape: tuple[int, int, int], need: int, cells: int,
              step: int) -> LayerStorage:
        """``layer``'s storage, allocated or grown (``step`` cells at a time, at most ``cells``) to at least ``need``
        cells. Raises ``ValueError`` when ``shape`` differs from the one the layer was stored with."""
        st = self.layers.get(layer)
        if st is not None and st.shape != shape:
            raise ValueError(f"layer {layer} stored (H_kv, Dk, Dv) = {st.shape} before, now {shape}")
        if st is not None and st.size >= need:
            return st
        size = min(cells, max(need, round_up(need, max(1, step))))
        if st is None:
            k, v = self._alloc(ctx, shape, size)
            st = self.layers[layer] = LayerStorage(k, v, size, shape)
        else:
            k, v = self._alloc(ctx, shape, size - st.size)
            st.k = [ctx.concatenate([a, b], axis=2) for a, b in zip(st.k, k)]
            st.v = [ctx.concatenate([a, b], axis=2) for a, b in zip(st.v, v)]
            st.size = size
        return st

    def _store(self, ctx: Context, dst: list[Tensor], x: Tensor, write: RowWriter) -> None:
        if x.dtype != self.store_dtype:
            x = x.astype(self.store_dtype)
        if not self.quantized:
            write(dst[0], x)
            return
        for t, part in zip(dst, ctx.quantize(x, self.kv_group_size, self.kv_bits)):
            write(t, part)

    def write(self, ctx: Context, st: LayerStorage, key: Tensor, value: Optional[Tensor], write: RowWriter) -> None:
        """Key and value rows ``[1, H_kv, n, D]`` (compute dtype) put into ``st`` in its form by ``write`` (``value``
        None and unused with ``shared_values``)."""
        self._store(ctx, st.k, key, write)
        if st.v:
            self._store(ctx, st.v, value, write)

    def _load(self, ctx: Context, parts: list[Tensor], read: Callable[[Tensor], Tensor]) -> Tensor:
        if self.quantized:
            return ctx.dequantize(*(read(t) for t in parts), self.kv_group_size, self.kv_bits)
        x = read(parts[0])
        return x if x.dtype == self.dtype else x.astype(self.dtype)

    def read(self, ctx: Context, st: LayerStorage, used: int) -> tuple[Tensor, Tensor]:
        """Keys and values of cells ``[0, used)`` in the compute dtype (a slice of the storage where it is float; the
        values a slice of the keys with ``shared_values``)."""
        def cells(t: Tensor) -> Tensor:
            return t if used == st.size and not self.quantized else t[:, :, :used, :]
        k = self._load(ctx, st.k, cells)
        return k, (self._load(ctx, st.v, cells) if st.v else k[:, :, :, st.shape[1] - st.shape[2]:])

    def shift_keys(self, ctx: Context, idx: np.ndarray, delta: int, shift_fn: ShiftFn) -> None:
        """Keys of cells ``idx`` (ascending) of every layer re-rotated by ``delta`` positions with ``shift_fn``, read
        and written in the compute dtype (one slice where the cells are consecutive, a gather and scatter
        otherwise), then evaluated. Raises ``CacheError`` where a layer has no storage for those cells."""
        contiguous = int(idx[-1]) - int(idx[0]) == len(idx) - 1
        it = None if contiguous else ctx.from_numpy(idx.astype(np.int32), DType.INT32)
        a, b = int(idx[0]), int(idx[-1]) + 1
        shift = ctx.from_numpy(np.full(len(idx), delta, np.int32), DType.INT32)
        touched = []
        for layer, st in self.layers.items():
            if b > st.size:
                raise CacheError(f"layer {layer} has no storage for cells up to {b - 1}")

            def read(t: Tensor) -> Tensor:
                return t[:, :, a:b, :] if it is None else t.take(it, axis=2)

            def write(t: Tensor, x: Tensor) -> None:
                if it is None:
                    t[:, :, a:b, :] = x
                else:
                    t[:, :, it, :] = x
            self._store(ctx, st.k, shift_fn(ctx, layer, self._load(ctx, st.k, read), shift), write)
            touched.extend(st.k)
        ctx.evaluate(*touched)


def kv_value_bytes(kv_bits: int | None, item: int) -> float:
    """Bytes a KV cache of ``kv_bits`` (as :func:`load`'s) keeps per key or value element under a compute dtype of
    ``item`` bytes (a quantized cache: its bits plus a scale and a bias of the compute dtype per group of 64)."""
    if kv_bits is None:
        return item
    if kv_bits == HALF_KV_BITS:
        return min(item, 2)
    return kv_bits / 8 + 2 * item / 64
