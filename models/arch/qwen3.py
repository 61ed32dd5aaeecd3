"""Qwen3 dense models: Llama's layout plus per-head RMSNorm on queries and keys (before RoPE). Z-Image's text encoder.

Reference: transformers' ``models/qwen3/modeling_qwen3.py``; mlx-lm's ``models/arch/qwen3.py``.
"""

from __future__ import annotations

from typing import Any

from mlx_engine.ml import Tensor
from mlx_engine.models.layers.base import DecoderModel
from mlx_engine.models.layers.config import DecoderConfig, check_rope_scaling, hf_rope_parameters, metadata_getter, \
    vocab_size_of


class Qwen3(DecoderModel):
    architecture = "qwen3"

    @classmethod
    def config_from_gguf(cls, metadata: Any, weights: dict[str, Tensor]) -> DecoderConfig:
        get = metadata_getter(metadata, "qwen3")
        heads = get("attention.head_count", positive=True)
        hidden = get("embedding_length", positive=True)
        scaling = get("rope.scaling.type", None)
        check_rope_scaling(scaling, "qwen3")
        factor = float(get("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
        return DecoderConfig(
            architecture="qwen3", vocab_size=vocab_size_of(weights, metadata, "qwen3"), hidden_size=hidden,
            num_layers=int(get("block_count")), num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=int(get("attention.key_length", hidden // heads)),
            intermediate_size=int(get("feed_forward_length")),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            context_length=int(get("context_length", 40960)), rope_theta=float(get("rope.freq_base", 1000000.0)),
            rope_scale=1.0 / factor, qk_norm=True,
        )

    @classmethod
    def config_from_hf(cls, config: Any) -> DecoderConfig:
        heads = int(config["num_attention_heads"])
        theta, scaling = hf_rope_parameters(config)
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        check_rope_scaling(kind, "qwen3")
        return DecoderConfig(
            architecture="qwen3", vocab_size=int(config["vocab_size"]), hidden_size=int(config["hidden_size"]),
            num_layers=int(config["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
            intermediate_size=int(config["intermediate_size"]), rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            context_length=int(config.get("max_position_embeddings", 40960)), rope_theta=theta,
            rope_scale=1.0 / float(scaling["factor"]) if kind == "linear" else 1.0, qk_norm=True,
            attention_bias=bool(config.get("attention_bias", False)),
        )

    @classmethod
    def sanitize(cls, weights: dict[str, Tensor], config: DecoderConfig, source: str) -> dict[str, Tensor]:
        """GGUF names as the default does; a bare transformers ``Qwen3Model`` (Z-Image's ``text_encoder/``) saves its
        tensors without the ``model.`` prefix and has no ``lm_head``: the prefix is added."""
        if source == "hf" and "embed_tokens.weight" in weights and "model.embed_tokens.weight" not in weights:
            weights = {n if n.startswith(("model.", "lm_head.")) else "model." + n: t for n, t in weights.items()}
        return super().sanitize(weights, config, source)
