"""NumPy helpers for MLX's affine quantization layout and the GGUF block formats that map onto it.

MLX's affine layout (``mx.quantize`` / ``mx.dequantize`` with ``mode="affine"``): a float matrix ``[rows, cols]`` is
cut into groups of ``group_size`` consecutive elements of a row; each group has a scale and a bias, and element ``j``
is ``scales[r, j // group_size] * q + biases[r, j // group_size]`` with ``q`` an unsigned ``bits``-bit integer stored
at bit ``bits * (j % (32 // bits))`` of the uint32 word ``weight[r, j // (32 // bits)]`` (lowest bits first; in bytes,
little-endian, element ``j`` of a 4-bit row is the low nibble of byte ``j // 2`` when ``j`` is even, the high nibble
when odd).

GGUF block formats (``ggml/src/ggml-common.h`` in llama.cpp; the ``gguf`` package's ``gguf.quants`` mirrors them):

- ``Q4_0``: 32 elements, ``{f16 d; u8 qs[16]}``; element ``i < 16`` is the low nibble of ``qs[i]``, element ``i + 16``
  the high nibble; value ``d * (q - 8)``. In MLX's layout: scale ``d``, bias ``-8 d``, 4 bits.
- ``Q4_1``: 32 elements, ``{f16 d; f16 m; u8 qs[16]}``, nibbles as Q4_0; value ``d * q + m``: scale ``d``, bias ``m``.
- ``Q8_0``: 32 elements, ``{f16 d; i8 qs[32]}``; value ``d * q``. In MLX's layout: ``q + 128`` as an unsigned byte,
  scale ``d``, bias ``-128 d``, 8 bits.

All three map without loss: ``d`` (an f16) times a 4- or 8-bit integer is exact in float32, and so is the sum with
the bias, so the float32 dequantization equals ``gguf.quants.dequantize`` exactly (up to the sign of zero for Q4_0
and Q8_0).

This module imports NumPy only (never ``mlx``).
"""

from __future__ import annotations

import numpy as np

from mlx_engine.weights.base import QuantizedArray

GROUP_SIZE = 32

#: numpy structured dtypes of one GGUF block (little-endian, packed)
Q4_0_BLOCK = np.dtype([("d", "<f2"), ("qs", "u1", (16,))])
Q4_1_BLOCK = np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (16,))])
Q8_0_BLOCK = np.dtype([("d", "<f2"), ("qs", "i1", (32,))])
Q8_K_BLOCK = np.dtype([("d", "<f4"), ("qs", "i1", (256,)), ("bsums", "<i2", (16,))])

# Rows processed per chunk so that temporaries stay around this many bytes.
_CHUNK_BYTES = 1 << 24


