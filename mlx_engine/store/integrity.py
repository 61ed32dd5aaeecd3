"""Checked weights: every pulled file against the sha256 its manifest recorded at pull.

Hashing a model at every load would cost a full read of the file, so each folder keeps ``verified.json`` beside its
manifest: per file, the size, ``st_mtime_ns`` and ``st_ctime_ns`` it had when it was last hashed, and the sha256 it
had. A load re-hashes a file only when one of those changed (a copy, an edit, a write in place; the ctime also
moves when someone resets the mtime by hand), so an untouched model loads without reading its bytes twice. The record
is written atomically and is only a cache: lost or unreadable, the next load hashes again. A pull writes it for the
files it has just verified.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

from mlx_engine.errors import WeightsError
from mlx_engine.store.manifest import VERIFIED, atomic_write_bytes

_BUFFER = 4 << 20  # bytes read at a time: bounded memory, few system calls
_BAR_FROM = 64 << 20  # files at least this large get a progress bar in `verify`


def sha256_file(path: Path, bar=None) -> str:
    """The sha256 (hex) of ``path``, read 4 MiB at a time into one reused buffer; ``bar`` (a tqdm bar) is advanced
    by the bytes read. Raises OSError when the file cannot be read."""
    digest = hashlib.sha256()
    buf = bytearray(_BUFFER)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
            if bar is not None:
                bar.update(n)
    return digest.hexdigest()


def _stamp(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def _checked_files(manifest: dict) -> list[tuple[str, str]]:
    """(name, sha256) of the manifest's files that carry a sha256 (older ``hf:`` manifests may not)."""
    out = []
    for f in manifest.get("files", []):
        sha = f.get("sha256") if isinstance(f, dict) else None
        if isinstance(sha, str) and len(sha) == 64 and isinstance(f.get("name"), str):
            out.append((f["name"], sha.lower()))
    return out


def read_record(folder: Path) -> dict:
    """``folder``'s verification record: file name -> {size, mtime_ns, ctime_ns, sha256 (recorded at pull), got
    (the sha256 hashed)}; {} when absent or unreadable."""
    try:
        data = json.loads((folder / VERIFIED).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    files = data.get("files") if isinstance(data, dict) else None
    return files if isinstance(files, dict) else {}


def _write_record(folder: Path, record: dict) -> None:
    # a read-only or full store keeps working: the record is a cache, the next load hashes again
    with contextlib.suppress(OSError):
        atomic_write_bytes(folder / VERIFIED, (json.dumps({"files": record}, indent=1) + "\n").encode("utf-8"))


def _still(record: dict, name: str, sha: str, stamp: dict) -> dict | None:
    """The record's entry for ``name`` if it still holds (same expected sha256, same size and times), else None."""
    r = record.get(name)
    if not isinstance(r, dict) or r.get("sha256") != sha or not isinstance(r.get("got"), str) or \
            any(r.get(k) != v for k, v in stamp.items()):
        return None
    return r


def record_pulled(folder: Path, manifest: dict) -> None:
    """Record the manifest's files as verified as they are now: the pull that wrote them has just checked them."""
    record = {}
    for name, sha in _checked_files(manifest):
        with contextlib.suppress(OSError):
            record[name] = {**_stamp(folder / name), "sha256": sha, "got": sha}
    _write_record(folder, record)


def mismatch_error(model: str, path: Path, expected: str, got: str | None) -> WeightsError:
    """The error for a pulled file that does not match its recorded sha256 (``got`` None: it cannot be read)."""
    how = "cannot be read" if got is None else f"has sha256 {got[:16]}..."
    return WeightsError(f"{path} does not match the sha256 recorded when {model} was pulled (expected "
                        f"{expected[:16]}..., the file {how}): it changed on disk since (a failing disk, an "
                        f"interrupted copy, or tampering) and is not loaded. Pull it again: mlx-engine pull {model}")


def _hashed(folder: Path, record: dict, name: str, sha: str, *, again: bool, bar_from: int | None = None) -> str:
    """The sha256 of ``folder/name``: from the record if it still holds (and not ``again``), else hashed now and
    recorded. Raises OSError when the file cannot be read."""
    path = folder / name
    stamp = _stamp(path)
    r = None if again else _still(record, name, sha, stamp)
    if r is None:
        bar = None
        if bar_from is not None and stamp["size"] >= bar_from:
            from tqdm import tqdm

            bar = tqdm(total=stamp["size"], desc=f"verifying {name}", unit="B", unit_scale=True, unit_divisor=1000,
                       leave=False, dynamic_ncols=True)
        try:
            r = record[name] = {**stamp, "sha256": sha, "got": sha256_file(path, bar)}
        finally:
            if bar is not None:
                bar.close()
    return r["got"]


def check(folder: Path, manifest: dict) -> None:
    """Check a pulled model before it loads: files changed since their last verification are hashed again.

    Raises:
        WeightsError: a file does not match its recorded sha256 (or cannot be read); the message names the file and
            says to pull again. The verdict is recorded, so ``list`` marks the model.
    """
    record = read_record(folder)
    before = json.dumps(record, sort_keys=True)
    try:
        for name, sha in _checked_files(manifest):
            try:
                got = _hashed(folder, record, name, sha, again=False)
            except OSError:
                got = None
            if got != sha:
                raise mismatch_error(manifest["name"], folder / name, sha, got)
    finally:
        if json.dumps(record, sort_keys=True) != before:
            _write_record(folder, record)


def verify(folder: Path, manifest: dict, *, progress: bool = False, report=None) -> bool:
    """Hash every file of a pulled model now, whatever the record says; True when all match.

    ``report(name, ok)`` is called after each file; files of 64 MiB or more show a tqdm progress bar on stderr when
    ``progress`` is set. The verdicts are recorded.
    """
    record = read_record(folder)
    all_ok = True
    try:
        for name, sha in _checked_files(manifest):
            try:
                ok = _hashed(folder, record, name, sha, again=True, bar_from=_BAR_FROM if progress else None) == sha
            except OSError:
                ok = False
            all_ok = all_ok and ok
            if report is not None:
                report(name, ok)
    finally:
        _write_record(folder, record)
    return all_ok


def known_bad(folder: Path, manifest: dict) -> list[str]:
    """The files whose last verification failed and that have not changed since (a stat per file, no hashing)."""
    record = read_record(folder)
    out = []
    for name, sha in _checked_files(manifest):
        with contextlib.suppress(OSError):
            r = _still(record, name, sha, _stamp(folder / name))
            if r is not None and r["got"] != sha:
                out.append(name)
    return out


def remove_bad(folder: Path, manifest: dict) -> None:
    """Delete the files of ``folder`` that do not match their sha256 (before a pull downloads them again), so no
    downloader takes a damaged file for a finished one."""
    for name in known_bad(folder, manifest):
        with contextlib.suppress(OSError):
            os.unlink(folder / name)
