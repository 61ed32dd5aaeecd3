"""GLM-4.5 / 4.6 / 4.7 and their Air variants (``glm4_moe`` folders, ``glm4moe`` in GGUF; ollama's ``glm-4.6``,
``glm-4.7``): Llama's layer with partial RoPE, q/k/v biases and optional per-head q/k norms, the first
``first_k_dense_replace`` layers dense, the others DeepSeek V3's mixture of experts.

- **Attention**: RoPE on the first ``head_dim * partial_rotary_factor`` features of each head (0.5 unless the config
  says), in the rotate-half layout (llama.cpp's NEOX: its converter does not permute Q/K rows); biases on the query,
  key and value projections (``attention_bias``); RMSNorm on each head's queries and keys before RoPE where
  ``use_qk_norm`` (GLM-4.5's 355B model).
- **Experts**: a sigmoid router with ``e_score_correction_bias`` for the choice, group-limited top-k (``n_group``,
  ``topk_group``: one group in every released config), ``norm_topk_prob``, ``routed_scaling_factor``, plus
  ``n_shared_experts`` always-on shared experts (one SwiGLU of their joint width, no gate):
  :func:`mlx_engine.models.layers.moe.grouped_route`.
- **Next-token prediction layers** (``num_nextn_predict_layers``: layers past ``num_hidden_layers`` in the folder,
  extra blocks in the GGUF, whose ``block_count`` counts them) are for speculative decoding: kept apart at load, they
  draft with ``speculative="mtp"`` (:mod:`mlx_engine.models.generation.mtp`).

llama.cpp's ``glm4moe`` reads no expert groups (its converter writes none); a GGUF's experts are chosen from all of
them, as llama.cpp does.

References: transformers' ``models/glm4_moe/modeling_glm4_moe.py`` (``Glm4MoeAttention``, ``Glm4MoeTopkRouter``,
``Glm4MoeMoE``); llama.cpp's ``src/models/glm4-moe.cpp`` and its converter (``conversion/glm.py``,
``Glm4MoeModel``).
"""

from __future__ import annotations

from typing import Any

from mlx_engine.errors import UnsupportedError, WeightsError
from mlx_engine.ml import Backend, Tensor
from mlx_engine.models.layers.base import DecoderModel, ModelPart, hf_names_from_gguf
from mlx_engine.models.layers.config import (DecoderConfig, check_layer_count, check_rope_scaling, hf_rope_parameters,
                                      metadata_getter, vocab_size_of)
from mlx_engine.models.layers.moe import MoEWeights, moe_names_from_gguf, stack_experts
from mlx_engine.models.layers.nextn import mtp_weights


