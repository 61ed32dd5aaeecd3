"""A sequence's cached state as host arrays, and back: what the server's prompt cache on disk saves and restores.

:func:`export_sequence` copies what a cache holds for one sequence into NumPy arrays (a :class:`Snapshot`);
:func:`import_sequence` puts such a snapshot into an empty sequence of a cache of the same layout (:func:`describe`),
where the sequence then continues exactly as the one it was taken from: the same cells' bits, the same recurrent
state. As mlx-lm's ``save_prompt_cache`` / ``load_prompt_cache`` (``mlx_lm/models/cache.py``: each cache's ``state``
arrays, the cache classes in the metadata) and llama.cpp's ``llama_state_seq_save_file`` (one sequence's cells).

What a snapshot holds, by cache kind:

- :class:`CausalCache` (plain, sliding window, chunked): the cells the sequence owns, in position order: per layer
  the stored parts (float or 16-bit keys and values; a quantized cache's packed words, scales and biases, bit for
  bit), ``[H_kv, n, d]`` each, and the positions. A sliding window holds only its last ``memory`` positions, so a
  restored sequence resumes only where the window still has everything the next token sees
  (:attr:`Snapshot.resume_from`: the lowest held position plus the window); a chunked cache from the start of its
  last chunk; a plain causal cache anywhere.
- :class:`WrapperCache`: each of its caches' snapshots (resumable where all of them are).
- :class:`RecurrentCache`: the attention layers' cells, the recurrent state after the sequence's last token and its
  complete checkpoints (and the state one step back): it resumes at its end or just after a checkpoint
  (:attr:`Snapshot.resume_points`), never in between (a recurrent state cannot forget tokens).
- Any other cache (:class:`EncoderCache`'s cross-attention) has no snapshot: :func:`describe` gives None.

bfloat16 parts are widened to float32 by ``Tensor.numpy`` (exact) and narrowed back on import (exact).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from mlx_engine.batch import Batch
from mlx_engine.errors import CacheError
from mlx_engine.kvcache.base import Cache
from mlx_engine.kvcache.causal import CausalCache
from mlx_engine.kvcache.recurrent import Checkpoint, RecurrentCache
from mlx_engine.kvcache.wrapper import WrapperCache
from mlx_engine.ml import Context, DType

# This module reads the bookkeeping of the caches it snapshots (cells, owners, slots): it belongs to their package.


@dataclass
class Snapshot:
    """One sequence's cached state on the host.

    Attributes:
        length: tokens the sequence holds (its next token goes at this position).
        arrays: name -> array (see the module docstring; the names are this module's business).
        resume_from: the sequence can continue at any position ``p`` with ``resume_from <= p <= length``.
        resume_points: further positions below ``resume_from`` where it can continue (a recurrent state's
            checkpoints, each ``checkpoint position + 1``), ascending.
    """

    length: int
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    resume_from: int = 0
    resume_points: list[int] = field(default_factory=list)

    def restore_point(self, pos: int) -> int:
        """The largest position ``r <= pos`` at which the restored sequence can continue (0: nowhere but the
        start), as :meth:`Cache.restore_point` will answer after :func:`import_sequence`."""
        pos = min(pos, self.length)
        if pos >= self.resume_from:
            return pos
        return max([p for p in self.resume_points if p <= pos], default=0)


def describe(cache: Cache) -> Optional[dict[str, Any]]:
    """The layout of ``cache`` as JSON-able values: its kind, window / memory / chunk, ``kv_bits`` and group size,
    compute and storage dtypes, a recurrent cache's state dtype and checkpoint plan. Two caches with equal
    descriptions take each other's snapshots. None for a cache that has no snapshot (see the module docstring)."""
    if isinstance(cache, WrapperCache):
        parts = [describe(c) for c in cache.caches]
        return None if any(p is None for p in parts) else {"kind": "wrapper", "caches": parts}
    if isinstance(cache, RecurrentCache):
        kv = describe(cache.kv)
        return None if kv is None else {
            "kind": "recurrent", "kv": kv, "state_dtype": cache.state_dtype.value,
            "checkpoints": [cache.checkpoint_count, cache.checkpoint_min_pos, cache.checkpoint_interval]}
    if isinstance(cache, CausalCache):
        return {"kind": "causal", "window": cache.window, "memory": cache.memory, "chunk": cache.chunk,
                "kv_bits": cache.kv_bits, "kv_group_size": cache.kv_group_size, "dtype": cache.dtype.value,
                "store_dtype": cache.store_dtype.value}
    return None


def export_sequence(cache: Cache, seq: int) -> Optional[Snapshot]:
    """What ``cache`` holds for ``seq`` as host arrays (the device work: one gather of its cells per stored tensor,
    then the copy out). None when the sequence holds nothing or cannot be continued (a recurrent sequence with no
    state of its own to continue from), or for a cache :func:`describe` does not know."""
    if describe(cache) is None:
        return None
    snap = _export(cache, seq, "")
    return snap if snap is not None and snap.length > 0 else None


def import_sequence(ctx: Context, cache: Cache, seq: int, snap: Snapshot) -> None:
    """Put ``snap`` (taken from a cache whose :func:`describe` equals this one's) into ``seq``, which must hold
    nothing. Runs in chunks of the cache's ``max_batch`` cells and evaluates what it wrote.

    Raises:
        CacheFullError: no room for the cells (the sequence may then hold part of them: ``remove(seq, 0, None)``).
        CacheError: ``seq`` is not empty, or the arrays do not fit this cache (a missing array, another shape).
    """
    _import(ctx, cache, seq, snap, "")


# ---- per kind ---------------------------------------------------------------------------------------------------
def _export(cache: Cache, seq: int, prefix: str) -> Optional[Snapshot]:
    if isinstance(cache, WrapperCache):
        parts = [_export(c, seq, f"{prefix}c{i}/") for i, c in enumerate(cache.caches)]
        if any(p is None for p in parts) or len({p.length for p in parts}) != 1:
            return None
        lo = max(p.resume_from for p in parts)
        points = sorted({q for p in parts for q in p.resume_points
                         if q < lo and all(o.restore_point(q) == q for o in parts)})
        return Snapshot(parts[0].length, {k: v for p in parts for k, v in p.arrays.items()}, lo, points)
    if isinstance(cache, RecurrentCache):
        return _export_recurrent(cache, seq, prefix)
    if isinstance(cache, CausalCache):
        return _export_causal(cache, seq, prefix)
    return None


def _import(ctx: Context, cache: Cache, seq: int, snap: Snapshot, prefix: str) -> None:
    if isinstance(cache, WrapperCache):
        for i, c in enumerate(cache.caches):
            _import(ctx, c, seq, snap, f"{prefix}c{i}/")
    elif isinstance(cache, RecurrentCache):
        _import_recurrent(ctx, cache, seq, snap, prefix)
    elif isinstance(cache, CausalCache):
        _import_causal(ctx, cache, seq, snap, prefix)
    else:
        raise CacheError(f"a {type(cache).__name__} takes no snapshot")


def _export_causal(cache: CausalCache, seq: int, prefix: str) -> Snapshot:
    h = cache._hi
    cells = np.flatnonzero(cache._owners[:h, seq])
    pos = cache._pos[cells]
    order = np.argsort(pos, kind="stable")
    cells, pos = cells[order], pos[order]
    length = int(pos[-1]) + 1 if len(pos) else 0
    arrays = {f"{prefix}positions": pos.astype(np.int64)}
    if len(cells):
        ctx = cache._backend.new_context()
        try:
            contiguous = int(cells[-1]) - int(cells[0]) == len(cells) - 1
            idx = None if contiguous else ctx.from_numpy(cells.astype(np.int32), DType.INT32)
            a, b = int(cells[0]), int(cells[-1]) + 1
            for layer, st in sorted(cache._kv.layers.items()):
                arrays[f"{prefix}{layer}/shape"] = np.asarray(st.shape, np.int64)
                for name, parts in (("k", st.k), ("v", st.v)):
                    for i, t in enumerate(parts):
                        rows = t[:, :, a:b, :] if idx is None else t.take(idx, axis=2)
                        arrays[f"{prefix}{layer}/{name}{i}"] = rows.numpy()[0]
        finally:
            ctx.close()
    return Snapshot(length, arrays, _resume_from(cache, seq, length))


def _resume_from(cache: Cache, seq: int, length: int) -> int:
    """The lowest ``p`` from which ``seq`` can continue at every position up to ``length`` (a window or a chunk
    needs the positions before ``p``; the held positions are one run, so the answer is monotonic in ``p``)."""
    if length == 0 or not cache.can_resume(seq, length):
        return length
    lo, hi = 0, length  # can_resume(hi) holds; find the least such
    while lo < hi:
        mid = (lo + hi) // 2
        if mid > 0 and cache.can_resume(seq, mid):
            hi = mid
        else:
            lo = mid + 1
    return lo if lo > 0 and cache.can_resume(seq, lo) else hi


def _import_causal(ctx: Context, cache: CausalCache, seq: int, snap: Snapshot, prefix: str) -> None:
    cache._check()
    cache._check_seq(seq)
    if cache._seq_count[seq]:
        raise CacheError(f"sequence {seq} is not empty; remove it before putting a snapshot in it")
    try:
        pos = np.asarray(snap.arrays[f"{prefix}positions"], np.int64)
        rest = [name[len(prefix):].split("/") for name in snap.arrays if name.startswith(prefix)]
        layers = {int(r[0]) for r in rest if len(r) == 2 and r[1] == "shape" and r[0].isdigit()}
        shapes = {layer: tuple(int(x) for x in snap.arrays[f"{prefix}{layer}/shape"]) for layer in layers}
    except (KeyError, ValueError, TypeError) as e:
        raise CacheError(f"the snapshot does not fit this cache: {e}") from None
    if len(pos) and (not layers or (cache._kv.layers and layers != set(cache._kv.layers))):
        raise CacheError(f"the snapshot holds layers {sorted(layers)}, this cache {sorted(cache._kv.layers)}")
    for a in range(0, len(pos), cache.max_batch):
        chunk = pos[a:a + cache.max_batch]
        n = len(chunk)
        cache.prepare_forward(ctx, Batch(np.zeros(n, np.int32), chunk, np.full(n, seq)))()
        fwd = cache._fwd
        written = []
        for layer in sorted(layers):
            st = cache._kv.layer(ctx, layer, shapes[layer], fwd.used, cache.num_cells, cache._config.step)
            for name, parts in (("k", st.k), ("v", st.v)):
                for i, t in enumerate(parts):
                    src = snap.arrays.get(f"{prefix}{layer}/{name}{i}")
                    if src is None or src.ndim != 3 or src.shape[1] != len(pos) or \
                            (src.shape[0], src.shape[2]) != (t.shape[1], t.shape[3]):
                        raise CacheError(f"the snapshot's layer {layer} ({name}{i}) does not fit this cache")
                    cache._write(fwd, t, ctx.from_numpy(src[None, :, a:a + n, :], t.dtype))
            written.extend(st.tensors())
        ctx.evaluate(*written)
    cache._fwd = None  # nothing of this import is a forward pass for put or get


def _export_recurrent(cache: RecurrentCache, seq: int, prefix: str) -> Optional[Snapshot]:
    slot = cache._slot_of.get(seq)
    if slot is None or seq in cache._broken:
        return None
    kv = _export(cache.kv, seq, prefix + "kv/")
    length = cache._length[slot]
    if kv is None or (kv.length not in (0, length)):
        return None
    arrays = dict(kv.arrays)
    for (layer, name), t in cache._states[slot].items():
        arrays[f"{prefix}state/{layer}/{name}"] = t.numpy()
    prev = cache._previous[slot]
    cps = [cp for cp in cache._checkpoints[slot] + ([prev] if prev is not None else [])
           if cache._keys <= cp.states.keys()]
    cps = list({cp.pos: cp for cp in sorted(cps, key=lambda c: c.pos)}.values())
    arrays[f"{prefix}checkpoints"] = np.asarray([cp.pos for cp in cps], np.int64)
    for j, cp in enumerate(cps):
        for (layer, name), t in cp.states.items():
            arrays[f"{prefix}cp{j}/{layer}/{name}"] = t.numpy()
    points = [cp.pos + 1 for cp in cps if cp.pos + 1 < length and kv.restore_point(cp.pos + 1) == cp.pos + 1]
    return Snapshot(length, arrays, length, points)


def _import_recurrent(ctx: Context, cache: RecurrentCache, seq: int, snap: Snapshot, prefix: str) -> None:
    cache._check()
    if seq in cache._slot_of:
        raise CacheError(f"sequence {seq} is not empty; remove it before putting a snapshot in it")
    _import(ctx, cache.kv, seq, snap, prefix + "kv/")

    def states(tag: str) -> dict:
        out = {}
        for name, arr in snap.arrays.items():
            if name.startswith(f"{prefix}{tag}/"):
                layer, key = name[len(prefix) + len(tag) + 1:].split("/", 1)
                out[(int(layer), key)] = ctx.from_numpy(arr, cache.state_dtype)
        return out
    now = states("state")
    if not now or not cache._free:
        raise CacheError("the snapshot holds no recurrent state" if not now else "no free recurrent-state slot")
    cps = [Checkpoint(int(p), states(f"cp{j}")) for j, p in enumerate(snap.arrays.get(f"{prefix}checkpoints", []))]
    slot = cache._free.pop()
    cache._refs[slot] = 1
    cache._slot_of[seq] = slot
    cache._states[slot], cache._length[slot], cache._previous[slot] = now, snap.length, None
    cache._checkpoints[slot] = cps[-cache.checkpoint_count:] if cache.checkpoint_count else []
    cache._keys |= set(now)
    ctx.evaluate(*now.values(), *(t for cp in cps for t in cp.states.values()))
