"""The speed paths give the answers of the plain ones: compiled single-token decode steps (``Backend.compile``)
against op-by-op steps, attention that skips hidden key blocks (``Context.attention_mask``) against attention over
the whole mask and a NumPy softmax, ``Backend.compile`` itself (tuples, quantized weights, the identity default),
and one-row linear layers in OpenBLAS-sized blocks."""

from __future__ import annotations

import gc
import json
import threading
import weakref

import numpy as np
import pytest

from mlx_engine.batch import Batch
from mlx_engine.ml import Backend, DType
from mlx_engine.mlx import MLXBackend, MLXQuantizedTensor
from mlx_engine.mlx.attention import MLXMask
from mlx_engine.models.registry import load_text_model
from tests.test_models_random import VOCAB, _make_folder


@pytest.fixture(scope="module")
def backend():
    return MLXBackend(None, device="cpu")


# ------------------------------------------------------------------------------------------- compiled decode steps


def _decode(model, backend, tokens: list[int], steps: int, capacity: int = 512, kv_bits: int | None = None
            ) -> np.ndarray:
    cache = model.make_cache(kv_bits)
    cache.init(backend, model.dtype, 1, capacity, 64)
    ctx = backend.new_context()
    logits = model.forward(ctx, Batch.single(np.array(tokens), 0), cache).numpy()[0]
    out, tok, pos = [], int(logits.argmax()), len(tokens)
    for _ in range(steps):
        step = model.forward(ctx, Batch.single(np.array([tok]), pos), cache).numpy()[0]
        out.append(step)
        tok, pos = int(step.argmax()), pos + 1
    return np.stack(out)


@pytest.mark.parametrize("kind", ["llama3", "qwen3", "gemma3"])
def test_compiled_decode_steps_match_op_by_op(kind, tmp_path):
    folder, _, _ = _make_folder(tmp_path, kind)
    backend = MLXBackend(folder, dtype="float32")
    model = load_text_model(backend)
    tokens = [int(t) for t in np.random.default_rng(5).integers(0, VOCAB, 40)]
    model.compile_decode = False
    plain = _decode(model, backend, tokens, 24)  # gemma3's window is 8: the steps run past it
    assert not model._compiled
    model.compile_decode = True
    compiled = _decode(model, backend, tokens, 24)
    assert model._compiled, "the compiled path was not taken"
    assert np.abs(compiled - plain).max() <= 1e-5 * np.abs(plain).max()
    assert (compiled.argmax(-1) == plain.argmax(-1)).all()
    # the traced functions do not hold the model: dropping it frees its weights at once (no cycle awaiting the GC)
    alive = weakref.ref(model)
    del model
    assert alive() is None


@pytest.mark.parametrize("kv_bits", [None, 16])
@pytest.mark.parametrize("kind", ["llama3", "qwen3", "gemma3"])
def test_fused_decode_attention_gives_the_bits_of_the_steps_apart(kind, kv_bits, tmp_path, monkeypatch):
    """``Cache.attend`` (RoPE, the cache write and attention as one node) against RoPE, put, get and attention apart:
    the same logits to the bit over 240 steps, with a float32 cache and with a float16 one (``kv_bits=16``: the
    kernel rounds the new keys and values as ``astype`` does). gemma3's sliding window (8, with 256 positions of
    memory) wraps its ring on the way: a query then sees two runs of cells, read in the kernel as one."""
    from mlx_engine.mlx import cpu_kernels

    folder, _, _ = _make_folder(tmp_path, kind)
    backend = MLXBackend(folder, device="cpu", dtype="float32")  # CPU kernels
    model = load_text_model(backend)
    tokens = [int(t) for t in np.random.default_rng(6).integers(0, VOCAB, 40)]
    steps = 240
    model.fuse_attention = False
    apart = _decode(model, backend, tokens, steps, capacity=300, kv_bits=kv_bits)
    if kv_bits:  # the float16 cache does change the numbers: it is used
        assert not np.array_equal(apart, _decode(model, backend, tokens, steps, capacity=300))
    calls = []
    if cpu_kernels.attend_cached is not None:
        real = cpu_kernels.attend_cached
        monkeypatch.setattr(cpu_kernels, "attend_cached",
                            lambda *a: calls.append(tuple(np.array(a[7]).tolist())) or real(*a))
    model.fuse_attention = True
    model.compile_step = False  # layer by layer: each step calls the kernel (a whole step's trace calls it once)
    fused = _decode(model, backend, tokens, steps, capacity=300, kv_bits=kv_bits)
    assert np.array_equal(fused, apart)
    if cpu_kernels.attend_cached is None:  # not built here: both ran apart
        return
    # (start, lo, hi, lo2, hi2): the new token's cell ends a run it sees: all cells, or the window's last 8
    # positions in one run or, once the ring wrapped, two
    one = [(start, lo, hi) for start, lo, hi, lo2, hi2 in calls if lo2 == hi2]
    two = [(start, lo, hi, lo2, hi2) for start, lo, hi, lo2, hi2 in calls if lo2 < hi2]
    assert all(hi == start + 1 and lo in (0, start - 7) for start, lo, hi in one)
    assert all(start + 1 in (hi, hi2) and hi - lo + hi2 - lo2 == 8 for start, lo, hi, lo2, hi2 in two)
    assert len(calls) == steps * len(model.layers)
    assert (len(two) > 0) == (kind == "gemma3")


@pytest.mark.parametrize("kv_bits", [None, 16])
@pytest.mark.parametrize("kind", ["llama3", "gemma3"])
def test_a_decode_step_compiled_whole_gives_the_bits_of_the_blocks(kind, kv_bits, tmp_path, monkeypatch):
    """``models/layers/step.py``: the decode step traced whole (its cells, angles and cache storage as inputs) against the
    same step block by block: the same logits to the bit over 240 steps, from one trace per storage shape (not one
    per position), gemma3's sliding window of 8 before and after its ring wraps. Dropping the model frees it at
    once (no cycle through the trace)."""
    from mlx_engine.models.layers import step

    folder, _, _ = _make_folder(tmp_path, kind)
    backend = MLXBackend(folder, device="cpu", dtype="float32")  # CPU kernels
    model = load_text_model(backend)
    tokens = [int(t) for t in np.random.default_rng(8).integers(0, VOCAB, 40)]
    model.compile_step = False
    blocks = _decode(model, backend, tokens, 240, capacity=300, kv_bits=kv_bits)
    runs, traces = [], []
    real_run, real_trace = step.WholeStep.run, step.WholeStep._traced
    monkeypatch.setattr(step.WholeStep, "run", lambda self, *a: runs.append(real_run(self, *a)) or runs[-1])
    monkeypatch.setattr(step.WholeStep, "_traced", lambda self, *a: traces.append(1) or real_trace(self, *a))
    model.compile_step = True
    whole = _decode(model, backend, tokens, 240, capacity=300, kv_bits=kv_bits)
    assert np.array_equal(whole, blocks)
    # with our attention kernel or without it (the cells then read from an array, as on a GPU), the step is taken
    # whole; the storage grows (256 cells, then 300): a trace for each size
    taken = sum(r is not None for r in runs)
    assert taken >= 238 and len(traces) <= 4
    alive = weakref.ref(model)
    del model
    assert alive() is None


