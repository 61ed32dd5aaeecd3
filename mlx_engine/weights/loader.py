"""``open_weights``: pick the reader for a model file or folder."""

from __future__ import annotations

import os
from pathlib import Path

from mlx_engine.errors import WeightsError
from mlx_engine.weights.base import WeightFile
from mlx_engine.weights.gguf import GGUF_MAGIC, GGUFFile
from mlx_engine.weights.safetensors import open_safetensors

__all__ = ["open_weights"]


def _magic(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(4)
    except FileNotFoundError:
        raise WeightsError(f"{path}: no such file") from None
    except OSError as e:
        raise WeightsError(f"{path}: cannot open: {e.strerror or e}") from None


def open_weights(path: "str | os.PathLike[str]") -> WeightFile:
    """Open model weights for reading, tensor by tensor.

    Args:
        path: one of
            - a GGUF file (recognized by its ``GGUF`` magic, whatever its name: ollama's blobs have no extension);
            - a ``.safetensors`` file, or a ``*.safetensors.index.json`` index of shards;
            - a folder: a Hugging Face folder (``model.safetensors.index.json`` or another single
              ``*.safetensors.index.json``, else ``model.safetensors``, else its only ``*.safetensors``), or a
              folder holding no safetensors and exactly one ``.gguf`` file.

    Returns:
        a :class:`~mlx_engine.weights.gguf.GGUFFile` or :class:`~mlx_engine.weights.safetensors.SafetensorsFile`;
        use it as a context manager to release the files.

    Raises:
        WeightsError: the path does not exist, holds nothing readable or several candidates, or the file is
            truncated or corrupt. The message names the file and the problem.
    """
    p = Path(os.fspath(path))
    if p.is_dir():
        has_safetensors = any(p.glob("*.safetensors")) or any(p.glob("*.safetensors.index.json"))
        if has_safetensors:
            return open_safetensors(p)
        ggufs = sorted(f for f in p.glob("*.gguf") if f.is_file())
        if len(ggufs) == 1:
            return GGUFFile(ggufs[0])
        if len(ggufs) > 1:
            raise WeightsError(f"{p}: several .gguf files ({', '.join(f.name for f in ggufs)}); open one of them")
        raise WeightsError(f"{p}: no weights in the folder (no .safetensors, index or .gguf file)")
    if not p.exists():
        raise WeightsError(f"{p}: no such file or folder")
    if p.name.endswith(".index.json"):
        return open_safetensors(p)
    magic = _magic(p)
    if magic == GGUF_MAGIC:
        return GGUFFile(p)
    if p.suffix == ".gguf":
        return GGUFFile(p)  # raises, naming the bad magic
    if p.suffix == ".safetensors" or _looks_like_safetensors(p):
        return open_safetensors(p)
    raise WeightsError(f"{p}: unknown weights format (neither GGUF nor safetensors; first bytes {magic!r})")


def _looks_like_safetensors(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError:
        return False
    return len(head) == 9 and head[8:9] == b"{"