class Glm4MoE(MoEWeights, DecoderModel):
    """GLM-4.5 / 4.6 / 4.7 (module docstring): the shared decoder's layer with DeepSeek V3's router on the MoE
    layers (a layer holding ``mlp.gate.weight``)."""

    architecture = "glm4_moe"
    shared_expert_gated = False

    def __init__(self, config: DecoderConfig, weights: dict[str, Tensor], backend: Backend,
                 part: ModelPart | None = None):
        super().__init__(config, stack_experts(weights, config.num_experts, config.num_layers, backend.new_context()),
                         backend, part)

    @classmethod
    def config_from_gguf(cls, metadata: Any, weights: dict[str, Tensor]) -> DecoderConfig:
        """From llama.cpp's ``glm4moe.*`` keys (``block_count`` less ``nextn_predict_layers``,
        ``rope.dimension_count``, ``expert_*``, ``leading_dense_block_count``). Raises ``UnsupportedError`` for
        multimodal RoPE sections (GLM-4.5V's) and a RoPE scaling other than linear; ``WeightsError`` for a router
        other than sigmoid."""
        get = metadata_getter(metadata, "glm4moe")
        if any(int(s) for s in get("rope.dimension_sections", []) or []):
            raise UnsupportedError("glm4moe with multimodal RoPE sections (GLM-4.5V) is not supported")
        if int(get("expert_gating_func", 2)) != 2:
            raise WeightsError("GGUF metadata glm4moe.expert_gating_func is not 2 (sigmoid), GLM-4.5's router")
        heads = get("attention.head_count", positive=True)
        hidden = get("embedding_length", positive=True)
        head_dim = int(get("attention.key_length", hidden // heads))
        scaling = get("rope.scaling.type", None)
        check_rope_scaling(scaling, "glm4moe")
        factor = float(get("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
        layers = check_layer_count(int(get("block_count", positive=True)) - int(get("nextn_predict_layers", 0)))
        moe_ff = int(get("expert_feed_forward_length", positive=True))
        return DecoderConfig(
            architecture=cls.architecture, vocab_size=vocab_size_of(weights, metadata, "glm4moe"),
            hidden_size=hidden, num_layers=layers, num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)), head_dim=head_dim,
            intermediate_size=int(get("feed_forward_length", positive=True)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            context_length=int(get("context_length", 131072)), rope_theta=float(get("rope.freq_base", 1000000.0)),
            rope_scale=1.0 / factor, rope_dims=int(get("rope.dimension_count", head_dim // 2)),
            qk_norm="blk.0.attn_q_norm.weight" in weights, num_experts=int(get("expert_count", positive=True)),
            experts_per_token=int(get("expert_used_count", positive=True)), moe_intermediate_size=moe_ff,
            shared_expert_size=int(get("expert_shared_count", 0)) * moe_ff,
            norm_topk_prob=bool(get("expert_weights_norm", False)), sigmoid_router=True,
            routed_scale=float(get("expert_weights_scale", 1.0)))

    @classmethod
    def config_from_hf(cls, config: Any) -> DecoderConfig:
        """From a ``Glm4MoeForCausalLM`` ``config.json``. Raises ``UnsupportedError`` for a RoPE scaling other than
        linear."""
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        theta, scaling = hf_rope_parameters(config)
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        check_rope_scaling(kind, cls.architecture)
        params = config.get("rope_parameters") or {}
        partial = float(config.get("partial_rotary_factor", params.get("partial_rotary_factor", 0.5)))
        moe_ff = int(config.get("moe_intermediate_size") or 0)
        return DecoderConfig(
            architecture=cls.architecture, vocab_size=int(config["vocab_size"]), hidden_size=hidden,
            num_layers=check_layer_count(config["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads), head_dim=head_dim,
            intermediate_size=int(config["intermediate_size"]), rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            context_length=int(config.get("max_position_embeddings", 131072)), rope_theta=theta,
            rope_scale=1.0 / float(scaling["factor"]) if kind == "linear" else 1.0,
            rope_dims=int(head_dim * partial), qk_norm=bool(config.get("use_qk_norm", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            num_experts=int(config.get("n_routed_experts") or 0),
            experts_per_token=int(config.get("num_experts_per_tok") or 0), moe_intermediate_size=moe_ff,
            shared_expert_size=int(config.get("n_shared_experts") or 0) * moe_ff,
            norm_topk_prob=bool(config.get("norm_topk_prob", True)), sigmoid_router=True,
            expert_groups=int(config.get("n_group") or 1), groups_used=int(config.get("topk_group") or 1),
            routed_scale=float(config.get("routed_scaling_factor") or 1.0))

    @classmethod
    def sanitize(cls, weights: dict[str, Tensor], config: DecoderConfig, source: str) -> dict[str, Tensor]:
        """llama.cpp's names to the hub's (``blk.N.post_attention_norm`` is the MLP's input norm); the hub's
        ``shared_experts`` to ``shared_expert`` (:class:`MoEWeights`); the next-token prediction layers (past
        ``num_layers``; llama.cpp's ``blk.N.nextn.*``) kept apart under ``mtp.``
        (:func:`~mlx_engine.models.layers.nextn.mtp_weights`)."""
        if source == "gguf":
            weights = hf_names_from_gguf(moe_names_from_gguf(weights), "post_attention_layernorm")
        out: dict[str, Tensor] = {}
        for name, t in weights.items():
            if name.startswith("model.layers."):
                name = name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")
            out[name] = t
        return mtp_weights(out, config.num_layers)
