"""The prompt cache on disk (``mlx-engine serve --prompt-cache-dir DIR --prompt-cache-size SIZE``).

When a conversation's answer ends, the device thread copies what the KV cache holds for it to the host
(:func:`mlx_engine.kvcache.snapshot.export_sequence`) and hands it to a writer thread through a bounded queue (full:
the snapshot is dropped, never waited for); the writer saves it as one safetensors file per prefix, written to a
temporary name, flushed to the disk and renamed (atomic), then deletes entries that the new one supersedes (a
shorter prefix of the same conversation that it can resume wherever they could) and the least recently used ones
while the folder holds more than its size. When a request comes whose prompt starts with a saved prefix longer than
what the in-memory prefix cache holds, the device thread reads that file, checks it, and puts it into a free sequence
(:func:`~mlx_engine.kvcache.snapshot.import_sequence`): the prompt is then prefilled from there (the usage's cached
tokens count it). So the cache survives a server restart and a model's unload and reload.

A file (``<model key>-<prefix hash>.safetensors``) holds the prompt's cache keys (``keys``, int64: token ids, an
image's placeholders as keys of its pixels) and the snapshot's arrays; its metadata: ``format``, ``version``, the
model's identity (the name the server serves it under, and the resolved path, size and modification time in
nanoseconds of each of its files: a changed file is another model; hashing gigabytes at every load is what the store's
integrity records already avoid), the cache's layout (:func:`~mlx_engine.kvcache.snapshot.describe`: kind, window,
``kv_bits``, dtypes), where it can be resumed, and the sha256 of its data section. A file that cannot be read, is
truncated, fails its sha256, or was saved for the same model name by other weights or another cache layout is deleted
and never loaded; files of other model names are other models' and stay (until least-recently-used eviction).
One server per folder.

As llama.cpp's ``--slot-save-path`` (``llama_state_seq_save_file``: a magic and version, the tokens, then the
sequence's state; a file that does not match is refused) and mlx-lm's ``save_prompt_cache`` (safetensors, the cache
layout in the metadata).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlx_engine.errors import CacheFullError
from mlx_engine.kvcache.snapshot import Snapshot, describe, export_sequence, import_sequence

log = logging.getLogger("mlx_engine.server")

FORMAT = "mlx-engine.prompt-cache"
VERSION = "1"
QUEUE_SIZE = 8  # snapshots waiting for the writer; more are dropped (the device thread never waits)
_NAME = re.compile(r"^[0-9a-f]{16}-[0-9a-f]{32}\.safetensors$")
_TMP = ".tmp-"
_MAX_HEADER = 64 << 20  # bytes: a longer header is not ours
# safetensors dtype names; bfloat16 never reaches a file (snapshots hold it widened to float32)
_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32, "U32": np.uint32,
           "U8": np.uint8, "I8": np.int8}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


class BadFile(Exception):
    """A prompt-cache file that is not one (unreadable, truncated, another format or version, a wrong sha256)."""


# ---- the file format --------------------------------------------------------------------------------------------
def write_file(path: Path, arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> int:
    """Write ``arrays`` and ``metadata`` as a safetensors file (header: 8-byte little-endian length, JSON padded to 8
    bytes, then the tensors' bytes, as the safetensors format says), adding ``data_sha256`` (of the data section) to
    the metadata; to a temporary name in the same folder, flushed, then renamed over ``path``. Returns its size."""
    arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    digest, header, offset = hashlib.sha256(), {}, 0
    for name in sorted(arrays):
        a = arrays[name]
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        digest.update(a.data)
        offset += a.nbytes
    header["__metadata__"] = {**metadata, "data_sha256": digest.hexdigest()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_name(f"{_TMP}{os.getpid()}-{threading.get_ident()}-{path.name}")
    try:
        with open(tmp, "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            for name in sorted(arrays):
                f.write(arrays[name].data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return 8 + len(raw) + offset


def read_header(path: Path) -> tuple[dict[str, Any], dict[str, str], int]:
    """``(tensors, metadata, data start)`` of a prompt-cache file, checked: our format and version, every tensor
    inside a data section whose end is the file's end. Raises :class:`BadFile`."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= _MAX_HEADER:
                raise BadFile(f"a header of {n} bytes")
            header = json.loads(f.read(n))
        size = path.stat().st_size
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise BadFile(str(e)) from None
    meta = header.pop("__metadata__", None) if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise BadFile("not a prompt-cache file of this version")
    end = 0
    for name, t in header.items():
        try:
            a, b = (int(x) for x in t["data_offsets"])
            count = int(np.prod(t["shape"], dtype=np.int64))
            item = np.dtype(_DTYPES[t["dtype"]]).itemsize
        except (KeyError, TypeError, ValueError):
            raise BadFile(f"tensor {name!r} is described wrongly") from None
        if not 0 <= a <= b or b - a != count * item:
            raise BadFile(f"tensor {name!r} has {b - a} bytes for its shape")
        end = max(end, b)
    if size != 8 + n + end:
        raise BadFile(f"{size} bytes where the header describes {8 + n + end} (truncated?)")
    return header, meta, 8 + n


def read_arrays(path: Path, header: dict[str, Any], meta: dict[str, str], start: int,
                only: str | None = None) -> dict[str, np.ndarray]:
    """The tensors of a file that :func:`read_header` checked; every byte checked against ``data_sha256`` (or only
    the tensor ``only``, unchecked: the keys an index needs). Raises :class:`BadFile`."""
    try:
        with open(path, "rb") as f:
            if only is not None:
                a, b = header[only]["data_offsets"]
                f.seek(start + a)
                data, base = f.read(b - a), a
            else:
                f.seek(start)
                data, base = f.read(), 0
    except (OSError, KeyError) as e:
        raise BadFile(str(e)) from None
    if only is None and hashlib.sha256(data).hexdigest() != meta.get("data_sha256"):
        raise BadFile("its bytes do not match their sha256")
    out = {}
    for name in ([only] if only is not None else header):
        t = header[name]
        a, b = t["data_offsets"]
        out[name] = np.frombuffer(data, _DTYPES[t["dtype"]], (b - a) // np.dtype(_DTYPES[t["dtype"]]).itemsize,
                                  a - base).reshape(t["shape"])
    return out


# ---- the model's identity -----------------------------------------------------------------------------------------
def model_identity(name: str, path: str | Path) -> str:
    """The identity of a loaded model as JSON text: its served name, and per file (the file, or a folder's files
    other than hidden ones) the resolved path, size and ``st_mtime_ns``."""
    p = Path(path).expanduser().resolve()
    files = [p] if p.is_file() else sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith("."))
    stamps = []
    for f in files:
        r = f.resolve()
        st = r.stat()
        stamps.append([str(r), st.st_size, st.st_mtime_ns])
    return json.dumps({"name": name, "files": stamps}, separators=(",", ":"))