def _as_words(packed_bytes: np.ndarray) -> np.ndarray:
    """uint8 ``[rows, n]`` (``n`` a multiple of 4) -> uint32 ``[rows, n / 4]``, reading each 4 bytes little-endian."""
    words = np.ascontiguousarray(packed_bytes).view("<u4")
    return words if words.dtype == np.uint32 else words.astype(np.uint32)


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned integers ``[rows, cols]`` (each ``< 2**bits``) into MLX's uint32 words ``[rows, cols * bits / 32]``.

    ``bits`` is 2, 4 or 8; ``cols * bits`` must be a multiple of 32.
    """
    if bits not in (2, 4, 8):
        raise ValueError(f"bits must be 2, 4 or 8, not {bits}")
    q = np.asarray(q)
    if q.ndim != 2 or (q.shape[1] * bits) % 32:
        raise ValueError(f"cannot pack shape {q.shape} with {bits} bits")
    q8 = q.astype(np.uint8, copy=False)
    per_byte = 8 // bits
    if per_byte == 1:
        b = q8
    else:
        b = q8[:, 0::per_byte].copy()
        for k in range(1, per_byte):
            b |= q8[:, k::per_byte] << np.uint8(k * bits)
    return _as_words(b)


def unpack(weight: np.ndarray, bits: int) -> np.ndarray:
    """The inverse of :func:`pack`: uint32 ``[rows, w]`` -> uint8 ``[rows, w * 32 / bits]``."""
    per_word = 32 // bits
    shifts = np.arange(per_word, dtype=np.uint32) * np.uint32(bits)
    q = (weight[:, :, None] >> shifts) & np.uint32((1 << bits) - 1)
    return q.reshape(weight.shape[0], -1).astype(np.uint8)


def quantize_affine(w: np.ndarray, bits: int, group_size: int = GROUP_SIZE) -> QuantizedArray:
    """Quantize a float matrix ``[rows, cols]`` to MLX's affine layout, as ``mx.quantize(w, group_size, bits)`` does.

    The formula is MLX's (``mlx/backend/cpu/quantized.cpp``, ``quantize``; the same in ``mlx/ops.cpp``'s fallback),
    evaluated in float32: per group, ``n_bins = 2**bits - 1``, ``scale = max((w_max - w_min) / n_bins, 1e-7)``
    negated unless ``|w_min| > |w_max|``, ``edge`` the endpoint of larger magnitude, ``q0 = rint(edge / scale)``;
    when ``q0 != 0`` then ``scale = edge / q0`` and ``bias = edge``, else ``bias = 0``; ``q = clip(rint((w - bias) /
    scale), 0, n_bins)``. ``rint`` rounds half to even. The test suite checks bit equality with ``mx.quantize``.

    Args:
        w: float ``[rows, cols]``, ``cols`` a multiple of ``group_size``.
        bits: 2, 4 or 8.
        group_size: elements per scale and bias (32, 64 or 128 in MLX).

    Returns:
        a :class:`QuantizedArray` with float32 scales and biases ``[rows, cols / group_size]``.
    """
    w = np.asarray(w)
    if w.ndim != 2 or w.shape[1] % group_size:
        raise ValueError(f"cannot quantize shape {w.shape} with group size {group_size}")
    rows, cols = w.shape
    ng = cols // group_size
    weight = np.empty((rows, cols * bits // 32), np.uint32)
    scales = np.empty((rows, ng), np.float32)
    biases = np.empty((rows, ng), np.float32)
    n_bins = np.float32((1 << bits) - 1)
    eps = np.float32(1e-7)
    step = max(1, _CHUNK_BYTES // max(1, cols * 4))
    with np.errstate(all="ignore"):
        for r0 in range(0, rows, step):
            g = w[r0:r0 + step].astype(np.float32, copy=False).reshape(-1, ng, group_size)
            w_max = g.max(axis=-1)
            w_min = g.min(axis=-1)
            mask = np.abs(w_min) > np.abs(w_max)
            scale = np.maximum((w_max - w_min) / n_bins, eps)
            scale = np.where(mask, scale, -scale)
            edge = np.where(mask, w_min, w_max)
            q0 = np.rint(edge / scale)
            nonzero = q0 != 0
            scale = np.where(nonzero, edge / np.where(nonzero, q0, np.float32(1)), scale).astype(np.float32)
            bias = np.where(nonzero, edge, np.float32(0)).astype(np.float32)
            q = np.rint((g - bias[..., None]) / scale[..., None])
            q = np.clip(np.nan_to_num(q, nan=0.0), 0, n_bins).astype(np.uint8).reshape(g.shape[0], cols)
            weight[r0:r0 + step] = pack(q, bits)
            scales[r0:r0 + step] = scale
            biases[r0:r0 + step] = bias
    return QuantizedArray(weight, scales, biases, group_size, bits)


def _repack_q4_nibbles(qs: np.ndarray) -> np.ndarray:
    """GGUF Q4 nibbles ``[n_blocks, 16]`` (element ``i < 16`` low nibble of byte ``i``, ``i + 16`` high nibble of
    byte ``i``) -> MLX bytes ``[n_blocks, 16]`` (element ``2k`` low nibble of byte ``k``, ``2k + 1`` high nibble)."""
    even = qs[:, 0::2]
    odd = qs[:, 1::2]
    out = np.empty(qs.shape, np.uint8)
    np.bitwise_or(even & np.uint8(0x0F), (odd & np.uint8(0x0F)) << np.uint8(4), out=out[:, :8])
    np.bitwise_or(even >> np.uint8(4), odd & np.uint8(0xF0), out=out[:, 8:])
    return out


def repack_gguf(blocks: np.ndarray, type_name: str, rows: int, cols: int) -> QuantizedArray:
    """GGUF Q4_0 / Q4_1 / Q8_0 blocks -> a lossless :class:`QuantizedArray` ``[rows, cols]``, group size 32.

    Args:
        blocks: a 1-D array of ``rows * cols / 32`` blocks of the structured dtype :data:`Q4_0_BLOCK`,
            :data:`Q4_1_BLOCK` or :data:`Q8_0_BLOCK` (a view of the file is fine; it is not modified).
        type_name: ``"Q4_0"``, ``"Q4_1"`` or ``"Q8_0"``.
        rows, cols: the logical shape in NumPy order (``cols`` is GGUF's first dimension, a multiple of 32).
    """
    nb = cols // GROUP_SIZE
    bits = 8 if type_name == "Q8_0" else 4
    weight = np.empty((rows, cols * bits // 32), np.uint32)
    scales = np.empty((rows, nb), np.float32)
    biases = np.empty((rows, nb), np.float32)
    step = max(1, _CHUNK_BYTES // max(1, cols))
    with np.errstate(all="ignore"):
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            blk = blocks[r0 * nb:r1 * nb]
            d = blk["d"].astype(np.float32).reshape(r1 - r0, nb)
            scales[r0:r1] = d
            if type_name == "Q8_0":
                q = blk["qs"].view(np.uint8) ^ np.uint8(0x80)  # q + 128 (mod 256) for q in [-128, 127]
                weight[r0:r1] = _as_words(q.reshape(r1 - r0, nb * 32))
                biases[r0:r1] = np.float32(-128) * d
            else:
                q = _repack_q4_nibbles(blk["qs"])
                weight[r0:r1] = _as_words(q.reshape(r1 - r0, nb * 16))
                if type_name == "Q4_0":
                    biases[r0:r1] = np.float32(-8) * d
                else:
                    biases[r0:r1] = blk["m"].astype(np.float32).reshape(r1 - r0, nb)
    return QuantizedArray(weight, scales, biases, GROUP_SIZE, bits)


def dequantize_q8_k(blocks: np.ndarray) -> np.ndarray:
    """GGUF Q8_K blocks (``{f32 d; i8 qs[256]; i16 bsums[16]}``, value ``d * q``) -> float32 ``[n_blocks, 256]``.

    ``gguf.quants`` has no Q8_K dequantizer; this follows ``dequantize_row_q8_K`` in ggml-quants.c.
    """
    with np.errstate(all="ignore"):
        return blocks["qs"].astype(np.float32) * blocks["d"].astype(np.float32)[:, None]


def bf16_to_float32(raw: np.ndarray) -> np.ndarray:
    """bfloat16 stored as little-endian uint16 (any shape) -> float32 of the same shape (exact)."""
    return (raw.astype("<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)


def _fp8_e4m3fn_table() -> np.ndarray:
    b = np.arange(256, dtype=np.uint32)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e = (b >> 3) & 0xF
    m = (b & 0x7).astype(np.float64)
    val = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e.astype(np.float64) - 7))
    val = sign * val
    val[(b & 0x7F) == 0x7F] = np.nan  # E4M3FN: no infinities, S.1111.111 is NaN
    return val.astype(np.float32)


FP8_E4M3FN_TABLE = _fp8_e4m3fn_table()


def fp8_e4m3fn_to_float32(raw: np.ndarray) -> np.ndarray:
    """OCP FP8 E4M3FN (bias 7, no infinities, 0x7F/0xFF NaN) bytes -> float32 (exact)."""
    return FP8_E4M3FN_TABLE[raw.view(np.uint8)]


def fp8_e5m2_to_float32(raw: np.ndarray) -> np.ndarray:
    """OCP FP8 E5M2 bytes -> float32 (exact: E5M2 is the high byte of an IEEE float16)."""
    return (raw.view(np.uint8).astype("<u2") << np.uint16(8)).view("<f2").astype(np.float32)


def fp8_e8m0_to_float32(raw: np.ndarray) -> np.ndarray:
    """OCP E8M0 scale bytes (``2**(x - 127)``, 0xFF NaN) -> float32 (exact; 0x00 is 2**-127, a subnormal)."""
    x = raw.view(np.uint8)
    with np.errstate(all="ignore"):
        out = np.ldexp(np.float32(1), x.astype(np.int32) - 127).astype(np.float32)
    out[x == 0xFF] = np.nan
    return out
