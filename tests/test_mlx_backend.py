"""The MLX implementation of the ``ml`` interfaces: each Tensor operation against a NumPy reference, device choice,
the BLAS switch, memory controls."""

from __future__ import annotations

import ctypes.util
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from mlx_engine.errors import EngineError
from mlx_engine.ml import DType
from mlx_engine.mlx import MLXBackend, MLXContext

RNG = np.random.default_rng(0)


def r(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


@pytest.fixture
def ctx():
    return MLXContext()


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(a.numpy() if hasattr(a, "numpy") else a, b, rtol=tol, atol=tol)


def test_arithmetic_and_reductions(ctx):
    a, b = r(3, 4), r(3, 4)
    ta, tb = ctx.from_numpy(a), ctx.from_numpy(b)
    close(ta + tb, a + b)
    close(ta - 2.0, a - 2.0)
    close(1.0 - ta, 1.0 - a)
    close(ta * tb, a * b)
    close(ta / 3.0, a / 3.0)
    close(-ta, -a)
    close(ta @ tb.transpose(1, 0), a @ b.T, 1e-4)
    close(ta.linear(tb), a @ b.T, 1e-4)
    close(ta.exp(), np.exp(a))
    close(ta.maximum(tb), np.maximum(a, b))
    close(ta.sum(axis=1), a.sum(1), 1e-4)
    close(ta.mean(axis=0, keepdims=True), a.mean(0, keepdims=True))
    close(ta.max(axis=1), a.max(1))
    assert ta.argmax(-1).numpy().tolist() == a.argmax(-1).tolist()
    close(ta.logsumexp(-1), np.log(np.exp(a).sum(-1)), 1e-5)
    close(ta.cumsum(1), np.cumsum(a, 1), 1e-5)
    assert (ta.compare(">", 0.0).where(1.0, 0.0).numpy() == (a > 0)).all()
    assert ta.argsort(-1, descending=True).numpy().tolist() == np.argsort(-a, -1).tolist()


def test_indexing_and_in_place_updates(ctx):
    a = r(2, 5, 3)
    t = ctx.from_numpy(a)
    close(t[:, 1:3], a[:, 1:3])
    close(t.reshape(10, 3), a.reshape(10, 3))
    close(t.take(ctx.from_list([4, 0], DType.INT32), axis=1), a[:, [4, 0]])
    t[:, 0:2] = ctx.zeros((2, 2, 3), DType.FLOAT32)
    expected = a.copy()
    expected[:, 0:2] = 0
    close(t, expected)
    idx = ctx.from_list([[1], [0]], DType.INT32)
    m = ctx.from_numpy(a[:, :, 0])
    close(m.take_along_axis(idx, 1), np.take_along_axis(a[:, :, 0], np.array([[1], [0]]), 1))


def test_norms(ctx):
    x, w, b = r(2, 3, 8), r(8), r(8)
    t = ctx.from_numpy(x)
    rms = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-6) * w
    close(t.rms_norm(ctx.from_numpy(w), 1e-6), rms, 1e-5)
    ln = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * w + b
    close(t.layer_norm(ctx.from_numpy(w), ctx.from_numpy(b), 1e-5), ln, 1e-4)
    img = r(2, 4, 4, 8)
    g = img.reshape(2, 16, 2, 4)
    gn = ((g - g.mean((1, 3), keepdims=True)) / np.sqrt(g.var((1, 3), keepdims=True) + 1e-5)).reshape(img.shape)
    close(ctx.from_numpy(img).group_norm(2, ctx.from_numpy(w), ctx.from_numpy(b), 1e-5), gn * w + b, 1e-4)
    close(t.softmax(-1), np.exp(x) / np.exp(x).sum(-1, keepdims=True), 1e-5)


def _rope_ref(x, offset, base, traditional):
    b, h, n, d = x.shape
    inv = base ** (-np.arange(0, d, 2) / d)
    ang = (np.arange(n) + offset)[:, None] * inv[None]
    cos, sin = np.cos(ang), np.sin(ang)
    if traditional:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x1 * cos - x2 * sin
        out[..., 1::2] = x1 * sin + x2 * cos
        return out
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


@pytest.mark.parametrize("traditional", [False, True])
def test_rope(ctx, traditional):
    x = r(1, 2, 5, 8)
    close(ctx.from_numpy(x).rope(3, 8, base=10000.0, traditional=traditional),
          _rope_ref(x, 3, 10000.0, traditional), 1e-4)


