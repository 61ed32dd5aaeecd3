"""gpt-oss (openai/gpt-oss-20b and -120b; GGUF architecture ``gpt-oss``, llama.cpp's ``LLM_ARCH_OPENAI_MOE``).

- Attention: grouped-query, biases on the query, key, value and output projections, learned per-head sinks (one more
  logit per head in the softmax, its probability dropped), sliding-window (128 keys) and full layers alternating
  (the first slides), RoPE on rotated halves with YaRN scaling (its attention factor folded into the query scale).
- MLP: a router with a bias whose top-k logits are softmaxed (the same as renormalised top-k probabilities), experts
  with biases and the clamped SwiGLU ``(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate,
  limit)`` (:func:`mlx_engine.models.layers.moe.moe_mlp`).
- RMSNorm before attention and before the MLP; an untied output head.

Checkpoints: a Hugging Face folder holds the experts as ``gate_up_proj [E, D, 2I]`` (gate and up interleaved by
column) and ``down_proj [E, I, D]``; llama.cpp's converter splits and transposes them into ``ffn_gate_exps`` /
``ffn_up_exps [E, I, D]`` and ``ffn_down_exps [E, D, I]``, MXFP4 in the released GGUF files (read by
:mod:`mlx_engine.weights.quant`). YaRN: llama.cpp rounds the correction range to whole dimensions (``ggml_rope_yarn_
corr_dims``), so a GGUF file runs so; a folder follows its ``rope_parameters.truncate`` as transformers does.

References: transformers' ``models/gpt_oss/modeling_gpt_oss.py``; llama.cpp's ``src/models/openai-moe.cpp`` and
``conversion/gpt_oss.py``; mlx-lm's ``models/arch/gpt_oss.py``.
"""

from __future__ import annotations

import re
from typing import Any

from mlx_engine.errors import UnsupportedError, WeightsError
from mlx_engine.ml import DType, Tensor
from mlx_engine.models.layers.base import DecoderModel, hf_names_from_gguf
from mlx_engine.models.layers.config import (DecoderConfig, check_layer_count, hf_rope_parameters, metadata_getter,
                                      vocab_size_of, yarn_rope)
from mlx_engine.models.layers.moe import MoEWeights, moe_names_from_gguf


