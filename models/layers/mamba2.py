"""The Mamba-2 token mixer (Dao & Gu, "Transformers are SSMs", 2024) on the ``ml`` interfaces, with its state in the
:class:`~mlx_engine.kvcache.RecurrentCache`: what Granite 4's (``granitemoehybrid``) recurrent layers run.

Per layer, on the normed input ``x [S, L, D]`` (``S`` sequences of ``L`` tokens):

- ``in_proj`` gives ``z [d_inner]``, ``xBC [d_inner + 2 G N]`` and ``dt [H]`` (``H`` heads of ``P`` features,
  ``d_inner = H P``; ``G`` groups of ``B`` and ``C``, each ``N = d_state`` wide);
- a depthwise causal convolution (kernel ``K``, bias) with SiLU over ``xBC``, its last ``K - 1`` inputs kept as the
  ``"conv"`` state; then ``xBC`` splits into ``x [H, P]``, ``B [G, N]``, ``C [G, N]``, head ``h`` reading group
  ``h // (H / G)``;
- ``dt = clip(softplus(dt + dt_bias), *time_step_limit)``, and per token and head the selective scan on the
  ``"recurrent"`` state ``S [H, P, N]``: ``S = exp(dt A) S + dt x B^T``, ``y = S C + D x`` (``A = -exp(A_log)``);
- the gated RMSNorm: ``y silu(z)`` normed over each of ``G`` groups of ``d_inner / G`` features, times its weight;
  then ``out_proj``.

Prefill runs of at least :data:`SSD_CHUNK` tokens use the chunked form (the state-space dual: within a chunk the scan
is one masked product, ``y_i = sum_{j <= i} (C_i . B_j) exp(cum_i - cum_j) dt_j x_j``, and only the chunks run one
after another); shorter runs and decode steps the recurrence token by token. Both in float32, as the reference.

References: transformers' ``models/granitemoehybrid/modeling_granitemoehybrid.py`` (``GraniteMoeHybridMambaLayer``,
``mamba2_chunk_scan``, ``mamba2_selective_state_update``, ``GraniteMoeHybridRMSNormGated``) and ``models/mamba2``;
llama.cpp's ``src/models/mamba-base.cpp`` (``build_mamba2_layer``).
"""

from __future__ import annotations

import numpy as np

from mlx_engine.ml import Context, DType, Tensor

#: Prefill runs of at least this many tokens use the chunked scan (chunks of this size).
SSD_CHUNK = 64


def softplus(x: Tensor) -> Tensor:
    """``log(1 + exp(x))`` without overflow: ``max(x, 0) + log(1 + exp(-|x|))``."""
    return x.maximum(0.0) + ((x.minimum(-x)).exp() + 1.0).log()


def ssm_scan(ctx: Context, x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor,
             state: Tensor) -> tuple[Tensor, Tensor]:
    """The selective scan token by token (transformers' ``mamba2_selective_state_update``): ``x [S, L, H, P]``,
    ``dt [S, L, H]`` (after softplus), ``a [H]`` (``A``, negative), ``b, c [S, L, H, N]`` (per head), ``state [S, H,
    P, N]``, all float32. Returns ``(y [S, L, H, P], state)`` without the ``D`` skip."""
    s, n, h, p = x.shape
    decay = (dt * a).exp()                                              # [S, L, H]
    xdt = x * dt.reshape(s, n, h, 1)
    outs = []
    for t in range(n):
        state = (state * decay[:, t].reshape(s, h, 1, 1)
                 + xdt[:, t].reshape(s, h, p, 1) * b[:, t].reshape(s, h, 1, -1))
        outs.append((state @ c[:, t].reshape(s, h, -1, 1)).reshape(s, 1, h, p))
    return (outs[0] if n == 1 else ctx.concatenate(outs, axis=1)), state


