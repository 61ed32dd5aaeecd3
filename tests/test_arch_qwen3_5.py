"""The proof of Qwen3.5 (``qwen3_5`` dense and ``qwen3_5_moe``; tests/arch_proof.py): a random transformers
``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` of 4 layers (3 Gated DeltaNet, 1 gated attention), more value heads
than key heads in the linear layers (llama.cpp's converter then reorders them), partial interleaved-multimodal RoPE;
the MoE variant with 4 experts, top-2, and the gated shared expert on every layer. Its folder completed with a
multi-token-prediction block as the released checkpoints hold one (which llama.cpp's converter requires and neither
side runs); llama.cpp's F32 / Q8_0 / Q4_K_M GGUF files; against transformers and llama.cpp."""

from __future__ import annotations

import numpy as np
import pytest

from tests import arch_proof
from tests.hf_gguf import llama_cpp_logits

pytest.importorskip("torch")

#: Linear-attention heads: 2 key heads, 4 value heads (Qwen3.5 has twice as many value heads as key heads too).
HK, HV, DK = 2, 4, 16
SIZES = dict(vocab_size=49152, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, linear_num_key_heads=HK, linear_num_value_heads=HV, linear_key_head_dim=DK,
             linear_value_head_dim=DK, linear_conv_kernel_dim=4, max_position_embeddings=512,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                              "mrope_section": [2, 1, 1], "mrope_interleaved": True})


