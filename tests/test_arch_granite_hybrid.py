"""The proof of Granite 4 (``granitemoehybrid``, GGUF ``granitehybrid``; tests/arch_proof.py): a random transformers
``GraniteMoeHybridForCausalLM`` of 4 layers (Mamba-2, Mamba-2, attention without RoPE, Mamba-2; 8 SSM heads of 16,
state 16, kernel 4), Granite's four multipliers away from 1; the MoE variant with 4 experts, top-2, beside the shared
MLP and 2 SSM groups, the dense one with the shared MLP alone and 1 group. Its ``config.json`` names the layer kinds
as the released checkpoints do (``"mamba"`` / ``"attention"``, which llama.cpp's converter reads). The prompt (86
tokens) runs the chunked scan over two chunks, one of them padded; the decode steps the token-by-token one.
llama.cpp's F32 / Q8_0 / Q4_K_M GGUF files; against transformers and llama.cpp."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests import arch_proof
from tests.hf_gguf import llama_cpp_logits

pytest.importorskip("torch")

SIZES = dict(vocab_size=49152, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             layer_types=["mamba", "mamba", "attention", "mamba"], mamba_n_heads=8, mamba_d_head=16,
             mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, shared_intermediate_size=48,
             position_embedding_type="nope", embedding_multiplier=12.0, logits_scaling=6.0, residual_multiplier=0.22,
             attention_multiplier=0.0078125, max_position_embeddings=512)


def _released_layer_names(model, folder) -> None:
    """``config.json``'s layer kinds as the released checkpoints write them (transformers 5 saves its own names,
    which llama.cpp's converter does not read)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["layer_types"] = ["attention" if t == "full_attention" else "mamba" for t in config["layer_types"]]
    path.write_text(json.dumps(config, indent=2))


def _doubled(write):
    """The prompt twice (86 tokens): past one chunk of the scan and the first checkpoint of the recurrent cache."""
    def write2(folder):
        tokens = write(folder)
        return tokens + tokens
    return write2


@pytest.fixture(scope="module", params=["moe", "dense"])
def made(request, tmp_path_factory, smollm2_gguf):
    from transformers import GraniteMoeHybridConfig

    if request.param == "moe":
        config = GraniteMoeHybridConfig(**SIZES, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                        mamba_n_groups=2)
    else:  # llama.cpp reads the dense MLP's width from intermediate_size
        config = GraniteMoeHybridConfig(**SIZES, intermediate_size=48, num_local_experts=0, num_experts_per_tok=0,
                                        mamba_n_groups=1)
    return request.param, arch_proof.make(tmp_path_factory.mktemp(f"granite4-{request.param}"), config,
                                          _doubled(arch_proof.smollm2_tokenizer(smollm2_gguf)), seed=2,
                                          complete=_released_layer_names)


def _undo(name: str, a: np.ndarray) -> np.ndarray:
    """What llama.cpp's converter changed in a tensor: ``A = -exp(A_log)``, the Q/K rows permuted as Llama's."""
    if name.endswith("A_log"):
        return np.log(-a)
    return arch_proof.llama_undo(SIZES["num_attention_heads"], SIZES["num_key_value_heads"])(name, a)


def _read(name: str, array) -> "np.ndarray | None":
    """The tensors the converter's name map does not find under transformers' names: ``dt_bias`` (``ssm_dt.bias``),
    the router and experts (``router.weight``, ``experts.down_proj``; the released files' ``router.layer``,
    ``output_linear`` are found), and the fused ``[gate; up]`` projections of the experts and of the shared MLP, which
    the converter splits (the shared MLP of a dense model as the plain ``ffn_*``)."""
    layer = name.split(".")[2] if name.startswith("model.layers.") else None
    try:
        if name.endswith("mamba.dt_bias"):
            return array(f"blk.{layer}.ssm_dt.bias")
        if name.endswith("block_sparse_moe.router.weight"):
            return array(f"blk.{layer}.ffn_gate_inp.weight")
        if name.endswith("block_sparse_moe.experts.gate_up_proj"):
            return np.concatenate([array(f"blk.{layer}.ffn_gate_exps.weight"),
                                   array(f"blk.{layer}.ffn_up_exps.weight")], axis=1)
        if name.endswith("block_sparse_moe.experts.down_proj"):
            return array(f"blk.{layer}.ffn_down_exps.weight")
        if name.endswith("shared_mlp.input_linear.weight"):
            try:
                parts = [array(f"blk.{layer}.ffn_gate_shexp.weight"), array(f"blk.{layer}.ffn_up_shexp.weight")]
            except KeyError:
                parts = [array(f"blk.{layer}.ffn_gate.weight"), array(f"blk.{layer}.ffn_up.weight")]
            return np.concatenate(parts, axis=0)
        if name.endswith("shared_mlp.output_linear.weight"):
            return array(f"blk.{layer}.ffn_down.weight")
    except KeyError:
        return None
    return None


def test_folder_matches_transformers(made):
    kind, m = made
    print(f"granite4 {kind} folder vs transformers:", arch_proof.check_folder(m))


def test_prefill_in_passes_carries_the_states(made):
    """The prompt in passes of 20 tokens (the token-by-token scan), the convolution and SSM states carried from pass
    to pass in the recurrent cache, against transformers over the whole prompt at once."""
    kind, m = made
    d = arch_proof.distance(arch_proof.ours(m.folder, m.tokens, chunk=20), arch_proof.reference(m.model, m.tokens))
    print(f"granite4 {kind} folder in passes of 20 vs transformers:", d)
    assert d <= 1e-4, d


def test_gguf_matches_transformers(made):
    """Each file against transformers on its dequantized weights; the dense model's Q8_0 file is left out for time
    (its tensors are read as the MoE model's are)."""
    kind, m = made
    for quant in ("F32", "Q8_0", "Q4_K_M") if kind == "moe" else ("F32", "Q4_K_M"):
        print(f"granite4 {kind} {quant} vs transformers:",
              arch_proof.check_gguf(m, quant, "granitehybrid", _undo, _read))


def test_gguf_matches_llama_cpp(made):
    """llama.cpp's F32 logits; on the dense model also its Q4_K_M perplexity (tests/arch_proof.py). The MoE model's
    quantized perplexity is not compared: llama.cpp rounds the activations to 8 bits before each product, which
    flips near-tied router choices of a random model (tests/test_arch_qwen_moe.py)."""
    kind, m = made
    if kind == "dense":
        print(f"granite4 {kind} F32 vs llama.cpp, Q4_K_M perplexity ours, llama.cpp's:", arch_proof.check_llama_cpp(m))
        return
    d = arch_proof.distance(arch_proof.ours(m.gguf["F32"], m.tokens), llama_cpp_logits(m.gguf["F32"], m.tokens))
    print(f"granite4 {kind} F32 vs llama.cpp:", d)
    assert d <= 1e-3, d


def test_an_ollama_name_loads(made, home, tmp_path, monkeypatch):
    kind, m = made
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    name = {"moe": "granite4:tiny-h", "dense": "granite4:micro-h"}[kind]
    arch_proof.check_ollama(m, name, "granitemoehybrid", tmp_path / "ollama")


def test_a_bad_config_is_refused_with_a_clear_error(made, tmp_path):
    _, m = made
    arch_proof.check_refused(m, tmp_path / "groups", {"mamba_n_groups": 3}, "heads a multiple of the groups")
    arch_proof.check_refused(m, tmp_path / "kinds", {"layer_types": ["mamba", "retention", "attention", "mamba"]},
                             "a Granite 4 layer is 'mamba' or 'attention'")
