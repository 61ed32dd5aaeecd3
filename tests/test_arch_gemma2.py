"""The proof of the ``gemma2`` architecture (tests/arch_proof.py): a random transformers Gemma 2 with grouped-query
attention, sliding-window layers (window 8, the prompt longer) alternating with global ones, attention scores capped
low enough to bite, capped output logits; a SentencePiece tokenizer (Gemma's converter reads only
``tokenizer.model``); its folder, llama.cpp's F32 / Q8_0 / Q4_K_M GGUF files, against transformers and llama.cpp."""

from __future__ import annotations

import pytest

from tests import arch_proof

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    from transformers import Gemma2Config

    # query_pre_attn_scalar = head_dim: GGUF keeps no scalar, llama.cpp scales by head_dim (but for 27B).
    config = Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                          sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=30.0,
                          max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    return arch_proof.make(tmp_path_factory.mktemp("gemma2"), config, arch_proof.sentencepiece_tokenizer(256))


def _undo(name, a):
    return a - 1.0 if name.endswith("norm.weight") else a  # the converter's Gemma norms hold 1 + w


def test_folder_matches_transformers(made):
    print("gemma2 folder vs transformers:", arch_proof.check_folder(made))


@pytest.mark.parametrize("kind", ["F32", "Q8_0", "Q4_K_M"])
def test_gguf_matches_transformers(made, kind):
    print(f"gemma2 {kind} vs transformers:", arch_proof.check_gguf(made, kind, "gemma2", _undo))


def test_gguf_matches_llama_cpp(made):
    print("gemma2 F32 vs llama.cpp, Q4_K_M perplexity ours, llama.cpp's:", arch_proof.check_llama_cpp(made))


def test_an_ollama_name_loads(made, home, tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    arch_proof.check_ollama(made, "gemma2:2b", "gemma2", tmp_path / "ollama")


def test_a_bad_config_is_refused_with_a_clear_error(made, tmp_path):
    arch_proof.check_refused(made, tmp_path / "bad", {"attn_logit_softcapping": -50.0},
                             "soft-cap -50.0 must be a positive number")
