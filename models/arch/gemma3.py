"""Gemma 3 text model: five sliding-window layers to one global layer (or the config's ``layer_types``), RoPE base
10,000 on the sliding layers and 1,000,000 on the global ones, Gemma's ``(1 + w)`` RMSNorm on every norm (including the
per-head query and key norms), sandwich norms around attention and MLP, embeddings scaled by ``sqrt(hidden_size)``,
``query_pre_attn_scalar ** -0.5`` attention scale, tanh-GELU gated MLP, tied output head.

References: transformers' ``models/gemma3/modeling_gemma3.py``; mlx-lm's ``models/gemma3_text.py``; Gemma 3 technical
report (2025). GGUF norm weights already hold ``1 + w`` (llama.cpp's converter adds the one); Hugging Face weights do
not, so :meth:`Gemma3.sanitize` adds it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mlx_engine.ml import DType, Tensor
from mlx_engine.models.layers.base import DecoderModel, hf_names_from_gguf
from mlx_engine.models.layers.config import (DecoderConfig, check_layer_count, check_rope_scaling, hf_rope_parameters,
                                      metadata_getter, vocab_size_of)

#: llama.cpp's ``general.architecture`` of EmbeddingGemma (``LLM_ARCH_GEMMA_EMBEDDING``).
EMBEDDING_GGUF = "gemma-embedding"
_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
          "q_norm", "k_norm", "model.norm")


def bf16_embed_scale(hidden: int) -> float:
    """``sqrt(hidden)`` rounded to bfloat16, as Gemma's reference code (which computes it in the bf16 weight dtype)
    and mlx-lm do."""
    bits = np.array([hidden ** 0.5], np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16  # round to nearest even in the top 16 bits
    return float(rounded.astype(np.uint32).view(np.float32)[0])


def _window(sliding_window: int, both_ways: bool) -> int:
    """The cache's window ``W`` of a checkpoint's ``sliding_window`` (as its ``config.json`` and the GGUF hold it).

    Causal: Hugging Face's ``sliding_window`` counts the token itself, the cache's window does not (``W = S - 1``).
    Both ways (EmbeddingGemma): a token sees the keys at distance ``|q - k| <= S // 2`` (transformers'
    ``Gemma3TextConfig`` makes its window ``S // 2 + 1`` and ``_bidirectional_window_overlay`` keeps ``|q - k|`` below
    it; llama.cpp's ``LLAMA_SWA_TYPE_SYMMETRIC`` masks ``|q - k| > S / 2``), so ``W = S // 2`` each way.
    """
    return sliding_window // 2 if both_ways else sliding_window - 1


def _layer_types(n: int, pattern: int) -> list[str]:
    n = check_layer_count(n)
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]


class Gemma3(DecoderModel):
    architecture = "gemma3"
    images_both_ways = True
    # The residual stream outgrows float16 (gemma3:270m's perplexity is NaN in float16, finite in bfloat16);
    # Google ships and Hugging Face runs Gemma 3 in bfloat16.
    half_dtype = DType.BFLOAT16

    @classmethod
    def config_from_gguf(cls, metadata: Any, weights: dict[str, Tensor]) -> DecoderConfig:
        # llama.cpp's converter writes EmbeddingGemma (a Gemma3TextModel folder) as ``gemma-embedding``: the same
        # keys under that name, attending both ways (LLAMA_SWA_TYPE_SYMMETRIC, no causal mask)
        both_ways = metadata.get("general.architecture") == EMBEDDING_GGUF
        get = metadata_getter(metadata, EMBEDDING_GGUF if both_ways else "gemma3")
        heads = get("attention.head_count", positive=True)
        hidden = get("embedding_length", positive=True)
        head_dim = int(get("attention.key_length", 256))
        layers = int(get("block_count"))
        scaling = get("rope.scaling.type", None)
        check_rope_scaling(scaling, "gemma3")
        factor = float(get("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
        window = _window(int(get("attention.sliding_window", 512)), both_ways)
        return DecoderConfig(
            architecture="gemma3", vocab_size=vocab_size_of(weights, metadata, "gemma3"), hidden_size=hidden,
            num_layers=layers, num_heads=heads, num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=head_dim, intermediate_size=int(get("feed_forward_length")),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            context_length=int(get("context_length", 32768)), rope_theta=float(get("rope.freq_base", 1e6)),
            rope_local_theta=10000.0, rope_scale=1.0 / factor, sliding_window=window,
            layer_types=_layer_types(layers, 6), query_scale=head_dim ** -0.5, embed_scale=bf16_embed_scale(hidden),
            qk_norm=True, sandwich_norm=True, activation="gelu_tanh", both_ways=both_ways,
        )

    @classmethod
    def config_from_hf(cls, config: Any) -> DecoderConfig:
        config = config.get("text_config", config)
        heads = int(config.get("num_attention_heads", 4))
        hidden = int(config["hidden_size"])
        head_dim = int(config.get("head_dim", 256))
        layers = int(config["num_hidden_layers"])
        theta, scaling = hf_rope_parameters({**config, "rope_theta": config.get("rope_theta", 1e6)})
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        check_rope_scaling(kind, "gemma3")
        types = config.get("layer_types") or _layer_types(layers, int(config.get("sliding_window_pattern", 6)))
        both_ways = bool(config.get("use_bidirectional_attention", False))
        return DecoderConfig(
            architecture="gemma3", vocab_size=int(config.get("vocab_size", 262144)), hidden_size=hidden,
            num_layers=layers, num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads", 1)),
            head_dim=head_dim, intermediate_size=int(config["intermediate_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            context_length=int(config.get("max_position_embeddings", 32768)), rope_theta=theta,
            rope_local_theta=float(config.get("rope_local_base_freq", 10000.0)),
            rope_scale=1.0 / float(scaling["factor"]) if kind == "linear" else 1.0,
            sliding_window=_window(int(config.get("sliding_window", 512)), both_ways), layer_types=list(types),
            query_scale=float(config.get("query_pre_attn_scalar", head_dim)) ** -0.5, embed_scale=bf16_embed_scale(hidden),
            qk_norm=True, sandwich_norm=True, activation="gelu_tanh", both_ways=both_ways,
        )

    @classmethod
    def sanitize(cls, weights: dict[str, Tensor], config: DecoderConfig, source: str) -> dict[str, Tensor]:
        if source == "gguf":
            return hf_names_from_gguf(weights, "pre_feedforward_layernorm")
        out = {}
        for name, t in weights.items():
            name = name.replace("language_model.model.", "model.").replace("model.language_model.", "model.")
            if name.startswith(("layers.", "embed_tokens.", "norm.")):
                name = "model." + name  # a bare Gemma3TextModel (EmbeddingGemma) saves no ``model.`` prefix
            if name.endswith(".weight") and any(name.endswith(n + ".weight") for n in _NORMS):
                t = t + 1.0
            out[name] = t
        return out
