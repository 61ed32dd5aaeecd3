"""Every scenario of the KV cache conformance list (tests/kvcache_conformance_data.py), on the MLX backend, for every
cache kind the scenario applies to.

A forward step stores one scalar per token as both key and value (one layer, one head) and checks, token by token,
that the keys its mask leaves visible are exactly the expected ones (as a multiset), and that values match keys cell by
cell. Float caches use head size 1. Quantized variants (kv_bits=8, group size 32) use head size 32 with the scalar
repeated across the head, a group that affine quantization stores exactly (scale 0, bias = the value), so the same
exact comparison holds for them; float16 variants (kv_bits=16) hold the scenarios' small integers exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

from mlx_engine.kvcache import (CausalCache, ChunkedAttentionCache, SlidingWindowCache, SlidingWindowMemoryCache,
                     WrapperCache)
from mlx_engine.batch import Batch
from mlx_engine.errors import CacheFullError
from mlx_engine.ml import DType
from mlx_engine.mlx import MLXBackend
from tests.kvcache_conformance_data import SCENARIOS

HUGE = 10**6  # a window or chunk longer than any capacity used here: behaves as a plain causal cache


def shift_add(ctx, layer, keys, shift):
    """The scenarios' 'add' shift: key + position delta."""
    return keys + shift.astype(keys.dtype).reshape(1, 1, -1, 1)


def shift_none(ctx, layer, keys, shift):
    return keys


SHIFTS = {"add": shift_add, "none": shift_none, None: None}


def variants(spec: dict) -> list[str]:
    kind = spec["kind"]
    return {
        "causal": ["causal", "causal_q8", "causal_q4", "causal_f16", "swa_huge", "chunked_huge", "wrapper"],
        "swa": ["swa", "swa_as_mem", "swa_q8", "swa_f16", "wrapper"],
        "swa_mem": ["swa_mem", "swa_mem_q8", "swa_mem_f16", "wrapper"],
        "chunked": ["chunked", "chunked_q8", "chunked_f16", "wrapper"],
    }[kind]


def make_cache(spec: dict, variant: str, shift):
    kind = spec["kind"]
    q = {}
    if variant.endswith("_q8"):
        q = {"kv_bits": 8, "kv_group_size": 32}
    elif variant.endswith("_q4"):
        q = {"kv_bits": 4, "kv_group_size": 32}
    elif variant.endswith("_f16"):
        q = {"kv_bits": 16}

    def base():
        if kind == "causal":
            return CausalCache(shift_fn=shift, **q)
        if kind == "swa":
            return SlidingWindowCache(spec["window"], shift_fn=shift, **q)
        if kind == "swa_mem":
            return SlidingWindowMemoryCache(spec["window"], spec["memory"], shift_fn=shift, **q)
        return ChunkedAttentionCache(spec["chunk"], shift_fn=shift, **q)

    if variant == "swa_huge":
        return SlidingWindowCache(HUGE, shift_fn=shift)
    if variant == "chunked_huge":
        return ChunkedAttentionCache(HUGE, shift_fn=shift)
    if variant == "swa_as_mem":
        return SlidingWindowMemoryCache(spec["window"], spec["window"], shift_fn=shift)
    if variant == "wrapper":
        return WrapperCache([base()], lambda layer: 0)
    return base()


def inner(cache):
    return cache.caches[0] if isinstance(cache, WrapperCache) else cache


