"""Our CPU kernels (``mlx_engine.mlx._kernels``, built from ``kernels/`` by setup.py at install), or why not.

``qmatmul`` (quantized matrix products; ``qmatmul_many``: several of one x as one graph node and one parallel job;
``output_mlp``: a decoder layer after attention, its output projection, norms and gated MLP, as one graph node;
``gather_qmatmul``: a mixture of experts' products, each row of x through its experts of a quantized stack),
``rope_apply`` (RoPE from a table), ``attend`` (attention of a few queries per head, decode steps;
``attend_cached``: with the RoPE of the queries and new keys and their write into the KV cache), ``qtake`` (rows
of a quantized weight, dequantized: an embedding lookup), ``rms_norm``
(RMSNorm as one graph node; ``add_rms_norm``: a residual add and the norm after it as one) and ``activation`` (SiLU
and tanh-form GELU, vectorized; times a gated MLP's up projection; ``qmatmul_many`` runs these as the prologue of its
products, and RMSNorms of its outputs, in the same node), ``widen`` (float16 / bfloat16 to float32, vectorized,
exactly as astype: a 16-bit KV cache read apart), ``softmax`` (over the last axis, the bits of MLX's, vectorized
and threaded: a prefill's attention scores) and ``huge_pages`` (the weights' memory in transparent huge pages, on
Linux) are None when the module is missing (not built:
no compiler or CMake at install, or ``MLX_ENGINE_NO_KERNELS=1``), was built against another MLX than the one
installed, or fails its self-test; then quantized weights run through MLX's own operations and
:func:`status` says why. ``MLX_ENGINE_KERNELS=0`` turns them off at run time. ``activations`` says what the
engine's products do with x by default (float32, or int8 / int16 with ``MLX_ENGINE_ACTIVATIONS``); a model loaded
with ``activations=`` sets its own (:func:`activations_problem` says whether int8 or int16 runs here).
"""

from __future__ import annotations

import importlib
import os
import threading
from collections import OrderedDict
from typing import Callable

import numpy as np

from mlx_engine.mlx.runtime import mx
from mlx_engine.weights.quant import IQ4_NL_VALUES, MXFP4_VALUES

qmatmul: "Callable | None" = None
qmatmul_many: "Callable | None" = None
output_mlp: "Callable | None" = None
gather_qmatmul: "Callable | None" = None
rope_apply: "Callable | None" = None
attend: "Callable | None" = None
attend_cached: "Callable | None" = None
qtake: "Callable | None" = None
rms_norm: "Callable | None" = None
add_rms_norm: "Callable | None" = None
activation: "Callable | None" = None
widen: "Callable | None" = None
softmax: "Callable | None" = None
huge_pages: "Callable | None" = None
#: the codebooks our kernels hold (``Codebook`` in kernels/qmatmul.h), by the id their ``codebook`` arguments take
#: (0: an affine weight): llama.cpp's ``kvalues_iq4nl`` (GGUF's IQ4_NL, IQ4_XS) and ``kvalues_mxfp4`` (MXFP4)
CODEBOOKS = {1: IQ4_NL_VALUES, 2: MXFP4_VALUES}
#: MXFP4's id: a weight of this codebook may hold its scales ``2**(e - 128)`` as the exponents ``e`` (uint8)
MXFP4 = 2


def codebook_id(levels: "np.ndarray | None") -> int:
    """The id (a key of :data:`CODEBOOKS`) of a weight's codebook ``levels`` (int8 ``[16]``, as a NumPy or MLX array);
    0 for None, and for levels our kernels do not hold."""
    if levels is None:
        return 0
    levels = np.asarray(levels)
    return next((i for i, v in CODEBOOKS.items() if np.array_equal(levels, v)), 0)


