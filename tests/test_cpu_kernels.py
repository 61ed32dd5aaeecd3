"""Our CPU kernels (mlx_engine/mlx/kernels, built by setup.py at install): the quantized product against MLX's own
dequantize + matmul for every bit width, group size and scale dtype; the loader's fallbacks; and the engine's use of
them (weights stay quantized on the CPU, and a model's tokens are those of the float path)."""

from __future__ import annotations

import importlib
import os
import platform
import subprocess
import sys

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from mlx_engine.mlx import cpu_kernels  # noqa: E402
from tests.conftest import passed_on_avx2  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _references_on_the_cpu():
    """The kernels run on the CPU, so the MLX operations they are held to run there too: on a machine with a GPU,
    MLX's default device, float32 matmuls round through TF32 (seen on CUDA: 1e-3 apart)."""
    before = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(before)


def _int8_supported() -> bool:
    import importlib

    return importlib.import_module("mlx_engine.mlx._kernels").int8_supported()


def test_kernels_are_built_and_loaded():
    """setup.py builds them wherever a C++ compiler and CMake exist (CI installs both); a silent fallback would
    hide a 2-3x slowdown, so the suite insists."""
    assert cpu_kernels.qmatmul is not None, cpu_kernels.status()
    import importlib

    _kernels = importlib.import_module("mlx_engine.mlx._kernels")
    assert _kernels.isa() in ("avx512", "avx2", "neon", "generic")
    assert _kernels.threads() >= 1
    assert cpu_kernels.status().startswith(_kernels.isa())


def test_the_avx2_kernels_where_the_cpu_has_avx512():
    """The AVX2 copy of the row kernels, which an AVX-512 machine never picks by itself: the products' tests again in
    a process told to take it ($MLX_ENGINE_CPU_ISA=avx2; elsewhere the variable changes nothing), the int8 ones
    included (AVX2's int8 kernel)."""
    isa = importlib.import_module("mlx_engine.mlx._kernels").isa()
    env = {**os.environ, "MLX_ENGINE_CPU_ISA": "avx2"}
    got = subprocess.run([sys.executable, "-c", "from mlx_engine.mlx import _kernels; print(_kernels.isa())"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert got.stdout.strip() == ("avx2" if isa in ("avx512", "avx2") else isa), got.stderr[-2000:]
    selection = "kernels_are_built or qmatmul_matches or qmatmul_many or many_rows or int8_activations"
    # off x86-64 (NEON: 58 pass under qemu-aarch64) the int8 tests skip, as they do in this process
    assert passed_on_avx2(__file__, selection) > (100 if isa in ("avx512", "avx2") else 50)


def _reference(x, q, s, b, group_size, bits):
    """float32 x @ dequantize(...).T with the scales widened to float32 first (exact dequantized values)."""
    w = mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), group_size=group_size, bits=bits)
    return np.array(x.astype(mx.float32) @ w.T)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", ["float32", "float16", "bfloat16"])
def test_qmatmul_matches_dequantize_matmul(bits, group_size, scale_dtype):
    key = mx.random.key(bits * 1000 + group_size)
    k1, k2 = mx.random.split(key)
    n, k = 70, 256  # 70 rows: blocks of 4 and a remainder
    q, s, b = mx.quantize(mx.random.normal((n, k), key=k1), group_size=group_size, bits=bits)
    dt = getattr(mx, scale_dtype)
    s, b = s.astype(dt), b.astype(dt)
    for m in (1, 3, 4, 9, 32, 45):  # one row (decode), tiles of 4 and the rest; panels (a prefill): 12s and the rest
        x = mx.random.normal((m, k), key=k2)
        got = np.array(cpu_kernels.qmatmul(x, q, s, b, group_size, bits))
        want = _reference(x, q, s, b, group_size, bits)
        # float32 sums in another order: a few ulps of the largest partial sums
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("bits, n", [(4, 77), (6, 40), (8, 16)])
def test_qmatmul_panel_rows_do_not_depend_on_their_neighbours(bits, n):
    """From 32 rows of x on (a prefill) the weights are dequantized into panels and each output is a sum over k in
    order: a row's outputs are the same bits whichever other rows share the call (a prompt's tokens give the same
    values prefilled in one chunk or several of 32 or more), across partial panels of output rows (77, 40) and the
    row blocks' remainders."""
    q, s, b = mx.quantize(mx.random.normal((n, 192), key=mx.random.key(50 + bits)), group_size=64, bits=bits)
    x = mx.random.normal((90, 192), key=mx.random.key(60))
    whole = np.array(cpu_kernels.qmatmul(x, q, s, b, 64, bits))
    for a, e in ((0, 32), (17, 90), (40, 77)):
        assert np.array_equal(np.array(cpu_kernels.qmatmul(x[a:e], q, s, b, 64, bits)), whole[a:e])
    np.testing.assert_allclose(whole, _reference(x, q, s, b, 64, bits), rtol=0,
                               atol=2e-5 * max(1.0, np.abs(whole).max()))


def test_qmatmul_shapes_dtypes_and_many_rows():
    key = mx.random.key(0)
    q, s, b = mx.quantize(mx.random.normal((300, 512), key=key), group_size=32, bits=4)
    x = mx.random.normal((2, 70, 512), key=mx.random.key(1)).astype(mx.float16)
    y = cpu_kernels.qmatmul(x, q, s, b, 32, 4)
    assert y.shape == (2, 70, 300) and y.dtype == mx.float16  # leading axes kept, x's dtype
    want = _reference(x.reshape(140, 512), q, s, b, 32, 4).reshape(2, 70, 300)
    np.testing.assert_allclose(np.array(y.astype(mx.float32)), want, rtol=2e-3, atol=2e-3)


def test_qmatmul_takes_strided_views():
    """Inputs in any layout: no graph node makes them row-major, the primitive gathers a strided one itself."""
    key = mx.random.key(3)
    q, s, b = mx.quantize(mx.random.normal((128, 256), key=key), group_size=32, bits=4)
    x = mx.random.normal((256, 5), key=mx.random.key(4)).T  # [5, 256], column-major
    qv, sv, bv = q[::2], s[::2], b[::2]  # every other row: strided views
    for args in ((x, q, s, b), (x, qv, sv, bv), (mx.contiguous(x), qv, s[::2], b[::2])):
        got = np.array(cpu_kernels.qmatmul(*args, 32, 4))
        want = _reference(mx.contiguous(args[0]), *(mx.contiguous(a) for a in args[1:]), 32, 4)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("traditional", [False, True])
