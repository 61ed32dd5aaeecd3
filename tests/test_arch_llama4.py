"""The proof of the ``llama4`` text architecture (Llama 4 Scout / Maverick; tests/arch_proof.py): a random transformers
``Llama4ForCausalLM`` of 4 layers (the 4th without RoPE), chunked attention on the RoPE layers with chunks of 16
positions and the attention temperature on the NoPE layer with a floor of 8 positions (both acting within the prompt),
query/key L2 norms, dense layers interleaved with MoE layers (8 experts, top-1, the sigmoid score on the expert's
input, a shared expert); its folder, llama.cpp's F32 / Q8_0 / Q4_K_M GGUF files, against transformers and llama.cpp.

llama.cpp fixes the chunk (8192), the temperature's floor (8192) and scale (0.1) of a ``llama4`` GGUF whatever the
model's config said (its converter writes none of them): the GGUF files are held to transformers with those values."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from tests import arch_proof

torch = pytest.importorskip("torch")

SIZES = dict(vocab_size=49152, hidden_size=64, intermediate_size=32, intermediate_size_mlp=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=1,
             interleave_moe_layer_step=2, attention_chunk_size=16, floor_scale=8, attn_scale=0.1,
             max_position_embeddings=512, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 500000.0})


@pytest.fixture(scope="module")
def made(tmp_path_factory, smollm2_gguf):
    from transformers import Llama4TextConfig

    return arch_proof.make(tmp_path_factory.mktemp("llama4"), Llama4TextConfig(**SIZES),
                           arch_proof.smollm2_tokenizer(smollm2_gguf), seed=1)


def _as_llama_cpp(made: arch_proof.Made) -> arch_proof.Made:
    """The same files, the transformers model with llama.cpp's fixed chunk and temperature (module docstring)."""
    model = copy.deepcopy(made.model)
    model.config.attention_chunk_size = 8192
    for layer in model.model.layers:
        layer.self_attn.floor_scale, layer.self_attn.attn_scale = 8192, 0.1
    return arch_proof.Made(model, made.folder, made.gguf, made.tokens)


def _read(name: str, array) -> "np.ndarray | None":
    """The stacked experts back into transformers' ``gate_up_proj [E, D, 2I]`` and ``down_proj [E, I, D]``."""
    if not name.startswith("model.layers."):
        return None
    p = f"blk.{name.split('.')[2]}."
    if name.endswith("experts.gate_up_proj"):
        gate_up = np.concatenate([array(p + "ffn_gate_exps.weight"), array(p + "ffn_up_exps.weight")], axis=1)
        return gate_up.transpose(0, 2, 1)
    if name.endswith("experts.down_proj"):
        return array(p + "ffn_down_exps.weight").transpose(0, 2, 1)
    return None


def test_folder_matches_transformers(made):
    """Past the chunk (the prompt spans 3 chunks of 16) and the temperature's floor, the prompt in passes of 12
    tokens, so that chunks and the temperature straddle passes; then 32 greedy one-token steps."""
    assert len(made.tokens) > 2 * SIZES["attention_chunk_size"]
    print("llama4 folder vs transformers:", arch_proof.check_folder(made, chunk=12))


def test_chunks_and_temperature_matter(made):
    """The reference with llama.cpp's values (no chunk, no temperature within the prompt) differs from the
    model's: the folder test above proves both."""
    ref = arch_proof.reference(made.model, made.tokens)
    assert arch_proof.distance(arch_proof.reference(_as_llama_cpp(made).model, made.tokens), ref) > 1e-2


def test_routing_reaches_every_expert(made):
    layers = made.model.model.layers
    seen = arch_proof.routers_seen(made, {i: layers[i].feed_forward.router for i in (1, 3)})
    assert len(seen) == 2
    for i, (_, (_, logits)) in seen.items():
        assert set(logits.argmax(dim=-1).tolist()) == set(range(SIZES["num_local_experts"])), i


@pytest.mark.parametrize("kind", ["F32", "Q8_0", "Q4_K_M"])
def test_gguf_matches_transformers(made, kind):
    print(f"llama4 {kind} vs transformers:", arch_proof.check_gguf(_as_llama_cpp(made), kind, "llama4", read=_read))


def test_llama_cpp_agrees(made):
    d, mine, theirs = arch_proof.check_llama_cpp(made, activations="int8")
    print(f"llama4 F32 vs llama.cpp: {d:.2e}; Q4_K_M perplexity ours {mine:.3f}, llama.cpp {theirs:.3f}")


def test_an_ollama_name_loads(made, home, tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    arch_proof.check_ollama(made, "llama4:16x17b", "llama4", tmp_path / "ollama")


def test_a_bad_config_is_refused_with_a_clear_error(made, tmp_path):
    arch_proof.check_refused(made, tmp_path / "bad", {"no_rope_layers": [1, 1, 0]}, "no_rope_layers has 3 entries")
