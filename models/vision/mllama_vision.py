"""Llama 3.2 Vision's image side (``MllamaVisionModel`` and its processor): an image cut into up to ``max_num_tiles``
square tiles, a ViT over all of them at once, and the projection into the text model's width, whose rows the text
model's cross-attention layers read (``models/arch/mllama.py``).

- Processor (transformers' ``MllamaImageProcessor``): the tile grid ``(rows, cols)`` with ``rows * cols <=
  max_num_tiles`` that needs the least upscaling (else the least downscaling; ties to the smaller canvas), the image
  resized (bilinear) to fit it keeping its aspect ratio, padded with black at the right and bottom, ``(x / 255 -
  mean) / std`` with CLIP's mean and std, then cut into tiles in row-major order. The grid's ``aspect_ratio_id`` is
  its index (from 1) among every ``(a, b)``, ``a * b <= max_num_tiles``, in increasing ``a`` then ``b``.
- Encoder: patches of each tile (a strided convolution without bias), a gated per-grid tile embedding, the class
  token, gated position embeddings (``(1 - tanh g) * pos + tanh g * tile_pos[grid]``), LayerNorm, each tile padded
  to a multiple of 8 rows; the local layers (pre-norm LayerNorm, attention without biases, exact-GELU MLP) over all
  ``max_num_tiles`` tiles' rows together (padding tiles included, as the reference computes them), LayerNorm, a
  second gated tile embedding, the global layers (the same with ``tanh``-gated residuals); the padding removed, the
  last hidden state and the outputs of ``intermediate_layers_indices`` (interleaved feature by feature) joined, then
  ``multi_modal_projector`` (linear with bias). Attention is masked only between two padding rows (padding tiles and
  the rows added to reach a multiple of 8), exactly as the reference's ``_prepare_aspect_ratio_attention_mask``.
- Prompt: ``<|image|>`` is one token of the text, left in place; the image's rows (its real tiles only: the padding
  tiles are masked out of cross-attention in the reference) enter the encoder cache at that token's position.

Reference: transformers' ``models/mllama/modeling_mllama.py`` and ``image_processing_pil_mllama.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from mlx_engine.errors import InvalidRequestError, WeightsError
from mlx_engine.ml import Backend, Context, DType, Tensor
from mlx_engine.models.vision.images import PromptImage, load_image

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@lru_cache(maxsize=16)
def tile_grids(max_tiles: int) -> tuple[tuple[int, int], ...]:
    """Every ``(a, b)`` with ``a * b <= max_tiles``, in the reference's order (``aspect_ratio_id - 1`` indexes it)."""
    return tuple((a, b) for a in range(1, max_tiles + 1) for b in range(1, max_tiles + 1) if a * b <= max_tiles)


def tile_grid(height: int, width: int, max_tiles: int, tile: int) -> tuple[int, int]:
    """``(rows, cols)`` of tiles for an image (transformers' ``get_optimal_tiled_canvas``)."""
    grids = np.array(tile_grids(max_tiles))
    canvas = grids * tile
    scale_h, scale_w = canvas[:, 0] / height, canvas[:, 1] / width
    scales = np.where(scale_w > scale_h, scale_h, scale_w)
    up = scales[scales >= 1]
    chosen = np.min(up) if len(up) else np.max(scales[scales < 1])
    options = grids[scales == chosen]
    rows, cols = options[np.argmin(options[:, 0] * options[:, 1])]
    return int(rows), int(cols)


def fit_size(height: int, width: int, canvas_h: int, canvas_w: int, tile: int) -> tuple[int, int]:
    """The resized ``(height, width)`` inside the canvas, aspect ratio kept (``get_image_size_fit_to_canvas``)."""
    target_w = int(np.clip(width, tile, canvas_w))
    target_h = int(np.clip(height, tile, canvas_h))
    scale_h, scale_w = target_h / height, target_w / width
    if scale_w < scale_h:
        return min(math.floor(height * scale_w) or 1, target_h), target_w
    return target_h, min(math.floor(width * scale_h) or 1, target_w)


