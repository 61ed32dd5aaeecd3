"""Qwen2.5-VL's vision tower (``Qwen2_5_VisionTransformerPretrainedModel``, Bai et al., "Qwen2.5-VL Technical Report",
2025) and the image preprocessing of its ``Qwen2VLImageProcessor``: a ViT with window attention, 2D RoPE and a 2x2
patch merger, whose rows replace a prompt's ``<|image_pad|>`` tokens.

``patches [N, C * T * p * p]`` (``N = t * h * w`` patches of ``p = 14`` pixels, ``T = 2`` frames, in merge-block
order: the 2x2 patches of each merged token are consecutive) -> patch embedding (a Conv3d with stride = kernel, i.e. a
linear map of each flattened patch) -> reordered by windows (``window_size / (merge * p)`` merged tokens a side,
``8 x 8`` for 112 pixels) -> ``depth`` pre-norm blocks (RMSNorm, attention with a fused biased ``qkv`` and 2D RoPE,
RMSNorm, SiLU-gated MLP with biases); the blocks in ``fullatt_block_indexes`` attend over the whole image, the others
only inside their window -> the merger (RMSNorm, the 4 patches of a merged token concatenated, Linear, exact GELU,
Linear) -> back to raster order -> ``[N / 4, out_hidden_size]``.

2D RoPE (``Qwen2_5_VLVisionRotaryEmbedding``, axial): ``inv_freq = 1 / theta ** (arange(0, Dh/2, 2) / (Dh/2))``;
a patch at row ``r``, column ``c`` gets the angles ``cat(r * inv_freq, c * inv_freq)`` for the ``Dh / 2`` rotary pairs
``(i, i + Dh/2)`` (the halves convention), applied in float32.

Preprocessing (``Qwen2VLImageProcessor``): the image resized (PIL bicubic) to ``smart_resize``'s size (both sides
multiples of ``p * merge`` = 28, the area kept within ``min_pixels .. max_pixels``), scaled to ``[0, 1]``, normalised with
OpenAI CLIP's mean and std, repeated to ``T`` frames and cut into patches in the order above.

Reference: transformers' ``models/qwen2_5_vl/modeling_qwen2_5_vl.py``, ``vision_utils.py``
(``get_vision_position_ids``, ``get_vision_window_index``) and ``models/qwen2_vl/image_processing_qwen2_vl.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from mlx_engine.errors import InvalidRequestError, WeightsError
from mlx_engine.ml import Context, DType, Tensor
from mlx_engine.models.vision.mllama_vision import CLIP_MEAN, CLIP_STD

__all__ = ["Qwen25VisionConfig", "Qwen25Vision", "smart_resize", "image_patches"]



@dataclass(frozen=True)
class Qwen25VisionConfig:
    """Hyper-parameters of the tower (a Hugging Face ``vision_config`` of ``qwen2_5_vl``)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    in_channels: int = 3
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, config: Any) -> "Qwen25VisionConfig":
        """Raises ``WeightsError`` for an incomplete config, or sizes that are not positive or do not divide."""
        try:
            rope = config.get("rope_parameters") or {}
            c = cls(int(config["depth"]), int(config["hidden_size"]), int(config["intermediate_size"]),
                    int(config["num_heads"]), int(config["out_hidden_size"]),
                    tuple(int(i) for i in config.get("fullatt_block_indexes", (7, 15, 23, 31))),
                    int(config.get("patch_size", 14)), int(config.get("temporal_patch_size", 2)),
                    int(config.get("spatial_merge_size", 2)), int(config.get("window_size", 112)),
                    int(config.get("in_channels", 3)), float(rope.get("rope_theta", config.get("rope_theta", 1e4))))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise WeightsError(f"the Qwen2.5-VL vision config is incomplete or invalid: {e}") from e
        if (min(c.depth, c.hidden_size, c.intermediate_size, c.num_heads, c.out_hidden_size, c.patch_size,
                c.temporal_patch_size, c.spatial_merge_size, c.in_channels) <= 0 or c.depth > 1024
                or c.hidden_size % c.num_heads or (c.hidden_size // c.num_heads) % 4
                or c.window_size < c.patch_size * c.spatial_merge_size):
            raise WeightsError(f"the Qwen2.5-VL vision config is inconsistent: {c}")
        return c

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def factor(self) -> int:
        """Pixels per merged token a side (28)."""
        return self.patch_size * self.spatial_merge_size

    @property
    def patch_features(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 28 * 28 * 1280) -> tuple[int, int]:
    """The ``(height, width)`` an image is resized to: sides multiples of ``factor``, aspect ratio kept as nearly as
    may be, area within ``min_pixels .. max_pixels`` (transformers' ``smart_resize``, same rounding).

    Raises:
        InvalidRequestError: an aspect ratio above 200 (the reference's limit), or an empty image.
    """
    if min(height, width) <= 0:
        raise InvalidRequestError(f"an image of {width} x {height} pixels is empty")
    if max(height, width) / min(height, width) > 200:
        raise InvalidRequestError(f"an image of {width} x {height} pixels is too narrow: the aspect ratio must be "
                                  "at most 200")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_patches(image: Image.Image, config: Qwen25VisionConfig, min_pixels: int = 56 * 56,
                  max_pixels: int = 28 * 28 * 1280) -> tuple[np.ndarray, tuple[int, int, int]]:
    """An RGB image as the tower's input: ``(patches float32 [t*h*w, C*T*p*p], grid (t, h, w))`` in patches, as
    ``Qwen2VLImageProcessor`` (see the module docstring; ``t = 1`` for an image)."""
    rh, rw = smart_resize(image.height, image.width, config.factor, min_pixels, max_pixels)
    image = image.convert("RGB")
    if (image.width, image.height) != (rw, rh):
        image = image.resize((rw, rh), Image.BICUBIC)
    x = (np.asarray(image, np.float32) / np.float32(255.0) - np.float32(CLIP_MEAN)) / np.float32(CLIP_STD)  # [H, W, C]
    p, m, tp = config.patch_size, config.spatial_merge_size, config.temporal_patch_size
    gh, gw = rh // p, rw // p
    x = np.broadcast_to(x.transpose(2, 0, 1)[None], (tp, 3, rh, rw))  # one frame repeated to T
    x = x.reshape(tp, 3, gh // m, m, p, gw // m, m, p).transpose(2, 5, 3, 6, 1, 0, 4, 7)
    return np.ascontiguousarray(x.reshape(gh * gw, -1)), (1, gh, gw)


def _window_index(grid: tuple[int, int, int], merge: int, window: int) -> tuple[np.ndarray, list[int]]:
    """The merged tokens in window order (raster inside each window, windows in raster order; windows at the right
    and bottom edges are cut short) and the windows' lengths in merged tokens (``get_vision_window_index``)."""
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    index = np.arange(t * h * w).reshape(t, h, w)
    order, lengths = [], []
    for f in range(t):
        for r in range(0, h, window):
            for c in range(0, w, window):
                block = index[f, r:r + window, c:c + window].reshape(-1)
                order.append(block)
                lengths.append(block.size)
    return np.concatenate(order), lengths


class Qwen25Vision:
    """The tower over weights named as in a Hugging Face checkpoint below ``visual.`` (``patch_embed.proj.weight``,
    ``blocks.N.{norm1,norm2,attn.qkv,attn.proj,mlp.gate_proj,mlp.up_proj,mlp.down_proj}``,
    ``merger.{ln_q,mlp.0,mlp.2}``).

    Raises (constructor):
        WeightsError: a tensor missing or of a shape the config does not imply.
    """

    def __init__(self, config: Qwen25VisionConfig, weights: dict[str, Tensor]):
        self.config = c = config
        d, f, merged = c.hidden_size, c.intermediate_size, c.hidden_size * c.spatial_merge_size ** 2
        want = {"patch_embed.proj.weight": (d, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size),
                "merger.ln_q.weight": (d,), "merger.mlp.0.weight": (merged, merged), "merger.mlp.0.bias": (merged,),
                "merger.mlp.2.weight": (c.out_hidden_size, merged), "merger.mlp.2.bias": (c.out_hidden_size,)}
        for i in range(c.depth):
            q = f"blocks.{i}."
            want.update({q + "norm1.weight": (d,), q + "norm2.weight": (d,), q + "attn.qkv.weight": (3 * d, d),
                         q + "attn.qkv.bias": (3 * d,), q + "attn.proj.weight": (d, d), q + "attn.proj.bias": (d,),
                         q + "mlp.gate_proj.weight": (f, d), q + "mlp.gate_proj.bias": (f,),
                         q + "mlp.up_proj.weight": (f, d), q + "mlp.up_proj.bias": (f,),
                         q + "mlp.down_proj.weight": (d, f), q + "mlp.down_proj.bias": (d,)})
        for name, shape in want.items():
            if name not in weights:
                raise WeightsError(f"the vision tower lacks visual.{name}; is the checkpoint complete?")
            if tuple(weights[name].shape) != shape:
                raise WeightsError(f"visual.{name} has shape {tuple(weights[name].shape)}, the config implies {shape}")
        self.w = {n: weights[n] for n in want}
        # the Conv3d with stride = kernel is a linear map of each flattened (C, T, p, p) patch
        self.patch_weight = self.w["patch_embed.proj.weight"].dequantize().reshape(d, c.patch_features)
        half = c.head_dim // 2
        self.inv_freq = (1.0 / c.rope_theta ** (np.arange(0, half, 2, dtype=np.float32) / np.float32(half))
                         ).astype(np.float32)

    def _rope(self, grid: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
        """``cos, sin`` float32 ``[N, Dh]`` of each patch in input (merge-block) order."""
        t, h, w = grid
        m = self.config.spatial_merge_size
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        blocks = (h // m, m, w // m, m)
        rows = np.tile(rows.reshape(blocks).transpose(0, 2, 1, 3).reshape(-1), t)
        cols = np.tile(cols.reshape(blocks).transpose(0, 2, 1, 3).reshape(-1), t)
        ang = np.concatenate([rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq], axis=-1)
        ang = np.concatenate([ang, ang], axis=-1).astype(np.float32)
        return np.cos(ang), np.sin(ang)

    def __call__(self, ctx: Context, patches: "Tensor | np.ndarray", grid: tuple[int, int, int]) -> Tensor:
        """One image's (or video's) patches ``[t*h*w, C*T*p*p]`` float, from :func:`image_patches`, with their grid
        ``(t, h, w)`` in patches -> merged features float32 ``[t*h*w / merge**2, out_hidden_size]`` in raster order of
        the merged grid.

        Raises:
            InvalidRequestError: patches that do not match the grid, or a grid not divisible by the merge size.
        """
        c, w = self.config, self.w
        t, h, wd = (int(v) for v in grid)
        m, unit = c.spatial_merge_size, c.spatial_merge_size ** 2
        n = t * h * wd
        if min(t, h, wd) <= 0 or h % m or wd % m or tuple(patches.shape) != (n, c.patch_features):
            raise InvalidRequestError(f"vision patches of shape {tuple(patches.shape)} do not fit the grid {grid} "
                                      f"(want [{n}, {c.patch_features}], sides multiples of {m})")
        if isinstance(patches, np.ndarray):
            patches = ctx.from_numpy(patches.astype(np.float32))
        dtype = patches.dtype
        order, lengths = _window_index((t, h, wd), m, c.window_size // c.factor)
        # the patches of each merged token stay together when the merged tokens are put in window order
        patch_order = (order[:, None] * unit + np.arange(unit)).reshape(-1)
        cos, sin = (ctx.from_numpy(a[patch_order][None, None]) for a in self._rope((t, h, wd)))
        x = patches.linear(self.patch_weight.astype(dtype)).take(ctx.from_numpy(patch_order.astype(np.int32)), 0)
        visible = np.zeros((n, n), bool)
        start = 0
        for length in lengths:
            visible[start:start + length * unit, start:start + length * unit] = True
            start += length * unit
        window_mask = ctx.attention_mask(visible, dtype)
        heads, dh, d = c.num_heads, c.head_dim, c.hidden_size
        for i in range(c.depth):
            p = f"blocks.{i}."
            y = x.rms_norm(w[p + "norm1.weight"], 1e-6)
            qkv = y.linear(w[p + "attn.qkv.weight"], w[p + "attn.qkv.bias"]).reshape(n, 3, heads, dh)
            qkv = qkv.transpose(1, 2, 0, 3)  # [3, H, N, Dh]
            q, k, v = (self._rotate(ctx, qkv[j][None], cos, sin) if j < 2 else qkv[j][None] for j in range(3))
            mask = None if i in c.fullatt_block_indexes else window_mask
            o = ctx.scaled_dot_product_attention(q.astype(dtype), k.astype(dtype), v, dh ** -0.5, mask)
            x = x + o[0].transpose(1, 0, 2).reshape(n, d).linear(w[p + "attn.proj.weight"], w[p + "attn.proj.bias"])
            y = x.rms_norm(w[p + "norm2.weight"], 1e-6)
            g = y.linear(w[p + "mlp.gate_proj.weight"], w[p + "mlp.gate_proj.bias"]).silu()
            x = x + (g * y.linear(w[p + "mlp.up_proj.weight"], w[p + "mlp.up_proj.bias"])).linear(
                w[p + "mlp.down_proj.weight"], w[p + "mlp.down_proj.bias"])
        y = x.rms_norm(w["merger.ln_q.weight"], 1e-6).reshape(n // unit, unit * d)
        y = y.linear(w["merger.mlp.0.weight"], w["merger.mlp.0.bias"]).gelu()
        y = y.linear(w["merger.mlp.2.weight"], w["merger.mlp.2.bias"])
        return y.take(ctx.from_numpy(np.argsort(order).astype(np.int32)), 0).astype(DType.FLOAT32)

    @staticmethod
    def _rotate(ctx: Context, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """``x * cos + rotate_half(x) * sin`` in float32 (``apply_rotary_pos_emb_vision``), ``x [1, H, N, Dh]``."""
        x = x.astype(DType.FLOAT32)
        half = x.shape[-1] // 2
        return x * cos + ctx.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin
