"""Our CPU kernels at a real model's widths (issue 66, item 1): a model with Llama 3.2 1B's hidden size, heads, KV
heads, head size, MLP width and RoPE scaling (1 of its 16 layers, smollm2's tokenizer and vocabulary), quantized by
llama.cpp to Q4_K_M. At these widths the file holds real K-quants (Q4_K and Q6_K rows of 2048 and 8192, where the
families' hidden-64 models fall back to Q5_0 / Q8_0), and the kernels split rows, groups and threads as they do for
the models people run. Our quantized path (the kernels, float32 activations, as a user runs it) is held to
transformers on the file's dequantized weights, and its greedy tokens to MLX's own operations on those weights."""

from __future__ import annotations

import numpy as np
import pytest

from tests import arch_proof

#: Llama 3.2 1B's published config, but for its 16 layers and its 128,256-token vocabulary (smollm2's 49,152 here).
SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
             rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
             rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192})


@pytest.fixture(scope="module")
def made(tmp_path_factory, smollm2_gguf):
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=49152, num_hidden_layers=1, bos_token_id=1, eos_token_id=2, **SHAPE)
    # one layer: llama.cpp's Q4_K_M gives a 1-layer model's attn_v and ffn_down Q6_K (use_more_bits), the other
    # matrices Q4_K, so both kernels run at full width
    return arch_proof.make(tmp_path_factory.mktemp("llama-1b-shape"), config,
                           arch_proof.smollm2_tokenizer(smollm2_gguf), kinds=("Q4_K_M",))


def test_the_file_holds_k_quants_at_full_width(made):
    import gguf

    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(made.gguf["Q4_K_M"]).tensors if len(t.shape) == 2}
    assert {"Q4_K", "Q6_K"} <= set(types.values()), types
    assert types["blk.0.ffn_down.weight"] == "Q6_K" and types["blk.0.ffn_up.weight"] == "Q4_K", types
    assert types["blk.0.attn_v.weight"] == "Q6_K" and types["blk.0.attn_q.weight"] == "Q4_K", types


def test_quantized_kernels_match_transformers_at_1b_widths(made, record_property):
    path = made.gguf["Q4_K_M"]
    ref = arch_proof.reference(arch_proof.dequantized_model(made, path, "llama", arch_proof.llama_undo(32, 8)),
                               made.tokens)
    got = arch_proof.ours(path, made.tokens, float_weights=False)
    d = arch_proof.distance(got, ref)
    record_property("distance_of_spread", d)
    assert d <= 1e-4, d
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_greedy_tokens_of_the_kernels_equal_mlxs_operations(made):
    path = made.gguf["Q4_K_M"]
    n = 8
    kernels = arch_proof.runner(path, float_weights=False, room=512)
    from mlx_engine.models.generation.runner import GenerationStats, Request
    from mlx_engine.models.generation.sampler import SamplerOptions

    got = list(kernels.generate_tokens(Request(list(made.tokens), SamplerOptions(temperature=0.0), max_tokens=n,
                                               sequence=0), GenerationStats()))
    want = arch_proof.ours_greedy(path, made.tokens, n)  # MLX's operations on the dequantized weights
    assert len(got) == n and got == want
    assert len(set(want)) > 1, want  # the prompt does not collapse into one repeated token