def model_key(name: str) -> str:
    """The first 16 hex digits of the sha256 of the served name: the file names' prefix."""
    return hashlib.sha256(name.encode()).hexdigest()[:16]


# ---- the folder ---------------------------------------------------------------------------------------------------
@dataclass
class Entry:
    """One saved prefix: its file, model key, cache keys and where it resumes (see :class:`Snapshot`)."""

    path: Path
    key: str
    model: str
    layout: str
    keys: np.ndarray
    nbytes: int
    last_used: float
    length: int
    resume_from: int
    resume_points: list[int]

    def restore_point(self, pos: int) -> int:
        return Snapshot(self.length, {}, self.resume_from, self.resume_points).restore_point(pos)


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class PromptDiskCache:
    """The prompt cache folder of one server (see the module docstring), shared by its models.

    Args:
        folder: where the files live (made if missing).
        max_bytes: the most bytes its files may take together; least recently used files go first.
        queue_size: snapshots waiting for the writer thread; more are dropped.

    Raises ``OSError`` when the folder cannot be made. Counters (``hits``, ``misses``, ``writes``, ``dropped``,
    ``deleted``) are for ``/status``.
    """

    def __init__(self, folder: str | Path, max_bytes: int, queue_size: int = QUEUE_SIZE):
        self.folder = Path(folder).expanduser()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.entries: dict[Path, Entry] = {}
        self.counts = {"hits": 0, "writes": 0, "dropped": 0, "deleted": 0}
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._scan()
        self._thread = threading.Thread(target=self._write_loop, name="mlx-engine-prompt-cache", daemon=True)
        self._thread.start()

    # ---- index -----------------------------------------------------------------------------------------------
    def _scan(self) -> None:
        for p in self.folder.iterdir():
            if p.name.startswith(_TMP):  # a write a crash cut short
                p.unlink(missing_ok=True)
            elif _NAME.match(p.name) and p.is_file():
                try:
                    self._index(p)
                except BadFile as e:
                    self._delete(p, f"unreadable ({e})")
        with self._lock:
            self._evict()

    def _index(self, path: Path) -> Entry:
        header, meta, start = read_header(path)
        if "keys" not in header or not path.name.startswith(meta.get("model_key", "?") + "-"):
            raise BadFile("no keys, or a name that is not its model's")
        try:
            keys = read_arrays(path, header, meta, start, only="keys")["keys"].astype(np.int64)
            entry = Entry(path, meta["model_key"], meta["model"], meta["cache"], keys, path.stat().st_size,
                          path.stat().st_mtime, int(meta["length"]), int(meta["resume_from"]),
                          [int(x) for x in json.loads(meta["resume_points"])])
        except (KeyError, ValueError, TypeError, OSError) as e:
            raise BadFile(f"metadata: {e}") from None
        if entry.length != len(keys):
            raise BadFile("its length is not its keys'")
        with self._lock:
            self.entries[path] = entry
        return entry

    def _delete(self, path: Path, why: str) -> None:
        log.info("prompt cache: deleting %s: %s", path.name, why)
        path.unlink(missing_ok=True)
        self.counts["deleted"] += 1
        with self._lock:
            self.entries.pop(path, None)

    def _evict(self) -> None:
        """Least recently used files out until the folder fits (lock held)."""
        total = sum(e.nbytes for e in self.entries.values())
        for e in sorted(self.entries.values(), key=lambda e: e.last_used):
            if total <= self.max_bytes:
                break
            e.path.unlink(missing_ok=True)
            self.entries.pop(e.path, None)
            self.counts["deleted"] += 1
            total -= e.nbytes

    def stats(self) -> dict[str, int]:
        """Entries, bytes, the size limit and the counters."""
        with self._lock:
            return {"entries": len(self.entries), "bytes": sum(e.nbytes for e in self.entries.values()),
                    "max_bytes": self.max_bytes, **self.counts}

    def for_model(self, name: str, path: str | Path, cache: Any) -> "ModelPromptCache | None":
        """The view of the model served as ``name`` from ``path`` whose KV cache is ``cache`` (None for a cache that
        has no snapshot). Deletes the files saved under this name by other weights or another cache layout."""
        layout = describe(cache)
        if layout is None:
            log.info("prompt cache: %s's KV cache cannot be saved (cross-attention); not cached on disk", name)
            return None
        try:
            identity = model_identity(name, path)
        except OSError as e:
            log.warning("prompt cache: %s's files cannot be read (%s); not cached on disk", name, e)
            return None
        view = ModelPromptCache(self, model_key(name), identity, json.dumps(layout, sort_keys=True,
                                                                             separators=(",", ":")))
        with self._lock:
            mine = [e for e in self.entries.values() if e.key == view.key]
        for e in mine:
            if e.model != view.model or e.layout != view.layout:
                self._delete(e.path, "saved by other weights or another cache layout")
        return view

    # ---- writer --------------------------------------------------------------------------------------------------
    def offer(self, job: tuple) -> bool:
        """Queue ``(view, keys, snapshot)`` for the writer; False (dropped) when the queue is full."""
        try:
            self._queue.put_nowait(job)
            return True
        except queue.Full:
            self.counts["dropped"] += 1
            return False

    def room(self) -> bool:
        return not self._queue.full()

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._write(*job)
            except Exception:  # noqa: BLE001 -- a failed write (disk full, say) must not stop the writer
                log.exception("prompt cache: a write failed")
            finally:
                self._queue.task_done()

    def _write(self, view: "ModelPromptCache", keys: np.ndarray, snap: Snapshot) -> None:
        path = self.folder / f"{view.key}-{hashlib.sha256(keys.tobytes()).hexdigest()[:32]}.safetensors"
        meta = {"format": FORMAT, "version": VERSION, "model_key": view.key, "model": view.model,
                "cache": view.layout, "length": str(snap.length), "resume_from": str(snap.resume_from),
                "resume_points": json.dumps(snap.resume_points)}
        nbytes = write_file(path, {"keys": keys, **snap.arrays}, meta)
        new = Entry(path, view.key, view.model, view.layout, keys, nbytes, time.time(), snap.length,
                    snap.resume_from, list(snap.resume_points))
        with self._lock:
            self.entries[path] = new
            self.counts["writes"] += 1
            for e in list(self.entries.values()):  # shorter prefixes this one resumes wherever they did
                if (e is not new and e.key == new.key and e.model == new.model and e.layout == new.layout
                        and e.length < new.length and _common(e.keys, keys) == e.length
                        and new.resume_from <= e.resume_from
                        and all(new.restore_point(q) == q for q in e.resume_points)):
                    e.path.unlink(missing_ok=True)
                    self.entries.pop(e.path, None)
                    self.counts["deleted"] += 1
            self._evict()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait (at most ``timeout`` seconds) until every queued snapshot is written; whether they all were."""
        end = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < end:
            time.sleep(0.01)
        return not self._queue.unfinished_tasks

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (at most ``timeout`` seconds), then stop the writer."""
        self.flush(timeout)
        try:
            self._queue.put(None, timeout=1.0)
        except queue.Full:
            return
        self._thread.join(timeout=1.0)


