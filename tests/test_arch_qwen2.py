"""The proof of the ``qwen2`` architecture (Qwen2 / Qwen2.5; tests/arch_proof.py): a random transformers Qwen2 with
grouped-query attention, q/k/v biases and a tied output head; its folder, llama.cpp's F32 / Q8_0 / Q4_K_M GGUF files,
against transformers and llama.cpp."""

from __future__ import annotations

import pytest

from tests import arch_proof

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def made(tmp_path_factory, smollm2_gguf):
    from transformers import Qwen2Config

    config = Qwen2Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, rope_theta=10000.0)
    return arch_proof.make(tmp_path_factory.mktemp("qwen2"), config, arch_proof.smollm2_tokenizer(smollm2_gguf))


def test_folder_matches_transformers(made):
    print("qwen2 folder vs transformers:", arch_proof.check_folder(made))


@pytest.mark.parametrize("kind", ["F32", "Q8_0", "Q4_K_M"])
def test_gguf_matches_transformers(made, kind):
    print(f"qwen2 {kind} vs transformers:", arch_proof.check_gguf(made, kind, "qwen2"))


def test_gguf_matches_llama_cpp(made):
    print("qwen2 F32 vs llama.cpp, Q4_K_M perplexity ours, llama.cpp's:", arch_proof.check_llama_cpp(made))


def test_an_ollama_name_loads(made, home, tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    arch_proof.check_ollama(made, "qwen2.5:0.5b", "qwen2", tmp_path / "ollama")


def test_a_bad_config_is_refused_with_a_clear_error(made, tmp_path):
    arch_proof.check_refused(made, tmp_path / "bad", {"num_key_value_heads": 3}, "not a multiple of 3 key/value heads")
