"""Pulling from ollama's public model registry: the OCI-style API that ``ollama pull`` uses.

``GET {registry}/v2/{namespace}/{model}/manifests/{tag}`` (``Accept:
application/vnd.docker.distribution.manifest.v2+json``) gives a manifest whose ``layers`` each have a ``mediaType``,
a ``digest`` (``sha256:<hex>``) and a ``size``; ``GET {registry}/v2/{namespace}/{model}/blobs/{digest}`` gives a
layer's bytes. The layer ``application/vnd.ollama.image.model`` is the GGUF file; ``...image.license``,
``...image.template`` (a Go template, kept for ``show``) and ``...image.params`` (JSON) are small text layers.

Downloads resume: bytes land in ``.<file>.partial`` next to the final file, and a later pull asks for the rest with a
``Range`` header (a server that ignores it sends the whole blob, which is then written from the start). Every blob is
checked against its size and sha256 before it is renamed into place, and the store's manifest is written last, so an
interrupted or corrupt pull never leaves anything that looks like a model.

The registry is ``$MLX_ENGINE_OLLAMA_REGISTRY``, else ollama's public one.
"""

from __future__ import annotations

import errno
import hashlib
import http.client
import json
import os
import re
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from mlx_engine.errors import ModelNotFoundError, PullError

REGISTRY_ENV = "MLX_ENGINE_OLLAMA_REGISTRY"
DEFAULT_REGISTRY = "https://registry.ollama.ai"
MODEL_LAYER = "application/vnd.ollama.image.model"
TEXT_LAYERS = {"application/vnd.ollama.image.license": "license.txt",
               "application/vnd.ollama.image.template": "template.txt",
               "application/vnd.ollama.image.params": "params.json",
               "application/vnd.ollama.image.system": "system.txt"}