def _layer_types(n: int) -> list[str]:
    """llama.cpp's ``set_swa_pattern(2)`` and transformers' default: even layers slide, odd ones see everything."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(check_layer_count(n))]


def _rope(theta: float, head_dim: int, scaling: dict | None, truncate_default: bool,
          context: int) -> tuple[Any, float]:
    """``(periods or None, attention factor)`` of the RoPE a config's ``rope_scaling`` describes (YaRN or none).

    Raises:
        UnsupportedError: a RoPE scaling other than YaRN.
    """
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind in (None, "default", "none"):
        return None, 1.0
    if kind != "yarn":
        raise UnsupportedError(f"gpt_oss: RoPE scaling {kind!r} is not supported (yarn is)")
    freqs, attn = yarn_rope(theta, head_dim, float(scaling["factor"]),
                            int(scaling.get("original_max_position_embeddings") or context),
                            float(scaling.get("beta_fast") or 32.0), float(scaling.get("beta_slow") or 1.0),
                            truncate=bool(scaling.get("truncate", truncate_default)))
    return freqs, float(scaling.get("attention_factor") or attn)


class GptOss(MoEWeights, DecoderModel):
    architecture = "gpt_oss"
    # OpenAI ships and runs gpt-oss in bfloat16 (its experts in MXFP4).
    half_dtype = DType.BFLOAT16

    @classmethod
    def config_from_gguf(cls, metadata: Any, weights: dict[str, Tensor]) -> DecoderConfig:
        """From llama.cpp's ``gpt-oss.*`` keys (``expert_count``, ``expert_used_count``,
        ``expert_feed_forward_length``, ``attention.sliding_window``, ``rope.scaling.*``)."""
        get = metadata_getter(metadata, "gpt-oss")
        heads = get("attention.head_count", positive=True)
        hidden = get("embedding_length", positive=True)
        head_dim = int(get("attention.key_length", hidden // heads))
        layers = check_layer_count(get("block_count"))
        theta = float(get("rope.freq_base", 150000.0))
        context = int(get("context_length", 131072))
        scaling = None
        if get("rope.scaling.type", None) not in (None, "none"):
            scaling = {"rope_type": get("rope.scaling.type"), "factor": get("rope.scaling.factor"),
                       "original_max_position_embeddings": get("rope.scaling.original_context_length", context),
                       "beta_fast": get("rope.scaling.yarn_beta_fast", 32.0),
                       "beta_slow": get("rope.scaling.yarn_beta_slow", 1.0),
                       "attention_factor": get("rope.scaling.yarn_attn_factor", None)}
        freqs, attn = _rope(theta, head_dim, scaling, True, context)
        pattern = get("attention.sliding_window_pattern", None)
        types = ([("sliding_attention" if bool(p) else "full_attention") for p in pattern]
                 if pattern is not None and not isinstance(pattern, int) else _layer_types(layers))
        experts = int(get("expert_count", positive=True))
        width = int(get("expert_feed_forward_length", positive=True))
        return DecoderConfig(
            architecture="gpt_oss", vocab_size=vocab_size_of(weights, metadata, "gpt-oss"), hidden_size=hidden,
            num_layers=layers, num_heads=heads, num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=head_dim, intermediate_size=width, rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            context_length=context, rope_theta=theta, rope_freqs=freqs, query_scale=head_dim ** -0.5 * attn ** 2,
            # Hugging Face's sliding_window counts the token itself; the cache's window does not.
            sliding_window=int(get("attention.sliding_window", positive=True)) - 1, layer_types=types,
            attention_bias=True, num_experts=experts, experts_per_token=int(get("expert_used_count", positive=True)),
            moe_intermediate_size=width, norm_topk_prob=True,
            # llama.cpp's graph (LLM_FFN_SWIGLU_OAI_MOE) fixes alpha and limit; GGUF holds neither
            clamped_swiglu=(1.702, 7.0),
        )

    @classmethod
    def config_from_hf(cls, config: Any) -> DecoderConfig:
        """From ``config.json`` (transformers' ``GptOssConfig``).

        Raises:
            UnsupportedError: a RoPE scaling other than YaRN.
        """
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        layers = check_layer_count(config["num_hidden_layers"])
        theta, scaling = hf_rope_parameters(config)
        context = int(config.get("max_position_embeddings", 131072))
        freqs, attn = _rope(theta, head_dim, scaling, True, context)
        width = int(config["intermediate_size"])
        window = config.get("sliding_window")
        return DecoderConfig(
            architecture="gpt_oss", vocab_size=int(config["vocab_size"]), hidden_size=hidden, num_layers=layers,
            num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads") or heads), head_dim=head_dim,
            intermediate_size=width, rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)), context_length=context,
            rope_theta=theta, rope_freqs=freqs, query_scale=head_dim ** -0.5 * attn ** 2,
            sliding_window=None if window is None else int(window) - 1,
            layer_types=list(config.get("layer_types") or _layer_types(layers)),
            attention_bias=bool(config.get("attention_bias", True)),
            num_experts=int(config.get("num_local_experts") or config["num_experts"]),
            experts_per_token=int(config["num_experts_per_tok"]), moe_intermediate_size=width, norm_topk_prob=True,
            clamped_swiglu=(float(config.get("swiglu_alpha", 1.702)), float(config.get("swiglu_limit", 7.0))),
        )

    @classmethod
    def sanitize(cls, weights: dict[str, Tensor], config: DecoderConfig, source: str) -> dict[str, Tensor]:
        """Names and layouts to those :class:`MoEWeights` reads: the router as ``mlp.gate``, the experts split and
        transposed to ``mlp.experts.{gate,up,down}_proj`` (``[E, I, D]``, ``[E, I, D]``, ``[E, D, I]``) with biases
        ``mlp.experts.{gate,up,down}_bias``, the sinks as ``self_attn.sinks``.

        Raises:
            UnsupportedError: a folder with the hub's MXFP4 expert blocks (``*_blocks`` / ``*_scales``).
        """
        if source == "gguf":
            out = {}
            for name, t in moe_names_from_gguf(weights).items():
                m = re.fullmatch(r"blk\.(\d+)\.(attn_sinks\.weight|ffn_gate_inp\.bias|ffn_(gate|up|down)_exps\.bias)",
                                 name)
                if m:
                    p = f"model.layers.{m.group(1)}."
                    name = (p + "self_attn.sinks" if m.group(2).startswith("attn_sinks")
                            else p + "mlp.gate.bias" if m.group(3) is None else f"{p}mlp.experts.{m.group(3)}_bias")
                out[name] = t
            return hf_names_from_gguf(out, "post_attention_layernorm")
        out = {}
        for name, t in weights.items():
            if name.endswith(("_blocks", "_scales")):
                raise UnsupportedError(f"tensor {name}: this gpt-oss folder holds the hub's MXFP4 expert blocks, "
                                       "which are not read yet; use its GGUF file (llama.cpp's converter)")
            p, _, leaf = name.rpartition("mlp.")
            if leaf == "router.weight" or leaf == "router.bias":
                out[p + "mlp.gate." + leaf.split(".")[1]] = t
            elif leaf == "experts.gate_up_proj":  # [E, D, 2I], gate and up interleaved by column
                out[p + "mlp.experts.gate_proj"] = t[:, :, 0::2].transpose(0, 2, 1)
                out[p + "mlp.experts.up_proj"] = t[:, :, 1::2].transpose(0, 2, 1)
            elif leaf == "experts.gate_up_proj_bias":
                out[p + "mlp.experts.gate_bias"], out[p + "mlp.experts.up_bias"] = t[:, 0::2], t[:, 1::2]
            elif leaf == "experts.down_proj":  # [E, I, D]
                out[p + "mlp.experts.down_proj"] = t.transpose(0, 2, 1)
            elif leaf == "experts.down_proj_bias":
                out[p + "mlp.experts.down_bias"] = t
            else:
                out[name] = t
        return out

    def mlp_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        """:meth:`MoEWeights.mlp_shapes` plus the router's and the experts' biases.

        Raises:
            WeightsError: a layer without a router (every gpt-oss layer has one).
        """
        if not self.is_moe(layer):
            raise WeightsError(f"the gpt_oss checkpoint's layer {layer} has no router (model.layers.{layer}.mlp."
                               "router); is it a complete gpt-oss model?")
        c, p = self.config, f"model.layers.{layer}.mlp."
        e, d, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
        return {**super().mlp_shapes(layer), p + "gate.bias": (e,), p + "experts.gate_bias": (e, i),
                p + "experts.up_bias": (e, i), p + "experts.down_bias": (e, d)}