def test_rope_apply_is_mlx_rope_bit_for_bit(traditional):
    """RoPE from the table equals mx.fast.rope exactly: consecutive positions, per-token positions (one token per
    batch row, as the engine lays out a batch of sequences), partial dims, Llama 3's explicit frequencies."""
    x = mx.random.normal((1, 4, 7, 64), key=mx.random.key(5))
    freqs = mx.array(10000.0 ** (np.arange(0, 48, 2) / 48) * np.linspace(1, 8, 24), dtype=mx.float32)
    for dims, base, scale, f in ((64, 10000.0, 1.0, None), (48, 1e6, 0.25, None), (48, None, 1.0, freqs)):
        cos, sin = cpu_kernels.rope_table(7, 13, dims, base, scale, f)
        want = mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=13, freqs=f)
        assert mx.array_equal(cpu_kernels.rope_apply(x, cos, sin, dims, traditional), want).item()
    per_token = x.transpose(2, 1, 0, 3)  # [7, 4, 1, 64], a strided view
    pos = mx.array([3, 9, 0, 44, 5, 6, 1000], dtype=mx.int32)
    cos, sin = cpu_kernels.rope_table(1, pos, 64, 10000.0, 1.0, None)
    want = mx.fast.rope(per_token, 64, traditional=traditional, base=10000.0, scale=1.0, offset=pos)
    assert mx.array_equal(cpu_kernels.rope_apply(per_token, cos, sin, 64, traditional), want).item()
    with pytest.raises(ValueError, match="cos and sin"):
        cpu_kernels.rope_apply(x, cos[:5], sin[:5], 64, traditional)  # 5 table rows for 7 tokens


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_qtake_is_mx_dequantize_of_the_rows_bit_for_bit(bits):
    """The embedding lookup of a quantized weight against mx.dequantize of the gathered rows, to the bit: every group
    size and scale dtype, with biases and symmetric, ids in any order, repeated, negative (from the end), 2-D."""
    W = mx.random.normal((50, 256), key=mx.random.key(bits))
    ids = mx.array([[3, 0, 49], [7, -1, 3]], dtype=mx.int32)
    for gs in (32, 64, 128):
        w, s, b = mx.quantize(W, group_size=gs, bits=bits)
        for dtype in (mx.float32, mx.float16, mx.bfloat16):
            s2, b2 = s.astype(dtype), b.astype(dtype)
            for biases in (b2, None):
                fs = s2.astype(mx.float32)
                fb = fs * -(2 ** (bits - 1)) if biases is None else biases.astype(mx.float32)
                want = mx.dequantize(w[ids], fs[ids], fb[ids], group_size=gs, bits=bits)
                got = cpu_kernels.qtake(w, s2, biases, ids, gs, bits)
                assert got.shape == (2, 3, 256) and got.dtype == mx.float32
                assert mx.array_equal(got, want).item(), (gs, dtype, biases is None)
    with pytest.raises(ValueError, match="bits must be"):
        cpu_kernels.qtake(w, s, b, ids, 128, 7)
    with pytest.raises(ValueError, match="ids must be integers"):
        cpu_kernels.qtake(w, s, b, ids.astype(mx.float32), 128, bits)


@pytest.mark.parametrize("dims, base, scale", [(64, 10000.0, 1.0), (256, 1000000.0, 1.0), (128, 10000.0, 0.125)])
def test_rope_row_is_rope_table_bit_for_bit(dims, base, scale):
    """A decode step's angles sliced from a table made for 1024 positions are the ones made for that position
    alone, at the start, the end and across chunks, far out (131071) too; the tables kept stay bounded."""
    for pos in (0, 1, 1023, 1024, 5000, 99999, 131071):
        got, want = cpu_kernels.rope_row(pos, dims, base, scale), cpu_kernels.rope_table(1, pos, dims, base, scale,
                                                                                          None)
        for g, w in zip(got, want):
            assert g.shape == (1, dims // 2) and mx.array_equal(g, w).item(), pos
    assert len(cpu_kernels._rope_chunks) <= 8


@pytest.mark.parametrize("heads, kv_heads, rows, dim", [(9, 3, 1, 64), (4, 1, 3, 256), (2, 2, 16, 80), (3, 1, 2, 72)])
def test_attend_matches_mlx_attention(heads, kv_heads, rows, dim):
    """Decode attention against MLX's: grouped heads, keys and values as views of a larger cache, with a mask that
    hides some keys (and one row seeing a single key), and without one."""
    k1, k2, k3 = mx.random.split(mx.random.key(heads * 100 + rows), 3)
    q = mx.random.normal((1, heads, rows, dim), key=k1)
    cache_k = mx.random.normal((1, kv_heads, 700, dim), key=k2)
    cache_v = mx.random.normal((1, kv_heads, 700, dim), key=k3)
    k, v = cache_k[:, :, :613], cache_v[:, :, :613]
    visible = np.arange(613)[None, :] <= np.arange(613 - rows, 613)[:, None]
    visible[0, :] = False
    visible[0, 17] = True
    mask = mx.array(np.where(visible, 0.0, -np.inf).astype(np.float32))
    for m in (None, mask):
        got = cpu_kernels.attend(q, k, v, dim ** -0.5, m)
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=dim ** -0.5, mask=m)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=2e-6)
    with pytest.raises(ValueError, match="multiple of H_kv"):
        cpu_kernels.attend(q, k[:, :, :, :dim - 1], v, 1.0, None)


def _random_mask(rng, rows: int, width: int):
    """An additive float32 mask [rows, width]: about 70 % of the keys visible, each row's last one always."""
    visible = rng.random((rows, width)) < 0.7
    visible[:, -1] = True
    return mx.array(np.where(visible, 0.0, -np.inf).astype(np.float32))


def _cells(start: int, lo: int, hi: int, lo2: int = 0, hi2: int = 0) -> mx.array:
    return mx.array([start, lo, hi, lo2, hi2], mx.int32)


@pytest.mark.parametrize("heads, kv_heads, rows, dim, dims, traditional, cells, start, lo, hi, masked", [
    (9, 3, 1, 64, 64, False, 256, 40, 0, 41, False),       # smollm2's heads, a decode step
    (4, 1, 1, 256, 256, False, 600, 500, 0, 501, False),   # gemma3's, split over the threads' key chunks
    (8, 2, 1, 128, 64, True, 64, 63, 10, 64, True),        # partial, traditional RoPE; a window's run, masked
    (8, 8, 3, 32, 16, False, 700, 600, 0, 603, True)])     # three rows of one sequence
