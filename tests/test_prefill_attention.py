"""A prefill's attention on the CPU: our attention kernel in blocks of queries over the keys each block sees (within
float32 rounding of the float64 definition), and where it does not run (several batch rows), MLX's own computation
(two products and a softmax) with our softmax kernel in place of MLX's, which runs one element at a time on one
thread: the same bits, vectorized and threaded."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_engine.mlx.runtime import mx  # noqa: E402  (MLX after the BLAS)
from mlx_engine.mlx import attention as mlx_attention, backend as mlx_backend, cpu_kernels  # noqa: E402
from mlx_engine.ml import DType  # noqa: E402
from mlx_engine.mlx.tensor import MLXTensor  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _on_the_cpu():
    with mx.stream(mx.cpu):
        yield


def _softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _assert_softmax(got: np.ndarray, x: np.ndarray) -> None:
    """``got`` within float32 rounding of the softmax of ``x``: 2e-6 relative, plus what rounding the argument
    ``x - max`` of exp to float32 moves exp by (``|x - max| * 2**-24`` relative: 2.4e-6 at -40)."""
    want = _softmax64(x)
    shift = np.abs(np.where(np.isinf(x), 0.0, x.astype(np.float64) - x.max(axis=-1, keepdims=True)))
    assert np.all(np.abs(got - want) <= want * (2e-6 + shift * 2.0 ** -23) + 1e-38)


@pytest.mark.parametrize("shape", [(1, 1), (7, 17), (3, 1000), (2, 9, 40, 2048)])
def test_softmax_is_mlx_softmax_bit_for_bit(shape):
    """MLX's CPU softmax's bits (its exp approximation and its sums in order) and, within float32 rounding, the
    softmax itself (float64): rows of odd lengths, hidden (-inf) elements, scores past exp's range (-88, 88), sizes
    split over the threads (the last: 720 rows of 2048), in place, a strided view, and the gradient (MLX's)."""
    assert cpu_kernels.softmax is not None, cpu_kernels.status()
    rng = np.random.default_rng(len(shape))
    x = (rng.standard_normal(shape) * 30).astype(np.float32)
    x[..., 1::7] = -np.inf
    x[..., 0] = rng.standard_normal(shape[:-1])  # every row sees something
    got = np.array(cpu_kernels.softmax(mx.array(x)))
    want = np.array(mx.softmax(mx.array(x), axis=-1, precise=True))
    assert got.dtype == np.float32 and got.shape == x.shape
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.all(got[..., 1::7] == 0)
    _assert_softmax(got, x)
    # scores that only the graph holds (a prefill's): computed in their own buffer, the same bits
    assert np.array_equal(np.array(cpu_kernels.softmax(mx.array(x) + 0.0)), got)
    view = mx.array(x)[..., ::2]
    assert np.array_equal(np.array(cpu_kernels.softmax(view)), np.array(mx.softmax(view, axis=-1, precise=True)))
    small = mx.array(np.where(np.isinf(x), -30.0, x).reshape(-1, shape[-1])[:3])
    ct = mx.array(rng.standard_normal(small.shape).astype(np.float32))
    np.testing.assert_allclose(np.array(mx.grad(lambda a: (cpu_kernels.softmax(a) * ct).sum())(small)),
                               np.array(mx.grad(lambda a: (mx.softmax(a, axis=-1) * ct).sum())(small)),
                               rtol=1e-5, atol=1e-7)


def test_softmax_of_a_row_that_sees_nothing_is_zeros():
    """A row of -inf only (every key hidden) gives no weight at all, not NaN; its neighbours are unaffected."""
    x = mx.array([[-np.inf] * 5, [0.0, 1.0, -np.inf, 2.0, 3.0]], dtype=mx.float32)
    got = np.array(cpu_kernels.softmax(x))
    assert np.array_equal(got[0], np.zeros(5, np.float32))
    _assert_softmax(got[1], np.array(x)[1])
    with pytest.raises(ValueError, match="float32"):
        cpu_kernels.softmax(x.astype(mx.float16))


@pytest.mark.parametrize("heads, kv_heads, n, dim", [(9, 3, 600, 64), (4, 4, 70, 32), (8, 1, 33, 256)])
def test_prefill_attention_is_mlx_attention_bit_for_bit(heads, kv_heads, n, dim, monkeypatch):
    """Where our attention kernel does not take a prefill (several batch rows; here turned off), the backend's
    attention of many queries with our softmax gives the bits it gave with MLX's
    (``mx.fast.scaled_dot_product_attention``): grouped heads, a causal mask (split into blocks of queries from 512
    queries on, each block MLX's attention over the keys it sees), and no mask (one call of MLX's)."""
    monkeypatch.setattr(mlx_attention.runtime, "on_cpu", True)
    monkeypatch.setattr(mlx_attention, "_prefill_rows", lambda *a: False)
    assert mlx_attention.cpu_kernels.softmax is not None
    rng = np.random.default_rng(heads * n)
    q, k, v = (MLXTensor(mx.array(rng.standard_normal((1, h, n, dim)).astype(np.float32)))
               for h in (heads, kv_heads, kv_heads))
    scale = dim ** -0.5
    ctx = mlx_backend.MLXContext()
    mask = ctx.attention_mask(np.tril(np.ones((n, n), bool)), DType.FLOAT32)
    assert (mask.blocks is not None) == (n >= 2 * mlx_attention.ATTENTION_BLOCK)  # blocks of queries where it pays
    got = [np.array(ctx.scaled_dot_product_attention(q, k, v, scale, m).a) for m in (mask, None)]
    monkeypatch.setattr(cpu_kernels, "softmax", None)  # MLX's own attention, as without our kernels
    want = [np.array(ctx.scaled_dot_product_attention(q, k, v, scale, m).a) for m in (mask, None)]
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
    assert np.array_equal(got[1], np.array(mx.fast.scaled_dot_product_attention(q.a, k.a, v.a, scale=scale)))


def _attention64(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, visible: np.ndarray | None) -> np.ndarray:
    """softmax(q k^T * scale + mask) v in float64, grouped heads (query head h reads key/value head h // rep)."""
    rep = q.shape[1] // k.shape[1]
    k64, v64 = (np.repeat(a.astype(np.float64), rep, axis=1) for a in (k, v))
    scores = np.einsum("bhnd,bhsd->bhns", q.astype(np.float64), k64) * scale
    if visible is not None:
        scores = np.where(visible, scores, -np.inf)
    return np.einsum("bhns,bhsd->bhnd", _softmax64(scores), v64)


@pytest.mark.parametrize("heads, kv_heads, n, dim, window", [(9, 3, 600, 64, None), (4, 4, 70, 32, None),
                                                             (8, 1, 200, 256, 48), (2, 1, 17, 64, None)])
def test_prefill_attention_by_our_kernel_is_attention(heads, kv_heads, n, dim, window, monkeypatch):
    """On the CPU with our kernels, a prefill's attention runs our kernel in blocks of ``PREFILL_BLOCK`` queries,
    each over the keys its queries see: within float32 rounding of the float64 definition with a causal mask, a
    sliding window (Gemma 3's local layers), no mask, grouped heads and a last partial block, each block over the keys
    its queries see or over all of them; and MLX's products no longer run (so no BLAS)."""
    monkeypatch.setattr(mlx_attention.runtime, "on_cpu", True)
    rng = np.random.default_rng(heads * n + dim)
    q, k, v = (rng.standard_normal((1, h, n, dim)).astype(np.float32) for h in (heads, kv_heads, kv_heads))
    scale = dim ** -0.5
    ctx = mlx_backend.MLXContext()
    at = np.arange(n)
    visible = at[None, :] <= at[:, None]
    if window is not None:
        visible &= at[None, :] > at[:, None] - window
    mask = ctx.attention_mask(visible, DType.FLOAT32)
    qt, kt, vt = (MLXTensor(mx.array(a)) for a in (q, k, v))
    monkeypatch.setattr(mlx_attention, "_rows_attention", None)  # would raise if MLX's products ran
    attend, keys = mlx_attention.cpu_kernels.attend, []

    def counting(q_, k_, *rest):  # the keys each call of the kernel reads
        keys.append(k_.shape[2])
        return attend(q_, k_, *rest)
    monkeypatch.setattr(mlx_attention.cpu_kernels, "attend", counting)
    for m, seen in ((mask, visible), (None, None)):
        keys.clear()
        got = np.array(ctx.scaled_dot_product_attention(qt, kt, vt, scale, m).a)
        blocks = -(-n // mlx_attention.PREFILL_BLOCK)
        assert len(keys) == blocks
        if m is not None and blocks > 1:  # a block reads only the keys its queries see
            cols = [seen[q0:q0 + mlx_attention.PREFILL_BLOCK].any(axis=0).nonzero()[0]
                    for q0 in range(0, n, mlx_attention.PREFILL_BLOCK)]
            assert keys == [int(c[-1] - c[0]) + 1 for c in cols]
            assert sum(keys) < blocks * n
        elif m is None:
            assert keys == [n] * blocks
        assert got.shape == (1, heads, n, dim) and got.dtype == np.float32
        want = _attention64(q, k, v, scale, seen)
        assert np.max(np.abs(got - want)) <= 2e-6 * np.max(np.abs(want)) * dim ** 0.5
    spans = mask.spans
    assert spans[0][0] == 0 and spans[1][-1] == n and spans[1][0] == 1  # the first query sees key 0 alone
    # every block over all the keys (the mask hiding the rest): the same values to float32 rounding (the kernel's
    # chunks of keys, so the order of its sums, follow the number of keys)
    whole = np.array(mlx_attention._kernel_blocks_attention(qt.a, kt.a, vt.a, scale, mask.a, None))
    want = _attention64(q, k, v, scale, visible)
    assert np.max(np.abs(whole - want)) <= 2e-6 * np.max(np.abs(want)) * dim ** 0.5
