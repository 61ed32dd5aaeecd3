"""GGUF's codebook types (IQ4_NL, IQ4_XS, MXFP4) held as their files hold them: 4-bit integers that index llama.cpp's
16 levels (``kvalues_iq4nl``; MXFP4's ``kvalues_mxfp4``, the E2M1 values doubled), times float16 scales (IQ4_NL), int8
ones under an f16 per 256 elements (IQ4_XS) or powers of two ``2**(e - 128)`` (MXFP4, on the device its E8M0
exponents ``e`` themselves). Exact against gguf.quants.dequantize; every CPU kernel (qmatmul and its many and int8
forms, qtake, gather_qmatmul) gives the dense product; the backend holds them in about the file's bytes (MXFP4 in
exactly its bytes) on the CPU and, where MLX's kernels run them, as 8-bit affine without loss (they had been
re-quantized to 8 bits from their values, with an 8-bit grid's error)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from mlx_engine.mlx import MLXBackend, cpu_kernels  # noqa: E402
from mlx_engine.mlx.backend import _e8m0  # noqa: E402
from mlx_engine.mlx.tensor import MLXQuantizedTensor, MLXTensor  # noqa: E402
from mlx_engine.weights import QuantizedArray  # noqa: E402
from mlx_engine.weights import quant  # noqa: E402
from mlx_engine.weights.gguf import GGUFFile  # noqa: E402
from tests.conftest import passed_on_avx2  # noqa: E402
from tests.test_int8_activations_by_type import q8_k_x  # noqa: E402
from tests.test_sub_block_scales import held_on_the_cpu  # noqa: E402
from tests.test_weights_gguf import write_gguf  # noqa: E402

needs_kernels = pytest.mark.skipif(cpu_kernels.qmatmul is None, reason="the CPU kernels are not built here")

pytestmark = pytest.mark.usefixtures("mlx_on_the_cpu")

TYPES = ["IQ4_NL", "IQ4_XS", "MXFP4"]
ELEMENTS = {"IQ4_NL": 32, "IQ4_XS": 256, "MXFP4": 32}  # per block
CODEBOOK = {"IQ4_NL": 1, "IQ4_XS": 1, "MXFP4": 2}  # the kernels' ids (cpu_kernels.CODEBOOKS)
KVALUES = {"IQ4_NL": gguf.quants.IQ4_NL.kvalues, "IQ4_XS": gguf.quants.IQ4_NL.kvalues,
           "MXFP4": gguf.quants.MXFP4.kvalues}


def blocks(type_name: str, rows: int, cols: int, seed: int = 0, exponents: tuple[int, int] = (112, 136)) -> np.ndarray:
    """Random blocks (gguf cannot quantize these types): any integers and sub-scales, small finite d; MXFP4's
    exponents from ``exponents`` (its scales ``2**(e - 128)``, float16 ones from 104 to 143)."""
    dt = quant.BLOCKS[type_name]
    n = rows * cols // ELEMENTS[type_name]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (n, dt.itemsize), dtype=np.uint8).view(dt).reshape(n).copy()
    if type_name == "MXFP4":
        b["e"] = rng.integers(*exponents, n)
    else:
        b["d"] = rng.uniform(1e-4, 2e-3, n).astype(np.float16)
    return b


def dense(type_name: str, blk: np.ndarray, rows: int) -> np.ndarray:
    return gguf.quants.dequantize(blk.view(np.uint8).reshape(rows, -1), gguf.GGMLQuantizationType[type_name])


def device_arrays(qa: QuantizedArray, blk: "np.ndarray | None" = None):
    """(w, scales, super or None) as MLX arrays: as the backend holds them on the CPU (MXFP4's scales as the
    exponents of its blocks ``blk``, the file's bytes)."""
    scales = qa.scales if blk is None or "e" not in blk.dtype.names else blk["e"].reshape(qa.scales.shape)
    return (mx.array(qa.weight), mx.array(scales),
            None if qa.super_scales is None else mx.array(qa.super_scales))


@pytest.mark.parametrize("type_name", TYPES)
def test_codebook_types_repack_exactly_in_their_bytes(tmp_path, type_name):
    blk = blocks(type_name, 24, 768)
    raw = blk.view(np.uint8).reshape(24, -1)
    path = write_gguf(tmp_path / "iq.gguf", {"w": (raw, gguf.GGMLQuantizationType[type_name])})
    with GGUFFile(path) as wf:
        qa = wf.load("w")
    want = dense(type_name, blk, 24)
    assert isinstance(qa, QuantizedArray) and (qa.bits, qa.group_size, qa.biases) == (4, 32, None)
    np.testing.assert_array_equal(qa.codebook, KVALUES[type_name])
    np.testing.assert_array_equal(qa.dequantize(), want)
    if type_name == "IQ4_NL":  # exactly the file's 18 bytes per 32 elements
        assert qa.super_scales is None and qa.scales.dtype == np.float16 and qa.nbytes == raw.nbytes
    elif type_name == "MXFP4":  # float16 powers of two here (the device holds the file's exponents: _e8m0)
        assert qa.super_scales is None and qa.scales.dtype == np.float16
        np.testing.assert_array_equal(_e8m0(qa.scales), blk["e"].reshape(24, -1))
    else:  # an int8 sub-scale where the file packs 6 bits: 1.015x
        assert qa.scales.dtype == np.int8 and qa.super_scales.shape == (24, 3, 1)
        assert qa.nbytes <= 1.02 * raw.nbytes
        np.testing.assert_array_equal(qa.expanded().dequantize(), want)
    # rows, columns, a cut inside a super-block and a stack keep the codebook and the values
    for part, ref in ((qa.slice(0, 5, 17), want[5:17]), (qa.slice(1, 256, 768), want[:, 256:]),
                      (qa.slice(1, 32, 96), want[:, 32:96]), (qa.stacked((4,)), want.reshape(4, 6, 768))):
        assert part.codebook is not None
        np.testing.assert_array_equal(part.dequantize(), ref)
    affine = quant.codebook_to_affine(qa)  # MLX's form: 8 bits, exact
    assert (affine.bits, affine.group_size, affine.codebook) == (8, 32, None)
    np.testing.assert_array_equal(affine.dequantize(), want)
    stacked = quant.codebook_to_affine(qa.stacked((3,)))
    assert stacked.shape == (3, 8, 768)
    np.testing.assert_array_equal(stacked.dequantize(), want.reshape(3, 8, 768))


def test_quantized_array_refuses_a_codebook_that_does_not_fit():
    qa = quant.repack_gguf(blocks("IQ4_NL", 4, 64), "IQ4_NL", 4, 64)
    with pytest.raises(ValueError, match="no biases and one value per integer"):
        QuantizedArray(qa.weight, qa.scales, qa.scales, 32, 4, codebook=qa.codebook)
    with pytest.raises(ValueError, match="no biases and one value per integer"):
        QuantizedArray(qa.weight, qa.scales, None, 32, 4, codebook=qa.codebook[:8])
    with pytest.raises(ValueError, match="a codebook"):  # float scales without biases or a codebook
        QuantizedArray(qa.weight, qa.scales, None, 32, 4)


def int8_x(x: "mx.array", levels: int = 127) -> np.ndarray:
    """x as the int8 activations see it (llama.cpp's Q8_0 blocks: x_q = round(x * 127 / max|x|) per 32, d = max|x| /
    127 in float16), as float64 ``d * x_q``; ``levels=32639``: as the int16 activations see it (x_q = round(x / d),
    d in float32)."""
    blocks = np.array(x, np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(-1)
    d = (amax / np.float32(levels)).astype(np.float32)
    if levels == 127:
        inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax != 0)
        d = d.astype(np.float16).astype(np.float32)
    else:
        inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    return (np.rint(blocks * inv[..., None]) * d[..., None].astype(np.float64)).reshape(x.shape)


def _kernels_isa() -> str:
    from mlx_engine.mlx import _kernels
    return _kernels.isa()


def _activations() -> list[str]:
    if cpu_kernels.qmatmul is None:
        return []
    return ["float32"] + [k for k in ("int8", "int16") if cpu_kernels.activations_problem(k) is None]


@needs_kernels
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("m", [1, 3, 8, 40])
def test_qmatmul_of_a_codebook_weight_is_the_dense_product(type_name, m):
    """Decode rows (1, 3), tiles (8) and panels (40): within float32 rounding of the dense product, and bit for bit
    the same with the float scales the two levels (MXFP4's exponents) stand for; with int8 activations, of x rounded
    as llama.cpp rounds it for the type."""
    blk = blocks(type_name, 72, 512, seed=m)
    qa = quant.repack_gguf(blk, type_name, 72, 512)
    w, s, sup = device_arrays(qa, blk)
    cb = CODEBOOK[type_name]
    x = mx.random.normal((m, 512), key=mx.random.key(m))
    got = cpu_kernels.qmatmul(x, w, s, None, 32, 4, "float32", sup, cb)
    want = x @ mx.array(dense(type_name, blk, 72)).T
    assert mx.abs(got - want).max().item() <= 1e-5 * mx.abs(want).max().item()
    flat_scales = mx.array(qa.expanded().scales)  # (MXFP4: the float16 powers of two its exponents stand for)
    assert mx.array_equal(got, cpu_kernels.qmatmul(x, w, flat_scales, None, 32, 4, "float32", None, cb)).item()
    # the integers read as they lie (an affine 4-bit weight) are another product altogether
    assert not mx.array_equal(cpu_kernels.qmatmul(x, w, flat_scales, None, 32, 4, "float32", None), got).item()
    if "int8" in _activations():  # llama.cpp's: x rounded per 32 elements (IQ4_NL, MXFP4: Q8_0) or 256 (IQ4_XS:
        # Q8_K), integer sums of kvalues[q] * x_q
        got8 = cpu_kernels.qmatmul(x, w, s, None, 32, 4, "int8", sup, cb)
        want8 = (q8_k_x(x) if type_name == "IQ4_XS" else int8_x(x)) @ dense(type_name, blk, 72).astype(np.float64).T
        np.testing.assert_allclose(np.array(got8), want8, rtol=0, atol=1e-5 * np.abs(want8).max())
        assert not mx.array_equal(got8, got).item()  # (x was rounded: the check above can fail)
    if "int16" in _activations():
        got16 = cpu_kernels.qmatmul(x, w, s, None, 32, 4, "int16", sup, cb)
        if _kernels_isa() == "avx2":  # AVX2's int16 kernel leaves codebooks to the float32 one (its sign trick)
            assert mx.array_equal(got16, got).item()
        else:  # VNNI: integer sums of kvalues[q] * x_q, x rounded to 16 bits per 32
            want16 = int8_x(x, 32639) @ dense(type_name, blk, 72).astype(np.float64).T
            np.testing.assert_allclose(np.array(got16), want16, rtol=0, atol=1e-5 * np.abs(want16).max())
    # beside an affine 4-bit weight in one node (a layer's q, k and v): each product its own
    q4, s4, b4 = mx.quantize(mx.random.normal((40, 512), key=mx.random.key(99)), group_size=32, bits=4)
    for activations in _activations():
        ys = cpu_kernels.qmatmul_many(x, [w, q4], [s, s4], [None, b4], [32, 32], [4, 4], None, activations,
                                      supers=[sup, None], codebooks=[cb, 0])
        assert mx.array_equal(ys[0], cpu_kernels.qmatmul(x, w, s, None, 32, 4, activations, sup, cb)).item()
        assert mx.array_equal(ys[1], cpu_kernels.qmatmul(x, q4, s4, b4, 32, 4, activations)).item()


@needs_kernels
def test_bad_codebook_weights_are_refused():
    qa = quant.repack_gguf(blocks("IQ4_NL", 4, 64), "IQ4_NL", 4, 64)
    w, s, _ = device_arrays(qa)
    x = mx.ones((1, 64))
    with pytest.raises(ValueError, match="codebook weight has 4 bits and no biases"):
        cpu_kernels.qmatmul(x, w, s, s, 32, 4, "float32", None, True)
    with pytest.raises(ValueError, match="codebook weight has 4 bits and no biases"):
        cpu_kernels.qmatmul(x, mx.zeros((4, 16), dtype=mx.uint32), s, None, 32, 8, "float32", None, True)
    with pytest.raises(ValueError, match="codebook weight has 4 bits and no biases"):
        cpu_kernels.qtake(w, s, s, mx.array([0]), 32, 4, None, True)
    with pytest.raises(ValueError, match="one or more weights"):
        cpu_kernels.qmatmul_many(x, [w], [s], [None], [32], [4], codebooks=[True, False])
    with pytest.raises(ValueError, match="codebook must be 0"):
        cpu_kernels.qmatmul(x, w, s, None, 32, 4, "float32", None, 3)
    exps = mx.full(s.shape, 127, mx.uint8)  # E8M0 exponents: MXFP4's scales only
    for codebook in (0, 1):
        with pytest.raises(ValueError, match="E8M0 exponents, an MXFP4"):
            cpu_kernels.qmatmul(x, w, exps, None, 32, 4, "float32", None, codebook)
        with pytest.raises(ValueError, match="E8M0 exponents, an MXFP4"):
            cpu_kernels.qtake(w, exps, None, mx.array([0]), 32, 4, None, codebook)
        with pytest.raises(ValueError, match="E8M0 exponents, an MXFP4"):
            cpu_kernels.gather_qmatmul(x, w[None], exps[None], None, mx.array([[0]]), 32, 4, "float32", None,
                                       codebook)


@needs_kernels
def test_the_self_test_catches_a_wrong_codebook_product():
    assert cpu_kernels._codebook_self_test(cpu_kernels.qmatmul) is None
    assert "codebook" in cpu_kernels._codebook_self_test(lambda x, *a: mx.zeros((x.shape[0], 24)))


@needs_kernels
@pytest.mark.parametrize("type_name", TYPES)
def test_qtake_and_gather_of_a_codebook_weight(type_name):
    blk = blocks(type_name, 48, 512, seed=3)
    qa = quant.repack_gguf(blk, type_name, 48, 512)
    want = dense(type_name, blk, 48)
    w, s, sup = device_arrays(qa, blk)
    cb = CODEBOOK[type_name]
    ids = mx.array([0, 47, 5, 5], dtype=mx.int32)
    np.testing.assert_array_equal(np.array(cpu_kernels.qtake(w, s, None, ids, 32, 4, sup, cb)), want[[0, 47, 5, 5]])
    stack = device_arrays(qa.stacked((4,)), blk)
    for n, activations in [(1, a) for a in _activations()] + [(6, "float32")]:
        x = mx.random.normal((n, 512), key=mx.random.key(n))
        idx = mx.array(np.random.default_rng(n).integers(0, 4, (n, 2)).astype(np.int32))
        got = cpu_kernels.gather_qmatmul(x, stack[0], stack[1], None, idx, 32, 4, activations, stack[2], cb)
        for t in range(n):
            for j in range(2):
                e = int(idx[t, j].item())
                one = cpu_kernels.qmatmul(x[t:t + 1], stack[0][e], stack[1][e], None, 32, 4, activations,
                                          None if stack[2] is None else stack[2][e], cb)
                if n == 1:  # a decode step's products are qmatmul's, bit for bit
                    assert mx.array_equal(got[t, j], one[0]).item()
                assert mx.abs(got[t, j] - one[0]).max().item() <= 1e-5 * (1 + mx.abs(one).max().item())


@pytest.mark.parametrize("type_name", TYPES)
def test_the_tensor_dequantizes_a_codebook_weight_exactly(type_name):
    """The tensor's own dequantization (operations other than products, rows in another dtype, no kernels)."""
    blk = blocks(type_name, 16, 512, seed=5)
    qa = quant.repack_gguf(blk, type_name, 16, 512)
    w, s, sup = device_arrays(qa, blk)
    want = dense(type_name, blk, 16)
    t = MLXQuantizedTensor(w, s, None, 32, 4, dtype=mx.float32, super_scales=sup, codebook=mx.array(qa.codebook))
    np.testing.assert_array_equal(np.array(t.a), want)
    np.testing.assert_array_equal(np.array(t.rows([3, 0]).a), want[[3, 0]])
    half = MLXQuantizedTensor(w, s, None, 32, 4, dtype=mx.float16, super_scales=sup, codebook=mx.array(qa.codebook))
    rows = half.take(MLXTensor(mx.array([3, 0])), axis=0)
    np.testing.assert_array_equal(np.array(rows.a), want[[3, 0]].astype(np.float16))


@pytest.mark.parametrize("type_name", ["IQ4_XS", "MXFP4"])
@pytest.mark.parametrize("kernels", [True, False])
def test_the_backend_holds_codebook_types_in_their_bytes_or_as_exact_8_bits(tmp_path, kernels, monkeypatch,
                                                                            type_name):
    """On the CPU with our kernels an IQ4_XS tensor keeps its codebook in about its file's bytes, an MXFP4 one in
    exactly its file's bytes (its E8M0 exponents as scales); where MLX's kernels run them (GPUs; here the CPU without
    ours) they are 8-bit affine holding the same values. Both give the dense product (the re-quantization to 8 bits
    these types had before moved it by an 8-bit grid's step)."""
    blk = blocks(type_name, 64, 512, seed=4)
    raw = blk.view(np.uint8).reshape(64, -1)
    want = dense(type_name, blk, 64)
    with held_on_the_cpu(tmp_path, monkeypatch, kernels, raw, gguf.GGMLQuantizationType[type_name]) as (w, x, y):
        np.testing.assert_array_equal(np.array(w.a), want)
        ref = x @ want.T
        np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
        if not kernels:
            assert (w.bits, w.codebook) == (8, None)
        elif type_name == "IQ4_XS":
            assert (w.bits, w.codebook_id) == (4, 1) and w.nbytes <= 1.02 * raw.nbytes
        else:
            assert (w.bits, w.codebook_id, w.scales.dtype, w.nbytes) == (4, 2, mx.uint8, raw.nbytes)


@needs_kernels
def test_mxfp4_exponents_of_any_range():
    """MXFP4 scales from 2**-128 (subnormal) to 2**71: float32 on the host (not every one a float16), the file's
    exponents on the device; the tensor's values, its rows (qtake) and its products as the file's."""
    blk = blocks("MXFP4", 16, 256, seed=8, exponents=(0, 200))
    blk["e"][:2] = (0, 1)  # the two subnormal scales
    qa = quant.repack_gguf(blk, "MXFP4", 16, 256)
    want = dense("MXFP4", blk, 16)
    assert qa.scales.dtype == np.float32
    np.testing.assert_array_equal(qa.dequantize(), want)
    held = MLXBackend(device="cpu", quantized=True)._to_device(qa)
    np.testing.assert_array_equal(np.array(held.scales), blk["e"].reshape(16, -1))
    np.testing.assert_array_equal(np.array(held.a), want)
    np.testing.assert_array_equal(np.array(held.take(MLXTensor(mx.array([0, 15], dtype=mx.int32))).a), want[[0, 15]])
    x = mx.random.normal((3, 256), key=mx.random.key(8))
    got = np.array(MLXTensor(x).linear(held).a)
    np.testing.assert_array_equal(got, np.array(cpu_kernels.qmatmul(x, held.w, mx.array(qa.scales), None, 32, 4,
                                                                      "float32", None, 2)))
    ref = np.array(x, np.float64) @ want.astype(np.float64).T
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


def test_the_avx2_kernels_with_a_codebook():
    """The AVX2 copy of the row kernels (which an AVX-512 machine never picks by itself) on these weights, in a
    process told to take it."""
    if cpu_kernels.qmatmul is None:
        pytest.skip("the CPU kernels are not built here")
    assert passed_on_avx2(__file__, "dense_product or qtake_and_gather") >= 10


@needs_kernels
def test_a_codebook_our_kernels_do_not_hold_goes_to_exact_8_bits():
    """Our kernels hold IQ4_NL's and MXFP4's levels only: a weight of other levels is made 8-bit affine at load, the
    same values; a tensor of other levels is refused."""
    blk = blocks("IQ4_NL", 8, 256, seed=6)
    qa = quant.repack_gguf(blk, "IQ4_NL", 8, 256)
    other = QuantizedArray(qa.weight, qa.scales, None, 32, 4, codebook=np.arange(-8, 8, dtype=np.int8))
    backend = MLXBackend(device="cpu", quantized=True)
    held, kept = backend._to_device(other), backend._to_device(qa)
    assert (held.bits, held.codebook) == (8, None) and (kept.bits, kept.codebook is not None) == (4, True)
    np.testing.assert_array_equal(np.array(held.a), other.dequantize())
    np.testing.assert_array_equal(np.array(kept.a), dense("IQ4_NL", blk, 8))
    with pytest.raises(ValueError, match="IQ4_NL's or MXFP4's"):
        MLXQuantizedTensor(kept.w, kept.scales, None, 32, 4, codebook=mx.array(other.codebook))


@needs_kernels
@pytest.mark.parametrize("type_name", ["IQ4_NL", "MXFP4"])
def test_a_compiled_block_keeps_the_codebook(type_name):
    """A layer's compiled block (``backend.compile``: the weights pass as their arrays, a decode step's path) runs the
    codebook weight's product, the same bits as outside it (its spec had left the codebook out: IQ4 weights were read
    as affine 4-bit integers there)."""
    blk = blocks(type_name, 64, 256, seed=9)
    backend = MLXBackend(device="cpu", quantized=True)
    w = backend._to_device(quant.repack_gguf(blk, type_name, 64, 256))
    x = MLXTensor(mx.random.normal((1, 256), key=mx.random.key(9)))
    compiled = backend.compile(lambda x, w: x.linear(w))(x, w).a
    assert mx.array_equal(compiled, x.linear(w).a).item()
    ref = np.array(x.a, np.float64) @ dense(type_name, blk, 64).astype(np.float64).T
    np.testing.assert_allclose(np.array(compiled), ref, rtol=0, atol=1e-5 * np.abs(ref).max())