@pytest.mark.parametrize("kv_bits", [None, 16])
@pytest.mark.parametrize("kind", ["llama3", "gemma3"])
def test_a_whole_step_without_our_kernels_reads_its_cells_from_an_array(kind, kv_bits, tmp_path, monkeypatch):
    """Where the backend rotates from positions and has no attention kernel (a GPU; here the CPU with our RoPE and
    attention kernels off): the step compiled whole takes the position as an array, and its attention is MLX's
    (a slice update at the cells' start, attention over every stored cell with the visible run unmasked). Its
    logits against the steps apart (RoPE, put, get and attention over the used cells): within float32 rounding
    over 120 steps, the same greedy tokens; and against the same attention block by block, to the bit."""
    from mlx_engine.mlx import cpu_kernels
    from mlx_engine.models.layers import step

    for name in ("rope_apply", "attend_cached", "attend"):
        monkeypatch.setattr(cpu_kernels, name, None)
    folder, _, _ = _make_folder(tmp_path, kind)
    backend = MLXBackend(folder, device="cpu", dtype="float32")
    model = load_text_model(backend)
    tokens = [int(t) for t in np.random.default_rng(9).integers(0, VOCAB, 40)]
    model.fuse_attention = False
    apart = _decode(model, backend, tokens, 120, capacity=300, kv_bits=kv_bits)
    model.fuse_attention, model.compile_step = True, False
    blocks = _decode(model, backend, tokens, 120, capacity=300, kv_bits=kv_bits)
    runs = []
    real_run = step.WholeStep.run
    monkeypatch.setattr(step.WholeStep, "run", lambda self, *a: runs.append(real_run(self, *a)) or runs[-1])
    model.compile_step = True
    whole = _decode(model, backend, tokens, 120, capacity=300, kv_bits=kv_bits)
    assert np.array_equal(whole, blocks)
    assert np.abs(whole - apart).max() <= 1e-5 * np.abs(apart).max()
    assert (whole.argmax(-1) == apart.argmax(-1)).all()
    taken = sum(r is not None for r in runs)
    assert taken >= 118  # (gemma3's window of 8 sees one run of cells: its ring does not wrap in 160 positions)


@pytest.mark.parametrize("kind", ["llama3", "qwen3", "gemma3"])
def test_fused_products_give_the_bits_of_the_operations_apart(kind, tmp_path, monkeypatch):
    """With quantized projections, a decode step's norms and activations run in the products' node (the prologue
    and the output norms of ``qmatmul_many``), and everything after attention in one node (``output_mlp``): the
    same logits to the bit over 60 steps as the composed operations of ``Tensor``'s defaults (each one our kernel
    apart), the compiled steps and the first, uncompiled prefill."""
    from mlx_engine.ml import Tensor
    from mlx_engine.mlx import cpu_kernels
    from mlx_engine.mlx.tensor import MLXTensor

    folder, _, _ = _make_folder(tmp_path, kind)
    backend = MLXBackend(folder, device="cpu", dtype="float32")  # CPU kernels
    model = load_text_model(backend)
    for lw in model.layers.values():
        for name in ("q", "k", "v", "o", "gate", "up", "down"):
            lw[name] = lw[name].quantize_weight(group_size=32, bits=4)
    tokens = [int(t) for t in np.random.default_rng(7).integers(0, VOCAB, 40)]
    prologues = []
    if cpu_kernels.qmatmul_many is not None:
        real = cpu_kernels.qmatmul_many
        monkeypatch.setattr(cpu_kernels, "qmatmul_many",
                            lambda *a, **k: prologues.append((a[8], a[10] is not None) if len(a) > 8
                                                             else ("none", False)) or real(*a, **k))
        real_mlp, mlps = cpu_kernels.output_mlp, []
        # (the activation, and whether the node runs the next layer's input norm and projections too)
        monkeypatch.setattr(cpu_kernels, "output_mlp",
                            lambda *a: mlps.append((a[7], len(a) > 13 and bool(a[13]))) or real_mlp(*a))
    fused = _decode(model, backend, tokens, 60, capacity=128)
    with monkeypatch.context() as apart:
        for name in ("norm_linear", "gated_linear", "linear_norm"):
            apart.setattr(MLXTensor, name, getattr(Tensor, name))
        apart.setattr(MLXBackend, "takes_output_mlp", lambda *a: False)  # the LayerFusion capability declines
        model.compile_decode = True  # (a switch: the decode plan is made again, without the fused MLP)
        model._compiled.clear()
        model._block_of.clear()
        model._whole_step = None
        composed = _decode(model, backend, tokens, 60, capacity=128)
    assert np.array_equal(fused, composed)
    if cpu_kernels.qmatmul_many is None:  # not built here: both composed MLX's operations
        return
    # the first layer's input norm, the later ones' residual add and norm, the activation
    assert {"norm", "add_norm", "gelu_tanh" if kind == "gemma3" else "silu"} <= {p for p, _ in prologues}
    # the query and key norms per head, and Gemma 3's norms after the output and down projections
    assert any(normed for _, normed in prologues) == (kind != "llama3")
    # every layer of a decode step after attention as one node (traced once per alike layers); the layer boundary
    # (the next layer's input in the same node) is no longer taken: it bought nothing measurable
    assert mlps and {a for a, _ in mlps} == {"gelu_tanh" if kind == "gemma3" else "silu"}
    assert {nxt for _, nxt in mlps} == {False}


