"""int8 activations quantize x as llama.cpp's CPU path does for the weight's type (ggml-cpu's type_traits
``vec_dot_type``): per 256 elements as its Q8_K blocks for the K-quants (Q2_K .. Q6_K) and IQ4_XS, per 32 as its Q8_0
blocks for Q4_0, Q5_0, Q8_0 and IQ4_NL. Each product is held to a NumPy reference of llama.cpp's dot product
(``ggml_vec_dot_q4_K_q8_K``, ``_q6_K_q8_K``, ``_q4_0_q8_0``, ... in ggml-cpu's quants.c) on random blocks of the type:
exact integer sums per sub-block, then its scales, in float64."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from mlx_engine.mlx import cpu_kernels  # noqa: E402
from mlx_engine.weights import quant  # noqa: E402
from mlx_engine.weights.base import unpack  # noqa: E402
from tests.conftest import passed_on_avx2  # noqa: E402
from tests.test_weights_gguf import k_quant_blocks, quantized  # noqa: E402

pytestmark = [pytest.mark.usefixtures("mlx_on_the_cpu"),
              pytest.mark.skipif(cpu_kernels.qmatmul is None or cpu_kernels.int8_problem() is not None,
                                 reason="int8 activations do not run here (the kernels need AVX-512 VNNI or AVX2)")]

PER_256 = ["Q4_K", "Q5_K", "Q6_K", "Q3_K", "IQ4_XS"]  # the vec_dot_type Q8_K
PER_32 = ["Q4_0", "Q5_0", "Q8_0", "IQ4_NL"]  # Q8_0
ZERO_POINT = {"Q4_0": 8, "Q5_0": 16, "Q8_0": 128}  # the integers as repacked: value d * (q - zero point)


def q8_k(x) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] as llama.cpp's Q8_K blocks hold it (quantize_row_q8_K_ref of ggml-quants.c, which its x86 CPU path
    runs): per 256 elements, ``max`` the first element of largest |x|, ``iscale = -127 / max``, ``q = min(127,
    nearest_int(iscale * x))``, ``d = 1 / iscale``, all float32 (d = 0, q = 0 where the block is zeros). Returns
    (q int64 [M, K], d float32 [M, K / 256])."""
    x = np.array(x, np.float32)
    blocks = x.reshape(x.shape[0], -1, 256)
    top = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)[..., 0]
    safe = np.where(top != 0, top, np.float32(1))
    iscale = np.where(top != 0, np.float32(-127) / safe, np.float32(0)).astype(np.float32)
    q = np.minimum(127, np.rint(iscale[..., None] * blocks)).astype(np.int64)  # (rint: nearest_int's even ties)
    d = np.where(top != 0, np.float32(1) / np.where(top != 0, iscale, np.float32(1)), np.float32(0))
    return q.reshape(x.shape), d.astype(np.float32)


def q8_0(x) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] as llama.cpp's Q8_0 blocks hold it (quantize_row_q8_0 of ggml-cpu's x86 quants.c): per 32 elements
    ``q = round(x * (127 / max|x|))`` (nearest even), ``d = max|x| / 127`` stored in float16. Returns (q int64 [M, K],
    d float32 [M, K / 32])."""
    x = np.array(x, np.float32)
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(-1)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax != 0)
    q = np.rint(blocks * inv[..., None]).astype(np.int64)
    return q.reshape(x.shape), (amax / np.float32(127)).astype(np.float16).astype(np.float32)


def q8_k_x(x) -> np.ndarray:
    """x as the Q8_K blocks see it: float64 d * q (see q8_k)."""
    q, d = q8_k(x)
    return (q.reshape(q.shape[0], -1, 256) * d[..., None].astype(np.float64)).reshape(q.shape)


def _integers(qa, type_name: str) -> np.ndarray:
    """The weight's integers as its dot product multiplies them: q, q - zero point, or kvalues[q] (int64 [N, K])."""
    w = unpack(qa.weight, qa.bits).astype(np.int64)
    if qa.codebook is not None:
        return qa.codebook.astype(np.int64)[w]
    if qa.biases is None and qa.super_scales is not None:  # Q6_K, Q3_K: symmetric about 2**(bits - 1)
        return w - 2 ** (qa.bits - 1)
    return w - ZERO_POINT.get(type_name, 0)


