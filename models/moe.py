"""Mixture-of-experts MLPs (Qwen2-MoE, Qwen3-MoE, Qwen3-Next): a softmax router picks ``k`` experts per token, their SwiGLU
outputs are summed with the router's probabilities, plus an optional shared expert behind a sigmoid gate.

Reference: transformers' ``Qwen3NextSparseMoeBlock`` (``Qwen3NextTopKRouter``, ``Qwen3NextExperts``); mlx-lm's
``SwitchGLU`` for the gathered products.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlx_engine.ml import Context, DType, Tensor

if TYPE_CHECKING:
    from mlx_engine.models.config import DecoderConfig


def moe_mlp(x: Tensor, w: dict[str, Tensor | None], top_k: int, norm_topk: bool,
            clamped_swiglu: "tuple[float, float] | None" = None) -> Tensor:
    """The MoE MLP on normed hidden states ``x [1, N, D]``; returns ``[1, N, D]`` (no residual).

    ``w``: ``router [E, D]``, ``experts_gate`` / ``experts_up [E, I, D]``, ``experts_down [E, D, I]``, and
    optionally ``shared_gate`` / ``shared_up [S, D]``, ``shared_down [D, S]``, ``shared_expert_gate [1, D]``,
    ``router_bias [E]``, ``experts_gate_bias`` / ``experts_up_bias [E, I]``, ``experts_down_bias [E, D]``
    (gpt-oss). The router's softmax runs in float32; ``norm_topk`` renormalises the ``top_k`` kept probabilities to
    sum to 1 (gpt-oss's softmax over the top-k logits is the same). ``clamped_swiglu``: as :func:`experts_mlp`'s.
    """
    n, d = x.shape[1], x.shape[2]
    x2 = x.reshape(n, d)
    probs = x2.linear(w["router"], w.get("router_bias")).astype(DType.FLOAT32).softmax(-1)  # [N, E]
    experts = probs.shape[-1]
    idx = (-probs).argpartition(top_k - 1, axis=-1)[:, :top_k] if top_k < experts else \
        (-probs).argsort(axis=-1)  # [N, k]
    top = probs.take_along_axis(idx, axis=-1)
    if norm_topk:
        top = top / top.sum(axis=-1, keepdims=True)
    return experts_mlp(x2, idx, top, w, clamped_swiglu).reshape(1, n, d)


def experts_mlp(x2: Tensor, idx: Tensor, top: Tensor, w: dict[str, Tensor | None],
                clamped_swiglu: "tuple[float, float] | None" = None) -> Tensor:
    """The routed experts' outputs on ``x2 [N, D]``: each token's experts ``idx [N, k]`` (INT32) by the gathered
    products (with the experts' biases where ``w`` has them), weighed by ``top [N, k]`` and summed, plus the shared
    expert where ``w`` has one (behind its sigmoid gate where it has one); returns ``[N, D]``. ``w``: as
    :func:`moe_mlp`'s. ``clamped_swiglu`` ``(alpha, limit)``: the activation is gpt-oss's
    (:attr:`DecoderConfig.clamped_swiglu`), else SiLU-gated (SwiGLU)."""
    n, d = x2.shape
    top_k = idx.shape[-1]
    gate, up = x2.gather_linear(w["experts_gate"], idx), x2.gather_linear(w["experts_up"], idx)  # [N, k, I]
    if w.get("experts_gate_bias") is not None:
        gate, up = gate + w["experts_gate_bias"].take(idx, axis=0), up + w["experts_up_bias"].take(idx, axis=0)
    if clamped_swiglu is None:
        hidden = gate.silu() * up
    else:
        alpha, limit = clamped_swiglu
        gate, up = gate.minimum(limit), up.minimum(limit).maximum(-limit)
        hidden = (up + 1.0) * (gate * (gate * alpha).sigmoid())
    inner = hidden.shape[-1]
    flat = idx.reshape(n * top_k, 1)
    out = hidden.reshape(n * top_k, inner).gather_linear(w["experts_down"], flat).reshape(n, top_k, d)
    if w.get("experts_down_bias") is not None:
        out = out + w["experts_down_bias"].take(idx, axis=0)
    y = (out * top.astype(out.dtype).reshape(n, top_k, 1)).sum(axis=1)  # [N, D]
    if w.get("shared_gate") is not None:
        shared = (x2.linear(w["shared_gate"]).silu() * x2.linear(w["shared_up"])).linear(w["shared_down"])
        if w.get("shared_expert_gate") is not None:
            shared = shared * x2.linear(w["shared_expert_gate"]).sigmoid()
        y = y + shared
    return y


# llama.cpp's MoE tensor names (blk.N.<base>.weight) to the Hugging Face layout we run: router and shared expert as
# in the hub's files, the routed experts stacked ``[experts, out, in]`` under one name per projection.
_GGUF_MOE_NAMES = {
    "ffn_gate_inp": "mlp.gate.weight", "ffn_gate_inp_shexp": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj.weight", "ffn_up_shexp": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp": "mlp.shared_expert.down_proj.weight", "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj",
}


def moe_names_from_gguf(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename llama.cpp's MoE tensors (``blk.N.ffn_gate_exps.weight`` ...) to the names :class:`MoEWeights`
    reads; every other name is left as it is."""
    out = {}
    for name, t in weights.items():
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _GGUF_MOE_NAMES:
            name = f"model.layers.{parts[1]}.{_GGUF_MOE_NAMES[parts[2]]}"
            if parts[2] == "ffn_gate_inp_shexp" and t.ndim == 1:  # llama-quantize writes the [1, D] row as [D]
                t = t.reshape(1, t.shape[0])
        out[name] = t
    return out


def stack_experts(weights: dict[str, Tensor], num_experts: int, num_layers: int, ctx: Context) -> dict[str, Tensor]:
    """Per-expert tensors (``mlp.experts.E.gate_proj.weight``, the hub's layout) stacked into one ``[experts, out,
    in]`` tensor per projection (``mlp.experts.gate_proj``), for the gathered products; each expert's tensor is let
    go as it is stacked. A folder of mlx-lm's (``mlp.switch_mlp.*``, already stacked, possibly quantized) is renamed
    to the same names, its quantization kept; transformers 5's fused ``mlp.experts.gate_up_proj [experts, 2 I, in]``
    (Qwen3.5-MoE's own layout) is split into the gate (its first ``I`` rows) and up projections."""
    out = {}
    for name, t in weights.items():
        if ".mlp.switch_mlp." in name and name.endswith(".weight"):
            name = name.replace(".mlp.switch_mlp.", ".mlp.experts.").removesuffix(".weight")
        if name.endswith(".mlp.experts.gate_up_proj") and t.ndim == 3:
            t, half, p = t.dequantize(), t.shape[1] // 2, name.removesuffix("gate_up_proj")
            out[p + "gate_proj"], out[p + "up_proj"] = t[:, :half], t[:, half:]
            continue
        out[name] = t
    if not num_experts:
        return out
    for layer in range(num_layers):
        p = f"model.layers.{layer}.mlp.experts."
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names = [f"{p}{j}.{proj}.weight" for j in range(num_experts)]
            if not all(n in out for n in names):
                continue
            out[p + proj] = ctx.stack([out.pop(n).dequantize() for n in names], axis=0)
    return out


class MoEWeights:
    """The mixture-of-experts MLP's weights of a :class:`~mlx_engine.models.base.DecoderModel` (mixed in before it):
    a layer holding a router (``mlp.gate.weight``) is an MoE layer; its expected shapes and the names the layer
    maths reads (:func:`moe_mlp`). Any other layer keeps the dense MLP (``mlp_only_layers``, ``decoder_sparse_step``
    of the Qwen MoE configs)."""

    config: "DecoderConfig"
    w: dict[str, Tensor]

    def is_moe(self, layer: int) -> bool:
        return f"model.layers.{layer}.mlp.gate.weight" in self.w

    def mlp_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        if not self.is_moe(layer):
            return super().mlp_shapes(layer)  # type: ignore[misc]
        c, p = self.config, f"model.layers.{layer}.mlp."
        d, e, i, s = c.hidden_size, c.num_experts, c.moe_intermediate_size, c.shared_expert_size
        shapes = {p + "gate.weight": (e, d), p + "experts.gate_proj": (e, i, d), p + "experts.up_proj": (e, i, d),
                  p + "experts.down_proj": (e, d, i)}
        if s:
            shapes.update({p + "shared_expert.gate_proj.weight": (s, d), p + "shared_expert.up_proj.weight": (s, d),
                           p + "shared_expert.down_proj.weight": (d, s), p + "shared_expert_gate.weight": (1, d)})
        return shapes

    def _layer_weights(self, i: int) -> dict[str, Tensor | None]:
        w = super()._layer_weights(i)  # type: ignore[misc]
        if self.is_moe(i):
            m = f"model.layers.{i}.mlp."
            w.update({"gate": None, "up": None, "down": None, "router": self.w[m + "gate.weight"],
                      "experts_gate": self.w[m + "experts.gate_proj"], "experts_up": self.w[m + "experts.up_proj"],
                      "experts_down": self.w[m + "experts.down_proj"],
                      "shared_gate": self.w.get(m + "shared_expert.gate_proj.weight"),
                      "shared_up": self.w.get(m + "shared_expert.up_proj.weight"),
                      "shared_down": self.w.get(m + "shared_expert.down_proj.weight"),
                      "shared_expert_gate": self.w.get(m + "shared_expert_gate.weight"),
                      "router_bias": self.w.get(m + "gate.bias"),
                      "experts_gate_bias": self.w.get(m + "experts.gate_bias"),
                      "experts_up_bias": self.w.get(m + "experts.up_bias"),
                      "experts_down_bias": self.w.get(m + "experts.down_bias")})
        return w
