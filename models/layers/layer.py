"""A decoder layer's math on the ``ml`` interfaces, as functions of the config and the layer's weights (by the names
of :meth:`mlx_engine.models.layers.base.DecoderModel._layer_weights`): RoPE, the part before attention (input norm,
projections, query/key norms), the part after it (output projection, residual adds, norms, the gated MLP or the
experts). :class:`DecoderModel` runs them, compiled per block for one-token steps. Shapes: hidden states ``[1, N, D]``, attention ``[1, H, N, Dh]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from mlx_engine.batch import Batch
from mlx_engine.ml import Context, DType, LayerFusion, RopeAngles, Tensor
from mlx_engine.models.layers.config import DecoderConfig
from mlx_engine.models.layers.moe import moe_mlp


def rope_positions(ctx: Context, batch: Batch) -> "int | Tensor":
    """The RoPE offset for a batch: an int when its tokens are consecutive positions of one sequence (the fast
    path), else an INT32 Tensor ``[N]`` with each token's own position."""
    pos, seqs = batch.positions, batch.sequences
    n = len(pos)
    if n == 1 or (np.all(seqs == seqs[0]) and pos[-1] - pos[0] == n - 1 and np.all(np.diff(pos) == 1)):
        return int(pos[0])
    return ctx.from_numpy(pos, DType.INT32)


@dataclass(frozen=True)
class SectionPositions:
    """M-RoPE's positions for one forward pass (Qwen2-VL, Wang et al. 2024; transformers'
    ``apply_multimodal_rotary_pos_emb``): the rotary pairs in consecutive sections, section ``s`` rotated by its own
    positions ``positions[s]`` (INT32 ``[N]``). Applied as one RoPE per section whose periods ``freqs[s]``
    (``[dims / 2]``) are the model's inside the section and infinite outside (an angle of 0 leaves a pair as it is),
    so each pair is rotated once, by its own axis."""

    positions: tuple[Tensor, ...]
    freqs: tuple[Tensor, ...]


