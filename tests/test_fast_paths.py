"""The speed paths give the answers of the plain ones: compiled single-token decode steps (``Backend.compile``)
against op-by-op steps, and ``Backend.compile`` itself (tuples, quantized weights, the identity default)."""

from __future__ import annotations

import weakref

import numpy as np
import pytest

from mlx_engine.batch import Batch
from mlx_engine.ml import Backend
from mlx_engine.mlx import MLXBackend, MLXQuantizedTensor
from models.registry import load_text_model
from tests.test_models_random import VOCAB, _make_folder


@pytest.fixture(scope="module")
def backend():
    return MLXBackend(None, device="cpu")


# ------------------------------------------------------------------------------------------- compiled decode steps


def _decode(model, backend, tokens: list[int], steps: int) -> np.ndarray:
    cache = model.make_cache()
    cache.init(backend, model.dtype, 1, 512, 64)
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
