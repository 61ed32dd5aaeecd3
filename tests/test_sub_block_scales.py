"""GGUF's 16-element sub-block K-quants (Q6_K, Q3_K, Q2_K) held as their files hold them: groups of 16, integer
scales times an f16 per 256 elements (int8 and symmetric for Q6_K and Q3_K, uint8 scales and mins for Q2_K). Exact
against gguf.quants.dequantize; every CPU kernel (qmatmul and its many and int8 forms, qtake, gather_qmatmul) gives
the dense product; the backend holds them in about the file's bytes on the CPU and re-quantizes them for MLX's
kernels elsewhere."""

from __future__ import annotations

import contextlib
import gguf
import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from mlx_engine.mlx import MLXBackend, cpu_kernels  # noqa: E402
from mlx_engine.mlx.tensor import MLXQuantizedTensor, MLXTensor  # noqa: E402
from mlx_engine.weights import QuantizedArray  # noqa: E402
from mlx_engine.weights import quant  # noqa: E402
from tests.conftest import passed_on_avx2  # noqa: E402
from tests.test_int8_activations_by_type import q8_k_x  # noqa: E402
from tests.test_weights_gguf import k_quant_blocks, write_gguf  # noqa: E402

needs_kernels = pytest.mark.skipif(cpu_kernels.qmatmul is None, reason="the CPU kernels are not built here")

pytestmark = pytest.mark.usefixtures("mlx_on_the_cpu")

TYPES = [("Q6_K", 6), ("Q3_K", 3), ("Q2_K", 2)]
SIGNED = {"Q6_K": True, "Q3_K": True, "Q2_K": False}


def blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    raw = k_quant_blocks((rows, cols), gguf.GGMLQuantizationType[type_name], seed)
    return raw.reshape(-1).view(quant.BLOCKS[type_name])


def dense(type_name: str, blk: np.ndarray, rows: int) -> np.ndarray:
    return gguf.quants.dequantize(blk.view(np.uint8).reshape(rows, -1), gguf.GGMLQuantizationType[type_name])


def device_arrays(qa: QuantizedArray):
    """(w, scales, biases or None, super) as MLX arrays."""
    return (mx.array(qa.weight), mx.array(qa.scales), None if qa.biases is None else mx.array(qa.biases),
            mx.array(qa.super_scales))


@pytest.mark.parametrize("type_name, bits", TYPES)
def test_sub_block_types_keep_two_levels_exactly(type_name, bits):
    blk = blocks(type_name, 24, 768)
    qa = quant.repack_gguf(blk, type_name, 24, 768)
    signed = SIGNED[type_name]
    assert (qa.group_size, qa.bits) == (16, bits) and qa.scales.shape == (24, 48)
    assert qa.super_scales.shape == (24, 3, 1 if signed else 2) and (qa.biases is None) == signed
    want = dense(type_name, blk, 24)
    np.testing.assert_array_equal(qa.dequantize(symmetric=signed), want)
    np.testing.assert_array_equal(qa.expanded().dequantize(symmetric=signed), want)
    # rows, and columns on super-block bounds, keep both levels; a cut inside a super-block has float scales
    rows, cols, inside = qa.slice(0, 5, 17), qa.slice(1, 256, 768), qa.slice(1, 32, 96)
    assert rows.super_scales is not None and cols.super_scales is not None and inside.super_scales is None
    np.testing.assert_array_equal(rows.dequantize(symmetric=signed), want[5:17])
    np.testing.assert_array_equal(cols.dequantize(symmetric=signed), want[:, 256:])
    np.testing.assert_allclose(inside.dequantize(), want[:, 32:96], rtol=1e-6, atol=1e-9)
    with pytest.raises(ValueError, match="cut a quantization group"):
        qa.expanded().slice(1, 16, 64)  # half a 32-element word
    stack = qa.stacked((4,))
    assert stack.shape == (4, 6, 768) and stack.super_scales.shape[:2] == (4, 6)
    np.testing.assert_array_equal(stack.dequantize(symmetric=signed), want.reshape(4, 6, 768))