_ACCEPT = "application/vnd.docker.distribution.manifest.v2+json"
_PART = r"[a-z0-9][a-z0-9._-]{0,79}"
_NAME = re.compile(rf"^(?:({_PART})/)?({_PART})(?::([A-Za-z0-9_][A-Za-z0-9._-]{{0,127}}))?$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_MAX_MANIFEST = 1 << 20
_MAX_TEXT_LAYER = 1 << 20
_TIMEOUT = 30


@dataclass(frozen=True)
class RegistryRef:
    """``namespace/model:tag`` in the registry (``library`` is ollama's namespace of official models)."""

    namespace: str
    model: str
    tag: str

    @property
    def name(self) -> str:
        """The name the store keeps: ``llama3.2:latest``, or ``user/model:tag`` outside ``library``."""
        base = self.model if self.namespace == "library" else f"{self.namespace}/{self.model}"
        return f"{base}:{self.tag}"


def parse_registry_name(name: str) -> RegistryRef | None:
    """``llama3.2``, ``llama3.2:1b``, ``user/model:tag`` -> a reference; None for anything else (paths, spaces,
    upper case model names, ``hf:`` names)."""
    mo = _NAME.match(name.strip()) if isinstance(name, str) else None
    if not mo or name.startswith("hf:"):
        return None
    return RegistryRef(mo.group(1) or "library", mo.group(2), mo.group(3) or "latest")


def registry_url() -> str:
    return (os.environ.get(REGISTRY_ENV) or DEFAULT_REGISTRY).rstrip("/")


def _open(url: str, headers: dict[str, str] | None = None):
    req = urllib.request.Request(url, headers={"User-Agent": "mlx-engine", **(headers or {})})
    return urllib.request.urlopen(req, timeout=_TIMEOUT)  # noqa: S310 -- http(s) URLs of the registry only


def fetch_manifest(ref: RegistryRef, base: str | None = None) -> dict:
    """The registry's manifest of ``ref``, checked for shape.

    Raises:
        ModelNotFoundError: the registry has no such model or tag. PullError: the registry cannot be reached or
            answers something that is not a manifest.
    """
    base = base or registry_url()
    url = f"{base}/v2/{ref.namespace}/{ref.model}/manifests/{ref.tag}"
    try:
        with _open(url, {"Accept": _ACCEPT}) as r:
            body = r.read(_MAX_MANIFEST + 1)
    except urllib.error.HTTPError as e:
        if e.code in (401, 404):
            raise ModelNotFoundError(f"{ref.name}: no such model in the ollama registry ({base})") from None
        raise PullError(f"the ollama registry ({base}) answered {e.code} for {ref.name}; try again later") from None
    except (urllib.error.URLError, OSError) as e:
        raise PullError(f"cannot reach the ollama registry ({base}) for {ref.name}: {getattr(e, 'reason', e)}; "
                        "check your network") from None
    try:
        if len(body) > _MAX_MANIFEST:
            raise ValueError("larger than 1 MiB")
        manifest = json.loads(body)
        layers = manifest["layers"]
        if not isinstance(layers, list):
            raise ValueError("layers is not a list")
        for layer in layers:
            if not (isinstance(layer, dict) and isinstance(layer.get("mediaType"), str)
                    and isinstance(layer.get("digest"), str) and _DIGEST.match(layer["digest"])
                    and isinstance(layer.get("size"), int) and layer["size"] >= 0):
                raise ValueError(f"bad layer {str(layer)[:100]}")
    except (ValueError, KeyError, TypeError) as e:
        raise PullError(f"the ollama registry's manifest for {ref.name} is not valid ({e})") from None
    if sum(1 for la in layers if la["mediaType"] == MODEL_LAYER) != 1:
        raise PullError(f"{ref.name} has no single model layer in the registry: not a model this engine can run")
    return manifest


def download_blob(ref: RegistryRef, layer: dict, dest: Path, *, base: str | None = None, bar=None) -> None:
    """Download one layer to ``dest``, resuming ``.<name>.partial``; verified by size and sha256 before the rename.

    Raises:
        PullError: the download failed (the partial file is kept for a later resume) or did not verify (the partial
            file is deleted).
    """
    base = base or registry_url()
    size, digest = layer["size"], layer["digest"]
    partial = dest.with_name(f".{dest.name}.partial")
    have = partial.stat().st_size if partial.exists() else 0
    if have > size:
        partial.unlink()
        have = 0
    sha = hashlib.sha256()
    if have:
        with open(partial, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                sha.update(block)
    if bar is not None:
        bar.update(have)
    url = f"{base}/v2/{ref.namespace}/{ref.model}/blobs/{digest}"
    try:
        if have < size:
            with _open(url, {"Range": f"bytes={have}-"} if have else None) as r:
                if have and r.status != 206:  # the server sent the whole blob: start over
                    have, sha = 0, hashlib.sha256()
                    if bar is not None:
                        bar.reset(total=size)
                with open(partial, "ab" if have else "wb") as f:
                    while True:
                        block = r.read(1 << 20)
                        if not block:
                            break
                        if have + len(block) > size:
                            raise PullError(f"{digest} is longer than the {size} bytes its manifest gives")
                        f.write(block)
                        sha.update(block)
                        have += len(block)
                        if bar is not None:
                            bar.update(len(block))
                    f.flush()
                    os.fsync(f.fileno())
    except urllib.error.HTTPError as e:
        raise PullError(f"the ollama registry answered {e.code} for blob {digest} of {ref.name}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as e:
        raise PullError(f"the download of {ref.name} was interrupted ({getattr(e, 'reason', e)}); pull again to "
                        "resume it") from None
    except OSError as e:
        if e.errno == errno.ENOSPC:  # the store reports a full disk with the numbers, not as a write error
            raise
        raise PullError(f"cannot write {partial}: {e.strerror or e}") from None
    if have < size:
        raise PullError(f"the download of {ref.name} ended early ({have} of {size} bytes); pull again to resume it")
    if "sha256:" + sha.hexdigest() != digest:
        partial.unlink(missing_ok=True)
        raise PullError(f"blob {digest} of {ref.name} does not verify (its sha256 is {sha.hexdigest()[:12]}...); "
                        "nothing was kept, pull again")
    os.replace(partial, dest)


def read_text_layer(ref: RegistryRef, layer: dict, base: str | None = None) -> bytes:
    """A small text layer (license, template, params), verified by its digest."""
    base = base or registry_url()
    if layer["size"] > _MAX_TEXT_LAYER:
        raise PullError(f"{ref.name}: the {layer['mediaType']} layer is larger than 1 MiB")
    url = f"{base}/v2/{ref.namespace}/{ref.model}/blobs/{layer['digest']}"
    try:
        with _open(url) as r:
            data = r.read(_MAX_TEXT_LAYER + 1)
    except (urllib.error.URLError, OSError) as e:
        raise PullError(f"cannot download the {layer['mediaType']} layer of {ref.name}: "
                        f"{getattr(e, 'reason', e)}") from None
    if "sha256:" + hashlib.sha256(data).hexdigest() != layer["digest"]:
        raise PullError(f"the {layer['mediaType']} layer of {ref.name} does not verify")
    return data