def ssm_scan_chunked(ctx: Context, x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, state: Tensor,
                     chunk: int = SSD_CHUNK) -> tuple[Tensor, Tensor]:
    """The same scan over chunks of ``chunk`` tokens (transformers' ``mamba2_chunk_scan``, the SSD form of Dao & Gu
    2024): within a chunk ``y = ((C B^T) * L) (dt x) + exp(cum) C S_0`` with ``L[i, j] = exp(cum_i - cum_j)`` for
    ``j <= i``, ``cum`` the running sum of ``dt A``; the state passes from chunk to chunk. Padding tokens have
    ``dt = 0``: no decay, no input. Same arguments and result as :func:`ssm_scan`."""
    s, n, h, p = x.shape
    pad = -n % chunk

    def chunks(t: Tensor) -> Tensor:  # [S, L, H, ...] -> [S, H, chunks, C, ...], zeros after the end
        if pad:
            t = ctx.concatenate([t, ctx.zeros([s, pad, *t.shape[2:]], t.dtype)], axis=1)
        t = t.transpose(0, 2, 1, *range(3, t.ndim))
        return t.reshape(s, h, (n + pad) // chunk, chunk, *t.shape[3:])

    xdt = chunks(x * dt.reshape(s, n, h, 1))                            # [S, H, Nc, C, P]
    b, c = chunks(b), chunks(c)                                         # [S, H, Nc, C, N]
    cum = chunks(dt * a).cumsum(axis=-1)                                # [S, H, Nc, C]
    lower = ctx.from_numpy(np.tril(np.ones((chunk, chunk), bool)))
    pair = cum.reshape(*cum.shape, 1) - cum.reshape(*cum.shape[:-1], 1, chunk)
    pair = lower.where(pair, float("-inf")).exp()                       # exp(cum_i - cum_j) for j <= i, else 0
    within = ((c @ b.transpose(0, 1, 2, 4, 3)) * pair) @ xdt            # [S, H, Nc, C, P]
    last = cum[..., chunk - 1:chunk]                                    # [S, H, Nc, 1]
    c_decayed = c * cum.exp().reshape(*cum.shape, 1)
    x_decayed = (xdt * (last - cum).exp().reshape(*cum.shape, 1)).transpose(0, 1, 2, 4, 3)  # [S, H, Nc, P, C]
    chunk_decay = last.exp().reshape(s, h, -1, 1, 1)
    outs = []
    for i in range((n + pad) // chunk):
        outs.append(within[:, :, i] + c_decayed[:, :, i] @ state.transpose(0, 1, 3, 2))
        state = state * chunk_decay[:, :, i] + x_decayed[:, :, i] @ b[:, :, i]
    y = (outs[0] if len(outs) == 1 else ctx.concatenate(outs, axis=2))[:, :, :n]  # [S, H, L, P]
    return y.transpose(0, 2, 1, 3), state


def mamba2_mixer(ctx: Context, x: Tensor, w: dict[str, Tensor | None], sizes: tuple[int, int, int, int],
                 taps: list[Tensor], conv_state: Tensor, ssm_state: Tensor, eps: float,
                 dt_limit: tuple[float, float]) -> tuple[Tensor, Tensor, Tensor]:
    """One Mamba-2 mixer (module docstring) on the normed ``x [S, L, D]``.

    Args:
        w: ``in_proj [2 d_inner + 2 G N + H, D]`` (``in_proj_bias``), ``conv_bias [d_inner + 2 G N]`` or None,
            ``a`` (``A = -exp(A_log)``), ``d``, ``dt_bias`` ``[H]`` float32, ``norm [d_inner]``, ``out_proj
            [D, d_inner]`` (``out_proj_bias``).
        sizes: ``(H, P, G, N)``.
        taps: the convolution's ``K`` taps, ``[d_inner + 2 G N]`` each (tap ``K - 1`` multiplies the newest input).
        conv_state: ``[S, K - 1, d_inner + 2 G N]``; ssm_state: ``[S, H, P, N]`` float32.
        dt_limit: ``(low, high)`` that ``dt`` is clipped to (``time_step_limit``; ``(0, inf)``: none).

    Returns:
        ``(out [S, L, D], conv_state, ssm_state)``.
    """
    h, p, g, n_state = sizes
    s, n = x.shape[0], x.shape[1]
    inner, conv_dim = h * p, h * p + 2 * g * n_state
    proj = x.linear(w["in_proj"], w.get("in_proj_bias"))                # [S, L, 2 d_inner + 2 G N + H]
    z, xbc, dt = proj[..., :inner], proj[..., inner:inner + conv_dim], proj[..., inner + conv_dim:]
    full = ctx.concatenate([conv_state.astype(xbc.dtype), xbc], axis=1)  # [S, K - 1 + L, C]
    conv = full[:, 0:n] * taps[0]
    for j in range(1, len(taps)):
        conv = conv + full[:, j:j + n] * taps[j]
    if w.get("conv_bias") is not None:
        conv = conv + w["conv_bias"]
    conv = conv.silu().astype(DType.FLOAT32)
    xs = conv[..., :inner].reshape(s, n, h, p)
    per_group = h // g

    def heads(t: Tensor) -> Tensor:  # [S, L, G * N] -> [S, L, H, N], head j reading group j // (H / G)
        t = t.reshape(s, n, g, 1, n_state)
        if per_group > 1:
            t = ctx.concatenate([t] * per_group, axis=3)
        return t.reshape(s, n, h, n_state)

    b = heads(conv[..., inner:inner + g * n_state])
    c = heads(conv[..., inner + g * n_state:])
    dt = softplus(dt.astype(DType.FLOAT32) + w["dt_bias"])
    low, high = dt_limit
    if low > 0.0:
        dt = dt.maximum(low)
    if high < float("inf"):
        dt = dt.minimum(high)
    scan = ssm_scan_chunked if n >= SSD_CHUNK else ssm_scan
    y, ssm_state = scan(ctx, xs, dt, w["a"], b, c, ssm_state)
    y = y + xs * w["d"].reshape(h, 1)
    y = y.reshape(s, n, inner) * z.astype(DType.FLOAT32).silu()
    y = y.reshape(s, n, g, inner // g).rms_norm(None, eps).reshape(s, n, inner) * w["norm"]
    out = y.astype(x.dtype).linear(w["out_proj"], w.get("out_proj_bias"))
    return out, full[:, n:], ssm_state
