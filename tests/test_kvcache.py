"""KV caches beyond the conformance list: bounded sliding-window storage, full-cache errors, remove and copy_prefix
edge cases, the wrapper's routing, the encoder cache, interleaved multi-sequence batches against a reference model,
quantized storage (accuracy and memory), contiguous decode, reserve, and the layer rule (kvcache imports no mlx)."""

from __future__ import annotations

import ast
import gc
import pathlib
import subprocess
import sys
from collections import defaultdict

import numpy as np
import pytest

from mlx_engine.kvcache import (CausalCache, ChunkedAttentionCache, EncoderCache, LatentCache, SlidingWindowCache,
                                SlidingWindowMemoryCache, WrapperCache)
from mlx_engine.batch import Batch
from mlx_engine.errors import CacheError, CacheFullError
from mlx_engine.ml import CacheConfig, DType
from mlx_engine.mlx import MLXBackend

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def backend():
    return MLXBackend()


@pytest.fixture
def ctx(backend):
    return backend.new_context()


def batch(seqs, pos):
    return Batch(np.zeros(len(pos), np.int32), pos, seqs)


def scalars(ctx, values, d=1):
    """``[1, 1, N, d]`` float32 with each value repeated across the head."""
    a = np.repeat(np.asarray(values, np.float32)[:, None], d, axis=1)[None, None]
    return ctx.from_numpy(a)


def step(cache, ctx, seqs, pos, values, layer=0, d=1):
    """Start a forward, put one scalar per token at ``layer``, return (keys [S], values [S], mask [N, S] 0/-inf)."""
    cache.start_forward(ctx, batch(seqs, pos))
    return put_get(cache, ctx, values, layer, d)


def put_get(cache, ctx, values, layer=0, d=1):
    cache.set_layer(layer)
    cache.put(ctx, scalars(ctx, values, d), scalars(ctx, values, d))
    k, v, mask = cache.get(ctx)
    kn, vn = k.numpy()[0, 0, :, 0], v.numpy()[0, 0, :, 0]
    m = np.zeros((len(values), len(kn)), np.float32) if mask is None else mask.numpy()
    return kn, vn, m


def seen(kn, m):
    return [sorted(kn[m[i] == 0].tolist()) for i in range(m.shape[0])]


