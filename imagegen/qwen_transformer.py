"""The Qwen-Image diffusion transformer on the ``ml`` interfaces: diffusers' ``QwenImageTransformer2DModel``.

Reference: diffusers ``models/transformers/transformer_qwenimage.py`` (``QwenImageTransformer2DModel``,
``QwenImageTransformerBlock``, ``QwenDoubleStreamAttnProcessor2_0``, ``QwenTimestepProjEmbeddings``,
``QwenEmbedRope``), ``models/normalization.py`` (``AdaLayerNormContinuous``, ``RMSNorm``), ``models/attention.py``
(``FeedForward`` with ``gelu-approximate``). The architecture is an MMDiT (Esser et al. 2024, "Scaling Rectified Flow
Transformers for High-Resolution Image Synthesis"): two streams, image and text, each with its own weights, that meet
in one joint attention per block. The flow of one call::

    t (= sigma) -> sinusoidal features (256, [cos, sin], t * f * 1000) -> Linear, SiLU, Linear -> temb [B, D]
    packed latents [B, N, 4C] -> img_in -> image stream [B, N, D]
    text features [B, L, D_text] -> RMSNorm -> txt_in -> text stream [B, L, D]
    per block: each stream: LayerNorm, x * (1 + scale) + shift (its own 6 D modulation of SiLU(temb))
               joint attention over [text, image] (per-stream Q/K/V, per-head RMSNorm of Q and K, RoPE, one SDPA,
               per-stream output projections); gated residual; LayerNorm, modulation, GELU(tanh) MLP; gated residual
    image stream -> LayerNorm * (1 + scale) + shift (AdaLayerNormContinuous: scale first) -> proj_out [B, N, 4C_out]

RoPE (``QwenEmbedRope`` with ``scale_rope=True``, theta 10000): the head's features are split by ``axes_dims_rope``
(frame, height, width); pair ``i`` of an axis with ``d`` features at position ``p`` turns by ``p * theta ** (-2i/d)``
(float32, as diffusers) and rotates the interleaved features ``(2i, 2i + 1)`` (complex multiplication). An image of
``h x w`` patches sits at frame 0 with heights ``-(h - h // 2) .. h // 2 - 1`` and widths likewise (centred); text
token ``j`` sits at ``max(h // 2, w // 2) + j`` on all three axes (after the image's positions). An edit's input
images (Qwen-Image-Edit) follow the image in the sequence at frames 1, 2, ..., each centred likewise; the text then
starts after the largest half-side of them all.

Padding: text features of a batch are padded to the longest; the mask hides the padded keys (diffusers' joint
attention mask ``[text_mask, ones]``). The output is the flow-matching velocity (the pipeline steps with it as is).

Weights: diffusers' names (``transformer_blocks.N.attn.to_q.weight``, ``img_in.weight``...), read from a
``transformer/`` folder through a ``Backend`` the caller made. Guidance-distilled checkpoints (``guidance_embeds``),
``zero_cond_t`` (Qwen-Image-Edit-2511), ``use_additional_t_cond`` and the layered RoPE are refused.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlx_engine.errors import UnsupportedError, WeightsError
from mlx_engine.imagegen.quantize import quantize_linears
from mlx_engine.imagegen.transformer import rotate_pairs, timestep_features
from mlx_engine.ml import Backend, Context, DType, Tensor

__all__ = ["QwenImageConfig", "QwenImageTransformer", "rope_positions"]

ROPE_THETA = 10000.0  # QwenEmbedRope(theta=10000) in QwenImageTransformer2DModel.__init__
NORM_EPS = 1e-6  # the blocks' LayerNorms and RMSNorms, txt_norm and norm_out


@dataclass(frozen=True)
class QwenImageConfig:
    """Hyper-parameters of ``QwenImageTransformer2DModel`` (its ``config.json``; defaults are diffusers'
    ``__init__``, the released Qwen-Image's values).

    Attributes:
        patch_size: spatial patch side (the latents are packed 2x2 by the pipeline).
        in_channels: packed input width (``4 * 16`` latent channels). out_channels: latent channels of the output
            (the output is ``patch_size ** 2 * out_channels`` wide).
        num_layers: double-stream blocks. attention_head_dim, num_attention_heads: ``D = heads * head_dim``.
        joint_attention_dim: width of the text encoder's hidden states.
        axes_dims_rope: features of the head given to the frame, height and width axes (sum ``head_dim``).
    """

    patch_size: int = 2
    in_channels: int = 64
    out_channels: int = 16
    num_layers: int = 60
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)

    @property
    def dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> "QwenImageConfig":
        """From ``config.json``'s keys.

        Raises:
            UnsupportedError: a variant this engine does not run (``guidance_embeds``, ``zero_cond_t``,
                ``use_additional_t_cond``, ``use_layer3d_rope``).
            WeightsError: inconsistent values (the message names them).
        """
        for key in ("guidance_embeds", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope"):
            if config.get(key):
                raise UnsupportedError(f"Qwen-Image transformer: {key}=true is not supported")
        kw: dict[str, Any] = {}
        for k in cls.__dataclass_fields__:
            if config.get(k) is not None:
                v = config[k]
                kw[k] = tuple(int(i) for i in v) if isinstance(v, (list, tuple)) else int(v)
        c = cls(**kw)
        if config.get("out_channels") is None:
            c = cls(**{**kw, "out_channels": c.in_channels})  # diffusers: out_channels or in_channels
        if len(c.axes_dims_rope) != 3 or sum(c.axes_dims_rope) != c.attention_head_dim or \
                any(d % 2 for d in c.axes_dims_rope):
            raise WeightsError(f"Qwen-Image transformer config: axes_dims_rope {list(c.axes_dims_rope)} must be three "
                               f"even numbers summing to attention_head_dim {c.attention_head_dim}")
        if min(c.patch_size, c.in_channels, c.out_channels, c.num_layers, c.num_attention_heads,
               c.attention_head_dim, c.joint_attention_dim) < 1:
            raise WeightsError(f"Qwen-Image transformer config: a size is not positive: {config}")
        return c


def rope_positions(shapes: "Sequence[tuple[int, int, int]]", text_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Position ids ``(image [sum F*h*w, 3], text [text_len, 3])`` int64 of ``QwenEmbedRope(scale_rope=True)`` for
    the images of ``shapes`` (each ``frames x height x width`` patches; image ``i``'s frames start at frame index
    ``i``: the generated image, then an edit's input images) and ``text_len`` text tokens, which start after the
    largest half-side."""
    grids = []
    for i, (frames, height, width) in enumerate(shapes):
        grid = np.stack(np.meshgrid(i + np.arange(frames), np.arange(height) - (height - height // 2),
                                    np.arange(width) - (width - width // 2), indexing="ij"), -1)
        grids.append(grid.reshape(-1, 3))
    start = max(max(h // 2, w // 2) for _, h, w in shapes)
    text = np.repeat((start + np.arange(text_len, dtype=np.int64))[:, None], 3, axis=1)
    return np.concatenate(grids).astype(np.int64), text


class _Tables:
    """Host-side RoPE tables and key mask of one call shape; copied to a context once (:meth:`bind`)."""

    def __init__(self, model: "QwenImageTransformer", shapes: "tuple[tuple[int, int, int], ...]", text_len: int,
                 text_mask: np.ndarray | None):
        img_pos, txt_pos = rope_positions(shapes, text_len)
        ang = model.angles(np.concatenate([txt_pos, img_pos]))  # joint order: [text, image]
        self.cos = np.cos(ang.astype(np.float64)).astype(np.float32)[None, :, None, :]
        self.sin = np.sin(ang.astype(np.float64)).astype(np.float32)[None, :, None, :]
        self.mask = None
        if text_mask is not None and not text_mask.all():
            keys = np.concatenate([text_mask, np.ones((text_mask.shape[0], len(img_pos)), bool)], axis=1)
            self.mask = np.where(keys, 0.0, -np.inf).astype(np.float32)[:, None, None, :]
        self._ctx: Context | None = None
        self.dev: tuple[Tensor, Tensor, Tensor | None] | None = None

    def bind(self, ctx: Context, dtype: DType) -> tuple[Tensor, Tensor, Tensor | None]:
        if self._ctx is not ctx:
            mask = None if self.mask is None else ctx.from_numpy(self.mask, dtype)
            self.dev = (ctx.from_numpy(self.cos), ctx.from_numpy(self.sin), mask)
            self._ctx = ctx
        return self.dev


class QwenImageTransformer:
    """diffusers' ``QwenImageTransformer2DModel`` on the ``ml`` interfaces.

    Build with :meth:`from_backend`; call with :meth:`__call__`. Computes in the backend's ``compute_dtype``; RoPE
    runs in float32 (as diffusers' ``apply_rotary_emb_qwen``).
    """

    #: Layers kept in float when quantizing: the embedders and the output layers (small, and they set the scale of
    #: everything else).
    FLOAT_PREFIXES = ("time_text_embed.", "txt_norm.", "img_in.", "txt_in.", "norm_out.", "proj_out.")

    _BLOCK = ("img_mod.1", "txt_mod.1", "attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj",
              "attn.add_v_proj", "attn.to_out.0", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2",
              "txt_mlp.net.0.proj", "txt_mlp.net.2")
    _BLOCK_NORMS = ("attn.norm_q", "attn.norm_k", "attn.norm_added_q", "attn.norm_added_k")
    _TOP = ("time_text_embed.timestep_embedder.linear_1", "time_text_embed.timestep_embedder.linear_2", "img_in",
            "txt_in", "norm_out.linear", "proj_out")

    def __init__(self, config: QwenImageConfig, weights: dict[str, Tensor], backend: Backend):
        self.config = config
        self.backend = backend
        self.dtype = backend.compute_dtype
        self.w = weights
        need = [f"{n}.{s}" for n in self._TOP for s in ("weight", "bias")] + ["txt_norm.weight"]
        for i in range(config.num_layers):
            need += [f"transformer_blocks.{i}.{n}.{s}" for n in self._BLOCK for s in ("weight", "bias")]
            need += [f"transformer_blocks.{i}.{n}.weight" for n in self._BLOCK_NORMS]
        missing = [n for n in need if n not in weights]
        if missing:
            raise WeightsError(f"the Qwen-Image transformer checkpoint lacks {len(missing)} tensors, e.g. "
                               f"{', '.join(missing[:3])}; is it a complete QwenImageTransformer2DModel?")
        # per-axis inverse frequencies 1 / theta ** (2i / d), float32 as QwenEmbedRope.rope_params keeps them
        self._inv_freqs = [(1.0 / ROPE_THETA ** (np.arange(0, d, 2, dtype=np.float64) / d)).astype(np.float32)
                           for d in config.axes_dims_rope]
        self._tables: "OrderedDict[Any, _Tables]" = OrderedDict()

    @classmethod
    def from_backend(cls, backend: Backend, quantize_bits: int | None = None,
                     group_size: int = 64) -> "QwenImageTransformer":
        """Build from a backend loaded on a diffusers ``transformer/`` folder (``backend.metadata`` holds its
        ``config.json``).

        Args:
            quantize_bits: None, 8 or 4: quantize the blocks' linear weights (see
                :func:`mlx_engine.imagegen.quantize.quantize_linears`); :attr:`FLOAT_PREFIXES` stay float.
            group_size: elements per quantization group (32, 64 or 128).

        Raises:
            WeightsError: a missing tensor or an inconsistent config. UnsupportedError: see
            :meth:`QwenImageConfig.from_dict`. ValueError: bad ``quantize_bits`` or ``group_size``.
        """
        config = QwenImageConfig.from_dict(backend.metadata)
        weights = dict(backend.weights)
        if quantize_bits is not None:
            weights = quantize_linears(backend, weights, quantize_bits, group_size, cls.FLOAT_PREFIXES)
        return cls(config, weights, backend)

    # ---- host-side tables ----------------------------------------------------------------------------------------
    def angles(self, positions: np.ndarray) -> np.ndarray:
        """RoPE angles ``[n, head_dim / 2]`` float32 of position ids ``[n, 3]`` (each axis' pairs in turn)."""
        # index * inv_freq rounded once to float32, as torch.outer of an int64 index and a float32 vector
        parts = [(positions[:, a:a + 1].astype(np.float64) * inv[None].astype(np.float64)).astype(np.float32)
                 for a, inv in enumerate(self._inv_freqs)]
        return np.concatenate(parts, axis=1)

    def _bind(self, ctx: Context, shapes: "tuple[tuple[int, int, int], ...]", text_len: int,
              text_mask: np.ndarray | None) -> tuple[Tensor, Tensor, Tensor | None]:
        key = (shapes, text_len, None if text_mask is None else text_mask.tobytes(),
               None if text_mask is None else text_mask.shape)
        tab = self._tables.get(key)
        if tab is None:
            tab = self._tables[key] = _Tables(self, shapes, text_len, text_mask)
            while len(self._tables) > 4:
                self._tables.popitem(last=False)
        self._tables.move_to_end(key)
        return tab.bind(ctx, self.dtype)

    # ---- forward -------------------------------------------------------------------------------------------------
    def __call__(self, ctx: Context, x: Tensor, t: "np.ndarray | Sequence[float] | float", text: Tensor,
                 img_shape: "tuple[int, int, int] | Sequence[tuple[int, int, int]]",
                 text_mask: np.ndarray | None = None) -> Tensor:
        """One transformer evaluation, as diffusers' ``QwenImageTransformer2DModel.forward(hidden_states,
        encoder_hidden_states, encoder_hidden_states_mask, timestep, img_shapes)[0]``.

        Args:
            ctx: the context of this step.
            x: packed latents ``[B, N, in_channels]``, ``N = F * h * w`` patches in (frame, row, column) order.
            t: ``[B]`` (or one) timesteps as the pipeline passes them: ``timestep / 1000``, i.e. sigma in [0, 1].
            text: text features ``[B, L, joint_attention_dim]`` (rows beyond an item's length are padding).
            img_shape: ``(F, h, w)`` in patches, the same for every item (diffusers' ``img_shapes[i][0]``), or a
                sequence of them (diffusers' ``img_shapes[i]``): the image to denoise, then an edit's input images,
                whose latents follow in ``x``.
            text_mask: bool ``[B, L]``, True for real text tokens (None: all real).

        Returns:
            ``[B, N, patch_size ** 2 * out_channels]`` in the compute dtype: the velocity the scheduler steps with.

        Raises:
            ValueError: shapes that do not fit the config or each other.
        """
        c = self.config
        shapes = ((img_shape,) if np.ndim(img_shape) == 1 else tuple(img_shape))
        shapes = tuple(tuple(int(v) for v in s) for s in shapes)
        patches = sum(int(np.prod(s)) for s in shapes)
        if x.ndim != 3 or x.shape[2] != c.in_channels or x.shape[1] != patches:
            raise ValueError(f"Qwen-Image transformer: latents must be [B, {patches}, "
                             f"{c.in_channels}] for image shapes {list(shapes)}, got {x.shape}")
        bsz, n = x.shape[0], x.shape[1]
        if text.ndim != 3 or text.shape[0] != bsz or text.shape[2] != c.joint_attention_dim or text.shape[1] < 1:
            raise ValueError(f"Qwen-Image transformer: text features must be [{bsz}, L > 0, "
                             f"{c.joint_attention_dim}], got {text.shape}")
        length = text.shape[1]
        if text_mask is not None:
            text_mask = np.asarray(text_mask, bool)
            if text_mask.shape != (bsz, length):
                raise ValueError(f"Qwen-Image transformer: text mask {text_mask.shape} is not {(bsz, length)}")
        t_host = np.asarray(t, np.float32).reshape(-1)
        if t_host.size == 1:
            t_host = np.full(bsz, t_host[0], np.float32)
        if t_host.size != bsz:
            raise ValueError(f"Qwen-Image transformer: {t_host.size} timesteps for a batch of {bsz}")
        cos, sin, mask = self._bind(ctx, shapes, length, text_mask)
        dt, w = self.dtype, self.w

        # QwenTimestepProjEmbeddings: Timesteps(256, flip_sin_to_cos=True, shift 0, scale 1000), TimestepEmbedding
        temb = ctx.from_numpy(timestep_features(t_host, scale=1000.0), dt)
        temb = temb.linear(w["time_text_embed.timestep_embedder.linear_1.weight"],
                           w["time_text_embed.timestep_embedder.linear_1.bias"]).silu()
        temb = temb.linear(w["time_text_embed.timestep_embedder.linear_2.weight"],
                           w["time_text_embed.timestep_embedder.linear_2.bias"])
        act = temb.silu()

        img = (x if x.dtype == dt else x.astype(dt)).linear(w["img_in.weight"], w["img_in.bias"])
        txt = (text if text.dtype == dt else text.astype(dt)).rms_norm(w["txt_norm.weight"], NORM_EPS)
        txt = txt.linear(w["txt_in.weight"], w["txt_in.bias"])
        for i in range(c.num_layers):
            txt, img = self._block(ctx, f"transformer_blocks.{i}.", img, txt, act, cos, sin, mask)

        # AdaLayerNormContinuous: scale, shift = chunk(linear(silu(temb)), 2)
        mod = act.linear(w["norm_out.linear.weight"], w["norm_out.linear.bias"])[:, None, :]
        d = c.dim
        img = img.layer_norm(None, None, NORM_EPS) * (mod[:, :, :d] + 1.0) + mod[:, :, d:]
        out = img.linear(w["proj_out.weight"], w["proj_out.bias"])
        return out.reshape(bsz, n, out.shape[-1])

    def _lin(self, x: Tensor, name: str) -> Tensor:
        return x.linear(self.w[name + ".weight"], self.w[name + ".bias"])

    def _block(self, ctx: Context, p: str, img: Tensor, txt: Tensor, act: Tensor, cos: Tensor, sin: Tensor,
               mask: Tensor | None) -> tuple[Tensor, Tensor]:
        """``QwenImageTransformerBlock.forward``: returns ``(text, image)`` streams as diffusers does."""
        d = self.config.dim
        im = self._lin(act, p + "img_mod.1")[:, None, :]  # [B, 1, 6D]: (shift, scale, gate) x (attn, mlp)
        tm = self._lin(act, p + "txt_mod.1")[:, None, :]

        def modulate(x: Tensor, m: Tensor, k: int) -> tuple[Tensor, Tensor]:
            shift, scale, gate = (m[:, :, (3 * k + j) * d:(3 * k + j + 1) * d] for j in range(3))
            return x.layer_norm(None, None, NORM_EPS) * (scale + 1.0) + shift, gate

        img_in, img_gate = modulate(img, im, 0)
        txt_in, txt_gate = modulate(txt, tm, 0)
        img_attn, txt_attn = self._attention(ctx, p, img_in, txt_in, cos, sin, mask)
        img = img + img_gate * img_attn
        txt = txt + txt_gate * txt_attn

        img_in, img_gate = modulate(img, im, 1)
        img = img + img_gate * self._mlp(p + "img_mlp.", img_in)
        txt_in, txt_gate = modulate(txt, tm, 1)
        txt = txt + txt_gate * self._mlp(p + "txt_mlp.", txt_in)
        return txt, img

    def _mlp(self, p: str, x: Tensor) -> Tensor:
        """``FeedForward(activation_fn="gelu-approximate")``: Linear, GELU (tanh), Linear."""
        return self._lin(self._lin(x, p + "net.0.proj").gelu(approximate=True), p + "net.2")

    def _attention(self, ctx: Context, p: str, img: Tensor, txt: Tensor, cos: Tensor, sin: Tensor,
                   mask: Tensor | None) -> tuple[Tensor, Tensor]:
        """``QwenDoubleStreamAttnProcessor2_0``: joint attention over ``[text, image]``; returns the image and text
        outputs after their own output projections."""
        c = self.config
        heads, hd = c.num_attention_heads, c.attention_head_dim
        bsz, n, _ = img.shape
        lt = txt.shape[1]
        w = self.w

        def qkv(x: Tensor, names: tuple[str, str, str], norms: tuple[str, str]) -> list[Tensor]:
            rows = x.shape[1]
            q, k, v = (self._lin(x, p + "attn." + nm).reshape(bsz, rows, heads, hd) for nm in names)
            q = q.rms_norm(w[p + "attn." + norms[0] + ".weight"], NORM_EPS)
            k = k.rms_norm(w[p + "attn." + norms[1] + ".weight"], NORM_EPS)
            return [q, k, v]

        iq, ik, iv = qkv(img, ("to_q", "to_k", "to_v"), ("norm_q", "norm_k"))
        tq, tk, tv = qkv(txt, ("add_q_proj", "add_k_proj", "add_v_proj"), ("norm_added_q", "norm_added_k"))
        q = rotate_pairs(ctx, ctx.concatenate([tq, iq], axis=1), cos, sin).transpose(0, 2, 1, 3)
        k = rotate_pairs(ctx, ctx.concatenate([tk, ik], axis=1), cos, sin).transpose(0, 2, 1, 3)
        v = ctx.concatenate([tv, iv], axis=1).transpose(0, 2, 1, 3)
        o = ctx.scaled_dot_product_attention(q, k, v, hd ** -0.5, mask)
        o = o.transpose(0, 2, 1, 3).reshape(bsz, lt + n, heads * hd)
        return self._lin(o[:, lt:], p + "attn.to_out.0"), self._lin(o[:, :lt], p + "attn.to_add_out")
