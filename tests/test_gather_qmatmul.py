"""A mixture of experts' products with quantized experts: our CPU kernel (gather_qmatmul) against MLX's dequantize +
matmul of each chosen expert, bit for bit against qmatmul for one row of x, the engine's gather_linear on it and on
MLX's gather_qmm, and a bad index that must not read outside the weights."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from mlx_engine.mlx import cpu_kernels  # noqa: E402
from mlx_engine.mlx.tensor import MLXQuantizedTensor, MLXTensor  # noqa: E402

needs_kernels = pytest.mark.skipif(cpu_kernels.gather_qmatmul is None, reason="the CPU kernels are not built here")

pytestmark = pytest.mark.usefixtures("mlx_on_the_cpu")


def _experts(bits: int, symmetric: bool, scale_dtype=mx.float16, experts: int = 6, rows: int = 40, k: int = 96,
             seed: int = 0):
    """A random stack ``[experts, rows, k]`` quantized: (q, scales, biases or None, the dequantized float32)."""
    w = mx.random.normal((experts, rows, k), key=mx.random.key(seed))
    q, s, b = mx.quantize(w, group_size=32, bits=bits)
    s = s.astype(scale_dtype)
    b = s * -(2 ** (bits - 1)) if symmetric else b.astype(scale_dtype)
    dense = mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), group_size=32, bits=bits)
    return q, s, None if symmetric else b, dense


def _reference(x, dense, idx):
    """out[n, j] = x[n] @ dense[idx[n, j]].T, one expert at a time."""
    ix = np.array(idx)
    return mx.stack([mx.stack([x[n] @ dense[int(e)].T for e in ix[n]]) for n in range(ix.shape[0])])


@needs_kernels
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("n", [1, 3, 9])
def test_gather_qmatmul_is_each_experts_product(bits, symmetric, n):
    assert cpu_kernels.gather_problem() is None  # its self-test, run on first need
    q, s, b, dense = _experts(bits, symmetric, seed=bits)
    x = mx.random.normal((n, 96), key=mx.random.key(n))
    idx = mx.array(np.random.default_rng(n).integers(0, 6, (n, 2)).astype(np.int32))
    got = cpu_kernels.gather_qmatmul(x, q, s, b, idx, 32, bits)
    want = _reference(x, dense, idx)
    assert got.shape == (n, 2, 40) and got.dtype == mx.float32
    assert mx.abs(got - want).max().item() <= 1e-5 * mx.abs(want).max().item()
    if n == 1:  # a decode step's products are qmatmul's, bit for bit
        for j in range(2):
            e = int(idx[0, j].item())
            one = cpu_kernels.qmatmul(x, q[e], s[e], None if b is None else b[e], 32, bits)
            assert mx.array_equal(got[0, j], one[0]).item()


@needs_kernels
def test_gather_qmatmul_takes_uint32_indices_and_float32_scales():
    q, s, b, dense = _experts(4, False, scale_dtype=mx.float32)
    x = mx.random.normal((4, 96), key=mx.random.key(3))
    idx = mx.array([[5, 0, 2], [1, 1, 3], [4, 2, 0], [0, 5, 5]], dtype=mx.uint32)
    got = cpu_kernels.gather_qmatmul(x, q, s, b, idx, 32, 4)
    want = _reference(x, dense, idx)
    assert mx.abs(got - want).max().item() <= 1e-5 * mx.abs(want).max().item()


@needs_kernels
def test_an_expert_index_out_of_range_gives_nan_not_a_stray_read():
    q, s, b, dense = _experts(8, False)
    x = mx.random.normal((2, 96), key=mx.random.key(4))
    for idx in ([[0, 6], [1, -1]], [[7, 2]]):
        xi = x[:len(idx)]
        got = cpu_kernels.gather_qmatmul(xi, q, s, b, mx.array(idx, dtype=mx.int32), 32, 8)
        for n, row in enumerate(idx):
            for j, e in enumerate(row):
                if 0 <= e < 6:
                    assert mx.allclose(got[n, j], xi[n] @ dense[e].T, rtol=1e-5, atol=1e-4).item()
                else:
                    assert mx.isnan(got[n, j]).all().item()


@needs_kernels
@pytest.mark.parametrize("args, message", [
    (dict(bits=7), "bits must be"),
    (dict(w_shape=(6, 40 * 12)), "w must be 3-D"),
    (dict(k=64), "x must be"),
    (dict(scale_shape=(6, 40, 2)), "scales and biases"),
    (dict(idx_shape=(3, 2)), "indices must be"),
    (dict(activations="bf16"), "activations must be"),
])
def test_gather_qmatmul_rejects_bad_arguments(args, message):
    q, s, b, _ = _experts(4, False)
    if "w_shape" in args:
        q = q.reshape(args["w_shape"])
    if "scale_shape" in args:
        s = mx.ones(args["scale_shape"], dtype=s.dtype)
    x = mx.ones((2, args.get("k", 96)))
    idx = mx.zeros(args.get("idx_shape", (2, 2)), dtype=mx.int32)
    with pytest.raises(ValueError, match=message):
        cpu_kernels.gather_qmatmul(x, q, s, b, idx, 32, args.get("bits", 4), args.get("activations", "float32"))


@pytest.mark.parametrize("kernels", [True, False])
def test_gather_linear_keeps_the_experts_quantized(kernels, monkeypatch):
    """The engine's MoE projection on a quantized stack: our kernel, and MLX's gather_qmm where the kernels are off
    (and on GPUs), both the products of the dequantized experts."""
    if kernels and cpu_kernels.gather_qmatmul is None:
        pytest.skip("the CPU kernels are not built here")
    if not kernels:
        monkeypatch.setattr(cpu_kernels, "gather_qmatmul", None)
    q, s, b, dense = _experts(4, False, scale_dtype=mx.float32)
    weight = MLXQuantizedTensor(q, s, b, 32, 4, dtype=mx.float32)
    assert weight.shape == (6, 40, 96) and weight.is_quantized
    x = mx.random.normal((5, 96), key=mx.random.key(5))
    idx = mx.array(np.random.default_rng(5).integers(0, 6, (5, 2)).astype(np.int32))
    got = MLXTensor(x).gather_linear(weight, MLXTensor(idx)).a
    want = _reference(x, dense, idx)
    assert got.shape == (5, 2, 40)
    assert mx.abs(got - want).max().item() <= 1e-5 * mx.abs(want).max().item()