# What qmatmul does with x unless a model was loaded with activations=: "float32" (the exact product of x with the
# dequantized weight: the float model's tokens), or with $MLX_ENGINE_ACTIVATIONS=int8 where the CPU has that kernel
# (AVX-512 VNNI or AVX2) "int8" (quantized per 32 or, for K-quants, 256 elements and integer dot products, as
# llama.cpp does: a faster
# decode, llama.cpp's numerics), or with $MLX_ENGINE_ACTIVATIONS=int16 on the same CPUs "int16" (16 bits
# per 32 elements, the same integer dot products, in products of fewer than 64 rows of x: the float path's numerics
# to a few 1e-5). Each quantized weight
# carries the value it was made with (a compiled graph keeps what it was traced with).
activations = "float32"
_status = "not loaded"
_note = ""  # what became of $MLX_ENGINE_ACTIVATIONS, where it was not taken
_kernels_module = None
# why int8 / int16 activations cannot run here (None: they can), found on first need
_activation_problems: "dict[str, str | None]" = {}
_gather_problem: "str | None" = "not checked"
_self_test_lock = threading.Lock()  # the self-tests run on first need


def _self_test(fn, many) -> str | None:
    """Compare with MLX's dequantize + matmul on a small random problem for each bit width, one product at a time and
    all of them in one ``many`` call, and a weight without biases with the one holding the biases it implies (to
    float32 rounding); None when all agree."""
    key = mx.random.key(7)
    k0, key = mx.random.split(key)
    x = mx.random.normal((3, 96), key=k0)
    weights, wants = [], []
    for bits in (2, 3, 4, 5, 6, 8):
        k1, key = mx.random.split(key)
        w = mx.random.normal((40 + bits, 96), key=k1)
        q, s, b = mx.quantize(w, group_size=32, bits=bits)
        s, b = s.astype(mx.float16), b.astype(mx.float16)
        want = x @ mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), group_size=32, bits=bits).T
        err = mx.abs(fn(x, q, s, b, 32, bits) - want).max().item()
        if not err <= 1e-4 * (1 + mx.abs(want).max().item()):
            return f"{bits}-bit product off by {err:.3g}"
        # the same weight, rounded in another order (a symmetric one's decode sums per group before its scale)
        implied = fn(x, q, s, s * -(2 ** (bits - 1)), 32, bits)
        if not mx.abs(fn(x, q, s, None, 32, bits) - implied).max().item() <= 1e-5 * (1 + mx.abs(implied).max().item()):
            return f"{bits}-bit product of a symmetric weight (no biases) differs from its implied biases"
        weights.append((q, s, b, bits))
        wants.append(want)
    got = many(x, *[[w[i] for w in weights] for i in range(3)], [32] * len(weights), [w[3] for w in weights])
    for (*_, bits), g, want in zip(weights, got, wants):
        err = mx.abs(g - want).max().item()
        if not err <= 1e-4 * (1 + mx.abs(want).max().item()):
            return f"{bits}-bit product off by {err:.3g} among several of one x"
    return _sub_block_self_test(fn) or _codebook_self_test(fn)


def _sub_block_self_test(fn) -> str | None:
    """A weight of GGUF Q6_K's form (groups of 16, int8 scales times a float16 per 256 elements, symmetric, 6 bits)
    against its values made here, ``(q - 32) * d * sc``; None when they agree."""
    k1, k2, k3, k4 = mx.random.split(mx.random.key(13), 4)
    w = mx.random.randint(0, 2 ** 31, (24, 48), key=k1).astype(mx.uint32)  # any bits are 256 6-bit integers a row
    sc = mx.random.randint(-128, 128, (24, 16), key=k2).astype(mx.int8)
    d = (mx.random.uniform(shape=(24, 1, 1), key=k3) * 1e-2).astype(mx.float16)
    x = mx.random.normal((3, 256), key=k4)
    one = mx.ones((24, 8))
    q = mx.dequantize(w, one, mx.zeros_like(one), group_size=32, bits=6).reshape(24, 16, 16)
    want = x @ ((q - 32) * (d.astype(mx.float32)[:, 0, :] * sc.astype(mx.float32))[..., None]).reshape(24, 256).T
    err = mx.abs(fn(x, w, sc, None, 16, 6, "float32", d) - want).max().item()
    if not err <= 1e-4 * (1 + mx.abs(want).max().item()):
        return f"a product with groups of 16 (two-level int8 scales) off by {err:.3g}"
    return None


