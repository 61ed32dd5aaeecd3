"""Reference models for parity tests: mlx-lm's own ``llama`` / ``gemma3_text`` / ``qwen3`` classes on weights that the
``gguf`` package dequantizes, independent of our readers and models."""

from __future__ import annotations

import re

import numpy as np

from mlx_engine.mlx.runtime import mx  # loads OpenBLAS before mlx on Linux
from gguf import GGUFReader
from gguf.quants import dequantize

_NAMES = [
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q\.weight", r"model.layers.\1.self_attn.q_proj.weight"),
    (r"blk\.(\d+)\.attn_k\.weight", r"model.layers.\1.self_attn.k_proj.weight"),
    (r"blk\.(\d+)\.attn_v\.weight", r"model.layers.\1.self_attn.v_proj.weight"),
    (r"blk\.(\d+)\.attn_output\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"blk\.(\d+)\.attn_q_norm\.weight", r"model.layers.\1.self_attn.q_norm.weight"),
    (r"blk\.(\d+)\.attn_k_norm\.weight", r"model.layers.\1.self_attn.k_norm.weight"),
    (r"blk\.(\d+)\.post_attention_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.post_ffw_norm\.weight", r"model.layers.\1.post_feedforward_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_gate\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down\.weight", r"model.layers.\1.mlp.down_proj.weight"),
]


def _field(reader: GGUFReader, key: str):
    return reader.fields[key].contents()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of Q/K rows (interleaved RoPE layout back to Hugging Face's halves)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantized_tensors(path) -> tuple[GGUFReader, dict[str, np.ndarray]]:
    reader = GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        out[t.name] = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
    return reader, out


def mlx_lm_model(path):
    """mlx-lm's model class for a GGUF file, loaded with float32 weights dequantized by ``gguf``."""
    reader, tensors = dequantized_tensors(path)
    arch = _field(reader, "general.architecture")
    g = lambda k, d=None: _field(reader, f"{arch}.{k}") if f"{arch}.{k}" in reader.fields else d  # noqa: E731
    ffn_norm = "pre_feedforward_layernorm" if arch == "gemma3" else "post_attention_layernorm"
    weights = {}
    heads, kv_heads = int(g("attention.head_count")), int(g("attention.head_count_kv"))
    for name, arr in tensors.items():
        m = re.match(r"blk\.(\d+)\.ffn_norm\.weight$", name)
        hf = f"model.layers.{m.group(1)}.{ffn_norm}.weight" if m else None
        for pat, rep in _NAMES:
            if hf is None and re.match(pat + "$", name):
                hf = re.sub(pat + "$", rep, name)
        if arch == "llama" and hf.endswith("q_proj.weight"):
            arr = _unpermute(arr, heads)
        if arch == "llama" and hf.endswith("k_proj.weight"):
            arr = _unpermute(arr, kv_heads)
        if arch == "gemma3" and "norm" in hf:
            arr = arr - 1.0  # GGUF holds Gemma's 1 + w; mlx-lm adds the one itself
        weights[hf] = mx.array(arr)
    hidden = int(g("embedding_length"))
    common = dict(hidden_size=hidden, num_hidden_layers=int(g("block_count")),
                  intermediate_size=int(g("feed_forward_length")), num_attention_heads=heads,
                  num_key_value_heads=kv_heads, rms_norm_eps=float(g("attention.layer_norm_rms_epsilon")),
                  vocab_size=tensors["token_embd.weight"].shape[0])
    if arch == "llama":
        from mlx_lm.models import llama as mod

        args = mod.ModelArgs(model_type="llama", rope_theta=float(g("rope.freq_base")),
                             tie_word_embeddings="output.weight" not in tensors, **common)
    elif arch == "gemma3":
        from mlx_lm.models import gemma3_text as mod

        args = mod.ModelArgs(model_type="gemma3_text", head_dim=int(g("attention.key_length")),
                             rope_theta=float(g("rope.freq_base")), query_pre_attn_scalar=int(g("attention.key_length")),
                             sliding_window=int(g("attention.sliding_window")),
                             max_position_embeddings=int(g("context_length")), **common)
    else:
        raise ValueError(arch)
    model = mod.Model(args)
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    return model


def mlx_lm_greedy(model, tokens: list[int], n: int) -> tuple[np.ndarray, list[int]]:
    """First-step logits (float32 ``[vocab]``) and ``n`` greedy tokens from an mlx-lm model."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array(tokens)[None], cache=cache)[0, -1].astype(mx.float32)
    first = np.array(logits)
    out = []
    tok = int(mx.argmax(logits).item())
    for _ in range(n):
        out.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)[0, -1]
        tok = int(mx.argmax(logits).item())
    return first, out
