"""The FLUX.1 diffusion transformer on the ``ml`` interfaces: diffusers' ``FluxTransformer2DModel``.

Reference: diffusers ``models/transformers/transformer_flux.py`` (``FluxTransformer2DModel``,
``FluxTransformerBlock``, ``FluxSingleTransformerBlock``, ``FluxAttnProcessor``, ``FluxPosEmbed``),
``models/normalization.py`` (``AdaLayerNormZero``, ``AdaLayerNormZeroSingle``, ``AdaLayerNormContinuous``),
``models/embeddings.py`` (``CombinedTimestep[Guidance]TextProjEmbeddings``, ``get_timestep_embedding``,
``get_1d_rotary_pos_embed``, ``apply_rotary_emb``). The architecture is the MM-DiT of Esser et al. 2024 ("Scaling
Rectified Flow Transformers for High-Resolution Image Synthesis") with FLUX's parallel single-stream blocks. One
call, as diffusers' ``forward``::

    t, guidance (dev), pooled CLIP [B, P] -> temb [B, D]:  TimestepEmbedding(sinusoid(1000 t))
                                                           (+ TimestepEmbedding(sinusoid(1000 g))) + MLP(pooled)
    packed latents [B, S, C_in] -> x_embedder ; T5 features [B, L, J] -> context_embedder
    num_layers double-stream blocks (text and image streams, own weights, joint attention over [text, image])
    num_single_layers single-stream blocks on [text, image] (attention and MLP in parallel)
    image part -> AdaLayerNormContinuous(temb) -> proj_out -> [B, S, patch^2 C_out]

Position ids are 3 numbers per token (``txt_ids [L, 3]``, zero for text; ``img_ids [S, 3]``: ``(0, row, col)`` of the
2x2 latent patch, Kontext's input image ``(1, row, col)``). RoPE (``FluxPosEmbed``, theta 10000): per axis ``a`` of
``axes_dims_rope[a]`` features, pair ``i`` at position ``p`` turns by ``p * theta ** (-2i / d_a)`` (float64, cos and
sin rounded to float32 as diffusers); the axes' pairs are concatenated and rotate interleaved features ``(2k, 2k+1)``
of each head (``apply_rotary_emb`` with ``use_real_unbind_dim=-1``).

The timestep given is diffusers' ``timestep / 1000`` (``sigma``, in [0, 1]) and the output is the flow-matching
velocity (``noise - x0``), fed to the scheduler as is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlx_engine.errors import WeightsError
from mlx_engine.imagegen.quantize import quantize_linears
from mlx_engine.imagegen.transformer import rotate_pairs, timestep_features
from mlx_engine.ml import Backend, Context, Tensor

__all__ = ["FluxConfig", "FluxTransformer", "ROPE_THETA"]

#: ``FluxPosEmbed(theta=10000, ...)`` in ``FluxTransformer2DModel.__init__``.
ROPE_THETA = 10000.0
#: eps of every LayerNorm and of the per-head query/key RMSNorms (diffusers' blocks).
EPS = 1e-6


@dataclass
class FluxConfig:
    """Hyper-parameters of ``FluxTransformer2DModel`` (its ``config.json``; defaults are diffusers' ``__init__``,
    FLUX.1-dev's and -schnell's sizes).

    Attributes:
        patch_size: 1 for FLUX.1 (the 2x2 patches are packed by the pipeline into ``in_channels = 4 * C``).
        in_channels, out_channels: features per packed token in and out (64: 16 latent channels x 2 x 2).
        num_layers, num_single_layers: double-stream and single-stream blocks.
        attention_head_dim, num_attention_heads: the model width is their product (3072).
        joint_attention_dim: T5's width (4096). pooled_projection_dim: CLIP's pooled width (768).
        guidance_embeds: FLUX.1-dev's distilled guidance input (schnell has none).
        axes_dims_rope: RoPE features per position axis; they sum to ``attention_head_dim``.
    """

    patch_size: int = 1
    in_channels: int = 64
    out_channels: int | None = None
    num_layers: int = 19
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 768
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def out_features(self) -> int:
        return self.patch_size * self.patch_size * (self.out_channels or self.in_channels)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> "FluxConfig":
        """From ``config.json``'s keys.

        Raises:
            WeightsError: ``axes_dims_rope`` not even or not summing to ``attention_head_dim``.
        """
        names = {f for f in cls.__dataclass_fields__ if f != "extra"}
        kw = {k: (tuple(int(i) for i in v) if isinstance(v, (list, tuple)) else v)
              for k, v in config.items() if k in names and v is not None}
        c = cls(**kw)
        c.extra = {k: v for k, v in config.items() if k not in names}
        if sum(c.axes_dims_rope) != c.attention_head_dim or any(d % 2 for d in c.axes_dims_rope):
            raise WeightsError(f"FLUX transformer config: axes_dims_rope {list(c.axes_dims_rope)} must be even and sum "
                               f"to attention_head_dim {c.attention_head_dim}")
        return c


def rope_tables(ids: np.ndarray, axes_dims: tuple[int, ...],
                theta: float = ROPE_THETA) -> tuple[np.ndarray, np.ndarray]:
    """``(cos, sin)`` float32 ``[N, head_dim / 2]`` for position ids ``[N, 3]`` (``FluxPosEmbed``: the angles in
    float64, cos and sin rounded to float32; the pairs of the axes concatenated)."""
    pos = np.asarray(ids, dtype=np.float64)
    angles = []
    for a, d in enumerate(axes_dims):
        freqs = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64)[: d // 2] / d))
        angles.append(np.outer(pos[:, a], freqs))
    ang = np.concatenate(angles, axis=-1)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


class FluxTransformer:
    """diffusers' ``FluxTransformer2DModel`` on the ``ml`` interfaces. Build with :meth:`from_backend`; call with
    :meth:`__call__`. Computes in the backend's ``compute_dtype``; RoPE in float32 (as ``apply_rotary_emb``)."""

    #: kept in float when quantizing: the embedders and the output layers (small; they set the scale of everything).
    FLOAT_PREFIXES = ("time_text_embed.", "context_embedder.", "x_embedder.", "norm_out.", "proj_out.")

    def __init__(self, config: FluxConfig, weights: dict[str, Tensor], backend: Backend):
        self.config = config
        self.backend = backend
        self.dtype = backend.compute_dtype
        self.w = weights
        self._check_weights()

    @classmethod
    def from_backend(cls, backend: Backend, quantize_bits: int | None = None,
                     group_size: int = 64) -> "FluxTransformer":
        """Build from a backend loaded on a diffusers ``transformer/`` folder (``backend.metadata``: its
        ``config.json``; ``backend.weights``: its tensors by diffusers' names).

        Args:
            quantize_bits: None, 8 or 4: affine-quantize the blocks' linear weights (``group_size`` per group; a
                weight whose input width is not a multiple stays float; :func:`~mlx_engine.imagegen.quantize.
                quantize_linears`); :attr:`FLOAT_PREFIXES` stay float. Weights the backend quantized as it read them
                (:func:`~mlx_engine.imagegen.quantize.transformer_backend`) stay as they are.

        Raises:
            WeightsError: a missing tensor or an inconsistent config (the message names it).
            ValueError: ``quantize_bits`` not in (None, 4, 8), or ``group_size`` not in (32, 64, 128).
        """
        config = FluxConfig.from_dict(backend.metadata)
        weights = dict(backend.weights)
        if quantize_bits is not None:
            weights = quantize_linears(backend, weights, quantize_bits, group_size, cls.FLOAT_PREFIXES)
        return cls(config, weights, backend)

    _DOUBLE = ("norm1.linear", "norm1_context.linear", "attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj",
               "attn.add_k_proj", "attn.add_v_proj", "attn.to_out.0", "attn.to_add_out", "ff.net.0.proj", "ff.net.2",
               "ff_context.net.0.proj", "ff_context.net.2")
    _DOUBLE_NORMS = ("attn.norm_q", "attn.norm_k", "attn.norm_added_q", "attn.norm_added_k")
    _SINGLE = ("norm.linear", "attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "proj_out")

    def _check_weights(self) -> None:
        c = self.config
        lin = ["x_embedder", "context_embedder", "norm_out.linear", "proj_out",
               "time_text_embed.timestep_embedder.linear_1", "time_text_embed.timestep_embedder.linear_2",
               "time_text_embed.text_embedder.linear_1", "time_text_embed.text_embedder.linear_2"]
        if c.guidance_embeds:
            lin += ["time_text_embed.guidance_embedder.linear_1", "time_text_embed.guidance_embedder.linear_2"]
        for i in range(c.num_layers):
            lin += [f"transformer_blocks.{i}.{n}" for n in self._DOUBLE]
        for i in range(c.num_single_layers):
            lin += [f"single_transformer_blocks.{i}.{n}" for n in self._SINGLE]
        need = [n + s for n in lin for s in (".weight", ".bias")]
        need += [f"transformer_blocks.{i}.{n}.weight" for i in range(c.num_layers) for n in self._DOUBLE_NORMS]
        need += [f"single_transformer_blocks.{i}.attn.{n}.weight" for i in range(c.num_single_layers)
                 for n in ("norm_q", "norm_k")]
        missing = [n for n in need if n not in self.w]
        if missing:
            raise WeightsError(f"the FLUX transformer checkpoint lacks {len(missing)} tensors, e.g. "
                               f"{', '.join(missing[:3])}; is it a complete FluxTransformer2DModel?")

    def _lin(self, x: Tensor, name: str) -> Tensor:
        return x.linear(self.w[name + ".weight"], self.w[name + ".bias"])

    # ---- the call ------------------------------------------------------------------------------------------------
    def rope(self, ctx: Context, txt_ids: np.ndarray, img_ids: np.ndarray) -> tuple[Tensor, Tensor]:
        """The RoPE tables of the joint sequence ``[text, image]``: ``(cos, sin)`` float32 ``[L + S, 1, Dh / 2]``
        in ``ctx`` (made once per generation and passed to each call)."""
        cos, sin = rope_tables(np.concatenate([txt_ids, img_ids], axis=0), self.config.axes_dims_rope)
        return ctx.from_numpy(cos[:, None, :]), ctx.from_numpy(sin[:, None, :])

    def __call__(self, ctx: Context, hidden: Tensor, timestep: np.ndarray, pooled: Tensor, text: Tensor,
                 rope: tuple[Tensor, Tensor], guidance: np.ndarray | None = None) -> Tensor:
        """One forward pass.

        Args:
            ctx: the context to compute in.
            hidden: packed latents ``[B, S, in_channels]`` (any float dtype; cast to the compute dtype).
            timestep: float32 ``[B]``, diffusers' ``timestep / 1000`` (sigma).
            pooled: CLIP's pooled output ``[B, pooled_projection_dim]``.
            text: T5's features ``[B, L, joint_attention_dim]``.
            rope: :meth:`rope` of the text and image ids (``L + S`` rows).
            guidance: float32 ``[B]``, the distilled guidance scale (models with ``guidance_embeds``; else ignored).

        Returns:
            the velocity ``[B, S, out_features]`` in the compute dtype.

        Raises:
            ValueError: a model with ``guidance_embeds`` called without ``guidance``.
        """
        c, dt = self.config, self.dtype
        x = self._lin(hidden.astype(dt) if hidden.dtype != dt else hidden, "x_embedder")
        temb = self._time_text(ctx, timestep, guidance, pooled)
        act = temb.silu()  # every AdaLN takes silu(temb)
        txt = self._lin(text.astype(dt) if text.dtype != dt else text, "context_embedder")
        n_txt = txt.shape[1]
        for i in range(c.num_layers):
            x, txt = self._double(ctx, f"transformer_blocks.{i}.", x, txt, act, rope)
        h = ctx.concatenate([txt, x], axis=1)
        for i in range(c.num_single_layers):
            h = self._single(ctx, f"single_transformer_blocks.{i}.", h, act, rope)
        x = h[:, n_txt:]
        # AdaLayerNormContinuous: (scale, shift) in that order
        mod = self._lin(act, "norm_out.linear")
        d = c.dim
        x = x.layer_norm(None, None, EPS) * (mod[:, None, :d] + 1.0) + mod[:, None, d:]
        return self._lin(x, "proj_out")

    def _time_text(self, ctx: Context, timestep: np.ndarray, guidance: np.ndarray | None, pooled: Tensor) -> Tensor:
        """``CombinedTimestep[Guidance]TextProjEmbeddings``: ``temb [B, dim]``."""
        dt = self.dtype

        def embed(values: np.ndarray, name: str) -> Tensor:
            # diffusers: (t.to(dtype) * 1000) -> get_timestep_embedding(256, flip_sin_to_cos=True, shift=0)
            scaled = np.asarray(values, np.float32).reshape(-1) * np.float32(1000.0)
            f = ctx.from_numpy(timestep_features(scaled), dt)
            return self._lin(self._lin(f, name + ".linear_1").silu(), name + ".linear_2")

        temb = embed(timestep, "time_text_embed.timestep_embedder")
        if self.config.guidance_embeds:
            if guidance is None:
                raise ValueError("this FLUX transformer embeds the guidance scale: pass guidance=")
            temb = temb + embed(guidance, "time_text_embed.guidance_embedder")
        p = pooled.astype(dt) if pooled.dtype != dt else pooled
        p = self._lin(self._lin(p, "time_text_embed.text_embedder.linear_1").silu(),
                      "time_text_embed.text_embedder.linear_2")
        return temb + p

    def _modulate(self, x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
        return x.layer_norm(None, None, EPS) * (scale[:, None, :] + 1.0) + shift[:, None, :]

    def _qkv(self, x: Tensor, pre: str, q: str, k: str, v: str, nq: str, nk: str) -> tuple[Tensor, Tensor, Tensor]:
        """Projections ``[B, N, H, Dh]`` with the per-head RMSNorm of queries and keys."""
        c = self.config
        b, n, _ = x.shape
        shape = (b, n, c.num_attention_heads, c.attention_head_dim)
        qq = self._lin(x, pre + q).reshape(*shape).rms_norm(self.w[pre + nq + ".weight"], EPS)
        kk = self._lin(x, pre + k).reshape(*shape).rms_norm(self.w[pre + nk + ".weight"], EPS)
        return qq, kk, self._lin(x, pre + v).reshape(*shape)

    def _attend(self, ctx: Context, q: Tensor, k: Tensor, v: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        """RoPE on q and k, then attention over the whole joint sequence: ``[B, N, H, Dh] -> [B, N, dim]``."""
        b, n, heads, hd = q.shape
        cos, sin = rope
        q = rotate_pairs(ctx, q, cos, sin).transpose(0, 2, 1, 3)
        k = rotate_pairs(ctx, k, cos, sin).transpose(0, 2, 1, 3)
        o = ctx.scaled_dot_product_attention(q, k, v.transpose(0, 2, 1, 3), hd ** -0.5)
        return o.transpose(0, 2, 1, 3).reshape(b, n, heads * hd)

    def _ff(self, x: Tensor, pre: str) -> Tensor:
        """``FeedForward(activation_fn="gelu-approximate")``: Linear, GELU (tanh), Linear."""
        return self._lin(self._lin(x, pre + ".net.0.proj").gelu(approximate=True), pre + ".net.2")

    def _double(self, ctx: Context, pre: str, x: Tensor, txt: Tensor, act: Tensor,
                rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """``FluxTransformerBlock``: AdaLayerNormZero on each stream, joint attention over ``[text, image]``, gated
        residuals, a gated feed-forward per stream."""
        d = self.config.dim
        m = self._lin(act, pre + "norm1.linear")  # shift, scale, gate (msa), shift, scale, gate (mlp)
        mc = self._lin(act, pre + "norm1_context.linear")
        chunk = lambda t, i: t[:, i * d:(i + 1) * d]  # noqa: E731
        nx = self._modulate(x, chunk(m, 0), chunk(m, 1))
        nt = self._modulate(txt, chunk(mc, 0), chunk(mc, 1))
        q, k, v = self._qkv(nx, pre, "attn.to_q", "attn.to_k", "attn.to_v", "attn.norm_q", "attn.norm_k")
        qc, kc, vc = self._qkv(nt, pre, "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
                               "attn.norm_added_q", "attn.norm_added_k")
        n_txt = txt.shape[1]
        o = self._attend(ctx, ctx.concatenate([qc, q], axis=1), ctx.concatenate([kc, k], axis=1),
                         ctx.concatenate([vc, v], axis=1), rope)
        x = x + chunk(m, 2)[:, None, :] * self._lin(o[:, n_txt:], pre + "attn.to_out.0")
        x = x + chunk(m, 5)[:, None, :] * self._ff(self._modulate(x, chunk(m, 3), chunk(m, 4)), pre + "ff")
        txt = txt + chunk(mc, 2)[:, None, :] * self._lin(o[:, :n_txt], pre + "attn.to_add_out")
        txt = txt + chunk(mc, 5)[:, None, :] * self._ff(self._modulate(txt, chunk(mc, 3), chunk(mc, 4)),
                                                          pre + "ff_context")
        return x, txt

    def _single(self, ctx: Context, pre: str, h: Tensor, act: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        """``FluxSingleTransformerBlock``: AdaLayerNormZeroSingle, attention and a GELU MLP in parallel, one output
        projection of both, a gated residual."""
        d = self.config.dim
        m = self._lin(act, pre + "norm.linear")  # shift, scale, gate
        nh = self._modulate(h, m[:, :d], m[:, d:2 * d])
        mlp = self._lin(nh, pre + "proj_mlp").gelu(approximate=True)
        q, k, v = self._qkv(nh, pre, "attn.to_q", "attn.to_k", "attn.to_v", "attn.norm_q", "attn.norm_k")
        o = self._attend(ctx, q, k, v, rope)
        out = self._lin(ctx.concatenate([o, mlp], axis=2), pre + "proj_out")
        return h + m[:, None, 2 * d:] * out