# set_causal (the seed's CausalOptions.Except): a 'both_ways' list of [begin, end) batch ranges whose tokens see each
# other both ways in that forward pass only. Ours, in the scenarios' own form (pos p holds value p + 1 unless given).
SET_CAUSAL = [
    {'name': 'both_ways_causal',
     'cache': {'kind': 'causal'},
     'init': {'max_sequences': 1, 'capacity': 16, 'max_batch': 16},
     'steps': [{'forward': {'seqs': [0] * 6, 'pos': [0, 1, 2, 3, 4, 5], 'values': [1, 2, 3, 4, 5, 6],
                            'both_ways': [[1, 4]]},
                'sees': [[1], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6]]},
               {'forward': {'seqs': [0], 'pos': [6], 'values': [7]}, 'sees': [[1, 2, 3, 4, 5, 6, 7]]}]},
    {'name': 'both_ways_sliding_window',
     'cache': {'kind': 'swa', 'window': 2},
     'init': {'max_sequences': 1, 'capacity': 16, 'max_batch': 16},
     'steps': [{'forward': {'seqs': [0] * 6, 'pos': [0, 1, 2, 3, 4, 5], 'values': [1, 2, 3, 4, 5, 6],
                            'both_ways': [[2, 5]]},
                # the window's lower bound still holds; later tokens of the range are seen
                'sees': [[1], [1, 2], [1, 2, 3, 4, 5], [2, 3, 4, 5], [3, 4, 5], [4, 5, 6]]},
               {'forward': {'seqs': [0, 0], 'pos': [6, 7], 'values': [7, 8]}, 'sees': [[5, 6, 7], [6, 7, 8]]}]},
    {'name': 'both_ways_two_sequences',
     'cache': {'kind': 'causal'},
     'init': {'max_sequences': 2, 'capacity': 16, 'max_batch': 16},
     'steps': [{'forward': {'seqs': [0, 0, 0, 1, 1, 1], 'pos': [0, 1, 2, 0, 1, 2], 'values': [1, 2, 3, 4, 5, 6],
                            'both_ways': [[0, 2], [4, 6]]},
                'sees': [[1, 2], [1, 2], [1, 2, 3], [4], [4, 5, 6], [4, 5, 6]]},
               {'forward': {'seqs': [0, 1], 'pos': [3, 3], 'values': [7, 8]}, 'sees': [[1, 2, 3, 7], [4, 5, 6, 8]]}]},
    {'name': 'both_ways_window_two_sequences',
     'cache': {'kind': 'swa', 'window': 1},
     'init': {'max_sequences': 2, 'capacity': 16, 'max_batch': 16},
     'steps': [{'forward': {'seqs': [1, 1, 1, 0, 0, 0], 'pos': [0, 1, 2, 0, 1, 2], 'values': [1, 2, 3, 4, 5, 6],
                            'both_ways': [[0, 3]]},
                'sees': [[1, 2, 3], [1, 2, 3], [2, 3], [4], [4, 5], [5, 6]]}]},
]

CASES = [pytest.param(sc, v, id=f"{sc['name']}-{v}") for sc in SCENARIOS + SET_CAUSAL for v in variants(sc["cache"])]


class Runner:
    def __init__(self, cache, head_dim: int, values_are_keys: bool):
        self.values_are_keys = values_are_keys
        self.backend = MLXBackend()
        self.ctx = self.backend.new_context()
        self.cache = cache
        self.d = head_dim

    def forward(self, seqs, pos, values, both_ways=()):
        ctx, cache = self.ctx, self.cache
        n = len(pos)
        cache.start_forward(ctx, Batch(np.zeros(n, np.int32), pos, seqs))
        cache.set_causal(ctx, [tuple(r) for r in both_ways])
        cache.set_layer(0)
        kv = np.repeat(np.asarray(values, np.float32)[:, None], self.d, axis=1).reshape(1, 1, n, self.d)
        cache.put(ctx, ctx.from_numpy(kv), ctx.from_numpy(kv * 1))
        return self.view(n)

    def view(self, n):
        """(keys [S], mask [N, S] as 0 / -inf) of the current layer, with the invariants of get checked."""
        k, v, mask = self.cache.get(self.ctx)
        kn, vn = k.numpy(), v.numpy()
        s = kn.shape[2]
        assert kn.shape == (1, 1, s, self.d) and vn.shape == (1, 1, s, self.d)
        assert k.dtype == DType.FLOAT32 and v.dtype == DType.FLOAT32
        # one scalar per cell, repeated across the head (exact after quantization too)
        assert np.array_equal(kn, np.repeat(kn[..., :1], self.d, axis=-1))
        if mask is None:
            m = np.zeros((n, s), np.float32)
        else:
            assert mask.shape == (n, s)
            assert mask.dtype == self.backend.cache_config().mask_dtype
            m = mask.numpy()
            assert np.all((m == 0) | (m == -np.inf))
        visible = m == 0
        # values match keys wherever a key is visible (unless a shift re-rotated keys and not values)
        if self.values_are_keys:
            assert np.array_equal(kn[0, 0, :, 0][visible.any(0)], vn[0, 0, :, 0][visible.any(0)])
        return kn[0, 0, :, 0], m

    def sees(self, keys, m):
        return [sorted(keys[m[i] == 0].tolist()) for i in range(m.shape[0])]


