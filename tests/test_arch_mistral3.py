"""Ministral 3 / Mistral Small 3.x text (``mistral3``, ``ministral3``): a random transformers
``Ministral3ForCausalLM`` with grouped-query attention, a head size apart from hidden / heads, YaRN RoPE scaling and
Llama 4's attention temperature (its original context shorter than the prompt, so both act), against transformers
and llama.cpp (see ``tests/hf_proof.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.hf_proof import (dequantized_into, distance, make_model, ours, perplexity, torch_greedy,
                              torch_logits, unpermute)
from tests.hf_gguf import llama_cpp_logits, peaked

HEADS, KV_HEADS = 4, 2
ORIGINAL = 16  # YaRN's original context, and the temperature's step


def _model():
    from transformers import Ministral3Config, Ministral3ForCausalLM

    config = Ministral3Config(
        vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=24, max_position_embeddings=512, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
        rope_parameters={"type": "yarn", "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": ORIGINAL, "max_position_embeddings": 512,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
                         "llama_4_scaling_beta": 0.3})
    model = Ministral3ForCausalLM(config).float().eval()
    peaked(model)
    return model


@pytest.fixture(scope="module")
def made(tmp_path_factory, smollm2_gguf):
    return make_model(_model(), tmp_path_factory.mktemp("mistral3"), smollm2_gguf)


def _unpermute(name: str, arr: np.ndarray) -> dict[str, np.ndarray]:
    """llama.cpp's converter permutes Llama's (and Mistral 3's) Q/K rows for its RoPE: undone."""
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
    model = dequantized_into(_model(), made.gguf[kind], "mistral3", _unpermute)
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
    # 1.0 %, at the 1 % hoped for: llama.cpp's K-quant products take 8-bit activations (ggml's q8_K) and this random
    # model's perplexity on English is huge; ours are held to 1e-4 of transformers on the same dequantized weights
    assert abs(perplexity(got, made.tokens) / perplexity(ref, made.tokens) - 1) < 0.03
