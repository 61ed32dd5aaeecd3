"""Image generation at the Python API: load a text-to-image pipeline (the catalog's ``shapes:64`` or a diffusers
Z-Image folder), generate, save with the parameters in the PNG, read them back. Re-exported by
:mod:`mlx_engine.api`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mlx_engine.mlx import MLXBackend
from mlx_engine.store import DEFAULT_IMAGE_MODEL, Store

def _image_model_path(model: "str | Path | None") -> Path:
    from mlx_engine.errors import ModelNotFoundError
    from mlx_engine.store import image_model_path

    model = model if model is not None else DEFAULT_IMAGE_MODEL
    packaged = image_model_path(model) if isinstance(model, str) else None
    if packaged is not None:
        return packaged
    if model is None:
        raise ModelNotFoundError("no image model given: pass the path of a diffusers Z-Image folder (model_index.json, "
                                 "transformer/, vae/, text_encoder/, tokenizer/, scheduler/) as model= (--model)")
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"{model}: no such image model; give the path of a diffusers Z-Image folder "
                                 "(model_index.json, transformer/, vae/, text_encoder/, tokenizer/, scheduler/)")
    return path


def _image_model_label(model: "str | Path | None") -> str:
    """What an image's metadata records as its model: the catalog name, or the folder's absolute path."""
    model = model if model is not None else DEFAULT_IMAGE_MODEL
    p = Path(model).expanduser()
    return str(p.resolve()) if p.exists() else str(model)


def load_image_model(model: "str | Path | None" = None, *, quantize: int | None = None, device: str | None = None,
                     dtype: str | None = None, keep_text_encoder: bool = False):
    """Load a text-to-image model: a diffusers folder whose ``model_index.json`` names a pipeline this engine runs
    (:mod:`mlx_engine.imagegen.registry`: Z-Image, Qwen-Image, FLUX.1, FLUX.1 Kontext, FLUX.2), or a packaged model (``shapes:64``,
    the default). Returns the pipeline (``.generate(prompt, ...)`` -> ``ImageResult`` with images, stats and the
    parameters that reproduce them; ``.memory()``, ``.close()``).

    Args:
        quantize: quantize the diffusion transformer and the folder's text encoders (T5 and the decoders; not
            CLIP) to 8 or 4 bits as they are read (None: as stored).
        device, dtype: as :func:`load`. keep_text_encoder: keep the text encoder loaded between generations
            (default: loaded per generation and freed before the denoising loop).

    Raises:
        ModelNotFoundError: no model given, or the path does not exist / is not a diffusers folder.
        UnsupportedError: a pipeline class this engine does not run.
        WeightsError: a missing component folder or a corrupt weights file (the message names it).
        InvalidRequestError: ``quantize`` other than 4 or 8.
        MemoryBudgetError: the model cannot fit in the memory available (checked before any weight is read; the
            message gives what it needs and what is available, and whether ``quantize`` or a smaller size would fit).
    """
    from mlx_engine.imagegen.registry import load_pipeline

    path = _image_model_path(model)

    def make_backend(folder: Path, transform: Any = None) -> MLXBackend:  # transform: quantize as it reads
        return MLXBackend(folder, device=device, dtype=dtype, transform=transform)

    def resolve_model(name: str) -> Path:  # a text encoder the folder takes from the store (pulled when missing)
        return Store().resolve(name, pull=True).path

    # a backend without weights on the same device and dtype: the load is refused before reading weights when the
    # model cannot fit in what it has available (mlx_engine.imagegen.memory)
    probe = MLXBackend(None, device=device, dtype=dtype)
    pipe = load_pipeline(path, make_backend, quantize=quantize, keep_text_encoder=keep_text_encoder,
                         resolve_model=resolve_model, memory_check=probe)
    pipe.name = _image_model_label(model)
    return pipe


def open_init_image(path: "str | Path"):
    """An init image file read once: ``.path``, ``.sha256`` (of its bytes), ``.image`` (PIL). Pass it as
    ``generate_image(..., image=...)`` to have its path and hash recorded in the image's metadata.

    Raises:
        InvalidRequestError: no such file, or not an image.
    """
    from mlx_engine.imagegen.metadata import InitImageFile

    return InitImageFile.open(path)


def generate_image(prompt: str, *, model: "str | Path | Any | None" = None, negative_prompt: str | None = None,
                   width: int | None = None, height: int | None = None, steps: int | None = None,
                   guidance: float | None = None, seed: int | None = None, image: Any = None,
                   strength: float | None = None, callback: Any = None, quantize: int | None = None,
                   device: str | None = None, edit_images: "Sequence[Any] | None" = None):
    """Generate one image from a prompt (text-to-image), or from a prompt and an init image (image-to-image): the
    one front door for images, which ``mlx-engine image`` uses too.

    >>> img = mlx_engine.generate_image("a red circle on a blue background", seed=1)
    >>> mlx_engine.save_image(img, "circle.png"); img.info["seed"]

    Args:
        model: a catalog image model (``shapes:64``, the default), a diffusers folder, or a pipeline from
            :func:`load_image_model` (reused, not closed). A name or folder is loaded for this call and freed after.
        negative_prompt: steered away from when ``guidance > 0``.
        width, height: pixels, multiples of the model's ``size_multiple`` (default: the model's; image-to-image: the
            init image's size).
        steps: denoising steps (default: the model's). guidance: diffusers' Z-Image ``guidance_scale``: 0 is off;
            above 0, ``pos + guidance * (pos - neg)`` (default: the model's).
        seed: the noise seed; None draws one (``img.info["seed"]`` tells which).
        image, strength: image-to-image, for a model that does it (Z-Image, FLUX.1 schnell and dev): an init image
            (PIL image, path, uint8 array, or :func:`open_init_image`'s result) and how much of the schedule to run,
            in [0, 1] (default 0.6).
        callback: ``callback(step, total, latents, elapsed_seconds)`` after each denoising step.
        quantize: quantize the transformer and text encoders to 8 or 4 bits (only when ``model`` is a name or
            folder; see :func:`load_image_model`).
        edit_images: images to edit (paths, encoded file bytes, PIL images, uint8 arrays or
            :func:`open_init_image`'s results), for a model that edits images (FLUX.1 Kontext takes one); the path
            and sha256 of each file (the sha256 of bytes) go in the metadata.

    Returns:
        a ``PIL.Image.Image`` (RGB) whose ``save`` to a PNG writes its metadata; ``info["parameters"]`` holds
        the metadata that reproduces it (``prompt``, ``seed``, ``steps``, ``guidance``, ``width``, ``height``,
        ``model``, ``strength``, ``init_image`` and its ``init_image_sha256``, ``edit_images`` and their
        ``edit_images_sha256``, ``quantize``), the seed also as
        ``info["seed"]``, and the generation statistics (times, peak memory) as ``info["stats"]``.

    Raises:
        ModelNotFoundError, WeightsError, MemoryBudgetError: see :func:`load_image_model`; MemoryBudgetError also
        for a ``width x height`` whose activations cannot fit beside the loaded model. InvalidRequestError: an
        unsupported size
        (the message lists the allowed ones), steps < 1, a strength outside [0, 1], an unreadable init image,
        edit images for a model that does not edit images (or more than it takes).
    """
    from mlx_engine.errors import InvalidRequestError
    from mlx_engine.imagegen.memory import check_request_memory
    from mlx_engine.imagegen.metadata import GeneratedImage, InitImageFile, image_parameters

    init = open_init_image(image) if isinstance(image, (str, Path)) else image
    edits = None
    if edit_images is not None:
        if not isinstance(edit_images, (list, tuple)):
            edit_images = [edit_images]
        edits = [open_init_image(e) if isinstance(e, (str, Path)) else
                 InitImageFile.from_bytes(bytes(e)) if isinstance(e, (bytes, bytearray)) else e for e in edit_images]
    owned = not hasattr(model, "generate")
    pipe = load_image_model(model, quantize=quantize, device=device) if owned else model
    try:
        extra = {}
        if edits:
            takes = getattr(pipe, "max_edit_images", 0)
            label = getattr(pipe, "name", model)
            if not takes:
                raise InvalidRequestError(f"{label}: this model does not edit images; use one that does (FLUX.1 "
                                          "Kontext, FLUX.2)")
            if len(edits) > takes:
                raise InvalidRequestError(f"{label}: this model takes at most {takes} edit image(s), got {len(edits)}")
            extra["edit_images"] = [e.image if isinstance(e, InitImageFile) else e for e in edits]
        w, h = width, height
        if w is None and h is None and init is None and not edits:
            d = getattr(pipe, "defaults", {})
            w, h = d.get("width"), d.get("height")
        if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (w, h)):
            # the activations at this size beside the loaded weights, refused before any work when they cannot fit
            # (a size taken from an init or edit image is known only once the pipeline has read it); a size the
            # model cannot make is the caller's error first (InvalidRequestError), not a lack of memory
            if hasattr(pipe, "check_size"):
                w, h = pipe.check_size(w, h)
            check_request_memory(pipe, w, h)
        result = pipe.generate(prompt, negative_prompt=negative_prompt, width=width, height=height, steps=steps,
                               guidance=guidance, seed=seed,
                               image=init.image if isinstance(init, InitImageFile) else init, strength=strength,
                               callback=callback, **extra)
    finally:
        if owned:
            pipe.close()
    out = GeneratedImage.adopt(result.images[0])  # img.save("x.png") keeps the metadata too
    out.info["parameters"] = image_parameters(
        result.parameters, model=str(getattr(pipe, "name", model)), negative_prompt=negative_prompt,
        init=init if isinstance(init, InitImageFile) else None, quantize=getattr(pipe, "quantize", None),
        edits=[e if isinstance(e, InitImageFile) else None for e in edits] if edits else None)
    out.info["seed"] = result.stats.seed
    out.info["stats"] = result.stats
    return out


def save_image(image, path: "str | Path") -> None:
    """Write a PNG with its generation metadata (``image.info["parameters"]``, as :func:`generate_image` sets it) in
    its text chunks, so that ``mlx-engine image --from-metadata`` can make it again.

    Raises:
        OSError: the file cannot be written.
    """
    from mlx_engine.imagegen.metadata import png_info

    params = image.info.get("parameters")
    image.save(path, format="PNG", pnginfo=png_info(params) if params else None)


def read_image_parameters(path: "str | Path") -> dict[str, Any]:
    """The generation metadata stored in a PNG by :func:`save_image` (or ``mlx-engine image``), typed.

    Raises:
        InvalidRequestError: the file is missing, not an image, or holds no mlx-engine metadata.
    """
    from mlx_engine.imagegen.metadata import read_png_parameters

    return read_png_parameters(path)
