"""What every image pipeline shares: its results and statistics, the step callback, and the reading of a diffusers
folder (``model_index.json``, component folders and configs, this engine's defaults file) and of an init image.

A pipeline class (:mod:`mlx_engine.imagegen.zimage` is the first) is registered in
:mod:`mlx_engine.imagegen.registry` under the ``_class_name`` values of ``model_index.json`` that it loads; it is
made as ``cls(folder, make_backend, quantize=..., keep_text_encoder=..., resolve_model=..., memory_check=...)``
(``memory_check``: :func:`mlx_engine.imagegen.memory.check_pipeline_memory` before any weight is read, with the
class's ``memory_layout()``) and offers ``generate(prompt, ...) -> ImageResult`` (also as ``prepare`` / ``denoise`` /
``decode``), ``memory()``, ``memory_estimate``, ``close()``, ``name``, ``defaults`` and ``size_multiple``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mlx_engine.errors import InvalidRequestError, ModelNotFoundError, UnsupportedError, WeightsError
from mlx_engine.ml import Context, Tensor

__all__ = ["DenoiseJob", "ImageGenerationStats", "ImageResult", "StepCallback", "DEFAULTS_FILE", "MAX_SIDE", "read_json",
           "read_model_index", "read_pipeline_index", "guide", "store_component", "component_folder", "read_defaults", "load_init_image",
           "check_image_size", "preprocess_init_image"]

#: an optional file beside ``model_index.json`` with this engine's defaults for the model (``width``, ``height``,
#: ``steps``, ``guidance``, ``strength``, ``negative_prompt``); not a diffusers file, and diffusers ignores it.
DEFAULTS_FILE = "mlx_engine.json"
#: the largest width or height accepted (pixels), whatever the model's RoPE tables allow.
MAX_SIDE = 4096

#: ``callback(step, total, latents, elapsed)``: after each denoising step, ``step`` the 0-based index of the step
#: just done among the ``total`` steps this generation runs, ``latents`` the float32 ``[B, C, h, w]`` Tensor after it
#: (evaluated), ``elapsed`` the seconds since the denoising loop began. Raising from it (``KeyboardInterrupt``
#: included) cancels the generation.
StepCallback = Callable[[int, int, Tensor, float], Any]


@dataclass
class ImageGenerationStats:
    """What one generation did and took.

    Attributes:
        seed: the seed of the noise (the one drawn when the caller gave none); None when the caller gave the noise.
        width, height: the image size in pixels. steps: the scheduler's step count; steps_run: the steps the loop
            ran (fewer for image-to-image: ``steps - t_start``). guidance: the guidance scale.
        text_seconds: loading and running the text encoder. denoise_seconds: the denoising loop.
        decode_seconds: the VAE decode. total_seconds: the whole call. step_seconds: each step's time.
        peak_memory_bytes: the device's peak memory during the call (``Backend.peak_memory``).
        tiled_decode: whether the VAE decoded in tiles.
    """

    seed: int | None
    width: int
    height: int
    steps: int
    steps_run: int
    guidance: float
    strength: float | None = None
    text_seconds: float = 0.0
    denoise_seconds: float = 0.0
    decode_seconds: float = 0.0
    total_seconds: float = 0.0
    peak_memory_bytes: int = 0
    tiled_decode: bool = False
    step_seconds: list[float] = field(default_factory=list)

    def summary(self) -> str:
        per_step = self.denoise_seconds / self.steps_run if self.steps_run else 0.0
        return (f"{self.width}x{self.height}, {self.steps_run} steps in {self.denoise_seconds:.2f} s "
                f"({per_step:.2f} s/step), text {self.text_seconds:.2f} s, decode {self.decode_seconds:.2f} s"
                f"{' (tiled)' if self.tiled_decode else ''}, total {self.total_seconds:.2f} s, "
                f"peak memory {_format_bytes(self.peak_memory_bytes)}")


@dataclass
class ImageResult:
    """The output of an image pipeline's ``generate``.

    Attributes:
        images: one ``PIL.Image.Image`` (RGB, ``width x height``) per prompt.
        latents: the final latents, float32 ``[B, C, h, w]`` (before the VAE's scaling and shift are undone).
        pixels: the decoded images, float32 ``[B, H, W, 3]`` in ``[0, 1]`` (before rounding to 8 bits).
        stats: :class:`ImageGenerationStats`.
        parameters: the settings that reproduce the image (prompt, negative_prompt, seed, steps, guidance, width,
            height, strength, cfg_normalization, cfg_truncation, max_sequence_length).
    """

    images: list[Image.Image]
    latents: np.ndarray
    pixels: np.ndarray
    stats: ImageGenerationStats
    parameters: dict[str, Any]


@dataclass
class DenoiseJob:
    """One generation as a pipeline's ``prepare`` settled it: the sizes, the schedule, the caption features and
    the start latents, in a :class:`~mlx_engine.ml.Context` of the transformer's backend that the job owns until
    :meth:`close` (or the pipeline's ``decode``).

    Attributes:
        batch: images (prompts). channels, lh, lw: the latents' ``[B, C, h, w]`` without ``B``.
        width, height: pixels. first, steps: the loop runs scheduler steps ``first .. steps - 1``.
        guidance, do_cfg: the guidance scale and whether it is on. cfg_normalization, cfg_truncation: as
            the pipeline's ``generate`` takes them. vae_tiling: as there.
        pos_embeds, neg_embeds: caption features ``[L_i, D]`` of the prompts and negative prompts.
        latents: float32 ``[B, C, h, w]``, updated by each step. stats, parameters: what the result will carry.
    """

    ctx: Context
    batch: int
    channels: int
    lh: int
    lw: int
    width: int
    height: int
    steps: int
    first: int
    guidance: float
    do_cfg: bool
    cfg_normalization: "bool | float"
    cfg_truncation: float | None
    vae_tiling: bool | None
    pos_embeds: list[Tensor]
    neg_embeds: list[Tensor]
    latents: Tensor
    stats: ImageGenerationStats
    parameters: dict[str, Any]
    started: float = field(default_factory=time.perf_counter)

    @property
    def total(self) -> int:
        """The steps the loop runs."""
        return self.steps - self.first

    def close(self) -> None:
        self.ctx.close()


def _format_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def read_json(path: Path, what: str) -> dict:
    """A JSON object from ``path``.

    Raises:
        WeightsError: missing, unreadable, not JSON, or not an object (the message names ``what`` it is).
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise WeightsError(f"{path}: missing ({what})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightsError(f"{path}: cannot read {what}: {e}") from None
    if not isinstance(data, dict):
        raise WeightsError(f"{path}: {what} is not a JSON object")
    return data


def read_model_index(folder: Path) -> dict:
    """``folder/model_index.json`` of a diffusers folder.

    Raises:
        ModelNotFoundError: ``folder`` does not exist, is a file, or holds no ``model_index.json``.
        WeightsError: the index is unreadable.
    """
    layout = "model_index.json, transformer/, vae/, text_encoder/, tokenizer/, scheduler/"
    if not folder.exists():
        raise ModelNotFoundError(f"{folder}: no such image model folder (give a diffusers folder holding {layout})")
    if not folder.is_dir():
        raise ModelNotFoundError(f"{folder}: an image model is a diffusers folder ({layout}), not a file")
    if not (folder / "model_index.json").is_file():
        raise ModelNotFoundError(f"{folder}: not a diffusers image model folder (no model_index.json)")
    return read_json(folder / "model_index.json", "the pipeline index")


def read_pipeline_index(folder: Path, classes: "tuple[str, ...]", family: str, components: "tuple[str, ...]",
                        component_classes: "dict[str, str]") -> dict:
    """``model_index.json`` of a folder that a pipeline of ``family`` loads: its ``_class_name`` one of ``classes``,
    each of ``components`` listed, and each component's class, where the index names one, that of
    ``component_classes``.

    Raises:
        ModelNotFoundError: as :func:`read_model_index`. UnsupportedError: another pipeline or component class.
        WeightsError: a component missing from the index.
    """
    f = folder
    index = read_model_index(f)
    name = index.get("_class_name")
    if name not in classes:
        raise UnsupportedError(f"{f}: pipeline {name!r} is not supported by the {family} pipeline, which "
                               f"runs {' and '.join(classes)} folders")
    for comp in components:
        if comp not in index:
            raise WeightsError(f"{f / 'model_index.json'}: no {comp!r} component listed")
    for comp, cls in component_classes.items():
        entry = index.get(comp)
        got = entry[1] if isinstance(entry, list) and len(entry) == 2 else None
        if got is not None and got != cls:
            raise UnsupportedError(f"{f}: {comp} is a {got}; this engine implements {cls}")
    return index


def guide(pos: Tensor, neg: Tensor, scale: float, normalization: "bool | float") -> Tensor:
    """diffusers' Z-Image guidance: ``pos + scale * (pos - neg)``, its norm capped at ``normalization`` times
    ``pos``'s when that is above 0 (``pipeline_z_image.py``, ``cfg_normalization``)."""
    pred = pos + (pos - neg) * scale
    if normalization and float(normalization) > 0.0:
        ori = (pos * pos).sum().sqrt()
        new = (pred * pred).sum().sqrt()
        cap = ori * float(normalization)
        pred = pred * new.compare(">", cap).where(cap / new, 1.0)
    return pred


def store_component(entry: Any) -> str | None:
    """``"NAME"`` for a ``model_index.json`` entry ``["mlx_engine", "store:NAME"]`` (a component this engine takes
    from its model store instead of the folder), else None."""
    if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], str) and entry[1].startswith("store:"):
        return entry[1][len("store:"):]
    return None


def component_folder(folder: Path, name: str) -> Path:
    """``folder/name``. Raises WeightsError when it is missing."""
    p = folder / name
    if not p.is_dir():
        raise WeightsError(f"{p}: missing component folder {name}/ of the diffusers folder {folder}")
    return p


def read_defaults(folder: Path, builtin: dict[str, Any]) -> dict[str, Any]:
    """``builtin`` updated with :data:`DEFAULTS_FILE` when the folder has one.

    Raises:
        WeightsError: the file is unreadable or names a setting not in ``builtin``.
    """
    d = dict(builtin)
    f = folder / DEFAULTS_FILE
    if f.is_file():
        extra = read_json(f, "the engine's defaults for this model")
        unknown = set(extra) - set(d)
        if unknown:
            raise WeightsError(f"{f}: unknown key(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(d))}")
        d.update(extra)
    return d


def load_init_image(image: Any) -> Image.Image:
    """An init image as a PIL image, from a PIL image, a file path or an ``[H, W, 3]`` array (uint8, or floats in
    ``[0, 1]``).

    Raises:
        InvalidRequestError: a missing or unreadable file, an array of another shape, or another type.
    """
    if isinstance(image, (str, os.PathLike)):
        from mlx_engine.imagegen.metadata import InitImageFile

        image = InitImageFile.open(image).image
    elif isinstance(image, np.ndarray):
        a = image
        if a.ndim == 2:
            a = np.stack([a] * 3, axis=-1)
        if a.ndim != 3 or a.shape[-1] not in (3, 4):
            raise InvalidRequestError(f"an init image array must be [H, W, 3] uint8, got shape {a.shape}")
        if a.dtype != np.uint8:
            a = (np.clip(a.astype(np.float64), 0, 1) * 255).round().astype(np.uint8)
        image = Image.fromarray(a[..., :3])
    if not isinstance(image, Image.Image):
        raise InvalidRequestError(f"the init image must be a PIL image, a file path or a uint8 array, got "
                                  f"{type(image).__name__}")
    return image


def check_image_size(width: Any, height: Any, *, multiple: int, min_side: int, max_width: int,
                     max_height: int) -> tuple[int, int]:
    """``(width, height)`` as ints when a model with these limits can make that size.

    Raises:
        InvalidRequestError: not integers, not multiples of ``multiple``, or outside ``min_side .. max_width`` /
            ``max_height``; the message says which sizes are allowed and the nearest allowed one.
    """
    upper = f"{max_width}" if max_width == max_height else f"{max_width} (width) / {max_height} (height)"
    allowed = f"width and height must be multiples of {multiple} between {min_side} and {upper} pixels"
    out = []
    for name, v, hi in (("width", width, max_width), ("height", height, max_height)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise InvalidRequestError(f"{name} must be an integer number of pixels, got {v!r}; {allowed}")
        v = int(v)
        if v % multiple or not min_side <= v <= hi:
            nearest = max(min_side, min(hi, int(round(v / multiple)) * multiple))
            raise InvalidRequestError(f"unsupported {name} {v}: {allowed} (e.g. {nearest})")
        out.append(v)
    return out[0], out[1]


def preprocess_init_image(image: Any, width: int | None, height: int | None,
                          check_size: Callable[[Any, Any], tuple[int, int]],
                          multiple: int) -> tuple[np.ndarray, int, int]:
    """An init image as float32 ``[1, H, W, 3]`` in ``[-1, 1]``, with its checked size (diffusers
    ``VaeImageProcessor.preprocess``: RGB, resized with Lanczos to ``width x height``, or to its own size rounded down
    to a multiple of ``multiple`` when they are not given).

    Raises:
        InvalidRequestError: as :func:`load_init_image` and ``check_size``.
    """
    image = load_init_image(image)
    w = width if width is not None else image.width - image.width % multiple
    h = height if height is not None else image.height - image.height % multiple
    w, h = check_size(w, h)
    if image.mode != "RGB":
        image = image.convert("RGB")
    if image.size != (w, h):
        image = image.resize((w, h), resample=Image.LANCZOS)
    a = np.asarray(image, dtype=np.float32) / np.float32(255.0)
    return (2.0 * a - 1.0)[None].astype(np.float32), w, h