def _codebook_self_test(fn) -> str | None:
    """A 4-bit codebook weight of each of :data:`CODEBOOKS` (GGUF's IQ4_NL, MXFP4: ``scale * kvalues[q]``; MXFP4's
    also with its E8M0 exponents as scales) against its values made here; None when they agree."""
    k1, k2, k3 = mx.random.split(mx.random.key(17), 3)
    w = mx.random.randint(0, 2 ** 31, (24, 8), key=k1).astype(mx.uint32)  # any bits are 64 4-bit integers a row
    s = (mx.random.uniform(shape=(24, 2), key=k2) * 1e-2).astype(mx.float16)
    x = mx.random.normal((3, 64), key=k3)
    one = mx.ones((24, 2))
    q = mx.dequantize(w, one, mx.zeros_like(one), group_size=32, bits=4).astype(mx.int32)
    e = np.random.default_rng(17).integers(120, 136, (24, 2)).astype(np.uint8)  # MXFP4's exponents, 2**(e - 128)
    forms = [(cid, s, s.astype(mx.float32)) for cid in CODEBOOKS]
    forms.append((MXFP4, mx.array(e), mx.array(np.ldexp(np.float32(1), e.astype(np.int32) - 128))))
    for cid, held, scale in forms:
        levels = mx.take(mx.array(CODEBOOKS[cid].astype(np.float32)), q).reshape(24, 2, 32)
        want = x @ (levels * scale[..., None]).reshape(24, 64).T
        err = mx.abs(fn(x, w, held, None, 32, 4, "float32", None, cid) - want).max().item()
        if not err <= 1e-4 * (1 + mx.abs(want).max().item()):
            return f"a product of a codebook weight (codebook {cid}, {held.dtype} scales) off by {err:.3g}"
    return None


def _gather_self_test(fn, one) -> str | None:
    """``fn`` (gather_qmatmul) against ``one`` (qmatmul) on each chosen expert: the same bits for one row of x (a
    decode step's products), within float32 rounding for several (grouped by expert, other tiles); None when so."""
    key = mx.random.key(11)
    k1, k2 = mx.random.split(key)
    w = mx.random.normal((3, 24, 64), key=k1)
    x = mx.random.normal((5, 64), key=k2)
    q, s, b = mx.quantize(w, group_size=32, bits=4)
    idx = mx.array([[2, 0], [1, 2], [0, 0], [2, 1], [1, 0]], dtype=mx.int32)
    got = fn(x, q, s, b, idx, 32, 4)
    first = fn(x[:1], q, s, b, idx[:1], 32, 4)
    for n in range(5):
        for j in range(2):
            e = int(idx[n, j].item())
            want = one(x[n:n + 1], q[e], s[e], b[e], 32, 4)[0]
            if n == 0 and not mx.array_equal(first[0, j], want).item():
                return "a one-row expert product differs from qmatmul's"
            if not mx.abs(got[n, j] - want).max().item() <= 1e-4 * (1 + mx.abs(want).max().item()):
                return "an expert product of several rows is off"
    return None


def _int8_self_test(fn, kind: str = "int8") -> str | None:
    """int8 activations compute x_hat @ w.T per 32 elements as llama.cpp's Q8_0 / Q8_1 blocks: x_q = round(x * 127 /
    max|x|), x_hat = d * x_q with d = max|x| / 127 in float16, a bias meeting its group's float16 sum d * sum(x_q)
    (int16: x_q = round(x / d), d = max|x| / 32639 in float32, the sums d * sum(x_q)); a symmetric weight's integer
    sums take w_q - 2**(bits - 1); the integer sums are exact.
    Checked against MLX's float product, with and without biases; None when they agree."""
    x = mx.random.normal((5, 160), key=mx.random.key(11)).reshape(5, 5, 32)
    amax = mx.abs(x).max(axis=-1, keepdims=True)
    if kind == "int8":
        q = mx.round(x * (127 / amax))
        d = (amax / 127).astype(mx.float16).astype(mx.float32)
        sums = (amax / 127 * q.sum(axis=-1, keepdims=True)).astype(mx.float16).astype(mx.float32)
    else:
        d = amax / 32639
        q = mx.round(x * (1 / d))
        sums = d * q.sum(axis=-1, keepdims=True)
    x_hat = (q * d).reshape(5, 160)
    for bits in (4, 5, 8):
        wq, s, b = mx.quantize(mx.random.normal((24, 160), key=mx.random.key(bits)), group_size=32, bits=bits)
        for biases in (b, None):
            if biases is None:  # symmetric: integer sums of (w_q - 2**(bits - 1)) * x_q, no sums of x
                want = x_hat @ mx.dequantize(wq, s, s * -(2 ** (bits - 1)), group_size=32, bits=bits).T
            else:
                want = x_hat @ mx.dequantize(wq, s, mx.zeros_like(s), group_size=32, bits=bits).T + sums[..., 0] @ b.T
            err = mx.abs(fn(x.reshape(5, 160), wq, s, biases, 32, bits, kind) - want).max().item()
            if not err <= 1e-4 * (1 + mx.abs(want).max().item()):
                return f"{bits}-bit product with {kind} activations off by {err:.3g}"
    return None