def section_positions(ctx: Context, mrope: np.ndarray, sections: "tuple[int, ...]", dims: int, base: float | None,
                      freqs: "Tensor | None") -> SectionPositions:
    """:class:`SectionPositions` from the batch's ``mrope`` ``[3, N]`` and the config's ``mrope_section`` (the model's
    periods: ``freqs``, or ``base ** (2i / dims)``)."""
    periods = freqs.numpy().astype(np.float32) if freqs is not None else \
        (np.float64(base) ** (np.arange(0, dims, 2, dtype=np.float64) / dims)).astype(np.float32)
    edges = np.cumsum((0,) + tuple(sections))
    pos, fr = [], []
    for s in range(len(sections)):
        f = np.full(dims // 2, np.inf, np.float32)
        f[edges[s]:edges[s + 1]] = periods[edges[s]:edges[s + 1]]
        pos.append(ctx.from_numpy(np.ascontiguousarray(mrope[s % 3]), DType.INT32))
        fr.append(ctx.from_numpy(f))
    return SectionPositions(tuple(pos), tuple(fr))


def apply_rope(x: Tensor, positions: "int | Tensor | RopeAngles | SectionPositions", dims: int, base: float | None,
               scale: float, traditional: bool, freqs: "Tensor | None") -> Tensor:
    """RoPE on ``x [1, H, N, Dh]`` at ``positions`` (see :func:`rope_positions`), or with the tokens' angles made
    once for the forward pass (:meth:`Context.rope_angles`), or M-RoPE's :class:`SectionPositions`. Per-token
    positions put the tokens on the batch axis (``[N, H, 1, Dh]``), where MLX's RoPE takes one offset per row."""
    if isinstance(positions, SectionPositions):
        for pos, f in zip(positions.positions, positions.freqs):
            x = apply_rope(x, pos, dims, None, scale, traditional, f)
        return x
    if isinstance(positions, (int, RopeAngles)):
        return x.rope(positions, dims, base=base, scale=scale, traditional=traditional, freqs=freqs)
    y = x.transpose(2, 1, 0, 3).rope(positions, dims, base=base, scale=scale, traditional=traditional, freqs=freqs)
    return y.transpose(2, 1, 0, 3)


def _heads(x: Tensor, heads: int, dim: int) -> Tensor:
    """``[1, N, heads * dim]`` -> ``[1, heads, N, dim]`` (one token: a reshape alone, no transpose node)."""
    n = x.shape[1]
    if n == 1:
        return x.reshape(1, heads, 1, dim)
    return x.reshape(1, n, heads, dim).transpose(0, 2, 1, 3)


def attention_in(c: DecoderConfig, rope: tuple[float | None, float, "Tensor | None"], h: Tensor,
                 positions: "int | Tensor | RopeAngles | None", w: dict[str, Tensor | None],
                 residual: "Tensor | None" = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One layer before attention: ``h [1, N, D]`` (plus ``residual``, the last layer's deferred residual term,
    where given) -> queries ``[1, H, N, Dh]``, keys and values ``[1, H_kv, N, Dh]`` and the sum ``h``
    (input norm, projections, query/key norms, RoPE ``(base, scale, freqs)`` at ``positions``, or by the tokens'
    angles made for this RoPE; ``positions=None``: no RoPE, the caller's).
    ``w`` holds the layer's weights by the names of :meth:`DecoderModel._layer_weights`."""
    eps = c.rms_norm_eps
    biases = [w.get("q_bias"), w.get("k_bias"), w.get("v_bias")]
    qkv, n = [w["q"], w["k"], w["v"]], h.shape[1]
    if n == 1 and all(b is None for b in biases):
        # one token: the norm, the products in the heads' shape and the query/key norms as one operation where the
        # backend can
        shapes = [(1, c.num_heads, 1, c.head_dim)] + [(1, c.num_kv_heads, 1, c.head_dim)] * 2
        norms = [w["q_norm"], w["k_norm"], None] if c.qk_norm else None
        h, (q, k, v) = h.norm_linear(qkv, w["attn_norm"], eps, residual, shapes, norms)
    else:
        if all(b is None for b in biases):
            h, (q, k, v) = h.norm_linear(qkv, w["attn_norm"], eps, residual)
        else:
            h, x = (h, h.rms_norm(w["attn_norm"], eps)) if residual is None else h.add_rms_norm(
                residual, w["attn_norm"], eps)
            q, k, v = x.linear_many(qkv, biases)
        q = _heads(q, c.num_heads, c.head_dim)
        k = _heads(k, c.num_kv_heads, c.head_dim)
        v = _heads(v, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = q.rms_norm(w["q_norm"], eps)
            k = k.rms_norm(w["k_norm"], eps)
    if positions is None:  # the caller rotates (the KV cache's fused attention)
        return q, k, v, h
    base, scale, freqs = rope
    dims = c.rope_dims or c.head_dim
    q = apply_rope(q, positions, dims, base, scale, c.rope_traditional, freqs)
    k = apply_rope(k, positions, dims, base, scale, c.rope_traditional, freqs)
    return q, k, v, h


def attention_out(c: DecoderConfig, h: Tensor, o: Tensor, w: dict[str, Tensor | None],
                  reduce: "Callable[[Tensor], Tensor] | None" = None, defer: bool = False,
                  fusion: "LayerFusion | None" = None) -> "Tensor | tuple[Tensor, Tensor]":
    """One layer after attention: the attention output ``o [1, H, N, Dh]`` through the output projection, the
    residual adds, the norms and the gated MLP; returns the new ``h [1, N, D]`` (``defer``: see
    :func:`feed_forward`). ``reduce`` (tensor parallelism) sums the partial outputs of the two row-sharded
    projections (output and down) over the ranks, before the residual add and the sandwich norms (Megatron-LM's
    layout, Shoeybi et al. 2019). ``fusion``: the backend runs it all as one operation (one token, a dense gated MLP;
    the decode plan's choice, :func:`takes_output_mlp`), with the same values."""
    n = h.shape[1]
    if fusion is not None:
        norm = w["pre_ffn_norm"] if c.sandwich_norm else w["post_attn_norm"]
        h, m = fusion.output_mlp(o, h, w["o"], norm, w["gate"], w["up"], w["down"], c.activation, c.rms_norm_eps,
                                 w["post_attn_norm"] if c.sandwich_norm else None,
                                 w["post_ffn_norm"] if c.sandwich_norm else None)
        return (h, m) if defer else h + m
    o = (o if n == 1 else o.transpose(0, 2, 1, 3)).reshape(1, n, c.num_heads * c.head_dim)
    if w.get("attn_gate") is not None:  # gated attention (Qwen3-Next): the gate reads the layer's normed input
        o = o * h.rms_norm(w["attn_gate_norm"], c.rms_norm_eps).linear(w["attn_gate"]).sigmoid()
    if c.sandwich_norm and reduce is None:  # the product and the norm after it as one operation where it can
        return feed_forward(c, h, o.linear_norm(w["o"], w["post_attn_norm"], c.rms_norm_eps), w, reduce, defer,
                            normed=True)
    o = o.linear(w["o"], w.get("o_bias"))
    if reduce is not None:
        o = reduce(o)
    if c.residual_scale != 1.0:  # Granite
        o = o * c.residual_scale
    return feed_forward(c, h, o, w, reduce, defer)


def feed_forward(c: DecoderConfig, h: Tensor, o: Tensor, w: dict[str, Tensor | None],
                 reduce: "Callable[[Tensor], Tensor] | None" = None, defer: bool = False, normed: bool = False
                 ) -> "Tensor | tuple[Tensor, Tensor]":
    """The second half of a layer: ``h + o`` (the token mixer's output ``o [1, N, D]``, attention or recurrent;
    ``normed``: through the sandwich norm already), the norms, and the gated MLP with its residual; returns the new
    ``h [1, N, D]``, or with ``defer`` the two terms of its last residual add, ``(h', m)`` with ``h = h' + m``, for
    the next layer's norm to add (one node)."""
    eps = c.rms_norm_eps
    if c.sandwich_norm and not normed:
        o = o.rms_norm(w["post_attn_norm"], eps)
    norm = w["pre_ffn_norm"] if c.sandwich_norm else w["post_attn_norm"]
    if w.get("router") is not None:
        h, x = h.add_rms_norm(o, norm, eps)
        m = moe_mlp(x, w, c)
    else:
        # the residual add, the norm and the products; the activation, the down projection and the norm after it:
        # each as one operation where the backend can
        h, (g, u) = h.norm_linear([w["gate"], w["up"]], norm, eps, o)
        post = w["post_ffn_norm"] if c.sandwich_norm else None
        m = g.gated_linear(u, c.activation, w["down"], post if reduce is None else None, eps)
        if reduce is not None:
            m = reduce(m)
            if post is not None:
                m = m.rms_norm(post, eps)
    if c.residual_scale != 1.0:  # Granite
        m = m * c.residual_scale
    return (h, m) if defer else h + m


def takes_output_mlp(c: DecoderConfig, w: dict[str, Tensor | None], fusion: "LayerFusion | None", dtype: DType,
                     reduce: "Callable[[Tensor], Tensor] | None") -> bool:
    """Whether a decode step's :func:`attention_out` of the layer of weights ``w`` runs as the backend's one
    operation (``fusion``): a dense gated MLP with no gate on the attention, no output bias, no residual scale,
    not split over ranks, and weights the backend takes."""
    if (fusion is None or reduce is not None or w.get("attn_gate") is not None or w.get("router") is not None
            or w.get("o_bias") is not None or c.residual_scale != 1.0):
        return False
    norms = [w["pre_ffn_norm"] if c.sandwich_norm else w["post_attn_norm"]]
    norms += [w["post_attn_norm"], w["post_ffn_norm"]] if c.sandwich_norm else []
    return fusion.takes_output_mlp(dtype, [w["o"], w["gate"], w["up"], w["down"]], norms, c.activation)
