"""Phi-3 / Phi-4 (``phi3``): a random transformers ``Phi3ForCausalLM`` with fused projections, grouped-query
attention, partial rotary (Phi-4-mini's layout), LongRoPE with short and long factors and its attention factor, and a
sliding window shorter than the prompt, against transformers and llama.cpp (see ``tests/hf_proof.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.hf_proof import (dequantized_into, distance, make_model, ours, perplexity, torch_greedy,
                              torch_logits)
from tests.hf_gguf import llama_cpp_logits, peaked

WINDOW = 16  # Hugging Face's sense: 16 keys including the token itself
ORIGINAL = 128  # original_max_position_embeddings: beyond it the long factors apply


def _config():
    from transformers import Phi3Config

    rng = np.random.default_rng(3)
    return Phi3Config(
        vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, original_max_position_embeddings=ORIGINAL,
        sliding_window=WINDOW, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "original_max_position_embeddings": ORIGINAL,
                         "short_factor": (1 + rng.random(4)).tolist(), "long_factor": (2 + 4 * rng.random(4)).tolist()})


def _model():
    from transformers import Phi3ForCausalLM

    model = Phi3ForCausalLM(_config()).float().eval()
    peaked(model)
    return model


@pytest.fixture(scope="module")
def made(tmp_path_factory, smollm2_gguf):
    # Phi-4's tokenizer is GPT-2's BPE: the converter reads a BPE vocabulary (not a SentencePiece model) for it
    return make_model(_model(), tmp_path_factory.mktemp("phi3"), smollm2_gguf, tokenizer_class="GPT2Tokenizer")


def test_folder_matches_transformers(made):
    model = _model()
    tokens = made.tokens
    assert len(tokens) > WINDOW
    ref = torch_logits(model, tokens)
    got, greedy = ours(made.folder, tokens, context=ORIGINAL)
    assert distance(got, ref) < 1e-4
    assert greedy == torch_greedy(model, tokens)


def test_long_factors_past_the_original_context(made):
    """A context beyond the original takes the long factors: transformers takes them for a sequence that long."""
    model = _model()
    tokens = (made.tokens * 4)[:ORIGINAL + 20]
    assert len(tokens) > ORIGINAL
    ref = torch_logits(model, tokens)
    got, _ = ours(made.folder, tokens, n=0, context=512)
    assert distance(got, ref) < 1e-4
    short, _ = ours(made.folder, tokens, n=0, context=ORIGINAL)  # the rule reads the context the model runs with
    assert distance(short, ref) > 1e-2


@pytest.mark.parametrize("kind", ["f32", "q8_0", "Q4_K_M"])
def test_gguf_matches_transformers_on_its_weights(made, kind):
    model = _model()
    if kind != "f32":
        model = dequantized_into(model, made.gguf[kind], "phi3")
    ref = torch_logits(model, made.tokens)
    got, greedy = ours(made.gguf[kind], made.tokens, context=ORIGINAL)
    assert distance(got, ref) < 1e-4
    if kind == "f32":
        assert greedy == torch_greedy(model, made.tokens)


def test_llama_cpp_agrees(made):
    # llama.cpp turns Phi-3's sliding window off: compared where the window hides nothing. Its context is padded
    # to 256 tokens, past the original 128: it takes the long factors, as we do for that context
    tokens = made.tokens[:WINDOW]
    ref = llama_cpp_logits(made.gguf["f32"], tokens)
    got, _ = ours(made.gguf["f32"], tokens, n=0, context=256)
    assert distance(got, ref) < 1e-3
    ref = llama_cpp_logits(made.gguf["Q4_K_M"], tokens)
    got, _ = ours(made.gguf["Q4_K_M"], tokens, n=0, context=256)
    # Not the 1 % hoped for: llama.cpp's K-quant products take 8-bit activations (ggml's q8_K), and this random
    # model's peaked logits amplify every rounding (its perplexity on English is in the hundreds of millions); ours
    # are held to 1e-4 of transformers on the same dequantized weights above
    assert abs(perplexity(got, tokens) / perplexity(ref, tokens) - 1) < 0.1

