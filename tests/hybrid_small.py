"""Small random hybrid checkpoints built with transformers on PyTorch CPU and saved in Hugging Face's folder layout
(with a small trained BPE tokenizer and a ChatML template), and the same weights written as a GGUF file the way
llama.cpp's ``convert_hf_to_gguf.py`` names them: the references of the hybrid-model tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

VOCAB = 512
LFM2_LAYERS = ["conv", "conv", "full_attention", "conv", "full_attention", "conv"]


def char_tokenizer():
    """A byte-level BPE tokenizer without merges (one token per byte) and a ChatML template: text the model writes
    from single characters tokenizes back to the same ids, so a chat's next turn finds its history in the cache."""
    from tests.zimage_small import CHAT_TEMPLATE, SPECIAL_TOKENS

    return byte_tokenizer(SPECIAL_TOKENS, CHAT_TEMPLATE, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def byte_tokenizer(special: list[str], chat_template: str, **tokens: str):
    """A transformers fast tokenizer over the 256 byte-level symbols and ``special`` tokens, no merges (``tokens``:
    ``eos_token=`` and the like)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + len(special), special_tokens=special,
                                  show_progress=False, initial_alphabet=alphabet)
    tok.train_from_iterator(["no merges"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=chat_template, **tokens)


def write_gguf(writer) -> None:
    """Write a ``gguf.GGUFWriter``'s header, metadata and tensors to its file, and close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _randomize(model, seed: int) -> None:
    """Weights large enough that every layer matters (transformers initialises norms to 1 and projections tiny)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else noise * (1.0 if "embed" in name else 0.2))


def build_lfm2(folder: Path, seed: int = 0):
    """A random LFM2 (hidden 64, 6 layers: 4 convolution, 2 attention with 4 heads over 2 key/value heads, kernel 3,
    tied head) saved to ``folder``; returns the transformers model (eval mode)."""
    import torch
    from transformers import Lfm2Config, Lfm2ForCausalLM

    torch.manual_seed(seed)
    config = Lfm2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=len(LFM2_LAYERS),
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                        layer_types=LFM2_LAYERS, block_multiple_of=16, block_ffn_dim_multiplier=1.0,
                        conv_L_cache=3, tie_word_embeddings=True, eos_token_id=2, bos_token_id=None)
    model = Lfm2ForCausalLM(config).eval()
    _randomize(model, seed)
    model.save_pretrained(folder)
    # LiquidAI's own config.json files also carry block_dim and block_ff_dim, which mlx-lm's LFM2 requires
    path = folder / "config.json"
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({**saved, "block_dim": config.hidden_size, "block_ff_dim": config.intermediate_size}))
    tokenizer = char_tokenizer()
    assert len(tokenizer) <= VOCAB
    tokenizer.save_pretrained(str(folder))
    return model


def build_qwen3_next(folder: Path, seed: int = 0):
    """A random Qwen3-Next (hidden 64; 4 layers: 3 Gated DeltaNet with 2 key heads over 4 value heads of 8, kernel
    4, and 1 gated attention layer with 4 heads over 2 key/value heads of 16 and RoPE on a quarter of each head;
    MoE MLPs of 4 experts, 2 per token, with a shared expert, but layer 1 dense) saved to ``folder``; returns the
    transformers model (eval mode)."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    config = Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[1],
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        max_position_embeddings=4096, eos_token_id=2, tie_word_embeddings=False)
    model = Qwen3NextForCausalLM(config).eval()
    _randomize(model, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and "linear_attn.norm" not in name:
                p.sub_(1.0)  # zero-centred norms store w for 1 + w
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=torch.Generator().manual_seed(seed)) * 4 + 0.5))
    model.save_pretrained(folder)
    # Qwen's own config.json files keep rope_theta and partial_rotary_factor at the top, where mlx-lm reads them
    path = folder / "config.json"
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({**saved, "rope_theta": saved["rope_parameters"]["rope_theta"],
                                "partial_rotary_factor": saved["rope_parameters"]["partial_rotary_factor"]}))
    char_tokenizer().save_pretrained(str(folder))
    return model


BUILDERS = {"lfm2": build_lfm2, "qwen3_next": build_qwen3_next}


# transformers' LFM2 names -> llama.cpp's (gguf-py's tensor map for MODEL_ARCH.LFM2)
_LFM2_GGUF = [("model.embed_tokens.", "token_embd."), ("model.embedding_norm.", "token_embd_norm."),
              ("model.layers.", "blk."), (".operator_norm.", ".attn_norm."), (".feed_forward.w1.", ".ffn_gate."),
              (".feed_forward.w3.", ".ffn_up."), (".feed_forward.w2.", ".ffn_down."),
              (".self_attn.q_proj.", ".attn_q."), (".self_attn.k_proj.", ".attn_k."),
              (".self_attn.v_proj.", ".attn_v."), (".self_attn.out_proj.", ".attn_output."),
              (".self_attn.q_layernorm.", ".attn_q_norm."), (".self_attn.k_layernorm.", ".attn_k_norm."),
              (".conv.conv.", ".shortconv.conv."), (".conv.in_proj.", ".shortconv.in_proj."),
              (".conv.out_proj.", ".shortconv.out_proj.")]