def _widen_self_test(fn) -> str | None:
    """float16 and bfloat16 to float32 must be astype's, bit for bit: normals, subnormals, infinities, a strided view."""
    x = mx.concatenate([mx.random.normal((70,), key=mx.random.key(12)) * 3e4,
                        mx.array([6e-8, -3e-7, 1e-40, float("inf"), -float("inf"), 0.0, -0.0, 65504.0])])
    for dt in (mx.float16, mx.bfloat16):
        h = x.astype(dt)
        if not (mx.array_equal(fn(h), h.astype(mx.float32)).item()
                and mx.array_equal(fn(h[::3]), h[::3].astype(mx.float32)).item()):
            return f"widening {dt} differs from astype"
    return None


def _rope_self_test(fn) -> str | None:
    """RoPE from the table must be mx.fast.rope's, bit for bit, in both pair layouts."""
    x = mx.random.normal((1, 3, 5, 16), key=mx.random.key(9))
    for traditional in (False, True):
        cos, sin = rope_table(5, 2, 12, 10000.0, 1.0, None)
        want = mx.fast.rope(x, 12, traditional=traditional, base=10000.0, scale=1.0, offset=2)
        if not mx.array_equal(fn(x, cos, sin, 12, traditional), want).item():
            return "RoPE differs from mx.fast.rope"
    return None


def _attend_self_test(fn) -> str | None:
    """Against MLX's own attention: grouped heads, a strided cache view, with and without a mask."""
    k1, k2, k3 = mx.random.split(mx.random.key(11), 3)
    q = mx.random.normal((1, 6, 2, 32), key=k1)
    store = mx.random.normal((1, 2, 40, 32), key=k2)
    k, v = store[:, :, :23], mx.random.normal((1, 2, 23, 32), key=k3)
    mask = mx.where(mx.arange(23)[None] <= mx.array([[20], [22]]), 0.0, -mx.inf)
    for m in (None, mask):
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=m)
        if not mx.allclose(fn(q, k, v, 0.3, m), want, rtol=1e-5, atol=1e-5).item():
            return "attention differs from mx.fast.scaled_dot_product_attention"
    return None


def _qtake_self_test(fn) -> str | None:
    """Against ``mx.dequantize`` of the gathered rows, bit for bit: 4 and 6 bits, float16 scales, with biases and
    symmetric."""
    ids = mx.array([3, 0, 19, 3], dtype=mx.int32)
    for bits in (4, 6):
        w, s, b = mx.quantize(mx.random.normal((20, 128), key=mx.random.key(15 + bits)), group_size=32, bits=bits)
        s16 = s.astype(mx.float16)
        for biases in (b.astype(mx.float16), None):
            fs = s16.astype(mx.float32)
            fb = fs * -(2 ** (bits - 1)) if biases is None else biases.astype(mx.float32)
            want = mx.dequantize(w[ids], fs[ids], fb[ids], group_size=32, bits=bits)
            if not mx.array_equal(fn(w, s16, biases, ids, 32, bits), want).item():
                return "the quantized row lookup differs from mx.dequantize"
    return None


