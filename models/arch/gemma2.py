"""Gemma 2: sliding-window and global attention layers alternating (the first slides), attention scores and output
logits soft-capped (``cap * tanh(x / cap)``), Gemma's ``(1 + w)`` RMSNorm before and after attention and the MLP,
embeddings scaled by ``sqrt(hidden_size)``, ``query_pre_attn_scalar ** -0.5`` attention scale, tanh-GELU gated MLP,
tied output head.

References: transformers' ``models/gemma2/modeling_gemma2.py``; mlx-lm's ``models/arch/gemma2.py``; llama.cpp's
``src/models/gemma2.cpp``; Gemma 2 technical report (2024). GGUF norm weights already hold ``1 + w``, as for Gemma 3.
"""

from __future__ import annotations

from typing import Any

from mlx_engine.batch import Batch
from mlx_engine.ml import Context, DType, Tensor
from mlx_engine.models.layers.base import DecoderModel
from mlx_engine.models.layers.config import (DecoderConfig, check_layer_count, check_rope_scaling, hf_rope_parameters,
                                      metadata_getter, vocab_size_of)
from mlx_engine.models.arch.gemma3 import Gemma3


def _layer_types(n: int) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(check_layer_count(n))]


class Gemma2(DecoderModel):
    architecture = "gemma2"
    # Google ships and Hugging Face runs Gemma 2 in bfloat16; its residual stream outgrows float16, as Gemma 3's.
    half_dtype = DType.BFLOAT16

    @classmethod
    def config_from_gguf(cls, metadata: Any, weights: dict[str, Tensor]) -> DecoderConfig:
        get = metadata_getter(metadata, "gemma2")
        heads = get("attention.head_count", positive=True)
        hidden = get("embedding_length", positive=True)
        head_dim = int(get("attention.key_length", 256))
        layers = int(get("block_count"))
        check_rope_scaling(get("rope.scaling.type", None), "gemma2")
        # GGUF has no query_pre_attn_scalar: llama.cpp scales by head_dim, and by hidden / heads for the 27B model
        # (46 layers), as its config says.
        scalar = hidden // heads if layers == 46 else head_dim
        return DecoderConfig(
            architecture="gemma2", vocab_size=vocab_size_of(weights, metadata, "gemma2"), hidden_size=hidden,
            num_layers=layers, num_heads=heads, num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=head_dim, intermediate_size=int(get("feed_forward_length")),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            context_length=int(get("context_length", 8192)), rope_theta=float(get("rope.freq_base", 10000.0)),
            # Hugging Face's sliding_window counts the token itself; the cache's window does not.
            sliding_window=int(get("attention.sliding_window", 4096)) - 1, layer_types=_layer_types(layers),
            query_scale=scalar ** -0.5, embed_scale=hidden ** 0.5, sandwich_norm=True, activation="gelu_tanh",
            attn_softcap=soft_cap(get("attn_logit_softcapping", None)),
            final_softcap=soft_cap(get("final_logit_softcapping", None)),
        )

    @classmethod
    def config_from_hf(cls, config: Any) -> DecoderConfig:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        head_dim = int(config.get("head_dim", 256))
        layers = int(config["num_hidden_layers"])
        theta, scaling = hf_rope_parameters(config)
        check_rope_scaling((scaling or {}).get("rope_type", (scaling or {}).get("type")), "gemma2")
        return DecoderConfig(
            architecture="gemma2", vocab_size=int(config["vocab_size"]), hidden_size=hidden, num_layers=layers,
            num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads") or heads), head_dim=head_dim,
            intermediate_size=int(config["intermediate_size"]), rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            context_length=int(config.get("max_position_embeddings", 8192)), rope_theta=theta,
            sliding_window=int(config.get("sliding_window", 4096)) - 1,
            layer_types=list(config.get("layer_types") or _layer_types(layers)),
            query_scale=float(config.get("query_pre_attn_scalar", head_dim)) ** -0.5, embed_scale=hidden ** 0.5,
            sandwich_norm=True, activation="gelu_tanh", attn_softcap=soft_cap(config.get("attn_logit_softcapping")),
            final_softcap=soft_cap(config.get("final_logit_softcapping")),
        )

    @classmethod
    def sanitize(cls, weights: dict[str, Tensor], config: DecoderConfig, source: str) -> dict[str, Tensor]:
        """GGUF names as Gemma 3's; Hugging Face norms get Gemma's ``+ 1`` (see :meth:`Gemma3.sanitize`)."""
        return Gemma3.sanitize(weights, config, source)

    def logits(self, ctx: Context, batch: Batch, h: Tensor) -> Tensor:
        """The output logits ``[K, vocab]``, soft-capped where the config caps them."""
        return capped(super().logits(ctx, batch, h), self.config.final_softcap)


def capped(x: Tensor, cap: float | None) -> Tensor:
    """``cap * tanh(x / cap)`` (Gemma's soft-cap), or ``x`` where ``cap`` is None."""
    return x if cap is None else (x * (1.0 / cap)).tanh() * cap


def soft_cap(value: Any) -> float | None:
    """A soft-cap from the config (None or 0: none), checked positive.

    Raises:
        ValueError: a negative or non-finite cap (reported by the loader as an invalid config).
    """
    if value is None or float(value) == 0.0:
        return None
    if not 0.0 < float(value) < float("inf"):
        raise ValueError(f"soft-cap {value!r} must be a positive number")
    return float(value)
