"""Llama 2 / 3 family (and Mistral-style configs): grouped-query attention, SwiGLU, RMSNorm, RoPE with optional
Llama 3 frequency scaling; tied or separate output head.

Reference: transformers' ``models/llama/modeling_llama.py``; mlx-lm's ``models/arch/llama.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mlx_engine.ml import Tensor
from mlx_engine.models.layers.base import DecoderModel
from mlx_engine.models.layers.config import (DecoderConfig, check_rope_scaling, hf_rope_parameters, llama3_rope_freqs,
                                      metadata_getter, vocab_size_of)


class Llama(DecoderModel):
    architecture = "llama"
    #: the GGUF metadata keys' prefix (an architecture on Llama's layout names its own)
    gguf_prefix = "llama"

    @classmethod
    def config_from_gguf(cls, metadata: Any, weights: dict[str, Tensor]) -> DecoderConfig:
        get = metadata_getter(metadata, cls.gguf_prefix)
        heads = get("attention.head_count", positive=True)
        hidden = get("embedding_length", positive=True)
        head_dim = int(get("attention.key_length", hidden // heads))
        theta = float(get("rope.freq_base", 10000.0))
        freqs = None
        if "rope_freqs.weight" in weights:  # llama.cpp stores Llama 3 scaling as per-pair factors
            factors = weights["rope_freqs.weight"].numpy().astype(np.float64)
            freqs = (theta ** (np.arange(0, head_dim, 2) / head_dim) * factors).astype(np.float32)
        scaling = get("rope.scaling.type", None)
        check_rope_scaling(scaling, cls.gguf_prefix)
        factor = float(get("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
        return DecoderConfig(
            architecture="llama", vocab_size=vocab_size_of(weights, metadata, cls.gguf_prefix), hidden_size=hidden,
            num_layers=int(get("block_count")), num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)), head_dim=head_dim,
            intermediate_size=int(get("feed_forward_length")),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            context_length=int(get("context_length", 4096)), rope_theta=theta, rope_freqs=freqs,
            rope_scale=1.0 / factor,
            # llama.cpp's converter permutes Q/K rows for interleaved RoPE; use the matching layout.
            rope_traditional=True,
        )

    @classmethod
    def config_from_hf(cls, config: Any) -> DecoderConfig:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        theta, scaling = hf_rope_parameters(config)
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        check_rope_scaling(kind, "llama")
        freqs, scale = None, 1.0
        if kind == "llama3":
            freqs = llama3_rope_freqs(theta, head_dim, float(scaling["factor"]),
                                      float(scaling.get("low_freq_factor", 1.0)),
                                      float(scaling.get("high_freq_factor", 4.0)),
                                      int(scaling.get("original_max_position_embeddings", 8192)))
        elif kind == "linear":
            scale = 1.0 / float(scaling["factor"])
        window = config.get("sliding_window")  # Mistral-style configs
        return DecoderConfig(
            architecture="llama", vocab_size=int(config["vocab_size"]), hidden_size=hidden,
            num_layers=int(config["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads), head_dim=head_dim,
            intermediate_size=int(config["intermediate_size"]), rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            context_length=int(config.get("max_position_embeddings", 4096)), rope_theta=theta, rope_freqs=freqs,
            rope_scale=scale, attention_bias=bool(config.get("attention_bias", False)),
            sliding_window=int(window) - 1 if window else None,
            layer_types=["sliding_attention" if window else "full_attention"] * int(config["num_hidden_layers"]),
        )
