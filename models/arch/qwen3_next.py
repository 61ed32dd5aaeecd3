"""Qwen3-Next: a hybrid of Gated DeltaNet linear attention and gated full attention, with mixture-of-experts MLPs.

- **Gated DeltaNet** layers (``layer_types[i] == "linear_attention"``): ``q, k, v, z`` and ``b, a`` from two
  projections (grouped per key head), a depthwise causal convolution (kernel ``linear_conv_kernel_dim``) with SiLU
  over ``[q, k, v]``, L2-normed ``q`` and ``k`` (``q`` also scaled by ``Dk^-1/2``), then per token and value head
  the gated delta rule on the state ``S [Dk, Dv]``:
  ``S = exp(g) S``, ``S += k (beta (v - k^T S))^T``, ``o = q^T S``, with ``beta = sigmoid(b)`` and
  ``g = -exp(A_log) softplus(a + dt_bias)`` (Yang et al., "Gated Delta Networks", 2024); then an RMSNorm gated by
  ``silu(z)`` and the output projection. Its states (the convolution's last ``K - 1`` inputs and ``S``) live in the
  :class:`~mlx_engine.kvcache.RecurrentCache`.
- **Full attention** layers: Qwen3's (query/key RMSNorm) with RoPE on the first quarter of each head
  (``partial_rotary_factor``) and the output gated by ``sigmoid(x W_gate)``, ``W_gate`` the second half of each
  head's rows of ``q_proj``.
- **MLP**: a mixture of experts with a gated shared expert (:mod:`mlx_engine.models.layers.moe`) on the layers
  ``decoder_sparse_step`` selects, a dense SwiGLU on ``mlp_only_layers``.
- Every RMSNorm but the gated one stores ``w`` for ``1 + w`` (zero-centred); the one is added at load.

References: transformers' ``models/qwen3_next/modeling_qwen3_next.py`` (``torch_recurrent_gated_delta_rule``,
``Qwen3NextGatedDeltaNet.fix_query_key_value_ordering``); mlx-lm's ``models/arch/qwen3_next.py`` and
``models/gated_delta.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from mlx_engine.errors import WeightsError
from mlx_engine.ml import Backend, Context, DType, Tensor
from mlx_engine.models.layers.base import DecoderModel, ModelPart
from mlx_engine.models.layers.layer import feed_forward
from mlx_engine.models.layers.moe import MoEWeights, stack_experts
from mlx_engine.models.layers.config import DecoderConfig, check_rope_scaling, hf_rope_parameters, metadata_getter, \
    vocab_size_of

if TYPE_CHECKING:
    from mlx_engine.batch import Batch
    from mlx_engine.kvcache import Cache

_ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                 "self_attn.k_norm.weight")


def _softplus(x: Tensor) -> Tensor:
    """``log(1 + exp(x))`` without overflow: ``max(x, 0) + log(1 + exp(-|x|))``."""
    return x.maximum(0.0) + ((x.minimum(-x)).exp() + 1.0).log()


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis (transformers' ``l2norm``, the FLA library's)."""
    return x / ((x * x).sum(axis=-1, keepdims=True) + eps).sqrt()


#: Prefill runs of at least this many tokens use the chunked form of the delta rule (chunks of this size).
DELTA_CHUNK = 64


def delta_rule(ctx: Context, q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, beta: Tensor,
               state: Tensor) -> tuple[Tensor, Tensor]:
    """The gated delta rule token by token (transformers' ``torch_recurrent_gated_delta_rule``): ``q, k [S, L, H,
    Dk]`` (normed, ``q`` scaled), ``v [S, L, H, Dv]``, ``log_decay, beta [S, L, H]``, ``state [S, H, Dk, Dv]``, all
    float32. Per token: ``S = exp(g) S``, ``S += k (beta (v - k^T S))^T``, ``o = q^T S``. Returns ``(o [S, L, H, Dv],
    state)``."""
    s, n, h, dk = k.shape
    dv = v.shape[-1]
    decay = log_decay.exp()
    outs = []
    for t in range(n):
        kt = k[:, t].reshape(s, h, 1, dk)
        state = state * decay[:, t].reshape(s, h, 1, 1)
        delta = (v[:, t].reshape(s, h, 1, dv) - kt @ state) * beta[:, t].reshape(s, h, 1, 1)
        state = state + kt.reshape(s, h, dk, 1) * delta
        outs.append((q[:, t].reshape(s, h, 1, dk) @ state).reshape(s, 1, h, dv))
    return (outs[0] if n == 1 else ctx.concatenate(outs, axis=1)), state


