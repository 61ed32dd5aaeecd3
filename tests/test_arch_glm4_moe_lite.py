"""The proof of ``glm4_moe_lite`` (GLM-4.7-Flash; tests/arch_proof.py): a random transformers
``Glm4MoeLiteForCausalLM`` (DeepSeek V3's multi-head latent attention: queries through their low rank, a latent of
32, RoPE on 16 of each head's 32 key features; one dense layer then two MoE layers of 8 experts in 4 groups of which
2 are kept, top-2, the sigmoid router with a correction bias, one shared expert); its folder, and the ``deepseek2``
GGUF files llama.cpp's converter writes of it (F32, Q4_K_M), against transformers (on the dequantized weights for the
quantized file) and against llama.cpp. The config holds what the released one adds to transformers' fields
(``first_k_dense_replace``, ``scoring_func``, which llama.cpp's converter reads)."""

from __future__ import annotations

import pytest

from tests import arch_proof
from tests.test_arch_deepseek2 import _bias, _dequantized
from tests.test_arch_glm4moe import _tokenizer

torch = pytest.importorskip("torch")

SIZES = dict(vocab_size=49160, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
             routed_scaling_factor=1.8, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16,
             v_head_dim=24, n_group=4, topk_group=2, num_experts_per_tok=2, norm_topk_prob=True,
             mlp_layer_types=["dense", "sparse", "sparse"], max_position_embeddings=512, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
             first_k_dense_replace=1, scoring_func="sigmoid", topk_method="noaux_tc")


@pytest.fixture(scope="module")
def made(tmp_path_factory, smollm2_gguf):
    from transformers import Glm4MoeLiteConfig

    return arch_proof.make(tmp_path_factory.mktemp("glm4_moe_lite"), Glm4MoeLiteConfig(**SIZES),
                           _tokenizer(smollm2_gguf), prepare=_bias)


def test_folder_matches_transformers(made):
    """The folder's logits and 32 greedy tokens (decode steps on the latent cache) against transformers."""
    from mlx_engine.models.arch.glm4_moe_lite import Glm4MoeLite

    r = arch_proof.runner(made.folder)
    assert type(r.model) is Glm4MoeLite and r.model.config.dense_layers == 1
    print("glm4_moe_lite folder vs transformers:", arch_proof.check_folder(made))


@pytest.mark.parametrize("kind", ["F32", "Q4_K_M"])
def test_gguf_matches_transformers(made, kind):
    path = made.gguf[kind]
    ref = arch_proof.reference(made.model if kind == "F32" else _dequantized(made, path), made.tokens)
    d = arch_proof.distance(arch_proof.ours(path, made.tokens), ref)
    print(f"glm4_moe_lite {kind} (a deepseek2 GGUF) vs transformers:", d)
    assert d <= 1e-4, (kind, d)


def test_f32_gguf_matches_llama_cpp(made):
    from tests.hf_gguf import llama_cpp_logits

    d = arch_proof.distance(arch_proof.ours(made.gguf["F32"], made.tokens),
                            llama_cpp_logits(made.gguf["F32"], made.tokens))
    print("glm4_moe_lite F32 vs llama.cpp:", d)
    assert d <= 1e-3, d


def test_dense_layers_after_moe_layers_are_refused(made, tmp_path):
    import json
    import shutil

    from mlx_engine.errors import UnsupportedError
    from mlx_engine.mlx import MLXBackend
    from mlx_engine.models.registry import load_text_model

    shutil.copytree(made.folder, tmp_path / "bad")
    path = tmp_path / "bad" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "mlp_layer_types": ["sparse", "dense", "sparse"]}))
    with pytest.raises(UnsupportedError, match="dense layers must lead"):
        load_text_model(MLXBackend(tmp_path / "bad", dtype="float32"))
