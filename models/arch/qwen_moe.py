"""Qwen mixtures of experts: Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B, Qwen3-235B-A22B) and Qwen2-MoE
(Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B).

- **Qwen3-MoE**: Qwen3's attention (per-head RMSNorm on queries and keys before RoPE, no biases); each MLP a router
  ``softmax(x W_r)`` whose ``k`` largest probabilities (renormalised to sum to 1 with ``norm_topk_prob``) weigh
  their experts' SwiGLU outputs.
- **Qwen2-MoE**: Qwen2's attention (biases on the query, key and value projections, no query/key norms); the same
  router (``norm_topk_prob`` off in the released models), plus an always-on shared expert scaled by
  ``sigmoid(x W_s)``.

Both: RoPE in the rotate-half layout (llama.cpp's NEOX: its converter does not permute Q/K rows for Qwen), dense
SwiGLU MLPs on the layers without a router (``mlp_only_layers``, ``decoder_sparse_step``). llama.cpp's graphs fix the
renormalisation per architecture (on for ``qwen3moe``, off for ``qwen2moe``) unless ``expert_weights_norm`` says.
The MoE maths is :func:`mlx_engine.models.layers.moe.moe_mlp`.

References: transformers' ``models/qwen3_moe/modeling_qwen3_moe.py`` and ``models/qwen2_moe/modeling_qwen2_moe.py``;
mlx-lm's ``models/qwen3_moe.py`` and ``models/qwen2_moe.py``; llama.cpp's ``src/models/qwen3moe.cpp`` and
``qwen2moe.cpp``.
"""

from __future__ import annotations

from typing import Any

from mlx_engine.errors import UnsupportedError
from mlx_engine.ml import Backend, Tensor
from mlx_engine.models.layers.base import DecoderModel, ModelPart, hf_names_from_gguf
from mlx_engine.models.layers.config import DecoderConfig, check_rope_scaling, hf_rope_parameters, metadata_getter, \
    vocab_size_of
from mlx_engine.models.layers.moe import MoEWeights, moe_names_from_gguf, stack_experts


class _QwenMoE(MoEWeights, DecoderModel):
    """What both Qwen MoE generations share; subclasses set the names and the attention's switches."""

    gguf_arch = ""
    qk_norm = False
    #: ``norm_topk_prob`` where the checkpoint does not say (llama.cpp's graph for the architecture).
    default_norm_topk = False

    def __init__(self, config: DecoderConfig, weights: dict[str, Tensor], backend: Backend,
                 part: ModelPart | None = None):
        super().__init__(config, stack_experts(weights, config.num_experts, config.num_layers, backend.new_context()),
                         backend, part)

    @classmethod
    def config_from_gguf(cls, metadata: Any, weights: dict[str, Tensor]) -> DecoderConfig:
        """From llama.cpp's ``<arch>.*`` keys (``expert_count``, ``expert_used_count``,
        ``expert_feed_forward_length``, ``expert_shared_feed_forward_length``)."""
        get = metadata_getter(metadata, cls.gguf_arch)
        heads = get("attention.head_count", positive=True)
        hidden = get("embedding_length", positive=True)
        scaling = get("rope.scaling.type", None)
        check_rope_scaling(scaling, cls.gguf_arch)
        factor = float(get("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
        experts = int(get("expert_count", positive=True))
        return DecoderConfig(
            architecture=cls.architecture, vocab_size=vocab_size_of(weights, metadata, cls.gguf_arch),
            hidden_size=hidden, num_layers=int(get("block_count")), num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=int(get("attention.key_length", hidden // heads)),
            intermediate_size=int(get("feed_forward_length", 0) or get("expert_feed_forward_length")),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            context_length=int(get("context_length", 32768)), rope_theta=float(get("rope.freq_base", 1000000.0)),
            rope_scale=1.0 / factor, qk_norm=cls.qk_norm, num_experts=experts,
            experts_per_token=int(get("expert_used_count", positive=True)),
            moe_intermediate_size=int(get("expert_feed_forward_length", positive=True)),
            shared_expert_size=int(get("expert_shared_feed_forward_length", 0)),
            norm_topk_prob=bool(get("expert_weights_norm", cls.default_norm_topk)),
        )

    @classmethod
    def config_from_hf(cls, config: Any) -> DecoderConfig:
        """From ``config.json``. Raises ``UnsupportedError`` for ``use_sliding_window`` (no released checkpoint
        sets it) and a RoPE scaling other than linear."""
        if config.get("use_sliding_window"):
            raise UnsupportedError(f"{cls.architecture} with use_sliding_window is not supported")
        heads = int(config["num_attention_heads"])
        theta, scaling = hf_rope_parameters(config)
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        check_rope_scaling(kind, cls.architecture)
        return DecoderConfig(
            architecture=cls.architecture, vocab_size=int(config["vocab_size"]), hidden_size=int(config["hidden_size"]),
            num_layers=int(config["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
            intermediate_size=int(config["intermediate_size"]), rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            context_length=int(config.get("max_position_embeddings", 32768)), rope_theta=theta,
            rope_scale=1.0 / float(scaling["factor"]) if kind == "linear" else 1.0, qk_norm=cls.qk_norm,
            num_experts=int(config.get("num_experts") or config["num_local_experts"]),
            experts_per_token=int(config["num_experts_per_tok"]),
            moe_intermediate_size=int(config["moe_intermediate_size"]),
            shared_expert_size=int(config.get("shared_expert_intermediate_size") or 0),
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        )

    @classmethod
    def sanitize(cls, weights: dict[str, Tensor], config: DecoderConfig, source: str) -> dict[str, Tensor]:
        if source == "gguf":
            return hf_names_from_gguf(moe_names_from_gguf(weights), "post_attention_layernorm")
        return weights


class Qwen3MoE(_QwenMoE):
    architecture = "qwen3_moe"
    gguf_arch = "qwen3moe"
    qk_norm = True
    default_norm_topk = True


class Qwen2MoE(_QwenMoE):
    architecture = "qwen2_moe"
    gguf_arch = "qwen2moe"