def test_rope_angles_give_the_rotation_of_the_positions(ctx):
    """Angles made once (Context.rope_angles, what every layer of a forward pass shares) rotate exactly as RoPE from
    the positions does: consecutive positions from an offset, and one position per token (a batch of sequences)."""
    from mlx_engine.mlx import cpu_kernels, runtime
    runtime.select_device("cpu")
    if cpu_kernels.rope_apply is None:  # no kernel: the backend makes no angles and callers pass the positions
        assert ctx.rope_angles(3, 5, 8, 10000.0, 1.0, None, DType.FLOAT32) is None
        return
    x = ctx.from_numpy(r(1, 2, 5, 8))
    for traditional in (False, True):
        angles = ctx.rope_angles(3, 5, 8, 10000.0, 1.0, None, DType.FLOAT32)
        assert np.array_equal(x.rope(angles, 8, traditional=traditional).numpy(),
                              x.rope(3, 8, base=10000.0, traditional=traditional).numpy())
        pos = np.array([7, 0, 2, 40, 3], np.int32)
        angles = ctx.rope_angles(ctx.from_numpy(pos), 5, 8, 500.0, 0.5, None, DType.FLOAT32)
        per_token = x.transpose(2, 1, 0, 3).rope(ctx.from_numpy(pos), 8, base=500.0, scale=0.5,
                                                 traditional=traditional).transpose(2, 1, 0, 3)
        assert np.array_equal(x.rope(angles, 8, traditional=traditional).numpy(), per_token.numpy())
    assert ctx.rope_angles(3, 5, 8, 10000.0, 1.0, None, DType.BFLOAT16) is None  # the kernel is float32 only
    with pytest.raises(ValueError, match="RoPE angles apply to float32"):
        x.astype(DType.BFLOAT16).rope(angles, 8)


def test_attention_with_mask_and_gqa(ctx):
    q, k, v = r(1, 4, 3, 8), r(1, 2, 5, 8), r(1, 2, 5, 8)
    mask = np.where(np.tril(np.ones((3, 5)), 2) > 0, 0, -np.inf).astype(np.float32)
    out = ctx.scaled_dot_product_attention(ctx.from_numpy(q), ctx.from_numpy(k), ctx.from_numpy(v), 0.3,
                                           ctx.from_numpy(mask))
    kk, vv = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
    s = q @ kk.transpose(0, 1, 3, 2) * 0.3 + mask
    p = np.exp(s - s.max(-1, keepdims=True))
    close(out, (p / p.sum(-1, keepdims=True)) @ vv, 1e-5)


def test_a_later_prompt_chunk_attends_block_by_block(ctx):
    """A prompt's second chunk (1024 queries after 1024 cached keys, 9 heads over 3 key heads as smollm2's) attends
    in blocks of queries, each computed before the next is made: the values of one attention over the whole mask,
    and, over three layers chained as in a forward pass, a peak of memory of one block's score matrix (256 of the
    1024 queries: 18 MiB) beside the queries and outputs kept here (13.5 MiB): measured 35 MiB, where blocks left in
    the graph held 139 MiB and the unsplit chunk three whole score matrices (72 MiB each) a layer."""
    import mlx.core as mx

    from mlx_engine.mlx import runtime
    from mlx_engine.mlx.tensor import MLXTensor

    runtime.select_device("cpu")
    n, s = 1024, 2048
    visible = np.arange(s)[None, :] <= np.arange(s - n, s)[:, None]
    mask = ctx.attention_mask(visible, DType.FLOAT32)
    assert mask.blocks is not None  # few keys hidden (a fifth), split all the same
    h, wq = ctx.from_numpy(r(1, n, 576)), ctx.from_numpy(r(576, 576) * 0.05)
    k, v = ctx.from_numpy(r(1, 3, s, 64)), ctx.from_numpy(r(1, 3, s, 64))
    mx.eval(h.a, wq.a, k.a, v.a, mask.a)
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    x, queries, outs = h.a, [], []
    for _ in range(3):  # a layer: queries from the last layer's output, attention, the residual add
        q = (x @ wq.a).reshape(1, n, 9, 64).transpose(0, 2, 1, 3)
        o = ctx.scaled_dot_product_attention(MLXTensor(q), k, v, 0.125, mask).a
        queries.append(q), outs.append(o)
        x = o.transpose(0, 2, 1, 3).reshape(1, n, 576) + x
    mx.eval(x, *queries, *outs)
    whole_scores = 9 * n * s * 4
    assert mx.get_peak_memory() - base < 0.5 * whole_scores + sum(a.nbytes for a in queries + outs)
    for q, o in zip(queries, outs):
        close(o, np.array(mx.fast.scaled_dot_product_attention(q, k.a, v.a, scale=0.125, mask=mask.a)), 1e-5)