def llama_cpp_dot(x, qa, type_name: str) -> np.ndarray:
    """llama.cpp's product of x [M, K] with the weight ``qa`` (a repacked GGUF tensor [N, K]) in float64: x in Q8_K
    blocks for a weight of two-level scales, per super-block ``d_x * (d * sum_g sc_g * S_g + (-dmin) * sum_g m_g *
    B_g)`` (S_g the exact integer sum of w * x_q over sub-block g, B_g that of x_q; ggml_vec_dot_q4_K_q8_K and its
    kin); else in Q8_0 blocks, ``sum_b d_w * d_x * S_b`` per 32 (ggml_vec_dot_q4_0_q8_0 and its kin)."""
    w = _integers(qa, type_name)
    n, k = w.shape
    g = qa.group_size
    xq, dx = q8_k(x) if qa.super_scales is not None else q8_0(x)
    m = xq.shape[0]
    sums = np.einsum("mgj,ngj->mng", xq.reshape(m, k // g, g), w.reshape(n, k // g, g))  # exact, int64
    if qa.super_scales is None:  # scale d_w per 32
        return np.einsum("mng,ng,mg->mn", sums.astype(np.float64), qa.scales.astype(np.float64),
                         dx.astype(np.float64))
    per = 256 // g
    sup = qa.super_scales.astype(np.float64)  # [N, K / 256, (d, -dmin)]
    isum = (sums * qa.scales.astype(np.int64)[None]).reshape(m, n, k // 256, per).sum(-1)
    out = isum * sup[None, :, :, 0]
    if qa.biases is not None:  # the mins meet x's integer sums per sub-block (Q8_K's bsums)
        bx = xq.reshape(m, k // g, g).sum(-1)
        msum = (bx[:, None, :] * qa.biases.astype(np.int64)[None]).reshape(m, n, k // 256, per).sum(-1)
        out = out + msum * sup[None, :, :, 1]
    return np.einsum("mni,mi->mn", out, dx.astype(np.float64))


def _weight(type_name: str, rows: int, cols: int, seed: int):
    """(repacked QuantizedArray, the file's dequantized float32 weight) of random blocks of ``type_name``."""
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name in ("IQ4_NL", "IQ4_XS"):  # any integers and sub-scales, a small finite d (gguf cannot quantize them)
        dt = quant.BLOCKS[type_name]
        n = rows * cols // (32 if type_name == "IQ4_NL" else 256)
        rng = np.random.default_rng(seed)
        blk = rng.integers(0, 256, (n, dt.itemsize), dtype=np.uint8).view(dt).reshape(n).copy()
        blk["d"] = rng.uniform(1e-4, 2e-3, n).astype(np.float16)
        raw = blk.view(np.uint8)
    elif type_name.endswith("_K"):
        raw = k_quant_blocks((rows, cols), qtype, seed)
    else:
        raw = quantized((rows, cols), qtype, seed)[1]
    blk = raw.reshape(-1).view(quant.BLOCKS[type_name])
    return quant.repack_gguf(blk, type_name, rows, cols), gguf.quants.dequantize(raw.reshape(rows, -1), qtype)


def _args(qa, type_name: str) -> tuple:
    """The weight as the backend gives it to the kernels: (w, scales, biases, group size, bits, super, codebook), a
    legacy symmetric type (Q4_0, Q5_0, Q8_0) without its biases (the kernel makes them from the zero point)."""
    biases = None if qa.biases is None or type_name in ZERO_POINT else mx.array(qa.biases)
    return (mx.array(qa.weight), mx.array(qa.scales), biases, qa.group_size, qa.bits,
            None if qa.super_scales is None else mx.array(qa.super_scales), qa.codebook is not None)


def _product(x, qa, type_name: str, activations: str):
    w, s, b, group_size, bits, sup, codebook = _args(qa, type_name)
    return cpu_kernels.qmatmul(x, w, s, b, group_size, bits, activations, sup, codebook)


def _xhat(x, per_256: bool) -> np.ndarray:
    """x as Q8_K (per_256) or Q8_0 blocks see it: float64 d * q."""
    if per_256:
        return q8_k_x(x)
    q, d = q8_0(x)
    return q * np.repeat(d, 32, axis=1).astype(np.float64)


def _x(m: int, k: int, seed: int) -> "mx.array":
    """Heavy-tailed x (magnitudes that differ between blocks of 32, as a layer's inputs do), a block of zeros."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, k)) * np.exp(1.5 * rng.standard_normal((m, k)))).astype(np.float32)
    x[0, :256] = 0
    return mx.array(x)


# float32 sums of exact integer sums, each under a float32 scale: a few ulps of the largest partial sums
def _close(got, want) -> bool:
    return bool(np.abs(np.asarray(got, np.float64) - want).max() <= 1e-5 * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("type_name", PER_256 + PER_32)
@pytest.mark.parametrize("m", [1, 3, 8, 40])
def test_int8_product_is_llama_cpps_reference(type_name, m):
    """Decode rows (1, 3), tiles (8) and several threads quantizing x (40): our int8 product equals llama.cpp's
    dot product of the type within float32 rounding, and x quantized the other way is farther off than that (the
    check tells the two apart)."""
    k = 768  # three super-blocks; six spans of 128 (the nibble order)
    qa, dense = _weight(type_name, 72, k, seed=m)
    x = _x(m, k, seed=m)
    per_256 = type_name in PER_256
    assert (qa.super_scales is not None) == per_256
    want = llama_cpp_dot(x, qa, type_name)
    # the reference's integer form is x as its blocks hold it times the file's weights, which gguf's dequantize
    # rounds to float32 (half an ulp each: d * sc * q - dmin * m can need more than 24 bits)
    xhat = _xhat(x, per_256)
    ulps = np.spacing(np.abs(dense)).astype(np.float64) / 2
    bound = np.abs(xhat) @ ulps.T + 1e-12 * np.abs(want).max()
    assert np.all(np.abs(want - xhat @ dense.astype(np.float64).T) <= bound)
    got = np.array(_product(x, qa, type_name, "int8"))
    assert _close(got, want), np.abs(got - want).max() / np.abs(want).max()
    assert not _close(got, _xhat(x, not per_256) @ dense.astype(np.float64).T)


@pytest.mark.parametrize("m", [1, 8])
def test_q2_k_takes_the_float_kernel(m):
    """Q2_K (groups of 16 with mins: x's sums per 16, which its mins meet, are not kept) stays on the float32 kernel
    with int8 activations: the exact product's bits, where llama.cpp takes x in Q8_K blocks."""
    qa, _ = _weight("Q2_K", 40, 512, seed=m)
    x = _x(m, 512, seed=m)
    assert mx.array_equal(_product(x, qa, "Q2_K", "int8"), _product(x, qa, "Q2_K", "float32")).item()


@pytest.mark.parametrize("m", [1, 8])
def test_one_node_quantizes_x_once_per_way(m):
    """A node of several weights (a layer's q, k and v) whose types take x two ways (a Q4_K_M file's Q4_K and Q6_K
    beside the Q8_0 and Q5_0 it falls back to): each output is its weight's product alone, bit for bit."""
    k = 512
    x = _x(m, k, seed=10 + m)
    types = ["Q4_K", "Q8_0", "Q6_K", "Q5_0"]
    weights = [_weight(t, 24 + 8 * i, k, seed=i)[0] for i, t in enumerate(types)]
    cols = [list(c) for c in zip(*(_args(qa, t) for qa, t in zip(weights, types)))]
    ys = cpu_kernels.qmatmul_many(x, *cols[:5], None, "int8", supers=cols[5], codebooks=cols[6])
    for y, qa, t in zip(ys, weights, types):
        assert mx.array_equal(y, _product(x, qa, t, "int8")).item(), t


def test_the_avx2_kernel_too():
    """The same tests on the kernels' AVX2 copy (on an AVX-512 machine, a process told to take it)."""
    assert passed_on_avx2(__file__, "reference or float_kernel or once_per_way") >= 40
