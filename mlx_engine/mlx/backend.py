"""The MLX ``Backend`` and ``Context``."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from mlx_engine.errors import InvalidRequestError, UnsupportedError
from mlx_engine.ml import ACTIVATIONS, Backend, CacheConfig, Context, DType, RopeAngles
from mlx_engine.mlx import cpu_kernels, runtime
from mlx_engine.mlx.runtime import blas_description, mx, select_device
from mlx_engine.mlx.tensor import TO_MX, MLXQuantizedTensor, MLXTensor
from mlx_engine.weights import QuantizedArray, open_weights
from mlx_engine.weights.quant import IQ4_NL_VALUES, codebook_to_affine, regroup


ATTENTION_BLOCK = 256
"""Queries per block when attention skips hidden key blocks (see :meth:`MLXContext.attention_mask`)."""

PREFILL_BLOCK = 64
"""Queries per call of our attention kernel in a prefill on the CPU (:func:`_kernel_blocks_attention`): each block
reads only the keys its queries see. 64 was the fastest of 8 to 128 on smollm2's prefill
(docs/internals/cpu-kernels.md)."""

ATTENTION_SPLIT = 1 << 20
"""From this many query-key pairs on (``[L, S]``), attention runs in blocks of queries even where they hide few keys:
the score matrix of a whole chunk (a prompt's second chunk of 1024 tokens over 2048 keys, smollm2's 9 heads: 75 MB)
had set a long prompt's peak memory."""


class MLXMask(MLXTensor):
    """An additive attention mask ``[L, S]`` that also knows which keys its queries can see.

    ``blocks`` lists ``(q0, q1, k0, k1, all_visible)``: queries ``q0 .. q1-1`` see no key outside ``k0 .. k1-1``, and
    with ``all_visible`` they see every key in it (no mask needed there). ``runs``, for one query (a decode step),
    lists the ``(k0, k1)`` runs of keys it sees, all of them. Each is ``None`` when it would not pay. ``spans``: for
    each query, the first key it sees and one past the last (int64 ``[L]`` each; ``0, 0`` where it sees none), or None.
    """

    __slots__ = ("blocks", "runs", "spans")

    def __init__(self, a: "mx.array", blocks: "list[tuple[int, int, int, int, bool]] | None",
                 runs: "list[tuple[int, int]] | None" = None,
                 spans: "tuple[np.ndarray, np.ndarray] | None" = None):
        super().__init__(a)
        self.blocks = blocks
        self.runs = runs
        self.spans = spans


