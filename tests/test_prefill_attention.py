"""A prefill's attention on the CPU: MLX's own computation (two products and a softmax) with our softmax kernel in
place of MLX's, which runs one element at a time on one thread: the same bits, vectorized and threaded."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_engine.mlx.runtime import mx  # noqa: E402  (MLX after the BLAS)
from mlx_engine.mlx import backend as mlx_backend, cpu_kernels  # noqa: E402
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
    """The backend's attention of many queries with our softmax gives the bits it gave with MLX's
    (``mx.fast.scaled_dot_product_attention``): grouped heads, a causal mask (split into blocks of queries from 512
    queries on, each block MLX's attention over the keys it sees), and no mask (one call of MLX's)."""
    assert mlx_backend.cpu_kernels.softmax is not None
    rng = np.random.default_rng(heads * n)
    q, k, v = (MLXTensor(mx.array(rng.standard_normal((1, h, n, dim)).astype(np.float32)))
               for h in (heads, kv_heads, kv_heads))
    scale = dim ** -0.5
    ctx = mlx_backend.MLXContext()
    mask = ctx.attention_mask(np.tril(np.ones((n, n), bool)), DType.FLOAT32)
    assert (mask.blocks is not None) == (n >= 2 * mlx_backend.ATTENTION_BLOCK)  # blocks of queries where it pays
    got = [np.array(ctx.scaled_dot_product_attention(q, k, v, scale, m).a) for m in (mask, None)]
    monkeypatch.setattr(cpu_kernels, "softmax", None)  # MLX's own attention, as without our kernels
    want = [np.array(ctx.scaled_dot_product_attention(q, k, v, scale, m).a) for m in (mask, None)]
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
    assert np.array_equal(got[1], np.array(mx.fast.scaled_dot_product_attention(q.a, k.a, v.a, scale=scale)))
