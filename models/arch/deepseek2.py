"""DeepSeek V2 / V3 (``deepseek2`` in GGUF: DeepSeek-V2/V2.5/V3/V3.1/R1, Kimi K2, Moonlight; ``deepseek_v3`` and
``kimi_k2`` folders): multi-head latent attention and a mixture of experts with shared experts.

- **Multi-head latent attention (MLA)**: queries through a low-rank pair (``q_a_proj``, RMSNorm, ``q_b_proj``) or
  one projection (``q_proj``, V2-Lite); keys and values from one latent per token: ``kv_a_proj_with_mqa`` gives the
  latent ``c [kv_lora_rank]`` (RMSNorm'd) and one RoPE key ``k_rot [qk_rope_head_dim]`` shared by every head;
  ``kv_b_proj`` expands ``c`` to each head's ``k_nope [qk_nope_head_dim]`` and value ``[v_head_dim]``. A head's key
  is ``(k_nope, k_rot)``, its query ``(q_nope, q_rot)``, RoPE on the ``rot`` parts only, in the interleaved-pairs
  layout (transformers' ``rope_interleave``, llama.cpp's ``LLAMA_ROPE_TYPE_NORM``; the converter does not permute).
  We put the RoPE part first (in the cache's key and in the queries alike, which leaves the scores unchanged), so
  that the cache's RoPE shift rotates the first features.
- **YaRN** (Peng et al. 2023) with DeepSeek's softmax scale: ``qk_head_dim ** -0.5 * mscale(factor,
  mscale_all_dim) ** 2`` with ``mscale(s, m) = 0.1 m ln s + 1``; the RoPE attention factor ``mscale(s, mscale) /
  mscale(s, mscale_all_dim)`` multiplies the rotated features of queries and keys (its square is folded into the
  queries).
- **Experts**: the first ``first_k_dense_replace`` layers have a dense SwiGLU MLP, the others a router and routed
  experts plus always-on shared experts (``n_shared_experts`` of them, one SwiGLU of their joint width). The router:
  sigmoid scores (V3; softmax for V2 GGUF files that say so), plus ``e_score_correction_bias`` for the choice only;
  experts in ``n_group`` groups, a group scored by its two best experts, the ``topk_group`` best groups kept; the
  ``top_k`` best experts of those, weighed by their scores (without the bias), renormalised with ``norm_topk_prob``,
  times ``routed_scaling_factor``.
- **Cache**: compressed (:class:`~mlx_engine.kvcache.LatentCache`): per token and layer the rotated RoPE key and the
  latent, ``qk_rope_head_dim + kv_lora_rank`` numbers (DeepSeek-V3: 64 + 512 = 576, where every head's expanded key
  and value would take 128 * (192 + 128) = 40960, 71 times more), as llama.cpp and mlx-lm keep it. Small batches
  (every decode step) attend in the absorbed form, the query taken through ``W_UK`` into the latent's space and the
  output through ``W_UV``; a long prefill chunk expands the cached latents into each head's keys and values
  (:meth:`DeepSeek2.absorbed` picks the form of fewer multiply-adds).

llama.cpp's GGUF (``conversion/deepseek.py``) splits ``kv_b_proj`` per head into ``attn_k_b [H, kv_lora_rank,
qk_nope]`` (transposed, for the absorbed product) and ``attn_v_b [H, v_head_dim, kv_lora_rank]``; older files keep
``attn_kv_b``. Both are read back into the per-head products ``k_b [H * qk_nope, kv_lora_rank]`` and ``v_b
[H * v_head_dim, kv_lora_rank]`` (dequantized: a small share of the file).

References: transformers' ``models/deepseek_v3/modeling_deepseek_v3.py`` (``DeepseekV3Attention``,
``DeepseekV3MoE.route_tokens_to_experts``); llama.cpp's ``src/models/deepseek2.cpp``, ``build_moe_ffn`` in
``src/llama-graph.cpp`` (group-limited top-k), ``src/llama-context.cpp`` (YaRN factors) and its converter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mlx_engine.batch import Batch
from mlx_engine.errors import UnsupportedError, WeightsError
from mlx_engine.ml import Backend, Context, DType, Tensor
from mlx_engine.models.layers.base import DecoderModel, ModelPart, hf_names_from_gguf
from mlx_engine.models.layers.config import DecoderConfig, hf_rope_parameters, metadata_getter, vocab_size_of, yarn_rope
from mlx_engine.models.layers.layer import apply_rope, rope_positions
from mlx_engine.models.layers.moe import MoEWeights, experts_mlp, grouped_route, moe_names_from_gguf, stack_experts
from mlx_engine.models.layers.nextn import mtp_weights
from mlx_engine.models.layers.step import NotWholeStep

if TYPE_CHECKING:
    from mlx_engine.kvcache import Cache


@dataclass
class MLAConfig(DecoderConfig):
    """:class:`DecoderConfig` plus multi-head latent attention and DeepSeek's router. ``head_dim`` is the key's
    ``qk_nope + qk_rope`` features, ``rope_dims`` the RoPE part, ``num_kv_heads == num_heads`` (keys expanded).

    Attributes:
        q_lora_rank: the queries' low rank (0: one ``q_proj``). kv_lora_rank: the latent's size.
        qk_nope_dim: the key features without RoPE. v_head_dim: a value head's size.
        dense_layers: the leading layers with a dense MLP (``first_k_dense_replace``).

    The router's fields (``sigmoid_router``, ``expert_groups``, ``groups_used``, ``routed_scale``) are
    :class:`DecoderConfig`'s; :func:`~mlx_engine.models.layers.moe.grouped_route` reads them (softmax scores for the V2
    GGUF files that say so).
    """

    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    v_head_dim: int = 0
    dense_layers: int = 0

    def __post_init__(self) -> None:
        """Raises ``WeightsError`` for sizes that are not positive or a count of dense layers out of range."""
        super().__post_init__()
        for name in ("kv_lora_rank", "qk_nope_dim", "v_head_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise WeightsError(f"model config has {name} = {v!r}; it must be a positive integer")
        if not 0 <= self.dense_layers <= self.num_layers:
            raise WeightsError(f"model config has {self.dense_layers!r} leading dense layers of {self.num_layers}")
        if self.dense_layers < self.num_layers and not (self.num_experts and self.experts_per_token):
            raise WeightsError(f"model config has MoE layers past the first {self.dense_layers} but "
                               f"{self.num_experts!r} experts, {self.experts_per_token!r} per token")


def _mscale(scale: float, m: float) -> float:
    """DeepSeek's YaRN magnitude correction ``0.1 m ln(s) + 1`` (1 for ``s <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