def test_quantized_array_refuses_mismatched_two_level_parts():
    qa = quant.repack_gguf(blocks("Q6_K", 4, 256), "Q6_K", 4, 256)
    with pytest.raises(ValueError, match="but for two-level int8"):  # int8 scales with biases
        QuantizedArray(qa.weight, qa.scales, qa.scales, 16, 6, qa.super_scales)
    with pytest.raises(ValueError, match="do not fit"):  # int8 scales with (d, -dmin) super scales
        QuantizedArray(qa.weight, qa.scales, None, 16, 6, np.concatenate([qa.super_scales] * 2, axis=-1))
    with pytest.raises(ValueError, match="two-level scales"):
        QuantizedArray(qa.weight, qa.scales, None, 16, 6)


def _activations() -> list[str]:
    if cpu_kernels.qmatmul is None:
        return []
    return ["float32"] + (["int8"] if cpu_kernels.int8_problem() is None else [])


@needs_kernels
@pytest.mark.parametrize("type_name, bits", TYPES)
@pytest.mark.parametrize("m", [1, 3, 8, 40])
def test_qmatmul_with_groups_of_16_is_the_dense_product(type_name, bits, m):
    """Decode rows (1, 3), tiles (8) and panels (40): within float32 rounding of the dense product, and bit for bit
    the same with the float32 scales and biases the two levels stand for; int8 activations run the symmetric ones
    (Q6_K, Q3_K) through the int8 kernel with x in llama.cpp's Q8_K blocks (tests/test_int8_activations_by_type.py
    holds them to llama.cpp's dot products), Q2_K in float32 (x's sums per 16, which its mins meet, are not kept)."""
    blk = blocks(type_name, 72, 512, seed=m)
    qa = quant.repack_gguf(blk, type_name, 72, 512)
    w, sc, mn, sup = device_arrays(qa)
    ex = qa.expanded()
    x = mx.random.normal((m, 512), key=mx.random.key(m))
    got = cpu_kernels.qmatmul(x, w, sc, mn, 16, bits, "float32", sup)
    want = x @ mx.array(dense(type_name, blk, 72)).T
    assert mx.abs(got - want).max().item() <= 1e-5 * mx.abs(want).max().item()
    flat = cpu_kernels.qmatmul(x, w, mx.array(ex.scales), mx.array(ex.biases), 16, bits)
    assert mx.array_equal(got, flat).item()
    for activations in _activations():
        two = cpu_kernels.qmatmul(x, w, sc, mn, 16, bits, activations, sup)
        if SIGNED[type_name] and activations != "float32":
            want8 = q8_k_x(x) @ dense(type_name, blk, 72).astype(np.float64).T
            np.testing.assert_allclose(np.array(two), want8, rtol=0, atol=1e-5 * np.abs(want8).max())
            assert not mx.array_equal(two, got).item()  # (x was rounded: the check above can fail)
        else:
            assert mx.array_equal(two, got).item()
    # with a weight of groups of 32 in one node (a layer's q, k and v), each product its own
    q4, s4, b4 = mx.quantize(mx.random.normal((40, 512), key=mx.random.key(99)), group_size=32, bits=4)
    for activations in _activations():
        ys = cpu_kernels.qmatmul_many(x, [w, q4], [sc, s4], [mn, b4], [16, 32], [bits, 4], None, activations,
                                      supers=[sup, None])
        assert mx.array_equal(ys[0], cpu_kernels.qmatmul(x, w, sc, mn, 16, bits, activations, sup)).item()
        assert mx.array_equal(ys[1], cpu_kernels.qmatmul(x, q4, s4, b4, 32, 4, activations)).item()


