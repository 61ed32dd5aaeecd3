"""GGUF's K-quants (Q4_K, Q5_K) held with their two levels of scales (6-bit integers, and an f16 d and dmin per 256
elements): exact against gguf.quants.dequantize, about the file's bytes, and every CPU kernel (qmatmul and its many
and int8 forms, qtake, gather_qmatmul) bit for bit the same as with the float32 scales and biases they stand for
(int8 activations: with x in the blocks llama.cpp takes for them, Q8_K)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from mlx_engine.mlx import MLXBackend, cpu_kernels  # noqa: E402
from mlx_engine.mlx.tensor import MLXQuantizedTensor, MLXTensor  # noqa: E402
from mlx_engine.weights import GGUFFile, QuantizedArray  # noqa: E402
from mlx_engine.weights import quant  # noqa: E402
from tests.test_int8_activations_by_type import q8_k_x  # noqa: E402
from tests.test_weights_gguf import k_quant_blocks, write_gguf  # noqa: E402

needs_kernels = pytest.mark.skipif(cpu_kernels.qmatmul is None, reason="the CPU kernels are not built here")

pytestmark = pytest.mark.usefixtures("mlx_on_the_cpu")


def k_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random blocks of a K-quant for a ``[rows, cols]`` tensor (``k_quant_blocks``), as its structured dtype."""
    raw = k_quant_blocks((rows, cols), gguf.GGMLQuantizationType[type_name], seed)
    return raw.reshape(-1).view(quant.BLOCKS[type_name])


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K"])
def test_k_quants_keep_two_levels_exactly_in_about_their_bytes(type_name):
    blk = k_blocks(type_name, 24, 768)
    qa = quant.repack_gguf(blk, type_name, 24, 768)
    assert qa.scales.dtype == qa.biases.dtype == np.uint8 and qa.super_scales.shape == (24, 3, 2)
    want = gguf.quants.dequantize(blk.view(np.uint8).reshape(24, -1), gguf.GGMLQuantizationType[type_name])
    np.testing.assert_array_equal(qa.dequantize(), want)
    np.testing.assert_array_equal(qa.expanded().dequantize(), want)
    assert qa.expanded().scales.dtype == np.float32
    assert qa.nbytes <= 1.03 * blk.nbytes  # float32 scales and biases took 1.33x a Q4_K tensor's bytes
    # cut for a rank of a distributed run: rows, and columns on super-block bounds, keep both levels
    rows, cols = qa.slice(0, 5, 17), qa.slice(1, 256, 768)
    assert rows.super_scales is not None and cols.super_scales is not None
    np.testing.assert_array_equal(rows.dequantize(), want[5:17])
    np.testing.assert_array_equal(cols.dequantize(), want[:, 256:])
    inside = qa.slice(1, 32, 96)  # inside a super-block: one float scale per group instead
    assert inside.super_scales is None
    np.testing.assert_array_equal(inside.dequantize(), want[:, 32:96])
    with pytest.raises(ValueError, match="two-level scales"):  # integer scales without their super scales
        QuantizedArray(qa.weight, qa.scales, qa.biases, 32, qa.bits)
    stack = qa.stacked((4,))
    assert stack.shape == (4, 6, 768) and stack.super_scales.shape == (4, 6, 3, 2)
    np.testing.assert_array_equal(stack.dequantize(), want.reshape(4, 6, 768))


def _arrays(type_name: str, rows: int, cols: int, seed: int = 0):
    qa = quant.repack_gguf(k_blocks(type_name, rows, cols, seed), type_name, rows, cols)
    ex = qa.expanded()
    two = (mx.array(qa.weight), mx.array(qa.scales), mx.array(qa.biases), mx.array(qa.super_scales))
    one = (mx.array(ex.weight), mx.array(ex.scales), mx.array(ex.biases))
    return qa, two, one


def _activations() -> list[str]:
    if cpu_kernels.qmatmul is None:
        return []
    return ["float32"] + (["int8"] if cpu_kernels.int8_problem() is None else [])


@needs_kernels
@pytest.mark.parametrize("type_name, bits", [("Q4_K", 4), ("Q5_K", 5)])
@pytest.mark.parametrize("m", [1, 3, 8, 40])
def test_qmatmul_with_two_level_scales_is_its_float_scales_bit_for_bit(type_name, bits, m):
    """The float32 product bit for bit that of the float32 scales and biases the two levels stand for; with int8
    activations x goes in llama.cpp's Q8_K blocks (per 256, for the K-quants) where float scales take Q8_0 ones (per
    32): the product of x so rounded (tests/test_int8_activations_by_type.py holds it to llama.cpp's dot product)."""
    qa, (w, sc, mn, sup), (w1, s32, b32) = _arrays(type_name, 80, 512, seed=m)
    x = mx.random.normal((m, 512), key=mx.random.key(m))
    got = cpu_kernels.qmatmul(x, w, sc, mn, 32, bits, "float32", sup)
    assert mx.array_equal(got, cpu_kernels.qmatmul(x, w1, s32, b32, 32, bits, "float32")).item()
    if "int8" in _activations():
        got8 = np.array(cpu_kernels.qmatmul(x, w, sc, mn, 32, bits, "int8", sup))
        want8 = q8_k_x(x) @ qa.dequantize().astype(np.float64).T
        np.testing.assert_allclose(got8, want8, rtol=0, atol=1e-5 * np.abs(want8).max())
    dense = x @ mx.array(qa.dequantize()).T
    assert mx.abs(got - dense).max().item() <= 1e-5 * mx.abs(dense).max().item()
    # several weights of one x, two-level and not, in one node (a layer's q, k and v)
    ys = cpu_kernels.qmatmul_many(x, [w, w1], [sc, s32], [mn, b32], [32, 32], [bits, bits], supers=[sup, None])
    assert mx.array_equal(ys[0], got).item() and mx.array_equal(ys[1], got).item()


