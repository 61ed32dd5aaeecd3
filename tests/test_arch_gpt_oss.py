"""The proof of the ``gpt_oss`` architecture (gpt-oss-20b / -120b; tests/arch_proof.py): a random transformers
GptOss with grouped-query attention, biases, learned attention sinks, sliding-window layers (8 keys, the prompt
longer) alternating with full ones, YaRN RoPE, 4 experts of which each token takes 2 (router and expert biases, the
clamped SwiGLU); its folder, llama.cpp's F32 GGUF and the MXFP4_MOE file ``llama-quantize`` makes of it (experts in
MXFP4, the rest Q8_0, as the released GGUF files), against transformers and llama.cpp."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from tests import arch_proof

torch = pytest.importorskip("torch")

EXPERTS, TOP_K = 4, 2
# YaRN as the released config (factor 32 over 4096 positions) but with the correction range rounded to whole
# dimensions (``truncate``), as llama.cpp always rounds it: the released config's unrounded range is checked alone
# below (test_yarn_as_transformers).
ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": True, "original_max_position_embeddings": 4096}


@pytest.fixture(scope="module")
def made(tmp_path_factory, smollm2_gguf):
    from transformers import GptOssConfig

    config = GptOssConfig(vocab_size=49152, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=EXPERTS,
                          num_experts_per_tok=TOP_K, sliding_window=8, max_position_embeddings=512,
                          rope_parameters=ROPE, tie_word_embeddings=False)
    return arch_proof.make(tmp_path_factory.mktemp("gpt_oss"), config, arch_proof.smollm2_tokenizer(smollm2_gguf),
                           kinds=("Q8_0", "MXFP4_MOE"))


def _dequantized(made: arch_proof.Made, path):
    """A copy of the transformers model holding the GGUF file's weights as the ``gguf`` package dequantizes them:
    the converter's split experts (``ffn_{gate,up}_exps [E, I, D]``, ``ffn_down_exps [E, D, I]``) put back into
    transformers' interleaved ``gate_up_proj [E, D, 2I]`` and ``down_proj [E, I, D]``."""
    import gguf

    tensors = {t.name: np.array(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
               for t in gguf.GGUFReader(path).tensors}
    model = copy.deepcopy(made.model)
    state = model.state_dict()
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, model.config.num_hidden_layers)
    used = set()

    def put(name: str, array: np.ndarray) -> None:
        state[name].copy_(torch.from_numpy(np.ascontiguousarray(array.reshape(state[name].shape))))

    for name in state:
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        p = f"blk.{layer}."
        if name.endswith("experts.gate_up_proj"):
            g, u = tensors[p + "ffn_gate_exps.weight"], tensors[p + "ffn_up_exps.weight"]
            put(name, np.stack([g, u], axis=2).reshape(g.shape[0], -1, g.shape[2]).transpose(0, 2, 1))
            used |= {p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight"}
        elif name.endswith("experts.gate_up_proj_bias"):
            g, u = tensors[p + "ffn_gate_exps.bias"], tensors[p + "ffn_up_exps.bias"]
            put(name, np.stack([g, u], axis=-1).reshape(g.shape[0], -1))
            used |= {p + "ffn_gate_exps.bias", p + "ffn_up_exps.bias"}
        elif name.endswith("experts.down_proj"):
            put(name, tensors[p + "ffn_down_exps.weight"].transpose(0, 2, 1))
            used.add(p + "ffn_down_exps.weight")
        elif name.endswith("experts.down_proj_bias"):
            put(name, tensors[p + "ffn_down_exps.bias"])
            used.add(p + "ffn_down_exps.bias")
        else:
            # (the converter names the sinks as a weight)
            gguf_name = names.get_name(name + ".weight" if name.endswith(".sinks") else name,
                                       try_suffixes=(".weight", ".bias"))
            put(name, tensors[gguf_name])
            used.add(gguf_name)
    assert used == set(tensors), set(tensors) - used
    model.load_state_dict(state)
    return model


def test_folder_matches_transformers(made):
    routers = _router_choices(made)
    assert all(set(c.ravel().tolist()) == set(range(EXPERTS)) for c in routers)  # every expert of every layer
    print("gpt_oss folder vs transformers:", arch_proof.check_folder(made))


def _router_choices(made: arch_proof.Made) -> list[np.ndarray]:
    with torch.no_grad():
        out = made.model(torch.tensor([made.tokens]), output_router_logits=True)
    return [np.argsort(-r.float().numpy(), axis=-1)[:, :TOP_K] for r in out.router_logits]


def test_f32_gguf_matches_transformers(made):
    print("gpt_oss F32 vs transformers:", arch_proof.check_gguf(made, "F32", "gpt-oss"))


def test_mxfp4_gguf_matches_transformers_on_its_weights(made):
    """The MXFP4_MOE file: experts in MXFP4 (read without loss), everything else Q8_0, against transformers on the
    file's dequantized weights, the weights as stored (the experts kept quantized, in their file's bytes where our
    CPU kernels run them) and dequantized at load alike."""
    path = made.gguf["MXFP4_MOE"]
    import gguf

    from mlx_engine.mlx import cpu_kernels

    tensors = gguf.GGUFReader(path).tensors
    kinds = {t.name: t.tensor_type.name for t in tensors}
    assert kinds["blk.0.ffn_gate_exps.weight"] == "MXFP4" and kinds["blk.1.ffn_down_exps.weight"] == "MXFP4"
    r = arch_proof.runner(path, float_weights=False)
    assert all(w[k].is_quantized for w in r.model.layers.values() for k in ("experts_gate", "experts_up",
                                                                            "experts_down"))
    if cpu_kernels.qmatmul is not None:  # MXFP4 as stored: 4-bit integers and the E8M0 exponents, 17 bytes per 32
        sizes = {t.name: int(t.n_bytes) for t in tensors}
        for i, w in r.model.layers.items():
            for k in ("gate", "up", "down"):
                assert (w[f"experts_{k}"].codebook_id, w[f"experts_{k}"].nbytes) == (
                    cpu_kernels.MXFP4, sizes[f"blk.{i}.ffn_{k}_exps.weight"])
        ratio = r.backend.weights_nbytes() / sum(sizes.values())
        print(f"gpt_oss MXFP4_MOE weights / file: {ratio:.4f}")
        assert ratio <= 1.05, ratio
    ref = arch_proof.reference(_dequantized(made, path), made.tokens)
    for float_weights in (True, False):
        d = arch_proof.distance(arch_proof.ours(path, made.tokens, float_weights), ref)
        print(f"gpt_oss MXFP4_MOE (float_weights={float_weights}) vs transformers on its weights:", d)
        assert d <= 1e-4, (float_weights, d)


def test_gguf_matches_llama_cpp(made):
    """On the MXFP4_MOE file ours runs with llama.cpp's numerics (activations rounded to 8 bits per 32 before each
    product, as its CPU does for MXFP4 and Q8_0 weights): this peaked random model's perplexity moves by 17 % under
    that rounding alone (ours exact, 1.72e8; llama.cpp's 1.43e8; ours with int8 activations within 2 % of it)."""
    print("gpt_oss F32 vs llama.cpp, MXFP4_MOE perplexity ours, llama.cpp's:",
          arch_proof.check_llama_cpp(made, "MXFP4_MOE", activations="int8"))


def test_an_ollama_name_loads(made, home, tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    arch_proof.check_ollama(made, "gpt-oss:20b", "gpt_oss", tmp_path / "ollama", "MXFP4_MOE")


def test_a_bad_config_is_refused_with_a_clear_error(made, tmp_path):
    arch_proof.check_refused(made, tmp_path / "bad", {"swiglu_limit": -7.0}, r"swiglu \(alpha, limit\)")


def test_yarn_as_transformers():
    """The released config's YaRN (its correction range not rounded) as transformers computes it: the periods and
    the attention factor."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from mlx_engine.models.arch.gpt_oss import GptOss

    hf = GptOssConfig()
    ours = GptOss.config_from_hf(hf.to_dict())
    inv_freq, attn = ROPE_INIT_FUNCTIONS["yarn"](hf)
    np.testing.assert_allclose(1.0 / np.asarray(ours.rope_freqs, np.float64), inv_freq.double().numpy(), rtol=1e-6)
    assert ours.query_scale == pytest.approx(hf.head_dim ** -0.5 * attn ** 2, rel=1e-7)
