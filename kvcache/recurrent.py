"""The recurrent cache of hybrid models (ollama's ``kvcache.Recurrent``): a causal KV cache for the attention layers,
and per sequence the state of the recurrent layers (short convolutions, linear attention, state-space blocks).

A recurrent layer does not keep one entry per past token: it folds every token into a fixed-size state. So:

- **Slots.** Each sequence's state lives in a *slot*, one tensor per ``(layer, name)`` (``"conv"``: the last
  ``kernel - 1`` inputs of a causal convolution, ``[conv_dim, conv_channels]``; ``"recurrent"``: the layer's own
  state, e.g. Gated DeltaNet's ``[heads, Dk, Dv]``). There are ``max_sequences`` slots.
- **Copy-on-write.** :meth:`copy_prefix` lets the new sequence share the source's slot (a reference count); the first
  forward pass (or roll-back) of either sequence gives it a slot of its own, copying the state. Tensors are immutable
  on the device, so the copy shares storage until a layer writes its new state.
- **Checkpoints.** A state cannot be rolled back token by token. At the end of a forward pass whose last position
  ``p`` is at least ``checkpoint_min_pos`` and ``checkpoint_interval`` past the slot's last checkpoint, or is on the
  grid ``checkpoint_min_pos + k * checkpoint_interval`` (where the runner ends prefill chunks), or when the runner
  asked for one with :meth:`request_checkpoint`, the cache keeps a copy of the state after token ``p``; at
  most ``checkpoint_count`` per slot, the oldest dropped first. Defaults are the seed's: 24 checkpoints, the first
  at position 16, then every 1,664 tokens.
- **One step back.** The state before a slot's last forward pass is kept too (references, no copy), so a sequence
  can step back over its last token: a stop token that the chat template writes differently next turn.
- **Roll-back** (:meth:`remove` of ``begin .. end``) is possible only to a position with a checkpoint right before it
  (``begin - 1``), to the start (``begin = 0``: drop the sequence), one step back, or to where the sequence is; anything else
  is refused with :class:`CacheError` and the cache is unchanged. :meth:`restore_point` tells the runner the nearest
  position at or before a wanted one that it can roll back to; it then prefills from there.
- **Batches.** The recurrent layers run ``[S, L, D]``: each sequence of the batch must hold the same number ``L`` of
  consecutive tokens, contiguous in the batch, continuing its state (:meth:`is_supported_for_batch`). Prefill chunks
  (one sequence) and decode steps (one token per sequence) always are.

Memory is bounded by the configuration, however long a sequence runs: ``max_sequences`` slots, each holding its
state, the state one step back and at most ``checkpoint_count`` checkpoints, each ``sum(state sizes)``, besides the
KV cache of the attention layers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from mlx_engine.batch import Batch
from mlx_engine.errors import CacheError, CacheFullError
from mlx_engine.kvcache.base import Cache, Checkpoints, LayerShape, ShiftFn
from mlx_engine.kvcache.causal import CausalCache
from mlx_engine.ml import Backend, CacheConfig, Context, DType, Tensor

CHECKPOINT_COUNT = 24
CHECKPOINT_MIN_POS = 16
CHECKPOINT_INTERVAL = 1664

StateKey = tuple[int, str]  # (layer, name)


@dataclass
class Checkpoint:
    """The recurrent state of a slot after the token at ``pos``: one tensor ``[1, *shape]`` per ``(layer, name)``."""

    pos: int
    states: dict[StateKey, Tensor] = field(default_factory=dict)


class RecurrentCache(Cache, Checkpoints):
    """A causal KV cache for attention layers plus per-sequence recurrent state (see the module docstring).

    Args:
        kv: the cache of the attention layers (default: a :class:`CausalCache` with ``shift_fn`` and ``kv_bits``).
        checkpoint_count: checkpoints kept per slot (0: none, so nothing can be rolled back but to the start).
        checkpoint_min_pos: no checkpoint before this position.
        checkpoint_interval: positions between two checkpoints of a slot.
        state_dtype: the dtype the states are stored in (float32, as the seed: a recurrent state accumulates).

    The model drives the recurrent layers with :meth:`get_state` / :meth:`set_state` between :meth:`start_forward`
    and the end of the forward pass, and the attention layers with ``set_layer`` / ``put`` / ``get`` as usual.
    """

    def __init__(self, kv: Optional[Cache] = None, *, shift_fn: Optional[ShiftFn] = None,
                 kv_bits: Optional[int] = None, checkpoint_count: int = CHECKPOINT_COUNT,
                 checkpoint_min_pos: int = CHECKPOINT_MIN_POS, checkpoint_interval: int = CHECKPOINT_INTERVAL,
                 state_dtype: DType = DType.FLOAT32):
        if checkpoint_count < 0 or checkpoint_min_pos < 0 or checkpoint_interval < 1:
            raise ValueError("checkpoint_count and checkpoint_min_pos must be >= 0 and checkpoint_interval >= 1")
        self.kv = kv if kv is not None else CausalCache(shift_fn=shift_fn, kv_bits=kv_bits)
        self.checkpoint_count = checkpoint_count
        self.checkpoint_min_pos = checkpoint_min_pos
        self.checkpoint_interval = checkpoint_interval
        self.state_dtype = state_dtype
        self.keeps_checkpoints = checkpoint_count > 0
        self._ready = False

    # ---- set-up --------------------------------------------------------------------------------------------------
    def init(self, backend: Backend, dtype: DType, max_sequences: int, capacity: int, max_batch: int) -> None:
        self.kv.init(backend, dtype, max_sequences, capacity, max_batch)
        self.max_sequences = max_sequences
        self._slot_of: dict[int, int] = {}          # sequence -> slot
        self._refs = [0] * max_sequences            # sequences per slot
        self._free = list(range(max_sequences - 1, -1, -1))
        self._states: list[dict[StateKey, Tensor]] = [{} for _ in range(max_sequences)]
        self._length = [0] * max_sequences          # tokens folded into each slot's state
        self._checkpoints: list[list[Checkpoint]] = [[] for _ in range(max_sequences)]
        self._previous: list[Optional[Checkpoint]] = [None] * max_sequences  # the state before the last forward
        self._keys: set[StateKey] = set()           # every state the model has written: a checkpoint needs them all
        self._broken: set[int] = set()              # sequences that hold KV entries but no state to continue from
        self._forced: set[int] = set()
        self._cur: list[tuple[int, int, Optional[Checkpoint]]] = []  # (sequence, slot, checkpoint to fill)
        self._layout = (0, 0)
        self._reserve = False
        self._ready = True

    def set_config(self, config: CacheConfig) -> None:
        self.kv.set_config(config)

    def close(self) -> None:
        self.kv.close()
        self._ready = False

    def _check(self) -> None:
        if not self._ready:
            raise CacheError("the recurrent cache is used before init() or after close()")

    # ---- attention layers ----------------------------------------------------------------------------------------
    def set_layer(self, layer: int) -> None:
        self.kv.set_layer(layer)

    def set_causal(self, ctx: Context, both_ways: Sequence[tuple[int, int]], window_both_ways: bool = False) -> None:
        self.kv.set_causal(ctx, both_ways, window_both_ways)

    def put(self, ctx: Context, key: Tensor, value: Tensor) -> None:
        self.kv.put(ctx, key, value)

    def get(self, ctx: Context) -> tuple[Tensor, Tensor, Optional[Tensor]]:
        return self.kv.get(ctx)

    def reserve(self, ctx: Context, layer_shapes: Sequence[LayerShape]) -> None:
        self.kv.reserve(ctx, layer_shapes)

    # ---- batches -------------------------------------------------------------------------------------------------
    def _batch_layout(self, batch: Batch) -> tuple[list[int], list[int], int]:
        """``(sequences, first positions, L)`` of a batch the recurrent layers can run; CacheError otherwise."""
        seqs, pos = batch.sequences, batch.positions
        n = len(seqs)
        starts = np.flatnonzero(np.r_[True, seqs[1:] != seqs[:-1]]) if n else np.zeros(0, np.int64)
        order = [int(seqs[i]) for i in starts]
        if n == 0:
            return [], [], 0
        length = n // len(order)
        if len(set(order)) != len(order) or length * len(order) != n or np.any(np.diff(starts) != length):
            raise CacheError("a recurrent cache runs each sequence of a batch as one run of consecutive tokens, the "
                             "same number for every sequence; this batch mixes them (run the sequences apart)")
        runs = pos.reshape(len(order), length)
        if np.any(np.diff(runs, axis=1) != 1):
            raise CacheError("a recurrent cache needs consecutive positions within each sequence of a batch")
        return order, [int(p) for p in runs[:, 0]], length

    def is_supported_for_batch(self, batch: Batch) -> bool:
        """Whether the recurrent layers can run ``batch`` (see the module docstring)."""
        try:
            self._batch_layout(batch)
        except CacheError:
            return False
        return True

    @property
    def layout(self) -> tuple[int, int]:
        """``(S, L)`` of the current forward pass: the recurrent layers see hidden states ``[S, L, D]``, sequence
        ``i`` of :attr:`sequences` in row ``i``."""
        return self._layout

    @property
    def sequences(self) -> list[int]:
        """The sequences of the current forward pass, in the order of the rows of :attr:`layout`."""
        return [s for s, _, _ in self._cur]

    def start_forward(self, ctx: Context, batch: Batch, reserve: bool = False) -> None:
        self.prepare_forward(ctx, batch, reserve)()

    def prepare_forward(self, ctx: Context, batch: Batch, reserve: bool = False) -> Callable[[], None]:
        self._check()
        order, firsts, length = self._batch_layout(batch)
        if not reserve:
            new, refs = 0, list(self._refs)
            for s, p in zip(order, firsts):
                if not 0 <= s < self.max_sequences:
                    raise CacheError(f"sequence {s} out of range: the cache holds {self.max_sequences}")
                if s in self._broken:
                    raise CacheError(f"sequence {s} shares keys with another sequence but no recurrent state to "
                                     "continue from; remove it (remove(seq, 0, None)) and prefill it again")
                slot = self._slot_of.get(s)
                have = self._length[slot] if slot is not None else 0
                if p != have:
                    raise CacheError(f"the recurrent state of sequence {s} is after {have} tokens, but the batch "
                                     f"continues it at position {p}; a recurrent state cannot skip or repeat tokens")
                if slot is None or refs[slot] > 1:  # as _writable_slot will: the last sharer keeps the slot
                    new += 1
                    if slot is not None:
                        refs[slot] -= 1
            if new > len(self._free):
                raise CacheFullError(f"no free recurrent-state slot: the cache holds {self.max_sequences} sequences")
        commit_kv = self.kv.prepare_forward(ctx, batch, reserve)

        def commit() -> None:
            commit_kv()
            self._reserve = reserve
            self._layout = (len(order), length)
            self._cur = []
            for s, p in zip(order, firsts):
                if reserve:
                    self._cur.append((s, -1, None))
                    continue
                slot = self._writable_slot(s)
                self._previous[slot] = Checkpoint(p - 1, dict(self._states[slot])) if p > 0 else None
                last = p + length - 1
                self._length[slot] = last + 1
                self._cur.append((s, slot, self._plan_checkpoint(s, slot, last)))
        return commit

    def _writable_slot(self, seq: int) -> int:
        """The slot of ``seq``, its own: a new one for a new sequence, a copy for one that shares (copy-on-write)."""
        slot = self._slot_of.get(seq)
        if slot is not None and self._refs[slot] == 1:
            return slot
        new = self._free.pop()
        self._refs[new] = 1
        if slot is None:
            self._states[new], self._checkpoints[new], self._length[new], self._previous[new] = {}, [], 0, None
        else:
            self._refs[slot] -= 1
            self._states[new] = dict(self._states[slot])
            self._checkpoints[new] = list(self._checkpoints[slot])
            self._length[new] = self._length[slot]
            self._previous[new] = self._previous[slot]
        self._slot_of[seq] = new
        return new

    def _plan_checkpoint(self, seq: int, slot: int, last: int) -> Optional[Checkpoint]:
        forced = seq in self._forced
        self._forced.discard(seq)
        if self.checkpoint_count == 0:
            return None
        cps = self._checkpoints[slot]
        previous = max((c.pos for c in cps), default=-1)
        due = last >= self.checkpoint_min_pos and (previous < 0 or last - previous >= self.checkpoint_interval)
        if not (forced or due or last in self.checkpoint_grid(last, last + 1)):
            return None
        if len(cps) >= self.checkpoint_count:
            cps.remove(min(cps, key=lambda c: c.pos))
        cp = Checkpoint(last)
        cps.append(cp)
        return cp

    def checkpoint_grid(self, start: int, end: int) -> list[int]:
        """The positions in ``start .. end - 1`` of the checkpoint grid (``checkpoint_min_pos``, then every
        ``checkpoint_interval``): a forward pass whose last token is on it keeps a checkpoint, so the runner ends
        prefill chunks there and sequences that share a prefix find checkpoints at the same places."""
        if self.checkpoint_count == 0:
            return []
        lo, step = self.checkpoint_min_pos, self.checkpoint_interval
        first = lo if start <= lo else lo + -(-(start - lo) // step) * step
        return list(range(first, end, step))

    def request_checkpoint(self, seq: int) -> None:
        """Keep a checkpoint after the next forward pass of ``seq``, whatever the interval (the runner asks for one
        before the last token of a prompt, so that the same prompt can be answered again without a prefill)."""
        self._forced.add(seq)

    # ---- recurrent layers ----------------------------------------------------------------------------------------
    def get_state(self, ctx: Context, layer: int, name: str, shape: Sequence[int]) -> Tensor:
        """The state ``name`` of ``layer`` for the sequences of the current forward pass: ``[S, *shape]`` in
        :attr:`state_dtype`, zeros for a sequence that has none yet."""
        rows = []
        for _, slot, _ in self._cur:
            t = self._states[slot].get((layer, name)) if slot >= 0 else None
            if t is not None and tuple(t.shape[1:]) != tuple(shape):
                raise ValueError(f"layer {layer}'s {name} state has shape {tuple(t.shape[1:])}, asked {tuple(shape)}")
            rows.append(t if t is not None else ctx.zeros([1, *shape], self.state_dtype))
        return rows[0] if len(rows) == 1 else ctx.concatenate(rows, axis=0)

    def set_state(self, ctx: Context, layer: int, name: str, value: Tensor) -> None:
        """Store the new state ``name`` of ``layer``, ``value [S, *shape]`` (row ``i``: sequence ``i`` of the
        forward pass), and keep it in the checkpoint planned for this pass, if any. The rows are copied into storage
        of their own, so a state taken as a slice of a larger tensor does not hold that tensor's memory."""
        if self._reserve:
            return
        if value.dtype != self.state_dtype:
            value = value.astype(self.state_dtype)
        key = (layer, name)
        self._keys.add(key)
        single = len(self._cur) == 1
        for i, (_, slot, cp) in enumerate(self._cur):
            row = (value if single else value[i:i + 1]).copy()
            self._states[slot][key] = row
            if cp is not None:
                cp.states[key] = row

    def state_tensors(self) -> list[Tensor]:
        """The states written by the current forward pass (to evaluate them with its logits)."""
        out = []
        for _, slot, _ in self._cur:
            if slot >= 0:
                out.extend(self._states[slot].values())
        return out

    # ---- sequences -----------------------------------------------------------------------------------------------
    def _checkpoint_at(self, slot: int, pos: int) -> Optional[Checkpoint]:
        """The complete checkpoint of ``slot`` after token ``pos`` (or the state before its last forward pass, kept
        so that a sequence can step back over its last token: a stop token the chat template writes otherwise),
        or None."""
        prev = self._previous[slot]
        for cp in self._checkpoints[slot] + ([prev] if prev is not None else []):
            if cp.pos == pos and self._keys <= cp.states.keys():
                return cp
        return None

    def checkpoints(self, seq: int) -> list[int]:
        """Positions (the last token included) of the complete checkpoints of ``seq``, ascending."""
        slot = self._slot_of.get(seq)
        if slot is None:
            return []
        return sorted(cp.pos for cp in self._checkpoints[slot] if self._keys <= cp.states.keys())

    def read_state(self, seq: int, layer: int, name: str) -> Optional[Tensor]:
        """The state ``name`` of ``layer`` that ``seq`` would continue from (``[1, *shape]``), or None before its
        first forward pass; for inspection."""
        slot = self._slot_of.get(seq)
        return self._states[slot].get((layer, name)) if slot is not None else None

    def length(self, seq: int) -> int:
        """Tokens folded into the recurrent state of ``seq``."""
        slot = self._slot_of.get(seq)
        return self._length[slot] if slot is not None else 0

    def can_resume(self, seq: int, pos: int) -> bool:
        self._check()
        if pos == 0:
            return True
        if seq in self._broken or not self.kv.can_resume(seq, pos):
            return False
        slot = self._slot_of.get(seq)
        if slot is None:
            return False
        return pos == self._length[slot] or self._checkpoint_at(slot, pos - 1) is not None

    def restore_point(self, seq: int, pos: int) -> int:
        """The largest position ``r <= pos`` that ``seq`` can resume at: where it is, one past a checkpoint, or 0."""
        self._check()
        if self.can_resume(seq, pos):
            return pos
        slot = self._slot_of.get(seq)
        prev = self._previous[slot] if slot is not None else None
        for cp in sorted(self.checkpoints(seq) + ([prev.pos] if prev is not None else []), reverse=True):
            if cp + 1 <= pos and self.can_resume(seq, cp + 1):
                return cp + 1
        return 0

    def copy_prefix(self, src_seq: int, dst_seq: int, length: int) -> None:
        """``dst_seq`` shares the first ``length`` positions of ``src_seq``: the attention layers' cells, and the
        slot of the recurrent state when ``length`` is where ``src_seq`` is; at a checkpoint (``length - 1``) it gets
        a slot of its own restored from it; anywhere else it gets no state, and only ``remove(dst_seq, 0, None)``
        is possible (:meth:`can_resume` says False): ask :meth:`restore_point` first."""
        self._check()
        self._drop(dst_seq)
        self.kv.copy_prefix(src_seq, dst_seq, length)
        src = self._slot_of.get(src_seq)
        if length == 0:
            return
        if src is None or src_seq in self._broken:
            self._broken.add(dst_seq)
            return
        if length == self._length[src]:
            self._slot_of[dst_seq] = src
            self._refs[src] += 1
            return
        cp = self._checkpoint_at(src, length - 1)
        if cp is None or not self._free:
            self._broken.add(dst_seq)
            return
        slot = self._free.pop()
        self._refs[slot] = 1
        self._slot_of[dst_seq] = slot
        self._restore(slot, cp, self._checkpoints[src])

    def _restore(self, slot: int, cp: Checkpoint, checkpoints: list[Checkpoint]) -> None:
        self._previous[slot] = None
        self._states[slot] = dict(cp.states)
        self._length[slot] = cp.pos + 1
        self._checkpoints[slot] = [c for c in checkpoints if c.pos <= cp.pos]

    def _drop(self, seq: int) -> None:
        self._broken.discard(seq)
        self._forced.discard(seq)
        slot = self._slot_of.pop(seq, None)
        if slot is not None:
            self._refs[slot] -= 1
            if self._refs[slot] == 0:
                self._states[slot], self._checkpoints[slot], self._length[slot] = {}, [], 0
                self._previous[slot] = None
                self._free.append(slot)

    def remove(self, seq: int, begin: int, end: Optional[int]) -> None:
        self.prepare_remove(seq, begin, end)()

    def prepare_remove(self, seq: int, begin: int, end: Optional[int]) -> Callable[[], None]:
        """Roll ``seq`` back to ``begin`` (``end`` None, or the sequence's length): to 0, to where it is, or to one
        past a checkpoint. Raises ``CacheError`` (the cache unchanged) for any other position or a range in the
        middle, which a recurrent state cannot forget."""
        self._check()
        if begin == 0 and end is None:
            commit_kv = self.kv.prepare_remove(seq, 0, None)

            def drop_all() -> None:
                commit_kv()
                self._drop(seq)
            return drop_all
        slot = self._slot_of.get(seq)
        have = self._length[slot] if slot is not None else 0
        if end is not None and end < have and end > begin:
            raise CacheError(f"cannot remove positions {begin}..{end - 1} from the middle of sequence {seq}: a "
                             "recurrent state cannot forget tokens; remove to the end instead")
        if begin >= have:
            return self.kv.prepare_remove(seq, begin, end)
        cp = self._checkpoint_at(slot, begin - 1) if slot is not None and seq not in self._broken else None
        if cp is None:
            at = ", ".join(str(p + 1) for p in self.checkpoints(seq)) or "none"
            raise CacheError(f"sequence {seq} cannot be rolled back to position {begin}: its recurrent state can "
                             f"only go back to 0 or to just after a checkpoint (positions {at}); use restore_point()")
        commit_kv = self.kv.prepare_remove(seq, begin, end)

        def commit() -> None:
            commit_kv()
            own = slot
            if self._refs[slot] > 1:  # copy-on-write: the others keep the state as it is
                self._refs[slot] -= 1
                own = self._free.pop()
                self._refs[own] = 1
                self._slot_of[seq] = own
            self._restore(own, cp, self._checkpoints[slot])
        return commit

    # ---- memory --------------------------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Device bytes of the KV cache plus every distinct state tensor held by a slot or a checkpoint."""
        seen: dict[int, int] = {}
        for slot in set(self._slot_of.values()):
            for t in self._states[slot].values():
                seen[id(t)] = t.nbytes
            for cp in self._checkpoints[slot] + [self._previous[slot] or Checkpoint(-1)]:
                for t in cp.states.values():
                    seen[id(t)] = t.nbytes
        return self.kv.nbytes() + sum(seen.values())

    def slots_in_use(self) -> int:
        """Slots owned by at least one sequence."""
        return self.max_sequences - len(self._free)

    def cells_in_use(self) -> int:
        return self.kv.cells_in_use()

    def cells_below(self, lengths) -> int:
        """Cells of the attention part (see :meth:`CausalCache.cells_below`)."""
        return self.kv.cells_below(lengths)