def test_attend_cached_is_rope_writes_and_attend_bit_for_bit(heads, kv_heads, rows, dim, dims, traditional, cells,
                                                             start, lo, hi, masked):
    """The fused decode step against rope_apply, the two slice updates and attend done apart: the output and the
    cache after it, to the bit; a cache given as a strided view (which it copies, leaving the view's array alone)
    the same; bad cells refused."""
    rng = np.random.default_rng(heads * 1000 + cells)

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    q, k, v = normal(1, heads, rows, dim), normal(1, kv_heads, rows, dim), normal(1, kv_heads, rows, dim + 16)
    keys, values = normal(1, kv_heads, cells, dim), normal(1, kv_heads, cells, dim + 16)
    cos, sin = cpu_kernels.rope_table(rows, start, dims, 10000.0, 1.0, None)
    mask = _random_mask(rng, rows, hi - lo) if masked else None
    mx.eval(q, k, v, keys, values, cos, sin)
    want_k, want_v = mx.array(np.array(keys)), mx.array(np.array(values))
    want_k[:, :, start:start + rows] = cpu_kernels.rope_apply(k, cos, sin, dims, traditional)
    want_v[:, :, start:start + rows] = v
    want = cpu_kernels.attend(cpu_kernels.rope_apply(q, cos, sin, dims, traditional), want_k[:, :, lo:hi],
                              want_v[:, :, lo:hi], 0.125, mask)
    mx.eval(want, want_k, want_v)
    wide = mx.array(np.concatenate([np.array(keys)] * 2, axis=-1))  # keys as a strided view of a wider array
    at = _cells(start, lo, hi)
    for ks in (mx.array(np.array(keys)), wide[..., :dim]):  # (fresh arrays: the kernel writes into a plain one)
        o, k2, v2 = cpu_kernels.attend_cached(q, k, v, ks, mx.array(np.array(values)), cos, sin, at, 0.125, dims,
                                              traditional, mask)
        assert o.shape == (1, heads, rows, dim + 16) and k2.shape == keys.shape and v2.shape == values.shape
        for got, exp in ((o, want), (k2, want_k), (v2, want_v)):
            assert mx.array_equal(got, exp).item()
    assert mx.array_equal(wide[..., :dim], keys).item()  # copied, not written through
    bad_cells = [(cells, lo, hi), (start, hi, lo), (start, lo, cells + 1), (-1, lo, hi)]
    for bad in bad_cells + ([(start, lo, hi - 1)] if masked else []):  # (the mask's columns no longer hi - lo)
        ks, vs = mx.array(np.array(keys)), mx.array(np.array(values))
        o, k2, v2 = cpu_kernels.attend_cached(q, k, v, ks, vs, cos, sin, _cells(*bad), 0.125, dims, traditional, mask)
        # known only as the step runs: NaN out, nothing written
        assert np.isnan(np.array(o)).all() and mx.array_equal(k2, keys).item() and mx.array_equal(v2, values).item()
    with pytest.raises(ValueError, match="cells must be int32"):
        cpu_kernels.attend_cached(q, k, v, keys, values, cos, sin, _cells(start, lo, hi).astype(mx.int64), 0.125, dims,
                                  traditional, mask)
    with pytest.raises(ValueError, match="multiple of H_kv"):
        cpu_kernels.attend_cached(q, k[:, :, :, :dim - 1], v, keys, values, cos, sin, at, 0.125, dims, traditional,
                                  mask)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("heads, kv_heads, rows, dim, cells, start, lo, hi, masked", [
    (9, 3, 1, 64, 256, 40, 0, 41, False),        # smollm2's heads, a decode step
    (4, 1, 1, 256, 600, 500, 0, 501, False),     # gemma3's, split over the threads' key chunks
    (8, 2, 3, 72, 64, 60, 10, 63, True),         # three rows, a head size with a tail past 64, masked
    (8, 8, 3, 32, 700, 600, 0, 603, True)])      # masked, split over the threads' key chunks
def test_attend_cached_reads_and_writes_a_16_bit_cache(dtype, heads, kv_heads, rows, dim, cells, start, lo, hi,
                                                        masked):
    """Keys and values kept as float16 or bfloat16: the new ones rounded as MLX's astype rounds them (to the bit,
    values beyond float16's range included), and the output that of attend on the stored cache widened to float32,
    to the bit; mixed or other dtypes refused."""
    rng = np.random.default_rng(heads * 1000 + cells)
    half = getattr(mx, dtype)

    def normal(*shape, scale=1.0):
        return mx.array((rng.standard_normal(shape) * scale).astype(np.float32))

    q, k = normal(1, heads, rows, dim), normal(1, kv_heads, rows, dim)
    # some beyond float16's 65504 (inf, as astype makes them), some below its normals, and its rounding's ties
    v = rng.standard_normal((1, kv_heads, rows, dim)).astype(np.float32) * 3e4
    v[0, 0, 0, :16] = [65504, 65519.99, 65520, -65520, 2.0 ** -25, 3 * 2.0 ** -25, 2.0 ** -14 - 2.0 ** -25,
                       1e-7, -3e-6, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 2.0 ** -126, -0.0, 1e-45, 2049, 2051]
    v[0, -1, -1, :8] *= 1e-9
    v = mx.array(v)
    keys, values = normal(1, kv_heads, cells, dim).astype(half), normal(1, kv_heads, cells, dim).astype(half)
    cos, sin = cpu_kernels.rope_table(rows, start, dim, 10000.0, 1.0, None)
    mask = _random_mask(rng, rows, hi - lo) if masked else None
    mx.eval(q, k, v, keys, values, cos, sin)
    want_k, want_v = mx.array(keys), mx.array(values)
    want_k[:, :, start:start + rows] = cpu_kernels.rope_apply(k, cos, sin, dim, False).astype(half)
    want_v[:, :, start:start + rows] = v.astype(half)
    want = cpu_kernels.attend(cpu_kernels.rope_apply(q, cos, sin, dim, False),
                              want_k[:, :, lo:hi].astype(mx.float32), want_v[:, :, lo:hi].astype(mx.float32), 0.125,
                              mask)
    mx.eval(want, want_k, want_v)
    at = _cells(start, lo, hi)
    o, k2, v2 = cpu_kernels.attend_cached(q, k, v, mx.array(keys), mx.array(values), cos, sin, at, 0.125, dim, False,
                                          mask)
    assert o.dtype == mx.float32 and k2.dtype == half and v2.dtype == half
    if dtype == "float16":
        assert not np.isfinite(np.array(v2.astype(mx.float32))).all()  # the overflow did happen
    for name, got, exp in (("o", o, want), ("k", k2, want_k), ("v", v2, want_v)):
        g, e = np.array(got.astype(mx.float32)), np.array(exp.astype(mx.float32))
        bad = ~((g == e) | (np.isnan(g) & np.isnan(e)))
        assert not bad.any(), (name, np.argwhere(bad)[:5], g[bad][:5], e[bad][:5])
    with pytest.raises(ValueError, match="keys and values must both be"):
        cpu_kernels.attend_cached(q, k, v, keys, values.astype(mx.float32), cos, sin, at, 0.125, dim, False, mask)
    with pytest.raises(ValueError, match="q, k, v, cos and sin must be float32"):
        cpu_kernels.attend_cached(q.astype(half), k, v, keys, values, cos, sin, at, 0.125, dim, False, mask)


def test_a_float16_cache_widened_first_where_the_cpu_has_avx512():
    """An AVX-512 CPU reads a float16 cache as it lies (the attention's chunk kernel converting each row as it loads
    it); a CPU with AVX2 alone widens a chunk of it to float32 first: the 16-bit cache's tests again in a process told
    to take the AVX2 copies ($MLX_ENGINE_CPU_ISA=avx2), each output still the bits of attention on the widened
    cache."""
    assert passed_on_avx2(__file__, "attend_cached_reads") >= 14


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("heads, kv_heads, dim, cells, start, runs", [
    (4, 1, 256, 700, 689, ((400, 690), (5, 300))),  # gemma3's heads: 16 chunks of 37 keys, one across the runs
    (9, 3, 64, 300, 40, ((200, 300), (0, 41))),     # smollm2's: the new token's cell ends the second run
    (8, 2, 32, 64, 3, ((60, 64), (0, 4)))])         # one chunk of both runs
