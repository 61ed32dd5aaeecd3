"""Per-token KV cache cost in single-sequence decode, at growing context lengths.

For each context length the cache is filled by prefill (chunks of ``--chunk`` tokens), then ``--steps`` decode steps
are timed (median), each one token through ``--layers`` layers. Columns, all per decode token:

- ``start_fwd``: ``cache.start_forward`` (host bookkeeping: find the cell, decide the mask), microseconds;
- ``put+get``: ``put`` then ``get`` for every layer, evaluated (a slice update and a slice of contiguous storage),
  microseconds per layer;
- ``gather``: for comparison, what a gather over the history (``take`` of every used cell) costs per layer;
- ``sdpa``: the attention itself over the returned keys (grows with the context by nature);
- ``total``: start_forward + put + get + attention for all layers, milliseconds per token;
- ``q8 put+get``: the same for an 8-bit cache, whose ``get`` dequantizes the history (so it grows);
- ``swa total``: a sliding-window cache (window 511), whose cost stays flat however long the context.

Run: ``python benchmarks/kvcache_bench.py [--contexts 256 1024 4096 16384] [--layers 4]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from mlx_engine.kvcache import CausalCache, SlidingWindowCache
from mlx_engine.batch import Batch
from mlx_engine.ml import DType
from mlx_engine.mlx import MLXBackend


def fill(cache, ctx, layers, h, d, n, chunk, rng):
    for p0 in range(0, n, chunk):
        m = min(chunk, n - p0)
        cache.start_forward(ctx, Batch(np.zeros(m, np.int32), np.arange(p0, p0 + m), np.zeros(m)))
        kv = ctx.from_numpy(rng.standard_normal((1, h, m, d)).astype(np.float32))
        outs = []
        for layer in range(layers):
            cache.set_layer(layer)
            cache.put(ctx, kv, kv)
            outs.extend(cache.get(ctx)[:2])
        ctx.evaluate(*outs)


def decode(cache, ctx, layers, h, hq, d, start, steps, mode, rng):
    """Median seconds per token of ``steps`` decode steps; ``mode`` is 'cache', 'gather', 'sdpa' or 'host'."""
    kv = ctx.from_numpy(rng.standard_normal((1, h, 1, d)).astype(np.float32))
    q = ctx.from_numpy(rng.standard_normal((1, hq, 1, d)).astype(np.float32))
    times = []
    for t in range(start, start + steps):
        b = Batch(np.zeros(1, np.int32), [t], [0])
        t0 = time.perf_counter()
        cache.start_forward(ctx, b)
        if mode == "host":
            times.append(time.perf_counter() - t0)
            for layer in range(layers):  # keep the cells filled, untimed
                cache.set_layer(layer)
                cache.put(ctx, kv, kv)
            ctx.evaluate(*[x for layer in range(layers) for x in (cache.set_layer(layer) or cache.get(ctx))[:2]])
            continue
        outs = []
        for layer in range(layers):
            cache.set_layer(layer)
            cache.put(ctx, kv, kv)
            k, v, mask = cache.get(ctx)
            if mode == "cache":
                outs += [k, v]
            elif mode == "gather":
                idx = ctx.arange(0, k.shape[2])
                outs += [k.take(idx, axis=2), v.take(idx, axis=2)]
            else:
                outs.append(ctx.scaled_dot_product_attention(q, k, v, d ** -0.5, mask))
        ctx.evaluate(*outs)
        del outs, k, v
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--q-heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--device", default=None, help="cpu, gpu, metal or cuda (default: automatic)")
    a = ap.parse_args()
    backend = MLXBackend(device=a.device)
    ctx = backend.new_context()
    L, h, hq, d, steps = a.layers, a.kv_heads, a.q_heads, a.head_dim, a.steps
    print(f"backend: {backend.name}; {L} layers, {h} KV heads, {hq} query heads, head size {d}, float32, "
          f"median of {steps - 2} decode steps")
    print(f"{'context':>8} {'start_fwd':>10} {'put+get':>10} {'gather':>10} {'sdpa':>10} {'total':>10} "
          f"{'q8 put+get':>11} {'swa total':>10}")
    print(f"{'tokens':>8} {'us':>10} {'us/layer':>10} {'us/layer':>10} {'us/layer':>10} {'ms/token':>10} "
          f"{'us/layer':>11} {'ms/token':>10}")
    for n in a.contexts:
        rng = np.random.default_rng(0)
        res = {}
        for name, make in (("f", lambda: CausalCache()), ("q8", lambda: CausalCache(kv_bits=8)),
                           ("swa", lambda: SlidingWindowCache(511))):
            cache = make()
            cache.init(backend, DType.FLOAT32, 1, n + 8 * steps + 8, a.chunk)
            fill(cache, ctx, L, h, d, n, a.chunk, rng)
            pos = n
            modes = ("host", "cache", "gather", "sdpa") if name == "f" else ("cache",) if name == "q8" else ("sdpa",)
            for mode in modes:
                res[name, mode] = decode(cache, ctx, L, h, hq, d, pos, steps, mode, rng)
                pos += steps
            cache.close()
            backend.clear_cache()
        print(f"{n:>8} {res['f', 'host'] * 1e6:>10.1f} {res['f', 'cache'] / L * 1e6:>10.1f} "
              f"{res['f', 'gather'] / L * 1e6:>10.1f} "
              f"{(res['f', 'sdpa'] - res['f', 'cache']) / L * 1e6:>10.1f} {res['f', 'sdpa'] * 1e3:>10.3f} "
              f"{res['q8', 'cache'] / L * 1e6:>11.1f} {res['swa', 'sdpa'] * 1e3:>10.3f}")


if __name__ == "__main__":
    main()
