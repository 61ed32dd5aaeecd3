"""IBM Granite 3.x dense models: Llama's layer with four multipliers: the embeddings times ``embedding_multiplier``,
the attention scale ``attention_multiplier`` (in place of ``head_dim ** -0.5``), each attention and MLP output times
``residual_multiplier`` before its residual add, and the logits divided by ``logits_scaling``.

References: transformers' ``models/granite/modeling_granite.py``; llama.cpp's ``convert_hf_to_gguf.py``
(``GraniteModel``: Llama's tensors, Q/K rows permuted, the multipliers as ``granite.embedding_scale``,
``granite.attention.scale``, ``granite.residual_scale``, ``granite.logit_scale``); mlx-lm's ``models/arch/granite.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mlx_engine.ml import Tensor
from mlx_engine.models.layers.config import DecoderConfig, metadata_getter
from mlx_engine.models.arch.llama import Llama


class Granite(Llama):
    architecture = "granite"
    gguf_prefix = "granite"

    @classmethod
    def config_from_gguf(cls, metadata: Any, weights: dict[str, Tensor]) -> DecoderConfig:
        config = super().config_from_gguf(metadata, weights)
        get = metadata_getter(metadata, "granite")
        return dataclasses.replace(
            config, architecture="granite", embed_scale=float(get("embedding_scale", 1.0)),
            query_scale=float(get("attention.scale", config.head_dim ** -0.5)),
            residual_scale=float(get("residual_scale", 1.0)), logit_scale=float(get("logit_scale", 1.0)))

    @classmethod
    def config_from_hf(cls, config: Any) -> DecoderConfig:
        base = super().config_from_hf(config)
        return dataclasses.replace(
            base, architecture="granite", embed_scale=float(config.get("embedding_multiplier", 1.0)),
            query_scale=float(config.get("attention_multiplier", base.head_dim ** -0.5)),
            residual_scale=float(config.get("residual_multiplier", 1.0)),
            logit_scale=float(config.get("logits_scaling", 1.0)))
