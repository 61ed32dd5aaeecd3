"""IBM Granite 3.x (``granite``): a random transformers ``GraniteForCausalLM`` with grouped-query attention and its
four multipliers (embedding, attention, residual, logits) far from their neutral values, against transformers and
llama.cpp (see ``tests/hf_proof.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.hf_proof import (dequantized_into, distance, make_model, ours, perplexity, torch_greedy,
                              torch_logits, unpermute)
from tests.hf_gguf import llama_cpp_logits, peaked

HEADS, KV_HEADS = 4, 2


def _model():
    from transformers import GraniteConfig, GraniteForCausalLM

    config = GraniteConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, max_position_embeddings=512, tie_word_embeddings=True, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, embedding_multiplier=6.0, attention_multiplier=0.1, residual_multiplier=0.4,
        logits_scaling=2.5)
    model = GraniteForCausalLM(config).float().eval()
    peaked(model)
    return model


@pytest.fixture(scope="module")
def made(tmp_path_factory, smollm2_gguf):
    return make_model(_model(), tmp_path_factory.mktemp("granite"), smollm2_gguf)


def _unpermute(name: str, arr: np.ndarray) -> dict[str, np.ndarray]:
    """llama.cpp's converter permutes Llama's (and Granite's) Q/K rows for its RoPE: undone."""
    if name.endswith("q_proj.weight"):
        arr = unpermute(arr, HEADS)
    elif name.endswith("k_proj.weight"):
        arr = unpermute(arr, KV_HEADS)
    return {name: arr}


def test_folder_matches_transformers(made):
    model = _model()
    ref = torch_logits(model, made.tokens)
    got, greedy = ours(made.folder, made.tokens)
    assert distance(got, ref) < 1e-4
    assert greedy == torch_greedy(model, made.tokens)


@pytest.mark.parametrize("kind", ["f32", "q8_0", "Q4_K_M"])
def test_gguf_matches_transformers_on_its_weights(made, kind):
    model = dequantized_into(_model(), made.gguf[kind], "granite", _unpermute)
    ref = torch_logits(model, made.tokens)
    got, greedy = ours(made.gguf[kind], made.tokens)
    assert distance(got, ref) < 1e-4
    if kind == "f32":
        assert greedy == torch_greedy(model, made.tokens)


def test_llama_cpp_agrees(made):
    ref = llama_cpp_logits(made.gguf["f32"], made.tokens)
    got, _ = ours(made.gguf["f32"], made.tokens, n=0)
    assert distance(got, ref) < 1e-3
    ref = llama_cpp_logits(made.gguf["Q4_K_M"], made.tokens)
    got, _ = ours(made.gguf["Q4_K_M"], made.tokens, n=0)
    # 1.5 %, not the 1 % hoped for: llama.cpp's K-quant products take 8-bit activations (ggml's q8_K) and this
    # random model's perplexity on English is in the hundreds of thousands; ours are held to 1e-4 of transformers on
    # the same dequantized weights above
    assert abs(perplexity(got, made.tokens) / perplexity(ref, made.tokens) - 1) < 0.03