def test_activations_conv_and_upsample(ctx):
    x = r(2, 6)
    t = ctx.from_numpy(x)
    erf = np.vectorize(math.erf)
    close(t.gelu(), 0.5 * x * (1 + erf(x / math.sqrt(2))), 1e-5)
    close(t.gelu(approximate=True), 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))), 1e-5)
    close(t.silu(), x / (1 + np.exp(-x)), 1e-5)
    img, w = r(1, 5, 5, 3), r(4, 3, 3, 3)
    out = ctx.from_numpy(img).conv2d(ctx.from_numpy(w), padding=1).numpy()
    padded = np.pad(img, ((0, 0), (1, 1), (1, 1), (0, 0)))
    ref = np.zeros((1, 5, 5, 4), np.float32)
    for i in range(5):
        for j in range(5):
            ref[0, i, j] = np.einsum("hwc,ohwc->o", padded[0, i:i + 3, j:j + 3], w)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)
    up = ctx.from_numpy(img).upsample_nearest(2).numpy()
    np.testing.assert_array_equal(up, img.repeat(2, axis=1).repeat(2, axis=2))


def test_random_draws_follow_the_seed(ctx):
    logits = ctx.from_numpy(np.zeros((4, 50), np.float32))
    a = ctx.categorical(logits, ctx.random_key(5)).numpy()
    b = ctx.categorical(logits, ctx.random_key(5)).numpy()
    c = ctx.categorical(logits, ctx.random_key(6)).numpy()
    assert (a == b).all() and not (a == c).all()
    n1 = ctx.random_normal((1000,), DType.FLOAT32, ctx.random_key(1)).numpy()
    assert abs(n1.mean()) < 0.15 and abs(n1.std() - 1) < 0.1


def test_memory_controls():
    backend = MLXBackend()
    ctx = backend.new_context()
    backend.reset_peak_memory()
    t = ctx.zeros((1024, 1024), DType.FLOAT32)
    ctx.evaluate(t)
    assert backend.active_memory() >= 4 * 2**20
    assert backend.peak_memory() >= 4 * 2**20
    previous = backend.set_cache_limit(0)
    assert isinstance(previous, int)
    backend.set_cache_limit(previous)
    assert backend.set_wired_limit(0) == 0  # not Metal: a no-op
    del t
    backend.clear_cache()


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)


def test_device_choice_and_blas_switch():
    out = _python("from mlx_engine.mlx import MLXBackend; print(MLXBackend().name)", MLX_ENGINE_DEVICE="cpu",
                  MLX_ENGINE_OPENBLAS="0")
    assert out.returncode == 0, out.stderr
    assert "cpu" in out.stdout and "OpenBLAS disabled" in out.stdout
    bad = _python("from mlx_engine.mlx import MLXBackend\ntry:\n MLXBackend(device='tpu')\nexcept Exception as e:"
                  "\n print(type(e).__name__, e)")
    assert "EngineError" in bad.stdout and "unknown device" in bad.stdout
    if sys.platform.startswith("linux"):  # BLAS is the CPU's: on a machine with a GPU the default device is that
        out = _python("from mlx_engine.mlx import MLXBackend; print(MLXBackend().name)", MLX_ENGINE_DEVICE="cpu")
        has_openblas = ctypes.util.find_library("openblas") is not None
        assert ("OpenBLAS (" in out.stdout) == has_openblas, out.stdout


def test_unavailable_gpu_is_a_clear_error():
    from mlx_engine.mlx.runtime import _cuda_available, mx, select_device

    if mx.metal.is_available() or _cuda_available():
        pytest.skip("a GPU is present")  # the error case only exists without an accelerator
    with pytest.raises(EngineError, match=r"use --device cpu"):  # the user typed the flag: the flag is the fix
        select_device("gpu")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLX_ENGINE_DEVICE", "gpu")
        with pytest.raises(EngineError, match="use MLX_ENGINE_DEVICE=cpu"):
            select_device(None)
    select_device("cpu")