class ModelPromptCache:
    """One model's view of a :class:`PromptDiskCache`: finds, loads and saves its prefixes."""

    def __init__(self, disk: PromptDiskCache, key: str, model: str, layout: str):
        self.disk, self.key, self.model, self.layout = disk, key, model, layout

    def find(self, keys: Any, have: int) -> "tuple[Entry, int] | None":
        """The saved prefix of ``keys`` (a prompt's cache keys) that resumes furthest, and where (at most
        ``len(keys) - 1``: one token must run); None when none resumes beyond ``have`` tokens."""
        keys = np.asarray(keys, np.int64)
        best = None
        with self.disk._lock:
            mine = [e for e in self.disk.entries.values()
                    if e.key == self.key and e.model == self.model and e.layout == self.layout]
        for e in mine:
            r = e.restore_point(min(_common(e.keys, keys), len(keys) - 1))
            if r > have and (best is None or r > best[1]):
                best = (e, r)
        return best

    def load(self, entry: Entry) -> Snapshot | None:
        """The snapshot of ``entry``, every byte checked; a file that fails is deleted (None)."""
        try:
            header, meta, start = read_header(entry.path)
            if meta.get("model") != self.model or meta.get("cache") != self.layout:
                raise BadFile("saved by other weights or another cache layout")
            arrays = read_arrays(entry.path, header, meta, start)
        except BadFile as e:
            self.disk._delete(entry.path, str(e))
            return None
        keys = arrays.pop("keys")
        if not np.array_equal(keys, entry.keys):
            self.disk._delete(entry.path, "its keys changed since it was indexed")
            return None
        now = time.time()
        entry.last_used = now
        try:
            os.utime(entry.path, (now, now))  # the recency survives a restart
        except OSError:
            pass
        self.disk.counts["hits"] += 1
        return Snapshot(entry.length, arrays, entry.resume_from, entry.resume_points)

    def room(self) -> bool:
        """Whether a snapshot offered now would be queued (take none otherwise: the copy would be wasted)."""
        return self.disk.room()

    def save(self, keys: Any, snap: Snapshot) -> bool:
        """Queue ``snap`` of the prompt ``keys`` for writing; False when it was dropped (the queue is full)."""
        return self.disk.offer((self, np.asarray(keys, np.int64), snap))

    # ---- the device thread's side -----------------------------------------------------------------------------
    def restore(self, runner: Any, seq: int, entry: Entry) -> int:
        """Put ``entry`` into ``seq`` of ``runner`` (emptied first); the tokens restored (0 when the file failed
        its checks, deleted then, or did not fit the cache: ``seq`` is left empty)."""
        snap = self.load(entry)
        if snap is None:
            return 0
        runner.reset(seq)
        ctx = runner.backend.new_context()
        try:
            import_sequence(ctx, runner.cache, seq, snap)
        except Exception as e:  # noqa: BLE001 -- a file that does not fit is deleted; the prompt is prefilled
            runner.cache.remove(seq, 0, None)
            if not isinstance(e, CacheFullError):
                self.disk._delete(entry.path, f"it does not fit the cache ({e})")
            return 0
        finally:
            ctx.close()
        runner.adopt(seq, entry.keys[:snap.length])
        return snap.length

    def save_sequence(self, runner: Any, seq: int) -> bool:
        """Copy what ``runner``'s cache holds for ``seq`` to the host and queue it for writing (nothing when the
        queue is full or the sequence holds nothing a snapshot can keep); whether it was queued."""
        keys = runner.cached_tokens(seq)
        if not keys or not self.room():
            return False
        snap = export_sequence(runner.cache, seq)
        if snap is None or snap.length != len(keys):
            return False
        return self.save(keys, snap)
