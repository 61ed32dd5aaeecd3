"""The FLUX ``AutoencoderKL`` (16 latent channels) and FLUX.2's ``AutoencoderKLFlux2`` (32), decoder and encoder, on
the ml interfaces.

Source: diffusers 0.42 ``models/autoencoders/autoencoder_kl.py`` (``AutoencoderKL``: ``encode``, ``decode``,
``tiled_decode``, ``blend_v`` / ``blend_h``), ``models/autoencoders/vae.py`` (``Encoder``, ``Decoder``,
``DiagonalGaussianDistribution``), ``models/unets/unet_2d_blocks.py`` (``DownEncoderBlock2D``, ``UpDecoderBlock2D``,
``UNetMidBlock2D``), ``models/resnet.py`` (``ResnetBlock2D``), ``models/downsampling.py`` (``Downsample2D``: zero pad
right and bottom by one, 3x3 convolution with stride 2), ``models/upsampling.py`` (``Upsample2D``: nearest x2, 3x3
convolution), ``models/attention_processor.py`` (``Attention`` with ``AttnProcessor2_0``: one head over all pixels,
GroupNorm first, residual). The architecture is the latent-diffusion autoencoder (Rombach et al. 2022,
"High-Resolution Image Synthesis with Latent Diffusion Models"), with FLUX's 16 latent channels.

Layout: channels last everywhere (``[B, H, W, C]``); PyTorch convolution weights ``[O, I, kH, kW]`` are transposed to
``[O, kH, kW, I]`` once, at load. The model computes in the dtype of the backend's weights; GroupNorm statistics are
taken in float32 when that is a half type (activations of this VAE overflow float16 squares).

Latent convention (as the diffusers pipelines): the transformer sees ``z = (x - shift_factor) * scaling_factor``;
:meth:`AutoencoderKL.decode` takes ``x = z / scaling_factor + shift_factor`` (the caller unscales), and
:meth:`AutoencoderKL.encode` returns ``x`` (the caller scales).

This module imports the ml interfaces only (never ``mlx``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, Mapping

import numpy as np

from mlx_engine.errors import InvalidRequestError, UnsupportedError, WeightsError
from mlx_engine.ml import Backend, Context, DType, Tensor

__all__ = ["AutoencoderKL", "VAEConfig", "decode_in_tiles", "pad_right_bottom"]

_HALF = (DType.FLOAT16, DType.BFLOAT16)
_ACTIVATIONS = ("silu", "swish")  # diffusers get_activation: both are nn.SiLU
_EPS = 1e-6  # resnet_eps and the output norms of diffusers' Encoder / Decoder
_CLASS_NAMES = ("AutoencoderKL", "AutoencoderKLFlux2")


@dataclass(frozen=True)
class VAEConfig:
    """The keys of a diffusers ``vae/config.json`` that shape the model (``AutoencoderKL.__init__``)."""

    in_channels: int = 3
    out_channels: int = 3
    block_out_channels: tuple[int, ...] = (64,)
    decoder_block_out_channels: tuple[int, ...] | None = None
    layers_per_block: int = 1
    latent_channels: int = 4
    norm_num_groups: int = 32
    scaling_factor: float = 0.18215
    shift_factor: float | None = None
    latents_mean: tuple[float, ...] | None = None
    latents_std: tuple[float, ...] | None = None
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    mid_block_add_attention: bool = True
    down_block_types: tuple[str, ...] = ("DownEncoderBlock2D",)
    up_block_types: tuple[str, ...] = ("UpDecoderBlock2D",)
    act_fn: str = "silu"
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any], where: str = "config.json") -> "VAEConfig":
        """Read the config, diffusers' defaults for missing keys. ``AutoencoderKLFlux2`` (FLUX.2's VAE) is the same
        network with an optional decoder width of its own (``decoder_block_out_channels``); its BatchNorm
        statistics are the pipeline's business (``batch_norm_eps`` stays in :attr:`extra`).

        Raises:
            UnsupportedError: another ``_class_name``, block types other than ``DownEncoderBlock2D`` /
                ``UpDecoderBlock2D``, an activation other than SiLU, or channel counts that GroupNorm cannot split;
                the message names the key.
        """
        name = cfg.get("_class_name")
        if name is not None and name not in _CLASS_NAMES:
            raise UnsupportedError(f"{where}: _class_name {name!r} is not supported; expected one of "
                                   f"{', '.join(_CLASS_NAMES)}")
        kw: dict[str, Any] = {}
        for f in cls.__dataclass_fields__:
            if f != "extra" and f in cfg and cfg[f] is not None:
                kw[f] = cfg[f]
        if cfg.get("shift_factor") is None:
            kw["shift_factor"] = None
        for key in ("block_out_channels", "decoder_block_out_channels", "down_block_types", "up_block_types",
                    "latents_mean", "latents_std"):
            if key in kw:
                kw[key] = tuple(kw[key])
        c = cls(**kw, extra={k: v for k, v in cfg.items() if k not in cls.__dataclass_fields__})
        n = len(c.block_out_channels)
        if n < 1:
            raise UnsupportedError(f"{where}: block_out_channels is empty")
        if len(c.down_block_types) != n or any(t != "DownEncoderBlock2D" for t in c.down_block_types):
            raise UnsupportedError(f"{where}: down_block_types {list(c.down_block_types)} is not supported; expected "
                                   f"{n} x 'DownEncoderBlock2D'")
        if len(c.up_block_types) != n or any(t != "UpDecoderBlock2D" for t in c.up_block_types):
            raise UnsupportedError(f"{where}: up_block_types {list(c.up_block_types)} is not supported; expected "
                                   f"{n} x 'UpDecoderBlock2D'")
        if c.act_fn not in _ACTIVATIONS:
            raise UnsupportedError(f"{where}: act_fn {c.act_fn!r} is not supported; expected 'silu'")
        if c.decoder_block_out_channels is not None and len(c.decoder_block_out_channels) != n:
            raise UnsupportedError(f"{where}: decoder_block_out_channels {list(c.decoder_block_out_channels)} must "
                                   f"have {n} entries, as block_out_channels")
        for ch in c.block_out_channels + (c.decoder_block_out_channels or ()):
            if ch % c.norm_num_groups:
                raise UnsupportedError(f"{where}: norm_num_groups {c.norm_num_groups} does not divide "
                                       f"block_out_channels entry {ch}")
        return c


# ---- layers ---------------------------------------------------------------------------------------------------------
class _Conv:
    """``torch.nn.Conv2d`` channels last: weight ``[O, kH, kW, I]``, bias ``[O]``."""

    __slots__ = ("weight", "bias", "stride", "padding")

    def __init__(self, weight: Tensor, bias: Tensor | None, stride: int = 1, padding: int = 0):
        self.weight, self.bias, self.stride, self.padding = weight, bias, stride, padding

    def __call__(self, x: Tensor) -> Tensor:
        return x.conv2d(self.weight, self.bias, stride=self.stride, padding=self.padding)


class _GroupNorm:
    """``torch.nn.GroupNorm(groups, C, eps)`` on ``[B, ..., C]``; statistics in float32 for half-precision inputs."""

    __slots__ = ("groups", "weight", "bias", "eps")

    def __init__(self, groups: int, weight: Tensor, bias: Tensor, eps: float = _EPS):
        self.groups, self.weight, self.bias, self.eps = groups, weight, bias, eps

    def __call__(self, x: Tensor) -> Tensor:
        if x.dtype in _HALF:
            return x.astype(DType.FLOAT32).group_norm(self.groups, self.weight, self.bias, self.eps).astype(x.dtype)
        return x.group_norm(self.groups, self.weight, self.bias, self.eps)


class _Resnet:
    """``ResnetBlock2D`` without a time embedding: ``shortcut(x) + conv2(silu(norm2(conv1(silu(norm1(x))))))``
    (output_scale_factor 1, dropout off at inference)."""

    __slots__ = ("norm1", "conv1", "norm2", "conv2", "shortcut")

    def __init__(self, norm1, conv1, norm2, conv2, shortcut):
        self.norm1, self.conv1, self.norm2, self.conv2, self.shortcut = norm1, conv1, norm2, conv2, shortcut

    def __call__(self, x: Tensor) -> Tensor:
        h = self.conv1(self.norm1(x).silu())
        h = self.conv2(self.norm2(h).silu())
        if self.shortcut is not None:
            x = self.shortcut(x)
        return x + h


class _Attention:
    """The mid-block self-attention (``Attention`` + ``AttnProcessor2_0``, one head of width C over the H*W pixels):
    ``x + to_out(sdpa(to_q(gn(x)), to_k(gn(x)), to_v(gn(x))))``, scale ``1/sqrt(C)``."""

    __slots__ = ("norm", "q", "k", "v", "out")

    def __init__(self, norm, q, k, v, out):
        self.norm, self.q, self.k, self.v, self.out = norm, q, k, v, out

    def __call__(self, ctx: Context, x: Tensor) -> Tensor:
        b, h, w, c = x.shape
        t = self.norm(x.reshape(b, h * w, c))
        q = t.linear(*self.q).reshape(b, 1, h * w, c)
        k = t.linear(*self.k).reshape(b, 1, h * w, c)
        v = t.linear(*self.v).reshape(b, 1, h * w, c)
        o = ctx.scaled_dot_product_attention(q, k, v, scale=1.0 / math.sqrt(c)).reshape(b, h * w, c)
        return x + o.linear(*self.out).reshape(b, h, w, c)


class _MidBlock:
    """``UNetMidBlock2D`` (one layer): resnet, attention (if configured), resnet."""

    __slots__ = ("resnets", "attention")

    def __init__(self, resnets, attention):
        self.resnets, self.attention = resnets, attention

    def __call__(self, ctx: Context, x: Tensor) -> Tensor:
        x = self.resnets[0](x)
        if self.attention is not None:
            x = self.attention(ctx, x)
        return self.resnets[1](x)


def pad_right_bottom(ctx: Context, x: Tensor) -> Tensor:
    """``F.pad(x, (0, 1, 0, 1))`` of ``Downsample2D`` (padding 0), channels last: one zero column on the right and
    one zero row at the bottom."""
    b, h, w, c = x.shape
    x = ctx.concatenate([x, ctx.zeros((b, h, 1, c), x.dtype)], axis=2)
    return ctx.concatenate([x, ctx.zeros((b, 1, w + 1, c), x.dtype)], axis=1)


class _Encoder:
    def __init__(self, conv_in, blocks, mid, norm_out, conv_out):
        self.conv_in, self.blocks, self.mid, self.norm_out, self.conv_out = conv_in, blocks, mid, norm_out, conv_out

    def __call__(self, ctx: Context, x: Tensor) -> Tensor:
        x = self.conv_in(x)
        for resnets, down in self.blocks:
            for r in resnets:
                x = r(x)
            if down is not None:
                x = down(pad_right_bottom(ctx, x))
        x = self.mid(ctx, x)
        return self.conv_out(self.norm_out(x).silu())


class _Decoder:
    def __init__(self, conv_in, mid, blocks, norm_out, conv_out):
        self.conv_in, self.mid, self.blocks, self.norm_out, self.conv_out = conv_in, mid, blocks, norm_out, conv_out

    def __call__(self, ctx: Context, z: Tensor) -> Tensor:
        x = self.conv_in(z)
        x = self.mid(ctx, x)
        for resnets, up in self.blocks:
            for r in resnets:
                x = r(x)
            if up is not None:
                x = up(x.upsample_nearest(2))
        return self.conv_out(self.norm_out(x).silu())


# ---- loading --------------------------------------------------------------------------------------------------------
class _Loader:
    """Fetches diffusers state-dict names from a backend, checks shapes, converts convolutions to channels last."""

    # old attention names (diffusers' _convert_deprecated_attention_blocks) -> current ones
    _DEPRECATED = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}

    def __init__(self, backend: Backend, where: str):
        self.weights = backend.weights
        self.ctx = backend.new_context()
        self.where = where
        self.used: set[str] = set()

    def get(self, name: str, shape: tuple[int, ...]) -> Tensor:
        t = self.weights.get(name)
        if t is None:
            raise WeightsError(f"{self.where}: tensor {name!r} is missing (the VAE config expects it)")
        if tuple(t.shape) != tuple(shape):
            raise WeightsError(f"{self.where}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)} "
                               "from the VAE config")
        self.used.add(name)
        return t

    def conv(self, prefix: str, cin: int, cout: int, k: int, stride: int = 1, padding: int = 0,
             bias: bool = True) -> _Conv:
        w = self.get(prefix + ".weight", (cout, cin, k, k))
        # [O, I, kH, kW] -> [O, kH, kW, I], made contiguous once (an exact copy through the host)
        w = self.ctx.from_numpy(np.ascontiguousarray(w.numpy().transpose(0, 2, 3, 1)), w.dtype)
        b = self.get(prefix + ".bias", (cout,)) if bias else None
        return _Conv(w, b, stride, padding)

    def norm(self, prefix: str, groups: int, c: int) -> _GroupNorm:
        return _GroupNorm(groups, self.get(prefix + ".weight", (c,)), self.get(prefix + ".bias", (c,)))

    def linear(self, prefix: str, cin: int, cout: int) -> tuple[Tensor, Tensor]:
        name = prefix + ".weight"
        if name not in self.weights:
            head, _, tail = prefix.rpartition(".attentions.0.")
            old = self._DEPRECATED.get(tail)
            if old is not None and f"{head}.attentions.0.{old}.weight" in self.weights:
                prefix, name = f"{head}.attentions.0.{old}", f"{head}.attentions.0.{old}.weight"
        w = self.weights.get(name)
        if w is not None and tuple(w.shape) == (cout, cin, 1, 1):  # a 1x1 convolution stored for a linear
            self.used.add(name)
            w = w.reshape(cout, cin)
        else:
            w = self.get(name, (cout, cin))
        return w, self.get(prefix + ".bias", (cout,))

    def resnet(self, prefix: str, cin: int, cout: int, groups: int) -> _Resnet:
        return _Resnet(self.norm(prefix + ".norm1", groups, cin), self.conv(prefix + ".conv1", cin, cout, 3, 1, 1),
                       self.norm(prefix + ".norm2", groups, cout), self.conv(prefix + ".conv2", cout, cout, 3, 1, 1),
                       self.conv(prefix + ".conv_shortcut", cin, cout, 1) if cin != cout else None)

    def mid(self, prefix: str, c: int, groups: int, attention: bool) -> _MidBlock:
        attn = None
        if attention:
            a = prefix + ".attentions.0"
            attn = _Attention(self.norm(a + ".group_norm", groups, c), self.linear(a + ".to_q", c, c),
                              self.linear(a + ".to_k", c, c), self.linear(a + ".to_v", c, c),
                              self.linear(a + ".to_out.0", c, c))
        return _MidBlock([self.resnet(f"{prefix}.resnets.{i}", c, c, groups) for i in range(2)], attn)


class AutoencoderKL:
    """The FLUX VAE (diffusers ``AutoencoderKL``, or FLUX.2's ``AutoencoderKLFlux2``), channels last.

    Attributes:
        config: the :class:`VAEConfig` read from the folder's ``config.json``.
        scaling_factor: ``z = (x - shift_factor) * scaling_factor`` maps VAE latents to the transformer's (FLUX:
            0.3611).
        shift_factor: see above (FLUX: 0.1159; 0.0 when the config has none).
        latent_channels: C of the latents (FLUX: 16).
        downscale: pixels per latent pixel along each axis, ``2 ** (len(block_out_channels) - 1)`` (FLUX: 8).
        dtype: the compute dtype (the backend's weights').
    """

    def __init__(self, config: VAEConfig, encoder: _Encoder, decoder: _Decoder, quant_conv: _Conv | None,
                 post_quant_conv: _Conv | None, dtype: DType):
        self.config = config
        self.encoder, self.decoder = encoder, decoder
        self.quant_conv, self.post_quant_conv = quant_conv, post_quant_conv
        self.dtype = dtype
        self.scaling_factor = float(config.scaling_factor)
        self.shift_factor = float(config.shift_factor or 0.0)
        self.latent_channels = int(config.latent_channels)
        self.downscale = 2 ** (len(config.block_out_channels) - 1)

    # ---- construction -------------------------------------------------------------------------------------------
    @classmethod
    def from_backend(cls, backend: Backend) -> "AutoencoderKL":
        """Build the VAE from a backend opened on a diffusers ``vae/`` folder (``config.json`` +
        ``diffusion_pytorch_model.safetensors``), e.g. ``MLXBackend(folder)`` made by the pipeline loader.

        Convolution weights are copied into channels-last form; the backend still holds the originals, so a caller
        that keeps only the VAE may ``backend.close()`` afterwards (the VAE keeps its own references).

        Raises:
            WeightsError: no ``config.json`` in the folder, a missing tensor, or a tensor of the wrong shape (the
                message names the folder and the tensor).
            UnsupportedError: a config this implementation does not cover (see :meth:`VAEConfig.from_dict`).
        """
        where = str(getattr(backend, "path", None) or "the VAE backend")
        meta = dict(backend.metadata)
        if not any(k in meta for k in ("block_out_channels", "latent_channels", "_class_name")):
            raise WeightsError(f"{where}: no VAE config.json (expected diffusers' AutoencoderKL config beside the "
                               "weights)")
        cfg = VAEConfig.from_dict(meta, where=f"{where}/config.json")
        ld = _Loader(backend, where)
        ch, g, lpb, n = cfg.block_out_channels, cfg.norm_num_groups, cfg.layers_per_block, len(cfg.block_out_channels)

        # Encoder (diffusers vae.py Encoder): conv_in, DownEncoderBlock2D x n, mid, norm, SiLU, conv_out (2C: mean,
        # logvar).
        blocks = []
        cout = ch[0]
        for i in range(n):
            cin, cout = cout, ch[i]
            res = [ld.resnet(f"encoder.down_blocks.{i}.resnets.{j}", cin if j == 0 else cout, cout, g)
                   for j in range(lpb)]
            down = (ld.conv(f"encoder.down_blocks.{i}.downsamplers.0.conv", cout, cout, 3, 2, 0)
                    if i < n - 1 else None)
            blocks.append((res, down))
        encoder = _Encoder(ld.conv("encoder.conv_in", cfg.in_channels, ch[0], 3, 1, 1), blocks,
                           ld.mid("encoder.mid_block", ch[-1], g, cfg.mid_block_add_attention),
                           ld.norm("encoder.conv_norm_out", g, ch[-1]),
                           ld.conv("encoder.conv_out", ch[-1], 2 * cfg.latent_channels, 3, 1, 1))

        # Decoder (diffusers vae.py Decoder): conv_in, mid, UpDecoderBlock2D x n (layers_per_block + 1 resnets),
        # norm, SiLU, conv_out; AutoencoderKLFlux2 may give the decoder widths of its own.
        ch = cfg.decoder_block_out_channels or ch
        rch = list(reversed(ch))
        blocks = []
        cout = rch[0]
        for i in range(n):
            cin, cout = cout, rch[i]
            res = [ld.resnet(f"decoder.up_blocks.{i}.resnets.{j}", cin if j == 0 else cout, cout, g)
                   for j in range(lpb + 1)]
            up = ld.conv(f"decoder.up_blocks.{i}.upsamplers.0.conv", cout, cout, 3, 1, 1) if i < n - 1 else None
            blocks.append((res, up))
        decoder = _Decoder(ld.conv("decoder.conv_in", cfg.latent_channels, ch[-1], 3, 1, 1),
                           ld.mid("decoder.mid_block", ch[-1], g, cfg.mid_block_add_attention), blocks,
                           ld.norm("decoder.conv_norm_out", g, ch[0]),
                           ld.conv("decoder.conv_out", ch[0], cfg.out_channels, 3, 1, 1))

        c2 = 2 * cfg.latent_channels
        quant = ld.conv("quant_conv", c2, c2, 1) if cfg.use_quant_conv else None
        post = ld.conv("post_quant_conv", cfg.latent_channels, cfg.latent_channels, 1) if cfg.use_post_quant_conv \
            else None
        some = next(iter(backend.weights.values()), None)
        dtype = some.dtype if some is not None and some.dtype.is_floating else backend.compute_dtype
        return cls(cfg, encoder, decoder, quant, post, dtype)

    # ---- inference ----------------------------------------------------------------------------------------------
    def _check(self, x: Tensor, channels: int, what: str) -> Tensor:
        if x.ndim != 4 or x.shape[-1] != channels:
            raise InvalidRequestError(f"{what} must be [B, H, W, {channels}] (channels last), got {list(x.shape)}")
        return x if x.dtype == self.dtype else x.astype(self.dtype)

    def decode(self, ctx: Context, latents: Tensor) -> Tensor:
        """Decode latents to images (diffusers ``AutoencoderKL.decode``: ``post_quant_conv`` if configured, then the
        decoder).

        Args:
            ctx: the context to compute in.
            latents: ``[B, h, w, latent_channels]`` channels last, already unscaled
                (``z / scaling_factor + shift_factor``), any float dtype (cast to :attr:`dtype`).

        Returns:
            images ``[B, h * downscale, w * downscale, out_channels]`` in :attr:`dtype`, about ``[-1, 1]`` (map with
            ``(x + 1) / 2`` and clip for pixels).

        Raises:
            InvalidRequestError: ``latents`` is not 4-D with ``latent_channels`` channels.
        """
        z = self._check(latents, self.latent_channels, "latents")
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return self.decoder(ctx, z)

    def encode(self, ctx: Context, images: Tensor, sample_key: Any = None) -> Tensor:
        """Encode images to VAE latents (diffusers ``AutoencoderKL.encode`` and ``DiagonalGaussianDistribution``).

        Args:
            ctx: the context to compute in.
            images: ``[B, H, W, in_channels]`` in ``[-1, 1]``, channels last, ``H`` and ``W`` multiples of
                :attr:`downscale` (other sizes round down at each stride-2 downsampling, as in diffusers).
            sample_key: None for the distribution's mode (its mean, ``retrieve_latents(sample_mode="argmax")``), or a
                random key (``ctx.random_key``) to draw ``mean + exp(logvar / 2) * eps`` with ``logvar`` clipped to
                ``[-30, 20]`` (the diffusers img2img pipelines sample).

        Returns:
            unscaled latents ``[B, H / downscale, W / downscale, latent_channels]`` in :attr:`dtype` (the caller
            applies ``(x - shift_factor) * scaling_factor``).
        """
        x = self._check(images, self.config.in_channels, "images")
        moments = self.encoder(ctx, x)
        if self.quant_conv is not None:
            moments = self.quant_conv(moments)
        c = self.latent_channels
        mean = moments[..., :c]
        if sample_key is None:
            return mean
        logvar = moments[..., c:].maximum(-30.0).minimum(20.0)
        eps = ctx.random_normal(mean.shape, mean.dtype, sample_key)
        return mean + (logvar * 0.5).exp() * eps

    def decode_tiled(self, ctx: Context, latents: Tensor, tile: int = 64, overlap: int = 16) -> Tensor:
        """Decode in overlapping latent tiles, blending the seams linearly (diffusers ``AutoencoderKL.tiled_decode``
        with ``tile_latent_min_size = tile`` and ``tile_overlap_factor = overlap / tile``; the defaults are diffusers'
        for a 512-pixel sample size: 64-latent tiles every 48, 128-pixel blends).

        Tiles start every ``tile - overlap`` latent pixels; each is decoded alone (and evaluated before the next, so
        peak memory is that of one tile); a tile's top and left ``overlap * downscale`` pixels are blended with the
        tile above and the tile to the left (weights ``y / extent`` ramping up, in diffusers' order, each blend
        using the neighbours' already blended pixels), and each tile keeps its first
        ``(tile - overlap) * downscale`` rows and columns. Latents no larger than one tile are decoded whole, as
        diffusers' ``decode`` does.

        Args:
            ctx: the context to compute in.
            latents: ``[B, h, w, latent_channels]`` as :meth:`decode`.
            tile: tile side in latent pixels (> overlap).
            overlap: overlap of neighbouring tiles in latent pixels (>= 0).

        Returns:
            images ``[B, h * downscale, w * downscale, out_channels]``, as :meth:`decode`.

        Raises:
            InvalidRequestError: ``tile <= overlap``, ``overlap < 0``, or bad ``latents``.
        """
        z = self._check(latents, self.latent_channels, "latents")
        return decode_in_tiles(ctx, z, lambda part: self.decode(ctx, part), self.downscale, tile, overlap)


def decode_in_tiles(ctx: Context, z: Tensor, decode: Callable[[Tensor], Tensor], downscale: int, tile: int,
                    overlap: int, whole: Callable[[], Tensor] | None = None) -> Tensor:
    """The tile loop of diffusers' ``tiled_decode`` (``AutoencoderKL``'s and ``AutoencoderKLQwenImage``'s, which
    agree): tiles of ``tile`` latent pixels start every ``tile - overlap``; each is decoded alone by ``decode`` and
    evaluated before the next (peak memory is one tile's); a tile's top and left ``overlap * downscale`` pixels are
    blended with the tile above and the tile to the left (weights ``y / extent`` ramping up, in diffusers' order,
    each blend using the neighbours' already blended pixels), and each tile keeps its first
    ``(tile - overlap) * downscale`` rows and columns. Latents no larger than one tile go whole to ``whole()`` (or
    ``decode``), as diffusers' ``decode`` does.

    Args:
        z: ``[B, h, w, C]`` latents as ``decode`` takes them.
        decode: ``decode(tile_latents) -> images [B, th * downscale, tw * downscale, 3]``.

    Raises:
        InvalidRequestError: ``tile <= overlap`` or ``overlap < 0``.
    """
    if overlap < 0 or tile <= overlap:
        raise InvalidRequestError(f"tiled decode needs 0 <= overlap < tile, got tile={tile}, overlap={overlap}")
    _, h, w, _ = z.shape
    if h <= tile and w <= tile:
        return whole() if whole is not None else decode(z)
    stride = tile - overlap
    blend = overlap * downscale
    keep = stride * downscale
    rows: list[list[Tensor]] = []
    for i in range(0, h, stride):
        row = []
        for j in range(0, w, stride):
            t = decode(z[:, i:i + tile, j:j + tile, :])
            ctx.evaluate(t)
            row.append(t)
        rows.append(row)
    out_rows = []
    for i, row in enumerate(rows):
        for j in range(len(row)):
            t = row[j]
            if i > 0:
                t = _blend(ctx, rows[i - 1][j], t, blend, axis=1)
            if j > 0:
                t = _blend(ctx, row[j - 1], t, blend, axis=2)
            row[j] = t  # diffusers blends in place: later tiles see this blended tile
        out_rows.append(ctx.concatenate([t[:, :keep, :keep, :] for t in row], axis=2))
    return ctx.concatenate(out_rows, axis=1)


def _blend(ctx: Context, a: Tensor, b: Tensor, extent: int, axis: int) -> Tensor:
    """diffusers ``blend_v`` (axis 1, rows) / ``blend_h`` (axis 2, columns) channels last: the first ``e`` lines of
    ``b`` become ``a[-e + y] * (1 - y / e) + b[y] * (y / e)``, ``e = min(extent, a's size, b's size)``."""
    e = min(a.shape[axis], b.shape[axis], extent)
    if e <= 0:
        return b
    y = np.arange(e, dtype=np.float64)
    shape = [1, 1, 1, 1]
    shape[axis] = e
    wa = ctx.from_numpy((1 - y / e).astype(np.float32).reshape(shape), b.dtype)
    wb = ctx.from_numpy((y / e).astype(np.float32).reshape(shape), b.dtype)
    n = a.shape[axis]
    if axis == 1:
        head = a[:, n - e:, :, :] * wa + b[:, :e, :, :] * wb
        return ctx.concatenate([head, b[:, e:, :, :]], axis=1)
    head = a[:, :, n - e:, :] * wa + b[:, :, :e, :] * wb
    return ctx.concatenate([head, b[:, :, e:, :]], axis=2)
