"""Attention on MLX arrays: the mask with its blocks, runs and spans, and the choice of kernel for each shape (our CPU
kernels for decode rows and prefill blocks, MLX's fused attention otherwise). :class:`MLXContext` calls
:func:`attend`, :func:`cached_attention` and :func:`attention_mask`."""

from __future__ import annotations

from typing import Any

import numpy as np

from mlx_engine.errors import UnsupportedError
from mlx_engine.ml import DType
from mlx_engine.mlx import cpu_kernels, runtime
from mlx_engine.mlx.runtime import mx
from mlx_engine.mlx.tensor import TO_MX, MLXTensor


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


def cached_attention(q, k, v, keys, values, cells, scale, mask, angles, dims, traditional):
    """:meth:`Context.cached_attention` on MLX arrays: our CPU kernel (RoPE, the cache write and attention in one
    call) where it applies, else None (the caller composes the operations); without ``angles``, the cache write and
    attention in the graph."""
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

def attention_mask(visible, dtype):
    """:meth:`Context.attention_mask`: an additive float mask (0 visible, -inf hidden) with the blocks of queries,
    the runs of a decode row or the spans of prefill rows that let attention skip hidden keys."""
    visible = np.asarray(visible, dtype=np.bool_)
    mask = mx.array(np.where(visible, np.float32(0.0), np.float32(-np.inf)))
    if dtype != DType.FLOAT32:
        mask = mask.astype(TO_MX[dtype])
    one = visible.shape[0] == 1  # a decode step's row: its runs of keys; a prefill's rows: their spans
    return MLXMask(mask, _attention_blocks(visible, ATTENTION_BLOCK), _visible_runs(visible[0]) if one else None,
                   None if one else _visible_spans(visible))

def attend(q, k, v, scale, mask=None, softcap=None, sinks=None):
    """:meth:`Context.scaled_dot_product_attention` on MLX tensors: ``softmax(q k^T * scale + mask) v`` (with
    ``softcap * tanh(scores / softcap)`` before the mask where given; with ``sinks [H]``, one more logit per head in
    the softmax's denominator, gpt-oss's attention sinks), by whichever kernel fits the shape.

    Raises:
        UnsupportedError: both a soft-cap and sinks.
    """
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
        return attend(q, MLXTensor(ka), MLXTensor(va), scale)
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
