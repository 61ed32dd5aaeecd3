"""The proof of the ``glm4moe`` architecture (GLM-4.5 / 4.6 / 4.7; tests/arch_proof.py): a random transformers
``Glm4MoeForCausalLM`` with grouped-query attention, q/k/v biases, per-head q/k norms, RoPE on half of each head's
features, one dense layer then two MoE layers (8 routed experts, top-2, the sigmoid router with a correction bias,
renormalised and scaled, one shared expert); its folder completed with a next-token prediction layer as the released
checkpoints hold one (run by neither side), llama.cpp's F32 / Q8_0 / Q4_K_M GGUF files, against transformers (on the
dequantized weights for the quantized files) and against llama.cpp."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests import arch_proof

torch = pytest.importorskip("torch")

#: smollm2's vocabulary and the four special tokens llama.cpp's GLM vocabulary reader (``_set_vocab_glm``) asks for.
GLM_TOKENS = ["[gMASK]", "<|user|>", "<|observation|>", "<|assistant|>"]
SIZES = dict(vocab_size=49160, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, n_shared_experts=1, n_routed_experts=8,
             num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
             routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True, max_position_embeddings=512,
             tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})


def _tokenizer(smollm2_gguf: Path):
    """smollm2's tokenizer with GLM's special tokens added after its vocabulary (ids 49152...)."""
    smollm2 = arch_proof.smollm2_tokenizer(smollm2_gguf)

    def write(folder: Path) -> list[int]:
        tokens = smollm2(folder)
        path = folder / "tokenizer.json"
        tok = json.loads(path.read_text())
        tok["added_tokens"] += [{"id": 49152 + i, "content": t, "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True}
                                for i, t in enumerate(GLM_TOKENS)]
        path.write_text(json.dumps(tok))
        return tokens
    return write


def _bias(model) -> None:
    """A correction bias on each router (a buffer: peaked() leaves it at 0), large enough to change choices."""
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=g))


def _add_nextn_layer(model, folder: Path) -> None:
    """The released checkpoints' next-token prediction layer (``model.layers.<num_hidden_layers>``, with
    ``eh_proj``, ``enorm``, ``hnorm`` and ``shared_head.norm``), which transformers neither loads nor saves: here the
    last layer's copy with those tensors, random; ``num_nextn_predict_layers: 1`` in the config."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    n, d = SIZES["num_hidden_layers"], SIZES["hidden_size"]
    last, mtp = f"model.layers.{n - 1}.", f"model.layers.{n}."
    g = torch.Generator().manual_seed(6)
    tensors.update({mtp + k[len(last):]: t.clone() for k, t in tensors.items() if k.startswith(last)})
    tensors.update({mtp + "eh_proj.weight": torch.randn(d, 2 * d, generator=g) * 0.1,
                    mtp + "enorm.weight": torch.ones(d), mtp + "hnorm.weight": torch.ones(d),
                    mtp + "shared_head.norm.weight": torch.ones(d)})
    save_file(tensors, path, metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))


@pytest.fixture(scope="module")
def made(tmp_path_factory, smollm2_gguf):
    from transformers import Glm4MoeConfig

    return arch_proof.make(tmp_path_factory.mktemp("glm4moe"), Glm4MoeConfig(**SIZES), _tokenizer(smollm2_gguf),
                           prepare=_bias, complete=_add_nextn_layer)


def _read(name: str, array) -> "np.ndarray | None":
    """The tensors llama.cpp's name map does not find: the stacked experts back into transformers' ``gate_up_proj
    [E, 2I, D]`` and ``down_proj [E, D, I]``, the router's correction bias."""
    if not name.startswith("model.layers."):
        return None
    p = f"blk.{name.split('.')[2]}."
    if name.endswith("experts.gate_up_proj"):
        return np.concatenate([array(p + "ffn_gate_exps.weight"), array(p + "ffn_up_exps.weight")], axis=1)
    if name.endswith("experts.down_proj"):
        return array(p + "ffn_down_exps.weight")
    if name.endswith("e_score_correction_bias"):
        return array(p + "exp_probs_b.bias")
    return None


def test_folder_matches_transformers(made):
    print("glm4moe folder vs transformers:", arch_proof.check_folder(made))


def test_the_nextn_layer_is_in_the_files(made):
    """The folder and the GGUF hold the next-token prediction layer (the GGUF's an extra block, counted in
    ``block_count``), which ours drops: the logits tests above and below match a model without it."""
    import gguf
    from safetensors import safe_open

    with safe_open(made.folder / "model.safetensors", "np") as f:
        assert "model.layers.3.eh_proj.weight" in f.keys()
    reader = gguf.GGUFReader(made.gguf["F32"])
    assert int(reader.fields["glm4moe.block_count"].contents()) == 4
    assert int(reader.fields["glm4moe.nextn_predict_layers"].contents()) == 1
    assert any(t.name.startswith("blk.3.nextn.") for t in reader.tensors)


def test_routing_reaches_every_expert_and_the_bias_matters(made):
    """Transformers' router sends the prompt's tokens to every expert of both MoE layers, and its choices differ,
    for some tokens, from a top-2 without the correction bias."""
    layers = made.model.model.layers
    seen = arch_proof.routers_seen(made, {i: layers[i].mlp.gate
                                          for i in range(SIZES["first_k_dense_replace"], len(layers))})
    assert len(seen) == 2
    for i, (x, (_, _, chosen)) in seen.items():
        scores = (x.reshape(-1, SIZES["hidden_size"]) @ layers[i].mlp.gate.weight.T).sigmoid()
        chosen = chosen.sort(dim=-1)[0]
        assert set(chosen.flatten().tolist()) == set(range(8)), i
        assert (scores.topk(2, dim=-1)[1].sort(dim=-1)[0] != chosen).any(), i


@pytest.mark.parametrize("kind", ["F32", "Q8_0", "Q4_K_M"])
def test_gguf_matches_transformers(made, kind):
    print(f"glm4moe {kind} vs transformers:", arch_proof.check_gguf(made, kind, "glm4moe", read=_read))


def test_llama_cpp_agrees(made):
    d, mine, theirs = arch_proof.check_llama_cpp(made, activations="int8")
    print(f"glm4moe F32 vs llama.cpp: {d:.2e}; Q4_K_M perplexity ours {mine:.3f}, llama.cpp {theirs:.3f}")


def test_an_ollama_name_loads(made, home, tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    arch_proof.check_ollama(made, "glm-4.6:355b", "glm4_moe", tmp_path / "ollama")


def test_a_bad_config_is_refused_with_a_clear_error(made, tmp_path):
    arch_proof.check_refused(made, tmp_path / "bad", {"n_group": 3}, "8 experts in 3 groups")