def test_attend_cached_reads_a_wrapped_ring_as_its_two_runs(dtype, heads, kv_heads, dim, cells, start, runs):
    """A sliding window whose ring wrapped sees two runs of cells: attended as ``attend`` over the two runs'
    concatenation (the stored cache widened to float32), to the bit, for float32 and 16-bit caches, chunks across
    the runs' boundary included; a mask beside two runs refused (NaN, nothing written)."""
    rng = np.random.default_rng(heads * 100 + cells)
    kind = getattr(mx, dtype)

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    q, k, v = normal(1, heads, 1, dim), normal(1, kv_heads, 1, dim), normal(1, kv_heads, 1, dim)
    keys, values = normal(1, kv_heads, cells, dim).astype(kind), normal(1, kv_heads, cells, dim).astype(kind)
    cos, sin = cpu_kernels.rope_table(1, start, dim, 10000.0, 1.0, None)
    mx.eval(q, k, v, keys, values, cos, sin)
    want_k, want_v = mx.array(keys), mx.array(values)
    want_k[:, :, start:start + 1] = cpu_kernels.rope_apply(k, cos, sin, dim, False).astype(kind)
    want_v[:, :, start:start + 1] = v.astype(kind)
    (lo, hi), (lo2, hi2) = runs
    both_k = mx.concatenate([want_k[:, :, lo:hi], want_k[:, :, lo2:hi2]], axis=2).astype(mx.float32)
    both_v = mx.concatenate([want_v[:, :, lo:hi], want_v[:, :, lo2:hi2]], axis=2).astype(mx.float32)
    want = cpu_kernels.attend(cpu_kernels.rope_apply(q, cos, sin, dim, False), both_k, both_v, 0.125, None)
    mx.eval(want, want_k, want_v)
    o, k2, v2 = cpu_kernels.attend_cached(q, k, v, mx.array(keys), mx.array(values), cos, sin,
                                          _cells(start, lo, hi, lo2, hi2), 0.125, dim, False, None)
    for got, exp in ((o, want), (k2, want_k), (v2, want_v)):
        assert mx.array_equal(got, exp).item()
    mask = mx.zeros((1, hi - lo))
    o, k2, _ = cpu_kernels.attend_cached(q, k, v, mx.array(keys), mx.array(values), cos, sin,
                                         _cells(start, lo, hi, lo2, hi2), 0.125, dim, False, mask)
    assert np.isnan(np.array(o)).all() and mx.array_equal(k2, keys).item()


@pytest.mark.parametrize("shape", [(1, 1, 576), (3, 5, 577), (600, 64), (1, 4, 1, 256)])
def test_rms_norm_is_mlx_rms_norm(shape):
    """RMSNorm against mx.fast.rms_norm (MLX's CPU fallback: the same steps; on x86-64 the same order of the sum of
    squares too, so bit for bit there): with and without a weight, rows small enough for eps to count, a strided
    view, 600 rows (split over the threads), and the gradient (training differentiates through it)."""
    k1, k2, k3 = mx.random.split(mx.random.key(sum(shape)), 3)
    d = shape[-1]
    x = mx.random.normal(shape, key=k1) * mx.where(mx.arange(shape[-2])[:, None] % 2 == 0, 1.0, 1e-3)
    w = mx.random.normal((d,), key=k2)
    exact = platform.machine() in ("x86_64", "AMD64")
    for weight in (w, None):
        for eps in (1e-6, 1e-5):
            got, want = cpu_kernels.rms_norm(x, weight, eps), mx.fast.rms_norm(x, weight, eps)
            assert got.shape == want.shape and got.dtype == mx.float32
            if exact:
                assert mx.array_equal(got, want).item(), (weight is None, eps)
            np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-6, atol=0)
    view = mx.random.normal((*shape[:-1], 2 * d), key=k3)[..., ::2]
    np.testing.assert_allclose(np.array(cpu_kernels.rms_norm(view, w, 1e-5)),
                               np.array(mx.fast.rms_norm(view, w, 1e-5)), rtol=2e-6, atol=0)
    cot = mx.random.normal(shape, key=k3)
    grads = mx.grad(lambda a, b: (cpu_kernels.rms_norm(a, b, 1e-5) * cot).sum(), argnums=(0, 1))(x, w)
    wants = mx.grad(lambda a, b: (mx.fast.rms_norm(a, b, 1e-5) * cot).sum(), argnums=(0, 1))(x, w)
    for got, want in zip(grads, wants):
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="weight must be float32"):
        cpu_kernels.rms_norm(x, w[:-1], 1e-5)
    with pytest.raises(ValueError, match="x must be float32"):
        cpu_kernels.rms_norm(x.astype(mx.float16), w, 1e-5)


@pytest.mark.parametrize("kind", [0, 1])
def test_activation_is_silu_and_gelu_tanh(kind):
    """SiLU (0) and tanh-form GELU (1) against the functions in float64 (closer than MLX's own float32 forms), and
    against mlx.nn's within float32 rounding: a range where they bend and far out (-inf, inf, saturation), 40000
    elements (split over the threads), a strided view, and the gradient (MLX's)."""
    import mlx.nn as nn

    ref = nn.silu if kind == 0 else nn.gelu_approx
    x = mx.concatenate([mx.random.normal((40000,), key=mx.random.key(kind)) * 5,
                        mx.array([0.0, -0.0, 1e-8, -1e-8, 30.0, -30.0, 88.0, -88.0, 1e30, -1e30, np.inf, -np.inf])])
    got = np.array(cpu_kernels.activation(x, kind))
    xd = np.array(x, np.float64)[:-2]
    with np.errstate(over="ignore"):
        inner = xd if kind == 0 else 2 * np.sqrt(2 / np.pi) * (xd + 0.044715 * xd ** 3)
        truth = xd / (1 + np.exp(-inner))
    # float32 rounding of the argument z of exp(-z) moves the result by up to |z| * 2**-24 relative (|z| <= 90 here),
    # so below 1e-9 only the absolute size is asked (MLX's own forms are off by up to 4e-5 relative here)
    np.testing.assert_allclose(got[:-2], truth, rtol=2e-6, atol=1e-9)
    np.testing.assert_allclose(got, np.array(ref(x)), rtol=1e-4, atol=1e-6)  # inf * sigmoid(-inf) is nan in both
    view = x[:40000].reshape(200, 200)[:, ::3]
    np.testing.assert_allclose(np.array(cpu_kernels.activation(view, kind)), np.array(ref(view)), rtol=1e-4,
                               atol=1e-6)
    small = x[:300]
    np.testing.assert_allclose(np.array(mx.grad(lambda a: cpu_kernels.activation(a, kind).sum())(small)),
                               np.array(mx.grad(lambda a: ref(a).sum())(small)), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="float32"):
        cpu_kernels.activation(x.astype(mx.float16), kind)