def _attend_cached_self_test(fn, rope_apply, attend) -> str | None:
    """The fused step against RoPE, the two slice updates and attention done apart (bit for bit), masked or not."""
    k1, k2, k3, k4, k5 = mx.random.split(mx.random.key(12), 5)
    q, k, v = (mx.random.normal((1, 6, 1, 32), key=k1), mx.random.normal((1, 2, 1, 32), key=k2),
               mx.random.normal((1, 2, 1, 32), key=k3))
    cos, sin = rope_table(1, 17, 32, 10000.0, 1.0, None)
    mask = mx.where(mx.arange(15)[None] != 3, 0.0, -mx.inf)
    for m, lo in ((None, 0), (mask, 3)):
        keys, values = mx.random.normal((1, 2, 40, 32), key=k4), mx.random.normal((1, 2, 40, 32), key=k5)
        mx.eval(keys, values)
        want_k = mx.array(keys)
        want_k[:, :, 17:18] = rope_apply(k, cos, sin, 32, False)
        want_v = mx.array(values)
        want_v[:, :, 17:18] = v
        want = attend(rope_apply(q, cos, sin, 32, False), want_k[:, :, lo:18], want_v[:, :, lo:18], 0.3, m)
        mx.eval(want, want_k, want_v)
        cells = mx.array([17, lo, 18, 0, 0], mx.int32)
        o, k_out, v_out = fn(q, k, v, mx.array(keys), mx.array(values), cos, sin, cells, 0.3, 32, False, m)
        if not all(mx.array_equal(a, b).item() for a, b in ((o, want), (k_out, want_k), (v_out, want_v))):
            return "the fused decode attention differs from RoPE, the cache writes and attention done apart"
    return None


def _norm_self_test(fn, add_fn) -> str | None:
    """Against ``mx.fast.rms_norm``, with and without a weight, on rows small enough for ``eps`` to count (on x86-64
    the two agree bit for bit; elsewhere MLX may sum the squares in another order); ``add_fn`` (a residual add, then
    the norm) against the two done apart."""
    x = mx.random.normal((2, 3, 40), key=mx.random.key(13)) * mx.array([1.0, 1e-3])[:, None, None]
    w = mx.random.normal((40,), key=mx.random.key(14))
    for weight in (w, None):
        if not mx.allclose(fn(x, weight, 1e-5), mx.fast.rms_norm(x, weight, 1e-5), rtol=2e-6, atol=0).item():
            return "RMSNorm differs from mx.fast.rms_norm"
        s, n = add_fn(x, x[::-1], weight, 1e-5)
        if not (mx.array_equal(s, x + x[::-1]).item() and mx.array_equal(n, fn(x + x[::-1], weight, 1e-5)).item()):
            return "the residual add and RMSNorm differ from the two done apart"
    return None


def _prologue_self_test(many, norm_fn, add_fn, act_fn) -> str | None:
    """``qmatmul_many``'s prologues (a residual add and the input norm; a gated activation) and output norms against
    the kernels apart: the same bits; None when they agree."""
    x, r = mx.random.normal((2, 64), key=mx.random.key(15)), mx.random.normal((2, 64), key=mx.random.key(16))
    w = mx.random.normal((64,), key=mx.random.key(17))
    q, s, b = mx.quantize(mx.random.normal((32, 64), key=mx.random.key(18)), group_size=32, bits=4)
    total, xn = add_fn(x, r, w, 1e-5)
    got = many(x, [q], [s], [b], [32], [4], None, "float32", "add_norm", [r, w], [w[:32]], 1e-5)
    if not (mx.array_equal(got[0], total).item()
            and mx.array_equal(got[1], norm_fn(many(xn, [q], [s], [b], [32], [4])[0], w[:32], 1e-5)).item()):
        return "a product's norm prologue or output norm differs from the kernels apart"
    got = many(x, [q], [s], [b], [32], [4], None, "float32", "silu", [r])
    if not mx.array_equal(got[0], many(act_fn(x, 0, r), [q], [s], [b], [32], [4])[0]).item():
        return "a product's activation prologue differs from the kernels apart"
    return None


