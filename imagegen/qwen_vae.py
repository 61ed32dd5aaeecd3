"""The Qwen-Image VAE (``AutoencoderKLQwenImage``, the Wan 2.1 video VAE fine-tuned) on single images, decoder and
encoder, on the ml interfaces.

Source: diffusers ``models/autoencoders/autoencoder_kl_qwenimage.py`` (``QwenImageCausalConv3d``,
``QwenImageRMS_norm``, ``QwenImageResample``, ``QwenImageResidualBlock``, ``QwenImageAttentionBlock``,
``QwenImageMidBlock``, ``QwenImageEncoder3d``, ``QwenImageUpBlock``, ``QwenImageDecoder3d``, ``_encode``,
``_decode``, ``tiled_decode``); the architecture is Wan's (Wan Team 2025, "Wan: Open and Advanced Large-Scale Video
Generative Models", arXiv:2503.20314).

One frame: the VAE is a 3D causal network, and an image is a video of one frame. Every causal convolution pads two
zero frames in front (its feature cache is empty for the first chunk), so on one frame a ``3 x k x k`` kernel reduces
to its last time slice, a ``k x k`` 2D convolution; the temporal up- and down-sampling convolutions (``time_conv``)
are skipped on the first chunk, as diffusers skips them. This module therefore runs 2D convolutions, channels last
(``[B, H, W, C]``), with weights ``[O, I, kT, kH, kW]`` cut to ``[O, kH, kW, I]`` at load.

Normalization: ``QwenImageRMS_norm`` is ``F.normalize(x, dim=C) * sqrt(C) * gamma``, which is the RMS norm over the
channels (``x / sqrt(mean(x^2)) * gamma``), computed here with :meth:`Tensor.rms_norm` and a negligible eps.

Latent convention (as diffusers' Qwen-Image pipelines): the transformer sees ``z = (x - latents_mean) /
latents_std`` per channel; :meth:`QwenImageVAE.decode` takes ``x = z * latents_std + latents_mean`` (the caller
unnormalizes) and clamps its output to ``[-1, 1]``; :meth:`QwenImageVAE.encode` returns ``x`` (the mode of the
posterior, or a sample).

This module imports the ml interfaces only (never ``mlx``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from mlx_engine.errors import InvalidRequestError, UnsupportedError, WeightsError
from mlx_engine.imagegen.vae import decode_in_tiles, pad_right_bottom
from mlx_engine.ml import Backend, Context, DType, Tensor

__all__ = ["QwenImageVAE", "QwenVAEConfig"]

_NORM_EPS = 1e-12  # F.normalize's floor on the norm; as an RMS eps it changes nothing for real activations


@dataclass(frozen=True)
class QwenVAEConfig:
    """The keys of a diffusers ``vae/config.json`` of ``AutoencoderKLQwenImage`` (defaults: diffusers')."""

    base_dim: int = 96
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    attn_scales: tuple[float, ...] = ()
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    input_channels: int = 3
    latents_mean: tuple[float, ...] = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134,
                                       -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
    latents_std: tuple[float, ...] = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526,
                                      2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)

    @property
    def scale_factor(self) -> int:
        """Pixels per latent along each side: ``2 ** len(temperal_downsample)`` (diffusers' pipelines)."""
        return 2 ** len(self.temperal_downsample)

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any], where: str = "config.json") -> "QwenVAEConfig":
        """Raises UnsupportedError for another ``_class_name`` and WeightsError for inconsistent values."""
        name = cfg.get("_class_name")
        if name is not None and name != "AutoencoderKLQwenImage":
            raise UnsupportedError(f"{where}: _class_name {name!r} is not supported; expected 'AutoencoderKLQwenImage'")
        kw: dict[str, Any] = {}
        for f in cls.__dataclass_fields__:
            if cfg.get(f) is not None:
                kw[f] = tuple(cfg[f]) if isinstance(cfg[f], (list, tuple)) else cfg[f]
        c = cls(**kw)
        if len(c.temperal_downsample) != len(c.dim_mult) - 1:
            raise WeightsError(f"{where}: temperal_downsample needs len(dim_mult) - 1 = {len(c.dim_mult) - 1} entries")
        if c.attn_scales:  # diffusers' encoder cannot run them either (its attention blocks take no feature cache)
            raise UnsupportedError(f"{where}: attn_scales {list(c.attn_scales)} is not supported (Qwen-Image has none)")
        if len(c.latents_mean) != c.z_dim or len(c.latents_std) != c.z_dim:
            raise WeightsError(f"{where}: latents_mean and latents_std need z_dim = {c.z_dim} values each")
        return c