@needs_kernels
def test_qtake_and_gather_with_two_level_scales_are_their_float_scales():
    _, (w, sc, mn, sup), (w1, s32, b32) = _arrays("Q4_K", 48, 512, seed=2)
    ids = mx.array([0, 47, 5, 5], dtype=mx.int32)
    got = cpu_kernels.qtake(w, sc, mn, ids, 32, 4, sup)
    assert mx.array_equal(got, cpu_kernels.qtake(w1, s32, b32, ids, 32, 4)).item()
    stack = [a.reshape(4, 12, *a.shape[1:]) for a in (w, sc, mn, sup)]
    flat = [a.reshape(4, 12, *a.shape[1:]) for a in (w1, s32, b32)]
    for n in (1, 6):
        x = mx.random.normal((n, 512), key=mx.random.key(n))
        idx = mx.array(np.random.default_rng(n).integers(0, 4, (n, 2)).astype(np.int32))
        got = cpu_kernels.gather_qmatmul(x, stack[0], stack[1], stack[2], idx, 32, 4, "float32", stack[3])
        assert mx.array_equal(got, cpu_kernels.gather_qmatmul(x, *flat, idx, 32, 4)).item()


@needs_kernels
@pytest.mark.parametrize("bad, message", [
    ("float_scales", "two-level scales must be uint8"),
    ("super_shape", "super scales must be float16"),
    ("super_dtype", "super scales must be float16"),
    ("no_biases", "need their biases|with biases the same"),
])
def test_bad_two_level_scales_are_refused(bad, message):
    _, (w, sc, mn, sup), (_, s32, _) = _arrays("Q4_K", 16, 512)
    x = mx.ones((1, 512))
    biases = None if bad == "no_biases" else mn
    scales = s32 if bad == "float_scales" else sc
    sup = sup[:, :1] if bad == "super_shape" else sup.astype(mx.float32) if bad == "super_dtype" else sup
    with pytest.raises(ValueError, match=message):
        cpu_kernels.qmatmul(x, w, scales, biases, 32, 4, "float32", sup)
    with pytest.raises(ValueError, match=message):
        cpu_kernels.qtake(w, scales, biases, mx.array([0], dtype=mx.int32), 32, 4, sup)


@pytest.mark.parametrize("kernels", [True, False])
def test_the_backend_holds_a_q4_k_tensor_in_about_its_bytes(tmp_path, kernels, monkeypatch):
    """On the CPU with our kernels, a Q4_K tensor keeps its two levels (and its products and rows are the float
    model's); without them (and on GPUs), MLX's kernels get one float scale and bias per group."""
    if kernels and cpu_kernels.qmatmul is None:
        pytest.skip("the CPU kernels are not built here")
    if not kernels:
        monkeypatch.setattr(cpu_kernels, "qmatmul", None)
    blk = k_blocks("Q4_K", 64, 512, seed=4)
    write_gguf(tmp_path / "k.gguf", {"w": (blk.view(np.uint8).reshape(64, -1), gguf.GGMLQuantizationType.Q4_K)})
    dense = gguf.quants.dequantize(blk.view(np.uint8).reshape(64, -1), gguf.GGMLQuantizationType.Q4_K)
    with GGUFFile(tmp_path / "k.gguf") as wf:
        assert isinstance(wf.load("w"), QuantizedArray)
    t = MLXBackend(tmp_path / "k.gguf", device="cpu", quantized=True).weights["w"]
    assert isinstance(t, MLXQuantizedTensor) and t.shape == (64, 512)
    assert (t.super_scales is not None) == kernels
    if kernels:
        assert t.nbytes <= 1.03 * blk.nbytes
    x = mx.random.normal((3, 512), key=mx.random.key(4))
    y = MLXTensor(x).linear(t).a
    want = x @ mx.array(dense).T
    assert mx.abs(y - want).max().item() <= 1e-5 * mx.abs(want).max().item()
    np.testing.assert_array_equal(np.array(t.take(MLXTensor(mx.array([7, 1], dtype=mx.int32))).a), dense[[7, 1]])
    np.testing.assert_array_equal(np.array(t.rows([2, 9]).a), dense[[2, 9]])
    np.testing.assert_array_equal(np.array(t.a), dense)
