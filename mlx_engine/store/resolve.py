"""Model names: what a model argument means, and whether a command-line word names a model at all.

A model argument resolves, in this order: ``hf:org/repo`` (the store, else downloaded), an existing path (a GGUF
file, a Hugging Face folder with ``config.json``, a store folder, or a folder holding one ``.gguf``), a catalog name
(pulled on first use), a name already in the store, and a model pulled with ollama.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Protocol

from mlx_engine.errors import EngineError, InvalidRequestError, ModelNotFoundError, PullError
from mlx_engine.store import integrity
from mlx_engine.store.catalog import CATALOG, DEFAULT_MODEL, canonical_name, catalog_hint
from mlx_engine.store.info import ModelInfo, folder_license
from mlx_engine.store.manifest import ResolvedModel, check_name, is_gguf, read_manifest, resolved_from_manifest
from mlx_engine.store.registry import parse_registry_name
from mlx_engine.store.ollama import ollama_models_dir, resolve_ollama


class Store(Protocol):
    """What resolving needs of :class:`mlx_engine.store.Store` (stated here, so that the store's module and this one
    do not import each other)."""

    @property
    def models_dir(self) -> Path: ...

    def check_name(self, name: str) -> None: ...

    def find(self, name: str) -> ResolvedModel | None: ...

    def pull(self, name: str, *, progress: bool = True) -> ResolvedModel: ...

    def list(self) -> list[ModelInfo]: ...

    def ollama_models(self) -> list[tuple[str, Path]]: ...


def resolve(store: "Store", model: str, *, pull: bool = True, progress: bool = True,
            verify: bool = True) -> ResolvedModel:
    """See :meth:`mlx_engine.store.Store.resolve`. Every door that loads a model comes through here, so a pulled
    model's files are checked against their recorded sha256 here (``verify``; see :mod:`mlx_engine.store.integrity`).
    """
    resolved = _resolve(store, model, pull=pull, progress=progress)
    if verify and resolved.folder is not None:
        manifest = read_manifest(resolved.folder)
        if manifest is None:  # removed or half-rewritten since it was found
            raise ModelNotFoundError(f"model {resolved.name!r} is no longer complete in the store; pull it again: "
                                     f"mlx-engine pull {resolved.name}")
        integrity.check(resolved.folder, manifest)
    return resolved


def _resolve(store: "Store", model: str, *, pull: bool, progress: bool) -> ResolvedModel:
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str):
        raise InvalidRequestError(f"a model is named by a string or a path, not {type(model).__name__}; "
                                  f"try {DEFAULT_MODEL!r}. {catalog_hint()}")
    if not model.strip():
        raise ModelNotFoundError(f"no model given; try {DEFAULT_MODEL!r}. {catalog_hint()}")
    model = model.strip()

    if model.startswith("hf:"):
        store.check_name(model)
        return _stored_or_pulled(store, model, pull=pull, progress=progress)

    path = Path(model).expanduser()
    if _exists(path):
        return resolve_path(path)
    check_name(model)  # not a file: a name, which must not smuggle control characters into a folder or a log

    name = canonical_name(model)
    if name in CATALOG:
        return _stored_or_pulled(store, name, pull=pull, progress=progress)

    ref = parse_registry_name(model)
    found = store.find(model)
    if found is None and ref is not None:  # llama3.2 -> llama3.2:latest, pulled from ollama's registry
        found = store.find(ref.name)
        found = found if found is not None and found.source == "ollama-registry" else None
    if found is not None:
        return found

    ollama = resolve_ollama(model)
    if ollama is not None:
        return ollama

    registry_note = ""
    if ref is not None and pull:
        try:
            return store.pull(model, progress=progress)  # ollama's registry
        except ModelNotFoundError:
            registry_note = " nor in ollama's registry"
        except PullError as e:
            registry_note = f" (ollama's registry could not be asked: {e})"

    looks_like_path = os.sep in model or model.endswith(".gguf") or model.startswith((".", "~"))
    what = f"no such file or folder: {model}" if looks_like_path else f"unknown model {model!r}"
    close = close_names(store, model)
    raise ModelNotFoundError(
        f"{what}: not in the catalog, the store or ollama's store ({ollama_models_dir()}){registry_note}. "
        + (f"Close names: {', '.join(close)}. " if close else "")
        + f"A model is a catalog name, a GGUF file, a Hugging Face folder, hf:org/repo, or an ollama name. "
        f"{catalog_hint()}")


def close_names(store: "Store", name: str) -> list[str]:
    """Known model names close to ``name``: the catalog's, the store's and ollama's local ones."""
    import difflib

    names = set(CATALOG)
    with contextlib.suppress(OSError, EngineError):
        names |= {i.name for i in store.list()}
    with contextlib.suppress(OSError, EngineError):
        names |= {n for n, _ in store.ollama_models()}
    low = name.lower()
    found = [n for n in sorted(names) if low and (low in n.lower() or n.lower().split(":")[0] in low)]
    found += [n for n in difflib.get_close_matches(low, sorted(names), n=5, cutoff=0.6) if n not in found]
    return found[:5]