def _add_mtp_block(model, folder) -> None:
    """The released checkpoints' multi-token-prediction block (``mtp.*``, ``mtp_num_hidden_layers: 1``), which
    transformers neither loads nor saves: here a copy of the last (full-attention) layer with the fusion projection
    and norms, random."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    last = f"model.layers.{SIZES['num_hidden_layers'] - 1}."
    g = torch.Generator().manual_seed(5)
    d = SIZES["hidden_size"]
    tensors.update({"mtp.layers.0." + n[len(last):]: t.clone() for n, t in tensors.items() if n.startswith(last)})
    tensors.update({"mtp.fc.weight": torch.randn(d, 2 * d, generator=g) * 0.1, "mtp.norm.weight": torch.zeros(d),
                    "mtp.pre_fc_norm_embedding.weight": torch.zeros(d), "mtp.pre_fc_norm_hidden.weight": torch.zeros(d)})
    save_file(tensors, path, metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def made(request, tmp_path_factory, smollm2_gguf):
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    if request.param == "qwen3_5":
        config = Qwen3_5TextConfig(**SIZES, intermediate_size=128, tie_word_embeddings=True)
    else:
        config = Qwen3_5MoeTextConfig(**SIZES, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                      shared_expert_intermediate_size=96, tie_word_embeddings=False)
    return request.param, arch_proof.make(tmp_path_factory.mktemp(request.param), config,
                                          arch_proof.smollm2_tokenizer(smollm2_gguf), seed=1, complete=_add_mtp_block)


def _grouped(a: np.ndarray, axis: int, size: int) -> np.ndarray:
    """``a``'s value heads (``size`` features each) along ``axis`` from llama.cpp's tiled order back to the grouped
    one (the converter's ``_LinearAttentionVReorderBase._reorder_v_heads``, inverted)."""
    a = np.moveaxis(a, axis, 0)
    shape = a.shape
    a = a.reshape(HV // HK, HK, size, *shape[1:]).swapaxes(0, 1).reshape(shape)
    return np.moveaxis(a, 0, axis)


def _undo(name: str, a: np.ndarray) -> np.ndarray:
    """What llama.cpp's converter changed in a Qwen3.5 tensor: ``+ 1`` on the zero-centred norms, ``-exp`` on
    ``A_log``, the linear layers' value heads reordered."""
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return a - 1.0
    v = 2 * HK * DK  # the convolution's and in_proj_qkv's channels before the values
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        return np.concatenate([a[:v], _grouped(a[v:], 0, DK)])
    if name.endswith("in_proj_z.weight"):
        return _grouped(a, 0, DK)
    if name.endswith("out_proj.weight"):
        return _grouped(a, 1, DK)
    if name.endswith(("in_proj_a.weight", "in_proj_b.weight", "dt_bias")):
        return _grouped(a, 0, 1)
    if name.endswith("A_log"):
        return np.log(-_grouped(a, 0, 1))
    return a


def _read(name: str, array) -> "np.ndarray | None":
    """The tensors the converter's name map does not find: ``dt_bias`` (``ssm_dt.bias``), the experts' ``down_proj``
    (a parameter without ``.weight``) and their fused ``gate_up_proj``, which the converter splits into
    ``ffn_gate_exps`` and ``ffn_up_exps``."""
    layer = name.split(".")[2] if name.startswith("model.layers.") else None
    if name.endswith("linear_attn.dt_bias"):
        return array(f"blk.{layer}.ssm_dt.bias")
    if name.endswith("mlp.experts.down_proj"):
        return array(f"blk.{layer}.ffn_down_exps.weight")
    if name.endswith("mlp.experts.gate_up_proj"):
        return np.concatenate([array(f"blk.{layer}.ffn_gate_exps.weight"), array(f"blk.{layer}.ffn_up_exps.weight")],
                              axis=1)
    return None


def test_folder_matches_transformers(made):
    arch, m = made
    print(f"{arch} folder vs transformers:", arch_proof.check_folder(m))


@pytest.mark.parametrize("kind", ["F32", "Q8_0", "Q4_K_M"])
def test_gguf_matches_transformers(made, kind):
    arch, m = made
    gguf_arch = {"qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe"}[arch]
    print(f"{arch} {kind} vs transformers:", arch_proof.check_gguf(m, kind, gguf_arch, _undo, _read))


def test_gguf_matches_llama_cpp(made):
    """The dense model: llama.cpp's F32 logits and its Q4_K_M perplexity (tests/arch_proof.py). The MoE model: its F32
    logits only; on the quantized files llama.cpp rounds the activations to 8 bits before each product, which flips
    near-tied router choices of this random model (as tests/test_arch_qwen_moe.py finds; docs/models-coverage.md
    has the figures, and how our int8 activations come closer to llama.cpp's)."""
    arch, m = made
    if arch == "qwen3_5":
        print(f"{arch} F32 vs llama.cpp, Q4_K_M perplexity ours, llama.cpp's:", arch_proof.check_llama_cpp(m))
        return
    d = arch_proof.distance(arch_proof.ours(m.gguf["F32"], m.tokens), llama_cpp_logits(m.gguf["F32"], m.tokens))
    print(f"{arch} F32 vs llama.cpp:", d)
    assert d <= 1e-3, d


def test_an_ollama_name_loads(made, home, tmp_path, monkeypatch):
    arch, m = made
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    name = {"qwen3_5": "qwen3.5:9b", "qwen3_5_moe": "qwen3.5:35b"}[arch]
    arch_proof.check_ollama(m, name, arch, tmp_path / "ollama")


def test_a_bad_config_is_refused_with_a_clear_error(made, tmp_path):
    _, m = made
    arch_proof.check_refused(m, tmp_path / "bad", {"linear_num_value_heads": 3},
                             "value heads must be a positive multiple of key heads")


def test_the_text_model_of_a_multimodal_folder_matches_transformers(made, tmp_path):
    """The released checkpoints' layout (``Qwen3_5ForConditionalGeneration``): the config under ``text_config``, the
    text tensors under ``model.language_model.``, a vision tower beside them (not loaded)."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    arch, m = made
    folder = tmp_path / "multimodal"
    shutil.copytree(m.folder, folder)
    tensors = {n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n: t
               for n, t in load_file(folder / "model.safetensors").items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(8, 3, 2, 2)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    text = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": text,
                                                    "architectures": ["Qwen3_5ForConditionalGeneration"]}))
    d = arch_proof.distance(arch_proof.ours(folder, m.tokens), arch_proof.reference(m.model, m.tokens))
    print(f"{arch} multimodal folder vs transformers:", d)
    assert d <= 1e-4, d