@needs_kernels
@pytest.mark.parametrize("bits", [2, 3, 5, 6, 8])
@pytest.mark.parametrize("symmetric", [False, True])
def test_qmatmul_groups_of_16_with_float_scales(bits, symmetric):
    rng = np.random.default_rng(bits)
    q = rng.integers(0, 1 << bits, (33, 96)).astype(np.uint8)
    s = rng.uniform(0.01, 0.1, (33, 6)).astype(np.float16)
    b = (s * -(2 ** (bits - 1))) if symmetric else rng.standard_normal((33, 6)).astype(np.float16)
    values = (q.reshape(33, 6, 16) * s[..., None].astype(np.float32) + b[..., None].astype(np.float32)).reshape(33, 96)
    w = mx.array(quant.pack(q, bits))
    for m in (1, 7, 33):
        x = mx.random.normal((m, 96), key=mx.random.key(m))
        got = cpu_kernels.qmatmul(x, w, mx.array(s), None if symmetric else mx.array(b), 16, bits)
        want = x @ mx.array(values).T
        assert mx.abs(got - want).max().item() <= 1e-5 * (1 + mx.abs(want).max().item())


@needs_kernels
def test_bad_groups_of_16_are_refused():
    qa = quant.repack_gguf(blocks("Q6_K", 4, 256), "Q6_K", 4, 256)
    w, sc, _, sup = device_arrays(qa)
    x = mx.ones((1, 256))
    with pytest.raises(ValueError, match="4-bit weights take groups of 32"):
        cpu_kernels.qmatmul(x, mx.zeros((4, 32), dtype=mx.uint32), mx.ones((4, 16)), None, 16, 4)
    with pytest.raises(ValueError, match="give no biases"):
        cpu_kernels.qmatmul(x, w, sc, sc, 16, 6, "float32", sup)
    with pytest.raises(ValueError, match=r"super scales must be float16 \[..., K / 256, 1\]"):
        cpu_kernels.qmatmul(x, w, sc, None, 16, 6, "float32", mx.concatenate([sup, sup], axis=-1))
    with pytest.raises(ValueError, match="multiple of group_size and of 32"):
        cpu_kernels.qmatmul(mx.ones((1, 48)), mx.zeros((4, 9), dtype=mx.uint32), mx.ones((4, 3)), None, 16, 6)
    with pytest.raises(ValueError, match="groups of 16 or 32"):
        cpu_kernels.qtake(w, sc, None, mx.array([0]), 64, 6, sup)


@needs_kernels
def test_the_self_test_catches_a_wrong_product_with_groups_of_16():
    assert cpu_kernels._sub_block_self_test(cpu_kernels.qmatmul) is None
    assert "groups of 16" in cpu_kernels._sub_block_self_test(lambda x, *a: mx.zeros((x.shape[0], 24)))


@needs_kernels
@pytest.mark.parametrize("type_name, bits", TYPES)
def test_qtake_and_gather_with_groups_of_16(type_name, bits):
    blk = blocks(type_name, 48, 512, seed=3)
    qa = quant.repack_gguf(blk, type_name, 48, 512)
    want = dense(type_name, blk, 48)
    w, sc, mn, sup = device_arrays(qa)
    ids = mx.array([0, 47, 5, 5], dtype=mx.int32)
    np.testing.assert_array_equal(np.array(cpu_kernels.qtake(w, sc, mn, ids, 16, bits, sup)), want[[0, 47, 5, 5]])
    stack = device_arrays(qa.stacked((4,)))
    for n in (1, 6):
        x = mx.random.normal((n, 512), key=mx.random.key(n))
        idx = mx.array(np.random.default_rng(n).integers(0, 4, (n, 2)).astype(np.int32))
        got = cpu_kernels.gather_qmatmul(x, stack[0], stack[1], stack[2], idx, 16, bits, "float32", stack[3])
        for t in range(n):
            for j in range(2):
                e = int(idx[t, j].item())
                one = cpu_kernels.qmatmul(x[t:t + 1], *(a[e] if a is not None else None for a in stack[:3]), 16, bits,
                                          "float32", stack[3][e])
                assert mx.abs(got[t, j] - one[0]).max().item() <= 1e-5 * (1 + mx.abs(one).max().item())