def _stored_or_pulled(store: "Store", name: str, *, pull: bool, progress: bool) -> ResolvedModel:
    """A catalog or ``hf:`` model from the store, pulled first when ``pull`` allows it."""
    found = store.find(name)
    if found is not None:
        return found
    if not pull:
        raise ModelNotFoundError(f"model {name!r} is not in the store ({store.models_dir}); "
                                 f"pull it with: mlx-engine pull {name}")
    return store.pull(name, progress=progress)


def resolve_path(path: Path) -> ResolvedModel:
    """A path given as a model: a GGUF file, a Hugging Face folder, a store folder, or a folder with one GGUF.

    Raises:
        ModelNotFoundError: not a GGUF file, or a folder with none (or several) of them; the message says what to
            give instead.
    """
    path = path.resolve()
    if path.is_file():
        if not is_gguf(path):
            raise ModelNotFoundError(f"{path} is not a GGUF file (it does not start with the GGUF magic); "
                                     f"give a .gguf file or a Hugging Face folder with config.json")
        return ResolvedModel(path=path, name=str(path), source="file", license=None)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ResolvedModel(path=path, name=str(path), source="folder", license=folder_license(path))
        manifest = read_manifest(path)
        if manifest is not None:
            return resolved_from_manifest(path, manifest)
        ggufs = sorted(p for p in path.glob("*.gguf") if p.is_file())
        if len(ggufs) == 1:
            return ResolvedModel(path=ggufs[0], name=str(ggufs[0]), source="file")
        if len(ggufs) > 1:
            raise ModelNotFoundError(f"{path} holds several GGUF files ({', '.join(p.name for p in ggufs)}); "
                                     f"give one of them")
        raise ModelNotFoundError(f"{path} is a folder without config.json or a .gguf file; give a GGUF file or "
                                 f"a Hugging Face model folder")
    raise ModelNotFoundError(f"{path} is neither a file nor a folder")


def looks_like_model(store: "Store", arg: str) -> bool:
    """See :meth:`mlx_engine.store.Store.looks_like_model`."""
    if not arg or not arg.strip():
        return False
    path = Path(arg).expanduser()
    if _exists(path):
        if path.is_dir():
            return True
        if path.is_file():
            return path.suffix == ".gguf" or is_gguf(path)
    if any(c.isspace() for c in arg):
        return False
    if arg.startswith("hf:") or canonical_name(arg) in CATALOG:
        return True
    if re.fullmatch(r"[\w.\-]+(/[\w.\-]+)*:[\w.\-]+", arg):
        return True
    if arg.endswith(".gguf"):
        return True
    try:
        resolve(store, arg, pull=False, progress=False, verify=False)  # a damaged model is still a model's name
    except EngineError:
        return False
    return True


def _exists(path: Path) -> bool:
    """``path.exists()``, False for a name the system cannot even look up (too long, a NUL byte...)."""
    try:
        return path.exists()
    except (OSError, ValueError):
        return False
