"""OLMo 2: norms after attention and after the MLP only (none before them: ``h + norm(attn(h))``,
``h + norm(mlp(h))``), RMSNorm on the queries and keys over the whole projection (all heads together, before RoPE),
RoPE on rotated halves, SwiGLU, separate output head. Its layer does not fit the shared decoder's blocks (they norm
the input first, and the query/key norms per head), so it runs its own, op by op.

References: transformers' ``models/olmo2/modeling_olmo2.py``; mlx-lm's ``models/arch/olmo2.py``; llama.cpp's
``src/models/olmo2.cpp``; OLMo 2 report ("2 OLMo 2 Furious", 2024).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mlx_engine.batch import Batch
from mlx_engine.errors import UnsupportedError, WeightsError
from mlx_engine.ml import Context, RopeAngles, Tensor
from mlx_engine.models.layers.base import DecoderModel
from mlx_engine.models.layers.config import (DecoderConfig, check_layer_count, check_rope_scaling, hf_rope_parameters,
                                      metadata_getter, vocab_size_of)
from mlx_engine.models.layers.layer import apply_rope, rope_positions

if TYPE_CHECKING:
    from mlx_engine.kvcache import Cache


class Olmo2(DecoderModel):
    architecture = "olmo2"
    own_layers = "query and key norms over all heads"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if self.part.reduce is not None:
            raise UnsupportedError("an OLMo 2 model is not split over ranks: its query/key norms span all heads")

    @classmethod
    def config_from_gguf(cls, metadata: Any, weights: dict[str, Tensor]) -> DecoderConfig:
        get = metadata_getter(metadata, "olmo2")
        heads = get("attention.head_count", positive=True)
        hidden = get("embedding_length", positive=True)
        scaling = get("rope.scaling.type", None)
        check_rope_scaling(scaling, "olmo2")
        factor = float(get("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
        return DecoderConfig(
            architecture="olmo2", vocab_size=vocab_size_of(weights, metadata, "olmo2"), hidden_size=hidden,
            num_layers=check_layer_count(get("block_count")), num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=int(get("attention.key_length", hidden // heads)),
            intermediate_size=int(get("feed_forward_length")),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            context_length=int(get("context_length", 4096)), rope_theta=float(get("rope.freq_base", 500000.0)),
            rope_scale=1.0 / factor,
        )

    @classmethod
    def config_from_hf(cls, config: Any) -> DecoderConfig:
        heads = int(config["num_attention_heads"])
        theta, scaling = hf_rope_parameters(config)
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        check_rope_scaling(kind, "olmo2")
        return DecoderConfig(
            architecture="olmo2", vocab_size=int(config["vocab_size"]), hidden_size=int(config["hidden_size"]),
            num_layers=check_layer_count(config["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
            intermediate_size=int(config["intermediate_size"]), rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            context_length=int(config.get("max_position_embeddings", 4096)), rope_theta=theta,
            rope_scale=1.0 / float(scaling["factor"]) if kind == "linear" else 1.0,
            attention_bias=bool(config.get("attention_bias", False)),
        )

    def _check_weights(self) -> None:
        """Every tensor of OLMo 2's layout is there, with the shape the config implies.

        Raises:
            WeightsError: a missing tensor, or one whose shape disagrees with the config (both named).
        """
        c = self.config
        d, q, kv, ff = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        want: dict[str, tuple[int, ...]] = {}
        if self.part.embed:
            want["model.embed_tokens.weight"] = (c.vocab_size, d)
        if self.part.head:
            want["model.norm.weight"] = (d,)
        for i in self.part.layers:
            p = f"model.layers.{i}."
            want.update({p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                         p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
                         p + "self_attn.q_norm.weight": (q,), p + "self_attn.k_norm.weight": (kv,),
                         p + "post_attention_layernorm.weight": (d,), p + "post_feedforward_layernorm.weight": (d,),
                         p + "mlp.gate_proj.weight": (ff, d), p + "mlp.up_proj.weight": (ff, d),
                         p + "mlp.down_proj.weight": (d, ff)})
        missing = [n for n in want if n not in self.w]
        if missing:
            raise WeightsError(f"the olmo2 checkpoint lacks {len(missing)} tensors, e.g. {', '.join(missing[:3])}; "
                               "is it a complete OLMo 2 model?")
        for name, shape in {**want, "lm_head.weight": (c.vocab_size, d)}.items():
            t = self.w.get(name)
            if t is not None and tuple(t.shape) != shape:
                raise WeightsError(f"tensor {name} has shape {tuple(t.shape)} but the model config implies {shape} "
                                   f"(hidden {d}, {c.num_heads} heads of {c.head_dim}, {c.num_kv_heads} key/value "
                                   f"heads, feed-forward {ff}); the file is inconsistent")

    def run_layers(self, ctx: Context, batch: Batch, h: Tensor, cache: "Cache", output_layer: int | None = None,
                   angles: "dict[tuple, RopeAngles] | None" = None, whole: bool = False,
                   pos_tensor: Tensor | None = None) -> Tensor:
        """OLMo 2's layers on ``h [1, N, D]`` (see :meth:`DecoderModel.run_layers`; ``angles``, ``whole`` and
        ``pos_tensor`` belong to the fused paths, which this model does not take)."""
        c, eps, n = self.config, self.config.rms_norm_eps, h.shape[1]
        positions = rope_positions(ctx, batch)
        base, scale, freqs = self._rope(0)
        dims = c.rope_dims or c.head_dim

        def heads(x: Tensor, count: int) -> Tensor:
            return x.reshape(1, n, count, c.head_dim).transpose(0, 2, 1, 3)

        for i, w in self.layers.items():
            if output_layer is not None and i > output_layer:
                break
            cache.set_layer(i)
            q = heads(h.linear(w["q"]).rms_norm(w["q_norm"], eps), c.num_heads)
            k = heads(h.linear(w["k"]).rms_norm(w["k_norm"], eps), c.num_kv_heads)
            v = heads(h.linear(w["v"]), c.num_kv_heads)
            q = apply_rope(q, positions, dims, base, scale, c.rope_traditional, freqs)
            k = apply_rope(k, positions, dims, base, scale, c.rope_traditional, freqs)
            cache.put(ctx, k, v)
            keys, values, mask = cache.get(ctx)
            o = ctx.scaled_dot_product_attention(q, keys, values, c.query_scale, mask)
            o = o.transpose(0, 2, 1, 3).reshape(1, n, c.num_heads * c.head_dim).linear(w["o"])
            h = h + o.rms_norm(w["post_attn_norm"], eps)
            h = h + h.linear(w["gate"]).gated_linear(h.linear(w["up"]), c.activation, w["down"], w["post_ffn_norm"],
                                                      eps)
        return h
