"""The proof of the ``smollm3`` architecture (tests/arch_proof.py): a random transformers SmolLM3 with grouped-query
attention, no RoPE in its 4th layer (no_rope_layer_interval 4, as llama.cpp assumes) and a tied output head; its
folder, llama.cpp's F32 / Q8_0 / Q4_K_M GGUF files, against transformers and llama.cpp."""

from __future__ import annotations

import pytest

from tests import arch_proof

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def made(tmp_path_factory, smollm2_gguf):
    from transformers import SmolLM3Config

    config = SmolLM3Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           tie_word_embeddings=True, rope_theta=10000.0, pad_token_id=0, bos_token_id=1,
                           eos_token_id=2)
    return arch_proof.make(tmp_path_factory.mktemp("smollm3"), config, arch_proof.smollm2_tokenizer(smollm2_gguf))


def _undo(name, a):
    """Undo llama.cpp's Q/K row permutation (``LlamaModel.permute``: each head's rows interleaved for its RoPE)."""
    heads = {"q_proj": 4, "k_proj": 2}.get(name.split(".")[-2])
    if heads is None:
        return a
    return a.reshape(heads, a.shape[0] // heads // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def test_folder_matches_transformers(made):
    print("smollm3 folder vs transformers:", arch_proof.check_folder(made))


@pytest.mark.parametrize("kind", ["F32", "Q8_0", "Q4_K_M"])
def test_gguf_matches_transformers(made, kind):
    print(f"smollm3 {kind} vs transformers:", arch_proof.check_gguf(made, kind, "smollm3", _undo))


def test_gguf_matches_llama_cpp(made):
    print("smollm3 F32 vs llama.cpp, Q4_K_M perplexity ours, llama.cpp's:", arch_proof.check_llama_cpp(made))


def test_an_ollama_name_loads(made, home, tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    arch_proof.check_ollama(made, "smollm3:3b", "smollm3", tmp_path / "ollama")


def test_a_bad_config_is_refused_with_a_clear_error(made, tmp_path):
    arch_proof.check_refused(made, tmp_path / "bad", {"no_rope_layers": [1, 1, 0]},
                             "no_rope_layers has 3 entries for 4 layers")
