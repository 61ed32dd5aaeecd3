"""Mixture-of-experts MLPs: a router picks ``k`` experts per token, their SwiGLU outputs are summed with the router's
weights, plus an optional shared expert (behind a sigmoid gate in the Qwen ones). Two routers: softmax top-k (Qwen2-MoE,
Qwen3-MoE, Qwen3-Next, gpt-oss) and DeepSeek V3's (sigmoid scores, a correction bias for the choice, group-limited
top-k, a routed scale: DeepSeek V3, Kimi K2, GLM-4.5/4.6/4.7).

References: transformers' ``Qwen3NextSparseMoeBlock`` (``Qwen3NextTopKRouter``, ``Qwen3NextExperts``),
``DeepseekV3MoE.route_tokens_to_experts`` and ``Glm4MoeTopkRouter``; llama.cpp's ``build_moe_ffn`` in
``src/llama-graph.cpp``; mlx-lm's ``SwitchGLU`` for the gathered products.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlx_engine.ml import Context, DType, Tensor

if TYPE_CHECKING:
    from mlx_engine.models.layers.config import DecoderConfig


def moe_mlp(x: Tensor, w: dict[str, Tensor | None], c: "DecoderConfig") -> Tensor:
    """The MoE MLP on normed hidden states ``x [1, N, D]``; returns ``[1, N, D]`` (no residual).

    ``w``: ``router [E, D]``, ``experts_gate`` / ``experts_up [E, I, D]``, ``experts_down [E, D, I]``, and
    optionally ``shared_gate`` / ``shared_up [S, D]``, ``shared_down [D, S]``, ``shared_expert_gate [1, D]``,
    ``router_bias [E]``, ``score_bias [E]`` (DeepSeek's correction bias), ``experts_gate_bias`` /
    ``experts_up_bias [E, I]``, ``experts_down_bias [E, D]`` (gpt-oss). The router: :func:`grouped_route` where
    ``c.sigmoid_router``, else :func:`softmax_route`; the experts' activation: ``c.clamped_swiglu``'s or SwiGLU."""
    n, d = x.shape[1], x.shape[2]
    x2 = x.reshape(n, d)
    idx, top = grouped_route(x2, w, c) if c.sigmoid_router else softmax_route(x2, w, c.experts_per_token,
                                                                             c.norm_topk_prob)
    return experts_mlp(x2, idx, top, w, c.clamped_swiglu).reshape(1, n, d)


def softmax_route(x2: Tensor, w: dict[str, Tensor | None], top_k: int, norm_topk: bool) -> tuple[Tensor, Tensor]:
    """The chosen experts ``[N, k]`` (INT32) and their weights ``[N, k]`` (float32) for ``x2 [N, D]``: the ``top_k``
    largest of ``softmax(x W_r + b_r)`` (float32), renormalised to sum to 1 with ``norm_topk`` (gpt-oss's softmax
    over the top-k logits is the same)."""
    probs = x2.linear(w["router"], w.get("router_bias")).astype(DType.FLOAT32).softmax(-1)  # [N, E]
    experts = probs.shape[-1]
    idx = (-probs).argpartition(top_k - 1, axis=-1)[:, :top_k] if top_k < experts else \
        (-probs).argsort(axis=-1)  # [N, k]
    top = probs.take_along_axis(idx, axis=-1)
    if norm_topk:
        top = top / top.sum(axis=-1, keepdims=True)
    return idx, top


def grouped_route(x2: Tensor, w: dict[str, Tensor | None], c: "DecoderConfig") -> tuple[Tensor, Tensor]:
    """DeepSeek V3's router: the chosen experts ``[N, k]`` (INT32) and their weights ``[N, k]`` (float32) for
    ``x2 [N, D]``.

    Scores ``sigmoid(x W_r)`` (softmax where not ``c.sigmoid_router``: DeepSeek V2 GGUF files) in float32; the
    choice adds ``w["score_bias"]`` (``e_score_correction_bias``) where there is one; with ``c.expert_groups > 1`` a
    group's score is the sum of its two best choice scores and only the ``c.groups_used`` best groups' experts can be
    chosen; the ``k`` best are weighed by their scores (without the bias), renormalised with ``c.norm_topk_prob``
    (plus 1e-20), times ``c.routed_scale``. Source: transformers' ``DeepseekV3MoE.route_tokens_to_experts`` /
    ``Glm4MoeTopkRouter``; llama.cpp's ``build_moe_ffn``."""
    n, k, e = x2.shape[0], c.experts_per_token, c.num_experts
    logits = x2.astype(DType.FLOAT32).linear(w["router"]).astype(DType.FLOAT32)
    scores = logits.sigmoid() if c.sigmoid_router else logits.softmax(-1)
    choice = scores if w.get("score_bias") is None else scores + w["score_bias"].astype(DType.FLOAT32)
    g = c.expert_groups
    if g > 1 and c.groups_used < g:
        per = e // g
        grouped = choice.reshape(n, g, per)
        best = min(2, per)
        two = grouped.take_along_axis((-grouped).argpartition(best - 1, axis=-1)[:, :, :best], axis=-1)
        group_scores = two.sum(axis=-1)  # [N, G]
        kept = (-group_scores).argpartition(c.groups_used - 1, axis=-1)[:, :c.groups_used]
        zeros = group_scores * 0.0
        mask = zeros.put_along_axis(kept, zeros.take_along_axis(kept, axis=-1) + 1.0, axis=-1)  # 1: a kept group
        choice = mask.reshape(n, g, 1).compare(">", 0.5).where(grouped, float("-inf")).reshape(n, e)
    idx = (-choice).argpartition(k - 1, axis=-1)[:, :k] if k < e else (-choice).argsort(axis=-1)
    top = scores.take_along_axis(idx, axis=-1)
    if c.norm_topk_prob:
        top = top / (top.sum(axis=-1, keepdims=True) + 1e-20)
    return idx, top * c.routed_scale


def experts_mlp(x2: Tensor, idx: Tensor, top: Tensor, w: dict[str, Tensor | None],
                clamped_swiglu: "tuple[float, float] | None" = None, weigh_input: bool = False) -> Tensor:
    """The routed experts' outputs on ``x2 [N, D]``: each token's experts ``idx [N, k]`` (INT32) by the gathered
    products (with the experts' biases where ``w`` has them), weighed by ``top [N, k]`` and summed, plus the shared
    expert where ``w`` has one (behind its sigmoid gate where it has one); returns ``[N, D]``. ``w``: as
    :func:`moe_mlp`'s. ``clamped_swiglu`` ``(alpha, limit)``: the activation is gpt-oss's
    (:attr:`DecoderConfig.clamped_swiglu`), else SiLU-gated (SwiGLU). ``weigh_input``: each expert's input is
    weighed by ``top`` instead of its output (Llama 4's ``Llama4TextMoe``: ``x * score`` into the expert)."""
    n, d = x2.shape
    top_k = idx.shape[-1]
    if weigh_input:  # one row per (token, expert), weighed, through its one expert
        rows = (x2.reshape(n, 1, d) * top.astype(x2.dtype).reshape(n, top_k, 1)).reshape(n * top_k, d)
        one = idx.reshape(n * top_k, 1)
        gate = rows.gather_linear(w["experts_gate"], one).reshape(n, top_k, -1)
        up = rows.gather_linear(w["experts_up"], one).reshape(n, top_k, -1)
    else:
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
    y = (out if weigh_input else out * top.astype(out.dtype).reshape(n, top_k, 1)).sum(axis=1)  # [N, D]
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
    """Rename llama.cpp's MoE tensors (``blk.N.ffn_gate_exps.weight`` ..., the router's correction bias
    ``blk.N.exp_probs_b.bias``) to the names :class:`MoEWeights` reads; every other name is left as it is."""
    out = {}
    for name, t in weights.items():
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] == "exp_probs_b":
            name = f"model.layers.{parts[1]}.mlp.gate.e_score_correction_bias"
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
    """The mixture-of-experts MLP's weights of a :class:`~mlx_engine.models.layers.base.DecoderModel` (mixed in before it):
    a layer holding a router (``mlp.gate.weight``) is an MoE layer; its expected shapes and the names the layer
    maths reads (:func:`moe_mlp`). Any other layer keeps the dense MLP (``mlp_only_layers``, ``decoder_sparse_step``
    of the Qwen MoE configs)."""

    config: "DecoderConfig"
    w: dict[str, Tensor]
    #: The shared expert sits behind a sigmoid gate ``shared_expert_gate [1, D]`` (Qwen); False: always on, whole
    #: (DeepSeek, GLM).
    shared_expert_gated = True

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
                           p + "shared_expert.down_proj.weight": (d, s)})
            if self.shared_expert_gated:
                shapes[p + "shared_expert_gate.weight"] = (1, d)
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
                      "score_bias": self.w.get(m + "gate.e_score_correction_bias"),
                      "experts_gate_bias": self.w.get(m + "experts.gate_bias"),
                      "experts_up_bias": self.w.get(m + "experts.up_bias"),
                      "experts_down_bias": self.w.get(m + "experts.down_bias")})
        return w
