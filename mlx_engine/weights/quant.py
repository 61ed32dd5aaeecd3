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

- ``Q5_0``: 32 elements, ``{f16 d; u32 qh; u8 qs[16]}``; element ``i`` takes its low 4 bits from the nibbles as in
  Q4_0 and its fifth bit from bit ``i`` of ``qh``; value ``d * (q - 16)``: scale ``d``, bias ``-16 d``, 5 bits.
- ``Q5_1``: ``{f16 d; f16 m; u32 qh; u8 qs[16]}``, bits as Q5_0, value ``d * q + m``.
- ``Q4_K``: 256 elements, ``{f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}``: eight sub-blocks of 32 with 6-bit
  scales ``sc`` and mins ``m`` packed in ``scales`` (``get_scale_min_k4``); sub-block ``2i`` is the low nibbles of
  ``qs[32i:32i+32]``, ``2i + 1`` the high nibbles; value ``d * sc * q - dmin * m``: scale ``d * sc``, bias
  ``-dmin * m``, 4 bits.
- ``Q5_K``: ``{f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}``: as Q4_K, plus a fifth bit for sub-block
  ``j`` from bit ``j`` of ``qh[l]``; 5 bits.

- ``Q6_K``: 256 elements, ``{u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}``: per half of 128 elements (``ql`` 64
  bytes, ``qh`` 32 apart), element ``32k + l`` takes its low 4 bits from ``ql[l + 32 (k & 1)]`` (the low nibble for
  ``k < 2``, else the high one) and bits 4-5 from ``qh[l] >> 2k``; value ``d * scales[j // 16] * (q - 32)``: groups
  of 16, int8 scales, symmetric, 6 bits.
- ``Q3_K``: 256 elements, ``{u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d}``: sixteen 6-bit scales ``sc`` packed in
  ``scales``; per half (``qs`` 32 bytes apart), element ``32k + l`` takes bits ``2k, 2k + 1`` of ``qs[l]`` and its
  third bit from bit ``4 h + k`` of ``hmask[l]``; value ``d * (sc - 32) * (q - 4)``: groups of 16, symmetric, 3 bits.
- ``Q2_K``: 256 elements, ``{u8 scales[16]; u8 qs[64]; f16 d; f16 dmin}``: ``scales[j // 16]`` holds ``sc`` (low
  nibble) and ``m`` (high); per half, element ``32k + l`` is bits ``2k, 2k + 1`` of ``qs[l]``; value
  ``d * sc * q - dmin * m``: groups of 16, 2 bits.

- ``IQ4_NL``: 32 elements, ``{f16 d; u8 qs[16]}``, nibbles as Q4_0; value ``d * kvalues[q]`` with ``kvalues`` the
  16 int8 levels of :data:`IQ4_NL_VALUES` (``kvalues_iq4nl``): a codebook, not an affine grid.
- ``IQ4_XS``: 256 elements, ``{f16 d; u16 scales_h; u8 scales_l[4]; u8 qs[128]}``: eight sub-blocks of 32, each
  with a 6-bit scale ``ls`` (low 4 bits from nibble ``j`` of ``scales_l``, high 2 from bits ``2j`` of ``scales_h``)
  and 16 bytes of nibbles as Q4_0; value ``d * (ls - 32) * kvalues[q]``.
- ``MXFP4``: 32 elements, ``{u8 e; u8 qs[16]}``, nibbles as Q4_0; value ``2**(e - 128) * kvalues[q]`` with
  ``kvalues`` the FP4 (E2M1) levels doubled (:data:`MXFP4_VALUES`, ``kvalues_mxfp4``; ``ggml_e8m0_to_fp32_half``
  gives the halved E8M0 scale): the OCP microscaling format, gpt-oss's experts.

All of the affine ones map without loss onto group-32 affine: a scale and a bias per 32 elements, each the product of an f16
and an integer of at most 6 bits, exact in float32, and ``scale * q`` (at most 17 + 5 significant bits) is exact too,
so the float32 dequantization equals ``gguf.quants.dequantize`` exactly (up to the sign of zero). Scales and biases are
stored as float16 where every one of them is exactly a float16 (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, barring overflow),
else float32 (:func:`compact_scales` decides); the K-quants' keep their two levels (6-bit integers, and an f16 ``d``
and ``dmin`` per 256 elements: :class:`QuantizedArray`'s ``super_scales``), 4.625 bits per Q4_K element where
float32 scales and biases took 6. The 16-element sub-block types (Q6_K, Q3_K, Q2_K) have no exact form with MLX's
smallest group of 32; they keep their two levels too, with groups of 16 (a Q6_K weight in its file's 6.5625 bits per
element), which our CPU kernels run; elsewhere the backend re-quantizes them (:func:`regroup`).

Bits other than 2, 4 and 8 (3, 5, 6) pack as MLX packs them: a little-endian bitstream, element ``j`` at bit
``j * bits`` of the row's bytes (the 2-, 4- and 8-bit word layout above is the same stream).

The three codebook types keep their 4-bit integers and the file's scales (two levels for IQ4_XS: ``ls - 32`` as int8
and ``d`` per 256; MXFP4's powers of two as float16 where all are exact, else float32), with
:class:`QuantizedArray`'s ``codebook``: our CPU kernels look IQ4's integers up (4.25 and 4.5 bits per element, the
files' own); elsewhere, and for MXFP4 everywhere, :func:`codebook_to_affine` makes them 8-bit affine without loss
(the levels plus 128 as bytes, zero point 128).

This module imports NumPy only (never ``mlx``).
"""

from __future__ import annotations

import numpy as np

from mlx_engine.weights.base import QuantizedArray, unpack

__all__ = [
    "GROUP_SIZE", "BITS", "BLOCKS", "REPACK_BITS", "SUBBLOCK_TYPES", "Q4_0_BLOCK", "Q4_1_BLOCK", "Q8_0_BLOCK",
    "Q8_K_BLOCK", "Q5_0_BLOCK", "IQ4_NL_BLOCK", "IQ4_XS_BLOCK", "IQ4_NL_VALUES", "MXFP4_VALUES", "CODEBOOK_TYPES",
    "codebook_to_affine", "Q5_1_BLOCK", "Q4_K_BLOCK", "Q5_K_BLOCK", "Q6_K_BLOCK", "Q3_K_BLOCK", "Q2_K_BLOCK",
    "FP8_E4M3FN_TABLE", "unpack", "pack", "compact_scales", "quantize_affine", "regroup", "repack_gguf",
    "dequantize_q8_k",
    "bf16_to_float32", "fp8_e4m3fn_to_float32", "fp8_e5m2_to_float32", "fp8_e8m0_to_float32",
]

GROUP_SIZE = 32

#: numpy structured dtypes of one GGUF block (little-endian, packed)
Q4_0_BLOCK = np.dtype([("d", "<f2"), ("qs", "u1", (16,))])
Q4_1_BLOCK = np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (16,))])
Q8_0_BLOCK = np.dtype([("d", "<f2"), ("qs", "i1", (32,))])
Q8_K_BLOCK = np.dtype([("d", "<f4"), ("qs", "i1", (256,)), ("bsums", "<i2", (16,))])
Q5_0_BLOCK = np.dtype([("d", "<f2"), ("qh", "<u4"), ("qs", "u1", (16,))])
Q5_1_BLOCK = np.dtype([("d", "<f2"), ("m", "<f2"), ("qh", "<u4"), ("qs", "u1", (16,))])
Q4_K_BLOCK = np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", (12,)), ("qs", "u1", (128,))])
Q5_K_BLOCK = np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", (12,)), ("qh", "u1", (32,)),
                       ("qs", "u1", (128,))])
Q6_K_BLOCK = np.dtype([("ql", "u1", (128,)), ("qh", "u1", (64,)), ("scales", "i1", (16,)), ("d", "<f2")])
Q3_K_BLOCK = np.dtype([("hmask", "u1", (32,)), ("qs", "u1", (64,)), ("scales", "u1", (12,)), ("d", "<f2")])
Q2_K_BLOCK = np.dtype([("scales", "u1", (16,)), ("qs", "u1", (64,)), ("d", "<f2"), ("dmin", "<f2")])
IQ4_NL_BLOCK = np.dtype([("d", "<f2"), ("qs", "u1", (16,))])
IQ4_XS_BLOCK = np.dtype([("d", "<f2"), ("scales_h", "<u2"), ("scales_l", "u1", (4,)), ("qs", "u1", (128,))])
MXFP4_BLOCK = np.dtype([("e", "u1"), ("qs", "u1", (16,))])

#: IQ4_NL's and IQ4_XS's 16 levels (``kvalues_iq4nl`` in llama.cpp's ggml-common.h)
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
#: MXFP4's 16 levels: the E2M1 values times 2 (``kvalues_mxfp4`` in ggml-common.h)
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)

#: GGUF types that map onto MLX's affine layout without loss, and the bits they take there.
REPACK_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8, "Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6, "Q3_K": 3,
               "Q2_K": 2, "IQ4_NL": 4, "IQ4_XS": 4, "MXFP4": 4}
#: those of them with 16-element sub-blocks (group size 16)
SUBBLOCK_TYPES = frozenset({"Q6_K", "Q3_K", "Q2_K"})
#: those whose integers index a codebook (:data:`IQ4_NL_VALUES`, :data:`MXFP4_VALUES`)
CODEBOOK_TYPES = frozenset({"IQ4_NL", "IQ4_XS", "MXFP4"})
#: their block dtypes
BLOCKS = {"Q4_0": Q4_0_BLOCK, "Q4_1": Q4_1_BLOCK, "Q8_0": Q8_0_BLOCK, "Q5_0": Q5_0_BLOCK, "Q5_1": Q5_1_BLOCK,
          "Q4_K": Q4_K_BLOCK, "Q5_K": Q5_K_BLOCK, "Q6_K": Q6_K_BLOCK, "Q3_K": Q3_K_BLOCK, "Q2_K": Q2_K_BLOCK,
          "IQ4_NL": IQ4_NL_BLOCK, "IQ4_XS": IQ4_XS_BLOCK, "MXFP4": MXFP4_BLOCK}

# Rows processed per chunk so that temporaries stay around this many bytes.
_CHUNK_BYTES = 1 << 24


def _as_words(packed_bytes: np.ndarray) -> np.ndarray:
    """uint8 ``[rows, n]`` (``n`` a multiple of 4) -> uint32 ``[rows, n / 4]``, reading each 4 bytes little-endian."""
    words = np.ascontiguousarray(packed_bytes).view("<u4")
    return words if words.dtype == np.uint32 else words.astype(np.uint32)


BITS = (2, 3, 4, 5, 6, 8)


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned integers ``[rows, cols]`` (each ``< 2**bits``) into MLX's uint32 words ``[rows, cols * bits / 32]``.

    ``bits`` is 2, 3, 4, 5, 6 or 8; ``cols * bits`` must be a multiple of 32 (``cols`` a multiple of 32 for 3, 5, 6).
    """
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, not {bits}")
    q = np.asarray(q)
    if q.ndim != 2 or (q.shape[1] * bits) % 32 or (bits in (3, 5, 6) and q.shape[1] % 32):
        raise ValueError(f"cannot pack shape {q.shape} with {bits} bits")
    q8 = q.astype(np.uint8, copy=False)
    if bits in (3, 5, 6):
        rows, cols = q8.shape
        lanes = q8.reshape(rows, cols // 8, 8).astype(np.uint64)
        v = np.bitwise_or.reduce(lanes << (np.arange(8, dtype=np.uint64) * np.uint64(bits)), axis=-1)
        b = v.astype("<u8").view(np.uint8).reshape(rows, cols // 8, 8)[:, :, :bits].reshape(rows, cols * bits // 8)
        return _as_words(b)
    per_byte = 8 // bits
    if per_byte == 1:
        b = q8
    else:
        b = q8[:, 0::per_byte].copy()
        for k in range(1, per_byte):
            b |= q8[:, k::per_byte] << np.uint8(k * bits)
    return _as_words(b)


def compact_scales(qa: QuantizedArray) -> QuantizedArray:
    """``qa`` with float16 scales and biases when every one of them is exactly a float16 (then nothing changes in
    the values, and a 4-bit weight takes 5 bits per element instead of 6); else ``qa`` itself."""
    with np.errstate(all="ignore"):
        s16, b16 = qa.scales.astype(np.float16), qa.biases.astype(np.float16)
        exact = (np.array_equal(s16.astype(np.float32), qa.scales, equal_nan=True)
                 and np.array_equal(b16.astype(np.float32), qa.biases, equal_nan=True))
    return QuantizedArray(qa.weight, s16, b16, qa.group_size, qa.bits) if exact else qa


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


def regroup(qa: QuantizedArray, bits: int) -> QuantizedArray:
    """A weight with groups of 16 (which MLX's own kernels do not take) re-quantized to ``bits`` (4 or 8) in groups of
    32 by :func:`quantize_affine` (MLX's formula) from its exact values; ``qa`` itself for other group sizes."""
    if qa.group_size != 16:
        return qa
    lead = qa.weight.shape[:-2]
    out = quantize_affine(qa.dequantize().reshape(-1, qa.shape[-1]), bits, GROUP_SIZE)
    return out.stacked(lead) if lead else out


def codebook_to_affine(qa: QuantizedArray) -> QuantizedArray:
    """A codebook weight (IQ4_NL, IQ4_XS) as 8-bit affine without loss, for MLX's kernels: each integer ``q`` becomes
    the byte ``codebook[q] + 128``, with one scale per group of 32 and bias ``-128 * scale`` (so each element is
    ``scale * codebook[q]``, one rounding, as in the file's dequantization); float16 scales and biases where exact.
    ``qa`` itself if it has no codebook."""
    if qa.codebook is None:
        return qa
    lead, cols = qa.weight.shape[:-2], qa.shape[-1]
    flat = qa.expanded()
    levels = (qa.codebook.astype(np.int16) + 128).astype(np.uint8)
    weight = flat.weight.reshape(-1, flat.weight.shape[-1])
    out = np.empty((weight.shape[0], cols // 4), np.uint32)
    step = max(1, _CHUNK_BYTES // max(1, cols))
    for r0 in range(0, weight.shape[0], step):
        out[r0:r0 + step] = pack(levels[unpack(weight[r0:r0 + step], 4)], 8)
    s = flat.scales.reshape(-1, flat.scales.shape[-1]).astype(np.float32)
    with np.errstate(all="ignore"):
        result = compact_scales(QuantizedArray(out, s, s * np.float32(-128), GROUP_SIZE, 8))
    return result.stacked(lead) if lead else result


def _repack_q4_nibbles(qs: np.ndarray) -> np.ndarray:
    """GGUF Q4 nibbles ``[n_blocks, 16]`` (element ``i < 16`` low nibble of byte ``i``, ``i + 16`` high nibble of
    byte ``i``) -> MLX bytes ``[n_blocks, 16]`` (element ``2k`` low nibble of byte ``k``, ``2k + 1`` high nibble)."""
    even = qs[:, 0::2]
    odd = qs[:, 1::2]
    out = np.empty(qs.shape, np.uint8)
    np.bitwise_or(even & np.uint8(0x0F), (odd & np.uint8(0x0F)) << np.uint8(4), out=out[:, :8])
    np.bitwise_or(even >> np.uint8(4), odd & np.uint8(0xF0), out=out[:, 8:])
    return out


def _q5_high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1 ``qh`` (uint32 per block) -> the fifth bit of each of the 32 elements, times 16, uint8 ``[n, 32]``."""
    return (((qh[:, None] >> np.arange(32, dtype=np.uint32)) & np.uint32(1)) << np.uint32(4)).astype(np.uint8)


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K packed ``scales[12]`` ``[n, 12]`` -> 6-bit scales and mins ``[n, 8]`` (``get_scale_min_k4``)."""
    sc = np.empty((raw.shape[0], 8), np.uint8)
    mn = np.empty((raw.shape[0], 8), np.uint8)
    sc[:, :4] = raw[:, 0:4] & 63
    mn[:, :4] = raw[:, 4:8] & 63
    sc[:, 4:] = (raw[:, 8:12] & 0xF) | ((raw[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (raw[:, 8:12] >> 4) | ((raw[:, 4:8] >> 6) << 4)
    return sc, mn


def _k_quants(blk: np.ndarray, type_name: str) -> np.ndarray:
    """Q4_K / Q5_K blocks -> their integers ``q`` uint8 ``[n, 256]`` in element order."""
    qs = blk["qs"].reshape(-1, 4, 32)
    q = np.stack([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=2)  # [n, 4, 2, 32]: sub-blocks 2i, 2i + 1
    if type_name == "Q5_K":
        shift = np.arange(8, dtype=np.uint8).reshape(4, 2)
        q |= ((blk["qh"][:, None, None, :] >> shift[None, :, :, None]) & np.uint8(1)) << np.uint8(4)
    return q.reshape(-1, 256)


def _sub_block_quants(blk: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray, "np.ndarray | None",
                                                                   np.ndarray]:
    """Q6_K, Q3_K or Q2_K blocks -> (their integers ``q`` uint8 ``[n, 256]`` in element order, scales ``[n, 16]``
    (int8 for Q6_K and Q3_K, uint8 for Q2_K), Q2_K's mins uint8 ``[n, 16]`` or None, super scales float16
    ``[n, 1]`` (``d``) or ``[n, 2]`` (``d, -dmin``)); ``dequantize_row_q6_K`` / ``_q3_K`` / ``_q2_K`` in
    llama.cpp's ggml-quants.c."""
    n = blk.shape[0]
    k = np.arange(4, dtype=np.uint8)
    if type_name == "Q6_K":
        ql = blk["ql"].reshape(n, 2, 2, 32)  # [n, half, k & 1, l]
        low = np.stack([ql & np.uint8(0x0F), ql >> np.uint8(4)], axis=2).reshape(n, 2, 4, 32)  # k = 2 nibble + (k & 1)
        high = (blk["qh"].reshape(n, 2, 1, 32) >> (2 * k)[None, None, :, None]) & np.uint8(3)
        return (low | (high << np.uint8(4))).reshape(n, 256), blk["scales"], None, blk["d"][:, None]
    two = (blk["qs"].reshape(n, 2, 1, 32) >> (2 * k)[None, None, :, None]) & np.uint8(3)  # [n, half, k, l]
    if type_name == "Q3_K":
        bit = np.arange(8, dtype=np.uint8).reshape(2, 4)  # hmask bit 4 half + k
        third = (blk["hmask"][:, None, None, :] >> bit[None, :, :, None]) & np.uint8(1)
        raw = blk["scales"]
        lo, hi = raw[:, 0:8], raw[:, 8:12]
        sc = np.empty((n, 16), np.uint8)
        sc[:, 0:4] = (lo[:, 0:4] & 0xF) | ((hi & 3) << 4)
        sc[:, 4:8] = (lo[:, 4:8] & 0xF) | (((hi >> 2) & 3) << 4)
        sc[:, 8:12] = (lo[:, 0:4] >> 4) | (((hi >> 4) & 3) << 4)
        sc[:, 12:16] = (lo[:, 4:8] >> 4) | (((hi >> 6) & 3) << 4)
        signed = (sc.astype(np.int16) - 32).astype(np.int8)
        return (two | (third << np.uint8(2))).reshape(n, 256), signed, None, blk["d"][:, None]
    sup = np.stack([blk["d"], -blk["dmin"]], axis=-1)  # (a sign flip: exact)
    return two.reshape(n, 256), blk["scales"] & np.uint8(0x0F), blk["scales"] >> np.uint8(4), sup


def _decode(blk: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_0, Q4_1, Q5_0 or Q5_1 blocks -> (``q`` uint8 ``[n, 32]`` in element order, scales and biases float32
    ``[n, 1]``)."""
    d = blk["d"].astype(np.float32)
    qs = blk["qs"]
    q = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1)
    if type_name in ("Q5_0", "Q5_1"):
        q |= _q5_high_bits(blk["qh"].astype(np.uint32))
    if type_name in ("Q4_1", "Q5_1"):
        bias = blk["m"].astype(np.float32)
    else:
        bias = np.float32(-8 if type_name == "Q4_0" else -16) * d
    return q, d[:, None], bias[:, None]


def repack_gguf(blocks: np.ndarray, type_name: str, rows: int, cols: int) -> QuantizedArray:
    """GGUF blocks of a type in :data:`REPACK_BITS` -> a lossless :class:`QuantizedArray` ``[rows, cols]``, group size
    32, with float16 scales and biases where they are exact (:func:`compact_scales`), two-level ones for Q4_K and
    Q5_K (``super_scales``); group size 16 and two-level scales for Q6_K, Q3_K and Q2_K.

    Args:
        blocks: a 1-D array of the type's blocks, of its structured dtype in :data:`BLOCKS` (a view of the file is
            fine; it is not modified).
        type_name: a key of :data:`REPACK_BITS`.
        rows, cols: the logical shape in NumPy order (``cols`` is GGUF's first dimension, a multiple of the block).
    """
    bits = REPACK_BITS[type_name]
    if type_name in SUBBLOCK_TYPES:
        return _repack_sub_blocks(blocks, type_name, rows, cols)
    if type_name in CODEBOOK_TYPES:
        return _repack_codebook(blocks, type_name, rows, cols)
    k_quant = type_name.endswith("_K")
    block_elems = 256 if k_quant else GROUP_SIZE
    nb = cols // block_elems
    ng = cols // GROUP_SIZE
    weight = np.empty((rows, cols * bits // 32), np.uint32)
    # a K-quant's scales as the file holds them (two levels: 6-bit integers, and f16 per 256 elements)
    scales = np.empty((rows, ng), np.uint8 if k_quant else np.float32)
    biases = np.empty((rows, ng), np.uint8 if k_quant else np.float32)
    supers = np.empty((rows, nb, 2), np.float16) if k_quant else None
    step = max(1, _CHUNK_BYTES // max(1, cols))
    with np.errstate(all="ignore"):
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            blk = blocks[r0 * nb:r1 * nb]
            if k_quant:
                q = _k_quants(blk, type_name)
                weight[r0:r1] = pack(q.reshape(r1 - r0, cols), bits)
                sc, mn = _k_scales(blk["scales"])
                scales[r0:r1], biases[r0:r1] = sc.reshape(r1 - r0, ng), mn.reshape(r1 - r0, ng)
                supers[r0:r1, :, 0] = blk["d"].reshape(r1 - r0, nb)
                supers[r0:r1, :, 1] = -blk["dmin"].reshape(r1 - r0, nb)  # (a sign flip: exact)
                continue
            if type_name == "Q8_0":
                d = blk["d"].astype(np.float32).reshape(r1 - r0, nb)
                q = blk["qs"].view(np.uint8) ^ np.uint8(0x80)  # q + 128 (mod 256) for q in [-128, 127]
                weight[r0:r1] = _as_words(q.reshape(r1 - r0, nb * 32))
                scales[r0:r1] = d
                biases[r0:r1] = np.float32(-128) * d
                continue
            if type_name in ("Q4_0", "Q4_1"):  # nibbles regrouped without unpacking
                weight[r0:r1] = _as_words(_repack_q4_nibbles(blk["qs"]).reshape(r1 - r0, nb * 16))
                d = blk["d"].astype(np.float32)
                scales[r0:r1] = d.reshape(r1 - r0, nb)
                bias = blk["m"].astype(np.float32) if type_name == "Q4_1" else np.float32(-8) * d
                biases[r0:r1] = bias.reshape(r1 - r0, nb)
                continue
            q, s, b = _decode(blk, type_name)
            weight[r0:r1] = pack(q.reshape(r1 - r0, cols), bits)
            scales[r0:r1] = s.reshape(r1 - r0, ng)
            biases[r0:r1] = b.reshape(r1 - r0, ng)
    if k_quant:
        return QuantizedArray(weight, scales, biases, GROUP_SIZE, bits, supers)
    return compact_scales(QuantizedArray(weight, scales, biases, GROUP_SIZE, bits))


def _repack_sub_blocks(blocks: np.ndarray, type_name: str, rows: int, cols: int) -> QuantizedArray:
    """Q6_K, Q3_K or Q2_K blocks -> a lossless :class:`QuantizedArray` with groups of 16 and the file's two levels of
    scales (see :func:`repack_gguf`)."""
    bits = REPACK_BITS[type_name]
    nb, ng = cols // 256, cols // 16
    weight = np.empty((rows, cols * bits // 32), np.uint32)
    signed = type_name != "Q2_K"
    scales = np.empty((rows, ng), np.int8 if signed else np.uint8)
    biases = None if signed else np.empty((rows, ng), np.uint8)
    supers = np.empty((rows, nb, 1 if signed else 2), np.float16)
    step = max(1, _CHUNK_BYTES // max(1, cols))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        q, sc, mn, sup = _sub_block_quants(blocks[r0 * nb:r1 * nb], type_name)
        weight[r0:r1] = pack(q.reshape(r1 - r0, cols), bits)
        scales[r0:r1] = sc.reshape(r1 - r0, ng)
        if biases is not None:
            biases[r0:r1] = mn.reshape(r1 - r0, ng)
        supers[r0:r1] = sup.reshape(r1 - r0, nb, -1)
    return QuantizedArray(weight, scales, biases, 16, bits, supers)


def _repack_codebook(blocks: np.ndarray, type_name: str, rows: int, cols: int) -> QuantizedArray:
    """IQ4_NL or IQ4_XS blocks -> a lossless :class:`QuantizedArray` with :data:`IQ4_NL_VALUES` as its codebook:
    the nibbles in MLX's order, IQ4_NL's ``d`` as float16 scales, IQ4_XS's ``ls - 32`` as int8 scales under ``d``
    per 256 elements (``dequantize_row_iq4_nl`` / ``_iq4_xs`` in llama.cpp's ggml-quants.c); MXFP4 blocks with
    :data:`MXFP4_VALUES` and ``2**(e - 128)`` as scales (``dequantize_row_mxfp4``)."""
    if type_name == "MXFP4":
        return _repack_mxfp4(blocks, rows, cols)
    xs = type_name == "IQ4_XS"
    nb = cols // (256 if xs else GROUP_SIZE)
    ng = cols // GROUP_SIZE
    weight = np.empty((rows, cols // 8), np.uint32)
    scales = np.empty((rows, ng), np.int8 if xs else np.float16)
    supers = np.empty((rows, nb, 1), np.float16) if xs else None
    step = max(1, _CHUNK_BYTES // max(1, cols))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        blk = blocks[r0 * nb:r1 * nb]
        weight[r0:r1] = _as_words(_repack_q4_nibbles(blk["qs"].reshape(-1, 16)).reshape(r1 - r0, cols // 2))
        if not xs:
            scales[r0:r1] = blk["d"].reshape(r1 - r0, nb)
            continue
        j = np.arange(8)
        low = (blk["scales_l"][:, j // 2] >> (4 * (j % 2)).astype(np.uint8)) & np.uint8(0x0F)
        high = ((blk["scales_h"][:, None] >> (2 * j).astype(np.uint16)) & np.uint16(3)).astype(np.uint8)
        scales[r0:r1] = ((low | (high << np.uint8(4))).astype(np.int16) - 32).astype(np.int8).reshape(r1 - r0, ng)
        supers[r0:r1, :, 0] = blk["d"].reshape(r1 - r0, nb)
    return QuantizedArray(weight, scales, None, GROUP_SIZE, 4, supers, codebook=IQ4_NL_VALUES)


def _repack_mxfp4(blocks: np.ndarray, rows: int, cols: int) -> QuantizedArray:
    """MXFP4 blocks -> a lossless codebook :class:`QuantizedArray`: the nibbles in MLX's order, the E8M0 exponents
    as the scales ``2**(e - 128)`` (float16 when every one is a float16: ``e`` from 104 to 143, else float32, exact
    for every ``e``)."""
    ng = cols // GROUP_SIZE
    weight = np.empty((rows, cols // 8), np.uint32)
    exps = np.empty((rows, ng), np.uint8)
    step = max(1, _CHUNK_BYTES // max(1, cols))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        blk = blocks[r0 * ng:r1 * ng]
        weight[r0:r1] = _as_words(_repack_q4_nibbles(blk["qs"].reshape(-1, 16)).reshape(r1 - r0, cols // 2))
        exps[r0:r1] = blk["e"].reshape(r1 - r0, ng)
    small = exps.size == 0 or (104 <= int(exps.min()) and int(exps.max()) <= 143)
    scales = np.ldexp(np.float32(1.0), exps.astype(np.int32) - 128).astype(np.float16 if small else np.float32)
    return QuantizedArray(weight, scales, None, GROUP_SIZE, 4, codebook=MXFP4_VALUES)


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
