"""GLM-4.7-Flash (``glm4_moe_lite`` folders, transformers' ``Glm4MoeLiteForCausalLM``; llama.cpp's converter writes
it as a ``deepseek2`` GGUF, which :class:`~mlx_engine.models.arch.deepseek2.DeepSeek2` reads): DeepSeek V3's layer
under another name. transformers builds it from ``DeepseekV3Attention`` (multi-head latent attention, interleaved
RoPE on ``qk_rope_head_dim`` features, YaRN's softmax scale where configured) and GLM-4.5's mixture of experts (the
sigmoid router with a correction bias, group-limited top-k, ``norm_topk_prob``, ``routed_scaling_factor``, shared
experts), the same maths as DeepSeek V3's; so the compressed latent cache serves it too.

What differs is the config: the dense and MoE layers are listed in ``mlp_layer_types`` (``"dense"`` / ``"sparse"``
per layer) rather than counted by ``first_k_dense_replace``, and the RoPE is sized by ``head_dim`` (mapped to
``qk_rope_head_dim``) times ``partial_rotary_factor``.

References: transformers' ``models/glm4_moe_lite/modular_glm4_moe_lite.py``; llama.cpp's converter
(``conversion/glm.py``, ``Glm4MoeLiteModel``, a ``DeepseekV2Model``).
"""

from __future__ import annotations

from typing import Any

from mlx_engine.errors import UnsupportedError, WeightsError
from mlx_engine.models.arch.deepseek2 import DeepSeek2, MLAConfig


class Glm4MoeLite(DeepSeek2):
    """GLM-4.7-Flash (module docstring): :class:`DeepSeek2` with GLM's config."""

    architecture = "glm4_moe_lite"

    @classmethod
    def config_from_hf(cls, config: Any) -> MLAConfig:
        """From a ``Glm4MoeLiteForCausalLM`` ``config.json``: DeepSeek V3's reading, the leading dense layers from
        ``mlp_layer_types`` (else ``first_k_dense_replace``, else one as transformers defaults).

        Raises:
            UnsupportedError: dense layers that do not all lead (``mlp_layer_types``), or RoPE on a part of the
                RoPE features (transformers cannot run that either), or as :meth:`DeepSeek2.config_from_hf`.
            WeightsError: ``mlp_layer_types`` not a list of ``dense`` / ``sparse`` per layer.
        """
        layers = int(config["num_hidden_layers"])
        kinds = config.get("mlp_layer_types")
        if kinds is None:
            dense = int(config.get("first_k_dense_replace", 1))
        else:
            if not isinstance(kinds, list) or len(kinds) != layers or set(kinds) - {"dense", "sparse"}:
                raise WeightsError(f"model config has mlp_layer_types {kinds!r:.120}; it must list 'dense' or "
                                   f"'sparse' for each of the {layers} layers")
            dense = kinds.count("dense")
            if kinds != ["dense"] * dense + ["sparse"] * (layers - dense):
                raise UnsupportedError(f"glm4_moe_lite with dense layers after MoE layers ({kinds}) is not supported: "
                                       "the dense layers must lead")
        params = config.get("rope_parameters") or {}
        partial = float(config.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)))
        if partial != 1.0:
            raise UnsupportedError(f"glm4_moe_lite with partial_rotary_factor {partial} is not supported (RoPE on "
                                   "all qk_rope_head_dim features)")
        return super().config_from_hf({**config, "first_k_dense_replace": dense})