# ------------------------------------------------------------------------------------ attention over visible blocks


def _visible(pattern: str) -> np.ndarray:
    if pattern == "causal":  # a first prefill chunk
        n = s = 700
        return np.tril(np.ones((n, s), bool))
    if pattern == "causal_after_prefix":  # a second chunk: 600 queries after 300 cached keys
        n, s = 600, 900
        return np.arange(s)[None, :] <= 300 + np.arange(n)[:, None]
    if pattern == "sliding_window":  # window 100: each query sees itself and the 100 before
        n = s = 800
        d = np.arange(n)[:, None] - np.arange(s)[None, :]
        return (d >= 0) & (d <= 100)
    if pattern == "two_sequences":  # interleaved tokens of two sequences in one batch
        n = s = 600
        seq, pos = np.arange(n) % 2, np.arange(n) // 2
        return (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    if pattern == "small":  # too small to block
        return np.tril(np.ones((40, 40), bool))
    if pattern == "decode_wrapped_window":  # one query; a sliding window's ring wrapped: two runs of keys
        row = np.zeros((1, 2815), bool)
        row[0, :3] = row[0, 2304:] = True
        return row
    if pattern == "decode_causal_other_sequence":  # one query; another sequence's cells in between
        row = np.ones((1, 900), bool)
        row[0, 100:800] = False
        return row
    raise ValueError(pattern)


def _additive(visible: np.ndarray) -> np.ndarray:
    m = np.full(visible.shape, -np.inf, np.float32)
    m[visible] = 0.0
    return m


def _softmax_attention(q, k, v, scale, mask):
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1).astype(np.float64), np.repeat(v, rep, axis=1).astype(np.float64)
    s = q.astype(np.float64) @ k.swapaxes(-1, -2) * scale + mask
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("pattern", ["causal", "causal_after_prefix", "sliding_window", "two_sequences", "small",
                                     "decode_wrapped_window", "decode_causal_other_sequence"])
