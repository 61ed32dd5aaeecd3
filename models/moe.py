"""Mixture-of-experts MLPs (Qwen3-MoE / Qwen3-Next): a softmax router picks ``k`` experts per token, their SwiGLU
outputs are summed with the router's probabilities, plus an optional shared expert behind a sigmoid gate.

Reference: transformers' ``Qwen3NextSparseMoeBlock`` (``Qwen3NextTopKRouter``, ``Qwen3NextExperts``); mlx-lm's
``SwitchGLU`` for the gathered products.
"""

from __future__ import annotations

from mlx_engine.ml import DType, Tensor


def moe_mlp(x: Tensor, w: dict[str, Tensor | None], top_k: int, norm_topk: bool) -> Tensor:
    """The MoE MLP on normed hidden states ``x [1, N, D]``; returns ``[1, N, D]`` (no residual).

    ``w``: ``router [E, D]``, ``experts_gate`` / ``experts_up [E, I, D]``, ``experts_down [E, D, I]``, and
    optionally ``shared_gate`` / ``shared_up [S, D]``, ``shared_down [D, S]``, ``shared_expert_gate [1, D]``. The
    router's softmax runs in float32; ``norm_topk`` renormalises the ``top_k`` kept probabilities to sum to 1.
    """
    n, d = x.shape[1], x.shape[2]
    x2 = x.reshape(n, d)
    probs = x2.linear(w["router"]).astype(DType.FLOAT32).softmax(-1)  # [N, E]
    experts = probs.shape[-1]
    idx = (-probs).argpartition(top_k - 1, axis=-1)[:, :top_k] if top_k < experts else \
        (-probs).argsort(axis=-1)  # [N, k]
    top = probs.take_along_axis(idx, axis=-1)
    if norm_topk:
        top = top / top.sum(axis=-1, keepdims=True)
    hidden = x2.gather_linear(w["experts_gate"], idx).silu() * x2.gather_linear(w["experts_up"], idx)  # [N, k, I]
    inner = hidden.shape[-1]
    flat = idx.reshape(n * top_k, 1)
    out = hidden.reshape(n * top_k, inner).gather_linear(w["experts_down"], flat).reshape(n, top_k, d)
    y = (out * top.astype(out.dtype).reshape(n, top_k, 1)).sum(axis=1)  # [N, D]
    if w.get("shared_gate") is not None:
        shared = (x2.linear(w["shared_gate"]).silu() * x2.linear(w["shared_up"])).linear(w["shared_down"])
        if w.get("shared_expert_gate") is not None:
            shared = shared * x2.linear(w["shared_expert_gate"]).sigmoid()
        y = y + shared
    return y.reshape(1, n, d)