# ---- sliding window: bounded storage ------------------------------------------------------------------------------
@pytest.mark.parametrize("make,per_seq_kept", [
    (lambda: SlidingWindowCache(8), 8),
    (lambda: SlidingWindowMemoryCache(8, 13), 13),
    (lambda: ChunkedAttentionCache(8), 8),
    (lambda: SlidingWindowCache(8, kv_bits=8, kv_group_size=32), 8),
])
def test_sliding_window_storage_is_bounded(backend, ctx, make, per_seq_kept):
    """Write 10x the window (in batches of 1..max_batch tokens) and check, after every step, that the allocated and
    used cells stay within (memory + max_batch) * max_sequences, the storage bytes stop growing, and every token sees
    exactly its window."""
    w, max_batch = 8, 5
    cache = make()
    cache.init(backend, DType.FLOAT32, 1, 100_000, max_batch)
    bound = per_seq_kept + max_batch
    assert cache.num_cells == bound
    d = 32 if cache.kv_bits else 1
    rng = np.random.default_rng(1)
    p = 0
    nbytes = []
    while p < 10 * w:
        n = int(rng.integers(1, max_batch + 1))
        pos = np.arange(p, p + n)
        kn, _, m = step(cache, ctx, [0] * n, pos, pos + 1.0, d=d)
        for i, q in enumerate(pos):
            lo = q - w if cache.window is not None else (q // w) * w
            assert seen(kn, m)[i] == [float(x + 1) for x in range(max(lo, 0), q + 1)], (q, seen(kn, m)[i])
        assert cache.allocated_cells() <= bound
        assert len(kn) <= bound
        assert cache.cells_in_use() <= bound
        held = cache.positions(0)
        assert held.min() >= pos.min() - per_seq_kept  # only what the memory allows is kept
        nbytes.append(cache.nbytes())
        p += n
    assert p >= 10 * w
    assert max(nbytes) == nbytes[-1] and nbytes[-1] <= bound * (cache.nbytes() // cache.allocated_cells())


def test_sliding_window_two_sequences_bounded(backend, ctx):
    """Two interleaved sequences running 10x the window: storage stays within (max(M, W+1) + max_batch) * 2."""
    w, max_batch = 4, 4
    cache = SlidingWindowCache(w)
    cache.init(backend, DType.FLOAT32, 2, 10_000, max_batch)
    bound = 2 * (w + 1 + max_batch)  # with several sequences the memory is at least W + 1 (ollama)
    assert cache.num_cells == bound
    nxt = [0, 0]
    for it in range(10 * w):
        seqs, pos = [], []
        for s in (0, 1):
            k = 1 + (it + s) % 2
            seqs += [s] * k
            pos += list(range(nxt[s], nxt[s] + k))
            nxt[s] += k
        kn, _, m = step(cache, ctx, seqs, pos, [1000 * s + q for s, q in zip(seqs, pos)])
        for i, (s, q) in enumerate(zip(seqs, pos)):
            assert seen(kn, m)[i] == [float(1000 * s + x) for x in range(max(0, q - w), q + 1)]
        assert cache.allocated_cells() <= bound and cache.cells_in_use() <= bound
    assert min(nxt) >= 10 * w


# ---- full cache -----------------------------------------------------------------------------------------------------
def test_full_cache_leaves_everything_unchanged(backend, ctx):
    cache = CausalCache()
    cache.init(backend, DType.FLOAT32, 2, 3, 4)  # 6 cells
    step(cache, ctx, [0, 0, 1], [0, 1, 0], [1, 2, 3])
    kn, _, m = step(cache, ctx, [0, 1], [2, 1], [4, 5])
    assert seen(kn, m) == [[1, 2, 4], [3, 5]]
    state = (cache.positions(0).tolist(), cache.positions(1).tolist(), cache.cells_in_use(), cache.nbytes())
    # a batch of 2 when only 1 cell is free
    with pytest.raises(CacheFullError, match="capacity 3 tokens per sequence x 2 sequence") as e:
        cache.start_forward(ctx, batch([1, 1], [2, 3]))
    assert "1 of 6" in str(e.value)
    assert (cache.positions(0).tolist(), cache.positions(1).tolist(), cache.cells_in_use(), cache.nbytes()) == state
    # the previous forward is intact: get still answers for it
    k, v, mask = cache.get(ctx)
    assert np.array_equal(k.numpy()[0, 0, :, 0], kn) and np.array_equal(mask.numpy(), m)
    # and the last cell can still be used
    kn, _, m = step(cache, ctx, [1], [2], [6])
    assert seen(kn, m) == [[3, 5, 6]]
    with pytest.raises(CacheFullError):
        cache.start_forward(ctx, batch([0], [3]))


def test_wrapper_full_is_all_or_nothing(backend, ctx):
    """When the causal cache of a wrapper is full, the sliding-window cache must not trim either."""
    swa, causal = SlidingWindowCache(1), CausalCache()
    cache = WrapperCache([swa, causal], [0, 1])
    cache.init(backend, DType.FLOAT32, 1, 4, 4)
    cache.start_forward(ctx, batch([0] * 4, [0, 1, 2, 3]))
    for layer in (0, 1):
        put_get(cache, ctx, [1, 2, 3, 4], layer)
    before = swa.positions(0).tolist()
    assert before == [0, 1, 2, 3]
    with pytest.raises(CacheFullError):
        cache.start_forward(ctx, batch([0], [4]))
    assert swa.positions(0).tolist() == before  # the window's trimming of 0..2 was not applied
    assert causal.positions(0).tolist() == [0, 1, 2, 3]


def test_invalid_batches(backend, ctx):
    cache = CausalCache()
    with pytest.raises(CacheError, match="not initialized"):
        cache.start_forward(ctx, batch([0], [0]))
    cache.init(backend, DType.FLOAT32, 2, 8, 4)
    with pytest.raises(CacheError, match="max_batch"):
        cache.start_forward(ctx, batch([0] * 5, range(5)))
    with pytest.raises(CacheError, match="out of range"):
        cache.start_forward(ctx, batch([2], [0]))
    step(cache, ctx, [0, 0], [0, 1], [1, 2])
    with pytest.raises(CacheError, match="already holds positions up to 1"):
        cache.start_forward(ctx, batch([0], [1]))
    with pytest.raises(CacheError, match="twice"):
        cache.start_forward(ctx, batch([1, 1], [0, 0]))
    assert cache.positions(0).tolist() == [0, 1] and cache.positions(1).tolist() == []
    with pytest.raises(ValueError, match=r"put expects key \[1, H_kv, 1, Dk\]"):
        cache.start_forward(ctx, batch([1], [0]))
        cache.put(ctx, scalars(ctx, [1, 2]), scalars(ctx, [1, 2]))


# ---- remove, copy_prefix, can_resume -------------------------------------------------------------------------------
def shift_add(ctx, layer, keys, shift):
    return keys + shift.astype(keys.dtype).reshape(1, 1, -1, 1)


def test_remove_shared_cell_raises_and_changes_nothing(backend, ctx):
    cache = CausalCache(shift_fn=shift_add)
    cache.init(backend, DType.FLOAT32, 2, 16, 16)
    step(cache, ctx, [0] * 4, range(4), [1, 2, 3, 4])
    cache.copy_prefix(0, 1, 4)
    with pytest.raises(CacheError, match=r"shared with sequence\(s\) \[1\]"):
        cache.remove(0, 1, 2)
    assert cache.positions(0).tolist() == [0, 1, 2, 3] and cache.positions(1).tolist() == [0, 1, 2, 3]
    # removing the tail of one sequence needs no shift: the other keeps the shared cells
    cache.remove(0, 2, None)
    assert cache.positions(0).tolist() == [0, 1] and cache.positions(1).tolist() == [0, 1, 2, 3]
    kn, vn, m = step(cache, ctx, [1, 0], [4, 2], [5, 6])
    assert seen(kn, m) == [[1, 2, 3, 4, 5], [1, 2, 6]]
    # a shift of cells no longer shared is fine: seq 1 owns 2, 3 alone now
    cache.remove(1, 2, 3)
    assert cache.positions(1).tolist() == [0, 1, 2, 3]
    kn, vn, m = step(cache, ctx, [1], [4], [7])
    # keys of the renumbered positions 3 -> 2 and 4 -> 3 were shifted by -1 (key 4 -> 3, key 5 -> 4); values not
    assert seen(kn, m) == [[1, 2, 3, 4, 7]]
    assert sorted(vn[m[0] == 0].tolist()) == [1, 2, 4, 5, 7]


def test_remove_without_shift_fn(backend, ctx):
    cache = CausalCache()
    cache.init(backend, DType.FLOAT32, 1, 16, 16)
    step(cache, ctx, [0] * 4, range(4), [1, 2, 3, 4])
    with pytest.raises(CacheError, match="no shift function"):
        cache.remove(0, 1, 2)
    assert cache.positions(0).tolist() == [0, 1, 2, 3]
    cache.remove(0, 2, 4)  # nothing after it: no shift needed
    assert cache.positions(0).tolist() == [0, 1]
    cache.remove(0, 0, None)
    assert cache.positions(0).tolist() == [] and cache.cells_in_use() == 0
    assert cache.can_resume(0, 0) and not cache.can_resume(0, 1)


def test_remove_re_rotates_keys_with_rope(backend, ctx):
    """A real RoPE shift_fn (as a model would write it): after removing positions 2..4, the keys of positions 5..9
    equal the raw keys rotated to their new positions 2..6, in every layer."""
    h, d, n = 2, 16, 10

    def rope_shift(ctx, layer, keys, shift):
        _, hk, m, dk = keys.shape
        # one token per row, so every key turns by the same delta
        return keys.reshape(1, hk * m, 1, dk).rope(shift[:1], dk).reshape(1, hk, m, dk)

    rng = np.random.default_rng(0)
    raw = [rng.standard_normal((1, h, n, d)).astype(np.float32) for _ in range(2)]
    cache = CausalCache(shift_fn=rope_shift)
    cache.init(backend, DType.FLOAT32, 1, 32, 16)
    cache.start_forward(ctx, batch([0] * n, range(n)))
    for layer in (0, 1):
        cache.set_layer(layer)
        k = ctx.from_numpy(raw[layer]).rope(0, d)
        cache.put(ctx, k, ctx.from_numpy(raw[layer]))
    cache.remove(0, 2, 5)
    assert cache.positions(0).tolist() == list(range(7))
    cache.start_forward(ctx, batch([0], [7]))
    for layer in (0, 1):
        cache.set_layer(layer)
        z = np.zeros((1, h, 1, d), np.float32)
        cache.put(ctx, ctx.from_numpy(z), ctx.from_numpy(z))
        k, v, mask = cache.get(ctx)
        kept = np.concatenate([raw[layer][:, :, :2], raw[layer][:, :, 5:]], axis=2)
        want = ctx.from_numpy(kept).rope(0, d).numpy()
        cell_pos = cache._pos[:k.shape[2]]
        cells = np.array([int(np.flatnonzero(cell_pos == q)[0]) for q in range(7)])  # positions 0..6
        # position 7 filled the first hole (cell 2); cells 3 and 4 are holes, hidden
        assert cells.tolist() == [0, 1, 5, 6, 7, 8, 9] and np.flatnonzero(cell_pos == 7).tolist() == [2]
        assert np.flatnonzero(mask.numpy()[0] != 0).tolist() == [3, 4]
        got = k.numpy()[:, :, cells]
        np.testing.assert_allclose(got, want, atol=2e-5)
        np.testing.assert_array_equal(v.numpy()[:, :, cells], kept)


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_latent_cache_keeps_keys_only_and_reads_values_from_them(backend, ctx, kv_bits):
    """LatentCache: one key row per token ``[rope + latent]``; the values are its last ``latent`` features (a view),
    nothing stored for them (bytes: the keys' alone); a value passed to ``put`` is refused; a removal re-rotates
    the key rows through the shift function as a causal cache does. The 8-bit form dequantizes within its step."""
    rope, latent, n = 16, 48, 6
    shifted = []

    def shift(ctx, layer, keys, delta):
        shifted.append(keys.shape)
        return keys

    cache = LatentCache(latent, shift_fn=shift, kv_bits=kv_bits, kv_group_size=64)
    cache.init(backend, DType.FLOAT32, 1, 32, 8)
    cache.set_config(CacheConfig(padding=1, step=8))
    raw = np.random.default_rng(1).standard_normal((1, 1, n, rope + latent)).astype(np.float32)
    cache.start_forward(ctx, batch([0] * n, range(n)))
    cache.set_layer(0)
    with pytest.raises(ValueError, match="no value"):
        cache.put(ctx, ctx.from_numpy(raw), ctx.from_numpy(raw[..., rope:]))
    cache.put(ctx, ctx.from_numpy(raw), None)
    k, v, mask = cache.get(ctx)
    tol = 0 if kv_bits is None else 2 * np.abs(raw).max() / 255  # 8 bits over a group's range
    np.testing.assert_allclose(k.numpy()[:, :, :n], raw, atol=tol)
    np.testing.assert_array_equal(v.numpy(), k.numpy()[..., rope:])
    per_cell = (rope + latent) * (4 if kv_bits is None else 1 + 2 * 4 / 64)  # 8-bit: a scale and bias per 64
    assert cache.nbytes() == per_cell * cache.allocated_cells()
    cache.remove(0, 1, 2)
    assert shifted == [(1, 1, n - 2, rope + latent)]


def test_copy_prefix_replaces_destination(backend, ctx):
    cache = CausalCache()
    cache.init(backend, DType.FLOAT32, 3, 16, 16)
    step(cache, ctx, [0, 0, 0, 1, 1], [0, 1, 2, 0, 1], [1, 2, 3, 7, 8])
    cache.copy_prefix(0, 1, 2)
    assert cache.positions(1).tolist() == [0, 1]
    assert cache.cells_in_use() == 3  # seq 1's own cells were freed, the prefix is shared, not copied
    kn, _, m = step(cache, ctx, [1, 2], [2, 0], [9, 10])
    assert seen(kn, m) == [[1, 2, 9], [10]]
    with pytest.raises(CacheError, match="out of range"):
        cache.copy_prefix(0, 3, 1)


def test_cells_below_counts_the_cells_of_recorded_tokens(backend, ctx):
    """cells_below: the cells that the sequences' recorded token counts account for (a shared prefix once); a cell
    past a sequence's record (what a leak looks like to the server's /status) is left out."""
    cache = CausalCache()
    cache.init(backend, DType.FLOAT32, 3, 16, 16)
    step(cache, ctx, [0, 0, 0, 1, 1], [0, 1, 2, 0, 1], [1, 2, 3, 7, 8])
    cache.copy_prefix(0, 2, 2)  # seq 2 shares seq 0's first two cells
    assert cache.cells_in_use() == 5
    assert cache.cells_below([3, 2, 2]) == 5
    assert cache.cells_below([2, 2, 2]) == 4  # seq 0's third cell is not accounted for
    assert cache.cells_below([1, 0, 2]) == 2 and cache.cells_below([0, 0, 0]) == 0


def test_can_resume_chunked_and_causal(backend, ctx):
    cache = ChunkedAttentionCache(4)
    cache.init(backend, DType.FLOAT32, 1, 64, 8)
    step(cache, ctx, [0] * 6, range(6), range(1, 7))
    assert [p for p in range(8) if cache.can_resume(0, p)] == [0, 1, 2, 3, 4, 5, 6]
    step(cache, ctx, [0] * 3, [6, 7, 8], [7, 8, 9])  # trims chunk 0 (positions 0..3)
    assert cache.positions(0).tolist() == [4, 5, 6, 7, 8]
    assert [p for p in range(11) if cache.can_resume(0, p)] == [4, 5, 6, 7, 8, 9]
    # a sequence absent from a batch keeps the chunk of its last token, so it can still step back one token
    two = ChunkedAttentionCache(4)
    two.init(backend, DType.FLOAT32, 2, 64, 8)
    step(two, ctx, [0] * 4, range(4), [1, 2, 3, 4])
    step(two, ctx, [1], [0], [9])
    assert two.positions(0).tolist() == [0, 1, 2, 3] and two.can_resume(0, 3)
    step(two, ctx, [0], [4], [5])  # its own next chunk starts: now chunk 0 goes
    assert two.positions(0).tolist() == [4] and not two.can_resume(0, 3)
    causal = CausalCache()
    causal.init(backend, DType.FLOAT32, 2, 64, 8)
    step(causal, ctx, [0] * 3, range(3), [1, 2, 3])
    assert [p for p in range(6) if causal.can_resume(0, p)] == [0, 1, 2, 3]
    assert causal.can_resume(1, 0) and not causal.can_resume(1, 1)


# ---- wrapper --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("routing", [[0, 1, 0], lambda layer: 1 if layer == 1 else 0], ids=["list", "callable"])
def test_wrapper_routes_layers(backend, ctx, routing):
    swa, causal = SlidingWindowCache(1), CausalCache()
    cache = WrapperCache([swa, causal], routing)
    cache.init(backend, DType.FLOAT32, 1, 16, 8)
    cache.reserve(ctx, [(1, 1, 1), (1, 1, 1), None])
    assert swa._kv.layers.keys() == {0} and causal._kv.layers.keys() == {1}
    assert swa._kv.layers[0].size == swa.num_cells and causal._kv.layers[1].size == causal.num_cells
    for p0, n in ((0, 4), (4, 2)):
        pos = list(range(p0, p0 + n))
        cache.start_forward(ctx, batch([0] * n, pos))
        for layer in (0, 1, 2):
            kn, _, m = put_get(cache, ctx, [100 * layer + q for q in pos], layer)
            for i, q in enumerate(pos):
                lo = 0 if layer == 1 else max(0, q - 1)
                assert seen(kn, m)[i] == [float(100 * layer + x) for x in range(lo, q + 1)], (layer, q)
    assert swa._kv.layers.keys() == {0, 2} and causal._kv.layers.keys() == {1}
    assert cache.can_resume(0, 6) and not cache.can_resume(0, 2)  # the window lost position 0..3
    assert causal.can_resume(0, 2)
    cache.remove(0, 5, None)
    assert swa.positions(0).max() == 4 and causal.positions(0).tolist() == [0, 1, 2, 3, 4]
    assert cache.nbytes() == swa.nbytes() + causal.nbytes() > 0
    with pytest.raises(ValueError, match="layer 3 has no cache"):
        WrapperCache([swa, causal], [0, 1, 0]).set_layer(3)
    with pytest.raises(ValueError, match="layer 0 is routed to cache 2"):
        WrapperCache([swa, causal], lambda layer: 2).set_layer(0)
    cache.close()


def test_step_tensors_are_the_cells_and_storage_of_a_fused_one_token_step(backend, ctx):
    """``step_tensors``: for one token whose visible cells are one run, the cells ``(start, lo, hi)`` and the
    layers' storage, through a wrapper in its caches' order; None where a trace would hold this step's numbers
    (several tokens, a quantized cache, a layer not stored, storage to grow); a wrapped window's two runs are both
    in the cells.
    ``load_step_tensors`` puts tensors back in that order, and refuses any other count."""
    swa, causal = SlidingWindowMemoryCache(2, 8), CausalCache()  # (memory 8: no cell given up yet)
    cache = WrapperCache([swa, causal], [0, 1, 0, 1])
    cache.init(backend, DType.FLOAT32, 1, 32, 8)
    cache.start_forward(ctx, batch([0] * 4, [0, 1, 2, 3]))
    for layer in (0, 1, 2):
        put_get(cache, ctx, [0, 1, 2, 3], layer)
    assert cache.step_tensors(ctx, [0, 1, 2]) is None  # four tokens
    cache.start_forward(ctx, batch([0], [4]))
    cells, storage = cache.step_tensors(ctx, [0, 1, 2])
    # the window's cache sees positions 2..4 (cells 2..4), the causal one all five; the token goes to cell 4
    assert [c.numpy().tolist() for c in cells] == [[4, 2, 5, 0, 0], [4, 0, 5, 0, 0]]
    assert [t.shape[2] for t in storage] == [swa._kv.layers[0].size] * 4 + [causal._kv.layers[1].size] * 2
    assert storage[0] is swa._kv.layers[0].k[0] and storage[4] is causal._kv.layers[1].k[0]
    fresh = [ctx.from_numpy(t.numpy() + 1) for t in storage]
    cache.load_step_tensors(cells, fresh)
    assert swa._kv.layers[2].v[0] is fresh[3] and causal._kv.layers[1].v[0] is fresh[5]
    with pytest.raises(CacheError, match="tensors of step_tensors"):
        cache.load_step_tensors(cells, fresh[:4])
    assert cache.step_tensors(ctx, [0, 1, 2, 3]) is None  # layer 3 not stored
    cache.close()
    quantized = CausalCache(kv_bits=8, kv_group_size=32)
    quantized.init(backend, DType.FLOAT32, 1, 32, 8)
    quantized.start_forward(ctx, batch([0], [0]))
    put_get(quantized, ctx, [0], 0, d=32)
    quantized.start_forward(ctx, batch([0], [1]))
    assert quantized.step_tensors(ctx, [0]) is None
    ring = SlidingWindowMemoryCache(2, 3)  # a ring of 3 + 8 cells: it wraps, and the window sees two runs at times
    ring.init(backend, DType.FLOAT32, 1, 64, 8)
    wrapped = False
    for p in range(24):
        ring.start_forward(ctx, batch([0], [p]))
        got = ring.step_tensors(ctx, [0]) if p else None
        _, _, m = put_get(ring, ctx, [p], 0)
        edges = np.flatnonzero(np.diff(np.concatenate(([0], m[0] == 0, [0])).astype(np.int8)))
        assert (got is None) == (p == 0 or len(edges) > 4 or ring._kv.layers[0].size < ring._fwd.used), p
        if got is not None and len(edges) == 4:  # two runs: both in the cells, in order
            assert got[0][0].numpy().tolist()[1:] == edges.tolist()
            wrapped = True
    assert wrapped
    with pytest.raises(CacheError, match="step_tensors"):
        CausalCache().load_step_tensors([], [])


# ---- encoder cache ------------------------------------------------------------------------------------------------
def test_encoder_cache(backend, ctx):
    rng = np.random.default_rng(3)
    cache = EncoderCache()
    cache.init(backend, DType.FLOAT16, 3, 64, 16)

    def kv(rows, shift=0.0):
        k = rng.standard_normal((1, 2, rows, 8)).astype(np.float32) + shift
        return k, rng.standard_normal((1, 2, rows, 4)).astype(np.float32)

    def with_images(seqs, pos, images):
        b = batch(seqs, pos)
        b.images = [(i, ctx.zeros((rows, 5), DType.FLOAT32)) for i, rows in images]
        return b

    # a reserve pass records nothing and its puts store nothing
    cache.start_forward(ctx, with_images([0] * 3, [0, 1, 2], [(0, 7)]), reserve=True)
    cache.set_layer(0)
    cache.put(ctx, *map(ctx.from_numpy, kv(7)))
    assert cache.nbytes() == 0
    with pytest.raises(CacheError, match="no encoder input"):
        cache.get(ctx)
    # an image enters sequence 0 at position 5 (batch index 0), 7 rows per layer
    first = {layer: kv(7, layer) for layer in (0, 1)}
    cache.start_forward(ctx, with_images([0] * 3, [5, 6, 7], [(0, 7)]))
    for layer in (0, 1):
        cache.set_layer(layer)
        cache.put(ctx, *map(ctx.from_numpy, first[layer]))
    assert cache.encoder_inputs() == [(0, 5, 7)]
    cache.start_forward(ctx, batch([0], [8]))  # later steps only get
    for layer in (0, 1):
        cache.set_layer(layer)
        k, v, mask = cache.get(ctx)
        assert mask is None and k.dtype == DType.FLOAT16 and k.shape == (1, 2, 7, 8) and v.shape == (1, 2, 7, 4)
        np.testing.assert_allclose(k.numpy(), first[layer][0].astype(np.float16))
        np.testing.assert_allclose(v.numpy(), first[layer][1].astype(np.float16))
    # a second image (3 rows) at position 9, and one in sequence 1 at position 0 (2 rows), in one batch
    second, other = kv(3), kv(2)
    cache.start_forward(ctx, with_images([0, 0, 1], [9, 10, 0], [(0, 3), (2, 2)]))
    cache.set_layer(0)
    with pytest.raises(ValueError, match="4 rows of keys for the batch's encoder inputs of 5 rows"):
        cache.put(ctx, *map(ctx.from_numpy, kv(4)))
    cache.put(ctx, ctx.from_numpy(np.concatenate([second[0], other[0]], 2)),
              ctx.from_numpy(np.concatenate([second[1], other[1]], 2)))
    assert cache.encoder_inputs() == [(0, 5, 7), (0, 9, 3), (1, 0, 2)]
    k, v, _ = cache.get(ctx)  # sequence 0's inputs by position, then sequence 1's
    np.testing.assert_allclose(k.numpy(), np.concatenate([first[0][0], second[0], other[0]], 2).astype(np.float16))
    np.testing.assert_allclose(v.numpy(), np.concatenate([first[0][1], second[1], other[1]], 2).astype(np.float16))
    cache.start_forward(ctx, batch([1], [1]))
    assert cache.encoder_inputs() == [(1, 0, 2)]
    np.testing.assert_allclose(cache.get(ctx)[0].numpy(), other[0].astype(np.float16))
    cache.set_layer(1)  # layer 1 has no keys of the later inputs
    with pytest.raises(CacheError, match="nothing for layer 1"):
        cache.get(ctx)
    with pytest.raises(CacheError, match="already holds an encoder input at position 9"):
        cache.start_forward(ctx, with_images([0], [9], [(0, 3)]))
    with pytest.raises(CacheError, match="sequence 3 out of range"):
        cache.start_forward(ctx, batch([3], [0]))
    # sharing a prefix shares the inputs that entered before its end
    held = cache.nbytes()
    cache.copy_prefix(0, 2, 9)
    cache.start_forward(ctx, batch([2], [9]))
    assert cache.encoder_inputs() == [(2, 5, 7)] and cache.nbytes() == held
    # remove: an input after the range moves down with the positions; one inside it is dropped
    cache.remove(0, 6, 8)
    cache.start_forward(ctx, batch([0], [20]))
    assert cache.encoder_inputs() == [(0, 5, 7), (0, 7, 3)]
    cache.remove(0, 5, 6)
    assert cache.can_resume(0, 5)
    cache.start_forward(ctx, batch([0], [20]))
    cache.set_layer(0)
    assert cache.encoder_inputs() == [(0, 6, 3)]
    np.testing.assert_allclose(cache.get(ctx)[0].numpy(), second[0].astype(np.float16))
    cache.remove(0, 0, None)
    cache.remove(1, 0, None)
    cache.remove(2, 0, None)
    assert cache.nbytes() == 0
    cache.close()
    with pytest.raises(CacheError, match="not initialized"):
        cache.get(ctx)


def test_wrapper_routes_encoder_inputs(backend, ctx):
    enc, causal = EncoderCache(), CausalCache()
    cache = WrapperCache([causal, enc], [0, 1])
    cache.init(backend, DType.FLOAT32, 1, 64, 16)
    b = batch([0, 0], [0, 1])
    b.images = [(1, ctx.zeros((3, 4), DType.FLOAT32))]
    cache.start_forward(ctx, b)
    cache.set_layer(0)
    assert cache.encoder_inputs() == []
    cache.set_layer(1)
    cache.put(ctx, ctx.zeros((1, 1, 3, 4), DType.FLOAT32), ctx.zeros((1, 1, 3, 4), DType.FLOAT32))
    assert cache.encoder_inputs() == [(0, 1, 3)] and cache.get(ctx)[0].shape == (1, 1, 3, 4)
    cache.close()


# ---- interleaved sequences against a reference --------------------------------------------------------------------
class Reference:
    """What each token must see: every position ``q <= p`` of its own sequence from the window or chunk start on."""

    def __init__(self, window=None, chunk=None):
        self.window, self.chunk = window, chunk
        self.seq: dict[int, dict[int, tuple[float, float]]] = defaultdict(dict)  # seq -> pos -> (key, value)

    def start(self, p):
        if self.window is not None:
            return p - self.window
        if self.chunk is not None:
            return p // self.chunk * self.chunk
        return 0

    def sees(self, s, p):
        return sorted(k for q, (k, v) in self.seq[s].items() if self.start(p) <= q <= p)


KINDS = {
    "causal": (lambda sh: CausalCache(shift_fn=sh), {}),
    "causal_q8": (lambda sh: CausalCache(shift_fn=sh, kv_bits=8, kv_group_size=32), {}),
    "swa": (lambda sh: SlidingWindowCache(3, shift_fn=sh), {"window": 3}),
    "swa_mem": (lambda sh: SlidingWindowMemoryCache(3, 7, shift_fn=sh), {"window": 3}),
    "chunked": (lambda sh: ChunkedAttentionCache(4, shift_fn=sh), {"chunk": 4}),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_interleaved_sequences_match_reference(backend, ctx, kind):
    """Random batches mixing three sequences (tokens shuffled inside a batch), with tail removals (after can_resume),
    restarts, prefix sharing and (causal) removals from the middle with key shifts, checked token by token."""
    make, ref_args = KINDS[kind]
    windowed = bool(ref_args)
    cache = make(shift_add)
    d = 32 if kind.endswith("_q8") else 1
    nseq, cap, max_batch = 3, 48, 6
    cache.init(backend, DType.FLOAT32, nseq, cap, max_batch)
    ref = Reference(**ref_args)
    nxt = [0] * nseq
    shared: set[int] = set()
    rng = np.random.default_rng(7)
    counter = 1.0
    checked = 0
    ops: dict[str, int] = defaultdict(int)
    for it in range(80):
        op = rng.random()
        s = int(rng.integers(nseq))
        if op < 0.1 and nxt[s] > 1:
            p = int(rng.integers(1, nxt[s]))
            if cache.can_resume(s, p):
                cache.remove(s, p, None)
                ref.seq[s] = {q: kv for q, kv in ref.seq[s].items() if q < p}
                nxt[s] = p
                ops["tail"] += 1
            else:
                ops["restart"] += 1
                assert windowed  # a causal cache can always resume before its next position
                cache.remove(s, 0, None)
                ref.seq[s], nxt[s] = {}, 0
                shared.discard(s)
            continue
        if op < 0.15 and not windowed and nxt[s] > 3 and s not in shared:
            b = int(rng.integers(0, nxt[s] - 2))
            e = int(rng.integers(b + 1, nxt[s] - 1))
            cache.remove(s, b, e)
            ref.seq[s] = {(q if q < b else q - (e - b)): ((k, v) if q < b else (k - (e - b), v))
                          for q, (k, v) in ref.seq[s].items() if not b <= q < e}
            nxt[s] -= e - b
            ops["middle"] += 1
            continue
        if op < 0.2:
            dst = (s + 1) % nseq
            length = int(rng.integers(0, nxt[s] + 1))
            if windowed and not cache.can_resume(s, length):
                continue
            cache.copy_prefix(s, dst, length)
            ref.seq[dst] = {q: kv for q, kv in ref.seq[s].items() if q < length}
            nxt[dst] = length
            shared |= {s, dst}
            ops["copy"] += 1
            continue
        if max(nxt) > cap - 2 * max_batch:  # keep clear of the capacity: restart the longest sequence
            s = int(np.argmax(nxt))
            cache.remove(s, 0, None)
            ref.seq[s], nxt[s] = {}, 0
            shared.discard(s)
        seqs, pos = [], []
        for t in rng.permutation(nseq)[: int(rng.integers(1, nseq + 1))]:
            k = int(rng.integers(1, max_batch - len(pos) + 1)) if len(pos) < max_batch else 0
            seqs += [int(t)] * k
            pos += list(range(nxt[t], nxt[t] + k))
            nxt[t] += k
        order = rng.permutation(len(pos))
        seqs, pos = [seqs[i] for i in order], [pos[i] for i in order]
        vals = [counter + i for i in range(len(pos))]
        counter += len(pos)
        for t, q, v in zip(seqs, pos, vals):
            ref.seq[t][q] = (v, v)
        kn, vn, m = step(cache, ctx, seqs, pos, vals, d=d)
        for i, (t, q) in enumerate(zip(seqs, pos)):
            assert seen(kn, m)[i] == ref.sees(t, q), (it, t, q)
            assert sorted(vn[m[i] == 0].tolist()) == sorted(v for qq, (k, v) in ref.seq[t].items()
                                                            if ref.start(q) <= qq <= q)
            checked += 1
        if windowed:
            assert cache.allocated_cells() <= cache.num_cells
    assert checked > 100 and ops["tail"] and ops["copy"], dict(ops)
    assert ops["middle"] if not windowed else ops["restart"], dict(ops)


# ---- quantized storage --------------------------------------------------------------------------------------------
# Tolerances on the attention output (random normal q, K, V; head size 64, group size 64, float32 storage). Affine
# quantization rounds each element to a grid of step (max - min) / (2**bits - 1) over its group; for 64 standard
# normals the range is about 5, so the worst element error is about half a step: 5 / 255 / 2 ~ 0.01 (8 bits) and
# 5 / 15 / 2 ~ 0.17 (4 bits). The attention output is a convex combination of values with weights perturbed through
# the keys, and its error stays within that of single elements (measured: 0.0033 and 0.09 max over 5 seeds). The
# test also checks the exact bound |o' - o| <= (exp(2 delta) - 1) max|v| + e_v, with delta the largest score change
# scale * sum_d |q_d| e_k, from the measured element errors e_k, e_v.
QUANT_TOL = {8: 0.01, 4: 0.17}


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_attention_close_to_float(backend, ctx, bits):
    h, hq, d, prefill, decode = 2, 8, 64, 300, 4
    scale = d ** -0.5
    worst = 0.0
    for seed in range(3):
        rng = np.random.default_rng(seed)
        kk = rng.standard_normal((1, h, prefill + decode, d)).astype(np.float32)
        vv = rng.standard_normal((1, h, prefill + decode, d)).astype(np.float32)
        q = rng.standard_normal((1, hq, 1, d)).astype(np.float32)
        outs, stored = [], []
        for b in (None, bits):
            c = CausalCache(kv_bits=b)
            c.init(backend, DType.FLOAT32, 1, 512, 512)
            c.set_layer(0)
            c.start_forward(ctx, batch([0] * prefill, range(prefill)))
            c.put(ctx, ctx.from_numpy(kk[:, :, :prefill]), ctx.from_numpy(vv[:, :, :prefill]))
            for t in range(prefill, prefill + decode):
                c.start_forward(ctx, batch([0], [t]))
                c.put(ctx, ctx.from_numpy(kk[:, :, t:t + 1]), ctx.from_numpy(vv[:, :, t:t + 1]))
                k, v, mask = c.get(ctx)
                assert mask is None and k.shape == (1, h, t + 1, d)
                o = ctx.scaled_dot_product_attention(ctx.from_numpy(q[:, :, :1]), k, v, scale, mask).numpy()
            outs.append(o)
            stored.append((k.numpy(), v.numpy()))
        err = np.abs(outs[1] - outs[0]).max()
        e_k = np.abs(stored[1][0] - kk).max()
        e_v = np.abs(stored[1][1] - vv).max()
        delta = scale * np.abs(q).sum(-1).max() * e_k
        bound = (np.exp(2 * delta) - 1) * np.abs(vv).max() + e_v
        assert 0 < err <= bound
        worst = max(worst, err)
    assert worst < QUANT_TOL[bits], worst


@pytest.mark.parametrize("dtype", [DType.FLOAT32, DType.FLOAT16])
def test_quantized_memory_saving(backend, ctx, dtype):
    """Storage bytes of a 4-layer cache (2 KV heads, head size 64, 4096 cells) reserved in full: the exact packed size
    and the device memory MLX reports for it."""
    layers, h, d, cells, g = 4, 2, 64, 4096, 64
    measured = {}
    for bits in (None, 8, 4):
        gc.collect()
        backend.clear_cache()
        before = backend.active_memory()
        c = CausalCache(kv_bits=bits, kv_group_size=g)
        c.init(backend, dtype, 1, cells, 512)
        c.reserve(ctx, [(h, d, d)] * layers)
        assert c.allocated_cells() == cells
        per_elem = dtype.itemsize if bits is None else bits / 8 + 2 * dtype.itemsize / g
        assert c.nbytes() == layers * 2 * h * cells * d * per_elem
        measured[bits] = backend.active_memory() - before
        assert measured[bits] == c.nbytes()
        c.close()
        del c
    ratio8, ratio4 = measured[8] / measured[None], measured[4] / measured[None]
    if dtype == DType.FLOAT32:
        assert ratio8 == pytest.approx(0.28125) and ratio4 == pytest.approx(0.15625)
    else:
        assert ratio8 == pytest.approx(0.53125) and ratio4 == pytest.approx(0.28125)


@pytest.mark.parametrize("dtype, stored", [(DType.FLOAT32, DType.FLOAT16), (DType.FLOAT16, DType.FLOAT16),
                                           (DType.BFLOAT16, DType.BFLOAT16)])
def test_half_cache_stores_16_bit_floats(backend, ctx, dtype, stored):
    """kv_bits=16: keys and values kept as float16 (bfloat16 under a bfloat16 compute dtype), rounded as astype
    rounds them; get returns them in the compute dtype; storage is 2 bytes a value, reserved in full, measured."""
    h, d, cells, n = 2, 64, 256, 40
    rng = np.random.default_rng(3)
    kk = (rng.standard_normal((1, h, n, d)) * 100).astype(np.float32)
    vv = rng.standard_normal((1, h, n, d)).astype(np.float32)
    c = CausalCache(kv_bits=16)
    c.init(backend, dtype, 1, cells, 64)
    assert c.store_dtype == stored
    c.set_layer(0)
    c.start_forward(ctx, batch([0] * n, range(n)))
    c.put(ctx, ctx.from_numpy(kk).astype(dtype), ctx.from_numpy(vv).astype(dtype))
    k, v, mask = c.get(ctx)
    assert k.dtype == dtype and v.dtype == dtype and k.shape == (1, h, n, d)
    for got, want in ((k, kk), (v, vv)):
        exact = ctx.from_numpy(want).astype(dtype).astype(stored).astype(DType.FLOAT32).numpy()
        assert np.array_equal(got.astype(DType.FLOAT32).numpy(), exact)
    if dtype == DType.FLOAT32:
        assert not np.array_equal(k.numpy(), kk)  # rounded: the narrower type is the one stored
    c.close()
    gc.collect()
    backend.clear_cache()
    before = backend.active_memory()
    c = CausalCache(kv_bits=16)
    c.init(backend, dtype, 1, cells, 64)
    c.reserve(ctx, [(h, d, d)] * 3)
    assert c.nbytes() == 3 * 2 * h * cells * d * 2 == backend.active_memory() - before
    c.close()


def test_quantized_needs_group_multiple(backend, ctx):
    c = CausalCache(kv_bits=8)
    c.init(backend, DType.FLOAT32, 1, 16, 4)
    c.start_forward(ctx, batch([0], [0]))
    with pytest.raises(ValueError, match="multiple of 64"):
        c.put(ctx, ctx.zeros((1, 1, 1, 48), DType.FLOAT32), ctx.zeros((1, 1, 1, 48), DType.FLOAT32))
    with pytest.raises(ValueError, match="kv_bits must be one of"):
        CausalCache(kv_bits=7)


# ---- contiguous decode, padding, mask dtype, reserve ----------------------------------------------------------------
def test_single_sequence_decode_is_a_slice_with_no_mask(backend, ctx):
    cache = CausalCache()
    cache.init(backend, DType.FLOAT32, 1, 1024, 64)
    rng = np.random.default_rng(0)
    hist = rng.standard_normal((1, 2, 40, 8)).astype(np.float32)
    cache.set_layer(0)
    cache.start_forward(ctx, batch([0] * 32, range(32)))
    assert cache._fwd.span == (0, 32)  # one slice update for the whole prefill
    cache.put(ctx, ctx.from_numpy(hist[:, :, :32]), ctx.from_numpy(-hist[:, :, :32]))
    k, v, mask = cache.get(ctx)
    assert k.shape == (1, 2, 32, 8) and mask is not None  # prefill needs the causal mask
    for t in range(32, 40):
        cache.start_forward(ctx, batch([0], [t]))
        assert cache._fwd.span == (t, t + 1)
        cache.put(ctx, ctx.from_numpy(hist[:, :, t:t + 1]), ctx.from_numpy(-hist[:, :, t:t + 1]))
        k, v, mask = cache.get(ctx)
        assert mask is None
        assert k.shape == (1, 2, t + 1, 8) and v.shape == (1, 2, t + 1, 8)
        np.testing.assert_array_equal(k.numpy(), hist[:, :, :t + 1])  # storage order = position order
        np.testing.assert_array_equal(v.numpy(), -hist[:, :, :t + 1])
    assert cache.allocated_cells() == 256  # grown one config.step at a time, not capacity at once


def test_padding_and_mask_dtype(backend, ctx):
    cache = SlidingWindowCache(2)
    cache.set_config(CacheConfig(padding=8, mask_dtype=DType.FLOAT16, step=16))
    cache.init(backend, DType.FLOAT16, 1, 100, 4)
    assert cache.num_cells % 8 == 0
    kn, _, m = step(cache, ctx, [0] * 3, range(3), [1, 2, 3])
    assert len(kn) == 8
    assert seen(kn, m) == [[1], [1, 2], [1, 2, 3]]
    cache.start_forward(ctx, batch([0], [3]))
    cache.set_layer(0)
    cache.put(ctx, scalars(ctx, [4]), scalars(ctx, [4]))
    k, v, mask = cache.get(ctx)
    assert k.dtype == DType.FLOAT16 and mask.dtype == DType.FLOAT16 and mask.shape == (1, 8)
    assert seen(k.numpy()[0, 0, :, 0], mask.numpy()) == [[2, 3, 4]]
    with pytest.raises(CacheError, match="set_config"):
        cache.set_config(CacheConfig(padding=4))


def test_reserve_forward_records_nothing(backend, ctx):
    cache = CausalCache()
    cache.init(backend, DType.FLOAT32, 2, 64, 16)
    cache.start_forward(ctx, batch([0] * 16, range(16)), reserve=True)
    for layer in range(3):
        cache.set_layer(layer)
        z = ctx.zeros((1, 2, 16, 8), DType.FLOAT32)
        cache.put(ctx, z, z)
        k, v, mask = cache.get(ctx)
        assert k.shape == (1, 2, 128, 8) and mask.shape == (16, 128)
        assert np.all(mask.numpy() == 0)
    assert cache.cells_in_use() == 0 and cache.positions(0).tolist() == []
    assert cache.allocated_cells() == cache.num_cells == 128
    full = cache.nbytes()
    assert full == 3 * 2 * 2 * 128 * 8 * 4
    cache.start_forward(ctx, batch([1, 1], [0, 1]))
    cache.set_layer(2)
    x = ctx.from_numpy(np.ones((1, 2, 2, 8), np.float32))
    cache.put(ctx, x, x)
    k, v, mask = cache.get(ctx)
    assert k.shape == (1, 2, 2, 8) and cache.nbytes() == full  # storage was already there: nothing grew


# ---- the layer rule -----------------------------------------------------------------------------------------------
def test_kvcache_does_not_import_mlx():
    for path in sorted((ROOT / "kvcache").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert name.split(".")[0] in ("kvcache", "mlx_engine", "numpy", "__future__", "abc", "collections",
                                              "typing", "dataclasses"), f"{path.name} imports {name}"
                assert not name.startswith("mlx_engine.mlx"), f"{path.name} imports {name}"
    code = "import sys, kvcache; print(sorted(m for m in sys.modules if m == 'mlx' or m.startswith('mlx.')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