def test_attention_that_skips_hidden_blocks_changes_nothing(backend, pattern):
    ctx = backend.new_context()
    visible = _visible(pattern)
    n, s = visible.shape
    mask = ctx.attention_mask(visible, DType.FLOAT32)
    assert isinstance(mask, MLXMask)
    np.testing.assert_array_equal(mask.numpy(), _additive(visible))
    if pattern in ("causal", "causal_after_prefix", "sliding_window"):
        assert mask.blocks is not None
        assert sum((q1 - q0) * (k1 - k0) for q0, q1, k0, k1, _ in mask.blocks) < 0.8 * n * s
    if pattern == "small":
        assert mask.blocks is None
    if pattern.startswith("decode"):
        assert mask.blocks is None
        assert mask.runs == {"decode_wrapped_window": [(0, 3), (2304, 2815)],
                             "decode_causal_other_sequence": [(0, 100), (800, 900)]}[pattern]
    else:
        assert mask.runs is None
    for q0, q1, k0, k1, full in mask.blocks or []:  # the blocks cover every visible key, and say so truly
        assert not visible[q0:q1, :k0].any() and not visible[q0:q1, k1:].any()
        assert full == bool(visible[q0:q1, k0:k1].all())
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 4, n, 32), dtype=np.float32)
    k = rng.standard_normal((1, 2, s, 32), dtype=np.float32)
    v = rng.standard_normal((1, 2, s, 32), dtype=np.float32)
    args = [ctx.from_numpy(a) for a in (q, k, v)]
    got = ctx.scaled_dot_product_attention(*args, 0.2, mask).numpy()
    whole = ctx.scaled_dot_product_attention(*args, 0.2, ctx.from_numpy(_additive(visible))).numpy()
    ref = _softmax_attention(q, k, v, 0.2, _additive(visible))
    assert np.abs(got - whole).max() <= 1e-5
    assert np.abs(got - ref).max() <= 1e-5


