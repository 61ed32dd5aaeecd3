"""The Qwen-Image-Edit pipelines, as diffusers' ``QwenImageEditPipeline`` (one input image) and
``QwenImageEditPlusPipeline`` (several): Qwen-Image's denoising loop (:class:`~mlx_engine.imagegen.qwen_image.
QwenImagePipeline`) with each input image entering twice:

- through Qwen2.5-VL's vision tower (:mod:`mlx_engine.models.vision.qwen25vl_vision`) into the prompt's
  ``<|image_pad|>`` tokens, with M-RoPE positions, for the text encoder (the prompt template of the edit pipelines;
  its first 64 tokens dropped from the features);
- through the VAE's encoder (the posterior's mode, normalised as ``(z - latents_mean) / latents_std``, packed 2x2)
  as extra image tokens after the noisy latents in every transformer call, at their own RoPE frames (1, 2, ...); the
  velocity of the noisy tokens alone is kept.

Sizes (diffusers ``calculate_dimensions``: ``width = sqrt(area * ratio)``, ``height = width / ratio``, each rounded
to a multiple of 32): Edit resizes its image (Lanczos) to about 1024 x 1024 pixels for both the VAE and the vision
tower; Plus resizes each image to about 384 x 384 for the vision tower and 1024 x 1024 for the VAE, and names them
``Picture i:`` in the prompt. The output defaults to the 1024 x 1024-area size of the (first for Edit, last for Plus)
input image. The vision tower then resizes again to multiples of 28 (``smart_resize``).

Reference: diffusers 0.42 ``pipelines/qwenimage/pipeline_qwenimage_edit.py`` and ``pipeline_qwenimage_edit_plus.py``
(``__call__``, ``_get_qwen_prompt_embeds``, ``_encode_vae_image``, ``prepare_latents``), with Qwen2.5-VL's 3D
positions as the model was trained with them: diffusers 0.42 on transformers 5 drops the processor's
``mm_token_type_ids`` and so runs the image tokens at 1D positions (diffusers issue 14194).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from mlx_engine.errors import InvalidRequestError
from mlx_engine.imagegen.pipeline import load_init_image
from mlx_engine.imagegen.qwen_image import QwenImagePipeline
from mlx_engine.ml import Context, DType, Tensor

__all__ = ["QwenImageEditPipeline", "QwenImageEditPlusPipeline", "PIPELINE_CLASSES", "PLUS_CLASSES"]

#: ``_class_name`` values of ``model_index.json`` each class loads.
PIPELINE_CLASSES = ("QwenImageEditPipeline",)
PLUS_CLASSES = ("QwenImageEditPlusPipeline",)
#: diffusers' ``prompt_template_encode`` of the edit pipelines (Edit's holds its one image; Plus puts its
#: ``Picture i:`` images before the prompt) and ``prompt_template_encode_start_idx``.
EDIT_TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
                 "objects, background), then explain how the user's text instruction should alter or modify the "
                 "image. Generate a new image that meets the user's requirements while maintaining consistency with "
                 "the original input where appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
                 "<|im_start|>assistant\n")
IMAGE_SLOT = "<|vision_start|><|image_pad|><|vision_end|>"
TEMPLATE_DROP = 64
#: the areas diffusers sizes the images to (``VAE_IMAGE_SIZE``, Plus's ``CONDITION_IMAGE_SIZE``) and the default
#: output's.
VAE_AREA = 1024 * 1024
CONDITION_AREA = 384 * 384
OUTPUT_AREA = 1024 * 1024
#: the model cards' settings: 50 steps, true_cfg_scale 4, negative prompt " ".
BUILTIN_DEFAULTS = {"steps": 50, "guidance": 4.0, "strength": None, "negative_prompt": " "}


def calculate_dimensions(area: int, ratio: float) -> tuple[int, int]:
    """``(width, height)`` of about ``area`` pixels at aspect ``ratio`` (width / height), multiples of 32
    (diffusers' ``calculate_dimensions``)."""
    width = math.sqrt(area * ratio)
    height = width / ratio
    return round(width / 32) * 32, round(height / 32) * 32


@dataclass
class EditImage:
    """One input image, prepared: ``vision`` for the vision tower (PIL, RGB), ``pixels`` for the VAE (float32
    ``[1, H, W, 3]`` in ``[-1, 1]``), and its source size ``(width, height)``."""

    vision: Image.Image
    pixels: np.ndarray
    size: tuple[int, int]


def _resized(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    """``VaeImageProcessor.resize``: Lanczos to ``size`` (width, height)."""
    return image if image.size == size else image.resize(size, Image.LANCZOS)


def _pixels(image: Image.Image) -> np.ndarray:
    """``VaeImageProcessor.preprocess`` of an image already at its size: ``2 x / 255 - 1``, ``[1, H, W, 3]``."""
    return (np.asarray(image, np.float32)[None] / np.float32(255.0) * 2.0 - 1.0).astype(np.float32)


class QwenImageEditPipeline(QwenImagePipeline):
    """A Qwen-Image-Edit diffusers folder, loaded for editing one image (``edit_images=[image]``).

    Args, attributes and errors as :class:`~mlx_engine.imagegen.qwen_image.QwenImagePipeline`; the text encoder
    folder must hold Qwen2.5-VL's vision tower (``visual.*``) and its ``vision_config``.
    """

    pipeline_classes = PIPELINE_CLASSES
    family = "Qwen-Image-Edit"
    builtin_defaults = BUILTIN_DEFAULTS
    max_edit_images = 1
    #: which input image sets the default output size (diffusers: Edit the first, Plus the last)
    _size_from = 0

    def _text_encoder_options(self) -> dict[str, Any]:
        return {"template": EDIT_TEMPLATE.replace("{}", IMAGE_SLOT + "{}"), "drop": TEMPLATE_DROP, "hidden_state": -1}

    def _prepare_image(self, image: Image.Image) -> EditImage:
        size = calculate_dimensions(VAE_AREA, image.width / image.height)
        resized = _resized(image, size)
        return EditImage(resized, _pixels(resized), image.size)

    def _edit_inputs(self, edit_images: Sequence[Any] | None) -> list[EditImage]:
        """Load and size the input images.

        Raises:
            InvalidRequestError: none given, more than :attr:`max_edit_images`, or one that cannot be read."""
        if isinstance(edit_images, (Image.Image, np.ndarray, str)) or hasattr(edit_images, "__fspath__"):
            edit_images = [edit_images]
        if not edit_images:
            raise InvalidRequestError(f"{self.family} edits an image: give the image to edit (edit_images=[...], "
                                      "--edit, or the edits endpoint's image)")
        if len(edit_images) > self.max_edit_images:
            raise InvalidRequestError(f"{type(self).__name__} takes at most {self.max_edit_images} edit image(s), "
                                      f"got {len(edit_images)}")
        return [self._prepare_image(load_init_image(im).convert("RGB")) for im in edit_images]

    def _default_size(self, edits: list[EditImage]) -> tuple[int, int]:
        """The 1024 x 1024-area size of the input image's aspect, floored to :attr:`size_multiple`."""
        w, h = edits[self._size_from].size
        width, height = calculate_dimensions(OUTPUT_AREA, w / h)
        m = self.size_multiple
        return width // m * m, height // m * m

    def _prompt_with_images(self, prompt: str, count: int) -> str:
        return prompt  # Edit's template holds its image

    def _encode(self, prompts: list[str], max_len: int, edits: list[EditImage]) -> list[Tensor]:
        """Caption features of the prompts, each with the input images (the vision tower's rows at the image
        tokens; the prompts are not cut, as diffusers' edit pipelines do not cut them)."""
        from mlx_engine.models.vision.qwen25vl_vision import Qwen25Vision, Qwen25VisionConfig, image_patches

        te = self._load_text_encoder()
        backend = self._text_backend
        config = Qwen25VisionConfig.from_hf(self._component_config("text_encoder").get("vision_config") or {})
        weights = {name.split("visual.", 1)[1]: t for name, t in backend.weights.items()
                   if name.startswith(("visual.", "model.visual."))}
        tower = Qwen25Vision(config, weights)
        with backend.new_context() as ctx:
            images = []
            for e in edits:
                patches, grid = image_patches(e.vision, config)
                m = config.spatial_merge_size
                images.append((tower(ctx, patches, grid), (grid[0], grid[1] // m, grid[2] // m)))
            texts = [self._prompt_with_images(p, len(edits)) for p in prompts]
            embeds = te.encode(ctx, texts, images=images)
            ctx.evaluate(*embeds)
        return embeds

    def _condition(self, ctx: Context, edits: list[EditImage], batch: int) -> tuple[Tensor, tuple]:
        """Each input image through the VAE's encoder (the mode), normalised and packed; concatenated along the
        tokens and repeated for each prompt: ``[batch, T, 64]`` and the images' ``(1, h/2, w/2)``."""
        vae = self.vae
        mean = ctx.from_numpy(vae.latents_mean.astype(np.float32))
        std = ctx.from_numpy(vae.latents_std.astype(np.float32))
        parts, shapes = [], []
        for e in edits:
            z = vae.encode(ctx, ctx.from_numpy(e.pixels)).astype(DType.FLOAT32)  # [1, h, w, 16]
            z = ((z - mean) / std).transpose(0, 3, 1, 2)  # [1, 16, h, w]
            parts.append(self.pack(z))
            shapes.append((1, z.shape[2] // 2, z.shape[3] // 2))
        cond = parts[0] if len(parts) == 1 else ctx.concatenate(parts, axis=1)
        if batch > 1:
            cond = ctx.concatenate([cond] * batch, axis=0)
        return cond.astype(self.backend.compute_dtype), tuple(shapes)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.folder)!r}, quantize={self.quantize})"


class QwenImageEditPlusPipeline(QwenImageEditPipeline):
    """A Qwen-Image-Edit-2509 (``QwenImageEditPlusPipeline``) folder: up to :attr:`max_edit_images` input images,
    each named ``Picture i:`` before the prompt, seen by the vision tower at about 384 x 384 pixels and by the VAE at
    about 1024 x 1024."""

    pipeline_classes = PLUS_CLASSES
    family = "Qwen-Image-Edit-Plus"
    #: the model card's "optimal performance with 1 to 3 input images"
    max_edit_images = 3
    _size_from = -1

    def _text_encoder_options(self) -> dict[str, Any]:
        return {"template": EDIT_TEMPLATE, "drop": TEMPLATE_DROP, "hidden_state": -1}

    def _prepare_image(self, image: Image.Image) -> EditImage:
        ratio = image.width / image.height
        vision = _resized(image, calculate_dimensions(CONDITION_AREA, ratio))
        return EditImage(vision, _pixels(_resized(image, calculate_dimensions(VAE_AREA, ratio))), image.size)

    def _prompt_with_images(self, prompt: str, count: int) -> str:
        return "".join(f"Picture {i + 1}: {IMAGE_SLOT}" for i in range(count)) + prompt