@pytest.mark.parametrize("shape", [(1, 1, 576), (600, 64)])
def test_add_rms_norm_is_the_add_then_the_norm(shape):
    """``add_rms_norm(x, r, w, eps)`` (a residual add and the norm after it, one graph node) returns the float32 sum
    and its RMSNorm bit for bit as the two operations give them, with and without a weight, on a decode row and on
    600 rows split over the threads, on strided views; gradients of all inputs are those of the composed form;
    ``Tensor.add_rms_norm`` uses it and agrees with the backend-neutral form."""
    from mlx_engine.ml import Tensor
    from mlx_engine.mlx.tensor import MLXTensor

    x = mx.random.normal(shape, key=mx.random.key(30))
    r = mx.random.normal(shape, key=mx.random.key(31)) * 3
    w = mx.random.normal((shape[-1],), key=mx.random.key(32))
    for weight in (w, None):
        s, n = cpu_kernels.add_rms_norm(x, r, weight, 1e-6)
        assert np.array_equal(np.array(s), np.array(x + r))
        assert np.array_equal(np.array(n), np.array(cpu_kernels.rms_norm(x + r, weight, 1e-6)))
    big = mx.random.normal((600, 128), key=mx.random.key(33))
    xv, rv = big[:, ::2], big[::-1, 1::2]
    s, n = cpu_kernels.add_rms_norm(xv, rv, None, 1e-5)
    assert np.array_equal(np.array(n), np.array(cpu_kernels.rms_norm(xv + rv, None, 1e-5)))
    for arg in (0, 1, 2):
        got = mx.grad(lambda a, b, c: sum(t.sum() * k for t, k in zip(cpu_kernels.add_rms_norm(a, b, c, 1e-5),
                                                                     (0.5, 2.0))), argnums=arg)(x, r, w)
        ref = mx.grad(lambda a, b, c: ((a + b).sum() * 0.5 + mx.fast.rms_norm(a + b, c, 1e-5).sum() * 2.0),
                      argnums=arg)(x, r, w)
        np.testing.assert_allclose(np.array(got), np.array(ref), rtol=1e-4, atol=1e-5)
    h, o, wt = MLXTensor(x), MLXTensor(r), MLXTensor(w)
    for got, want in zip(h.add_rms_norm(o, wt, 1e-6), Tensor.add_rms_norm(h, o, wt, 1e-6)):
        assert np.array_equal(np.array(got.a), np.array(want.a))
    with pytest.raises(ValueError, match="residual must be float32 of x's shape"):
        cpu_kernels.add_rms_norm(x, r[..., :5], None, 1e-5)


@pytest.mark.parametrize("kind", [0, 1])
def test_gated_activation_is_activation_times_up(kind):
    """``activation(x, kind, up)`` (a gated MLP's act(gate) * up as one operation) equals the activation times up bit
    for bit, on 40000 elements split over the threads and on strided views; its gradients (both inputs) are those
    of the composed form; ``Tensor.gated`` uses it and agrees with the backend-neutral form."""
    from mlx_engine.ml import Tensor
    from mlx_engine.mlx.tensor import MLXTensor

    x = mx.random.normal((40000,), key=mx.random.key(10 + kind)) * 5
    up = mx.random.normal((40000,), key=mx.random.key(20 + kind))
    want = np.array(cpu_kernels.activation(x, kind)) * np.array(up)  # float32 products, as numpy rounds them
    assert np.array_equal(np.array(cpu_kernels.activation(x, kind, up)), want)
    xv, uv = x.reshape(200, 200)[:, ::3], up.reshape(200, 200)[::-1, 1::3]
    assert np.array_equal(np.array(cpu_kernels.activation(xv, kind, uv)),
                          np.array(cpu_kernels.activation(xv, kind)) * np.array(uv))
    small, small_up = x[:300], up[:300]
    for arg in (0, 1):
        got = mx.grad(lambda a, b: cpu_kernels.activation(a, kind, b).sum(), argnums=arg)(small, small_up)
        ref = mx.grad(lambda a, b: (cpu_kernels.activation(a, kind) * b).sum(), argnums=arg)(small, small_up)
        np.testing.assert_allclose(np.array(got), np.array(ref), rtol=1e-5, atol=1e-6)
    name = "silu" if kind == 0 else "gelu_tanh"
    g, u = MLXTensor(x.reshape(1, 200, 200)), MLXTensor(up.reshape(1, 200, 200))
    assert np.array_equal(np.array(g.gated(u, name).a), np.array(Tensor.gated(g, u, name).a))
    with pytest.raises(ValueError, match="up must be float32"):
        cpu_kernels.activation(x, kind, up[:5])
    with pytest.raises(ValueError, match="'silu' or 'gelu_tanh'"):
        g.gated(u, "relu")


@pytest.mark.parametrize("m", [1, 5])
def test_qmatmul_many_is_each_product_alone(m):
    """Several weights of one x as one job (mixed bits, group sizes and scale dtypes; products big enough to be split
    over the threads and small ones that would run on one alone, as a decode step's k and v) give bit for bit what
    each product gives alone: every output row is computed the same way whichever thread and chunk it falls in."""
    k = 576
    specs = [(576, 4, 32, mx.float16), (192, 8, 32, mx.float16), (192, 5, 64, mx.float32), (1536, 6, 64, mx.bfloat16),
             (3, 4, 32, mx.float32)]
    weights = []
    for i, (n, bits, gs, dt) in enumerate(specs):
        q, s, b = mx.quantize(mx.random.normal((n, k), key=mx.random.key(i)), group_size=gs, bits=bits)
        weights.append((q, s.astype(dt), b.astype(dt), gs, bits))
    x = mx.random.normal((m, k), key=mx.random.key(99))
    got = cpu_kernels.qmatmul_many(x, *[[w[i] for w in weights] for i in range(5)])
    assert len(got) == len(weights)
    for y, (q, s, b, gs, bits) in zip(got, weights):
        assert y.shape == (m, q.shape[0])
        assert np.array_equal(np.array(y), np.array(cpu_kernels.qmatmul(x, q, s, b, gs, bits)))
        want = _reference(x, q, s, b, gs, bits)
        np.testing.assert_allclose(np.array(y), want, rtol=0, atol=2e-5 * max(1.0, np.abs(want).max()))
    for kind in [k for k in ("int8", "int16") if _supported(k)]:
        # int8 and int16 too: x quantized once, in the layouts the job's widths read, as alone
        got8 = cpu_kernels.qmatmul_many(x, *[[w[i] for w in weights] for i in range(5)], None, kind)
        for y, (q, s, b, gs, bits) in zip(got8, weights):
            assert np.array_equal(np.array(y), np.array(cpu_kernels.qmatmul(x, q, s, b, gs, bits, kind)))
    with pytest.raises(ValueError, match="one or more weights"):
        cpu_kernels.qmatmul_many(x, [weights[0][0]], [], [], [], [])
    # outputs in the shapes asked for: the same elements in row-major order, no reshape node
    shapes = [[m, 9, 1, 64], [1, m * 3, 64], [m * 192], [m, 2, 768], [m, 3]]
    shaped = cpu_kernels.qmatmul_many(x, *[[w[i] for w in weights] for i in range(5)], shapes)
    for y, want, shape in zip(shaped, got, shapes):
        assert y.shape == tuple(shape) and np.array_equal(np.array(y).ravel(), np.array(want).ravel())
    with pytest.raises(ValueError, match="output shape 0 has .* elements, the product has"):
        cpu_kernels.qmatmul_many(x, *[[w[i] for w in weights[:1]] for i in range(5)], [[m, 10]])