@dataclass(frozen=True)
class TiledImageProcessor:
    """Pixels for the Mllama encoder: ``float32 [rows, cols, tile, tile, 3]`` (channels last) for one image."""

    tile: int
    max_tiles: int
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD

    def __call__(self, image: Any) -> np.ndarray:
        from PIL import Image

        img = load_image(image)
        rows, cols = tile_grid(img.height, img.width, self.max_tiles, self.tile)
        h, w = fit_size(img.height, img.width, rows * self.tile, cols * self.tile, self.tile)
        canvas = np.zeros((rows * self.tile, cols * self.tile, 3), np.uint8)
        canvas[:h, :w] = np.asarray(img.resize((w, h), Image.Resampling.BILINEAR))
        x = canvas.astype(np.float32) * np.float32(1 / 255)
        x = (x - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        t = self.tile
        return np.ascontiguousarray(x.reshape(rows, t, cols, t, 3).transpose(0, 2, 1, 3, 4), np.float32)


class MllamaVision:
    """The image encoder of a Llama 3.2 Vision checkpoint: ``encode`` gives an image's rows ``[tiles * (P + 1), D]``
    for the text model's cross-attention.

    Attributes:
        tokens_per_image: 1 (the ``<|image|>`` token the rows are attached to).
        image_token_id: that token; processor: the tiling preprocessing.
    """

    boi_text = "<|image|>"
    tokens_per_image = 1

    def __init__(self, config: dict[str, Any], weights: dict[str, Tensor], projection: tuple[Tensor, Tensor],
                 image_token_id: int, backend: Backend, text_width: int):
        """``config``: the checkpoint's ``vision_config``; ``weights``: the tensors below ``vision_model.``;
        ``projection``: ``multi_modal_projector``'s weight ``[D, Dv * (1 + k)]`` and bias.

        Raises:
            WeightsError: a config or tensors that do not fit together, or a projector that does not fit the text
                model.
        """
        try:
            self.width = int(config["hidden_size"])
            self.heads = int(config.get("attention_heads", config.get("num_attention_heads", 16)))
            self.tile, self.patch = int(config["image_size"]), int(config["patch_size"])
            self.max_tiles = int(config.get("max_num_tiles", 4))
            self.layers = int(config["num_hidden_layers"])
            self.global_layers = int(config.get("num_global_layers", 8))
            self.intermediate = [int(i) for i in config.get("intermediate_layers_indices", [3, 7, 15, 23, 30])]
            self.eps = float(config.get("norm_eps", 1e-5))
            ff = int(config["intermediate_size"])
        except (KeyError, TypeError, ValueError) as e:
            raise WeightsError(f"the vision config is incomplete or invalid: {e}") from e
        d = self.width
        if min(d, self.heads, self.tile, self.patch, self.max_tiles, self.layers) <= 0 or d % self.heads \
                or self.tile % self.patch or not all(0 <= i < self.layers for i in self.intermediate):
            raise WeightsError(f"the vision config is inconsistent: {config}")
        self.patches = (self.tile // self.patch) ** 2 + 1   # per tile, with the class token
        self.padded = -(-self.patches // 8) * 8
        grids = len(tile_grids(self.max_tiles)) + 1
        want = {"patch_embedding.weight": (d, 3, self.patch, self.patch), "class_embedding": (d,),
                "gated_positional_embedding.embedding": (self.patches, d), "gated_positional_embedding.gate": (1,),
                "gated_positional_embedding.tile_embedding.weight": (grids, self.max_tiles * self.patches * d),
                "layernorm_pre.weight": (d,), "layernorm_pre.bias": (d,), "layernorm_post.weight": (d,),
                "layernorm_post.bias": (d,)}
        for which in ("pre", "post"):
            want.update({f"{which}_tile_positional_embedding.embedding.weight": (grids, self.max_tiles * d),
                         f"{which}_tile_positional_embedding.gate": (1,)})
        for stack, n in (("transformer", self.layers), ("global_transformer", self.global_layers)):
            for i in range(n):
                p = f"{stack}.layers.{i}."
                want.update({p + f"self_attn.{x}_proj.weight": (d, d) for x in "qkvo"})
                want.update({p + f"{x}.{y}": (d,) for x in ("input_layernorm", "post_attention_layernorm")
                             for y in ("weight", "bias")})
                want.update({p + "mlp.fc1.weight": (ff, d), p + "mlp.fc1.bias": (ff,), p + "mlp.fc2.weight": (d, ff),
                             p + "mlp.fc2.bias": (d,)})
                if stack == "global_transformer":
                    want.update({p + "gate_attn": (1,), p + "gate_ffn": (1,)})
        for name, shape in want.items():
            if name not in weights:
                raise WeightsError(f"the vision model lacks vision_model.{name}; is the checkpoint complete?")
            if tuple(weights[name].shape) != shape:
                raise WeightsError(f"vision_model.{name} has shape {tuple(weights[name].shape)}, the config implies "
                                   f"{shape}")
        proj_w, proj_b = projection
        out_dim = d * (1 + len(self.intermediate))
        if tuple(proj_w.shape) != (text_width, out_dim) or tuple(proj_b.shape) != (text_width,):
            raise WeightsError(f"the multi-modal projector has shape {tuple(proj_w.shape)}, but the vision model "
                               f"gives {out_dim} features and the text model is {text_width} wide: they do not "
                               "belong together")
        self.w = {n: weights[n] for n in want}
        self.projection = (proj_w, proj_b)
        self.patch_weight = self.w["patch_embedding.weight"].dequantize().transpose(0, 2, 3, 1)  # [out, kh, kw, in]
        self.image_token_id = image_token_id
        self.backend = backend
        self.processor = TiledImageProcessor(self.tile, self.max_tiles)

    @classmethod
    def from_backend(cls, backend: Backend, text_width: int,
                     token_id: Callable[[str], "int | None"]) -> "MllamaVision | None":
        """The vision part of a Hugging Face ``MllamaForConditionalGeneration`` folder, or None for a text-only
        one. Raises ``WeightsError``."""
        meta = backend.metadata
        weights = backend.weights
        if "vision_config" not in meta or not any("vision_model." in n for n in weights):
            return None
        vision = {n.split("vision_model.", 1)[1]: t for n, t in weights.items() if "vision_model." in n}
        proj = {n.split("multi_modal_projector.", 1)[1]: t for n, t in weights.items()
                if "multi_modal_projector." in n}
        if "weight" not in proj or "bias" not in proj:
            raise WeightsError("the checkpoint has a vision model but no multi_modal_projector weight and bias")
        image_id = meta.get("image_token_index", meta.get("image_token_id"))
        if image_id is None:
            image_id = token_id(cls.boi_text)
        if image_id is None:
            raise WeightsError("the checkpoint names no image token (image_token_index) and its vocabulary has no "
                               "<|image|>")
        return cls(meta["vision_config"] or {}, vision, (proj["weight"], proj["bias"]), int(image_id), backend,
                   text_width)

    def close(self) -> None:
        """The weights belong to the text model's checkpoint: nothing of its own to let go of."""

    # ---- the encoder ---------------------------------------------------------------------------------------------
    def _layer(self, ctx: Context, x: Tensor, prefix: str, mask: Tensor, gated: bool) -> Tensor:
        w, eps, heads = self.w, self.eps, self.heads
        b, n, d = x.shape
        dh = d // heads
        y = x.layer_norm(w[prefix + "input_layernorm.weight"], w[prefix + "input_layernorm.bias"], eps)

        def proj(name: str) -> Tensor:
            return y.linear(w[prefix + f"self_attn.{name}_proj.weight"]).reshape(b, n, heads, dh).transpose(0, 2, 1, 3)

        o = ctx.scaled_dot_product_attention(proj("q"), proj("k"), proj("v"), dh ** -0.5, mask)
        o = o.transpose(0, 2, 1, 3).reshape(b, n, d).linear(w[prefix + "self_attn.o_proj.weight"])
        x = x + (w[prefix + "gate_attn"].tanh() * o if gated else o)
        y = x.layer_norm(w[prefix + "post_attention_layernorm.weight"], w[prefix + "post_attention_layernorm.bias"],
                         eps)
        y = y.linear(w[prefix + "mlp.fc1.weight"], w[prefix + "mlp.fc1.bias"]).gelu()
        y = y.linear(w[prefix + "mlp.fc2.weight"], w[prefix + "mlp.fc2.bias"])
        return x + (w[prefix + "gate_ffn"].tanh() * y if gated else y)

    def hidden_states(self, ctx: Context, pixels: np.ndarray) -> Tensor:
        """The vision model's output for one image's ``pixels [rows, cols, S, S, 3]``: ``[tiles, P + 1, Dv * (1 +
        k)]`` for its real tiles (transformers' ``MllamaVisionModel`` ``last_hidden_state``)."""
        rows, cols = pixels.shape[:2]
        real, tiles, d, p, lp = rows * cols, self.max_tiles, self.width, self.patches, self.padded
        if (rows, cols) not in tile_grids(tiles) or pixels.shape[2:] != (self.tile, self.tile, 3):
            raise InvalidRequestError(f"pixels of shape {pixels.shape} are not a tiling this model reads")
        grid = ctx.from_numpy(np.array([tile_grids(tiles).index((rows, cols)) + 1], np.int32))
        w = self.w
        padded = np.zeros((tiles, self.tile, self.tile, 3), np.float32)
        padded[:real] = pixels.reshape(real, self.tile, self.tile, 3)
        x = ctx.from_numpy(padded).conv2d(self.patch_weight, stride=self.patch).reshape(tiles, p - 1, d)
        gate = w["pre_tile_positional_embedding.gate"].tanh()
        x = x + w["pre_tile_positional_embedding.embedding.weight"].take(grid, axis=0).reshape(tiles, 1, d) * gate
        cls = (w["class_embedding"].reshape(1, 1, d) + ctx.zeros((tiles, 1, d), DType.FLOAT32).astype(x.dtype))
        x = ctx.concatenate([cls, x], axis=1)
        gate = w["gated_positional_embedding.gate"].tanh()
        x = x + (1 - gate) * w["gated_positional_embedding.embedding"]
        tile_pos = w["gated_positional_embedding.tile_embedding.weight"].take(grid, axis=0).reshape(tiles, p, d)
        x = (x + gate * tile_pos).layer_norm(w["layernorm_pre.weight"], w["layernorm_pre.bias"], 1e-5)
        x = ctx.concatenate([x, ctx.zeros((tiles, lp - p, d), DType.FLOAT32).astype(x.dtype)], axis=1)
        pad = np.zeros((tiles, lp), bool)
        pad[real:] = True
        pad[:, p:] = True
        pad = pad.reshape(-1)
        mask = ctx.from_numpy(np.where(pad[:, None] & pad[None, :], -np.inf, 0.0).astype(np.float32)).astype(x.dtype)
        x = x.reshape(1, tiles * lp, d)
        kept = {}
        for i in range(self.layers):
            x = self._layer(ctx, x, f"transformer.layers.{i}.", mask, gated=False)
            kept[i] = x
        x = x.layer_norm(w["layernorm_post.weight"], w["layernorm_post.bias"], 1e-5).reshape(tiles, lp, d)
        gate = w["post_tile_positional_embedding.gate"].tanh()
        x = x + w["post_tile_positional_embedding.embedding.weight"].take(grid, axis=0).reshape(tiles, 1, d) * gate
        x = x.reshape(1, tiles * lp, d)
        for i in range(self.global_layers):
            x = self._layer(ctx, x, f"global_transformer.layers.{i}.", mask, gated=True)
        x = x.reshape(tiles, lp, d)[:real, :p]
        inter = ctx.stack([kept[i] for i in self.intermediate], axis=-1)
        inter = inter.reshape(tiles, lp, d * len(self.intermediate))[:real, :p]
        return ctx.concatenate([x, inter], axis=-1)

    def encode(self, pixels: np.ndarray) -> Tensor:
        """One image's rows ``[tiles * (P + 1), D]`` (float32) for cross-attention, computed in a context of its own
        and evaluated."""
        with self.backend.new_context() as ctx:
            x = self.hidden_states(ctx, pixels)
            x = x.reshape(-1, x.shape[-1]).linear(*self.projection).astype(DType.FLOAT32)
            ctx.evaluate(x)
            return x

    # ---- the prompt ----------------------------------------------------------------------------------------------
    def expand(self, text: str) -> str:
        """The rendered prompt as it is: ``<|image|>`` is one token the rows attach to."""
        return text

    def place(self, tokens: Sequence[int], images: Sequence[Any]) -> list[PromptImage]:
        """The images at the ``<|image|>`` tokens of ``tokens``, in order.

        Raises:
            InvalidRequestError: the prompt has a different number of image places than images were given.
        """
        at = np.flatnonzero(np.asarray(tokens) == self.image_token_id)
        if len(at) != len(images):
            raise InvalidRequestError(f"the prompt has {len(at)} image place(s) but {len(images)} image(s) were "
                                      "given")
        return [PromptImage(int(start), 1, self.processor(image)) for start, image in zip(at.tolist(), images)]