def _output_mlp_self_test(fn, many) -> str | None:
    """``output_mlp`` against its three ``qmatmul_many`` nodes apart (the output projection with its norm; the
    residual add, the norm, gate and up; the activation and down with its norm), and with the next layer's input
    (``next_norm`` and its weights) against ``output_mlp`` then that layer's ``add_norm`` node: the same bits; None
    when so."""
    keys = iter(mx.random.split(mx.random.key(19), 9))
    o, h = mx.random.normal((1, 2, 64), key=next(keys)), mx.random.normal((1, 1, 32), key=next(keys))
    norms = [mx.random.normal((32,), key=next(keys)) for _ in range(3)]
    ws = [mx.quantize(mx.random.normal(shape, key=next(keys)), group_size=32, bits=4)
          for shape in ((32, 128), (64, 32), (64, 32), (32, 64))]
    arg = [(q, s, b, 32, 4, None, False) for q, s, b in ws]
    for act, kind, o_norm, d_norm in (("silu", 0, None, None), ("gelu_tanh", 1, norms[1], norms[2])):
        s_got, m_got = fn(o, h, arg[0], norms[0], arg[1], arg[2], arg[3], act, 1e-5, o_norm, d_norm)
        y = many(o.reshape(1, 1, 128), [ws[0][0]], [ws[0][1]], [ws[0][2]], [32], [4], None, "float32", "none", [],
                 [o_norm], 1e-5)[0]
        s_want, g, u = many(h, [w[0] for w in ws[1:3]], [w[1] for w in ws[1:3]], [w[2] for w in ws[1:3]], [32, 32],
                            [4, 4], None, "float32", "add_norm", [y, norms[0]], None, 1e-5)
        m_want = many(g, [ws[3][0]], [ws[3][1]], [ws[3][2]], [32], [4], None, "float32", act, [u], [d_norm], 1e-5)[0]
        if not (mx.array_equal(s_got, s_want).item() and mx.array_equal(m_got, m_want).item()):
            return f"output_mlp ({act}) differs from its products apart"
    # with the next layer's input norm and projections (a decode step's layer boundary): that layer's node's bits
    nxt = [arg[1], arg[2]]
    got = fn(o, h, arg[0], norms[0], arg[1], arg[2], arg[3], "silu", 1e-5, None, None, "float32", norms[1], nxt,
             [[1, 2, 1, 32], [1, 2, 1, 32]], [norms[2], None])
    s, m = fn(o, h, arg[0], norms[0], arg[1], arg[2], arg[3], "silu", 1e-5, None, None)
    want = many(s, [w[0] for w in ws[1:3]], [w[1] for w in ws[1:3]], [w[2] for w in ws[1:3]], [32, 32], [4, 4],
                [[1, 2, 1, 32], [1, 2, 1, 32]], "float32", "add_norm", [m, norms[1]], [norms[2], None], 1e-5)
    if len(got) != 3 or not all(mx.array_equal(a, b).item() for a, b in zip(got, want)):
        return "output_mlp with the next layer's input differs from its products apart"
    return None


def _softmax_self_test(fn) -> str | None:
    """Against MLX's softmax, rows of an odd length with -inf among them; a row of -inf only gives zeros. Within
    rounding, not bit for bit (the tests ask that): another MLX's exp must not turn every kernel off."""
    x = mx.random.normal((5, 37), key=mx.random.key(13)) * 4
    x = mx.where(mx.arange(37) % 5 == 2, -mx.inf, x)
    if not mx.allclose(fn(x), mx.softmax(x, axis=-1, precise=True), rtol=1e-5, atol=1e-7).item():
        return "softmax differs from mx.softmax"
    if not mx.array_equal(fn(mx.full((1, 3), -mx.inf)), mx.zeros((1, 3))).item():
        return "softmax of a hidden row is not zeros"
    return None


def _activation_self_test(fn) -> str | None:
    """SiLU and tanh-form GELU against mlx.nn's, over the range where they bend and far out."""
    import mlx.nn as nn

    x = mx.concatenate([mx.linspace(-12, 12, 97), mx.array([-90.0, -40.0, 0.0, 40.0, 90.0])])
    for kind, ref in ((0, nn.silu), (1, nn.gelu_approx)):
        if not mx.allclose(fn(x, kind), ref(x), rtol=1e-5, atol=1e-6).item():
            return f"{ref.__name__} differs from mlx.nn's"
    return None


