"""The FLUX.2 diffusion transformer on the ``ml`` interfaces: diffusers' ``Flux2Transformer2DModel``.

Reference: diffusers 0.42 ``models/transformers/transformer_flux2.py`` (``Flux2Transformer2DModel.forward``,
``Flux2TransformerBlock``, ``Flux2SingleTransformerBlock``, ``Flux2AttnProcessor``,
``Flux2ParallelSelfAttnProcessor``, ``Flux2PosEmbed``, ``Flux2TimestepGuidanceEmbeddings``, ``Flux2Modulation``,
``Flux2FeedForward``) and ``models/normalization.py`` (``AdaLayerNormContinuous``). One call, as ``forward``::

    t * 1000 (and guidance * 1000) -> sinusoidal features (256) -> MLP each, summed -> temb [B, D]
    temb -> SiLU -> three shared modulations: double-stream image (6D), double-stream text (6D), single-stream (3D)
    image tokens [B, N, C] -> x_embedder ; text features [B, L, J] -> context_embedder        (no biases anywhere)
    num_layers double-stream blocks: separate weights per stream, one joint attention over [text, image]
    num_single_layers single-stream blocks on [text, image]: attention and MLP in parallel from one projection
    image rows -> LayerNorm * (1 + scale) + shift (AdaLayerNormContinuous) -> proj_out [B, N, C]

RoPE (``Flux2PosEmbed``): every token has four position ids ``(t, h, w, l)``; axis ``a`` takes ``axes_dims_rope[a]``
features of each head with angles ``pos * theta ** (-2i / d_a)`` (float64, then float32), and pair ``k`` rotates the
interleaved features ``(2k, 2k + 1)`` (``apply_rotary_emb`` with ``use_real_unbind_dim=-1``). The pipeline gives the
ids: text ``(0, 0, 0, l)``, image ``(0, h, w, 0)``, reference image ``i`` ``(10 + 10 i, h, w, 0)``.

Modulation: ``(shift, scale, gate)`` triples; a stream's input is ``LayerNorm(x) * (1 + scale) + shift`` (no affine
LayerNorm, ``eps`` from the config) and its output is added back times ``gate``. The final norm's chunks come in the
other order, ``(scale, shift)``.

Weights: diffusers' names (``transformer_blocks.N.attn.to_q.weight``, ``single_transformer_blocks.N.attn.to_qkv_mlp_
proj.weight``...) from a ``transformer/`` folder through a ``Backend`` the caller made.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlx_engine.errors import UnsupportedError, WeightsError
from mlx_engine.imagegen.quantize import quantize_linears
from mlx_engine.imagegen.transformer import rotate_pairs, timestep_features
from mlx_engine.ml import Backend, Context, Tensor

__all__ = ["Flux2Config", "Flux2Transformer", "rope_tables"]


@dataclass
class Flux2Config:
    """Hyper-parameters of ``Flux2Transformer2DModel`` (its ``config.json``; defaults are diffusers' ``__init__``).

    Attributes:
        patch_size: 1 (the pipeline packs 2x2 latent patches itself; other values are refused).
        in_channels, out_channels: token width in and out (128: 32 VAE channels times a 2x2 patch).
        num_layers, num_single_layers: double-stream and single-stream blocks.
        attention_head_dim, num_attention_heads: heads; the model width is their product.
        joint_attention_dim: width of the text features (3 stacked hidden states of the text encoder).
        timestep_guidance_channels: width of the sinusoidal timestep (and guidance) features.
        mlp_ratio: the feed-forward hidden width is ``int(dim * mlp_ratio)``.
        axes_dims_rope, rope_theta: 4-axis RoPE (the dims sum to the head dim).
        eps: eps of the LayerNorms and of the per-head RMSNorms.
        guidance_embeds: the model embeds a guidance scale (FLUX.2 dev, guidance-distilled); klein does not.
    """

    patch_size: int = 1
    in_channels: int = 128
    out_channels: int | None = None
    num_layers: int = 8
    num_single_layers: int = 48
    attention_head_dim: int = 128
    num_attention_heads: int = 48
    joint_attention_dim: int = 15360
    timestep_guidance_channels: int = 256
    mlp_ratio: float = 3.0
    axes_dims_rope: tuple[int, ...] = (32, 32, 32, 32)
    rope_theta: float = 2000.0
    eps: float = 1e-6
    guidance_embeds: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def mlp_hidden(self) -> int:
        return int(self.dim * self.mlp_ratio)

    @property
    def out(self) -> int:
        return self.out_channels or self.in_channels

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> "Flux2Config":
        """From ``config.json``'s keys.

        Raises:
            WeightsError: inconsistent values (RoPE dims that do not sum to the head dim).
            UnsupportedError: another ``_class_name``, or a patch size other than 1.
        """
        name = config.get("_class_name")
        if name is not None and name != "Flux2Transformer2DModel":
            raise UnsupportedError(f"transformer: _class_name {name!r} is not supported; expected "
                                   "'Flux2Transformer2DModel'")
        names = {f for f in cls.__dataclass_fields__ if f != "extra"}
        kw: dict[str, Any] = {}
        for k in names:
            if k in config and config[k] is not None:
                v = config[k]
                kw[k] = tuple(int(i) for i in v) if isinstance(v, (list, tuple)) else v
        c = cls(**kw)
        c.extra = {k: v for k, v in config.items() if k not in names}
        if c.patch_size != 1:
            raise UnsupportedError(f"FLUX.2 transformer: patch_size {c.patch_size} is not supported (1 is)")
        if sum(c.axes_dims_rope) != c.attention_head_dim or any(d % 2 for d in c.axes_dims_rope):
            raise WeightsError(f"FLUX.2 transformer config: axes_dims_rope {list(c.axes_dims_rope)} must be even and "
                               f"sum to attention_head_dim {c.attention_head_dim}")
        return c


def rope_tables(ids: np.ndarray, axes_dims: tuple[int, ...], theta: float) -> tuple[np.ndarray, np.ndarray]:
    """RoPE cosines and sines ``[S, head_dim / 2]`` float32 for position ids ``[S, n_axes]`` (diffusers
    ``Flux2PosEmbed.forward`` with ``get_1d_rotary_pos_embed(..., repeat_interleave_real=True, use_real=True,
    freqs_dtype=float64)``: per axis ``a`` the angles ``pos * theta ** (-arange(0, d_a, 2) / d_a)`` in float64, the
    cosines and sines rounded to float32; one value per pair here where diffusers repeats it for both features)."""
    pos = np.asarray(ids).astype(np.float32).astype(np.float64)
    angles = []
    for a, d in enumerate(axes_dims):
        freqs = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64)[: d // 2] / d))
        angles.append(np.outer(pos[:, a], freqs))
    ang = np.concatenate(angles, axis=-1)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


class Flux2Transformer:
    """diffusers' ``Flux2Transformer2DModel`` on the ``ml`` interfaces.

    Build with :meth:`from_backend`; call with :meth:`__call__`. Computes in the backend's ``compute_dtype``; RoPE
    rotates in float32 (as ``apply_rotary_emb``).
    """

    #: Layers kept in float when quantizing: the embedders, the modulations and the output layers (small, and the
    #: ones every token's scale depends on).
    FLOAT_PREFIXES = ("time_guidance_embed.", "x_embedder.", "context_embedder.", "double_stream_modulation_",
                      "single_stream_modulation.", "norm_out.", "proj_out.")

    _DOUBLE = {"q": "attn.to_q", "k": "attn.to_k", "v": "attn.to_v", "o": "attn.to_out.0", "aq": "attn.add_q_proj",
               "ak": "attn.add_k_proj", "av": "attn.add_v_proj", "ao": "attn.to_add_out", "q_norm": "attn.norm_q",
               "k_norm": "attn.norm_k", "aq_norm": "attn.norm_added_q", "ak_norm": "attn.norm_added_k",
               "ff_in": "ff.linear_in", "ff_out": "ff.linear_out", "cff_in": "ff_context.linear_in",
               "cff_out": "ff_context.linear_out"}
    _SINGLE = {"proj": "attn.to_qkv_mlp_proj", "o": "attn.to_out", "q_norm": "attn.norm_q", "k_norm": "attn.norm_k"}

    def __init__(self, config: Flux2Config, weights: dict[str, Tensor], backend: Backend):
        self.config = config
        self.backend = backend
        self.dtype = backend.compute_dtype
        self.w = weights
        c = config
        self.double = [self._named(f"transformer_blocks.{i}.", self._DOUBLE) for i in range(c.num_layers)]
        self.single = [self._named(f"single_transformer_blocks.{i}.", self._SINGLE)
                       for i in range(c.num_single_layers)]
        self._check_shapes()

    @classmethod
    def from_backend(cls, backend: Backend, quantize_bits: int | None = None,
                     group_size: int = 64) -> "Flux2Transformer":
        """Build from a backend loaded on a diffusers ``transformer/`` folder (``backend.metadata`` holds its
        ``config.json``, ``backend.weights`` its tensors by diffusers' names).

        Args:
            quantize_bits: None, 8 or 4: quantize the blocks' linear weights (as
                :func:`mlx_engine.imagegen.quantize.quantize_linears`), keeping :attr:`FLOAT_PREFIXES` float.
            group_size: elements per quantization group.

        Raises:
            WeightsError: a missing tensor, one of the wrong shape, or an inconsistent config (the message names it).
            UnsupportedError: another model class or a patch size other than 1.
            ValueError: ``quantize_bits`` or ``group_size`` out of range.
        """
        config = Flux2Config.from_dict(backend.metadata)
        weights = dict(backend.weights)
        if quantize_bits is not None:
            weights = quantize_linears(backend, weights, quantize_bits, group_size, cls.FLOAT_PREFIXES)
        return cls(config, weights, backend)

    def _named(self, prefix: str, names: dict[str, str]) -> dict[str, Tensor]:
        out = {}
        for key, name in names.items():
            full = prefix + name + ".weight"
            if full not in self.w:
                raise WeightsError(f"the FLUX.2 transformer checkpoint lacks {full}; is it a complete "
                                   "Flux2Transformer2DModel?")
            out[key] = self.w[full]
        return out

    def _check_shapes(self) -> None:
        c = self.config
        d, hd, m = c.dim, c.attention_head_dim, c.mlp_hidden
        tg = c.timestep_guidance_channels
        want = {"x_embedder.weight": (d, c.in_channels), "context_embedder.weight": (d, c.joint_attention_dim),
                "time_guidance_embed.timestep_embedder.linear_1.weight": (d, tg),
                "time_guidance_embed.timestep_embedder.linear_2.weight": (d, d),
                "double_stream_modulation_img.linear.weight": (6 * d, d),
                "double_stream_modulation_txt.linear.weight": (6 * d, d),
                "single_stream_modulation.linear.weight": (3 * d, d),
                "norm_out.linear.weight": (2 * d, d), "proj_out.weight": (c.out, d)}
        if c.guidance_embeds:
            want["time_guidance_embed.guidance_embedder.linear_1.weight"] = (d, tg)
            want["time_guidance_embed.guidance_embedder.linear_2.weight"] = (d, d)
        for i in range(c.num_layers):
            p = f"transformer_blocks.{i}."
            want.update({p + "attn.to_q.weight": (d, d), p + "attn.norm_q.weight": (hd,),
                         p + "ff.linear_in.weight": (2 * m, d), p + "ff.linear_out.weight": (d, m)})
        for i in range(c.num_single_layers):
            p = f"single_transformer_blocks.{i}.attn."
            want.update({p + "to_qkv_mlp_proj.weight": (3 * d + 2 * m, d), p + "to_out.weight": (d, d + m)})
        for name, shape in want.items():
            t = self.w.get(name)
            if t is None:
                raise WeightsError(f"the FLUX.2 transformer checkpoint lacks {name}; is it a complete "
                                   "Flux2Transformer2DModel?")
            got = tuple(t.shape)
            if t.is_quantized:  # packed: only the rows can be checked
                got, shape = got[:1], shape[:1]
            if got != tuple(shape):
                raise WeightsError(f"FLUX.2 transformer tensor {name} has shape {list(t.shape)}, expected "
                                   f"{list(shape)} from the config")

    # ---- forward -----------------------------------------------------------------------------------------------
    def __call__(self, ctx: Context, x: Tensor, img_ids: np.ndarray, txt: Tensor, txt_ids: np.ndarray,
                 t: "np.ndarray | float", guidance: "np.ndarray | float | None" = None) -> Tensor:
        """One evaluation, as diffusers' ``forward(hidden_states, encoder_hidden_states, timestep, img_ids, txt_ids,
        guidance)`` (``[0]``).

        Args:
            ctx: the context of this step.
            x: image tokens ``[B, N, in_channels]`` (the packed noisy latents, then any reference-image tokens), any
                float dtype.
            img_ids: their position ids ``[N, 4]`` (integers; shared by the batch, as diffusers uses ``img_ids[0]``).
            txt: text features ``[B, L, joint_attention_dim]``.
            txt_ids: their position ids ``[L, 4]``.
            t: ``[B]`` timesteps as the pipeline passes them, ``timestep / 1000`` = sigma (multiplied by 1000 here,
                in float32, as diffusers does).
            guidance: ``[B]`` guidance scales for a guidance-distilled model (multiplied by 1000 here), or None
                (klein; ignored by a model without ``guidance_embeds``).

        Returns:
            ``[B, N, out_channels]`` in the compute dtype: the flow-matching velocity of every image token (the
            pipeline keeps the first rows, those of the noisy latents).

        Raises:
            ValueError: shapes that disagree with each other or with the config.
        """
        c = self.config
        if x.ndim != 3 or x.shape[2] != c.in_channels:
            raise ValueError(f"FLUX.2 transformer: image tokens must be [B, N, {c.in_channels}], got {x.shape}")
        if txt.ndim != 3 or txt.shape[0] != x.shape[0] or txt.shape[2] != c.joint_attention_dim:
            raise ValueError(f"FLUX.2 transformer: text features must be [{x.shape[0]}, L, {c.joint_attention_dim}], "
                             f"got {txt.shape}")
        bsz, n, _ = x.shape
        lt = txt.shape[1]
        img_ids, txt_ids = np.asarray(img_ids), np.asarray(txt_ids)
        if img_ids.shape != (n, len(c.axes_dims_rope)) or txt_ids.shape != (lt, len(c.axes_dims_rope)):
            raise ValueError(f"FLUX.2 transformer: ids {img_ids.shape} / {txt_ids.shape} do not match {n} image and "
                             f"{lt} text tokens of {len(c.axes_dims_rope)} axes")
        dt = self.dtype
        temb = self._time_embedding(ctx, t, guidance, bsz)
        act = temb.silu()
        mod_img = act.linear(self.w["double_stream_modulation_img.linear.weight"])[:, None, :]
        mod_txt = act.linear(self.w["double_stream_modulation_txt.linear.weight"])[:, None, :]
        mod_single = act.linear(self.w["single_stream_modulation.linear.weight"])[:, None, :]

        h = (x if x.dtype == dt else x.astype(dt)).linear(self.w["x_embedder.weight"])
        e = (txt if txt.dtype == dt else txt.astype(dt)).linear(self.w["context_embedder.weight"])
        cos, sin = rope_tables(np.concatenate([txt_ids, img_ids]), c.axes_dims_rope, c.rope_theta)
        rope = (ctx.from_numpy(cos[None, :, None, :]), ctx.from_numpy(sin[None, :, None, :]))

        for b in self.double:
            e, h = self._double_block(ctx, b, h, e, mod_img, mod_txt, rope)
        s = ctx.concatenate([e, h], axis=1)
        for b in self.single:
            s = self._single_block(ctx, b, s, mod_single, rope)
        h = s[:, lt:]

        emb = act.linear(self.w["norm_out.linear.weight"])
        d = c.dim
        scale, shift = emb[:, None, :d], emb[:, None, d:]
        h = h.layer_norm(None, None, c.eps) * (scale + 1.0) + shift
        return h.linear(self.w["proj_out.weight"])

    def _time_embedding(self, ctx: Context, t: Any, guidance: Any, bsz: int) -> Tensor:
        """``Flux2TimestepGuidanceEmbeddings``: ``MLP_t(features(1000 t)) [+ MLP_g(features(1000 g))]``, ``[B, D]``."""
        c = self.config
        emb = self._embed(ctx, "timestep_embedder", self._per_item(t, bsz, "timesteps"))
        if guidance is not None and c.guidance_embeds:
            emb = emb + self._embed(ctx, "guidance_embedder", self._per_item(guidance, bsz, "guidance scales"))
        return emb

    def _embed(self, ctx: Context, which: str, values: np.ndarray) -> Tensor:
        """``TimestepEmbedding`` (linear, SiLU, linear; no biases) of ``Timesteps(flip_sin_to_cos=True,
        downscale_freq_shift=0)`` of ``values * 1000`` (float32, as ``timestep.to(dtype) * 1000``)."""
        p = f"time_guidance_embed.{which}."
        feats = timestep_features(values * np.float32(1000.0), self.config.timestep_guidance_channels)
        e = ctx.from_numpy(feats, self.dtype).linear(self.w[p + "linear_1.weight"]).silu()
        return e.linear(self.w[p + "linear_2.weight"])

    @staticmethod
    def _per_item(v: Any, bsz: int, what: str) -> np.ndarray:
        arr = np.asarray(v, dtype=np.float32).reshape(-1)
        if arr.size == 1:
            arr = np.full(bsz, arr[0], np.float32)
        if arr.size != bsz:
            raise ValueError(f"FLUX.2 transformer: {arr.size} {what} for a batch of {bsz}")
        return arr

    @staticmethod
    def _modulate(x: Tensor, mod: Tensor, k: int, d: int, eps: float) -> Tensor:
        """``LayerNorm(x) * (1 + scale) + shift`` with the ``k``-th ``(shift, scale, gate)`` triple of ``mod``."""
        shift = mod[:, :, (3 * k) * d:(3 * k + 1) * d]
        scale = mod[:, :, (3 * k + 1) * d:(3 * k + 2) * d]
        return x.layer_norm(None, None, eps) * (scale + 1.0) + shift

    @staticmethod
    def _gate(mod: Tensor, k: int, d: int) -> Tensor:
        return mod[:, :, (3 * k + 2) * d:(3 * k + 3) * d]

    def _heads(self, x: Tensor, weight: Tensor, norm: Tensor) -> Tensor:
        """``x [B, S, D] -> [B, S, H, Dh]`` through ``weight``, then the per-head RMSNorm."""
        c = self.config
        b, s, _ = x.shape
        return x.linear(weight).reshape(b, s, c.num_attention_heads, c.attention_head_dim).rms_norm(norm, c.eps)

    def _attend(self, ctx: Context, q: Tensor, k: Tensor, v: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        """RoPE on ``q, k [B, S, H, Dh]``, then unmasked attention (scale ``Dh^-1/2``); ``[B, S, H * Dh]``."""
        c = self.config
        b, s = q.shape[:2]
        q = rotate_pairs(ctx, q, *rope).transpose(0, 2, 1, 3)
        k = rotate_pairs(ctx, k, *rope).transpose(0, 2, 1, 3)
        o = ctx.scaled_dot_product_attention(q, k, v.transpose(0, 2, 1, 3), c.attention_head_dim ** -0.5)
        return o.transpose(0, 2, 1, 3).reshape(b, s, c.dim)

    @staticmethod
    def _swiglu(x: Tensor) -> Tensor:
        """``Flux2SwiGLU``: ``silu(first half) * second half`` of the last axis."""
        half = x.shape[-1] // 2
        return x[..., :half].silu() * x[..., half:]

    def _double_block(self, ctx: Context, b: dict, h: Tensor, e: Tensor, mod_img: Tensor, mod_txt: Tensor,
                      rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """``Flux2TransformerBlock.forward``: image ``h [B, N, D]`` and text ``e [B, L, D]`` -> ``(e, h)``."""
        c = self.config
        d, eps = c.dim, c.eps
        nh = self._modulate(h, mod_img, 0, d, eps)
        ne = self._modulate(e, mod_txt, 0, d, eps)
        q = ctx.concatenate([self._heads(ne, b["aq"], b["aq_norm"]), self._heads(nh, b["q"], b["q_norm"])], axis=1)
        k = ctx.concatenate([self._heads(ne, b["ak"], b["ak_norm"]), self._heads(nh, b["k"], b["k_norm"])], axis=1)
        bsz, lt = e.shape[:2]
        v = ctx.concatenate([ne.linear(b["av"]), nh.linear(b["v"])], axis=1)
        v = v.reshape(bsz, v.shape[1], c.num_attention_heads, c.attention_head_dim)
        o = self._attend(ctx, q, k, v, rope)
        h = h + self._gate(mod_img, 0, d) * o[:, lt:].linear(b["o"])
        e = e + self._gate(mod_txt, 0, d) * o[:, :lt].linear(b["ao"])
        ff = self._swiglu(self._modulate(h, mod_img, 1, d, eps).linear(b["ff_in"])).linear(b["ff_out"])
        h = h + self._gate(mod_img, 1, d) * ff
        ff = self._swiglu(self._modulate(e, mod_txt, 1, d, eps).linear(b["cff_in"])).linear(b["cff_out"])
        e = e + self._gate(mod_txt, 1, d) * ff
        return e, h

    def _single_block(self, ctx: Context, b: dict, s: Tensor, mod: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        """``Flux2SingleTransformerBlock.forward`` on ``s [B, L + N, D]``: one projection to Q, K, V and the MLP's
        input; attention and SwiGLU side by side; one output projection of both."""
        c = self.config
        d = c.dim
        bsz, n, _ = s.shape
        p = self._modulate(s, mod, 0, d, c.eps).linear(b["proj"])
        heads = (bsz, n, c.num_attention_heads, c.attention_head_dim)
        q = p[..., :d].reshape(*heads).rms_norm(b["q_norm"], c.eps)
        k = p[..., d:2 * d].reshape(*heads).rms_norm(b["k_norm"], c.eps)
        v = p[..., 2 * d:3 * d].reshape(*heads)
        o = self._attend(ctx, q, k, v, rope)
        out = ctx.concatenate([o, self._swiglu(p[..., 3 * d:])], axis=-1).linear(b["o"])
        return s + self._gate(mod, 0, d) * out
