"""IBM Granite 4 (``granitemoehybrid``; GGUF ``granitehybrid``): a hybrid of Mamba-2 layers and attention layers.

- **Mamba-2** layers (``layer_types[i] == "mamba"``): :func:`~mlx_engine.models.layers.mamba2.mamba2_mixer`, its states in
  the :class:`~mlx_engine.kvcache.RecurrentCache`.
- **Attention** layers (``"attention"``): Granite's, without RoPE in the released models
  (``position_embedding_type`` ``"nope"``; ``"rope"`` rotates as Llama); the attention scale is
  ``attention_multiplier``.
- **MLP**: every layer has the dense SwiGLU ``shared_mlp`` (``shared_intermediate_size``); with
  ``num_local_experts > 0`` a mixture of experts beside it (softmax over the top-k router logits, i.e. renormalised
  top-k probabilities), the two summed.
- Granite's multipliers (:mod:`mlx_engine.models.arch.granite`): embeddings times ``embedding_multiplier``, each mixer and
  MLP output times ``residual_multiplier``, logits over ``logits_scaling``.

References: transformers' ``models/granitemoehybrid/modeling_granitemoehybrid.py``; llama.cpp's
``src/models/granite-hybrid.cpp`` and its converter's ``GraniteHybridModel`` (``conversion/granite.py``,
``Mamba2Model`` in ``conversion/mamba.py``: ``A = -exp(A_log)`` stored ``[H, 1]``, ``D`` ``[H, 1]``, the gated
norm's weight ``[G, d_inner / G]``, the convolution ``[C, K]``, fused ``input_linear`` tensors split into gate and
up, Q/K rows permuted as Llama's; ``rope.scaling.finetuned`` false for a model without RoPE).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mlx_engine.errors import WeightsError
from mlx_engine.ml import Context, DType, Tensor
from mlx_engine.models.layers.base import DecoderModel, hf_names_from_gguf
from mlx_engine.models.layers.config import DecoderConfig, check_layer_count, metadata_getter, vocab_size_of
from mlx_engine.models.layers.layer import feed_forward
from mlx_engine.models.layers.mamba2 import mamba2_mixer
from mlx_engine.models.layers.moe import MoEWeights, moe_names_from_gguf

if TYPE_CHECKING:
    from mlx_engine.batch import Batch
    from mlx_engine.kvcache import Cache


@dataclass
class GraniteHybridConfig(DecoderConfig):
    """:class:`DecoderConfig` plus the Mamba-2 layers' sizes: ``ssm_heads`` (``H``), ``ssm_head_dim`` (``P``),
    ``ssm_groups`` (``G``), ``ssm_state`` (``N``), the clip of ``dt`` (``time_step_limit``), and ``rope`` (False:
    the attention layers have no positional encoding)."""

    ssm_heads: int = 0
    ssm_head_dim: int = 0
    ssm_groups: int = 1
    ssm_state: int = 0
    dt_limit: tuple[float, float] = (0.0, math.inf)
    rope: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if "mamba" not in self.layer_types:
            return
        sizes = (self.ssm_heads, self.ssm_head_dim, self.ssm_groups, self.ssm_state)
        if (any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in sizes)
                or self.ssm_heads % self.ssm_groups or not 2 <= self.conv_kernel <= 64):
            raise WeightsError(f"model config's Mamba-2 layers have {self.ssm_heads!r} heads of {self.ssm_head_dim!r}, "
                               f"{self.ssm_groups!r} groups, state size {self.ssm_state!r} and convolution kernel "
                               f"{self.conv_kernel!r}: sizes must be positive, the heads a multiple of the groups, "
                               "the kernel from 2 to 64")
        low, high = self.dt_limit
        if not (0.0 <= low < high):
            raise WeightsError(f"model config has time_step_limit {self.dt_limit!r}; it must be (low, high) with "
                               "0 <= low < high")


def _float(v: Any) -> float:
    """A number of ``config.json``, also as transformers writes infinity (``{"__float__": "Infinity"}``)."""
    return float(v["__float__"] if isinstance(v, dict) else v)


#: ``config.json``'s layer kinds (the released ``"mamba"`` / ``"attention"``, transformers 5's names) to ours.
_HF_LAYER_TYPES = {"mamba": "mamba", "linear_attention": "mamba", "attention": "full_attention",
                   "full_attention": "full_attention"}


class GraniteHybrid(MoEWeights, DecoderModel):
    architecture = "granitemoehybrid"
    gguf_arch = "granitehybrid"
    half_dtype = DType.BFLOAT16  # as released; the SSM state is float32 anyway

    # ---- configuration -------------------------------------------------------------------------------------------
    @classmethod
    def config_from_gguf(cls, metadata: Any, weights: dict[str, Tensor]) -> DecoderConfig:
        """From llama.cpp's ``granitehybrid.*`` keys: a layer is recurrent where ``attention.head_count_kv`` is 0;
        ``ssm.*`` the Mamba-2 sizes (``time_step_rank`` the heads); RoPE where ``rope.scaling.finetuned`` is true
        (llama.cpp's default) with Llama's permuted rows."""
        get = metadata_getter(metadata, cls.gguf_arch)
        heads = get("attention.head_count", positive=True)
        hidden = get("embedding_length", positive=True)
        layers = check_layer_count(get("block_count"))
        kv = get("attention.head_count_kv", heads)
        kv = [int(x) for x in kv] if hasattr(kv, "__len__") else [int(kv)] * layers
        if len(kv) != layers:
            raise WeightsError(f"GGUF metadata key '{cls.gguf_arch}.attention.head_count_kv' has {len(kv)} entries "
                               f"for {layers} layers")
        attn_kv = [x for x in kv if x] or [heads]
        if len(set(attn_kv)) != 1:
            raise WeightsError(f"GGUF metadata key '{cls.gguf_arch}.attention.head_count_kv' has different counts "
                               f"{sorted(set(attn_kv))} on the attention layers; one is supported")
        inner, ssm_heads = get("ssm.inner_size", positive=True), get("ssm.time_step_rank", positive=True)
        experts = int(get("expert_count", 0))
        ff = int(get("feed_forward_length", positive=True))
        shared = int(get("expert_shared_feed_forward_length", 0))
        rope = bool(get("rope.scaling.finetuned", True))
        return GraniteHybridConfig(
            architecture=cls.architecture, vocab_size=vocab_size_of(weights, metadata, cls.gguf_arch),
            hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=attn_kv[0],
            head_dim=int(get("attention.key_length", hidden // heads)),
            intermediate_size=shared or ff,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            context_length=min(int(get("context_length", 131072)), 1 << 30),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_traditional=True, layer_types=["full_attention" if x else "mamba" for x in kv],
            query_scale=float(get("attention.scale", (hidden // heads) ** -0.5)),
            embed_scale=float(get("embedding_scale", 1.0)), residual_scale=float(get("residual_scale", 1.0)),
            logit_scale=float(get("logit_scale", 1.0)), conv_kernel=int(get("ssm.conv_kernel", 4)),
            num_experts=experts, experts_per_token=int(get("expert_used_count", 0)),
            moe_intermediate_size=ff if experts else 0, shared_expert_size=shared if experts else 0,
            ssm_heads=int(ssm_heads), ssm_head_dim=int(inner) // int(ssm_heads),
            ssm_groups=int(get("ssm.group_count", 1)), ssm_state=int(get("ssm.state_size", positive=True)),
            rope=rope,
        )

    @classmethod
    def config_from_hf(cls, config: Any) -> DecoderConfig:
        """From ``config.json``: ``layer_types`` (or ``layers_block_type``) in the released names or transformers 5's;
        ``mamba_d_head`` ``"auto"`` is ``mamba_expand * hidden_size / mamba_n_heads``."""
        layers = check_layer_count(config["num_hidden_layers"])
        kinds = config.get("layer_types") or config.get("layers_block_type") or ["mamba"] * layers
        unknown = sorted({str(k) for k in kinds} - set(_HF_LAYER_TYPES))
        if unknown:
            raise WeightsError(f"model config's layer_types has kinds {unknown}; a Granite 4 layer is 'mamba' or "
                               "'attention'")
        heads, hidden = int(config["num_attention_heads"]), int(config["hidden_size"])
        ssm_heads = int(config.get("mamba_n_heads", 128))
        head_dim = config.get("mamba_d_head", "auto")
        if head_dim == "auto":
            head_dim = int(config.get("mamba_expand", 2)) * hidden // ssm_heads
        experts = int(config.get("num_local_experts") or 0)
        shared = int(config.get("shared_intermediate_size", 1024))
        position = config.get("position_embedding_type")
        params = config.get("rope_parameters") or {}
        limit = config.get("time_step_limit") or (0.0, math.inf)
        return GraniteHybridConfig(
            architecture=cls.architecture, vocab_size=int(config["vocab_size"]), hidden_size=hidden,
            num_layers=layers, num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=hidden // heads, intermediate_size=shared, rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            context_length=int(config.get("max_position_embeddings", 131072)),
            rope_theta=float(config.get("rope_theta", params.get("rope_theta", 10000.0))),
            layer_types=[_HF_LAYER_TYPES[str(k)] for k in kinds],
            query_scale=float(config.get("attention_multiplier", 1.0)),
            embed_scale=float(config.get("embedding_multiplier", 1.0)),
            residual_scale=float(config.get("residual_multiplier", 1.0)),
            logit_scale=float(config.get("logits_scaling", 1.0)), attention_bias=bool(config.get("attention_bias")),
            conv_kernel=int(config.get("mamba_d_conv", 4)), num_experts=experts,
            experts_per_token=int(config.get("num_experts_per_tok") or 0) if experts else 0,
            moe_intermediate_size=int(config["intermediate_size"]) if experts else 0,
            shared_expert_size=shared if experts else 0, ssm_heads=ssm_heads, ssm_head_dim=int(head_dim),
            ssm_groups=int(config.get("mamba_n_groups", 1)), ssm_state=int(config.get("mamba_d_state", 256)),
            dt_limit=(_float(limit[0]), _float(limit[1])), rope=position == "rope",
        )

    # ---- weights -------------------------------------------------------------------------------------------------
    @classmethod
    def sanitize(cls, weights: dict[str, Tensor], config: DecoderConfig, source: str) -> dict[str, Tensor]:
        """Both sources to one layout: the Mamba-2 tensors under ``mamba.`` with ``A = -exp(A_log)`` as ``mamba.A``,
        ``A``, ``D`` and the norm as vectors and the convolution ``[C, K]``; the shared MLP as ``mlp.gate_proj`` /
        ``up_proj`` / ``down_proj`` (``mlp.shared_expert.*`` in an MoE layer); the experts stacked as
        ``mlp.experts.gate_proj`` ... and the router as ``mlp.gate.weight`` (:class:`MoEWeights`' names)."""
        moe = config.num_experts > 0
        shared = "mlp.shared_expert." if moe else "mlp."
        out: dict[str, Tensor] = {}
        if source == "gguf":
            weights = moe_names_from_gguf(weights) if moe else weights
            for name, t in weights.items():
                parts = name.split(".")
                base = parts[2] if parts[0] == "blk" and len(parts) > 2 else None
                if base in _GGUF_SSM_NAMES:
                    suffix = "" if base in ("ssm_a", "ssm_d", "ssm_dt") else "." + ".".join(parts[3:])
                    name = f"model.layers.{parts[1]}.mamba.{_GGUF_SSM_NAMES[base]}{suffix}"
                    if base in ("ssm_a", "ssm_d", "ssm_norm"):  # [H, 1], [H, 1], [G, d_inner / G]: vectors
                        t = t.dequantize().reshape(-1)
                out[name] = t
            return hf_names_from_gguf(out, "post_attention_layernorm")
        for name, t in weights.items():
            if name.endswith("mamba.A_log"):
                name, t = name.replace("A_log", "A"), -(t.astype(DType.FLOAT32).exp())
            elif name.endswith("mamba.conv1d.weight") and t.ndim == 3:  # [C, 1, K]
                t = t.reshape(t.shape[0], t.shape[1] * t.shape[2])
            elif name.endswith(("shared_mlp.input_linear.weight", "block_sparse_moe.input_linear.weight",
                                "block_sparse_moe.experts.gate_up_proj")):  # gate rows, then up rows
                experts = t.ndim == 3
                p = name[:name.index("shared_mlp" if "shared_mlp" in name else "block_sparse_moe")]
                p += "mlp.experts." if experts else shared
                half = t.shape[-2] // 2
                if experts:
                    t = t.dequantize()
                    out[p + "gate_proj"], out[p + "up_proj"] = t[:, :half], t[:, half:]
                else:
                    out[p + "gate_proj.weight"] = t.rows(list(range(half)))
                    out[p + "up_proj.weight"] = t.rows(list(range(half, 2 * half)))
                continue
            elif name.endswith("shared_mlp.output_linear.weight"):
                name = name.replace("shared_mlp.output_linear.", shared + "down_proj.")
            elif name.endswith(("block_sparse_moe.output_linear.weight", "block_sparse_moe.experts.down_proj")):
                name = name[:name.index("block_sparse_moe")] + "mlp.experts.down_proj"
            elif name.endswith(("block_sparse_moe.router.layer.weight", "block_sparse_moe.router.weight")):
                name = name[:name.index("block_sparse_moe")] + "mlp.gate.weight"
            out[name] = t
        return out

    def mlp_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        shapes = super().mlp_shapes(layer)
        shapes.pop(f"model.layers.{layer}.mlp.shared_expert_gate.weight", None)  # Granite's shared MLP is ungated
        return shapes

    def mixer_shapes(self, layer: int) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        c = self.config
        if c.layer_types[layer] != "mamba":
            return super().mixer_shapes(layer)
        h, inner, p = c.ssm_heads, c.ssm_heads * c.ssm_head_dim, f"model.layers.{layer}.mamba."
        conv_dim = inner + 2 * c.ssm_groups * c.ssm_state
        proj = inner + conv_dim + h
        req = {p + "in_proj.weight": (proj, c.hidden_size), p + "conv1d.weight": (conv_dim, c.conv_kernel),
               p + "A": (h,), p + "D": (h,), p + "dt_bias": (h,), p + "norm.weight": (inner,),
               p + "out_proj.weight": (c.hidden_size, inner)}
        opt = {p + "conv1d.bias": (conv_dim,), p + "in_proj.bias": (proj,), p + "out_proj.bias": (c.hidden_size,)}
        return req, opt

    def _layer_weights(self, i: int) -> dict[str, Tensor | None]:
        w = super()._layer_weights(i)
        if self.config.layer_types[i] == "mamba":
            p = f"model.layers.{i}.mamba."
            f32 = {k: self.w[p + n].dequantize().astype(DType.FLOAT32)
                   for k, n in (("a", "A"), ("d", "D"), ("dt_bias", "dt_bias"))}
            w.update({"in_proj": self.w[p + "in_proj.weight"], "in_proj_bias": self.w.get(p + "in_proj.bias"),
                      "conv_bias": self.w.get(p + "conv1d.bias"), "norm": self.w[p + "norm.weight"],
                      "out_proj": self.w[p + "out_proj.weight"], "out_proj_bias": self.w.get(p + "out_proj.bias"),
                      **f32})
            taps = self.w[p + "conv1d.weight"].dequantize().astype(self.dtype).transpose(1, 0)
            w.update({f"conv_tap{k}": taps[k] for k in range(self.config.conv_kernel)})
        return w

    def _rope_scale(self, layer: int) -> float:
        # no positional encoding: RoPE by angle zero leaves queries and keys as they are (the fused paths still run)
        return super()._rope_scale(layer) if self.config.rope else 0.0

    # ---- cache ---------------------------------------------------------------------------------------------------
    def make_cache(self, kv_bits: int | None = None) -> "Cache":
        """A :class:`~mlx_engine.kvcache.RecurrentCache`: causal KV for the attention layers, the convolution and
        SSM states for the Mamba-2 layers."""
        from mlx_engine.kvcache import RecurrentCache

        return RecurrentCache(shift_fn=self.shift, kv_bits=kv_bits, **self.cache_options)

    def state_bytes(self) -> int:
        from mlx_engine.kvcache.recurrent import CHECKPOINT_COUNT

        c = self.config
        inner = c.ssm_heads * c.ssm_head_dim
        per_layer = ((c.conv_kernel - 1) * (inner + 2 * c.ssm_groups * c.ssm_state) + inner * c.ssm_state) * 4
        layers = sum(t == "mamba" for t in c.layer_types)
        return layers * per_layer * (2 + self.cache_options.get("checkpoint_count", CHECKPOINT_COUNT))

    # ---- Mamba-2 layers ------------------------------------------------------------------------------------------
    def mixer_layer(self, ctx: Context, layer: int, w: dict[str, Tensor | None], h: Tensor, cache: "Cache",
                    batch: "Batch") -> Tensor:
        """A Mamba-2 layer on ``h [1, S * L, D]``: the input norm, the mixer on its states, the residual-scaled
        add and the MLP."""
        c = self.config
        s, n = cache.layout
        sizes = (c.ssm_heads, c.ssm_head_dim, c.ssm_groups, c.ssm_state)
        conv_dim = c.ssm_heads * c.ssm_head_dim + 2 * c.ssm_groups * c.ssm_state
        conv = cache.get_state(ctx, layer, "conv", (c.conv_kernel - 1, conv_dim))
        ssm = cache.get_state(ctx, layer, "recurrent", (c.ssm_heads, c.ssm_head_dim, c.ssm_state))
        x = h.rms_norm(w["attn_norm"], c.rms_norm_eps).reshape(s, n, c.hidden_size)
        taps = [w[f"conv_tap{j}"] for j in range(c.conv_kernel)]
        y, conv, ssm = mamba2_mixer(ctx, x, w, sizes, taps, conv, ssm, c.rms_norm_eps, c.dt_limit)
        cache.set_state(ctx, layer, "conv", conv)
        cache.set_state(ctx, layer, "recurrent", ssm)
        y = y.reshape(1, s * n, c.hidden_size)
        if c.residual_scale != 1.0:
            y = y * c.residual_scale
        return feed_forward(c, h, y, w)


#: llama.cpp's Mamba-2 tensor names (``blk.N.<base>``) to ours under ``model.layers.N.mamba.``.
_GGUF_SSM_NAMES = {"ssm_in": "in_proj", "ssm_out": "out_proj", "ssm_conv1d": "conv1d", "ssm_norm": "norm",
                   "ssm_a": "A", "ssm_d": "D", "ssm_dt": "dt_bias"}