_MLA_NAMES = {"q": "q_proj.weight", "q_a": "q_a_proj.weight", "q_a_norm": "q_a_layernorm.weight",
              "q_b": "q_b_proj.weight", "kv_a": "kv_a_proj_with_mqa.weight", "kv_a_norm": "kv_a_layernorm.weight",
              "k_b": "k_b_proj.weight", "v_b": "v_b_proj.weight", "o": "o_proj.weight"}

# llama.cpp's MLA tensor names (blk.N.<base>.weight) to ours under model.layers.N.
_GGUF_NAMES = {"attn_q_a": "self_attn.q_a_proj.weight", "attn_q_a_norm": "self_attn.q_a_layernorm.weight",
               "attn_q_b": "self_attn.q_b_proj.weight", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa.weight",
               "attn_kv_a_norm": "self_attn.kv_a_layernorm.weight", "attn_kv_b": "self_attn.kv_b_proj.weight",
               "attn_k_b": "self_attn.attn_k_b", "attn_v_b": "self_attn.attn_v_b"}


class DeepSeek2(MoEWeights, DecoderModel):
    """DeepSeek V2 / V3 (module docstring). Runs its own layer loop (MLA is not the shared attention block), op by
    op, one-token steps included."""

    architecture = "deepseek2"
    half_dtype = DType.BFLOAT16  # trained in bfloat16 (FP8 for V3); its activations are not held to float16's range
    config: MLAConfig
    own_layers = "multi-head latent attention"

    def __init__(self, config: MLAConfig, weights: dict[str, Tensor], backend: Backend,
                 part: ModelPart | None = None):
        super().__init__(config, stack_experts(weights, config.num_experts, config.num_layers, backend.new_context()),
                         backend, part)
        if self.part.reduce is not None:
            raise UnsupportedError("a DeepSeek V2/V3 model is not split over ranks by heads yet (its latent "
                                   "attention); use --parallel pipeline")

    # ---- configuration -----------------------------------------------------------------------------------------
    @classmethod
    def config_from_gguf(cls, metadata: Any, weights: dict[str, Tensor]) -> MLAConfig:
        """From llama.cpp's ``deepseek2.*`` keys (``attention.{q,kv}_lora_rank``, ``attention.key_length_mla``,
        ``leading_dense_block_count``, ``expert_*``, ``rope.scaling.*``). Raises ``UnsupportedError`` for
        attention temperature scaling (Mistral Large 3) and a RoPE scaling other than YaRN."""
        get = metadata_getter(metadata, "deepseek2")
        if get("attention.temperature_scale", 0.0):
            raise UnsupportedError("deepseek2 with attention temperature scaling (Mistral Large 3) is not supported")
        heads = get("attention.head_count", positive=True)
        rope = int(get("rope.dimension_count", positive=True))
        key = int(get("attention.key_length_mla", 0) or get("attention.key_length", positive=True))
        value = int(get("attention.value_length_mla", 0) or get("attention.value_length", positive=True))
        layers = int(get("block_count", positive=True)) - int(get("nextn_predict_layers", 0))
        experts = int(get("expert_count", 0))
        shared = int(get("expert_shared_count", 0))
        moe_ff = int(get("expert_feed_forward_length", 0))
        theta = float(get("rope.freq_base", 10000.0))
        kind = get("rope.scaling.type", None)
        freqs, attn, mscale = None, 1.0, 1.0
        if kind == "yarn":
            factor = float(get("rope.scaling.factor"))
            # the converter writes 0.1 * mscale_all_dim; llama.cpp takes mscale = mscale_all_dim then (an attention
            # factor of 1), or with no multiplier the plain YaRN factor (src/llama-context.cpp)
            log_mul = float(get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
            freqs, _ = yarn_rope(theta, rope, factor, int(get("rope.scaling.original_context_length",
                                                               positive=True)),
                                 float(get("rope.scaling.yarn_beta_fast", 32.0)),
                                 float(get("rope.scaling.yarn_beta_slow", 1.0)))
            attn = 1.0 if log_mul else _mscale(factor, 1.0)
            mscale = attn * _mscale(factor, log_mul)
        elif kind not in (None, "none"):
            raise UnsupportedError(f"deepseek2: RoPE scaling {kind!r} is not supported (yarn is)")
        return MLAConfig(
            architecture=cls.architecture, vocab_size=vocab_size_of(weights, metadata, "deepseek2"),
            hidden_size=int(get("embedding_length", positive=True)), num_layers=layers, num_heads=heads,
            num_kv_heads=heads, head_dim=key, intermediate_size=int(get("feed_forward_length", positive=True)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            context_length=int(get("context_length", 4096)), rope_theta=theta, rope_freqs=freqs,
            rope_attention_factor=attn, rope_traditional=True, rope_dims=rope,
            query_scale=mscale * mscale / math.sqrt(key), num_experts=experts,
            experts_per_token=int(get("expert_used_count", 0)), moe_intermediate_size=moe_ff,
            shared_expert_size=shared * moe_ff, norm_topk_prob=bool(get("expert_weights_norm", False)),
            q_lora_rank=int(get("attention.q_lora_rank", 0)), kv_lora_rank=int(get("attention.kv_lora_rank")),
            qk_nope_dim=key - rope, v_head_dim=value,
            dense_layers=int(get("leading_dense_block_count", 0 if experts else layers)),
            expert_groups=int(get("expert_group_count", 0)) or 1, groups_used=int(get("expert_group_used_count", 0))
            or 1, routed_scale=float(get("expert_weights_scale", 1.0)),
            sigmoid_router=int(get("expert_gating_func", 1)) == 2)

    @classmethod
    def config_from_hf(cls, config: Any) -> MLAConfig:
        """From a ``DeepseekV3ForCausalLM`` ``config.json``. Raises ``UnsupportedError`` for attention biases,
        FP8 weights and a RoPE scaling other than YaRN."""
        if config.get("attention_bias"):
            raise UnsupportedError("deepseek_v3 with attention_bias is not supported (no released model has it)")
        if (config.get("quantization_config") or {}).get("quant_method") == "fp8":
            raise UnsupportedError("DeepSeek's FP8 checkpoints are not supported; use a GGUF or a bfloat16 folder")
        theta, scaling = hf_rope_parameters(config)
        scaling = scaling or {}
        kind = scaling.get("rope_type", scaling.get("type"))
        heads = int(config["num_attention_heads"])
        nope, rope, value = (int(config[k]) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
        freqs, attn, scale = None, 1.0, (nope + rope) ** -0.5
        if kind == "yarn":
            factor = float(scaling["factor"])
            original = int(scaling.get("original_max_position_embeddings") or config["max_position_embeddings"])
            freqs, attn = yarn_rope(theta, rope, factor, original, float(scaling.get("beta_fast") or 32.0),
                                    float(scaling.get("beta_slow") or 1.0), scaling.get("mscale"),
                                    scaling.get("mscale_all_dim"), bool(scaling.get("truncate", True)))
            attn = float(scaling.get("attention_factor") or attn)
            if scaling.get("mscale_all_dim"):
                scale *= _mscale(factor, float(scaling["mscale_all_dim"])) ** 2
        elif kind not in (None, "default"):
            raise UnsupportedError(f"deepseek_v3: RoPE scaling {kind!r} is not supported (yarn is)")
        experts = int(config.get("n_routed_experts") or 0)
        moe_ff = int(config.get("moe_intermediate_size") or 0)
        layers = int(config["num_hidden_layers"])
        return MLAConfig(
            architecture=cls.architecture, vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]), num_layers=layers, num_heads=heads, num_kv_heads=heads,
            head_dim=nope + rope, intermediate_size=int(config["intermediate_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            context_length=int(config.get("max_position_embeddings", 4096)), rope_theta=theta, rope_freqs=freqs,
            rope_attention_factor=attn, rope_traditional=bool(config.get("rope_interleave", True)), rope_dims=rope,
            query_scale=scale, num_experts=experts, experts_per_token=int(config.get("num_experts_per_tok") or 0),
            moe_intermediate_size=moe_ff, shared_expert_size=int(config.get("n_shared_experts") or 0) * moe_ff,
            norm_topk_prob=bool(config.get("norm_topk_prob", True)), q_lora_rank=int(config.get("q_lora_rank") or 0),
            kv_lora_rank=int(config["kv_lora_rank"]), qk_nope_dim=nope, v_head_dim=value,
            dense_layers=min(int(config.get("first_k_dense_replace") or 0), layers) if experts else layers,
            expert_groups=int(config.get("n_group") or 1), groups_used=int(config.get("topk_group") or 1),
            routed_scale=float(config.get("routed_scaling_factor") or 1.0), sigmoid_router=True)

    @classmethod
    def sanitize(cls, weights: dict[str, Tensor], config: MLAConfig, source: str) -> dict[str, Tensor]:
        """llama.cpp's names to the hub's; the hub's ``shared_experts`` to ``shared_expert`` (:class:`MoEWeights`);
        multi-token-prediction layers (past ``num_hidden_layers``; llama.cpp's ``blk.N.nextn.*``) kept apart under
        ``mtp.`` (:func:`~mlx_engine.models.layers.nextn.mtp_weights`); ``kv_b_proj`` (or llama.cpp's
        ``attn_k_b`` / ``attn_v_b``) into the per-head key and value products ``k_b_proj [H * qk_nope, rank]`` and
        ``v_b_proj [H * v_head_dim, rank]``.

        Raises:
            WeightsError: a ``kv_b_proj`` (or its halves) of a shape other than the config implies.
        """
        if source == "gguf":
            renamed = {}
            for name, t in weights.items():
                parts = name.split(".")
                if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_NAMES:
                    name = f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}"
                renamed[name] = t
            weights = hf_names_from_gguf(moe_names_from_gguf(renamed), "post_attention_layernorm")
        out: dict[str, Tensor] = {}
        layers = config.num_layers
        for name, t in weights.items():
            if name.startswith("model.layers."):
                layers = max(layers, int(name.split(".")[2]) + 1)
                name = name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")
            out[name] = t
        h, nope, v, rank = config.num_heads, config.qk_nope_dim, config.v_head_dim, config.kv_lora_rank
        for layer in range(layers):  # the multi-token-prediction layers' too
            p = f"model.layers.{layer}.self_attn."
            kv_b, k_b, v_b = out.pop(p + "kv_b_proj.weight", None), out.pop(p + "attn_k_b", None), \
                out.pop(p + "attn_v_b", None)
            try:
                if kv_b is not None:
                    kv = kv_b.dequantize().reshape(h, nope + v, rank)
                    k_b, v_b = kv[:, :nope], kv[:, nope:]
                elif k_b is not None and v_b is not None:  # llama.cpp's halves: k_b [H, rank, nope] transposed
                    k_b, v_b = k_b.dequantize().reshape(h, rank, nope).transpose(0, 2, 1), \
                        v_b.dequantize().reshape(h, v, rank)
                else:
                    continue  # missing: named by the weight check
            except ValueError as e:
                raise WeightsError(f"layer {layer}'s key/value expansion (kv_b_proj) does not have the shape of "
                                   f"{h} heads of {nope} + {v} features from a latent of {rank}: {e}") from e
            out[p + "k_b_proj.weight"] = k_b.reshape(h * nope, rank)
            out[p + "v_b_proj.weight"] = v_b.reshape(h * v, rank)
        return mtp_weights(out, config.num_layers)

    # ---- weights -----------------------------------------------------------------------------------------------
    def _check_weights(self) -> None:
        """Every tensor the config implies is there with its shape.

        Raises:
            WeightsError: a missing tensor, or one of another shape (both named).
        """
        c = self.config
        d, h = c.hidden_size, c.num_heads
        want: dict[str, tuple[int, ...] | None] = {}  # None: optional, [experts]
        if self.part.embed:
            want["model.embed_tokens.weight"] = (c.vocab_size, d)
        if self.part.head:
            want["model.norm.weight"] = (d,)
            want["lm_head.weight" if "lm_head.weight" in self.w else "model.embed_tokens.weight"] = (c.vocab_size, d)
        for i in self.part.layers:
            p = f"model.layers.{i}."
            a = p + "self_attn."
            want.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                         a + "kv_a_proj_with_mqa.weight": (c.kv_lora_rank + c.rope_dims, d),
                         a + "kv_a_layernorm.weight": (c.kv_lora_rank,),
                         a + "k_b_proj.weight": (h * c.qk_nope_dim, c.kv_lora_rank),
                         a + "v_b_proj.weight": (h * c.v_head_dim, c.kv_lora_rank),
                         a + "o_proj.weight": (d, h * c.v_head_dim)})
            if c.q_lora_rank:
                want.update({a + "q_a_proj.weight": (c.q_lora_rank, d), a + "q_a_layernorm.weight": (c.q_lora_rank,),
                             a + "q_b_proj.weight": (h * c.head_dim, c.q_lora_rank)})
            else:
                want[a + "q_proj.weight"] = (h * c.head_dim, d)
            m = p + "mlp."
            if i < c.dense_layers:
                ff = c.intermediate_size
                want.update({m + "gate_proj.weight": (ff, d), m + "up_proj.weight": (ff, d),
                             m + "down_proj.weight": (d, ff)})
            else:
                e, ff, s = c.num_experts, c.moe_intermediate_size, c.shared_expert_size
                want.update({m + "gate.weight": (e, d), m + "experts.gate_proj": (e, ff, d),
                             m + "experts.up_proj": (e, ff, d), m + "experts.down_proj": (e, d, ff),
                             m + "gate.e_score_correction_bias": None})  # optional (V2 has none)
                if s:
                    want.update({m + "shared_expert.gate_proj.weight": (s, d), m + "shared_expert.up_proj.weight":
                                 (s, d), m + "shared_expert.down_proj.weight": (d, s)})
        missing = [n for n, s in want.items() if s is not None and n not in self.w]
        if missing:
            raise WeightsError(f"the {self.architecture} checkpoint lacks {len(missing)} tensors, e.g. "
                               f"{', '.join(missing[:3])}; is it a complete DeepSeek V2/V3 model?")
        for name, shape in want.items():
            t = self.w.get(name)
            shape = (c.num_experts,) if shape is None else shape
            if t is not None and tuple(t.shape) != shape:
                raise WeightsError(f"tensor {name} has shape {tuple(t.shape)} but the model config implies {shape} "
                                   f"(hidden {d}, {h} heads, latent {c.kv_lora_rank}, query rank {c.q_lora_rank}, "
                                   f"key {c.qk_nope_dim} + {c.rope_dims} and value {c.v_head_dim} features, "
                                   f"{c.num_experts} experts); the file is inconsistent")

    def _layer_weights(self, i: int) -> dict[str, Tensor | None]:
        w = super()._layer_weights(i)
        a = f"model.layers.{i}.self_attn."
        w.update({k: self.w.get(a + v) for k, v in _MLA_NAMES.items()})
        return w

    def make_cache(self, kv_bits: int | None = None) -> "Cache":
        """The compressed cache: per token and layer the RoPE key and the latent (:class:`LatentCache`)."""
        from mlx_engine.kvcache import LatentCache

        return LatentCache(self.config.kv_lora_rank, shift_fn=self.shift, kv_bits=kv_bits)

    def layer_kv_shapes(self) -> list[tuple[int, int, int]]:
        c = self.config
        return [(1, c.rope_dims + c.kv_lora_rank, c.kv_lora_rank) if i in self.part.layers else None
                for i in range(c.num_layers)]

    def kv_width(self, layer: int) -> int:
        """``rope + kv_lora_rank``: the latent cache's numbers per token (the values are within the keys)."""
        return self.config.rope_dims + self.config.kv_lora_rank

    # ---- forward -----------------------------------------------------------------------------------------------
    def absorbed(self, n: int) -> bool:
        """Whether a forward pass of ``n`` tokens attends in the absorbed form (below) rather than expanding the
        cached latents into every head's keys and values: the form of fewer multiply-adds. Over ``S`` cached tokens
        the absorbed form costs ``H n S (rope + 2 rank)``, the expanded one ``H S (rank (nope + v) + n (rope + nope +
        v))``; absorbed wins while ``n (2 rank - nope - v) < rank (nope + v)`` (DeepSeek-V3: n < 171, so every decode
        step; mlx-lm absorbs for one token, expands for more)."""
        c = self.config
        return n * (2 * c.kv_lora_rank - c.qk_nope_dim - c.v_head_dim) < c.kv_lora_rank * (c.qk_nope_dim
                                                                                              + c.v_head_dim)

    def run_layers(self, ctx: Context, batch: Batch, h: Tensor, cache: "Cache", output_layer: int | None = None,
                   angles: Any = None, whole: bool = False, pos_tensor: Tensor | None = None) -> Tensor:
        """The layers on ``h [1, N, D]`` (see :meth:`DecoderModel.run_layers`; op by op, ``angles`` unused).
        Raises :class:`NotWholeStep` when traced whole."""
        if whole:
            raise NotWholeStep("multi-head latent attention runs op by op")
        c = self.config
        eps, n = c.rms_norm_eps, h.shape[1]
        positions = rope_positions(ctx, batch)
        absorbed = self.absorbed(n)
        for i, lw in self.layers.items():
            if output_layer is not None and i > output_layer:
                break
            cache.set_layer(i)
            o = self._attention(ctx, h.rms_norm(lw["attn_norm"], eps), lw, positions, i, cache, absorbed)
            h = h + o.transpose(0, 2, 1, 3).reshape(1, n, c.num_heads * c.v_head_dim).linear(lw["o"])
            x = h.rms_norm(lw["post_attn_norm"], eps)
            if lw.get("router") is not None:
                x2 = x.reshape(n, c.hidden_size)
                idx, top = grouped_route(x2, lw, c)
                m = experts_mlp(x2, idx, top, lw).reshape(1, n, c.hidden_size)
            else:
                m = (x.linear(lw["gate"]).silu() * x.linear(lw["up"])).linear(lw["down"])
            h = h + m
        return h

    def _attention(self, ctx: Context, x: Tensor, w: dict[str, Tensor | None], positions: "int | Tensor",
                   layer: int, cache: "Cache", absorbed: bool) -> Tensor:
        """MLA on the normed ``x [1, N, D]``, its latent and RoPE key stored in the :class:`LatentCache`; returns
        the heads' outputs ``[1, H, N, v_head_dim]``.

        Scores are ``q_rot . k_rot + q_nope . k_nope`` with ``k_nope = W_UK c`` per head, so ``q_nope . (W_UK c) =
        (W_UK^T q_nope) . c``: the absorbed form attends with the query ``(q_rot, W_UK^T q_nope) [rope + rank]`` over
        the cached ``(k_rot, c)`` as one key head, and the output ``W_UV (sum_j p_j c_j)`` is the latent's weighted
        sum through ``W_UV`` (DeepSeek-V2's paper, section 2.1.2; llama.cpp's ``deepseek2.cpp``, mlx-lm's
        ``deepseek_v3.py`` for one token). The expanded form makes each cached token's ``k_nope`` and value."""
        c = self.config
        eps, n, h, r, nope, rank = c.rms_norm_eps, x.shape[1], c.num_heads, c.rope_dims, c.qk_nope_dim, c.kv_lora_rank
        q = (x.linear(w["q_a"]).rms_norm(w["q_a_norm"], eps).linear(w["q_b"]) if w.get("q_a") is not None
             else x.linear(w["q"]))
        q = q.reshape(1, n, h, nope + r).transpose(0, 2, 1, 3)
        kv = x.linear(w["kv_a"])  # [1, N, rank + rope]: the latent, then the shared RoPE key
        latent = kv[:, :, :rank].rms_norm(w["kv_a_norm"], eps).reshape(1, 1, n, rank)
        base, scale, freqs = self._rope(layer)
        q_rot = apply_rope(q[:, :, :, nope:], positions, r, base, scale, c.rope_traditional, freqs)
        k_rot = apply_rope(kv[:, :, rank:].reshape(1, 1, n, r), positions, r, base, scale, c.rope_traditional, freqs)
        if c.rope_attention_factor != 1.0:  # YaRN's factor on queries' and keys' rotated features, both on q
            q_rot = q_rot * (c.rope_attention_factor ** 2)
        cache.put(ctx, ctx.concatenate([k_rot, latent], axis=-1), None)
        keys, values, mask = cache.get(ctx)  # [1, 1, S, rope + rank], [1, 1, S, rank]
        k_b, v_b = w["k_b"].reshape(h, nope, rank), w["v_b"].reshape(h, c.v_head_dim, rank)
        if absorbed:
            q = ctx.concatenate([q_rot, q[:, :, :, :nope] @ k_b], axis=-1)  # [1, H, N, rope + rank]
            return ctx.scaled_dot_product_attention(q, keys, values, c.query_scale, mask) @ v_b.transpose(0, 2, 1)
        s = keys.shape[2]
        k_nope = values.linear(w["k_b"]).reshape(1, s, h, nope).transpose(0, 2, 1, 3)
        v = values.linear(w["v_b"]).reshape(1, s, h, c.v_head_dim).transpose(0, 2, 1, 3)
        k = ctx.concatenate([keys[:, :, :, :r] + ctx.zeros((1, h, 1, r), keys.dtype), k_nope], axis=-1)
        return ctx.scaled_dot_product_attention(ctx.concatenate([q_rot, q[:, :, :, :nope]], axis=-1), k, v,
                                                c.query_scale, mask)