class _Conv:
    """A 2D convolution channels last (weight ``[O, kH, kW, I]``), ``padding`` on every side, or a 1x1 one."""

    __slots__ = ("weight", "bias", "stride", "padding")

    def __init__(self, weight: Tensor, bias: Tensor, stride: int = 1, padding: int = 0):
        self.weight, self.bias, self.stride, self.padding = weight, bias, stride, padding

    def __call__(self, x: Tensor) -> Tensor:
        return x.conv2d(self.weight, self.bias, stride=self.stride, padding=self.padding)


class _Resnet:
    """``QwenImageResidualBlock``: ``shortcut(x) + conv2(silu(norm2(conv1(silu(norm1(x))))))``."""

    __slots__ = ("norm1", "conv1", "norm2", "conv2", "shortcut")

    def __init__(self, norm1, conv1, norm2, conv2, shortcut):
        self.norm1, self.conv1, self.norm2, self.conv2, self.shortcut = norm1, conv1, norm2, conv2, shortcut

    def __call__(self, ctx: Context, x: Tensor) -> Tensor:
        h = self.conv1(x.rms_norm(self.norm1, _NORM_EPS).silu())
        h = self.conv2(h.rms_norm(self.norm2, _NORM_EPS).silu())
        return (self.shortcut(x) if self.shortcut is not None else x) + h


class _Attention:
    """``QwenImageAttentionBlock``: one head over the pixels of each frame, ``x + proj(sdpa(qkv(norm(x))))``."""

    __slots__ = ("norm", "qkv", "proj")

    def __init__(self, norm: Tensor, qkv: tuple[Tensor, Tensor], proj: tuple[Tensor, Tensor]):
        self.norm, self.qkv, self.proj = norm, qkv, proj

    def __call__(self, ctx: Context, x: Tensor) -> Tensor:
        b, h, w, c = x.shape
        t = x.rms_norm(self.norm, _NORM_EPS).reshape(b, 1, h * w, c).linear(*self.qkv)
        q, k, v = t[..., :c], t[..., c:2 * c], t[..., 2 * c:]
        o = ctx.scaled_dot_product_attention(q, k, v, scale=1.0 / math.sqrt(c))
        return x + o.reshape(b, h, w, c).linear(*self.proj)


class _Resample:
    """``QwenImageResample`` on one frame: ``upsample*``: nearest x2 then a 3x3 convolution to half the channels;
    ``downsample*``: zero pad right and bottom, 3x3 convolution with stride 2."""

    __slots__ = ("conv", "up")

    def __init__(self, conv: _Conv, up: bool):
        self.conv, self.up = conv, up

    def __call__(self, ctx: Context, x: Tensor) -> Tensor:
        return self.conv(x.upsample_nearest(2)) if self.up else self.conv(pad_right_bottom(ctx, x))