def _softcapped_attention(q: "mx.array", k: "mx.array", v: "mx.array", scale: float, cap: float,
                          mask: "mx.array | str | None") -> "mx.array":
    """Attention with Gemma 2's score soft-capping, ``cap * tanh(s / cap)`` on the scaled scores before the mask and
    the softmax (transformers' ``eager_attention_forward`` in ``modeling_gemma2.py``); no fused kernel takes the cap.
    Shapes as :meth:`Context.scaled_dot_product_attention`; the softmax in float32."""
    b, hq, n, d = q.shape
    hkv, keys = k.shape[1], k.shape[2]
    s = (q * scale).reshape(b, hkv, hq // hkv, n, d) @ k[:, :, None].swapaxes(-1, -2)  # [B, Hkv, G, L, S]
    s = mx.tanh(s.astype(mx.float32) / cap) * cap
    if isinstance(mask, str):  # "causal": query i sees keys 0..S-L+i
        s = mx.where(mx.arange(keys)[None] <= mx.arange(n)[:, None] + (keys - n), s, -mx.inf)
    elif mask is not None:
        if mask.ndim == 4:  # [B or 1, Hq or 1, L, S]
            mask = mask[:, :, None] if mask.shape[1] == 1 else mask.reshape(mask.shape[0], hkv, hq // hkv, n, keys)
        s = s + mask.astype(mx.float32)
    p = mx.softmax(s, axis=-1).astype(v.dtype)
    return (p @ v[:, :, None]).reshape(b, hq, n, d)


def _visible_spans(visible: np.ndarray) -> "tuple[np.ndarray, np.ndarray]":
    """Per query row of ``visible [L, S]``: its first visible key and one past its last (``0, 0``: none)."""
    seen = visible.any(axis=1)
    first = np.where(seen, visible.argmax(axis=1), 0)
    end = np.where(seen, visible.shape[1] - visible[:, ::-1].argmax(axis=1), 0)
    return first, end


def _visible_runs(row: np.ndarray, most: int = 4) -> "list[tuple[int, int]] | None":
    """The runs ``(k0, k1)`` of True in ``row``: one or two, or at most ``most`` that hold under 80% of it (a
    sliding-window cache whose ring wrapped: the window's cells lie in two runs of a larger used range). One or two
    runs are always read alone, as the KV cache's fused decode attention reads them (the same keys in the same
    order, so the same bits)."""
    s = len(row)
    count = int(np.count_nonzero(row))
    if count == 0:
        return None
    edges = np.flatnonzero(np.diff(np.concatenate(([False], row, [False])).astype(np.int8)))
    if len(edges) > 2 * most or (len(edges) > 4 and count >= 0.8 * s):
        return None
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def _attend_in_graph(q, k, v, keys, values, cells, scale, mask):
    """``Context.cached_attention`` for rotated ``q [1, H, 1, D]`` and ``k`` as MLX operations that read the cells
    from the ``cells`` array (a slice update at ``start``, attention over every stored cell with ``[lo, hi)`` and
    ``[lo2, hi2)`` visible), so that a decode step traced whole serves every position on any device (Metal, CUDA, or
    a CPU without our kernels). It reads all ``C`` stored cells, not only the visible ones: a GPU's step is bound by
    its launches, not by those bytes. ``(o, keys', values')``, or None for several queries or a mask (those go apart)."""
    if mask is not None or q.ndim != 4 or q.shape[2] != 1 or keys.dtype != values.dtype:
        return None
    start = cells[:1]
    keys = mx.slice_update(keys, k.astype(keys.dtype), start, axes=(2,))
    values = mx.slice_update(values, v.astype(values.dtype), start, axes=(2,))
    at = mx.arange(keys.shape[2], dtype=mx.int32)
    seen = ((at >= cells[1]) & (at < cells[2])) | ((at >= cells[3]) & (at < cells[4]))
    m = mx.where(seen, 0.0, -mx.inf).astype(q.dtype)[None]
    o = mx.fast.scaled_dot_product_attention(q, keys.astype(q.dtype), values.astype(q.dtype), scale=scale, mask=m)
    return MLXTensor(o), MLXTensor(keys), MLXTensor(values)


def _attention_blocks(visible: np.ndarray, block: int) -> "list[tuple[int, int, int, int, bool]] | None":
    """The key range of each block of ``block`` queries, or None when the blocks would skip too little and the
    whole score matrix is small (under ``ATTENTION_SPLIT`` pairs)."""
    n, s = visible.shape
    if n < 2 * block or s < 2 * block:
        return None
    blocks = []
    cost = 0
    for q0 in range(0, n, block):
        q1 = min(n, q0 + block)
        cols = visible[q0:q1].any(axis=0)
        if not cols.any():
            return None
        k0 = int(np.argmax(cols))
        k1 = s - int(np.argmax(cols[::-1]))
        blocks.append((q0, q1, k0, k1, bool(visible[q0:q1, k0:k1].all())))
        cost += (q1 - q0) * (k1 - k0)
    return blocks if cost < 0.8 * n * s or n * s >= ATTENTION_SPLIT else None


def _one_query_attention(q: "mx.array", k: "mx.array", v: "mx.array", scale: float, block: int) -> "mx.array":
    """Attention of one query per head (a decode step) over many keys, in products OpenBLAS streams.

    ``q [1, H, 1, D]``, ``k, v [1, H_kv, S, D]``. MLX's CPU attention computes ``q @ k^T`` and ``p @ v``, which OpenBLAS
    packs (its slower packed path); this computes ``k @ q^T`` in row blocks of ``K``, and ``p @ v`` as a sum
    over row blocks of ``V``, each product within ``block`` elements (``runtime.matvec_block``, OpenBLAS's small-matrix
    kernel). Returns ``[1, H, 1, D]``.
    """
    _, h, _, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    rep = h // hkv
    rows = max(1, block // (d * rep))
    outs = []
    for g in range(hkv):
        qt = q[0, g * rep:(g + 1) * rep, 0, :].T.reshape(d, rep)  # a contiguous [D, rep] (reshape copies the view)
        kg, vg = k[0, g], v[0, g]
        scores = mx.concatenate([kg[i:i + rows] @ qt for i in range(0, s, rows)], axis=0)  # [S, rep]
        p = mx.softmax(scores.T * scale, axis=-1, precise=True)  # [rep, S]
        out = None
        for i in range(0, s, rows):
            part = p[:, i:i + rows] @ vg[i:i + rows]
            out = part if out is None else out + part
        outs.append(out)
    return mx.concatenate(outs, axis=0).reshape(1, h, 1, d)


def _rows_attention(q: "mx.array", k: "mx.array", v: "mx.array", scale: float, mask: "mx.array | None") -> "mx.array":
    """Attention of many queries (a prefill) as MLX's CPU backend computes ``mx.fast.scaled_dot_product_attention``
    (its fallback: ``q * scale``, grouped heads as a broadcast axis, ``q @ k^T``, the additive mask, softmax,
    ``@ v``), with our softmax (``cpu_kernels.softmax``: the bits of MLX's, vectorized and threaded) for MLX's, which
    runs one element at a time on one thread: about half of a 2048-token prefill of smollm2 (perf). The same bits as
    MLX's attention. ``q [B, H, L, D]``, ``k [B, H_kv, S, D]``, ``v [B, H_kv, S, Dv]``, ``mask`` broadcastable to
    ``[L, S]`` or None; returns ``[B, H, L, Dv]``."""
    b, h, n, d = q.shape
    hkv = k.shape[1]
    q = mx.array(scale, q.dtype) * q
    if h != hkv:
        q = q.reshape(b, hkv, h // hkv, n, d)
        k, v = mx.expand_dims(k, 2), mx.expand_dims(v, 2)
    scores = q @ k.swapaxes(-1, -2)
    if mask is not None:
        scores = scores + mask
    out = cpu_kernels.softmax(scores) @ v
    return out.reshape(b, h, n, -1) if h != hkv else out


def _rows_kernel(q: "mx.array", k: "mx.array", v: "mx.array", m: Any) -> bool:
    """Whether :func:`_rows_attention` runs: on the CPU with our kernels, float32, an array mask or none."""
    return (runtime.on_cpu and cpu_kernels.softmax is not None and q.ndim == 4
            and q.dtype == k.dtype == v.dtype == mx.float32 and not isinstance(m, str)
            and (m is None or m.dtype == mx.float32))


_COMPILE_WORKS: "bool | None" = None


def _compile_works() -> bool:
    """Whether ``mx.compile`` can build and run a fused kernel here (checked once per process)."""
    global _COMPILE_WORKS
    if _COMPILE_WORKS is None:
        try:
            probe = mx.compile(lambda x: mx.tanh(x * 0.5) * 2.0 + 1.0)
            _COMPILE_WORKS = bool(np.allclose(np.array(probe(mx.zeros((4,)))), 1.0))
        except Exception:  # noqa: BLE001 (any failure of the JIT: no compiler, no writable temp folder...)
            _COMPILE_WORKS = False
    return _COMPILE_WORKS


def _kernel_blocks_attention(q: "mx.array", k: "mx.array", v: "mx.array", scale: float, m: "mx.array | None",
                             spans: "tuple[np.ndarray, np.ndarray] | None") -> "mx.array":
    """Attention of many queries (a prefill) by our CPU kernel (``cpu_kernels.attend``), ``PREFILL_BLOCK`` queries
    a call, each block over the keys its queries see (``spans``, from the mask; all keys without one).

    ``q [1, H, L, D]``, ``k [1, H_kv, S, D]``, ``v [1, H_kv, S, Dv]`` float32, ``m`` an additive float32 mask
    ``[L, S]`` or None; returns ``[1, H, L, Dv]``. softmax(q k^T * scale + mask) v (Vaswani et al. 2017) within float32
    rounding (the online softmax of Milakov and Gimelshein 2018, over chunks of keys), not MLX's bits. Why: MLX's CPU
    path is two products that OpenBLAS packs (or the much slower reference BLAS where no OpenBLAS is installed) and a
    softmax; this reads each key block once per query block, with or without OpenBLAS."""
    n, s = q.shape[2], k.shape[2]
    outs = []
    for q0 in range(0, n, PREFILL_BLOCK):
        q1 = min(n, q0 + PREFILL_BLOCK)
        k0, k1 = 0, s
        if spans is not None:
            lo, hi = int(spans[0][q0:q1].min()), int(spans[1][q0:q1].max())
            if hi > lo:  # (a block that sees no key at all keeps them all: the mask hides them)
                k0, k1 = lo, hi
        outs.append(cpu_kernels.attend(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], scale,
                                       None if m is None else m[q0:q1, k0:k1]))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)


def _prefill_rows(q: "mx.array", k: "mx.array", v: "mx.array", m: Any) -> bool:
    """Whether :func:`_kernel_blocks_attention` runs: on the CPU with our kernels, more queries than a decode step's
    (one batch row), float32, an ``[L, S]`` float32 mask or none."""
    return (runtime.on_cpu and cpu_kernels.attend is not None and q.ndim == 4 and q.shape[0] == 1
            and k.shape[0] == 1 and q.shape[2] > 16 and q.dtype == k.dtype == v.dtype == mx.float32
            and (m is None or (not isinstance(m, str) and m.ndim == 2 and m.dtype == mx.float32
                               and m.shape == (q.shape[2], k.shape[2]))))


def _decode_rows(q: "mx.array", k: "mx.array", v: "mx.array", m: Any) -> bool:
    """Whether our CPU attention kernel runs in one call: a few query rows (decode steps) in float32, no mask or an
    ``[N, S]`` one (more rows: :func:`_prefill_rows`, in blocks)."""
    return (runtime.on_cpu and cpu_kernels.attend is not None and q.ndim == 4 and q.shape[0] == 1
            and q.shape[2] <= 16 and q.dtype == k.dtype == v.dtype == mx.float32
            and (m is None or (not isinstance(m, str) and m.ndim == 2 and m.shape == (q.shape[2], k.shape[2]))))


def _streams_one_query(q: "mx.array", k: "mx.array") -> bool:
    """Whether :func:`_one_query_attention` should run: one query per head, and products over the small-matrix
    limit (below it MLX's own attention is as fast)."""
    block = runtime.matvec_block
    if not block or q.ndim != 4 or q.shape[0] != 1 or q.shape[2] != 1 or k.shape[0] != 1:
        return False
    rep = q.shape[1] // k.shape[1]
    return k.shape[2] * q.shape[3] * rep > block


class MLXContext(Context):
    """Makes MLX tensors. MLX frees intermediates by reference counting, so closing has nothing to release."""

    def from_numpy(self, array, dtype=None):
        a = mx.array(np.asarray(array))
        return MLXTensor(a if dtype is None else a.astype(TO_MX[dtype]))

    def zeros(self, shape, dtype):
        return MLXTensor(mx.zeros(tuple(shape), dtype=TO_MX[dtype]))

    def full(self, shape, value, dtype):
        return MLXTensor(mx.full(tuple(shape), value, dtype=TO_MX[dtype]))

    def arange(self, start, stop, dtype=DType.INT32):
        return MLXTensor(mx.arange(start, stop, dtype=TO_MX[dtype]))

    def concatenate(self, tensors, axis):
        return MLXTensor(mx.concatenate([t.a for t in tensors], axis=axis))

    def stack(self, tensors, axis=0):
        return MLXTensor(mx.stack([t.a for t in tensors], axis=axis))

    def rope_angles(self, positions, tokens, dims, base, scale, freqs, dtype):
        # Only for our RoPE kernel, whose table this is (bit for bit mx.fast.rope's angles); MLX's own RoPE on a GPU
        # computes them in the kernel.
        if not (runtime.on_cpu and cpu_kernels.rope_apply is not None and dtype == DType.FLOAT32):
            return None
        pos = positions.a if isinstance(positions, MLXTensor) else positions
        if isinstance(pos, int) and tokens == 1 and freqs is None:  # a decode step: a row of a table made once
            cos, sin = cpu_kernels.rope_row(pos, dims, base, scale)
            return RopeAngles(MLXTensor(cos), MLXTensor(sin))
        cos, sin = cpu_kernels.rope_table(tokens, pos, dims, base, scale, None if freqs is None else freqs.a)
        return RopeAngles(MLXTensor(cos), MLXTensor(sin))

    def cached_attention(self, q, k, v, keys, values, cells, scale, mask, angles, dims, traditional):
        qa, ka, va, ks, vs = q.a, k.a, v.a, keys.a, values.a
        if angles is None:
            return _attend_in_graph(qa, ka, va, ks, vs, cells.a, scale, mask)
        if not (runtime.on_cpu and cpu_kernels.attend_cached is not None and qa.ndim == 4 and qa.shape[2] <= 16
                and all(a.dtype == mx.float32 for a in (qa, ka, va, angles.cos.a))
                and ks.dtype in (mx.float32, mx.float16, mx.bfloat16) and vs.dtype == ks.dtype):
            return None
        m = None
        if mask is not None:
            runs = mask.runs if isinstance(mask, MLXMask) else None
            if runs is not None and len(runs) > 1 and qa.shape[2] == 1:
                return None  # more runs than the kernel reads: attention apart reads them alone, not all cells
            m = mask.a
            if m.ndim != 2 or m.shape[0] != qa.shape[2]:
                return None
            if m.dtype != mx.float32:
                m = m.astype(mx.float32)
        o, ks, vs = cpu_kernels.attend_cached(qa, ka, va, ks, vs, angles.cos.a, angles.sin.a, cells.a, scale, dims,
                                              traditional, m)
        return MLXTensor(o), MLXTensor(ks), MLXTensor(vs)

    def attention_mask(self, visible, dtype):
        visible = np.asarray(visible, dtype=np.bool_)
        mask = mx.array(np.where(visible, np.float32(0.0), np.float32(-np.inf)))
        if dtype != DType.FLOAT32:
            mask = mask.astype(TO_MX[dtype])
        one = visible.shape[0] == 1  # a decode step's row: its runs of keys; a prefill's rows: their spans
        return MLXMask(mask, _attention_blocks(visible, ATTENTION_BLOCK), _visible_runs(visible[0]) if one else None,
                       None if one else _visible_spans(visible))

    def scaled_dot_product_attention(self, q, k, v, scale, mask=None, softcap=None, sinks=None):
        m = mask if isinstance(mask, str) or mask is None else mask.a
        if m is not None and not isinstance(m, str) and m.dtype != q.a.dtype:
            m = m.astype(q.a.dtype)
        if sinks is not None:  # MLX's own attention takes the sinks; our kernels and the block split do not
            if softcap is not None:
                raise UnsupportedError("attention with both a soft-cap and sinks is not supported")
            return MLXTensor(mx.fast.scaled_dot_product_attention(q.a, k.a, v.a, scale=scale, mask=m,
                                                                  sinks=sinks.a.astype(q.a.dtype)))
        if softcap is not None:
            return MLXTensor(_softcapped_attention(q.a, k.a, v.a, scale, softcap, m))
        sdpa = mx.fast.scaled_dot_product_attention
        runs = mask.runs if isinstance(mask, MLXMask) else None
        if runs is not None and q.a.shape[2] == 1 and k.a.shape[2] == m.shape[-1]:
            # One query that sees a few runs of keys: attend to those alone, unmasked (a wrapped sliding window sees
            # about 512 of the 2815 cells of its ring).
            ka, va = k.a, v.a
            if len(runs) == 1:
                (a, b), = runs
                ka, va = ka[:, :, a:b], va[:, :, a:b]
            else:
                ka = mx.concatenate([ka[:, :, a:b] for a, b in runs], axis=2)
                va = mx.concatenate([va[:, :, a:b] for a, b in runs], axis=2)
            return self.scaled_dot_product_attention(q, MLXTensor(ka), MLXTensor(va), scale)
        if _decode_rows(q.a, k.a, v.a, m):
            return MLXTensor(cpu_kernels.attend(q.a, k.a, v.a, scale, m))
        if _prefill_rows(q.a, k.a, v.a, m):
            spans = mask.spans if isinstance(mask, MLXMask) else None
            return MLXTensor(_kernel_blocks_attention(q.a, k.a, v.a, scale, m, spans))
        if m is None and _streams_one_query(q.a, k.a):
            return MLXTensor(_one_query_attention(q.a, k.a, v.a, scale, runtime.matvec_block))
        if _rows_kernel(q.a, k.a, v.a, m):
            sdpa = _rows_attention
        blocks = mask.blocks if isinstance(mask, MLXMask) else None
        if blocks is None or q.a.shape[2] != m.shape[-2] or k.a.shape[2] != m.shape[-1]:
            return MLXTensor(sdpa(q.a, k.a, v.a, scale=scale, mask=m))
        # Blocks of queries attend only to the keys they can see: hidden keys add exp(-inf) = 0 to the softmax, so
        # leaving them out changes nothing but the work (and the size of the score matrix).
        qa, ka, va = q.a, k.a, v.a
        outs = []
        for q0, q1, k0, k1, full in blocks:
            outs.append(sdpa(qa[:, :, q0:q1], ka[:, :, k0:k1], va[:, :, k0:k1], scale=scale,
                             mask=None if full else m[q0:q1, k0:k1]))
            if runtime.on_cpu:
                # computed now, one block at a time (a prefill, never traced): MLX allocates an operation's output
                # when it schedules it, ahead of the stream that computes them, so left in the graph (even ordered
                # by mx.depends) several blocks' score matrices were alive at once
                mx.eval(outs[-1])
        return MLXTensor(mx.concatenate(outs, axis=2))

    def quantize(self, x, group_size=64, bits=8):
        w, s, b = mx.quantize(x.a, group_size=group_size, bits=bits)
        return MLXTensor(w), MLXTensor(s), MLXTensor(b)

    def dequantize(self, packed, scales, biases, group_size=64, bits=8):
        return MLXTensor(mx.dequantize(packed.a, scales.a, biases.a, group_size=group_size, bits=bits))

    def categorical(self, logits, seed_key):
        return MLXTensor(mx.random.categorical(logits.a, key=seed_key).astype(mx.int32))

    def random_key(self, seed):
        return mx.random.key(int(seed))

    def split_key(self, key):
        k1, k2 = mx.random.split(key)
        return k1, k2

    def random_normal(self, shape, dtype, key):
        return MLXTensor(mx.random.normal(tuple(shape), dtype=TO_MX[dtype], key=key))

    def evaluate(self, *tensors):
        mx.eval(*[t.w if t.is_quantized else t.a for t in tensors])

    def evaluate_async(self, *tensors):
        mx.async_eval(*[t.w if t.is_quantized else t.a for t in tensors])


def _cut(host: "np.ndarray | QuantizedArray", axis: int, start: int, stop: int) -> "np.ndarray | QuantizedArray":
    if isinstance(host, QuantizedArray):
        return host.slice(axis, start, stop)
    index = [slice(None)] * host.ndim
    index[axis] = slice(start, stop)
    return np.ascontiguousarray(host[tuple(index)])


def _symmetric(host: QuantizedArray) -> bool:
    """Whether every bias is ``-2**(bits - 1)`` times its scale, exactly (GGUF's Q8_0, Q4_0 and Q5_0 repacked: a
    signed integer times its scale, stored as an unsigned one with that zero point)."""
    if host.super_scales is not None or host.biases is None:  # a K-quant's: its mins, or none (Q6_K, Q3_K, IQ4)
        return host.biases is None
    return bool(np.array_equal(host.biases, host.scales * np.asarray(-(2 ** (host.bits - 1)), host.scales.dtype)))


def _check_activations(activations: str | None, device: str) -> str:
    """``activations`` as :class:`MLXBackend` takes it (None: the process default), checked for ``device``."""
    if activations is None:
        return cpu_kernels.activations if device == "cpu" else "float32"
    if activations not in ACTIVATIONS:
        raise InvalidRequestError(f"activations must be one of {', '.join(ACTIVATIONS)}, "
                                  f"not {activations!r}")
    if activations != "float32":
        if device != "cpu":
            raise UnsupportedError(f"{activations} activations are a CPU kernel's; on {device} MLX's quantized kernels "
                                   "take the activations in the compute dtype: leave activations unset (or float32)")
        problem = cpu_kernels.activations_problem(activations)
        if problem:
            raise UnsupportedError(f"{activations} activations cannot run here: {problem}; use float32")
    return activations


class MLXBackend(Backend):
    """Weights from a GGUF file, a safetensors file, or a Hugging Face folder, on an MLX device.

    Args:
        path: the model file or folder.
        device: ``cpu``, ``gpu``, ``metal``, ``cuda`` or None (automatic; see ``mlx_engine.mlx.runtime``).
        dtype: the compute dtype; float weights are cast to it. Default: float32 on CPU (MLX's CPU backend has no
            fast half-precision matmul), ``half_dtype`` on GPUs.
        requantize: re-quantize tensors of quantized types that have no exact form (IQ3_S, TQ2_0...), and on
            GPUs (or without our CPU kernels) those of 16-element groups (Q6_K, Q3_K, Q2_K, which only our CPU
            kernels run), to this many bits (4 or 8, group size 32); 0 keeps them dequantized (float). Default: 8
            where weights stay quantized (the closest MLX form: an 8-bit grid is 4x finer than Q6_K's own), else 0.
            (IQ4_NL and IQ4_XS keep their codebook on the CPU with our kernels, and are 8-bit affine without loss
            elsewhere.)
        quantized: keep quantized weights quantized. Default: yes on GPUs (``mx.quantized_matmul``), and on the CPU
            where our CPU kernels loaded (:mod:`mlx_engine.mlx.cpu_kernels`); without them, no on the CPU, where
            MLX's own quantized matmul is far slower than a BLAS float32 matmul, so weights are dequantized at load.
        shard: load only part of the file (one rank of a distributed run): ``shard(weight_file)`` returns, for each
            tensor to load, None (all of it) or ``(axis, start, stop)`` (that range of rows or columns); tensors it
            leaves out are not read. Each tensor is read, cut and uploaded alone, so the host never holds more
            than one whole tensor.
        half_dtype: the GPU's default compute dtype (the architecture's :attr:`DecoderModel.half_dtype`).
        activations: what the CPU's quantized products do with x: ``"float32"`` (the exact product with the
            dequantized weight: the float model's tokens) or ``"int8"`` (x quantized per 32 elements as llama.cpp's
            Q8_0 and integer dot products: llama.cpp's numerics, faster; needs AVX-512 VNNI or AVX2) or ``"int16"``
            (x quantized per 32 elements to 16 bits, d = max|x| / 32639, and the same integer dot products, in
            products of fewer than 64 rows of x, a prompt's taking the float32 kernel: the float path's numerics to a
            few 1e-5, a faster decode than float32; needs AVX-512 VNNI or AVX2).
            Default: ``$MLX_ENGINE_ACTIVATIONS``, else float32.

    Raises:
        WeightsError: the file is missing, truncated or corrupt (the message names it).
        InvalidRequestError: ``activations`` is none of float32, int8, int16.
        UnsupportedError: int8 or int16 activations where they cannot run (a GPU, whose MLX kernels take x as it is;
            a CPU without our kernels, or an x86-64 one without the instructions: the message says which).
    """

    def __init__(self, path: "str | Path | None" = None, *, device: str | None = None, dtype: "DType | str | None" = None,
                 requantize: int | None = None, quantized: bool | None = None,
                 shard: "Callable[[Any], Mapping[str, tuple[int, int, int] | None]] | None" = None,
                 half_dtype: "DType | str" = DType.FLOAT16, activations: str | None = None):
        self._device = select_device(device)
        self.activations = _check_activations(activations, self._device)
        if quantized is None:
            quantized = self._device != "cpu" or cpu_kernels.qmatmul is not None
        self._keep_quantized = quantized
        if requantize is None:
            requantize = 8 if quantized else 0
        requantize = requantize or None
        self._requantize = requantize
        self._dtype = DType.parse(dtype) if dtype else (DType.FLOAT32 if self._device == "cpu" else
                                                         DType.parse(half_dtype))
        self._weights: dict[str, MLXTensor] = {}
        self._metadata: Mapping[str, Any] = {}
        self.path = Path(path) if path is not None else None
        #: bytes in use on the device before this load (other models): the load's own peak is peak - this
        self.memory_before_load = mx.get_active_memory()
        if path is not None:
            mx.reset_peak_memory()  # so that peak_memory() after the load is the load's own peak
            with open_weights(path) as wf:
                self._metadata = wf.metadata
                self.tensor_types = {n: wf.type_name(n) for n in wf.names()}
                self.tensor_shapes = [wf.shape(n) for n in wf.names()]
                wanted = shard(wf) if shard is not None else dict.fromkeys(wf.names())
                #: what identifies the file's contents to the other ranks of a distributed run
                self.fingerprint = wf.fingerprint()
                for name in wf.names():
                    if name not in wanted:
                        continue
                    host = wf.load(name, requantize=requantize)
                    if wanted[name] is not None:
                        host = _cut(host, *wanted[name])
                    self._weights[name] = self._to_device(host)
        #: bytes of the weights' memory backed by huge pages (Linux, on the CPU: a decode step streams every weight,
        #: and 4 KiB pages cost a TLB miss each; see ``cpu_kernels.huge_pages``); 0 where not
        self.huge_page_bytes = 0
        if self._weights and self._device == "cpu" and cpu_kernels.huge_pages is not None:
            arrays = []
            for t in self._weights.values():
                parts = (t.w, t.scales, t.biases, t.super_scales) if isinstance(t, MLXQuantizedTensor) else (t.a,)
                arrays += [a for a in parts if a is not None]
            self.huge_page_bytes = cpu_kernels.huge_pages(arrays)

    def _to_device(self, host: "np.ndarray | QuantizedArray") -> MLXTensor:
        dt = TO_MX[self._dtype]
        ours = self._device == "cpu" and cpu_kernels.qmatmul is not None
        if isinstance(host, QuantizedArray) and host.group_size == 16 and not ours:
            # MLX's kernels take groups of 32 or more: the closest MLX form, or float
            host = regroup(host, self._requantize) if self._requantize else host.dequantize()
        if isinstance(host, QuantizedArray) and host.codebook is not None and not (
                ours and np.array_equal(host.codebook, IQ4_NL_VALUES)):  # (the one codebook our kernels hold)
            host = codebook_to_affine(host)  # MLX's kernels are affine: 8 bits hold the levels exactly
        if isinstance(host, QuantizedArray) and self._keep_quantized:
            if host.super_scales is not None and not ours:
                host = host.expanded()  # MLX's kernels take one float scale and bias per group
            s = mx.array(host.scales)
            b = None if host.biases is None else mx.array(host.biases)
            if self._device != "cpu":  # mx.quantized_matmul wants them in the compute dtype
                s, b = s.astype(dt), b.astype(dt)
            elif ours and _symmetric(host):
                b = None  # our kernel makes them from the scales: Q8_0 held in its file's 34 bytes per 32, not 36
            sup = None if host.super_scales is None else mx.array(host.super_scales)
            t = MLXQuantizedTensor(mx.array(host.weight), s, b, host.group_size, host.bits, dtype=dt,
                                   activations=self.activations, super_scales=sup,
                                   codebook=None if host.codebook is None else mx.array(host.codebook))
            mx.eval(t.w, t.scales, *([] if b is None else [b]), *([] if sup is None else [sup]))
            return t
        if isinstance(host, QuantizedArray):
            host = host.dequantize()  # on the host, so the device never holds both forms
        a = mx.array(host)
        if mx.issubdtype(a.dtype, mx.floating) and a.dtype != dt:
            a = a.astype(dt)
        mx.eval(a)
        return MLXTensor(a)

    @property
    def name(self) -> str:
        if self._device == "cpu":
            return f"mlx cpu ({blas_description()}; quantized kernels: {cpu_kernels.status(self.activations)})"
        return f"mlx {self._device}"

    @property
    def device(self) -> str:
        return self._device

    @property
    def compute_dtype(self) -> DType:
        return self._dtype

    @property
    def metadata(self) -> Mapping[str, Any]:
        return self._metadata

    @property
    def weights(self) -> dict[str, MLXTensor]:
        return self._weights

    def weights_nbytes(self) -> int:
        return sum(t.nbytes for t in self._weights.values())

    def new_context(self) -> MLXContext:
        runtime.watch_thread_exit()
        return MLXContext()

    def compile(self, fn):
        """``mx.compile`` of ``fn`` on the arrays behind its Tensor arguments (a quantized weight travels as its
        packed words, scales and biases). One trace per pattern of dense / quantized arguments, and per shape.

        On the CPU, MLX builds fused kernels with the system C++ compiler (once per machine: they are kept in
        ``$TMPDIR/mlx``); where that fails (no compiler), ``fn`` itself is returned and runs op by op.

        Each thread gets its own ``mx.compile`` object: MLX keeps traces in a per-thread cache keyed by the traced
        function's address and, when a compiled function dies, erases them only from the cache of the thread that
        called it last. A function called on two threads (a model warmed on the main thread, then served by a
        scheduler thread) left its trace behind in the other, where a later function allocated at the same address
        was handed the dead one's graph (MLX 0.32.4)."""
        if not _compile_works():
            return fn
        traced: dict[tuple, Any] = {}
        returns_tuple: dict[tuple, bool] = {}

        def call(*tensors):
            spec, flat = [], []  # one pass: this runs twice per layer and decode step
            for t in tensors:
                if isinstance(t, MLXQuantizedTensor):
                    spec.append((t.group_size, t.bits, t._dtype, t.biases is None, t.activations,
                                 t.super_scales is not None))
                    flat += (t.w, t.scales) if t.biases is None else (t.w, t.scales, t.biases)
                    if t.super_scales is not None:
                        flat.append(t.super_scales)
                else:
                    spec.append(None)
                    flat.append(t.a)
            spec = tuple(spec)
            key = (threading.get_ident(), spec)
            cfn = traced.get(key)
            if cfn is None:
                def raw(*arrays):
                    it = iter(arrays)
                    args = [MLXTensor(next(it)) if s is None else
                            MLXQuantizedTensor(next(it), next(it), None if s[3] else next(it), *s[:3],
                                               activations=s[4], super_scales=next(it) if s[5] else None)
                            for s in spec]
                    out = fn(*args)
                    returns_tuple[spec] = isinstance(out, tuple)
                    return tuple(o.a for o in out) if isinstance(out, tuple) else (out.a,)
                cfn = traced[key] = mx.compile(raw)
            out = cfn(*flat)
            if returns_tuple[spec]:
                return tuple(MLXTensor(a) for a in out)
            return MLXTensor(out[0])

        return call

    def cache_config(self) -> CacheConfig:
        return CacheConfig(padding=1, mask_dtype=self._dtype, step=256)

    def set_memory_limit(self, nbytes: int) -> int:
        return mx.set_memory_limit(int(nbytes))

    def set_cache_limit(self, nbytes: int) -> int:
        return mx.set_cache_limit(int(nbytes))

    def set_wired_limit(self, nbytes: int) -> int:
        if self._device != "metal":
            return 0
        return mx.set_wired_limit(int(nbytes))

    def active_memory(self) -> int:
        return mx.get_active_memory()

    def peak_memory(self) -> int:
        return mx.get_peak_memory()

    def reset_peak_memory(self) -> None:
        mx.reset_peak_memory()

    def clear_cache(self) -> None:
        mx.clear_cache()

    def device_memory(self) -> int:
        if self._device != "cpu":
            info = mx.device_info()
            for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
                if info.get(key):
                    return int(info[key])
        return super().device_memory()

    def close(self) -> None:
        self._weights.clear()
        mx.clear_cache()
