"""Models pulled with ollama, read in place from its store.

``<root>/manifests/<host>/<namespace>/<model>/<tag>`` (``root`` is ``$OLLAMA_MODELS``, else ``~/.ollama/models``)
is a JSON manifest whose layer of media type ``application/vnd.ollama.image.model`` names the model's blob (a GGUF),
stored as ``<root>/blobs/sha256-<hex>``; a layer of type ``application/vnd.ollama.image.license`` holds its license.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

from mlx_engine.errors import ModelNotFoundError
from mlx_engine.store.manifest import ResolvedModel, is_gguf

_MODEL_LAYER = "application/vnd.ollama.image.model"
_LICENSE_LAYER = "application/vnd.ollama.image.license"


def ollama_models_dir() -> Path:
    """``$OLLAMA_MODELS``, else ``~/.ollama/models``."""
    env = os.environ.get("OLLAMA_MODELS")
    return Path(env).expanduser() if env else Path.home() / ".ollama" / "models"


def resolve_ollama(model: str) -> ResolvedModel | None:
    """The GGUF blob of an ollama model (``llama3.2:1b``, ``library/x:tag``, ``host/ns/x:tag``), or None when ollama
    has no manifest for that name.

    Raises:
        ModelNotFoundError: the manifest exists but is unreadable, has no model layer, or its blob is missing or not
            a GGUF file.
    """
    root = ollama_models_dir()
    manifests = root / "manifests"
    if not manifests.is_dir():
        return None
    ref = model
    tag = "latest"
    last = ref.rsplit("/", 1)[-1]
    if ":" in last:
        ref, tag = ref.rsplit(":", 1)
    parts = [p for p in ref.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts) or tag in (".", "..") or "/" in tag:
        return None
    if len(parts) == 1:
        parts = ["registry.ollama.ai", "library", parts[0]]
    elif len(parts) == 2:
        parts = ["registry.ollama.ai", *parts]
    manifest_path = manifests.joinpath(*parts, tag)
    try:
        if not manifest_path.is_file():
            return None
    except (OSError, ValueError):  # a name the system cannot look up (too long...) names no ollama model
        return None
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        layers = manifest["layers"]
        if not isinstance(layers, list) or not all(isinstance(x, dict) for x in layers):
            raise ValueError(f"its layers are {type(layers).__name__}, not a list of objects")
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise ModelNotFoundError(f"ollama manifest {manifest_path} cannot be read: {e}") from e
    model_blob = None
    license_text = None
    for layer in layers:
        media = layer.get("mediaType", "")
        digest = layer.get("digest", "")
        blob = _blob(root, digest) if isinstance(digest, str) else None
        if media == _MODEL_LAYER and model_blob is None:
            model_blob = blob
        elif media == _LICENSE_LAYER and blob is not None and blob.is_file():
            with contextlib.suppress(OSError, UnicodeDecodeError):
                license_text = blob.read_text(encoding="utf-8").strip() or None
    if model_blob is None:
        raise ModelNotFoundError(f"ollama manifest {manifest_path} has no model layer ({_MODEL_LAYER})")
    if not model_blob.is_file():
        raise ModelNotFoundError(f"ollama model {model!r}: blob {model_blob} is missing; run: ollama pull {model}")
    if not is_gguf(model_blob):
        raise ModelNotFoundError(f"ollama model {model!r}: blob {model_blob} is not a GGUF file")
    return ResolvedModel(path=model_blob, name=ollama_name(parts, tag), source="ollama", license=license_text)


def ollama_models() -> list[tuple[str, Path]]:
    """(name, manifest path) of every model pulled with ollama, sorted."""
    manifests = ollama_models_dir() / "manifests"
    out = []
    if not manifests.is_dir():
        return out
    for p in sorted(manifests.rglob("*")):
        if p.is_file():
            rel = p.relative_to(manifests).parts
            if len(rel) >= 4:
                out.append((ollama_name(list(rel[:-1]), rel[-1]), p))
    return sorted(out)


def ollama_name(parts: list[str], tag: str) -> str:
    """As ollama writes names: ``x:tag`` for its own library, ``ns/x:tag`` for its registry, else in full."""
    if parts[0] == "registry.ollama.ai":
        parts = parts[2:] if parts[1] == "library" else parts[1:]
    return "/".join(parts) + ":" + tag


def _blob(root: Path, digest: str) -> Path | None:
    mo = re.fullmatch(r"sha256[:-]([0-9a-f]{64})", digest or "")
    return root / "blobs" / f"sha256-{mo.group(1)}" if mo else None