@pytest.mark.parametrize("m", [1, 70])
def test_qmatmul_prologues_and_output_norms_are_the_operations_apart(m):
    """The prologue of ``qmatmul_many`` (an input RMSNorm, a residual add and the norm, a gated activation) and its
    output norms give bit for bit the kernels' own ``rms_norm``, ``add_rms_norm`` and ``activation`` followed by the
    products and the norms apart, for one row (a decode step) and for rows over the threads (a prefill); a wrong
    prologue, a missing input or a norm weight of the wrong size is a ValueError."""
    k, eps = 96, 1e-6
    specs = [(64, 4, mx.float16), (32, 8, mx.float32), (48, 6, mx.bfloat16)]
    weights = []
    for i, (n, bits, dt) in enumerate(specs):
        q, s, b = mx.quantize(mx.random.normal((n, k), key=mx.random.key(30 + i)), group_size=32, bits=bits)
        weights.append((q, s.astype(dt), b.astype(dt), 32, bits))
    ws = [[w[i] for w in weights] for i in range(5)]
    x, r, up = (mx.random.normal((1, m, k), key=mx.random.key(40 + i)) for i in range(3))
    nw = mx.random.normal((k,), key=mx.random.key(43))
    shapes = [[1, m * 4, 16], [1, m, 32], [1, m, 48]]
    out_norms = [mx.random.normal((16,), key=mx.random.key(44)), None, mx.random.normal((48,), key=mx.random.key(45))]

    def apart(x_in):
        ys = cpu_kernels.qmatmul_many(x_in, *ws, shapes)
        return [y if w is None else cpu_kernels.rms_norm(y, w, eps) for y, w in zip(ys, out_norms)]

    def same(got, want):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.shape == w.shape and np.array_equal(np.array(g), np.array(w))

    s, xn = cpu_kernels.add_rms_norm(x, r, nw, eps)
    same(cpu_kernels.qmatmul_many(x, *ws, shapes, "float32", "add_norm", [r, nw], out_norms, eps), [s, *apart(xn)])
    same(cpu_kernels.qmatmul_many(x, *ws, shapes, "float32", "norm", [nw], out_norms, eps),
         apart(cpu_kernels.rms_norm(x, nw, eps)))
    for kind, name in ((0, "silu"), (1, "gelu_tanh")):
        same(cpu_kernels.qmatmul_many(x, *ws, shapes, "float32", name, [up], out_norms, eps),
             apart(cpu_kernels.activation(x, kind, up)))
    same(cpu_kernels.qmatmul_many(x, *ws, shapes, "float32", "none", [], out_norms, eps), apart(x))
    with pytest.raises(ValueError, match="prologue add_norm takes 2 inputs, not 1"):
        cpu_kernels.qmatmul_many(x, *ws, None, "float32", "add_norm", [r])
    with pytest.raises(ValueError, match="prologue must be none, norm, add_norm, silu or gelu_tanh"):
        cpu_kernels.qmatmul_many(x, *ws, None, "float32", "relu", [up])
    with pytest.raises(ValueError, match="prologue norm's input 0 must be float32 of shape"):
        cpu_kernels.qmatmul_many(x, *ws, None, "float32", "norm", [nw[:8]])
    with pytest.raises(ValueError, match="output 0's norm weight must be float32 \\[16\\]"):
        cpu_kernels.qmatmul_many(x, *ws, shapes, "float32", "none", [], [nw, None, None], eps)


@pytest.fixture
def float_activations(monkeypatch):
    """The engine's products with float32 activations (the exact product of x with the dequantized weight)."""
    monkeypatch.setattr(cpu_kernels, "activations", "float32")


@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("bits, scale_dtype", [(8, mx.float16), (4, mx.float32), (5, mx.float16), (4, mx.bfloat16)])
def test_symmetric_weight_is_its_implied_biases(m, bits, scale_dtype, float_activations):
    """A weight given without biases (GGUF's Q8_0, Q4_0, Q5_0: a signed integer times its scale) is the weight whose
    biases are -2**(bits - 1) * scales: bit for bit on the many-row path (m = 5), and to float32 rounding on the
    decode path (m = 1: it sums (q - 2**(bits - 1)) * x, or on AVX-512 for 4 bits q - 2**(bits - 1) from a table,
    per group before the scale, where the asymmetric form adds bias * (x's sum) per group),
    alone and among others in one job; and an MLXQuantizedTensor without biases takes and dequantizes bit for bit as
    the one that holds them, and multiplies as it does, through Backend.compile too, holding fewer bytes."""
    from mlx_engine.mlx import MLXBackend
    from mlx_engine.mlx.tensor import MLXQuantizedTensor, MLXTensor

    k = 576
    q, s, _ = mx.quantize(mx.random.normal((200, k), key=mx.random.key(bits)), group_size=32, bits=bits)
    s = s.astype(scale_dtype)
    b = s * -(2 ** (bits - 1))
    x = mx.random.normal((m, k), key=mx.random.key(3))
    want = np.array(cpu_kernels.qmatmul(x, q, s, b, 32, bits))
    exact = m > 1

    def same(got, want):
        if exact:
            return np.array_equal(got, want)
        # summed in another order: a few float32 roundings of the products' magnitude apart
        return np.abs(got - want).max() <= 1e-6 * np.abs(want).max() * np.sqrt(k)

    assert same(np.array(cpu_kernels.qmatmul(x, q, s, None, 32, bits)), want)
    q2, s2, b2 = mx.quantize(mx.random.normal((48, k), key=mx.random.key(4)), group_size=32, bits=4)
    both = cpu_kernels.qmatmul_many(x, [q2, q], [s2, s], [b2, None], [32, 32], [4, bits])
    assert np.array_equal(np.array(both[1]), np.array(cpu_kernels.qmatmul(x, q, s, None, 32, bits)))
    assert same(np.array(both[1]), want)
    assert np.array_equal(np.array(both[0]), np.array(cpu_kernels.qmatmul(x, q2, s2, b2, 32, 4)))

    held = MLXQuantizedTensor(q, s, b, 32, bits, dtype=mx.float32)
    implied = MLXQuantizedTensor(q, s, None, 32, bits, dtype=mx.float32)
    assert implied.nbytes == held.nbytes - b.nbytes
    assert np.array_equal(np.array(implied.a), np.array(held.a))
    rows = MLXTensor(mx.array([3, 0, 199], mx.int32))
    assert np.array_equal(np.array(implied.take(rows).a), np.array(held.take(rows).a))
    xt = MLXTensor(x)
    assert same(np.array(xt.linear(implied).a), np.array(xt.linear(held).a))
    compiled = MLXBackend(None, device="cpu").compile(lambda h, w: h.linear(w) * 2.0)
    assert same(np.array(compiled(xt, implied).a), np.array(compiled(xt, held).a))


# the largest x_q of int8 and int16 activations (qmatmul_int8.h): d = max|x| / LEVELS[kind]
LEVELS = {"int8": 127, "int16": 32639}


