"""Phi-3, Phi-3.5 and Phi-4 text models: Llama's layer with the query, key and value projections fused into one
(``qkv_proj``, GGUF ``attn_qkv``) and the gate and up projections fused into one (``gate_up_proj``, GGUF ``ffn_up``,
the gate's rows first), both split at load; partial rotary (Phi-4-mini); LongRoPE ("su") scaling with short and long
per-frequency factors and an attention factor; a sliding window where the config sets one.

The attention factor ``a`` multiplies RoPE's cosines and sines (transformers), so the rotated features of queries and
keys alike: the scores' rotated part grows by ``a**2``. With every feature rotated that is the attention scale times
``a**2``; with partial rotary the rotated rows of the query projection are scaled by ``a**2`` at load (a quantized
query projection is dequantized for it).

llama.cpp ignores Phi-3's sliding window (its loader turns it off and warns); we follow transformers and keep it.

References: transformers' ``models/phi3/modeling_phi3.py`` and ``modeling_rope_utils._compute_longrope_parameters``;
llama.cpp's ``convert_hf_to_gguf.py`` (``Phi3MiniModel``) and ``src/models/phi3.cpp``; mlx-lm's ``models/arch/phi3.py``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mlx_engine.errors import UnsupportedError, WeightsError
from mlx_engine.ml import Backend, Tensor
from mlx_engine.models.layers.base import DecoderModel, hf_names_from_gguf
from mlx_engine.models.layers.config import DecoderConfig, hf_rope_parameters, metadata_getter, vocab_size_of


def _periods(base: float, dims: int, factors: Any) -> np.ndarray:
    """RoPE periods ``[dims/2]``: ``factor_i * base ** (2i / dims)`` (the inverse of transformers' ``inv_freq``)."""
    f = np.asarray(factors, np.float64).reshape(-1)
    if f.shape != (dims // 2,):
        raise UnsupportedError(f"phi3: LongRoPE has {f.shape[0]} factors for {dims} rotated features; it needs "
                               f"{dims // 2}")
    return (f * base ** (np.arange(0, dims, 2) / dims)).astype(np.float32)


def _config(arch: str, *, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, ff: int, eps: float,
            context: int, theta: float, rope_dims: int, window: int | None, short: Any, long: Any,
            original: int, attn_factor: float) -> DecoderConfig:
    head_dim = hidden // heads
    dims = rope_dims if rope_dims < head_dim else None
    freqs = _periods(theta, rope_dims, short) if short is not None else None
    long_freqs = _periods(theta, rope_dims, long) if long is not None else None
    scale = head_dim ** -0.5 * (attn_factor ** 2 if dims is None else 1.0)  # partial rotary: Phi3.__init__
    return DecoderConfig(
        architecture=arch, vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=ff, rms_norm_eps=eps, context_length=context,
        rope_theta=theta, rope_freqs=freqs, rope_long_freqs=long_freqs, rope_original_context=original,
        rope_dims=dims, rope_attention_factor=attn_factor, query_scale=scale,
        sliding_window=window - 1 if window else None,
        layer_types=["sliding_attention" if window else "full_attention"] * layers,
    )


class Phi3(DecoderModel):
    architecture = "phi3"

    def __init__(self, config: DecoderConfig, weights: dict[str, Tensor], backend: Backend, *args: Any,
                 **kwargs: Any):
        a2 = config.rope_attention_factor ** 2
        if config.rope_dims is not None and a2 != 1.0:  # partial rotary: the rotated rows of W_q times a**2
            rows = np.ones((config.num_heads, config.head_dim, 1), np.float32)
            rows[:, :config.rope_dims] = a2
            factor = backend.new_context().from_numpy(rows.reshape(-1, 1))
            weights = dict(weights)
            for name in [n for n in weights if n.endswith("self_attn.q_proj.weight")]:
                t = weights[name]
                weights[name] = (t.dequantize() if t.is_quantized else t) * factor
        super().__init__(config, weights, backend, *args, **kwargs)

    @classmethod
    def config_from_gguf(cls, metadata: Any, weights: dict[str, Tensor]) -> DecoderConfig:
        get = metadata_getter(metadata, "phi3")
        heads = get("attention.head_count", positive=True)
        hidden = get("embedding_length", positive=True)
        long = weights.get("rope_factors_long.weight")
        short = weights.get("rope_factors_short.weight")
        window = int(get("attention.sliding_window", 0))
        return _config(
            "phi3", vocab=vocab_size_of(weights, metadata, "phi3"), hidden=hidden, layers=int(get("block_count")),
            heads=heads, kv_heads=int(get("attention.head_count_kv", heads)), ff=int(get("feed_forward_length")),
            eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)), context=int(get("context_length", 4096)),
            theta=float(get("rope.freq_base", 10000.0)), rope_dims=int(get("rope.dimension_count", hidden // heads)),
            window=window or None, short=None if short is None else short.numpy(),
            long=None if long is None else long.numpy(),
            original=int(get("rope.scaling.original_context_length", 0)),
            attn_factor=float(get("rope.scaling.attn_factor", 1.0)))

    @classmethod
    def config_from_hf(cls, config: Any) -> DecoderConfig:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        theta, scaling = hf_rope_parameters(config)
        scaling = scaling or {}
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in (None, "default", "longrope", "su"):
            raise UnsupportedError(f"phi3: RoPE scaling {kind!r} is not supported (longrope is)")
        partial = float(config.get("partial_rotary_factor", (config.get("rope_parameters") or {}).get(
            "partial_rotary_factor", 1.0)))
        rope_dims = int(hidden // heads * partial)
        context = int(config.get("max_position_embeddings", 4096))
        original = int(scaling.get("original_max_position_embeddings", config.get("original_max_position_embeddings",
                                                                                  context)))
        attn_factor = 1.0
        if kind in ("longrope", "su"):
            # transformers' _compute_longrope_parameters: the factor is the ratio of the contexts unless given
            factor = float(scaling.get("factor") or context / original)
            attn_factor = float(scaling.get("attention_factor") or (
                math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0))
        longrope = kind in ("longrope", "su")
        return _config(
            "phi3", vocab=int(config["vocab_size"]), hidden=hidden, layers=int(config["num_hidden_layers"]),
            heads=heads, kv_heads=int(config.get("num_key_value_heads") or heads),
            ff=int(config["intermediate_size"]), eps=float(config.get("rms_norm_eps", 1e-5)), context=context,
            theta=theta, rope_dims=rope_dims, window=config.get("sliding_window"),
            short=scaling.get("short_factor") if longrope else None,
            long=scaling.get("long_factor") if longrope else None, original=original, attn_factor=attn_factor)

    @classmethod
    def sanitize(cls, weights: dict[str, Tensor], config: DecoderConfig, source: str) -> dict[str, Tensor]:
        """GGUF names to Hugging Face ones; the fused projections split (``Tensor.rows``: quantized ones stay so)."""
        if source == "gguf":
            weights = {n.replace("attn_qkv", "self_attn.qkv_proj").replace("ffn_up", "mlp.gate_up_proj"): t
                       for n, t in weights.items()}
            weights = hf_names_from_gguf(weights, "post_attention_layernorm")
            weights = {n.replace("blk.", "model.layers.") if ".qkv_proj" in n or ".gate_up_proj" in n else n: t
                       for n, t in weights.items()}
        q, kv, ff = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.intermediate_size
        out: dict[str, Tensor] = {}
        fused = {"self_attn.qkv_proj.weight": q + 2 * kv, "mlp.gate_up_proj.weight": 2 * ff}
        for name, t in weights.items():
            want = next((n for k, n in fused.items() if name.endswith(k)), None)
            if want is not None and tuple(t.shape)[:1] != (want,):
                raise WeightsError(f"tensor {name} has shape {tuple(t.shape)} but the model config implies {want} "
                                   "rows; the file is inconsistent")
            if name.endswith("self_attn.qkv_proj.weight"):
                p = name[:-len("qkv_proj.weight")]
                out[p + "q_proj.weight"] = t.rows(list(range(q)))
                out[p + "k_proj.weight"] = t.rows(list(range(q, q + kv)))
                out[p + "v_proj.weight"] = t.rows(list(range(q + kv, q + 2 * kv)))
            elif name.endswith("mlp.gate_up_proj.weight"):
                p = name[:-len("gate_up_proj.weight")]
                out[p + "gate_proj.weight"] = t.rows(list(range(ff)))
                out[p + "up_proj.weight"] = t.rows(list(range(ff, 2 * ff)))
            elif name.startswith("rope_factors_"):
                continue  # read into the config
            else:
                out[name] = t
        return out