@pytest.mark.parametrize("scenario,variant", CASES)
def test_conformance(scenario, variant):
    spec = scenario["cache"]
    cache = make_cache(spec, variant, SHIFTS[spec.get("shift")])
    head_dim = 32 if variant.endswith(("_q8", "_q4")) else 1
    r = Runner(cache, head_dim, values_are_keys=spec.get("shift") != "add")
    init = scenario["init"]
    cache.init(r.backend, DType.FLOAT32, init["max_sequences"], init["capacity"], init["max_batch"])
    last = None
    checked = 0
    for step in scenario["steps"]:
        if "forward" in step:
            f = step["forward"]
            if "raises" in step:
                before = inner(cache).positions(0).tolist()
                with pytest.raises(CacheFullError) as e:
                    r.forward(f["seqs"], f["pos"], f["values"])
                msg = str(e.value)
                assert f"capacity {init['capacity']}" in msg, msg
                # unchanged: same positions, and the previous forward's keys and mask are still what get returns
                assert inner(cache).positions(0).tolist() == before
                keys, m = r.view(len(last[1]))
                assert np.array_equal(keys, last[0]) and np.array_equal(m, last[1])
                checked += 1
                continue
            keys, m = r.forward(f["seqs"], f["pos"], f["values"], f.get("both_ways", ()))
            last = (keys, m)
            if "sees" in step:
                got = r.sees(keys, m)
                want = [sorted(float(x) for x in s) for s in step["sees"]]
                assert got == want, f"step {step}: got {got}"
                checked += 1
            if "retained_positions_at_least" in step:
                held = set(inner(cache).positions(0).tolist())
                assert set(step["retained_positions_at_least"]) <= held, held
        elif "remove" in step:
            rm = step["remove"]
            cache.remove(rm["seq"], rm["begin"], None if rm["end"] == "end" else rm["end"])
        elif "copy_prefix" in step:
            cp = step["copy_prefix"]
            cache.copy_prefix(cp["src"], cp["dst"], cp["length"])
        elif "can_resume" in step:
            cr = step["can_resume"]
            assert [p for p in cr["true"] if not cache.can_resume(cr["seq"], p)] == []
            assert [p for p in cr["false"] if cache.can_resume(cr["seq"], p)] == []
            checked += 1
        else:
            raise AssertionError(f"unknown step {step}")
    assert checked > 0
    cache.close()


def test_every_scenario_is_run():
    """Guard against the list above silently shrinking: all 11 scenarios, each on at least 3 cache kinds."""
    names = {sc["name"] for sc in SCENARIOS}
    assert len(names) == 11
    for sc in SCENARIOS:
        assert len(variants(sc["cache"])) >= 3


def test_set_causal_refuses_a_range_across_sequences_or_outside_the_batch():
    from mlx_engine.errors import CacheError

    r = Runner(CausalCache(), 1, values_are_keys=True)
    r.cache.init(r.backend, DType.FLOAT32, 2, 16, 16)
    with pytest.raises(CacheError, match="before start_forward"):
        r.cache.set_causal(r.ctx, [(0, 1)])
    r.cache.start_forward(r.ctx, Batch(np.zeros(4, np.int32), [0, 1, 0, 1], [0, 0, 1, 1]))
    for bad in ([(1, 3)], [(2, 5)], [(2, 2)]):
        with pytest.raises(CacheError, match="not a run of one sequence"):
            r.cache.set_causal(r.ctx, bad)
