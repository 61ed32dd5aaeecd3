"""The Z-Image diffusion transformer on the ``ml`` interfaces: diffusers' ``ZImageTransformer2DModel``.

Reference: diffusers 0.42 ``models/transformers/transformer_z_image.py`` (``ZImageTransformer2DModel``,
``ZImageTransformerBlock``, ``ZSingleStreamAttnProcessor``, ``FinalLayer``, ``TimestepEmbedder``, ``RopeEmbedder``),
basic (non-omni) mode. The flow of one call, as diffusers' ``forward``::

    t -> sinusoidal embedding (256) -> MLP -> adaln_input [B, A]              (A = min(dim, 256))
    latents [C, F, H, W] -> patches [n, pF*pH*pW*C] -> x_embedder -> pad to a multiple of 32 with x_pad_token
        -> noise_refiner blocks (adaLN-modulated)
    caption features [L, D_text] -> RMSNorm + Linear -> pad to a multiple of 32 with cap_pad_token
        -> context_refiner blocks (no modulation)
    per item [image tokens, caption tokens] -> main blocks (adaLN-modulated) -> final layer -> unpatchify

Conventions kept exactly as diffusers (documented at :meth:`ZImageTransformer.__call__`): the timestep ``t`` is what
``ZImagePipeline`` passes, ``(1000 - timestep) / 1000`` = ``1 - sigma`` (in [0, 1], scaled by ``t_scale`` inside), and
the output is the *negated* flow-matching velocity: the pipeline computes ``noise_pred = -output`` before the
scheduler step. Neither convention is applied here.

Sequence layout (diffusers' ``patchify_and_embed`` / ``_pad_with_ids`` / ``_prepare_sequence``):

- a caption of ``L`` tokens is padded to ``Lc = L + (-L) % 32`` tokens; the pad rows become ``cap_pad_token`` after
  the embedder. Caption token ``j < Lc`` (pad rows included) has RoPE position ids ``(1 + j, 0, 0)``;
- an image of ``n = (F/pF)(H/pH)(W/pW)`` patches is padded to ``Lx = n + (-n) % 32`` tokens (pad rows become
  ``x_pad_token``); patch ``(f, h, w)`` has position ids ``(Lc + 1 + f, h, w)``, pad rows ``(0, 0, 0)``;
- items of a batch with different lengths are padded with zeros to the longest, and attention hides those keys
  (an additive mask ``[B, 1, 1, L]``: ``0`` for the item's own tokens, ``-inf`` beyond). The 32-padding tokens are
  real tokens: every token sees them. When all items have the same length there is no mask, as in diffusers.

RoPE (``RopeEmbedder``): per axis ``a`` with ``d_a`` dims (``sum(axes_dims) = head_dim``), the angle of pair ``i`` at
position ``p`` is ``p * theta ** (-2i / d_a)`` (float64, then float32 as diffusers); the pairs of the three axes are
concatenated, and pair ``k`` rotates the interleaved features ``(2k, 2k + 1)`` of a head (``torch.view_as_complex``).
The cos/sin tables are built on the host with NumPy and applied with elementwise ops.

Weights: the diffusers names (``layers.N.attention.to_q.weight``, ``all_x_embedder.2-1.weight``...), read from a
``transformer/`` folder (``config.json`` + ``diffusion_pytorch_model*.safetensors``, sharded or not) through a
``Backend`` the caller made. The SigLIP (omni) parts are not supported.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlx_engine.errors import UnsupportedError, WeightsError
from mlx_engine.imagegen.quantize import quantize_linears
from mlx_engine.ml import Backend, Context, DType, Tensor

__all__ = ["ZImageConfig", "ZImageTransformer", "ADALN_EMBED_DIM", "SEQ_MULTI_OF", "rotate_pairs", "timestep_features"]

#: Width of the timestep embedding fed to the adaLN layers is ``min(dim, ADALN_EMBED_DIM)`` (diffusers' constant).
ADALN_EMBED_DIM = 256
#: Image and caption token sequences are padded to a multiple of this (diffusers' ``SEQ_MULTI_OF``).
SEQ_MULTI_OF = 32
#: Width of the sinusoidal timestep features (``TimestepEmbedder.frequency_embedding_size``).
FREQUENCY_EMBEDDING_SIZE = 256
#: ``eps`` of the per-head query/key RMSNorm (diffusers' ``Attention(..., eps=1e-5)``, independent of ``norm_eps``).
QK_NORM_EPS = 1e-5
#: ``eps`` of the final layer's LayerNorm (no affine parameters).
FINAL_NORM_EPS = 1e-6


@dataclass
class ZImageConfig:
    """Hyper-parameters of ``ZImageTransformer2DModel`` (its ``config.json``; defaults are diffusers' ``__init__``).

    Attributes:
        all_patch_size, all_f_patch_size: the supported (spatial, frame) patch sizes, pairwise; each pair has its
            own ``all_x_embedder.{p}-{f}`` and ``all_final_layer.{p}-{f}``.
        in_channels: latent channels (16 for the FLUX VAE); the output has as many.
        dim: model width; ``n_heads`` heads of ``dim // n_heads`` features (``n_kv_heads`` is ignored: diffusers'
            attention has as many key/value heads as query heads).
        n_layers, n_refiner_layers: main blocks; noise-refiner and context-refiner blocks (each).
        norm_eps: eps of the blocks' RMSNorms and of the caption embedder's RMSNorm.
        qk_norm: per-head RMSNorm of queries and keys.
        cap_feat_dim: width of the text encoder's hidden states.
        rope_theta, axes_dims, axes_lens: 3-axis RoPE (``sum(axes_dims) == dim // n_heads``; positions on axis ``a``
            must stay below ``axes_lens[a]``).
        t_scale: the timestep is multiplied by it before the sinusoidal embedding.
    """

    all_patch_size: tuple[int, ...] = (2,)
    all_f_patch_size: tuple[int, ...] = (1,)
    in_channels: int = 16
    dim: int = 3840
    n_layers: int = 30
    n_refiner_layers: int = 2
    n_heads: int = 30
    n_kv_heads: int = 30
    norm_eps: float = 1e-5
    qk_norm: bool = True
    cap_feat_dim: int = 2560
    rope_theta: float = 256.0
    t_scale: float = 1000.0
    axes_dims: tuple[int, ...] = (32, 48, 48)
    axes_lens: tuple[int, ...] = (1024, 512, 512)
    siglip_feat_dim: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def adaln_dim(self) -> int:
        return min(self.dim, ADALN_EMBED_DIM)

    @property
    def ffn_dim(self) -> int:
        """Hidden width of the SwiGLU feed-forward: ``int(dim / 3 * 8)`` (diffusers' ``FeedForward``)."""
        return int(self.dim / 3 * 8)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> "ZImageConfig":
        """From ``config.json``'s keys. Raises ``WeightsError`` for inconsistent values."""
        names = {f for f in cls.__dataclass_fields__ if f != "extra"}
        kw: dict[str, Any] = {}
        for k in names:
            if k in config and config[k] is not None:
                v = config[k]
                kw[k] = tuple(int(i) for i in v) if isinstance(v, (list, tuple)) else v
        c = cls(**kw)
        c.extra = {k: v for k, v in config.items() if k not in names}
        if c.dim <= 0 or c.n_heads <= 0 or c.dim % c.n_heads:
            raise WeightsError(f"Z-Image transformer config: dim {c.dim} is not a multiple of n_heads {c.n_heads}")
        if sum(c.axes_dims) != c.head_dim or any(d % 2 for d in c.axes_dims):
            raise WeightsError(f"Z-Image transformer config: axes_dims {list(c.axes_dims)} must be even and sum to "
                               f"the head dim {c.head_dim}")
        if len(c.axes_dims) != len(c.axes_lens):
            raise WeightsError("Z-Image transformer config: axes_dims and axes_lens differ in length")
        if len(c.all_patch_size) != len(c.all_f_patch_size):
            raise WeightsError("Z-Image transformer config: all_patch_size and all_f_patch_size differ in length")
        return c


def timestep_features(t: np.ndarray, dim: int = FREQUENCY_EMBEDDING_SIZE, max_period: float = 10000.0,
                      scale: float = 1.0) -> np.ndarray:
    """Sinusoidal timestep features ``[B, dim]`` float32: ``[cos(a), sin(a)]`` with ``a = t * f * scale`` and
    ``f_i = exp(-ln(max_period) * i / (dim/2))`` (diffusers' ``TimestepEmbedder.timestep_embedding`` and
    ``embeddings.get_timestep_embedding`` with ``flip_sin_to_cos=True``, ``downscale_freq_shift=0``, in float32 as
    they compute them). ``t`` is float32 ``[B]``: Z-Image passes it already multiplied by ``t_scale`` (``scale``
    1); Qwen-Image's ``Timesteps(scale=1000)`` multiplies after the product, as ``scale`` does here."""
    half = dim // 2
    freqs = np.exp(np.float32(-math.log(max_period)) * np.arange(0, half, dtype=np.float32) / np.float32(half))
    args = t.astype(np.float32)[:, None] * freqs[None].astype(np.float32)
    if scale != 1.0:
        args = (np.float32(scale) * args).astype(np.float32)
    emb = np.concatenate([np.cos(args), np.sin(args)], axis=-1).astype(np.float32)
    if dim % 2:
        emb = np.concatenate([emb, np.zeros_like(emb[:, :1])], axis=-1)
    return emb


def rotate_pairs(ctx: Context, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on interleaved pairs (diffusers' ``apply_rotary_emb`` with ``use_real=False``: the features ``(2k,
    2k + 1)`` of a head as one complex number times ``cos + i sin`` of pair ``k``), in float32:
    ``(x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos)``.

    Args:
        x: ``[B, L, H, Dh]`` in any float dtype (returned in it).
        cos, sin: float32 ``[B or 1, L, 1, Dh / 2]``.
    """
    bsz, n, heads, hd = x.shape
    dt = x.dtype
    y = x if dt == DType.FLOAT32 else x.astype(DType.FLOAT32)
    y = y.reshape(bsz, n, heads, hd // 2, 2)
    x0, x1 = y[..., 0], y[..., 1]
    out = ctx.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1).reshape(bsz, n, heads, hd)
    return out if dt == DType.FLOAT32 else out.astype(dt)


class _Layout:
    """Host-side bookkeeping of one call: token counts, position ids, masks and RoPE tables per stage.

    Built from the shapes only (latent sizes and caption lengths), so a denoising loop reuses it every step. The
    device copies of the tables belong to one Context (:meth:`bind`): a context may free what it made when it closes.
    """

    def __init__(self, model: "ZImageTransformer", sizes: list[tuple[int, int, int]], cap_lens: list[int], p: int,
                 pf: int):
        c = model.config
        self.sizes = sizes
        self.cap_lens = cap_lens
        self.n_patches, self.x_lens, self.cap_padded = [], [], []
        x_pos, cap_pos = [], []
        for (f, h, w), lc in zip(sizes, cap_lens):
            # Caption: pad to a multiple of 32; ids (1 + j, 0, 0) for every row, pad rows included.
            lcp = lc + (-lc) % SEQ_MULTI_OF
            cp = np.zeros((lcp, 3), np.int64)
            cp[:, 0] = 1 + np.arange(lcp)
            # Image: ids (lcp + 1 + f, h, w) for patches, (0, 0, 0) for pad rows.
            ft, ht, wt = f // pf, h // p, w // p
            n = ft * ht * wt
            ln = n + (-n) % SEQ_MULTI_OF
            grid = np.stack(np.meshgrid(np.arange(ft), np.arange(ht), np.arange(wt), indexing="ij"), -1)
            xp = np.zeros((ln, 3), np.int64)
            xp[:n] = grid.reshape(n, 3) + np.array([lcp + 1, 0, 0])
            self.n_patches.append(n)
            self.x_lens.append(ln)
            self.cap_padded.append(lcp)
            x_pos.append(xp)
            cap_pos.append(cp)
        for pos in x_pos + cap_pos:
            for a, lim in enumerate(c.axes_lens):
                if pos[:, a].max() >= lim:
                    raise ValueError(f"Z-Image: RoPE position {int(pos[:, a].max())} on axis {a} is beyond the "
                                     f"model's axes_lens[{a}] = {lim} (caption or image too long)")
        uni_pos = [np.concatenate([xp, cp]) for xp, cp in zip(x_pos, cap_pos)]
        self._host = [model._stage(x_pos), model._stage(cap_pos), model._stage(uni_pos)]
        self._ctx: Context | None = None
        self.x = self.cap = self.uni = None  # type: ignore[assignment]

    def bind(self, ctx: Context, dtype: DType) -> "_Layout":
        """Make the device tables in ``ctx`` (once per context)."""
        if self._ctx is not ctx:
            self.x, self.cap, self.uni = (st.on_device(ctx, dtype) for st in self._host)
            self._ctx = ctx
        return self


class _Stage:
    """One batched attention stage: per-item lengths, the key mask ``[B, 1, 1, L]`` (or None; in the compute dtype)
    and the RoPE tables ``cos, sin [B, L, 1, head_dim/2]`` (float32; zero in the batch-padding rows, as diffusers
    pads them). Made on the host (NumPy arrays), then copied to a context with :meth:`on_device`."""

    def __init__(self, lens: list[int], mask, cos, sin):
        self.lens, self.mask, self.cos, self.sin = lens, mask, cos, sin
        self.max_len = max(lens)

    def on_device(self, ctx: Context, dtype: DType) -> "_Stage":
        mask = None if self.mask is None else ctx.from_numpy(self.mask, dtype)
        return _Stage(self.lens, mask, ctx.from_numpy(self.cos), ctx.from_numpy(self.sin))


class ZImageTransformer:
    """diffusers' ``ZImageTransformer2DModel`` (basic mode) on the ``ml`` interfaces.

    Build with :meth:`from_backend`; call with :meth:`__call__`. Computes in the backend's ``compute_dtype``; the RoPE
    rotation runs in float32 (as diffusers' ``apply_rotary_emb``).
    """

    #: Layers kept in float when quantizing (diffusers' ``_skip_layerwise_casting_patterns`` plus the small input and
    #: output layers): the timestep and caption embedders, the patch embedders and the final layers.
    FLOAT_PREFIXES = ("t_embedder.", "cap_embedder.", "all_x_embedder.", "all_final_layer.")

    def __init__(self, config: ZImageConfig, weights: dict[str, Tensor], backend: Backend):
        self.config = config
        self.backend = backend
        self.dtype = backend.compute_dtype
        self.w = weights
        c = config
        self._check_weights()
        self.noise_refiner = [self._block(f"noise_refiner.{i}.", True) for i in range(c.n_refiner_layers)]
        self.context_refiner = [self._block(f"context_refiner.{i}.", False) for i in range(c.n_refiner_layers)]
        self.layers = [self._block(f"layers.{i}.", True) for i in range(c.n_layers)]
        # RoPE angle tables per axis, float32 [axes_lens[a], axes_dims[a] / 2] (RopeEmbedder.precompute_freqs_cis).
        self._angles = []
        for d, e in zip(c.axes_dims, c.axes_lens):
            freqs = 1.0 / (c.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
            self._angles.append(np.outer(np.arange(e, dtype=np.float64), freqs).astype(np.float32))
        self._layouts: "OrderedDict[Any, _Layout]" = OrderedDict()

    # ---- construction ------------------------------------------------------------------------------------------
    @classmethod
    def from_backend(cls, backend: Backend, quantize_bits: int | None = None,
                     group_size: int = 64) -> "ZImageTransformer":
        """Build from a backend loaded on a diffusers ``transformer/`` folder (``backend.metadata`` holds its
        ``config.json``, ``backend.weights`` its tensors by diffusers' names).

        Args:
            quantize_bits: None (keep the weights as loaded), 8 or 4: quantize the linear weights of the refiner and
                main blocks (attention, feed-forward, adaLN modulation) with affine quantization, ``group_size``
                elements per group (64 or 32; a weight whose input width is not a multiple stays float). The
                timestep and caption embedders, patch embedders and final layers stay float
                (:attr:`FLOAT_PREFIXES`). The float weights are dropped from ``backend.weights``.
            group_size: see ``quantize_bits``.

        Raises:
            WeightsError: a missing tensor or an inconsistent config (the message names it).
            UnsupportedError: a SigLIP (omni) checkpoint.
            ValueError: ``quantize_bits`` not in (None, 4, 8) or ``group_size`` not in (32, 64, 128).
        """
        config = ZImageConfig.from_dict(backend.metadata)
        if config.siglip_feat_dim is not None:
            raise UnsupportedError("Z-Image Omni (SigLIP features) is not supported; only the text-to-image model")
        weights = dict(backend.weights)
        if quantize_bits is not None:
            weights = quantize_linears(backend, weights, quantize_bits, group_size, cls.FLOAT_PREFIXES)
        return cls(config, weights, backend)

    def _check_weights(self) -> None:
        c = self.config
        need = ["t_embedder.mlp.0.weight", "t_embedder.mlp.0.bias", "t_embedder.mlp.2.weight", "t_embedder.mlp.2.bias",
                "cap_embedder.0.weight", "cap_embedder.1.weight", "cap_embedder.1.bias", "x_pad_token",
                "cap_pad_token"]
        for p, f in zip(c.all_patch_size, c.all_f_patch_size):
            k = f"{p}-{f}"
            need += [f"all_x_embedder.{k}.weight", f"all_x_embedder.{k}.bias", f"all_final_layer.{k}.linear.weight",
                     f"all_final_layer.{k}.linear.bias", f"all_final_layer.{k}.adaLN_modulation.1.weight",
                     f"all_final_layer.{k}.adaLN_modulation.1.bias"]
        blocks = ([(f"noise_refiner.{i}.", True) for i in range(c.n_refiner_layers)]
                  + [(f"context_refiner.{i}.", False) for i in range(c.n_refiner_layers)]
                  + [(f"layers.{i}.", True) for i in range(c.n_layers)])
        for pre, mod in blocks:
            need += [pre + n for n in self._BLOCK_NAMES.values()
                     if (mod or not n.startswith("adaLN")) and (c.qk_norm or ".norm_" not in n)]
        missing = [n for n in need if n not in self.w]
        if missing:
            raise WeightsError(f"the Z-Image transformer checkpoint lacks {len(missing)} tensors, e.g. "
                               f"{', '.join(missing[:3])}; is it a complete ZImageTransformer2DModel?")

    _BLOCK_NAMES = {
        "q": "attention.to_q.weight", "k": "attention.to_k.weight", "v": "attention.to_v.weight",
        "o": "attention.to_out.0.weight", "q_norm": "attention.norm_q.weight", "k_norm": "attention.norm_k.weight",
        "attn_norm1": "attention_norm1.weight", "attn_norm2": "attention_norm2.weight",
        "ffn_norm1": "ffn_norm1.weight", "ffn_norm2": "ffn_norm2.weight", "w1": "feed_forward.w1.weight",
        "w2": "feed_forward.w2.weight", "w3": "feed_forward.w3.weight", "ada_w": "adaLN_modulation.0.weight",
        "ada_b": "adaLN_modulation.0.bias",
    }

    def _block(self, prefix: str, modulation: bool) -> dict[str, Tensor | None]:
        b = {k: self.w.get(prefix + v) for k, v in self._BLOCK_NAMES.items()}
        if not modulation:
            b["ada_w"] = b["ada_b"] = None
        if not self.config.qk_norm:
            b["q_norm"] = b["k_norm"] = None
        return b

    # ---- host-side layout --------------------------------------------------------------------------------------
    def _stage(self, positions: list[np.ndarray]) -> _Stage:
        """Mask and RoPE tables for a batch of items with position ids ``positions[i] [L_i, 3]``."""
        lens = [len(p) for p in positions]
        lmax, b = max(lens), len(lens)
        half = self.config.head_dim // 2
        ang = np.zeros((b, lmax, half), np.float32)
        valid = np.zeros((b, lmax), bool)
        for i, pos in enumerate(positions):
            ang[i, :len(pos)] = np.concatenate([tab[pos[:, a]] for a, tab in enumerate(self._angles)], axis=-1)
            valid[i, :len(pos)] = True
        cos = np.cos(ang.astype(np.float64)).astype(np.float32)
        sin = np.sin(ang.astype(np.float64)).astype(np.float32)
        cos[~valid] = 0.0  # diffusers pads freqs_cis with 0 (rotating the padding rows to zero)
        sin[~valid] = 0.0
        mask = None
        if any(n != lmax for n in lens):
            mask = np.where(valid, 0.0, -np.inf).astype(np.float32)[:, None, None, :]
        return _Stage(lens, mask, cos[:, :, None, :], sin[:, :, None, :])

    def _layout(self, ctx: Context, sizes: list[tuple[int, int, int]], cap_lens: list[int], p: int,
                pf: int) -> _Layout:
        key = (tuple(sizes), tuple(cap_lens), p, pf)
        lay = self._layouts.get(key)
        if lay is None:
            lay = _Layout(self, sizes, cap_lens, p, pf)
            self._layouts[key] = lay
            while len(self._layouts) > 4:
                self._layouts.popitem(last=False)
        else:
            self._layouts.move_to_end(key)
        return lay.bind(ctx, self.dtype)

    # ---- forward -----------------------------------------------------------------------------------------------
    def __call__(self, ctx: Context, x: Sequence[Tensor], t: "Tensor | np.ndarray | Sequence[float] | float",
                 cap_feats: Sequence[Tensor], patch_size: int = 2, f_patch_size: int = 1) -> list[Tensor]:
        """One transformer evaluation, as diffusers' ``ZImageTransformer2DModel.forward(x, t, cap_feats)`` (basic
        mode, ``return_dict=False``, ``[0]``).

        Args:
            ctx: the context of this step.
            x: ``B`` latents, each ``[C, F, H, W]`` (``C = in_channels``; ``F`` frames, 1 for an image; ``H, W``
                multiples of ``patch_size``) in any float dtype; they may differ in size.
            t: ``[B]`` timesteps in diffusers' transformer convention: ``ZImagePipeline`` passes
                ``(1000 - timestep) / 1000`` where ``timestep = sigma * 1000`` is the scheduler's, i.e. ``1 - sigma``
                (1 at the clean end). Multiplied by ``t_scale`` here. A Tensor (read back to the host: the sinusoidal
                features are computed with NumPy), an array, a list or a float (broadcast to ``B``).
            cap_feats: ``B`` caption features, each ``[L_i, cap_feat_dim]`` (the text encoder's hidden states of the
                unpadded prompt tokens); lengths may differ.
            patch_size, f_patch_size: one of the configured pairs (diffusers' defaults 2 and 1).

        Returns:
            ``B`` tensors ``[C, F, H, W]`` in the compute dtype: the model output as diffusers returns it, which is the
            *negative* of the flow-matching velocity the scheduler steps with (the pipeline negates it:
            ``noise_pred = -output``, after classifier-free guidance).

        Raises:
            ValueError: mismatched batch sizes, an unsupported patch size, sizes not divisible by the patch, or a
                sequence longer than the RoPE tables (``axes_lens``).
        """
        c = self.config
        bsz = len(x)
        if bsz == 0 or len(cap_feats) != bsz:
            raise ValueError(f"Z-Image transformer: {len(x)} latents but {len(cap_feats)} caption features")
        key = f"{patch_size}-{f_patch_size}"
        if (patch_size, f_patch_size) not in set(zip(c.all_patch_size, c.all_f_patch_size)):
            raise ValueError(f"Z-Image transformer: patch size {key} not in the model's "
                             f"{list(zip(c.all_patch_size, c.all_f_patch_size))}")
        t_host = self._timesteps(t, bsz)
        sizes = []
        for xi in x:
            if xi.ndim != 4 or xi.shape[0] != c.in_channels:
                raise ValueError(f"Z-Image transformer: a latent must be [{c.in_channels}, F, H, W], got {xi.shape}")
            _, f, h, w = xi.shape
            if h % patch_size or w % patch_size or f % f_patch_size:
                raise ValueError(f"Z-Image transformer: latent size {(f, h, w)} is not a multiple of the patch "
                                 f"({f_patch_size}, {patch_size}, {patch_size})")
            sizes.append((f, h, w))
        for ci in cap_feats:
            if ci.ndim != 2 or ci.shape[1] != c.cap_feat_dim or ci.shape[0] == 0:
                raise ValueError(f"Z-Image transformer: caption features must be [L > 0, {c.cap_feat_dim}], "
                                 f"got {ci.shape}")
        lay = self._layout(ctx, sizes, [ci.shape[0] for ci in cap_feats], patch_size, f_patch_size)
        dt = self.dtype

        # Timestep embedding: [B, A].
        tf = ctx.from_numpy(timestep_features(t_host * np.float32(c.t_scale)), dt)
        adaln = tf.linear(self.w["t_embedder.mlp.0.weight"], self.w["t_embedder.mlp.0.bias"]).silu()
        adaln = adaln.linear(self.w["t_embedder.mlp.2.weight"], self.w["t_embedder.mlp.2.bias"])

        # Patchify and embed the latents; pad each to a multiple of 32 with x_pad_token.
        patches = [self._patchify(xi.astype(dt) if xi.dtype != dt else xi, patch_size, f_patch_size) for xi in x]
        emb = ctx.concatenate(patches, axis=0) if bsz > 1 else patches[0]
        emb = emb.linear(self.w[f"all_x_embedder.{key}.weight"], self.w[f"all_x_embedder.{key}.bias"])
        x_items = self._pad_items(ctx, self._split(emb, lay.n_patches), lay.x_lens, self.w["x_pad_token"])
        x_items = self._run(ctx, self.noise_refiner, x_items, lay.x, adaln)

        # Embed the captions; pad each to a multiple of 32 with cap_pad_token.
        caps = [ci.astype(dt) if ci.dtype != dt else ci for ci in cap_feats]
        ce = ctx.concatenate(caps, axis=0) if bsz > 1 else caps[0]
        ce = ce.rms_norm(self.w["cap_embedder.0.weight"], c.norm_eps)
        ce = ce.linear(self.w["cap_embedder.1.weight"], self.w["cap_embedder.1.bias"])
        cap_items = self._pad_items(ctx, self._split(ce, lay.cap_lens), lay.cap_padded, self.w["cap_pad_token"])
        cap_items = self._run(ctx, self.context_refiner, cap_items, lay.cap, None)

        # Unified sequence per item: [image tokens, caption tokens]; the main blocks.
        uni = [ctx.concatenate([xi, ci], axis=0) for xi, ci in zip(x_items, cap_items)]
        h = self._run(ctx, self.layers, uni, lay.uni, adaln, keep_batched=True)

        # Final layer: LayerNorm (no affine) * (1 + scale(c)), Linear.
        fp = f"all_final_layer.{key}."
        scale = adaln.silu().linear(self.w[fp + "adaLN_modulation.1.weight"], self.w[fp + "adaLN_modulation.1.bias"])
        h = h.layer_norm(None, None, FINAL_NORM_EPS) * (scale[:, None, :] + 1.0)
        h = h.linear(self.w[fp + "linear.weight"], self.w[fp + "linear.bias"])

        return [self._unpatchify(h[i, :lay.n_patches[i]], sizes[i], patch_size, f_patch_size) for i in range(bsz)]

    # ---- pieces ------------------------------------------------------------------------------------------------
    @staticmethod
    def _timesteps(t: Any, bsz: int) -> np.ndarray:
        if isinstance(t, Tensor):
            t = t.numpy()
        arr = np.asarray(t, dtype=np.float32).reshape(-1)
        if arr.size == 1 and bsz > 1:
            arr = np.full(bsz, arr[0], np.float32)
        if arr.size != bsz:
            raise ValueError(f"Z-Image transformer: {arr.size} timesteps for a batch of {bsz}")
        return arr

    def _patchify(self, image: Tensor, p: int, pf: int) -> Tensor:
        """``[C, F, H, W] -> [n, pF*pH*pW*C]``, patches in (f, h, w) order, features in (pf, ph, pw, c) order
        (diffusers' ``_patchify_image``)."""
        ch, f, h, w = image.shape
        ft, ht, wt = f // pf, h // p, w // p
        y = image.reshape(ch, ft, pf, ht, p, wt, p).transpose(1, 3, 5, 2, 4, 6, 0)
        return y.reshape(ft * ht * wt, pf * p * p * ch)

    def _unpatchify(self, tokens: Tensor, size: tuple[int, int, int], p: int, pf: int) -> Tensor:
        """``[n, pF*pH*pW*C] -> [C, F, H, W]`` (diffusers' ``unpatchify``)."""
        f, h, w = size
        ch = self.config.in_channels
        y = tokens.reshape(f // pf, h // p, w // p, pf, p, p, ch).transpose(6, 0, 3, 1, 4, 2, 5)
        return y.reshape(ch, f, h, w)

    @staticmethod
    def _split(x: Tensor, lens: list[int]) -> list[Tensor]:
        out, start = [], 0
        for n in lens:
            out.append(x[start:start + n])
            start += n
        return out

    def _pad_items(self, ctx: Context, items: list[Tensor], lens: list[int], pad_token: Tensor) -> list[Tensor]:
        """Each ``[n_i, dim]`` item extended to ``lens[i]`` rows with ``pad_token [1, dim]`` (diffusers copies the
        last row, embeds it, then replaces it with the pad token: the same values)."""
        pad = pad_token.astype(self.dtype) if pad_token.dtype != self.dtype else pad_token
        out = []
        for it, n in zip(items, lens):
            extra = n - it.shape[0]
            if extra:
                rows = pad if extra == 1 else ctx.concatenate([pad] * extra, axis=0)
                it = ctx.concatenate([it, rows], axis=0)
            out.append(it)
        return out

    def _run(self, ctx: Context, blocks: list[dict], items: list[Tensor], stage: _Stage, adaln: Tensor | None,
             keep_batched: bool = False) -> "list[Tensor] | Tensor":
        """Pad ``items`` (``[L_i, dim]``) into one batch ``[B, L, dim]`` (zeros beyond each item, masked as keys), run
        the blocks, and split again (or return the batch ``[B, L, dim]`` with ``keep_batched``)."""
        d = self.config.dim
        rows = []
        for it in items:
            extra = stage.max_len - it.shape[0]
            if extra:
                it = ctx.concatenate([it, ctx.zeros((extra, d), self.dtype)], axis=0)
            rows.append(it)
        h = ctx.stack(rows, axis=0)
        for blk in blocks:
            h = self._block_forward(ctx, blk, h, stage, adaln)
        if keep_batched:
            return h
        return [h[i, :n] for i, n in enumerate(stage.lens)]

    def _block_forward(self, ctx: Context, b: dict, x: Tensor, stage: _Stage, adaln: Tensor | None) -> Tensor:
        """``ZImageTransformerBlock.forward`` on ``x [B, L, dim]`` (global modulation when ``adaln [B, A]``)."""
        eps = self.config.norm_eps
        d = self.config.dim
        if adaln is not None and b["ada_w"] is not None:
            mod = adaln.linear(b["ada_w"], b["ada_b"])[:, None, :]  # [B, 1, 4 dim]
            scale_msa = mod[:, :, 0:d] + 1.0
            gate_msa = mod[:, :, d:2 * d].tanh()
            scale_mlp = mod[:, :, 2 * d:3 * d] + 1.0
            gate_mlp = mod[:, :, 3 * d:4 * d].tanh()
            a = self._attention(ctx, b, x.rms_norm(b["attn_norm1"], eps) * scale_msa, stage)
            x = x + gate_msa * a.rms_norm(b["attn_norm2"], eps)
            f = self._feed_forward(b, x.rms_norm(b["ffn_norm1"], eps) * scale_mlp)
            return x + gate_mlp * f.rms_norm(b["ffn_norm2"], eps)
        a = self._attention(ctx, b, x.rms_norm(b["attn_norm1"], eps), stage)
        x = x + a.rms_norm(b["attn_norm2"], eps)
        return x + self._feed_forward(b, x.rms_norm(b["ffn_norm1"], eps)).rms_norm(b["ffn_norm2"], eps)

    @staticmethod
    def _feed_forward(b: dict, x: Tensor) -> Tensor:
        """SwiGLU: ``w2(silu(w1 x) * w3 x)`` (diffusers' ``FeedForward``)."""
        return (x.linear(b["w1"]).silu() * x.linear(b["w3"])).linear(b["w2"])

    def _attention(self, ctx: Context, b: dict, x: Tensor, stage: _Stage) -> Tensor:
        """``ZSingleStreamAttnProcessor``: Q/K/V projections, per-head RMSNorm, RoPE, masked SDPA, output
        projection. ``x [B, L, dim] -> [B, L, dim]``."""
        c = self.config
        bsz, n, _ = x.shape
        hd = c.head_dim
        q = x.linear(b["q"]).reshape(bsz, n, c.n_heads, hd)
        k = x.linear(b["k"]).reshape(bsz, n, c.n_heads, hd)
        v = x.linear(b["v"]).reshape(bsz, n, c.n_heads, hd)
        if b["q_norm"] is not None:
            q = q.rms_norm(b["q_norm"], QK_NORM_EPS)
            k = k.rms_norm(b["k_norm"], QK_NORM_EPS)
        q = self._rope(ctx, q, stage).transpose(0, 2, 1, 3)
        k = self._rope(ctx, k, stage).transpose(0, 2, 1, 3)
        v = v.transpose(0, 2, 1, 3)
        o = ctx.scaled_dot_product_attention(q, k, v, hd ** -0.5, stage.mask)
        return o.transpose(0, 2, 1, 3).reshape(bsz, n, c.dim).linear(b["o"])

    @staticmethod
    def _rope(ctx: Context, x: Tensor, stage: _Stage) -> Tensor:
        """Rotate interleaved pairs of ``x [B, L, H, Dh]`` by the stage's angles (:func:`rotate_pairs`)."""
        return rotate_pairs(ctx, x, stage.cos, stage.sin)
