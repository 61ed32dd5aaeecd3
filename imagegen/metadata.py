"""Image metadata: the settings that reproduce an image, kept in its PNG text chunks and read back.

The keys (:data:`METADATA_KEYS`) are written one per international text chunk (UTF-8) and all together as JSON under
``mlx_engine``; ``mlx-engine image --from-metadata FILE.png`` reads them back. An init image is recorded by its path
and sha256, read and hashed once (:class:`InitImageFile`).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from mlx_engine.errors import InvalidRequestError

__all__ = ["METADATA_KEYS", "GeneratedImage", "InitImageFile", "image_parameters", "png_info", "read_png_parameters"]


@dataclass(frozen=True)
class InitImageFile:
    """An init (or edit) image read from a file: ``path`` (absolute; None for bytes given in memory), ``sha256`` of
    its bytes (hex) and the decoded ``image`` (a PIL image)."""

    path: Path | None
    sha256: str
    image: Image.Image

    @classmethod
    def open(cls, path: "str | os.PathLike[str]") -> "InitImageFile":
        """Read ``path`` once: hash its bytes and decode them.

        Raises:
            InvalidRequestError: no such file, or not an image PIL can read.
        """
        p = Path(path).expanduser()
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            raise InvalidRequestError(f"{path}: no such init image file") from None
        except OSError as e:
            raise InvalidRequestError(f"{path}: cannot read the init image: {e}") from None
        return cls.from_bytes(data, p.resolve())

    @classmethod
    def from_bytes(cls, data: bytes, path: "Path | None" = None) -> "InitImageFile":
        """An image given as the bytes of its file (an upload: ``path`` None) and hashed.

        Raises:
            InvalidRequestError: not an image PIL can read.
        """
        try:
            with Image.open(io.BytesIO(data)) as im:
                im.load()
                image = im.copy()
        except (OSError, Image.DecompressionBombError) as e:
            raise InvalidRequestError(f"{path or 'the uploaded image'}: cannot read the image: {e}") from None
        return cls(path, hashlib.sha256(data).hexdigest(), image)


def image_parameters(parameters: dict[str, Any], *, model: str, negative_prompt: str | None = None,
                     init: InitImageFile | None = None, quantize: int | None = None,
                     edits: "list[InitImageFile | None] | None" = None) -> dict[str, Any]:
    """The metadata of one generated image: a pipeline result's ``parameters`` with the model's name (or its
    folder), the negative prompt as the caller gave it, the init image's path and sha256, the edit images' paths
    and sha256 (lists in their order; None for an image given in memory), and the quantization."""
    p = parameters
    edited = {}
    if edits:
        edited = {"edit_images": [str(e.path) if e is not None and e.path is not None else None for e in edits],
                  "edit_images_sha256": [e.sha256 if e is not None else None for e in edits]}
    return {
        "prompt": p["prompt"], "negative_prompt": negative_prompt if negative_prompt is not None
        else p.get("negative_prompt"), "seed": p["seed"], "steps": p["steps"], "guidance": p["guidance"],
        "width": p["width"], "height": p["height"], "model": model, "strength": p.get("strength"),
        "init_image": str(init.path) if init is not None else None,
        "init_image_sha256": init.sha256 if init is not None else None, "quantize": quantize,
        **({"true_cfg": p["true_cfg"]} if p.get("true_cfg") is not None else {}), **edited,
    }


#: the PNG text keys written by :func:`png_info`, one per setting (plus ``mlx_engine``: all of them as JSON).
METADATA_KEYS = ("prompt", "negative_prompt", "seed", "steps", "guidance", "width", "height", "model", "strength",
                 "init_image", "init_image_sha256", "edit_images", "edit_images_sha256", "true_cfg", "quantize",
                 "engine", "engine_version")
_JSON_KEY = "mlx_engine"
_INT_KEYS = ("seed", "steps", "width", "height", "quantize")
_FLOAT_KEYS = ("guidance", "strength", "true_cfg")


def png_info(parameters: dict[str, Any]):
    """A ``PIL.PngImagePlugin.PngInfo`` holding ``parameters`` (the keys of :data:`METADATA_KEYS` that are not None)
    as international text chunks (UTF-8), one per key, and all of them as JSON under ``mlx_engine``; the engine's name
    and version are added. Pass it to ``image.save(path, pnginfo=...)``."""
    from PIL.PngImagePlugin import PngInfo

    from mlx_engine.version import __version__

    params = {k: v for k, v in parameters.items() if v is not None}
    params.setdefault("engine", "mlx-engine")
    params.setdefault("engine_version", __version__)
    info = PngInfo()
    for key in METADATA_KEYS:
        if key in params:
            info.add_itxt(key, str(params[key]))
    info.add_itxt(_JSON_KEY, json.dumps(params, ensure_ascii=False, sort_keys=True))
    return info


class GeneratedImage(Image.Image):
    """A generated image (a ``PIL.Image.Image``) whose ``save`` writes its metadata (``info["parameters"]``) into
    the PNG's text chunks, as the CLI does, unless the caller passes ``pnginfo`` or saves another format.
    Operations that make a new image (``resize``, ``copy``...) return plain PIL images without it."""

    def save(self, fp, format=None, **params) -> None:  # noqa: A002 - PIL's own signature
        parameters = self.info.get("parameters")
        name = fp if isinstance(fp, (str, os.PathLike)) else getattr(fp, "name", "")
        png = (format or "").upper() == "PNG" or (not format and str(name).lower().endswith(".png"))
        if parameters and png and params.get("pnginfo") is None:
            params["pnginfo"] = png_info(parameters)
        super().save(fp, format, **params)

    @classmethod
    def adopt(cls, image: Image.Image) -> "GeneratedImage":
        """``image`` itself, its class changed (no copy of the pixels)."""
        image.__class__ = cls
        return image


def read_png_parameters(path: "str | os.PathLike[str]") -> dict[str, Any]:
    """The generation parameters stored in a PNG by :func:`png_info` (typed: ints, floats, strings).

    Raises:
        InvalidRequestError: the file is missing, not an image, or holds no mlx-engine metadata.
    """
    try:
        with Image.open(path) as im:
            im.load()
            text = dict(getattr(im, "text", {}) or {})
    except FileNotFoundError:
        raise InvalidRequestError(f"{path}: no such file") from None
    except (OSError, ValueError, Image.DecompressionBombError) as e:  # ValueError: a text chunk over PIL's limit
        raise InvalidRequestError(f"{path}: cannot read the image: {e}") from None
    params: dict[str, Any] = {}
    if _JSON_KEY in text:
        try:
            params = json.loads(text[_JSON_KEY])
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            params = {}
        if not isinstance(params, dict):
            params = {}
    if not params:
        params = {k: text[k] for k in METADATA_KEYS if k in text}
    if "prompt" not in params:
        raise InvalidRequestError(f"{path}: no generation metadata in this image (it was not written by "
                                  "mlx-engine image, or its text chunks were stripped)")
    for k in _INT_KEYS:
        if params.get(k) is not None:
            try:
                params[k] = int(params[k])
            except (TypeError, ValueError):
                raise InvalidRequestError(f"{path}: metadata {k}={params[k]!r} is not an integer") from None
    for k in _FLOAT_KEYS:
        if params.get(k) is not None:
            try:
                params[k] = float(params[k])
            except (TypeError, ValueError):
                raise InvalidRequestError(f"{path}: metadata {k}={params[k]!r} is not a number") from None
    return params
