"""Prefill and decode speed of one model split over 1, 2 and 3 ranks on this machine, and the time the ranks spend
talking per token, so that a two-machine figure can be predicted.

    python benchmarks/distributed.py smollm2:135m gemma3:270m [--ranks 1 2 3] [--modes pipeline tensor]

Each configuration starts its ranks the way ``mlx.launch -n N --backend ring`` does (``MLX_RANK`` and a host file of
loopback ports), but without ``mlx.launch`` itself: its I/O threads poll without sleeping and take a core of their
own, which on a 2-core machine would measure ``mlx.launch`` rather than the engine. Rank 0 prefills a prompt of
``--prompt-tokens`` and decodes ``--decode-tokens`` (greedy, a base-model continuation so that no end-of-sequence
cuts it short), ``--reps`` times after a warm-up; the medians are printed.

Communication is measured on its own, on the same ranks before the model loads: the collectives one decode token
needs in each mode, with the shapes the model gives them (tensor: one control message, the sampled token to every
rank, and two ``all_sum`` of ``[1, 1, hidden]`` per layer; pipeline: one control message, and one ``send`` of
``[1, 1, hidden]`` from rank 0, which embeds, to the first stage, then per stage boundary and back to rank 0), timed over 200 tokens. With a
link's latency ``t`` and bandwidth ``B``, a token's communication on two machines costs about
``messages * t + bytes / B`` (the figures give both counts).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
        "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it "
        "was the season of Darkness, it was the spring of hope, it was the winter of despair. ") * 40


def _comm(mode: str, hidden: int, layers: int, tokens: int = 200) -> dict:
    """Every rank: time the collectives of ``tokens`` decode steps (no model math). Returns ms per token, the
    messages and the bytes one rank sends per token."""
    import numpy as np

    from mlx_engine.ml import DType
    from mlx_engine.mlx import MLXContext
    from mlx_engine.mlx.distributed import init_group

    g = init_group("ring")
    ctx = MLXContext()
    n = g.size
    h = ctx.zeros((1, 1, hidden), DType.FLOAT32)
    tok = ctx.zeros((1,), DType.INT32)  # tensor parallelism: the sampled token goes to every rank
    control = json.dumps({"op": "forward", "cache": 0, "positions": [600], "sequences": [0], "outputs": [0],
                          "inputs": None}).encode()

    def step() -> None:
        g.broadcast_bytes(control if g.rank == 0 else None)
        if mode == "tensor":
            x = h + g.all_sum(tok).astype(DType.FLOAT32).reshape(1, 1, 1)
            for _ in range(2 * layers):
                x = g.all_sum(x) * 0.5
            ctx.evaluate(x)
            return
        # stage s on rank s + 1, the last on rank 0, which embeds and sends to rank 1 (models/layers/sharding.py)
        if g.rank == 0:
            x = g.depends(g.recv((1, 1, hidden), DType.FLOAT32, n - 1), g.send(h + 1.0, 1))
            ctx.evaluate(x)
        else:
            ctx.evaluate(g.send(g.recv((1, 1, hidden), DType.FLOAT32, g.rank - 1) * 1.0, (g.rank + 1) % n))

    for _ in range(10):
        step()
    t0 = time.perf_counter()
    for _ in range(tokens):
        step()
    ms = (time.perf_counter() - t0) / tokens * 1e3
    control_bytes = 4096  # one broadcast of a fixed 4 KiB buffer (models/layers/parallel.py)
    if mode == "tensor":
        messages = 2 + 2 * layers
        sent = control_bytes + 4 + 2 * layers * hidden * 4
    else:
        messages = 1 + n
        sent = control_bytes + n * hidden * 4
    return {"comm_ms_per_token": round(float(np.float64(ms)), 3), "messages_per_token": messages,
            "bytes_per_token": sent}


def worker(model: str, mode: str, prompt_tokens: int, decode_tokens: int, reps: int, out: str) -> None:
    """One rank of a configuration (``mode`` ``single``: one process)."""
    import mlx_engine
    from mlx_engine.models.generation.runner import Request
    from mlx_engine.models.generation.sampler import SamplerOptions

    comm = None
    if mode != "single":
        from mlx_engine.store import Store

        from mlx_engine.models.registry import file_config
        from mlx_engine.weights import open_weights

        with open_weights(Store().resolve(model, pull=False, progress=False).path) as wf:
            c = file_config(wf)
        comm = _comm(mode, c.hidden_size, c.num_layers)
    m = mlx_engine.load(model, progress=False, context_length=prompt_tokens + decode_tokens + 8,
                        **({} if mode == "single" else {"parallel": mode, "transport": "ring"}))
    tokens = m.text_tokens(TEXT)[:prompt_tokens]
    runner = m.runner
    prefill, decode = [], []
    for rep in range(reps + 1):
        runner.reset(0)
        with m.backend.new_context() as ctx:
            t0 = time.perf_counter()
            logits, _ = runner.prefill(ctx, 0, tokens)
            ctx.evaluate(logits)
            t1 = time.perf_counter()
        runner.reset(0)
        req = Request(tokens[:64], max_tokens=decode_tokens, sampler=SamplerOptions(temperature=0))
        gen = runner.generate_tokens(req)
        next(gen)
        t2 = time.perf_counter()
        n = sum(1 for _ in gen)
        t3 = time.perf_counter()
        if rep:  # the first is a warm-up
            prefill.append(len(tokens) / (t1 - t0))
            decode.append(n / (t3 - t2))
    result = {"prefill_tok_s": round(statistics.median(prefill), 1), "decode_tok_s": round(statistics.median(decode), 1),
              "per_rank": m.distributed.rank_stats() if m.distributed else [{"weights_bytes": m.weights_bytes,
                                                                          "peak_bytes": m.backend.peak_memory()}]}
    if comm:
        result.update(comm)
    with open(out, "w") as f:
        json.dump(result, f)
    m.close()


def run(model: str, mode: str, ranks: int, args: argparse.Namespace) -> dict:
    """Start ``ranks`` processes of one configuration and return rank 0's figures."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", model, "single" if ranks == 1 else mode,
               str(args.prompt_tokens), str(args.decode_tokens), str(args.reps), str(out)]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        if ranks > 1:
            socks = [socket.socket() for _ in range(ranks)]
            for s in socks:
                s.bind(("127.0.0.1", 0))
            hosts = Path(tmp) / "hosts.json"
            hosts.write_text(json.dumps([[f"127.0.0.1:{s.getsockname()[1]}"] for s in socks]))
            for s in socks:
                s.close()
            env["MLX_HOSTFILE"] = str(hosts)
        procs = [subprocess.Popen(cmd, env={**env, "MLX_RANK": str(r)} if ranks > 1 else env)
                 for r in range(ranks)]
        codes = [p.wait(timeout=1800) for p in procs]
        if any(codes):
            raise SystemExit(f"{model} {mode} x{ranks}: ranks exited {codes}")
        return json.loads(out.read_text())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        model, mode, p, d, reps, out = sys.argv[2:8]
        worker(model, mode, int(p), int(d), int(reps), out)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--modes", nargs="+", default=["pipeline", "tensor"], choices=["pipeline", "tensor"])
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args()
    rows = []
    for model in args.models:
        for ranks in args.ranks:
            for mode in (["single"] if ranks == 1 else args.modes):
                r = run(model, mode, ranks, args)
                rows.append({"model": model, "mode": mode, "ranks": ranks, **r})  # r["per_rank"]: each rank
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("| model | mode | ranks | prefill tok/s | decode tok/s | comm ms/token | messages/token | bytes/token | "
          "weights MiB per rank | peak MiB per rank |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        w = " / ".join(f"{x['weights_bytes'] / 2**20:.0f}" for x in r["per_rank"])
        pk = " / ".join(f"{x['peak_bytes'] / 2**20:.0f}" for x in r["per_rank"])
        print(f"| {r['model']} | {r['mode']} | {r['ranks']} | {r['prefill_tok_s']} | {r['decode_tok_s']} | "
              f"{r.get('comm_ms_per_token', '')} | {r.get('messages_per_token', '')} | {r.get('bytes_per_token', '')} "
              f"| {w} | {pk} |")


if __name__ == "__main__":
    main()
