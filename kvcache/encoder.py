"""The encoder cache: keys and values of cross-attention over an encoder's output (ollama's ``EncoderCache``).

Cross-attention keys and values depend on the encoder input (an image, an audio clip), not on the decoder's positions.
They are computed once, when the encoder input enters the sequence, stored whole, and returned whole by every later
``get`` with no mask. The cache remembers the position at which the encoder input entered (the lowest position of the
batch that stored it), so that ``remove`` over that position drops it and the model knows to encode again
(:meth:`EncoderCache.encoder_cached`). One sequence at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

import numpy as np

from mlx_engine.kvcache.base import Cache
from mlx_engine.batch import Batch
from mlx_engine.errors import CacheError
from mlx_engine.ml import Backend, CacheConfig, Context, DType, Tensor


class EncoderCache(Cache):
    """Position-independent storage of cross-attention keys and values, one sequence.

    ``put(ctx, key [1, H_kv, S_enc, Dk], value [1, H_kv, S_enc, Dv])`` replaces the current layer's keys and values
    (cast to the init dtype); ``get`` returns them as they were stored, with mask ``None``. The model checks
    :meth:`encoder_cached` to decide whether to run the encoder and ``put``, or only ``get``.
    """

    def __init__(self) -> None:
        self._backend: Optional[Backend] = None
        self._layer = 0
        self._keys: dict[int, Tensor] = {}
        self._values: dict[int, Tensor] = {}
        self._cached = False
        self._encoder_pos = 0
        self._owner: Optional[int] = None
        self._cur_pos = 0
        self._cur_seq = 0
        self._reserve = False

    def init(self, backend: Backend, dtype: DType, max_sequences: int, capacity: int, max_batch: int) -> None:
        self._backend = backend
        self.dtype = dtype
        self._keys, self._values = {}, {}
        self._cached, self._owner = False, None

    def set_config(self, config: CacheConfig) -> None:
        """No layout to configure: the stored tensors are returned as they are."""

    def set_layer(self, layer: int) -> None:
        self._layer = layer

    def _check(self) -> None:
        if self._backend is None:
            raise CacheError("the encoder cache is not initialized (call init) or was closed")

    def encoder_cached(self) -> bool:
        """Whether the keys and values of an encoder output are stored (so the model need not encode again)."""
        return self._cached

    def start_forward(self, ctx: Context, batch: Batch, reserve: bool = False) -> None:
        self.prepare_forward(ctx, batch, reserve)()

    def prepare_forward(self, ctx: Context, batch: Batch, reserve: bool = False) -> Callable[[], None]:
        """Raises ``CacheError`` for a batch of several sequences, or of another sequence than the one whose encoder
        output is stored (the encoder cache holds one sequence). A reserve batch may hold any sequences."""
        self._check()
        seqs = np.unique(batch.sequences)
        if reserve:
            def commit_reserve() -> None:
                self._cur_pos, self._cur_seq, self._reserve = 0, int(seqs[0]), True
            return commit_reserve
        if len(seqs) != 1:
            raise CacheError(f"the encoder cache holds one sequence, the batch has sequences {seqs.tolist()}")
        seq = int(seqs[0])
        if self._cached and seq != self._owner:
            raise CacheError(f"the encoder cache holds the encoder output of sequence {self._owner}, not {seq}; remove "
                             f"it first (remove({self._owner}, 0, None))")
        pos = int(np.min(batch.positions))

        def commit() -> None:
            self._cur_pos, self._cur_seq, self._reserve = pos, seq, False
        return commit

    def set_causal(self, ctx: Context, both_ways: Sequence[tuple[int, int]]) -> None:
        """Cross-attention sees the whole encoder output: there is no causal mask to change."""

    def put(self, ctx: Context, key: Tensor, value: Tensor) -> None:
        """Store ``key [1, H_kv, S_enc, Dk]`` and ``value [1, H_kv, S_enc, Dv]`` for the current layer, replacing
        what it held. In a reserve pass the storage is made (unless an encoder output is stored, which is kept) but
        the cache does not count as holding an encoder output."""
        self._check()
        if key.ndim != 4 or value.ndim != 4 or key.shape[:3] != value.shape[:3]:
            raise ValueError(f"put expects key [1, H_kv, S, Dk] and value [1, H_kv, S, Dv], got {list(key.shape)} and "
                             f"{list(value.shape)}")
        if self._reserve and self._cached:
            return  # a reserve pass must not overwrite a stored encoder output
        if key.dtype != self.dtype:
            key = key.astype(self.dtype)
        if value.dtype != self.dtype:
            value = value.astype(self.dtype)
        self._keys[self._layer], self._values[self._layer] = key, value
        if not self._reserve:
            self._cached, self._encoder_pos, self._owner = True, self._cur_pos, self._cur_seq

    def get(self, ctx: Context) -> tuple[Tensor, Tensor, Optional[Tensor]]:
        """``(keys [1, H_kv, S_enc, Dk], values [1, H_kv, S_enc, Dv], None)``; raises ``CacheError`` when the
        current layer holds nothing."""
        self._check()
        if self._layer not in self._keys:
            raise CacheError(f"the encoder cache holds nothing for layer {self._layer} (encode and put first)")
        return self._keys[self._layer], self._values[self._layer], None

    def copy_prefix(self, src_seq: int, dst_seq: int, length: int) -> None:
        raise CacheError("the encoder cache holds one sequence and cannot share it (copy_prefix)")

    def can_resume(self, seq: int, pos: int) -> bool:
        """Always True: a removed encoder output is simply encoded again."""
        return True

    def remove(self, seq: int, begin: int, end: Optional[int]) -> None:
        """Drop the encoder output when it entered ``seq`` at a position in ``begin .. end - 1``."""
        self.prepare_remove(seq, begin, end)()

    def prepare_remove(self, seq: int, begin: int, end: Optional[int]) -> Callable[[], None]:
        self._check()

        def commit() -> None:
            if self._cached and seq == self._owner and begin <= self._encoder_pos and (
                    end is None or self._encoder_pos < end):
                self._cached, self._owner = False, None
                self._keys, self._values = {}, {}
        return commit

    def close(self) -> None:
        self._keys, self._values = {}, {}
        self._cached, self._owner = False, None
        self._backend = None

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._keys.values()) + sum(t.nbytes for t in self._values.values())