def rope_table(tokens: int, positions, dims: int, base, scale: float, freqs) -> tuple:
    """``(cos, sin)`` float32 ``[rows, dims / 2]``: the angles ``mx.fast.rope`` would use, taken from it (rotating
    the unit vector ``(1, 0)`` of each pair gives ``(cos, sin)`` exactly), so that :data:`rope_apply` matches it bit
    for bit. ``positions``: an int offset (rows = ``tokens`` consecutive positions) or int32 ``[N]`` (one per row)."""
    half = dims // 2
    if isinstance(positions, int):
        unit = mx.concatenate([mx.ones((1, 1, tokens, half)), mx.zeros((1, 1, tokens, half))], axis=-1)
    else:
        unit = mx.concatenate([mx.ones((positions.size, 1, 1, half)), mx.zeros((positions.size, 1, 1, half))],
                              axis=-1)
    t = mx.fast.rope(unit, dims, traditional=False, base=base, scale=scale, offset=positions, freqs=freqs)
    t = t.reshape(-1, dims)
    return t[:, :half], t[:, half:]


_ROPE_CHUNK = 1024  # positions per table of rope_row
_rope_chunks: "OrderedDict[tuple, tuple]" = OrderedDict()
_rope_lock = threading.Lock()


def rope_row(position: int, dims: int, base, scale: float) -> tuple:
    """``(cos, sin)`` float32 ``[1, dims / 2]`` of one ``position`` (a decode step): a row of a :func:`rope_table`
    made for 1024 positions at a time (the last 8 such tables kept), so that a step slices its angles (a node each)
    instead of making them (about 25 nodes). Bit for bit ``rope_table(1, position, ...)``: the angle of a position
    does not depend on the table it is computed in (checked by the tests)."""
    key = (dims, base, scale, position // _ROPE_CHUNK)
    with _rope_lock:
        table = _rope_chunks.get(key)
        if table is None:
            table = rope_table(_ROPE_CHUNK, key[3] * _ROPE_CHUNK, dims, base, scale, None)
            mx.eval(*table)
            _rope_chunks[key] = table
            if len(_rope_chunks) > 8:
                _rope_chunks.popitem(last=False)
        else:
            _rope_chunks.move_to_end(key)
    r = position % _ROPE_CHUNK
    return table[0][r:r + 1], table[1][r:r + 1]


def _load() -> None:
    global qmatmul, qmatmul_many, output_mlp, gather_qmatmul, rope_apply, attend, attend_cached, qtake, rms_norm
    global add_rms_norm, activation, widen, softmax, huge_pages
    global activations, _status, _note, _kernels_module
    if os.environ.get("MLX_ENGINE_KERNELS", "1").lower() in ("0", "false", "no", "off"):
        _status = "off (MLX_ENGINE_KERNELS=0)"
        return
    try:
        # by name: a compiled module, not a source file, which an import statement would make look like an import of
        # the mlx_engine.mlx package (and a cycle through its __init__)
        _kernels = importlib.import_module("mlx_engine.mlx._kernels")
    except ImportError as e:
        _status = f"not built ({e}); reinstall mlx-engine with a C++ compiler and CMake to build them"
        return
    if _kernels.mlx_version != mx.__version__.split(".dev")[0]:
        _status = (f"built for MLX {_kernels.mlx_version}, but MLX {mx.__version__} is installed; reinstall "
                   "mlx-engine to rebuild them")
        return
    if _kernels.isa() == "x86-64 without AVX2":
        _status = "not usable on this CPU (an x86-64 without AVX2 and FMA, which they need)"
        return
    try:
        with mx.stream(mx.cpu):
            problem = (_self_test(_kernels.qmatmul, _kernels.qmatmul_many) or _rope_self_test(_kernels.rope_apply)
                       or _attend_self_test(_kernels.attend)
                       or _attend_cached_self_test(_kernels.attend_cached, _kernels.rope_apply, _kernels.attend)
                       or _qtake_self_test(_kernels.qtake)
                       or _norm_self_test(_kernels.rms_norm, _kernels.add_rms_norm)
                       or _activation_self_test(_kernels.activation) or _widen_self_test(_kernels.widen)
                       or _softmax_self_test(_kernels.softmax)
                       or _prologue_self_test(_kernels.qmatmul_many, _kernels.rms_norm, _kernels.add_rms_norm,
                                              _kernels.activation)
                       or _output_mlp_self_test(_kernels.output_mlp, _kernels.qmatmul_many))
    except Exception as e:  # a broken build must not stop the engine: it falls back to MLX's operations
        problem = f"{type(e).__name__}: {e}"
    if problem:
        _status = f"failed their self-test ({problem})"
        return
    qmatmul, qmatmul_many, rope_apply, attend = (_kernels.qmatmul, _kernels.qmatmul_many, _kernels.rope_apply,
                                                 _kernels.attend)
    attend_cached, qtake = _kernels.attend_cached, _kernels.qtake
    rms_norm, add_rms_norm, activation = _kernels.rms_norm, _kernels.add_rms_norm, _kernels.activation
    widen, softmax, gather_qmatmul = _kernels.widen, _kernels.softmax, _kernels.gather_qmatmul
    output_mlp = _kernels.output_mlp
    huge_pages = _kernels.huge_pages
    _kernels_module = _kernels
    _status = f"{_kernels.isa()}, {_kernels.threads()} threads"
    asked = os.environ.get("MLX_ENGINE_ACTIVATIONS", "float32").lower()
    if asked in ("int8", "int16"):
        problem = activations_problem(asked)
        _note = f" ({asked}: {problem})" if problem else ""
        activations = "float32" if problem else asked
    elif asked != "float32":
        _note = f" (MLX_ENGINE_ACTIVATIONS={asked!r} is none of float32, int8, int16)"


def int8_problem() -> str | None:
    """Why int8 activations cannot run here (the kernels are off, the CPU lacks both AVX-512 VNNI and AVX2, or their self-test
    failed), or None where they can. The self-test runs once per process, on first need."""
    return activations_problem("int8")


def activations_problem(kind: str) -> str | None:
    """Why ``kind`` activations (``"int8"`` or ``"int16"``) cannot run here (the kernels are off, the CPU lacks the
    instructions: int8 and int16 need AVX-512 VNNI or AVX2; or the kernel failed its self-test), or None
    where they can. Each self-test runs once per process, on first need."""
    if qmatmul is None or _kernels_module is None:
        return f"the CPU kernels are not in use: {_status}"
    with _self_test_lock:
        if kind not in _activation_problems:
            int8 = kind == "int8"
            if not (_kernels_module.int8_supported() if int8 else _kernels_module.int16_supported()):
                problem = "it needs AVX-512 VNNI or AVX2, which this CPU lacks"
            else:
                with mx.stream(mx.cpu):
                    failed = _int8_self_test(_kernels_module.qmatmul, kind)
                problem = f"the {kind} kernel failed its self-test ({failed})" if failed else None
            _activation_problems[kind] = problem
        return _activation_problems[kind]


def gather_problem() -> str | None:
    """Why :data:`gather_qmatmul` cannot run here (the kernels are off, or its self-test failed), or None where it
    can. Its self-test runs once per process, on first need (a model with experts), not at import: an import that
    took longer on every rank had moved where a distributed run's ranks stood when one of them was killed, and
    exposed the ring transport's hang on a collective issued after it has given a peer up."""
    global _gather_problem
    if gather_qmatmul is None or _kernels_module is None:
        return f"the CPU kernels are not in use: {_status}"
    if _gather_problem != "not checked":  # (every expert product asks: no lock once it is known)
        return _gather_problem
    with _self_test_lock:
        if _gather_problem == "not checked":
            with mx.stream(mx.cpu):
                problem = _gather_self_test(gather_qmatmul, qmatmul)
            _gather_problem = f"gather_qmatmul failed its self-test ({problem})" if problem else None
        return _gather_problem


def status(activations_in_use: str | None = None) -> str:
    """The CPU kernels in one line: the instruction set, threads and activations (``activations_in_use``, or the
    process default :data:`activations`), or why they are not used."""
    if qmatmul is None:
        return _status
    return f"{_status}, {activations_in_use or activations} activations{_note}"


_load()