def delta_rule_chunked(ctx: Context, q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, beta: Tensor,
                       state: Tensor, chunk: int = DELTA_CHUNK) -> tuple[Tensor, Tensor]:
    """The same rule over chunks of ``chunk`` tokens (transformers' ``torch_chunk_gated_delta_rule``, the WY form of
    Yang et al. 2024): within a chunk the updates are one unit-lower-triangular solve, here by the product
    ``(I - L)^-1 = prod_k (I + L^(2^k))`` (``L`` strictly lower, so nilpotent: ``log2(chunk)`` factors), and only the
    chunks run one after another. Same arguments and result as :func:`delta_rule`."""
    s, n, h, dk = k.shape
    pad = -n % chunk
    c = chunk

    def padded(x: Tensor) -> Tensor:  # [S, L, H, ...] -> [S, H, chunks, C, ...], zeros after the end
        if pad:
            x = ctx.concatenate([x, ctx.zeros([s, pad, *x.shape[2:]], x.dtype)], axis=1)
        x = x.transpose(0, 2, 1, *range(3, x.ndim))
        return x.reshape(s, h, (n + pad) // c, c, *x.shape[3:])

    q, k, v, g, b = (padded(x) for x in (q, k, v, log_decay, beta))
    cum = g.cumsum(axis=-1)                                             # [S, H, N, C]
    lower = ctx.from_numpy(np.tril(np.ones((c, c), bool)))
    pair = (cum.reshape(*cum.shape, 1) - cum.reshape(*cum.shape[:-1], 1, c))
    pair = lower.where(pair, float("-inf")).exp()                       # exp(cum_i - cum_j) for j <= i, else 0
    k_t = k.transpose(0, 1, 2, 4, 3)
    k_beta = k * b.reshape(*b.shape, 1)
    strict = ctx.from_numpy(np.tril(np.ones((c, c), np.float32), -1))
    neg_l = (k_beta @ k_t) * pair * strict                              # the strictly lower part
    eye = ctx.from_numpy(np.eye(c, dtype=np.float32))
    power, inverse = -neg_l, eye - neg_l
    for _ in range(int(np.log2(c)) - 1):
        power = power @ power
        inverse = inverse @ (eye + power)
    new_values = inverse @ (v * b.reshape(*b.shape, 1))
    k_cumdecay = inverse @ (k_beta * cum.exp().reshape(*cum.shape, 1))
    intra = (q @ k_t) * pair
    last = cum[..., c - 1:c]                                            # [S, H, N, 1]
    q_decayed = q * cum.exp().reshape(*cum.shape, 1)
    k_decayed = (k * (last - cum).exp().reshape(*cum.shape, 1)).transpose(0, 1, 2, 4, 3)
    chunk_decay = last.exp().reshape(s, h, -1, 1, 1)
    outs = []
    for i in range((n + pad) // c):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        outs.append(q_decayed[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k_decayed[:, :, i] @ v_new
    o = (outs[0] if len(outs) == 1 else ctx.concatenate(outs, axis=2))[:, :, :n]  # [S, H, L, Dv]
    return o.transpose(0, 2, 1, 3), state


class Qwen3Next(MoEWeights, DecoderModel):
    architecture = "qwen3_next"
    #: llama.cpp's name of the architecture (the prefix of its GGUF keys).
    gguf_arch = "qwen3next"
    #: llama.cpp's converter writes this architecture's value heads in tiled order (``DecoderConfig.linear_tiled``).
    gguf_tiled_values = False

    def __init__(self, config: DecoderConfig, weights: dict[str, Tensor], backend: Backend,
                 part: ModelPart | None = None):
        super().__init__(config, stack_experts(weights, config.num_experts, config.num_layers, backend.new_context()),
                         backend, part)

    @classmethod
    def config_from_gguf(cls, metadata: Any, weights: dict[str, Tensor]) -> DecoderConfig:
        """From llama.cpp's ``<gguf_arch>.*`` keys: the linear layers from ``ssm.*`` (``group_count`` key heads,
        ``time_step_rank`` value heads, ``state_size`` key head size, ``inner_size`` all value features), the layer
        kinds from ``attention.recurrent_layers`` or else every ``full_attention_interval``-th layer a full-attention
        one, RoPE on ``rope.dimension_count`` features. The ``nextn_predict_layers`` multi-token-prediction blocks
        the converter appends after the decoder's layers are not run (nor loaded: :meth:`sanitize`)."""
        get = metadata_getter(metadata, cls.gguf_arch)
        heads = get("attention.head_count", positive=True)
        hidden = get("embedding_length", positive=True)
        layers = int(get("block_count", positive=True)) - int(get("nextn_predict_layers", 0))
        head_dim = int(get("attention.key_length", hidden // heads))
        recurrent = get("attention.recurrent_layers", None)
        if recurrent is None:
            interval = get("full_attention_interval", 4, positive=True)
            recurrent = [(i + 1) % interval != 0 for i in range(layers)]
        recurrent = [bool(r) for r in recurrent]
        if len(recurrent) < layers or any(recurrent[layers:]):
            raise WeightsError(f"GGUF metadata key '{cls.gguf_arch}.attention.recurrent_layers' has {len(recurrent)} "
                               f"entries for {layers} layers (and {int(get('nextn_predict_layers', 0))} "
                               "multi-token-prediction blocks, which are not recurrent)")
        hv = get("ssm.time_step_rank", positive=True)
        return DecoderConfig(
            architecture=cls.architecture, vocab_size=vocab_size_of(weights, metadata, cls.gguf_arch),
            hidden_size=hidden, num_layers=layers, num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)), head_dim=head_dim,
            intermediate_size=int(get("feed_forward_length", 0) or 1),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            context_length=int(get("context_length", 32768)), rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_dims=int(get("rope.dimension_count", head_dim // 4)),
            layer_types=["linear_attention" if r else "full_attention" for r in recurrent[:layers]],
            qk_norm=True, attention_gate=True, conv_kernel=int(get("ssm.conv_kernel", 4)),
            linear_heads=(int(get("ssm.group_count", positive=True)), int(hv), int(get("ssm.state_size", positive=True)),
                          int(get("ssm.inner_size", positive=True)) // int(hv)),
            linear_tiled=cls.gguf_tiled_values,
            num_experts=int(get("expert_count", 0)), experts_per_token=int(get("expert_used_count", 0)),
            moe_intermediate_size=int(get("expert_feed_forward_length", 0)),
            shared_expert_size=int(get("expert_shared_feed_forward_length", 0)),
            norm_topk_prob=bool(get("expert_weights_norm", True)),
        )

    @classmethod
    def config_from_hf(cls, config: Any) -> DecoderConfig:
        """From ``config.json`` (a multimodal checkpoint's ``text_config``)."""
        config = config.get("text_config") or config
        heads = int(config["num_attention_heads"])
        layers = int(config["num_hidden_layers"])
        theta, scaling = hf_rope_parameters(config)
        check_rope_scaling((scaling or {}).get("rope_type", (scaling or {}).get("type")), cls.architecture)
        _check_sparse_step(config)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        params = config.get("rope_parameters") or {}
        partial = float(config.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)))
        types = config.get("layer_types") or [
            "full_attention" if (i + 1) % int(config.get("full_attention_interval", 4)) == 0 else "linear_attention"
            for i in range(layers)]
        return DecoderConfig(
            architecture=cls.architecture, vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]), num_layers=layers, num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads), head_dim=head_dim,
            # a Qwen3.5 MoE config has no dense MLP width (every layer routes)
            intermediate_size=int(config.get("intermediate_size") or config["moe_intermediate_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            context_length=int(config.get("max_position_embeddings", 32768)), rope_theta=theta,
            rope_dims=int(head_dim * partial), layer_types=list(types), qk_norm=True, attention_gate=True,
            conv_kernel=int(config.get("linear_conv_kernel_dim", 4)),
            linear_heads=(int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"]),
                          int(config["linear_key_head_dim"]), int(config["linear_value_head_dim"])),
            num_experts=int(config.get("num_experts", 0)), experts_per_token=int(config.get("num_experts_per_tok", 0)),
            moe_intermediate_size=int(config.get("moe_intermediate_size", 0)),
            shared_expert_size=int(config.get("shared_expert_intermediate_size", 0)),
            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
            attention_bias=bool(config.get("attention_bias", False)),
        )

    @classmethod
    def sanitize(cls, weights: dict[str, Tensor], config: DecoderConfig, source: str) -> dict[str, Tensor]:
        """Both sources to one layout: norms as plain RMSNorm weights (Hugging Face stores ``w`` for ``1 + w``;
        llama.cpp's converter already added the one); each head's ``q_proj`` rows split into the query and the
        output gate; the linear layers' input projection as ``in_proj_q/k/v`` (all heads of each, the order the
        convolution reads them) and ``in_proj_z``; Qwen3-Next's ``in_proj_ba`` (grouped per key head) as Qwen3.5's
        ``in_proj_b`` and ``in_proj_a`` (one row per value head); ``A = -exp(A_log)``; the convolution weight
        ``[C, K]``. A multimodal folder's text model (``model.language_model.*``) is read, its vision tower and the
        multi-token-prediction block (``mtp.*``, a GGUF's blocks past ``num_layers``) are not loaded. A folder that
        mlx-lm wrote (``mlx_lm.convert``, mlx-community's: its experts stacked as ``mlp.switch_mlp``) already holds
        ``1 + w`` in its norms and the convolution as ``[C, K, 1]``."""
        if source == "gguf":
            weights = _from_gguf_names(weights, config.num_layers)
        else:
            weights = {name.replace("model.language_model.", "model."): t for name, t in weights.items()
                       if not name.startswith(("mtp.", "model.visual.", "model.mtp."))}
        if source == "hf" and any(".mlp.switch_mlp." in name for name in weights):
            source = "mlx-lm"
            weights = {name.replace(".mlp.switch_mlp.", ".mlp.experts.").removesuffix(".weight")
                       if ".mlp.switch_mlp." in name else name: t for name, t in weights.items()}
        out = {}
        h, dh = config.num_heads, config.head_dim
        hk, hv, dk, dv = config.linear_heads or (1, 1, 1, 1)
        r = hv // hk
        for name, t in weights.items():
            if source == "hf" and (name == "model.norm.weight" or name.endswith(_ZERO_CENTRED)):
                t = t.dequantize() + 1.0
            elif name.endswith("self_attn.q_proj.weight"):  # per head: dh query rows, then dh gate rows
                out[name.replace("q_proj", "gate_proj")] = t.rows(_per_group(h, 2 * dh, dh, dh))
                t = t.rows(_per_group(h, 2 * dh, 0, dh))
            elif name.endswith("linear_attn.in_proj_qkvz.weight"):  # grouped per key head: [q, k, v, z] each
                g, p = 2 * dk + 2 * r * dv, name.replace("in_proj_qkvz.weight", "")
                out.update({p + "in_proj_q.weight": t.rows(_per_group(hk, g, 0, dk)),
                            p + "in_proj_k.weight": t.rows(_per_group(hk, g, dk, dk)),
                            p + "in_proj_v.weight": t.rows(_per_group(hk, g, 2 * dk, r * dv)),
                            p + "in_proj_z.weight": t.rows(_per_group(hk, g, 2 * dk + r * dv, r * dv))})
                continue
            elif name.endswith("linear_attn.in_proj_qkv.weight"):  # llama.cpp: all q rows, all k rows, all v rows
                p, n = name.replace("in_proj_qkv.weight", ""), t.shape[0]
                out.update({p + "in_proj_q.weight": t.rows(list(range(hk * dk))),
                            p + "in_proj_k.weight": t.rows(list(range(hk * dk, 2 * hk * dk))),
                            p + "in_proj_v.weight": t.rows(list(range(2 * hk * dk, n)))})
                continue
            elif name.endswith("linear_attn.in_proj_ba.weight"):  # grouped per key head: [b, a] each
                p = name.replace("in_proj_ba.weight", "")
                out.update({p + "in_proj_b.weight": t.rows(_per_group(hk, 2 * r, 0, r)),
                            p + "in_proj_a.weight": t.rows(_per_group(hk, 2 * r, r, r))})
                continue
            elif name.endswith("linear_attn.A_log"):
                name, t = name.replace("A_log", "A"), -(t.astype(DType.FLOAT32).exp())
            elif name.endswith("linear_attn.conv1d.weight") and t.ndim == 3:  # [C, 1, K], or mlx-lm's [C, K, 1]
                t = t.reshape(t.shape[0], t.shape[1] * t.shape[2])
            out[name] = t
        return out

    # ---- weights ---------------------------------------------------------------------------------------------
    def mixer_shapes(self, layer: int) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        if self.config.layer_types[layer] != "linear_attention":
            return super().mixer_shapes(layer)
        c, p = self.config, f"model.layers.{layer}.linear_attn."
        hk, hv, dk, dv = c.linear_heads
        d, kd, vd = c.hidden_size, hk * dk, hv * dv
        req = {p + "in_proj_q.weight": (kd, d), p + "in_proj_k.weight": (kd, d), p + "in_proj_v.weight": (vd, d),
               p + "in_proj_z.weight": (vd, d), p + "in_proj_b.weight": (hv, d), p + "in_proj_a.weight": (hv, d),
               p + "conv1d.weight": (2 * kd + vd, c.conv_kernel), p + "A": (hv,), p + "dt_bias": (hv,),
               p + "norm.weight": (dv,), p + "out_proj.weight": (d, vd)}
        return req, {}

    def _layer_weights(self, i: int) -> dict[str, Tensor | None]:
        w = super()._layer_weights(i)
        p = f"model.layers.{i}."
        if self.is_attention(i):
            w["attn_gate"] = self.w.get(p + "self_attn.gate_proj.weight")
            w["attn_gate_norm"] = w["attn_norm"]
        else:
            q = p + "linear_attn."
            w.update({f"lin_{k}": self.w[q + f"in_proj_{k}.weight"] for k in ("q", "k", "v", "z")})
            w.update({"lin_beta": self.w[q + "in_proj_b.weight"], "lin_alpha": self.w[q + "in_proj_a.weight"]})
            w.update({"lin_norm": self.w[q + "norm.weight"], "lin_out": self.w[q + "out_proj.weight"],
                      "lin_a": self.w[q + "A"].astype(DType.FLOAT32),  # g = A * softplus(a + dt_bias)
                      "lin_dt_bias": self.w[q + "dt_bias"].astype(DType.FLOAT32)})
            taps = self.w[q + "conv1d.weight"].dequantize().astype(self.dtype).transpose(1, 0)
            w.update({f"conv_tap{k}": taps[k] for k in range(self.config.conv_kernel)})
        return w

    # ---- cache -----------------------------------------------------------------------------------------------
    def make_cache(self, kv_bits: int | None = None) -> "Cache":
        from mlx_engine.kvcache import RecurrentCache

        return RecurrentCache(shift_fn=self.shift, kv_bits=kv_bits, **self.cache_options)

    def state_bytes(self) -> int:
        from mlx_engine.kvcache.recurrent import CHECKPOINT_COUNT

        c = self.config
        hk, hv, dk, dv = c.linear_heads
        per_layer = ((c.conv_kernel - 1) * (2 * hk * dk + hv * dv) + hv * dk * dv) * 4  # float32 states
        layers = sum(t == "linear_attention" for t in c.layer_types)
        return layers * per_layer * (2 + self.cache_options.get("checkpoint_count", CHECKPOINT_COUNT))

    # ---- Gated DeltaNet --------------------------------------------------------------------------------------
    def mixer_layer(self, ctx: Context, layer: int, w: dict[str, Tensor | None], h: Tensor, cache: "Cache",
                    batch: "Batch") -> Tensor:
        c = self.config
        hk, hv, dk, dv = c.linear_heads
        r, kd, vd = hv // hk, hk * dk, hv * dv
        s, n = cache.layout
        x = h.rms_norm(w["attn_norm"], c.rms_norm_eps)
        z = x.linear(w["lin_z"]).reshape(s, n, hv, dv)
        mixed = ctx.concatenate([x.linear(w[f"lin_{k}"]).reshape(s, n, -1) for k in ("q", "k", "v")], axis=-1)
        k_conv = c.conv_kernel
        state = cache.get_state(ctx, layer, "conv", (k_conv - 1, 2 * kd + vd))
        full = ctx.concatenate([state.astype(mixed.dtype), mixed], axis=1)  # [S, K - 1 + L, C]
        conv = full[:, 0:n] * w["conv_tap0"]
        for j in range(1, k_conv):
            conv = conv + full[:, j:j + n] * w[f"conv_tap{j}"]
        cache.set_state(ctx, layer, "conv", full[:, n:])
        conv = conv.silu().astype(DType.FLOAT32)
        q = _l2norm(conv[..., :kd].reshape(s, n, hk, 1, dk)) * (dk ** -0.5)
        k = _l2norm(conv[..., kd:2 * kd].reshape(s, n, hk, 1, dk))
        if r > 1 and c.linear_tiled:  # value head j reads key head j % hk
            q = ctx.concatenate([q.reshape(s, n, 1, hk, dk)] * r, axis=2)
            k = ctx.concatenate([k.reshape(s, n, 1, hk, dk)] * r, axis=2)
        elif r > 1:  # value head j reads key head j // r
            q = ctx.concatenate([q] * r, axis=3)
            k = ctx.concatenate([k] * r, axis=3)
        q, k = q.reshape(s, n, hv, dk), k.reshape(s, n, hv, dk)
        v = conv[..., 2 * kd:].reshape(s, n, hv, dv)
        beta = x.linear(w["lin_beta"]).reshape(s, n, hv).astype(DType.FLOAT32).sigmoid()
        alpha = x.linear(w["lin_alpha"]).reshape(s, n, hv).astype(DType.FLOAT32)
        log_decay = _softplus(alpha + w["lin_dt_bias"]) * w["lin_a"]
        rec = cache.get_state(ctx, layer, "recurrent", (hv, dk, dv))
        rule = delta_rule_chunked if n >= DELTA_CHUNK else delta_rule
        o, rec = rule(ctx, q, k, v, log_decay, beta, rec)
        cache.set_state(ctx, layer, "recurrent", rec)
        o = o.rms_norm(w["lin_norm"], c.rms_norm_eps) * z.astype(DType.FLOAT32).silu()
        y = o.astype(h.dtype).reshape(1, s * n, vd).linear(w["lin_out"])
        return feed_forward(c, h, y, w)


def _per_group(groups: int, size: int, start: int, count: int) -> list[int]:
    """Rows ``start .. start + count - 1`` of each of ``groups`` consecutive groups of ``size`` rows (a fused
    projection's part, per head), in order."""
    return [g * size + start + i for g in range(groups) for i in range(count)]


def _check_sparse_step(config: Any) -> None:
    """Qwen3-Next checkpoints put an MoE MLP on every ``decoder_sparse_step``-th layer not in ``mlp_only_layers``;
    the tensors say which (``mlp.gate.weight``), so only a step that is not a positive integer is refused here."""
    step = config.get("decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise WeightsError(f"model config has decoder_sparse_step = {step!r}; it must be a positive integer")


_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z", "ssm_ba": "linear_attn.in_proj_ba", "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a", "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj", "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def _from_gguf_names(weights: dict[str, Tensor], layers: int) -> dict[str, Tensor]:
    """llama.cpp's ``qwen3next`` / ``qwen35`` / ``qwen35moe`` tensor names (``convert_hf_to_gguf.py``'s
    ``Qwen3NextModel``, ``Qwen3_5TextModel``) to Hugging Face ones: ``ssm_a`` is already ``A = -exp(A_log)``,
    ``ssm_dt.bias`` is ``dt_bias``, the experts come stacked. Blocks from ``layers`` on (the multi-token-prediction
    head the converter appends) are left out."""
    out = {}
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    for name, t in weights.items():
        if name in top:
            out[top[name]] = t
            continue
        parts = name.split(".")
        if parts[0] != "blk" or len(parts) < 3:
            out[name] = t
            continue
        p, base, kind = f"model.layers.{parts[1]}.", parts[2], ".".join(parts[3:])
        if parts[1].isdigit() and int(parts[1]) >= layers:
            continue
        if base == "ssm_a":
            out[p + "linear_attn.A"] = t
        elif base == "ssm_dt":
            out[p + "linear_attn.dt_bias"] = t
        elif base in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            out[p + "mlp.experts." + {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                                      "ffn_down_exps": "down_proj"}[base]] = t
        elif base in _GGUF_LAYER_NAMES:
            if base == "ffn_gate_inp_shexp" and t.ndim == 1:  # the converter writes the [1, D] row as [D]
                t = t.reshape(1, t.shape[0])
            out[p + _GGUF_LAYER_NAMES[base] + "." + kind] = t
        else:
            out[name] = t
    return out