@pytest.mark.parametrize("heads,kv_heads,keys", [(4, 2, 300), (4, 1, 1000), (9, 3, 257), (2, 2, 40)])
def test_one_query_attention_in_streamed_blocks(backend, monkeypatch, heads, kv_heads, keys):
    """A decode step's attention over many keys runs as row-blocked products (block limit made small here)."""
    from mlx_engine.mlx import runtime
    from mlx_engine.mlx.attention import _streams_one_query

    monkeypatch.setattr(runtime, "matvec_block", 5000)
    ctx = backend.new_context()
    rng = np.random.default_rng(heads * keys)
    q = rng.standard_normal((1, heads, 1, 32), dtype=np.float32)
    k = rng.standard_normal((1, kv_heads, keys, 32), dtype=np.float32)
    v = rng.standard_normal((1, kv_heads, keys, 32), dtype=np.float32)
    assert _streams_one_query(ctx.from_numpy(q).a, ctx.from_numpy(k).a) == (keys * 32 * heads // kv_heads > 5000)
    got = ctx.scaled_dot_product_attention(*(ctx.from_numpy(a) for a in (q, k, v)), 0.3, None).numpy()
    ref = _softmax_attention(q, k, v, 0.3, np.zeros((1, keys), np.float32))
    assert got.shape == (1, heads, 1, 32)
    assert np.abs(got - ref).max() <= 1e-5


def test_attention_mask_in_half_precision(backend):
    ctx = backend.new_context()
    visible = _visible("causal")
    mask = ctx.attention_mask(visible, DType.FLOAT16)
    assert mask.dtype == DType.FLOAT16
    np.testing.assert_array_equal(mask.numpy(), _additive(visible))


# ------------------------------------------------------------------------------------------------ Backend.compile


def test_backend_compile_matches_the_function(backend):
    ctx = backend.new_context()
    rng = np.random.default_rng(1)
    x = ctx.from_numpy(rng.standard_normal((1, 3, 64), dtype=np.float32))
    w = ctx.from_numpy(rng.standard_normal((96, 64), dtype=np.float32))
    b = ctx.from_numpy(rng.standard_normal((96,), dtype=np.float32))

    def pair(x, w, b):
        return (x.linear(w) + b).silu(), x.rms_norm(None, 1e-6) * 2.0

    def single(x, w, b):
        return x.linear(w, b).gelu(approximate=True)

    cpair, csingle = backend.compile(pair), backend.compile(single)
    for got, want in zip(cpair(x, w, b), pair(x, w, b)):
        assert np.abs(got.numpy() - want.numpy()).max() <= 1e-5 * np.abs(want.numpy()).max()
    got = csingle(x, w, b)
    assert not isinstance(got, tuple)
    assert np.abs(got.numpy() - single(x, w, b).numpy()).max() <= 1e-5 * np.abs(got.numpy()).max()
    # a quantized weight travels as its parts, and a new shape traces again
    packed, scales, biases = ctx.quantize(w, 32, 8)
    qw = MLXQuantizedTensor(packed.a, scales.a, biases.a, 32, 8)
    assert np.abs(csingle(x, qw, b).numpy() - single(x, qw, b).numpy()).max() <= 1e-4
    x2 = ctx.from_numpy(rng.standard_normal((1, 5, 64), dtype=np.float32))
    assert csingle(x2, w, b).shape == (1, 5, 96)


def test_compiled_functions_used_on_two_threads_never_inherit_a_dead_ones_graph(backend):
    """MLX keeps traces per thread, keyed by the traced function's address, and erases a dead function's traces only
    from the thread that called it last; a function called on the main thread and on a thread, then dropped, left a
    trace on the main thread that the next function at the same address was handed (a KeyError, or another
    function's result). Each function here adds its own constant, so an inherited graph shows as a wrong sum."""
    ctx = backend.new_context()
    x = ctx.from_numpy(np.zeros((1, 8), np.float32))
    wrong = []
    for k in range(40):
        def add_k(t, k=k):
            return t + float(k)

        compiled = backend.compile(add_k)

        def use(where, compiled=compiled, k=k):
            try:
                got = float(compiled(x).numpy()[0, 0])
            except Exception as e:  # the failure being tested for, reported with its iteration
                got = repr(e)
            if got != k:
                wrong.append((k, where, got))

        order = ["main", "thread"] if k % 2 else ["thread", "main"]
        for where in order:
            if where == "main":
                use(where)
            else:
                t = threading.Thread(target=use, args=(where,))
                t.start()
                t.join()
        del compiled, use, add_k
        gc.collect(1)  # this iteration's young objects; a full collection of the suite's heap took ~1 s each
    assert not wrong, wrong[:5]


def test_backend_compile_defaults_to_the_function_itself(backend):
    def f(x):
        return x

    assert Backend.compile(backend, f) is f


# --------------------------------------------------------------------------------------- one-row linear as W @ x


@pytest.mark.parametrize("block", [0, 1000, 64 * 37, 10**6])
def test_one_row_linear_in_blocks_matches_numpy(backend, monkeypatch, block):
    from mlx_engine.mlx import runtime

    monkeypatch.setattr(runtime, "matvec_block", block)
    ctx = backend.new_context()
    rng = np.random.default_rng(2)
    w = rng.standard_normal((37, 64), dtype=np.float32)
    b = rng.standard_normal((37,), dtype=np.float32)
    for shape in ((64,), (1, 64), (1, 1, 64), (3, 64)):  # one row in any layout; (3, 64) takes the general path
        x = rng.standard_normal(shape, dtype=np.float32)
        got = ctx.from_numpy(x).linear(ctx.from_numpy(w), ctx.from_numpy(b)).numpy()
        want = x.astype(np.float64) @ w.T.astype(np.float64) + b
        assert got.shape == want.shape
        assert np.abs(got - want).max() <= 1e-4


def test_openblas_on_the_cpu_sets_the_matvec_block():
    from mlx_engine.mlx import runtime

    runtime.select_device("cpu")
    assert runtime.matvec_block == (10**6 if runtime.blas_description().startswith("OpenBLAS") else 0)



#: Makes mlx_engine's search for OpenBLAS fail in a fresh process, as on a machine without libopenblas0-pthread: the
#: engine loads it by ``ctypes.CDLL`` of a few library names, each of which then raises the OSError of a missing file.
_HIDE_OPENBLAS = """
import ctypes
_cdll = ctypes.CDLL
def _no_openblas(name, *args, **kwargs):
    if "openblas" in str(name):
        raise OSError(f"{name}: cannot open shared object file (hidden by the test)")
    return _cdll(name, *args, **kwargs)
ctypes.CDLL = _no_openblas
"""

#: What the engine loaded, what OPENBLAS_THREAD_TIMEOUT is after importing it, and whether this process could load
#: OpenBLAS by any of the engine's names (after the import, so that the answer cannot change what the engine did).
_BLAS_REPORT = """
import ctypes, os
import mlx_engine.mlx.runtime as r
def _findable():
    for name in r._OPENBLAS_NAMES:
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            pass
    return False
print(r.blas_description().startswith("OpenBLAS"), os.environ.get("OPENBLAS_THREAD_TIMEOUT"), _findable())
"""


@pytest.mark.parametrize("openblas", ["as installed", "hidden", "disabled"])
@pytest.mark.parametrize("given", [None, "12"])
def test_openblas_threads_sleep_after_a_call_unless_told_otherwise(given, openblas):
    """On Linux, mlx_engine sets OPENBLAS_THREAD_TIMEOUT to 4 (OpenBLAS's threads sleep at once after a call) unless
    the user gave a value, before it looks for OpenBLAS: the library reads it as it loads, so it is set whether or not
    one is then found. With MLX_ENGINE_OPENBLAS=0 it neither looks nor sets anything. It loads OpenBLAS exactly when
    the system has one under its names ("as installed"), and never when the search fails ("hidden": a machine without
    libopenblas0-pthread) or is disabled. Read as the library loads, so checked in fresh processes."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_THREAD_TIMEOUT", "MLX_ENGINE_OPENBLAS")}
    if given is not None:
        env["OPENBLAS_THREAD_TIMEOUT"] = given
    if openblas == "disabled":
        env["MLX_ENGINE_OPENBLAS"] = "0"
    code = (_HIDE_OPENBLAS if openblas == "hidden" else "") + _BLAS_REPORT
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    loaded, value, findable = out.stdout.split()
    linux = sys.platform.startswith("linux")
    assert loaded == str(linux and openblas == "as installed" and findable == "True")
    if linux and openblas != "disabled":
        assert value == (given or "4")
    else:  # not looked for: nothing set unless the user did
        assert value == str(given)


_DECODE_SCRIPT = """
import json, sys
import numpy as np
from mlx_engine.mlx import MLXBackend
from mlx_engine.mlx.backend import _compile_works
from mlx_engine.models.registry import load_text_model
from tests.test_fast_paths import _decode
backend = MLXBackend(sys.argv[1], dtype="float32")
model = load_text_model(backend)
steps = _decode(model, backend, list(range(3, 43)), 12)
print(json.dumps({"compile_works": _compile_works(), "logits": steps.tolist()}))
"""


def test_compiled_decode_without_a_cxx_compiler(tmp_path):
    """MLX fuses compiled CPU kernels with the system C++ compiler; without one the same steps run unfused."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    folder, _, _ = _make_folder(tmp_path, "gemma3")
    fake = tmp_path / "bin"
    fake.mkdir()
    for name in ("g++", "c++", "gcc", "cc", "clang++", "clang"):
        (fake / name).write_text("#!/bin/sh\nexit 1\n")
        (fake / name).chmod(0o755)
    (tmp_path / "tmp").mkdir()
    repo = Path(__file__).resolve().parents[1]
    out = {}
    for kind, extra in (("normal", {}), ("no compiler", {"PATH": f"{fake}{os.pathsep}{os.environ['PATH']}",
                                                         "TMPDIR": str(tmp_path / "tmp")})):
        env = dict(os.environ, MLX_ENGINE_DEVICE="cpu", **extra)
        r = subprocess.run([sys.executable, "-c", _DECODE_SCRIPT, str(folder)], cwd=repo, env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        out[kind] = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["normal"]["compile_works"] and out["no compiler"]["compile_works"]
    fused, unfused = np.array(out["normal"]["logits"]), np.array(out["no compiler"]["logits"])
    assert np.abs(fused - unfused).max() <= 1e-5 * np.abs(fused).max()
