"""Images in prompts: reading them (a path, bytes, a base64 or ``data:`` URL, a PIL image), turning them into the
pixel values a vision encoder takes, and naming them by their pixels (so a cached prefix is reused only for the same
image at the same place).

Preprocessing follows transformers' ``Gemma3ImageProcessorPil`` (the processor transformers uses without
torchvision): convert to RGB (transparent pixels over white, as ``convert_to_rgb``), resize to ``size x size`` with
PIL's bilinear filter, scale by ``1/255``, normalise by ``mean`` and ``std``; EXIF orientation applied when the file
is read (transformers' ``load_image``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import numpy as np

from mlx_engine.errors import InvalidRequestError

#: File name endings taken for images where a path is found in text (the chat's dropped files).
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff")
#: The most pixels an image may have (PIL's decompression-bomb limit is twice this); larger files are refused.
MAX_PIXELS = 64 * 2**20


def load_image(source: Any) -> Any:
    """A PIL image (RGB, EXIF orientation applied) from a path, ``bytes``, a ``data:`` URL, a base64 string or a PIL
    image.

    Raises:
        InvalidRequestError: the file is missing, is not an image PIL can read, or is larger than ``MAX_PIXELS``.
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    what = "the image"
    if isinstance(source, Image.Image):
        img = source
    else:
        if isinstance(source, str) and source.startswith(("http://", "https://")):
            raise InvalidRequestError(f"{source[:100]}: image URLs are not fetched; give a file, bytes, base64 data "
                                      "or a data: URL")
        if isinstance(source, (bytes, bytearray)):
            data = bytes(source)
        elif isinstance(source, str) and source.startswith("data:"):
            data = _decode_inline(source)
        elif isinstance(source, (str, Path)) and _is_file(source):
            path = Path(source).expanduser()
            what, data = str(path), path.read_bytes()
        elif isinstance(source, str) and len(source) > 64 and not _looks_like_path(source):  # ollama's: base64
            data = _decode_inline(source)
        else:
            raise InvalidRequestError(f"{source}: no such image file")
        Image.MAX_IMAGE_PIXELS = 2 * MAX_PIXELS
        try:
            img = Image.open(io.BytesIO(data))
            if img.width * img.height > MAX_PIXELS:
                raise InvalidRequestError(f"{what} has {img.width}x{img.height} pixels; at most {MAX_PIXELS:,} are "
                                          "accepted")
            img.load()
        except UnidentifiedImageError:
            raise InvalidRequestError(f"{what} is not an image that can be read (PNG, JPEG, WebP, GIF, ...)") \
                from None
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
            raise InvalidRequestError(f"{what} is not an image that can be read: {e}") from None
        img = ImageOps.exif_transpose(img)
    return to_rgb(img)


def _looks_like_path(s: str) -> bool:
    return s.startswith(("/", "./", "../", "~")) or s.lower().endswith(IMAGE_SUFFIXES) or "\\" in s


def _is_file(source: "str | Path") -> bool:
    try:
        return Path(source).expanduser().is_file()
    except (OSError, ValueError):  # base64 text is no file name (too long, or a NUL)
        return False


def _decode_inline(s: str) -> bytes:
    if s.startswith("data:"):
        head, _, s = s.partition(",")
        if ";base64" not in head:
            raise InvalidRequestError("an image data URL must be base64-encoded (data:image/png;base64,...)")
    try:
        return base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError("the image is neither a file path nor valid base64 data") from None


def to_rgb(img: Any) -> Any:
    """RGB; an image with transparency (an alpha band, or a palette's transparent colour) is composited over
    white first (transformers' ``convert_to_rgb``)."""
    from PIL import Image

    if img.mode == "RGB":
        return img
    if "A" not in img.getbands() and img.info.get("transparency") is None:
        return img.convert("RGB")
    rgba = img.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


@dataclass(frozen=True)
class ImageProcessor:
    """Pixels for a vision encoder: ``size x size`` RGB, bilinear, ``(x / 255 - mean) / std``."""

    size: int
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def __call__(self, image: Any) -> np.ndarray:
        """``float32 [size, size, 3]`` (channels last) for one image (any source :func:`load_image` reads)."""
        from PIL import Image

        img = load_image(image).resize((self.size, self.size), Image.Resampling.BILINEAR)
        x = np.asarray(img, np.float32) * np.float32(1 / 255)
        return ((x - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)).astype(np.float32)


@dataclass(frozen=True)
class PromptImage:
    """An image at an explicit place of a prompt: its ``count`` embedding rows replace the placeholder tokens at
    ``start .. start + count - 1``; ``pixels`` are the processed values; ``digest`` names the pixels."""

    start: int
    count: int
    pixels: np.ndarray

    @cached_property
    def digest(self) -> str:
        return hashlib.sha256(np.ascontiguousarray(self.pixels).tobytes()).hexdigest()

    def keys(self) -> list[int]:
        """What the cache remembers for these positions: negative ids from the digest (never a token id), so a
        cached prefix matches only the same image at the same place."""
        base = int(self.digest[:15], 16)
        return [-1 - ((base + i) % (1 << 62)) for i in range(self.count)]


def prompt_keys(tokens: Sequence[int], images: Sequence[PromptImage] = ()) -> list[int]:
    """What the cache remembers of a prompt: its token ids, with each image's placeholders replaced by keys made
    from the image's pixels (:meth:`PromptImage.keys`), so that a cached prefix is reused only for the same image
    at the same place."""
    keys = [int(t) for t in tokens]
    for im in images:
        keys[im.start:im.start + im.count] = im.keys()
    return keys