class _Loader:
    """Fetches diffusers names from a backend, checks shapes, and cuts causal 3D kernels to 2D channels-last ones."""

    def __init__(self, backend: Backend, where: str):
        self.weights = backend.weights
        self.ctx = backend.new_context()  # holds the cut kernels (kept open: they live as long as the VAE)
        self.where = where

    def get(self, name: str, shape: tuple[int, ...]) -> Tensor:
        t = self.weights.get(name)
        if t is None:
            raise WeightsError(f"{self.where}: tensor {name!r} is missing (the VAE config expects it)")
        if tuple(t.shape) != tuple(shape):
            raise WeightsError(f"{self.where}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)} "
                               "from the VAE config")
        return t

    def conv(self, prefix: str, cin: int, cout: int, k: int, *, three_d: bool = True, stride: int = 1) -> _Conv:
        """A (causal 3D, or 2D) convolution's weights as a 2D channels-last ``_Conv``; ``stride`` 2 takes no padding
        (``Downsample``'s zero pad comes first), the others pad ``k // 2`` on every side."""
        t = self.get(prefix + ".weight", (cout, cin, k, k, k) if three_d else (cout, cin, k, k))
        w = t.numpy()
        if three_d:
            w = w[:, :, -1]  # causal padding: only the last time slice meets the one frame
        w = np.ascontiguousarray(w.transpose(0, 2, 3, 1))
        return _Conv(self.ctx.from_numpy(w, t.dtype), self.get(prefix + ".bias", (cout,)), stride,
                     0 if stride == 2 else k // 2)

    def linear(self, prefix: str, cin: int, cout: int) -> tuple[Tensor, Tensor]:
        """A 1x1 2D convolution as a linear weight ``[O, I]``."""
        return self.get(prefix + ".weight", (cout, cin, 1, 1)).reshape(cout, cin), self.get(prefix + ".bias", (cout,))

    def norm(self, prefix: str, c: int, images: bool = False) -> Tensor:
        return self.get(prefix + ".gamma", (c, 1, 1) if images else (c, 1, 1, 1)).reshape(c)

    def resnet(self, prefix: str, cin: int, cout: int) -> _Resnet:
        return _Resnet(self.norm(prefix + ".norm1", cin), self.conv(prefix + ".conv1", cin, cout, 3),
                       self.norm(prefix + ".norm2", cout), self.conv(prefix + ".conv2", cout, cout, 3),
                       self.conv(prefix + ".conv_shortcut", cin, cout, 1) if cin != cout else None)

    def attention(self, prefix: str, c: int) -> _Attention:
        return _Attention(self.norm(prefix + ".norm", c, images=True), self.linear(prefix + ".to_qkv", c, 3 * c),
                          self.linear(prefix + ".proj", c, c))

    def mid(self, prefix: str, c: int) -> list:
        return [self.resnet(prefix + ".resnets.0", c, c), self.attention(prefix + ".attentions.0", c),
                self.resnet(prefix + ".resnets.1", c, c)]


class QwenImageVAE:
    """diffusers' ``AutoencoderKLQwenImage`` on single images, channels last.

    Attributes:
        config: the :class:`QwenVAEConfig`. latent_channels: ``z_dim`` (16). downscale: pixels per latent (8).
        latents_mean, latents_std: float32 ``[z_dim]`` (the pipeline's normalization of the latents).
        dtype: the compute dtype (the backend's weights').
    """

    def __init__(self, config: QwenVAEConfig, encoder: list, encoder_head: tuple, decoder: list,
                 decoder_head: tuple, quant: _Conv, post_quant: _Conv, dtype: DType):
        self.config = config
        self._encoder, self._encoder_head = encoder, encoder_head
        self._decoder, self._decoder_head = decoder, decoder_head
        self._quant, self._post_quant = quant, post_quant
        self.dtype = dtype
        self.latent_channels = config.z_dim
        self.downscale = config.scale_factor
        self.latents_mean = np.asarray(config.latents_mean, np.float32)
        self.latents_std = np.asarray(config.latents_std, np.float32)

    @classmethod
    def from_backend(cls, backend: Backend) -> "QwenImageVAE":
        """Build from a backend opened on a diffusers ``vae/`` folder (``config.json`` + safetensors). The VAE keeps
        its own 2D copies of the convolution weights: the caller may ``backend.close()`` afterwards.

        Raises:
            WeightsError: no VAE config, a missing tensor or one of the wrong shape (the message names it).
            UnsupportedError: another VAE class.
        """
        where = str(getattr(backend, "path", None) or "the VAE backend")
        meta = dict(backend.metadata)
        if "z_dim" not in meta and "_class_name" not in meta:
            raise WeightsError(f"{where}: no VAE config.json (expected diffusers' AutoencoderKLQwenImage config)")
        cfg = QwenVAEConfig.from_dict(meta, where=f"{where}/config.json")
        ld = _Loader(backend, where)
        some = next(iter(backend.weights.values()), None)
        dtype = some.dtype if some is not None and some.dtype.is_floating else backend.compute_dtype
        base, mult, z = cfg.base_dim, cfg.dim_mult, cfg.z_dim

        # Encoder (QwenImageEncoder3d): conv_in; per level num_res_blocks resnets and a downsample but the last
        # (one flat down_blocks list); mid block; RMS norm, SiLU, conv_out to 2 z (mean, logvar).
        dims = [base * u for u in (1, *mult)]
        enc: list = []
        for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
            for _ in range(cfg.num_res_blocks):
                enc.append(ld.resnet(f"encoder.down_blocks.{len(enc)}", cin, cout))
                cin = cout
            if i != len(mult) - 1:
                enc.append(_Resample(ld.conv(f"encoder.down_blocks.{len(enc)}.resample.1", cout, cout, 3,
                                             three_d=False, stride=2), up=False))
        enc += ld.mid("encoder.mid_block", dims[-1])
        enc_head = (ld.conv("encoder.conv_in", cfg.input_channels, dims[0], 3),
                    ld.norm("encoder.norm_out", dims[-1]), ld.conv("encoder.conv_out", dims[-1], 2 * z, 3))

        # Decoder (QwenImageDecoder3d): conv_in; mid block; per level num_res_blocks + 1 resnets (the input
        # width halved after an upsample) and an upsample (to half the channels) but the last; RMS norm, SiLU,
        # conv_out.
        dims = [base * u for u in (mult[-1], *mult[::-1])]
        dec: list = ld.mid("decoder.mid_block", dims[0])
        for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
            if i > 0:
                cin //= 2
            for j in range(cfg.num_res_blocks + 1):
                dec.append(ld.resnet(f"decoder.up_blocks.{i}.resnets.{j}", cin if j == 0 else cout, cout))
            if i != len(mult) - 1:
                dec.append(_Resample(ld.conv(f"decoder.up_blocks.{i}.upsamplers.0.resample.1", cout, cout // 2, 3,
                                             three_d=False), up=True))
        dec_head = (ld.conv("decoder.conv_in", z, dims[0], 3), ld.norm("decoder.norm_out", dims[-1]),
                    ld.conv("decoder.conv_out", dims[-1], cfg.input_channels, 3))
        quant = ld.conv("quant_conv", 2 * z, 2 * z, 1)
        post = ld.conv("post_quant_conv", z, z, 1)
        return cls(cfg, enc, enc_head, dec, dec_head, quant, post, dtype)

    # ---- inference -------------------------------------------------------------------------------------------------
    def _check(self, x: Tensor, channels: int, what: str) -> Tensor:
        if x.ndim != 4 or x.shape[-1] != channels:
            raise InvalidRequestError(f"{what} must be [B, H, W, {channels}] (channels last), got {list(x.shape)}")
        return x if x.dtype == self.dtype else x.astype(self.dtype)

    def _run(self, ctx: Context, x: Tensor, layers: list) -> Tensor:
        for layer in layers:
            x = layer(ctx, x)
        return x

    def _decode_raw(self, ctx: Context, z: Tensor) -> Tensor:
        conv_in, norm, conv_out = self._decoder_head
        x = self._run(ctx, conv_in(self._post_quant(z)), self._decoder)
        return conv_out(x.rms_norm(norm, _NORM_EPS).silu())

    def decode(self, ctx: Context, latents: Tensor) -> Tensor:
        """Decode one frame of latents to images (diffusers ``AutoencoderKLQwenImage._decode`` on ``num_frame = 1``:
        ``post_quant_conv``, the decoder, clamp to ``[-1, 1]``).

        Args:
            ctx: the context to compute in.
            latents: ``[B, h, w, z_dim]`` channels last, already unnormalized (``z * latents_std + latents_mean``),
                any float dtype (cast to :attr:`dtype`).

        Returns:
            images ``[B, h * downscale, w * downscale, 3]`` in :attr:`dtype`, in ``[-1, 1]``.

        Raises:
            InvalidRequestError: ``latents`` is not 4-D with ``z_dim`` channels.
        """
        z = self._check(latents, self.latent_channels, "latents")
        return self._decode_raw(ctx, z).maximum(-1.0).minimum(1.0)

    def decode_tiled(self, ctx: Context, latents: Tensor, tile: int = 32, overlap: int = 8) -> Tensor:
        """Decode in overlapping latent tiles blended linearly (diffusers ``AutoencoderKLQwenImage.tiled_decode``:
        256-pixel tiles every 192 pixels, i.e. ``tile = 32`` and ``overlap = 8`` latents; tiles are not clamped,
        as there; see :func:`mlx_engine.imagegen.vae.decode_in_tiles`).

        Raises:
            InvalidRequestError: ``tile <= overlap``, ``overlap < 0``, or bad ``latents``.
        """
        z = self._check(latents, self.latent_channels, "latents")
        return decode_in_tiles(ctx, z, lambda part: self._decode_raw(ctx, part), self.downscale, tile, overlap,
                               whole=lambda: self.decode(ctx, z))

    def encode(self, ctx: Context, images: Tensor, sample_key: Any = None) -> Tensor:
        """Encode images as one frame (diffusers ``AutoencoderKLQwenImage._encode`` and
        ``DiagonalGaussianDistribution``).

        Args:
            ctx: the context to compute in.
            images: ``[B, H, W, 3]`` in ``[-1, 1]``, ``H`` and ``W`` multiples of :attr:`downscale`.
            sample_key: None for the posterior's mode (its mean), or a random key to draw ``mean + exp(logvar / 2)
                * eps`` with ``logvar`` clipped to ``[-30, 20]``.

        Returns:
            unnormalized latents ``[B, H / downscale, W / downscale, z_dim]`` in :attr:`dtype` (the caller applies
            ``(x - latents_mean) / latents_std``).
        """
        x = self._check(images, self.config.input_channels, "images")
        conv_in, norm, conv_out = self._encoder_head
        x = self._run(ctx, conv_in(x), self._encoder)
        moments = self._quant(conv_out(x.rms_norm(norm, _NORM_EPS).silu()))
        c = self.latent_channels
        mean = moments[..., :c]
        if sample_key is None:
            return mean
        logvar = moments[..., c:].maximum(-30.0).minimum(20.0)
        return mean + (logvar * 0.5).exp() * ctx.random_normal(mean.shape, mean.dtype, sample_key)
