"""``load(activations=...)``: what the CPU's quantized products do with x, chosen per model.

int8 and int16 activations' numerics are tested against their definition in ``test_cpu_kernels.py``, int8's against
llama.cpp's perplexity and int16's against the float path's in ``test_models_real.py``; here: that int16 keeps the
float model's answer, that the choice belongs to the model that asked for it (two models of one process, each with
its own, through the compiled decode step too), and that a value the engine cannot run is refused with a clear
error.
"""

from __future__ import annotations

import numpy as np
import pytest

import mlx_engine
from mlx_engine.errors import InvalidRequestError, UnsupportedError
from mlx_engine.mlx import cpu_kernels
from mlx_engine.mlx.backend import _check_activations
from tests.conftest import logits_for
from mlx_engine.server.app import ServerConfig

INT8_PROBLEM = cpu_kernels.int8_problem()
INT16_PROBLEM = cpu_kernels.activations_problem("int16")
PROMPT = "The capital of France is"


def _answer(model) -> tuple[np.ndarray, str]:
    """The prompt's last logits (prefill) and a greedy answer (compiled decode steps), from a reset cache."""
    model.runner.reset()
    tokens = model.text_tokens(PROMPT)
    logits = logits_for(model.text_model, model.runner, tokens)
    model.runner.reset()
    return logits, model.generate(PROMPT, max_tokens=16, temperature=0, raw=True)


@pytest.mark.skipif(INT8_PROBLEM is not None, reason=f"int8 activations do not run here: {INT8_PROBLEM}")
def test_each_model_keeps_its_own_activations(smollm2_gguf):
    """A float32 model and an int8 model in one process: each gives its own numbers, before and after the other ran
    (the weights carry the choice, and so do the compiled graphs traced with them)."""
    exact = mlx_engine.load(str(smollm2_gguf), progress=False, context_length=256, activations="float32")
    rounded = mlx_engine.load(str(smollm2_gguf), progress=False, context_length=256, activations="int8")
    try:
        assert (exact.activations, rounded.activations) == ("float32", "int8")
        assert "float32 activations" in exact.backend_name and "int8 activations" in rounded.backend_name
        first_logits, first_text = _answer(exact)
        int8_logits, int8_text = _answer(rounded)
        again_logits, again_text = _answer(exact)
        assert np.array_equal(first_logits, again_logits) and first_text == again_text
        assert not np.array_equal(first_logits, int8_logits)  # x was rounded: the products differ
        # ... by rounding noise only: the same leading token, logits within a few hundredths of their spread
        assert int(np.argmax(first_logits)) == int(np.argmax(int8_logits))
        spread = float(first_logits.max() - first_logits.min())
        assert float(np.abs(first_logits - int8_logits).max()) < 0.05 * spread
        assert len(int8_text.split()) >= 2
        _, int8_again = _answer(rounded)
        assert int8_again == int8_text
    finally:
        exact.close()
        rounded.close()


@pytest.mark.skipif(INT16_PROBLEM is not None, reason=f"int16 activations do not run here: {INT16_PROBLEM}")
def test_int16_activations_keep_the_float_models_answer(smollm2_gguf):
    """int16 activations round x 257x finer than int8 (qmatmul_int8.h): the prompt's logits stay within 1e-3 of their
    spread of the float32 path's (measured 9e-5 on smollm2, 5e-5 on gemma3, where int8 moves them by 1.8e-2 and
    1.0e-2) and the greedy answer, through the compiled decode steps, is the float model's."""
    exact = mlx_engine.load(str(smollm2_gguf), progress=False, context_length=256, activations="float32")
    fine = mlx_engine.load(str(smollm2_gguf), progress=False, context_length=256, activations="int16")
    try:
        assert fine.activations == "int16" and "int16 activations" in fine.backend_name
        float_logits, float_text = _answer(exact)
        int16_logits, int16_text = _answer(fine)
        assert not np.array_equal(float_logits, int16_logits)  # x was rounded: the products differ
        spread = float(float_logits.max() - float_logits.min())
        assert float(np.abs(float_logits - int16_logits).max()) < 1e-3 * spread
        assert int16_text == float_text and len(int16_text.split()) >= 2
    finally:
        exact.close()
        fine.close()


def test_activations_that_cannot_run_are_refused(smollm2_gguf):
    with pytest.raises(InvalidRequestError, match="activations must be one of float32, int8, int16, not 'fp8'"):
        mlx_engine.load(str(smollm2_gguf), progress=False, activations="fp8")
    with pytest.raises(InvalidRequestError, match="activations must be one of"):
        _check_activations(8, "cpu")
    with pytest.raises(UnsupportedError, match="int8 activations are a CPU kernel's; on cuda"):
        _check_activations("int8", "cuda")
    with pytest.raises(UnsupportedError, match="int16 activations are a CPU kernel's; on metal"):
        _check_activations("int16", "metal")
    if INT16_PROBLEM is None:
        assert _check_activations("int16", "cpu") == "int16"
    else:
        with pytest.raises(UnsupportedError, match="int16 activations cannot run here"):
            _check_activations("int16", "cpu")
    assert _check_activations(None, "metal") == "float32"  # MLX's kernels take x as it is
    assert _check_activations(None, "cpu") == cpu_kernels.activations
    if INT8_PROBLEM is None:
        assert _check_activations("int8", "cpu") == "int8"
    else:
        with pytest.raises(UnsupportedError, match="int8 activations cannot run here"):
            _check_activations("int8", "cpu")
    with pytest.raises(InvalidRequestError, match="--activations must be one of float32, int8, int16, not .int4."):
        ServerConfig(activations="int4").check()
    ServerConfig(activations="int8").check()
