"""Mistral Small 3.x, Ministral 3, Magistral and Devstral, text part (``mistral3`` / ``ministral3``): Llama's layer
with YaRN RoPE scaling and Llama 4's attention temperature tuning (queries at position ``p`` times
``1 + beta * log(1 + floor(p / original_context))``, ``llama_4_scaling_beta``), where the config has them. A
``Mistral3ForConditionalGeneration`` folder's text model is read (``text_config``, ``language_model.`` names); its
vision tower is not run.

References: transformers' ``models/ministral3/modeling_ministral3.py`` (``get_llama_4_attn_scale``),
``models/mistral3/modeling_mistral3.py`` and ``modeling_rope_utils._compute_yarn_parameters``; llama.cpp's
``convert_hf_to_gguf.py`` (``Mistral3Model``: Llama's tensors, Q/K rows permuted, ``mistral3.*`` keys,
``attention.temperature_scale``, ``rope.scaling.yarn_log_multiplier``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mlx_engine.errors import UnsupportedError
from mlx_engine.ml import Tensor
from mlx_engine.models.layers.config import DecoderConfig, hf_rope_parameters, metadata_getter, yarn_rope
from mlx_engine.models.arch.llama import Llama


class Mistral3(Llama):
    architecture = "mistral3"
    gguf_prefix = "mistral3"

    @classmethod
    def config_from_gguf(cls, metadata: Any, weights: dict[str, Tensor]) -> DecoderConfig:
        get = metadata_getter(metadata, "mistral3")
        kind = get("rope.scaling.type", None)
        plain = {k: v for k, v in metadata.items() if not k.startswith("mistral3.rope.scaling.")}
        config = super().config_from_gguf(plain, weights)
        beta = float(get("attention.temperature_scale", 0.0))
        original = int(get("rope.scaling.original_context_length", config.context_length))
        if kind not in (None, "none", "yarn"):
            raise UnsupportedError(f"mistral3: RoPE scaling {kind!r} is not supported (yarn is)")
        freqs, attn = None, 1.0
        if kind == "yarn":
            # llama.cpp's converter writes mscale_all_dim as the log multiplier; the released configs have mscale
            # equal to it (an attention factor of 1)
            log_mul = get("rope.scaling.yarn_log_multiplier", None)
            freqs, attn = yarn_rope(config.rope_theta, config.head_dim, float(get("rope.scaling.factor")), original,
                                    float(get("rope.scaling.yarn_beta_fast", 32.0)),
                                    float(get("rope.scaling.yarn_beta_slow", 1.0)),
                                    log_mul, log_mul)
            attn = float(get("rope.scaling.yarn_attn_factor", attn))
        return dataclasses.replace(config, architecture="mistral3", rope_freqs=freqs,
                                   query_scale=config.head_dim ** -0.5 * attn ** 2,
                                   query_temperature=(beta, original) if beta else None)

    @classmethod
    def config_from_hf(cls, config: Any) -> DecoderConfig:
        config = config.get("text_config", config)
        theta, scaling = hf_rope_parameters(config)
        scaling = scaling or {}
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in (None, "default", "yarn"):
            raise UnsupportedError(f"mistral3: RoPE scaling {kind!r} is not supported (yarn is)")
        base = super().config_from_hf({**config, "rope_theta": theta, "rope_scaling": None, "rope_parameters": None})
        original = int(scaling.get("original_max_position_embeddings", base.context_length))
        freqs, attn = None, 1.0
        if kind == "yarn":
            freqs, attn = yarn_rope(theta, base.head_dim, float(scaling["factor"]), original,
                                    float(scaling.get("beta_fast") or 32.0), float(scaling.get("beta_slow") or 1.0),
                                    scaling.get("mscale"), scaling.get("mscale_all_dim"),
                                    bool(scaling.get("truncate", True)))
            attn = float(scaling.get("attention_factor") or attn)
        beta = scaling.get("llama_4_scaling_beta")
        return dataclasses.replace(base, architecture="mistral3", rope_freqs=freqs,
                                   query_scale=base.head_dim ** -0.5 * attn ** 2,
                                   query_temperature=(float(beta), original) if beta else None)

    @classmethod
    def sanitize(cls, weights: dict[str, Tensor], config: DecoderConfig, source: str) -> dict[str, Tensor]:
        """GGUF names as Llama's; a ``Mistral3ForConditionalGeneration`` folder's ``language_model.`` names to the
        text model's (its vision tower and projector dropped)."""
        if source == "gguf":
            return super().sanitize(weights, config, source)
        out = {}
        for name, t in weights.items():
            name = name.replace("model.language_model.", "model.").replace("language_model.model.", "model.")
            name = name.replace("language_model.lm_head.", "lm_head.")
            if name.startswith(("model.", "lm_head.")) and not name.startswith(("model.vision_tower.",
                                                                                 "model.multi_modal_projector.")):
                out[name] = t
        return out