def test_the_tensor_dequantizes_groups_of_16_exactly():
    """MLX's dequantize takes no groups of 16: the tensor's own dequantization (for operations other than products,
    and rows in another dtype) gives gguf's values exactly."""
    for type_name, bits in TYPES:
        blk = blocks(type_name, 16, 512, seed=5)
        qa = quant.repack_gguf(blk, type_name, 16, 512)
        t = MLXQuantizedTensor(*device_arrays(qa)[:3], 16, bits, super_scales=device_arrays(qa)[3])
        want = dense(type_name, blk, 16)
        np.testing.assert_array_equal(np.array(t.a), want)
        half = MLXQuantizedTensor(*device_arrays(qa)[:3], 16, bits, dtype=mx.float16,
                                  super_scales=device_arrays(qa)[3])
        rows = half.take(MLXTensor(mx.array([3, 0])), axis=0)
        np.testing.assert_allclose(np.array(rows.a.astype(mx.float32)), want[[3, 0]], rtol=1e-3, atol=1e-3)


@contextlib.contextmanager
def held_on_the_cpu(tmp_path, monkeypatch, kernels: bool, raw: np.ndarray, qtype):
    """The backend's tensor ``w`` of a GGUF file holding ``raw`` as ``qtype``, on the CPU with our kernels or (as
    where MLX's kernels run it) without them, and its product with a random x ``[2, cols]``: ``(w, x, y)``. Skips
    where the kernels are asked for and not built."""
    if kernels and cpu_kernels.qmatmul is None:
        pytest.skip("the CPU kernels are not built here")
    if not kernels:
        monkeypatch.setattr(cpu_kernels, "qmatmul", None)
    write_gguf(tmp_path / "w.gguf", {"w": (raw, qtype)})
    backend = MLXBackend(tmp_path / "w.gguf", device="cpu", quantized=True)
    try:
        w = backend.weights["w"]
        assert isinstance(w, MLXQuantizedTensor)
        x = mx.random.normal((2, w.shape[1]), key=mx.random.key(0))
        yield w, np.array(x), np.array(MLXTensor(x).linear(w).a)
    finally:
        backend.close()


@pytest.mark.parametrize("kernels", [True, False])
def test_the_backend_holds_q6_k_in_its_bytes_or_regroups_it(tmp_path, kernels, monkeypatch):
    """On the CPU with our kernels a Q6_K tensor is held in exactly its file's bytes and its products are the dense
    ones; where MLX's kernels run it (GPUs; here the CPU without ours) it is 8-bit in groups of 32."""
    blk = blocks("Q6_K", 64, 512, seed=4)
    raw = blk.view(np.uint8).reshape(64, -1)
    with held_on_the_cpu(tmp_path, monkeypatch, kernels, raw, gguf.GGMLQuantizationType.Q6_K) as (w, x, y):
        ref = x @ dense("Q6_K", blk, 64).T
        if kernels:
            assert (w.group_size, w.bits, w.nbytes) == (16, 6, raw.nbytes)
            np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
        else:
            assert (w.group_size, w.bits) == (32, 8)
            np.testing.assert_allclose(y, ref, rtol=0, atol=2e-2 * np.abs(ref).max())  # an 8-bit grid


def test_the_avx2_kernels_with_groups_of_16():
    """The AVX2 copy of the row kernels (which an AVX-512 machine never picks by itself) on these weights, in a
    process told to take it."""
    if cpu_kernels.qmatmul is None:
        pytest.skip("the CPU kernels are not built here")
    assert passed_on_avx2(__file__, "dense_product or float_scales or qtake_and_gather") >= 20