def _int8_reference(x, q, s, b, group_size, bits, kind="int8"):
    """float64 oracle of qmatmul's int8 (int16) activations, from its definition (qmatmul_int8.h; llama.cpp's Q8_0 and
    Q8_1 activations, quantize_row_q8_0 / _q8_1 of ggml-cpu's x86 quants.c): x per 32 elements as x_q = round(x * 127
    / max|x|), d = max|x| / 127 held in float16 (int16: d = max|x| / 32639 in float32, x_q = round(x / d)); integer
    sums of w_q * x_q per 32 (of (w_q - 2**(bits - 1)) * x_q for a symmetric weight, b None; per 16 for groups of 16,
    each under its group's scale) times scale * d; plus each bias times its group's sums d * sum(x_q) per 32 (float16
    for int8: Q8_1's s, computed with the float32 d)."""
    x = np.array(x, np.float32)
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    amax = np.abs(blocks).max(-1)
    d = (amax / np.float32(LEVELS[kind])).astype(np.float32)
    if kind == "int8":
        inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax != 0)
    else:
        inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    xq = np.rint(blocks * inv[..., None]).astype(np.int64)
    block_sums = (d * xq.sum(-1).astype(np.float32)).astype(np.float32)
    if kind == "int8":
        d, block_sums = (a.astype(np.float16).astype(np.float32) for a in (d, block_sums))
    xq = xq.reshape(m, k // 16, 16)
    ones = mx.ones((q.shape[0], k // 32), mx.float32)  # (the integers, whatever the groups)
    wq = np.array(mx.dequantize(q, ones, 0 * ones, group_size=32, bits=bits)).astype(np.int64)
    if b is None:
        wq -= 2 ** (bits - 1)
    sums = np.einsum("mbj,nbj->mnb", xq, wq.reshape(wq.shape[0], k // 16, 16)).astype(np.float64)
    scale = np.repeat(np.array(s.astype(mx.float32), np.float64), group_size // 16, axis=1)
    out = np.einsum("mnb,nb,mb->mn", sums, scale, np.repeat(d.astype(np.float64), 2, axis=1))
    if b is not None:
        grouped = block_sums.astype(np.float64).reshape(m, k // group_size, group_size // 32).sum(-1)
        out += grouped @ np.array(b.astype(mx.float32), np.float64).T
    return out


def _supported(kind: str) -> bool:
    """Whether the built kernels run ``kind`` (int8 or int16) activations on this CPU."""
    kernels = importlib.import_module("mlx_engine.mlx._kernels")
    return _int8_supported() and (kind == "int8" or kernels.int16_supported())


KINDS = [pytest.param("int8", marks=pytest.mark.skipif(not _supported("int8"), reason="the int8 kernel needs "
                                                        "AVX-512 VNNI or AVX2, which this CPU lacks")),
         pytest.param("int16", marks=pytest.mark.skipif(not _supported("int16"), reason="the int16 kernel needs "
                                                         "AVX-512 VNNI, which this CPU lacks"))]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", ["float32", "float16", "bfloat16"])
def test_int8_activations_are_their_definition(kind, bits, group_size, scale_dtype):
    """activations="int8" (and "int16") against its float64 oracle: for every width, group size and scale dtype, with
    and without biases, row lengths with and without a partial last register (576: 4.5 x 128; 160: 1.25 x 128, 2.5 x
    64; 224: 1.75 x 128, 3.5 x 64), and rows of x for decode (1, 3), the tiles (4, 8), their remainders (9) and
    enough to quantize x on several threads (40)."""
    rng = np.random.default_rng(bits * 1000 + group_size)
    dt = getattr(mx, scale_dtype)
    for k in (640, 576 if group_size <= 64 else 384, *((160, 224) if group_size == 32 else (128,))):
        w = mx.array(rng.standard_normal((37, k)).astype(np.float32))
        q, s, b = mx.quantize(w, group_size=group_size, bits=bits)
        s, b = s.astype(dt), b.astype(dt)
        for m in (1, 3, 4, 9, 40):
            x = rng.standard_normal((m, k)).astype(np.float32)
            x[0, :32] = 0  # a block of zeros (d = 0)
            x = mx.array(x)
            for biases in (b, None):
                got = np.array(cpu_kernels.qmatmul(x, q, s, biases, group_size, bits, kind))
                want = _int8_reference(x, q, s, biases, group_size, bits, kind)
                # float32 sums of exact integer sums: a few ulps of the largest partial sums
                np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bits", [3, 6])
def test_int8_activations_with_groups_of_16_are_their_definition(kind, bits):
    """Symmetric groups of 16 (float scales in the layout of GGUF's Q6_K and Q3_K): each half of x's block of 32
    under its own group's scale, against the float64 oracle (AVX-512 VNNI and AVX2); with biases (Q2_K's layout), the
    float32 kernel's product."""
    rng = np.random.default_rng(bits)
    k = 576  # 9 x 64: whole registers of the own order
    q = mx.array(rng.integers(0, 2**32, (37, k * bits // 32), dtype=np.uint32))
    s = mx.array(rng.standard_normal((37, k // 16)).astype(np.float32))
    b = mx.array(rng.standard_normal((37, k // 16)).astype(np.float32))
    for m in (1, 3, 4, 9):
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[0, :32] = 0
        x = mx.array(x)
        got = np.array(cpu_kernels.qmatmul(x, q, s, None, 16, bits, kind))
        want = _int8_reference(x, q, s, None, 16, bits, kind)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * max(1.0, np.abs(want).max()))
        assert mx.array_equal(cpu_kernels.qmatmul(x, q, s, b, 16, bits, kind),
                              cpu_kernels.qmatmul(x, q, s, b, 16, bits, "float32")).item()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bits", [4, 5, 8])
def test_int8_activations_stay_within_their_rounding(kind, bits):
    """Against the exact float product, the int8 result is off by at most what rounding x to its blocks' grids can
    give: sum_j |w_j| * d(j) / 2, d(j) = max|x| / 127 over element j's block (int16: / 32639; plus float32
    rounding); for int8 d is held in float16 (relative 2**-11: x_hat off by up to 127 d 2**-11 more) and so are the
    block sums d * sum(x_q) that the biases meet (off by up to 2**-10 d * 32 * 127 each)."""
    rng = np.random.default_rng(bits)
    k = 640
    q, s, b = mx.quantize(mx.array(rng.standard_normal((64, k)).astype(np.float32)), group_size=32, bits=bits)
    x = rng.standard_normal((5, k)).astype(np.float32) * np.exp(rng.standard_normal((5, k))).astype(np.float32)
    want = _reference(mx.array(x), q, s, b, 32, bits)
    got = np.array(cpu_kernels.qmatmul(mx.array(x), q, s, b, 32, bits, kind))
    w = np.array(mx.dequantize(q, s, b, group_size=32, bits=bits), np.float64)
    d_block = np.abs(x.reshape(5, k // 32, 32)).max(-1) / LEVELS[kind]
    d = np.repeat(d_block, 32, axis=1)
    bound = (d / 2) @ np.abs(w).T + 1e-5 * np.abs(want).max()
    if kind == "int8":
        bound += (d * 127 * 2.0**-11) @ np.abs(w).T + (d_block * 32 * 127 * 2.0**-10) @ np.abs(np.array(b)).T
    assert np.all(np.abs(got - want) <= bound)
    assert np.abs(got - want).max() > 0  # (x was rounded: the check above can fail)


@pytest.mark.skipif(not _supported("int16"), reason="the int16 kernel does not run here")
def test_int16_activations_leave_many_rows_to_the_float_kernel():
    """int16 activations quantize x for products of fewer than int16_max_rows() rows (decode steps, small batches);
    from there on (a prompt) the float32 kernel is the faster, and runs: the float32 product's bits. Below it, the
    int16 definition, not the float32 product."""
    kernels = importlib.import_module("mlx_engine.mlx._kernels")
    rows = kernels.int16_max_rows()
    rng = np.random.default_rng(16)
    k = 576
    q, s, b = mx.quantize(mx.array(rng.standard_normal((48, k)).astype(np.float32)), group_size=32, bits=4)
    for m in (rows - 1, rows, 3 * rows):
        x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
        got = cpu_kernels.qmatmul(x, q, s, b, 32, 4, "int16")
        exact = cpu_kernels.qmatmul(x, q, s, b, 32, 4, "float32")
        if m >= rows:
            assert mx.array_equal(got, exact).item(), m
        else:
            assert not mx.array_equal(got, exact).item()
            want = _int8_reference(x, q, s, b, 32, 4, "int16")
            np.testing.assert_allclose(np.array(got), want, rtol=0, atol=1e-5 * max(1.0, np.abs(want).max()))


def test_engine_activations_follow_the_environment():
    """float32 activations by default; MLX_ENGINE_ACTIVATIONS=int8 (int16) turns int8 (int16) on where the kernel
    runs."""
    import importlib

    int8 = importlib.import_module("mlx_engine.mlx._kernels").int8_supported()
    env = {k: v for k, v in os.environ.items() if k != "MLX_ENGINE_ACTIVATIONS"}
    out = subprocess.run([sys.executable, "-c", "from mlx_engine.mlx import cpu_kernels as k; print(k.status())"],
                         env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().endswith(", float32 activations")
    asked = _status_in_subprocess({"MLX_ENGINE_ACTIVATIONS": "int8"})
    assert asked.endswith(", int8 activations" if int8 else "which this CPU lacks)")
    asked = _status_in_subprocess({"MLX_ENGINE_ACTIVATIONS": "int16"})
    assert asked.endswith(", int16 activations" if _supported("int16") else "which this CPU lacks)")
    assert "is none of float32, int8, int16" in _status_in_subprocess({"MLX_ENGINE_ACTIVATIONS": "fp8"})


def test_linear_many_is_linear_of_each():
    """``Tensor.linear_many`` (one product on the CPU when every weight is quantized) equals ``linear`` per weight,
    biases included, for quantized and dense weights alike."""
    from mlx_engine.mlx.tensor import MLXQuantizedTensor, MLXTensor

    q1 = MLXQuantizedTensor(*mx.quantize(mx.random.normal((64, 128), key=mx.random.key(1)), group_size=32, bits=4),
                            32, 4)
    q2 = MLXQuantizedTensor(*mx.quantize(mx.random.normal((32, 128), key=mx.random.key(2)), group_size=64, bits=8),
                            64, 8)
    dense = MLXTensor(mx.random.normal((16, 128), key=mx.random.key(3)))
    bias = MLXTensor(mx.random.normal((32,), key=mx.random.key(4)))
    x = MLXTensor(mx.random.normal((1, 3, 128), key=mx.random.key(5)))
    for weights, biases in (([q1, q2], [None, bias]), ([q1, dense], None)):
        got = x.linear_many(weights, biases)
        want = [x.linear(w, b) for w, b in zip(weights, biases or [None] * len(weights))]
        for g, w in zip(got, want):
            assert g.shape == w.shape
            assert np.array_equal(np.array(g.a), np.array(w.a))
        shapes = [(1, 3, 2, w.shape[0] // 2) for w in weights]  # with or without biases, quantized or not
        for g, w, shape in zip(x.linear_many(weights, biases, shapes), want, shapes):
            assert g.shape == shape and np.array_equal(np.array(g.a), np.array(w.a).reshape(shape))


@pytest.mark.parametrize("args, message", [
    (dict(bits=7), "bits must be"),
    (dict(group_size=24), "group_size must be"),
    (dict(group_size=16), "4-bit weights take groups of 32"),
    (dict(k=100), "last axis must be"),
    (dict(scale_shape=(5, 3)), "scales and biases"),
    (dict(activations="bf16"), "activations must be"),
])
def test_qmatmul_rejects_bad_arguments(args, message):
    q, s, b = mx.quantize(mx.ones((8, 64)), group_size=32, bits=4)
    x = mx.ones((1, args.get("k", 64)))
    if "scale_shape" in args:
        s = mx.ones(args["scale_shape"])
    with pytest.raises(ValueError, match=message):
        cpu_kernels.qmatmul(x, q, s, b, args.get("group_size", 32), args.get("bits", 4),
                            args.get("activations", "float32"))


def _status_in_subprocess(env: dict[str, str]) -> str:
    code = "from mlx_engine.mlx import cpu_kernels as k; print(k.qmatmul is None, k.status())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=120, check=True)
    return out.stdout.strip()


def test_kernels_can_be_turned_off():
    assert _status_in_subprocess({"MLX_ENGINE_KERNELS": "0"}) == "True off (MLX_ENGINE_KERNELS=0)"


def test_thread_count_follows_the_environment():
    assert ", 1 threads, " in _status_in_subprocess({"MLX_ENGINE_CPU_THREADS": "1"})


def test_backend_keeps_gguf_weights_quantized_on_the_cpu(smollm2_gguf):
    from mlx_engine.mlx import MLXBackend
    from mlx_engine.mlx.tensor import MLXQuantizedTensor

    backend = MLXBackend(smollm2_gguf, device="cpu")
    try:
        w = backend.weights["blk.0.ffn_up.weight"]
        assert isinstance(w, MLXQuantizedTensor) and w.scales.dtype == mx.float16  # Q4_1: exact in float16
        assert w.biases is not None  # Q4_1 has its own minimums
        embed = backend.weights["token_embd.weight"]  # Q8_0: symmetric, held without biases (34 bytes per 32)
        assert embed.bits == 8 and embed.biases is None
        assert embed.nbytes == embed.w.nbytes + embed.scales.nbytes == embed.shape[0] * embed.shape[1] // 32 * 34
        assert "quantized kernels: " + cpu_kernels.status() in backend.name
        # resident weights: the file's tensor bytes and no more (Q4_1 with float16 scales is the same 5 bits)
        file_bytes = os.path.getsize(smollm2_gguf)
        assert backend.weights_nbytes() <= 1.1 * file_bytes
    finally:
        backend.close()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_widen_is_astype_bit_for_bit(dtype):
    """``widen`` (a 16-bit KV cache read apart, through ``Tensor.astype``) gives astype's float32 bits: normals,
    subnormals, infinities, NaN, signed zeros, a strided view, sizes around its chunks; its gradient is astype's."""
    half = getattr(mx, dtype)
    rng = np.random.default_rng(3)
    special = [6e-8, -3e-7, 1e-40, np.inf, -np.inf, 0.0, -0.0, 65504.0, 70000.0, np.nan]
    for n in (1, 7, 65536, 65536 * 2 + 13):
        x = mx.array(np.concatenate([rng.standard_normal(n) * 3e4, special]).astype(np.float32)).astype(half)
        for view in (x, x[::3], x.reshape(1, -1)[:, 1:]):
            got, want = np.array(cpu_kernels.widen(view)), np.array(view.astype(mx.float32))
            assert got.dtype == np.float32 and got.shape == want.shape
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        cpu_kernels.widen(mx.zeros((3,)))
    x = mx.array([1.5, -2.0, 3.25]).astype(half)
    g = mx.grad(lambda t: (cpu_kernels.widen(t) * mx.array([1.0, 2.0, 3.0])).sum())(x)
    assert g.dtype == half and np.array_equal(np.array(g.astype(mx.float32)), [1.0, 2.0, 3.0])
