"""The proof of the ``gemma4`` text architecture (Gemma 4 E2B / E4B / 31B; tests/arch_proof.py): a random
transformers Gemma4ForCausalLM with every layer kind and every feature of the dense family at once: sliding layers
(8 keys, the prompt longer) and full layers with their own head size, key/value head count and proportional RoPE,
values from the key projection on full layers (``attention_k_eq_v``), the last two layers (one of each kind) reading
earlier layers' keys and values with a double-wide MLP, per-layer embeddings, layer scalars away from 1 and the logit
soft-cap; a Gemma tokenizer (SentencePiece-style BPE in ``tokenizer.json``, what llama.cpp's converter reads for
Gemma 4). Its folder, llama.cpp's F32 GGUF and the Q8_0 / Q4_K_M files its quantizer makes, against transformers and
llama.cpp; an ollama name; a bad config refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests import arch_proof

torch = pytest.importorskip("torch")

# The last unshared layers a sliding and a full one, as in the released models: llama.cpp's KV cache takes the shared
# layers' sources to be those two (transformers finds the last of each kind).
S, F = "sliding_attention", "full_attention"
TYPES = [S, S, F, S, F, S, F]
VOCAB = 259  # the SentencePiece model's 256 pieces and the three special tokens GemmaTokenizer adds


def _config():
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(
        vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=64, intermediate_size=128,
        num_hidden_layers=len(TYPES), layer_types=TYPES, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
        num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=16,
        final_logit_softcapping=30.0, max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2)


def _gemma_tokenizer(folder: Path) -> list[int]:
    """A SentencePiece model trained on the prompt text, as transformers' GemmaTokenizer rewrites it
    (``tokenizer.json`` only, as Gemma 4 ships); returns the prompt's tokens."""
    from transformers import GemmaTokenizer

    arch_proof.sentencepiece_tokenizer(256)(folder)
    tokenizer = GemmaTokenizer.from_pretrained(str(folder))
    (folder / "tokenizer.model").unlink()
    tokenizer.save_pretrained(folder)
    assert len(tokenizer) == VOCAB
    return tokenizer.encode(arch_proof.TEXT, add_special_tokens=False)


def _layer_scalars(model) -> None:
    g = torch.Generator().manual_seed(1)
    for layer in model.model.layers:
        layer.layer_scalar.copy_(0.5 + torch.rand(1, generator=g))


def _read(name: str, array) -> np.ndarray | None:
    """The layer scalars, which the converter stores as ``blk.N.layer_output_scale.weight``."""
    if name.endswith(".layer_scalar"):
        return array(f"blk.{name.split('.')[2]}.layer_output_scale.weight")
    return None


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> arch_proof.Made:
    return arch_proof.make(tmp_path_factory.mktemp("gemma4"), _config(), _gemma_tokenizer, prepare=_layer_scalars)


def test_folder_matches_transformers(made):
    assert len(made.tokens) > 8 + 1
    print("gemma4 folder vs transformers:", arch_proof.check_folder(made, chunk=16))


@pytest.mark.parametrize("kind", ["F32", "Q8_0", "Q4_K_M"])
def test_gguf_matches_transformers(made, kind):
    print(f"gemma4 {kind} vs transformers:", arch_proof.check_gguf(made, kind, "gemma4", read=_read, chunk=16))


def test_gguf_tokenizer_matches_the_folders(made):
    """The converter's ``gemma4`` vocabulary (BPE merges in the file) tokenizes as the folder's tokenizer.json."""
    from mlx_engine.models.text.tokenizer import Tokenizer
    from mlx_engine.weights import open_weights

    with open_weights(made.gguf["F32"]) as wf:
        assert wf.metadata["tokenizer.ggml.model"] == "gemma4"
        tokenizer = Tokenizer.from_gguf(dict(wf.metadata))
    assert tokenizer.encode(arch_proof.TEXT, add_bos=False) == made.tokens


def test_gguf_matches_llama_cpp(made):
    print("gemma4 F32 vs llama.cpp, Q4_K_M perplexity ours, llama.cpp's:", arch_proof.check_llama_cpp(made))


def test_an_ollama_name_loads(made, home, tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    arch_proof.check_ollama(made, "gemma4:e4b", "gemma4", tmp_path / "ollama")


def test_a_bad_config_is_refused_with_a_clear_error(made, tmp_path):
    arch_proof.check_refused(made, tmp_path / "bad", {"num_kv_shared_layers": 5},
                             r"shared layer 2 \(full_attention\) has no unshared")


def test_the_text_model_of_a_multimodal_folder_matches_transformers(made, tmp_path):
    """The released checkpoints' layout (``Gemma4ForConditionalGeneration``): the config under ``text_config`` with a
    ``vision_config`` beside it, the text tensors under ``model.language_model.``, vision and audio towers beside them
    (not read: the text model loads and runs as the plain folder)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    import mlx_engine

    folder = tmp_path / "multimodal"
    shutil.copytree(made.folder, folder)
    tensors = {n.replace("model.", "model.language_model.", 1): t
               for n, t in load_file(folder / "model.safetensors").items()}
    tensors["model.vision_tower.patch_embedder.input_proj.weight"] = torch.zeros(8, 12)
    tensors["model.audio_tower.output_proj.weight"] = torch.zeros(8, 8)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    text = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({"model_type": "gemma4", "text_config": text,
                                                    "vision_config": {"hidden_size": 8},
                                                    "architectures": ["Gemma4ForConditionalGeneration"]}))
    d = arch_proof.distance(arch_proof.ours(folder, made.tokens), arch_proof.reference(made.model, made.tokens))
    print("gemma4 multimodal folder vs transformers:", d)
    assert d <= 1e-4, d
    multimodal, plain = mlx_engine.load(str(folder)), mlx_engine.load(str(made.folder))
    try:
        assert multimodal.architecture == "gemma4"
        assert multimodal.perplexity(arch_proof.TEXT) == plain.perplexity(arch_proof.TEXT)
    finally:
        multimodal.close()
        plain.close()
