"""The store's layout on disk, its manifests, and the atomic writes and locks that keep it consistent.

Layout (other parts of the engine rely on it)::

    <root>/                       $MLX_ENGINE_HOME, else <user cache dir>/mlx-engine
        models/<safe name>/       one folder per model; ':' and '/' in the name become '-'
            <model file(s)>       a .gguf file, or a Hugging Face folder's files
            manifest.json         written last, atomically: name, source, files (name, size, sha256), license...
            verified.json         when each file was last hashed, and what it gave (see mlx_engine.store.integrity)
            .download/, .*.partial  a pull's work files: removed (or resumed) by the next pull
        .<safe name>.lock         held by the process that pulls or removes the model
        chat_history              the ``chat`` command's line-editing history

A model is present only if its ``manifest.json`` exists and every file it lists has the recorded size. Files are
written to a temporary name in the model's folder, flushed to disk and renamed into place (``os.replace``), and the
manifest comes last, so an interrupted pull never leaves a file that later looks valid.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mlx_engine.errors import InvalidRequestError, StoreError
from mlx_engine.store.catalog import CATALOG, CatalogEntry

MANIFEST = "manifest.json"
VERIFIED = "verified.json"  # beside the manifest; never a model file
MANIFEST_SCHEMA = 1
GGUF_MAGIC = b"GGUF"
FILE_MODE = 0o644  # mkstemp makes 0o600; store files are ordinary readable files


@dataclass
class ResolvedModel:
    """Where a model argument led.

    Attributes:
        path: a ``.gguf`` file (an ollama blob has no extension) or a Hugging Face folder.
        name: the canonical name (catalog name, ``hf:org/repo``, ollama name, or the path given).
        source: ``catalog``, ``file``, ``folder``, ``hf`` or ``ollama``.
        entry: the catalog entry, for catalog models.
        license: the license's name or text, when known.
        folder: the store folder of a pulled model (its files are checked against the manifest's sha256 before a
            load), None for models added by path or read from ollama's store.
    """

    path: Path
    name: str
    source: str
    entry: CatalogEntry | None = None
    license: str | None = None
    folder: Path | None = None


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


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def check_name(name: str) -> None:
    """Refuse a model name with a control character (a NUL byte, a newline, an escape...): no store folder, lock
    file, log line or download may be made from it.

    Raises:
        InvalidRequestError: the message says which character, where, and what a model name is.
    """
    mo = _CONTROL.search(name)
    if mo:
        raise InvalidRequestError(f"model name {name!r} has a control character ({mo.group()!r} at position "
                                  f"{mo.start()}); a model name is a catalog name, name:tag or hf:org/repo")


def is_gguf(path: Path) -> bool:
    """Whether ``path`` is a readable file that starts with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder, fsync and ``os.replace``."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        os.chmod(tmp, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (created if needed), so two processes never pull one model at once.

    Raises:
        StoreError: the lock file cannot be created (a read-only store, a full disk).
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a+b")
    except OSError as e:
        raise store_error(path.parent, e) from None
    with f:
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


@contextlib.contextmanager
def lock_if_free(path: Path) -> Iterator[bool]:
    """Take the lock at ``path`` only if no process holds it: yields True when taken (held for the block), False when
    another process holds it, or on a system without ``fcntl`` (where nobody can tell)."""
    try:
        import fcntl
    except ImportError:
        yield False
        return
    try:
        f = open(path, "a+b")
    except OSError:
        yield False
        return
    with f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def remove_stale(models_dir: Path, since_ns: int, keep: str) -> None:
    """Remove what pulls killed before ``since_ns`` (``time.time_ns()``) left in other models' folders: their work
    files (``.download/``, ``.*.partial``, ``huggingface_hub``'s ``.cache/``), and the folder itself when that leaves
    it empty without a manifest; only where no process holds that model's lock. ``keep`` is the folder name of the
    model being pulled, whose leftovers its own pull removes or resumes. Files a user put there are never touched."""
    try:
        folders = [p for p in models_dir.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != keep]
    except OSError:
        return
    for folder in folders:
        try:
            stale = [p for p in folder.iterdir() if p.name.startswith(".") and p.lstat().st_mtime_ns < since_ns]
        except OSError:
            continue
        if not stale:
            continue
        with lock_if_free(models_dir / f".{folder.name}.lock") as free:
            if not free:
                continue
            for p in stale:
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        p.unlink()
            with contextlib.suppress(OSError):
                folder.rmdir()  # only if nothing is left: no manifest, no model file


def store_error(folder: Path, e: OSError) -> StoreError:
    """The error for a store folder that cannot be written, saying why in the user's terms."""
    if e.errno == errno.ENOSPC:
        why = "the disk is full; free some space"
    elif e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        why = "it is read-only here; set MLX_ENGINE_HOME to a folder you can write"
    else:
        why = e.strerror or str(e)
    return StoreError(f"cannot write to the model store at {folder}: {why}")


def read_manifest(folder: Path) -> dict | None:
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


def write_manifest(folder: Path, manifest: dict) -> None:
    """Write ``folder/manifest.json`` atomically (the last step of a pull), stamped with the schema and the time."""
    manifest = {"schema": MANIFEST_SCHEMA, **manifest,
                "pulled_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    atomic_write_bytes(folder / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode("utf-8"))


def discard_manifest(folder: Path) -> None:
    """Remove ``folder``'s manifest first, so nothing in it looks valid while it is rewritten or deleted."""
    with contextlib.suppress(FileNotFoundError):
        (folder / MANIFEST).unlink()


def resolved_from_manifest(folder: Path, m: dict) -> ResolvedModel:
    """The :class:`ResolvedModel` a manifest describes."""
    model_file = m.get("model_file")
    path = folder / model_file if model_file else folder
    return ResolvedModel(path=path, name=m["name"], source=m.get("source", "catalog"),
                         entry=CATALOG.get(m["name"]) if m.get("source") == "catalog" else None,
                         license=m.get("license"), folder=folder)


def size_on_disk(path: Path) -> int:
    """Bytes of a file, or of a folder's files (hidden work files left out)."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for p in path.rglob("*"):
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts):
            total += p.stat().st_size
    return total