def lfm2_gguf(model, path: Path) -> Path:
    """Write ``model`` (a transformers LFM2) as an F32 GGUF file as llama.cpp's converter does: ``head_count_kv``
    per layer with 0 for a convolution layer, ``shortconv.l_cache``, the convolution weight squeezed to ``[D, K]``."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), "lfm2")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(model.model.layers[0].feed_forward.w1.out_features)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([c.num_key_value_heads if t != "conv" else 0 for t in c.layer_types])
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_shortconv_l_cache(c.conv_L_cache)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied to the embeddings
        a = t.detach().numpy().astype(np.float32)
        if ".conv.conv." in name:
            a = a.reshape(a.shape[0], a.shape[2])
        for x, y in _LFM2_GGUF:
            name = name.replace(x, y)
        w.add_tensor(name, a)
    write_gguf(w)
    return path


def greedy_reference(model, prompt: list[int], n: int) -> tuple[np.ndarray, list[int]]:
    """transformers' first-step logits (float32 ``[vocab]``) and ``n`` greedy tokens (its own cache, no EOS stop)."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt])
        first = model(ids).logits[0, -1].float().numpy()
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return first, out[0, len(prompt):].tolist()


def qwen3_next_gguf(model, path: Path, types: "dict[str, str] | None" = None, dequantized: bool = False) -> Path:
    """Write ``model`` (a transformers Qwen3-Next) as an F32 GGUF file as llama.cpp's converter does
    (``Qwen3NextModel.modify_tensors``): ``A_log`` as ``-exp(A_log)``, ``dt_bias`` as ``ssm_dt.bias``, norms with
    the one added (but the gated ``linear_attn.norm``), ``in_proj_qkvz`` split into ``attn_qkv`` (all q, all k, all
    v) and ``attn_gate`` (z), the experts stacked; the rest through gguf-py's tensor name map.

    ``types``: a GGUF type for some of the layers' tensors (``{"ffn_gate_exps": "Q4_1", "attn_qkv": "Q8_0", ...}``),
    quantized by ``gguf.quants``; with ``dequantized`` they are written as F32 holding those quantized values."""
    import gguf
    import torch

    def add(w, name: str, a: np.ndarray) -> None:
        kind = name.split(".")[2] if name.startswith("blk.") else name
        if not types or kind not in types:
            return w.add_tensor(name, a)
        qtype = gguf.GGMLQuantizationType[types[kind]]
        q = gguf.quants.quantize(a, qtype)
        if dequantized:
            return w.add_tensor(name, gguf.quants.dequantize(q, qtype).astype(np.float32))
        w.add_tensor(name, q, raw_dtype=qtype)

    c = model.config
    hk, hv, dk, dv = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                      c.linear_value_head_dim)
    w = gguf.GGUFWriter(str(path), "qwen3next")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(hk)
    w.add_ssm_time_step_rank(hv)
    w.add_ssm_inner_size(dv * hv)
    w.add_full_attention_interval(4)
    w.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3NEXT, c.num_hidden_layers)
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    for name, t in state.items():
        bid = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if name.endswith(".mlp.experts.gate_up_proj"):  # transformers' fused layout in memory: [E, 2I, D]
            gate, up = t.chunk(2, dim=1)
            add(w, f"blk.{bid}.ffn_gate_exps.weight", gate.contiguous().numpy())
            add(w, f"blk.{bid}.ffn_up_exps.weight", up.contiguous().numpy())
            continue
        if name.endswith(".mlp.experts.down_proj"):
            add(w, f"blk.{bid}.ffn_down_exps.weight", t.contiguous().numpy())
            continue
        if name.endswith(".A_log"):
            add(w, f"blk.{bid}.ssm_a", (-torch.exp(t)).numpy())
            continue
        if name.endswith(".dt_bias"):
            add(w, f"blk.{bid}.ssm_dt.bias", t.numpy())
            continue
        if "conv1d" in name:
            t = t.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        if name.endswith("in_proj_qkvz.weight"):
            g = t.reshape(hk, 2 * dk + 2 * (hv // hk) * dv, -1)
            r = hv // hk
            qkv = torch.cat([g[:, :dk].reshape(hk * dk, -1), g[:, dk:2 * dk].reshape(hk * dk, -1),
                             g[:, 2 * dk:2 * dk + r * dv].reshape(hv * dv, -1)])
            add(w, f"blk.{bid}.attn_qkv.weight", qkv.numpy())
            add(w, f"blk.{bid}.attn_gate.weight", g[:, 2 * dk + r * dv:].reshape(hv * dv, -1).numpy())
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:  # a dense MLP (mlp_only_layers): llama.cpp's qwen3next map has none; its generic names
            gguf_name = f"blk.{bid}.ffn_{name.split('.')[-2].split('_')[0]}.weight"
        add(w, gguf_name, t.numpy())
    write_gguf(w)
    return path
