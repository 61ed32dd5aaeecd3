"""The encoder cache: keys and values of cross-attention over encoder outputs (ollama's ``EncoderCache``).

Cross-attention keys and values depend on an encoder input (an image), not on the decoder's positions. They are
computed once, when the input enters a sequence, and returned whole by every later ``get``. The seed's rule for
their lifetime: the cache remembers the position at which each input entered (the batch index the model gave it,
``batch.images``), and ``remove`` over that position drops it, so that a prompt that runs again from an earlier
position encodes it again.

Unlike the seed's (one sequence, one input), this cache holds several sequences, each with several inputs; which
input a token may see is the model's rule (Llama 3.2 Vision: the latest image, or run of adjacent images, at or
before the token), so ``get`` returns every stored row of the batch's sequences and :meth:`EncoderCache.encoder_inputs` says
whose rows they are; the model builds the mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from mlx_engine.kvcache.base import Cache, EncoderInputs
from mlx_engine.batch import Batch
from mlx_engine.errors import CacheError
from mlx_engine.ml import Backend, CacheConfig, Context, DType, Tensor


@dataclass
class EncoderInput:
    """One encoder input of a sequence: it entered at ``position`` and has ``rows`` keys per layer."""

    position: int
    rows: int
    keys: dict[int, Tensor] = field(default_factory=dict)    # layer -> [1, H_kv, rows, Dk]
    values: dict[int, Tensor] = field(default_factory=dict)  # layer -> [1, H_kv, rows, Dv]


class EncoderCache(Cache, EncoderInputs):
    """Position-independent storage of cross-attention keys and values, per sequence and encoder input.

    The life of an input: a batch whose ``images`` hold ``(index, rows [k, D])`` brings it into sequence
    ``batch.sequences[index]`` at ``batch.positions[index]``; in that forward pass the model ``put``s, for each layer,
    the keys ``[1, H_kv, S_new, Dk]`` and values ``[1, H_kv, S_new, Dv]`` of the batch's new inputs concatenated in the
    order of ``batch.images`` (``S_new`` = the sum of their ``k``; cast to the init dtype). ``get`` returns the keys
    and values of every input of the batch's sequences (each sequence's inputs by position, the sequences in
    increasing id), with mask ``None``; :meth:`encoder_inputs` lists ``(sequence, position, rows)`` in that order.
    """

    def __init__(self) -> None:
        self._backend: Optional[Backend] = None
        self._max_sequences = 0
        self._layer = 0
        self._inputs: dict[int, list[EncoderInput]] = {}
        self._new: list[tuple[int, EncoderInput]] = []    # the current batch's inputs: (sequence, input)
        self._seqs: list[int] = []                         # the current batch's sequences
        self._joined: dict[int, tuple[tuple, Tensor, Tensor]] = {}  # layer -> (what, keys, values) of the last get

    def init(self, backend: Backend, dtype: DType, max_sequences: int, capacity: int, max_batch: int) -> None:
        self._backend = backend
        self.dtype = dtype
        self._max_sequences = max_sequences
        self._inputs, self._new, self._seqs, self._joined = {}, [], [], {}

    def set_config(self, config: CacheConfig) -> None:
        """No layout to configure: the stored tensors are returned as they are."""

    def set_layer(self, layer: int) -> None:
        self._layer = layer

    def _check(self) -> None:
        if self._backend is None:
            raise CacheError("the encoder cache is not initialized (call init) or was closed")

    def start_forward(self, ctx: Context, batch: Batch, reserve: bool = False) -> None:
        self.prepare_forward(ctx, batch, reserve)()

    def prepare_forward(self, ctx: Context, batch: Batch, reserve: bool = False) -> Callable[[], None]:
        """Raises ``CacheError`` for a sequence id out of range, or an input at a position its sequence already holds
        one at (``remove`` it first). A reserve batch records nothing (and its ``put``s store nothing)."""
        self._check()
        seqs = sorted({int(s) for s in np.unique(batch.sequences)})
        bad = [s for s in seqs if not 0 <= s < self._max_sequences]
        if bad:
            raise CacheError(f"sequence {bad[0]} out of range: the cache holds {self._max_sequences} sequences")
        new: list[tuple[int, EncoderInput]] = []
        if not reserve:
            for index, rows in batch.images:
                seq, pos = int(batch.sequences[index]), int(batch.positions[index])
                if any(e.position == pos for e in self._inputs.get(seq, ())):
                    raise CacheError(f"sequence {seq} already holds an encoder input at position {pos}; remove it "
                                     "first")
                new.append((seq, EncoderInput(pos, int(rows.shape[0]))))

        def commit() -> None:
            self._new, self._seqs = new, seqs
            for seq, entry in new:
                self._inputs.setdefault(seq, []).append(entry)
                self._inputs[seq].sort(key=lambda e: e.position)
            if new:
                self._joined.clear()
        return commit

    def put(self, ctx: Context, key: Tensor, value: Tensor) -> None:
        """Store the current layer's keys ``[1, H_kv, S_new, Dk]`` and values ``[1, H_kv, S_new, Dv]`` of the batch's
        new inputs. Raises ``ValueError`` when ``S_new`` is not the sum of their rows; a batch without new inputs
        (or a reserve pass) stores nothing."""
        self._check()
        if key.ndim != 4 or value.ndim != 4 or key.shape[:3] != value.shape[:3]:
            raise ValueError(f"put expects key [1, H_kv, S, Dk] and value [1, H_kv, S, Dv], got {list(key.shape)} and "
                             f"{list(value.shape)}")
        if not self._new:
            return
        total = sum(e.rows for _, e in self._new)
        if key.shape[2] != total:
            raise ValueError(f"put got {key.shape[2]} rows of keys for the batch's encoder inputs of {total} rows")
        key, value = key.astype(self.dtype), value.astype(self.dtype)
        at = 0
        for _, entry in self._new:
            entry.keys[self._layer] = key[:, :, at:at + entry.rows].copy()
            entry.values[self._layer] = value[:, :, at:at + entry.rows].copy()
            at += entry.rows
        self._joined.pop(self._layer, None)

    def encoder_inputs(self) -> list[tuple[int, int, int]]:
        """``(sequence, position, rows)`` of every input :meth:`get` returns, in its order."""
        return [(s, e.position, e.rows) for s in self._seqs for e in self._inputs.get(s, ())]

    def get(self, ctx: Context) -> tuple[Tensor, Tensor, Optional[Tensor]]:
        """``(keys [1, H_kv, S, Dk], values [1, H_kv, S, Dv], None)``, ``S`` the rows of :meth:`encoder_inputs`. Raises
        ``CacheError`` when the batch's sequences hold no input, or the current layer none of theirs."""
        self._check()
        entries = [e for s in self._seqs for e in self._inputs.get(s, ())]
        if not entries:
            raise CacheError("the encoder cache holds no encoder input for the batch's sequences")
        if any(self._layer not in e.keys for e in entries):
            raise CacheError(f"the encoder cache holds nothing for layer {self._layer} (put first)")
        if len(entries) == 1:
            return entries[0].keys[self._layer], entries[0].values[self._layer], None
        what = tuple(id(e) for e in entries)
        joined = self._joined.get(self._layer)
        if joined is None or joined[0] != what:  # joined once, then reused until the inputs change
            joined = (what, ctx.concatenate([e.keys[self._layer] for e in entries], axis=2),
                      ctx.concatenate([e.values[self._layer] for e in entries], axis=2))
            self._joined[self._layer] = joined
        return joined[1], joined[2], None

    def copy_prefix(self, src_seq: int, dst_seq: int, length: int) -> None:
        """``dst_seq`` holds the inputs of ``src_seq`` that entered before ``length`` (sharing their tensors)."""
        self._check()
        self._inputs[dst_seq] = [EncoderInput(e.position, e.rows, dict(e.keys), dict(e.values))
                                 for e in self._inputs.get(src_seq, ()) if e.position < length]
        self._joined.clear()

    def can_resume(self, seq: int, pos: int) -> bool:
        """Always True: a removed input is simply encoded again when its position runs again."""
        return True

    def remove(self, seq: int, begin: int, end: Optional[int]) -> None:
        self.prepare_remove(seq, begin, end)()

    def prepare_remove(self, seq: int, begin: int, end: Optional[int]) -> Callable[[], None]:
        """Drop the inputs of ``seq`` that entered at a position in ``begin .. end - 1``; later ones move down by
        ``end - begin`` with the positions of the sequence."""
        self._check()

        def commit() -> None:
            kept = []
            for e in self._inputs.get(seq, ()):
                if e.position < begin:
                    kept.append(e)
                elif end is not None and e.position >= end:
                    e.position -= end - begin
                    kept.append(e)
            self._inputs[seq] = kept
            self._joined.clear()
        return commit

    def close(self) -> None:
        self._inputs, self._new, self._joined = {}, [], {}
        self._backend = None

    def nbytes(self) -> int:
        seen: dict[int, int] = {}
        for entries in self._inputs.values():
            for e in entries:
                for t in (*e.keys.values(), *e.values.values()):
                    seen[id(t)] = t.nbytes
        return sum(seen.values())
