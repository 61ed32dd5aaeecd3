"""The recurrent cache on its own, driven as a model drives it, with a state whose right value is known: each
sequence's ``"sum"`` state is the running sum of its token ids and its ``"last"`` state the last ``2`` ids (a
convolution's window). Slots, copy-on-write, checkpoints, roll-back and its refusals, batches of several sequences."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_engine.batch import Batch
from mlx_engine.errors import CacheError
from mlx_engine.kvcache import RecurrentCache
from mlx_engine.mlx import MLXBackend
from mlx_engine.ml import DType

LAYER = 0


@pytest.fixture
def backend(tmp_path):
    from safetensors.numpy import save_file

    save_file({"w": np.zeros((1,), np.float32)}, str(tmp_path / "w.safetensors"))
    return MLXBackend(tmp_path / "w.safetensors", dtype="float32")


def _cache(backend, sequences: int = 3, **options) -> RecurrentCache:
    cache = RecurrentCache(**{"checkpoint_min_pos": 2, "checkpoint_interval": 4, **options})
    cache.init(backend, DType.FLOAT32, sequences, 256, 64)
    return cache


def _forward(backend, cache: RecurrentCache, runs: dict[int, list[int]], start: dict[int, int]) -> None:
    """One forward pass: ``runs[seq]`` tokens for each sequence (equal lengths), from ``start[seq]``."""
    seqs = list(runs)
    n = len(runs[seqs[0]])
    batch = Batch(np.concatenate([runs[s] for s in seqs]), np.concatenate([np.arange(start[s], start[s] + n)
                                                                           for s in seqs]),
                  np.repeat(seqs, n), [])
    with backend.new_context() as ctx:
        cache.start_forward(ctx, batch)
        assert cache.sequences == seqs and cache.layout == (len(seqs), n)
        x = ctx.from_numpy(np.array([runs[s] for s in seqs], np.float32))  # [S, L]
        total = cache.get_state(ctx, LAYER, "sum", (1,)) + x.sum(axis=1, keepdims=True)
        last = ctx.concatenate([cache.get_state(ctx, LAYER, "last", (2,)), x], axis=1)[:, -2:]
        cache.set_state(ctx, LAYER, "sum", total)
        cache.set_state(ctx, LAYER, "last", last)
        ctx.evaluate(*cache.state_tensors())


def _state(backend, cache: RecurrentCache, seq: int) -> tuple[float, list[float]]:
    total, last = cache.read_state(seq, LAYER, "sum"), cache.read_state(seq, LAYER, "last")
    return float(total.numpy()[0, 0]), last.numpy()[0].tolist()


def test_states_follow_their_sequences_in_one_batch_and_alone(backend):
    cache = _cache(backend)
    _forward(backend, cache, {0: [1, 2, 3], 1: [10, 20, 30]}, {0: 0, 1: 0})
    _forward(backend, cache, {1: [5], 0: [4]}, {0: 3, 1: 3})  # another order: rows follow the sequences
    assert _state(backend, cache, 0) == (10.0, [3.0, 4.0])
    assert _state(backend, cache, 1) == (65.0, [30.0, 5.0])
    assert cache.slots_in_use() == 2


def test_copy_on_write_and_checkpoint_restore(backend):
    cache = _cache(backend)
    _forward(backend, cache, {0: [1, 1, 1]}, {0: 0})         # positions 0-2: checkpoint at 2 (min pos)
    _forward(backend, cache, {0: [2, 2, 2, 2]}, {0: 3})      # 3-6: checkpoint at 6 (interval 4)
    assert cache.checkpoints(0) == [2, 6]
    cache.copy_prefix(0, 1, 7)                                # seq 1 shares the slot
    assert cache.slots_in_use() == 1
    _forward(backend, cache, {1: [100]}, {1: 7})              # the first write copies
    assert cache.slots_in_use() == 2
    assert _state(backend, cache, 0) == (11.0, [2.0, 2.0]) and _state(backend, cache, 1) == (111.0, [2.0, 100.0])
    cache.copy_prefix(0, 2, 3)                                # at a checkpoint: a slot restored from it
    assert cache.length(2) == 3 and _state(backend, cache, 2) == (3.0, [1.0, 1.0])
    assert cache.restore_point(0, 5) == 3 and cache.restore_point(0, 7) == 7 and cache.restore_point(0, 1) == 0
    cache.remove(0, 3, None)                                  # back to just after the checkpoint at 2
    assert cache.length(0) == 3 and _state(backend, cache, 0) == (3.0, [1.0, 1.0])
    assert cache.checkpoints(0) == [2]
    _forward(backend, cache, {0: [7]}, {0: 3})
    assert _state(backend, cache, 0) == (10.0, [1.0, 7.0])


def test_refusals_leave_the_cache_unchanged(backend):
    cache = _cache(backend, sequences=2)
    _forward(backend, cache, {0: [1, 2, 3, 4, 5]}, {0: 0})   # checkpoint at 4 only
    before = (cache.length(0), cache.checkpoints(0), _state(backend, cache, 0), cache.nbytes())
    with pytest.raises(CacheError, match="cannot be rolled back to position 2"):
        cache.remove(0, 2, None)
    with pytest.raises(CacheError, match="middle"):
        cache.remove(0, 1, 3)
    with backend.new_context() as ctx:
        with pytest.raises(CacheError, match="cannot skip or repeat"):
            cache.start_forward(ctx, Batch(np.array([9]), [7], [0], []))
        with pytest.raises(CacheError, match="same number"):
            cache.start_forward(ctx, Batch(np.array([9, 9, 9]), [5, 6, 0], [0, 0, 1], []))
    assert (cache.length(0), cache.checkpoints(0), _state(backend, cache, 0), cache.nbytes()) == before
    cache.copy_prefix(0, 1, 5)   # seq 1 shares seq 0's slot; both write in one batch: two slots, none short
    _forward(backend, cache, {0: [1], 1: [2]}, {0: 5, 1: 5})
    assert cache.slots_in_use() == 2
    assert _state(backend, cache, 0)[0] == 16.0 and _state(backend, cache, 1)[0] == 17.0
    with backend.new_context() as ctx:  # a third sequence id: the cache holds two
        with pytest.raises(CacheError, match="out of range"):
            cache.start_forward(ctx, Batch(np.array([1]), [0], [2], []))


def test_one_step_back_and_bounded_memory(backend):
    cache = _cache(backend, checkpoint_count=2)
    for p in range(40):
        _forward(backend, cache, {0: [1]}, {0: p})
    assert len(cache.checkpoints(0)) == 2                     # the ring keeps the newest two
    assert cache.can_resume(0, 39)                            # one step back: the state before the last token
    per = 4 * (1 + 2)                                         # "sum" [1] + "last" [2], float32
    assert cache.nbytes() - cache.kv.nbytes() <= (1 + 1 + 2) * per
    cache.remove(0, 39, None)
    assert _state(backend, cache, 0)[0] == 39.0
