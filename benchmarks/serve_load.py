"""Load benchmark of ``mlx-engine serve`` beside ``mlx_lm.server`` on the same weights, in one run, alternating.

    python benchmarks/serve_load.py smollm2:135m gemma3:270m --clients 1 4 8 16 --max-tokens 64

For each model: our server (``mlx-engine serve``) and mlx-lm's (``mlx_lm.server`` on an mlx-lm folder written from the
same GGUF file: float32 weights dequantized by the ``gguf`` package, the GGUF's tokenizer and chat template) start
side by side; for each number of concurrent clients, each server in turn gets the same streaming chat requests
(greedy, ``max_tokens`` each). Reported per server: aggregate completion tokens/s over the wall time of the level,
time to first token p50/p95 and inter-token latency p50/p95 (gaps between streamed chunks), and the ratio ours / mlx-lm.
Then the shared-system-prompt case: a 1,500-token system prompt, one client, then four later clients with other
questions one after another; their time to first token over the first one's.

Not a test: these machines are shared and noisy; read the ratios, not the absolute figures.
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
import threading
import time
from pathlib import Path

import httpx

QUESTIONS = ["What is the capital of France?", "Name three colours.", "Write a haiku about rain.",
             "Explain what a CPU does.", "Count from one to ten.", "Who wrote Hamlet?", "What is ice made of?",
             "Describe a cat.", "Why is the sky blue?", "Name a large planet.", "What is 12 times 12?",
             "Say hello in Spanish.", "What is a river?", "Name a fruit.", "What is music?", "Describe the sea."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not start")


def one_request(url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    """Stream one chat completion; timestamps of each content chunk."""
    t0 = time.perf_counter()
    stamps = []
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choices = chunk.get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                stamps.append(time.perf_counter())
    return {"start": t0, "stamps": stamps}


def run_level(url: str, model: str, clients: int, max_tokens: int) -> dict:
    results: list[dict] = [None] * clients  # type: ignore[list-item]

    def worker(i: int) -> None:
        q = QUESTIONS[i % len(QUESTIONS)] + (f" (request {i})" if i >= len(QUESTIONS) else "")
        results[i] = one_request(url, model, [{"role": "user", "content": q}], max_tokens)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(len(r["stamps"]) for r in results)
    ttft = [r["stamps"][0] - r["start"] for r in results if r["stamps"]]
    itl = [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:])]
    return {"tok_s": tokens / wall, "tokens": tokens, "ttft": ttft, "itl": itl}


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def shared_prompt(url: str, model: str, max_tokens: int) -> float:
    system = ("You are a careful assistant for a library. The library opens at nine and closes at five. "
              "Books may be borrowed for three weeks and renewed twice. ") * 50
    ttfts = []
    for q in QUESTIONS[:5]:
        r = one_request(url, model, [{"role": "system", "content": system}, {"role": "user", "content": q}],
                        max_tokens)
        ttfts.append(r["stamps"][0] - r["start"] if r["stamps"] else float("nan"))
    return statistics.mean(ttfts[1:]) / ttfts[0]


def start_servers(model: str, folder: Path, max_seq: int) -> tuple[dict, list[subprocess.Popen]]:
    ours_port, peer_port = free_port(), free_port()
    engine = [sys.executable, "-c", "from mlx_engine.cli.main import main; main()"]
    ours = subprocess.Popen(engine + ["serve", "--port", str(ours_port), "--model", model, "--max-sequences",
                                      str(max_seq), "--context-length", "4096"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peer = subprocess.Popen([sys.executable, "-m", "mlx_lm", "server", "--model", str(folder), "--port",
                             str(peer_port), "--decode-concurrency", str(max_seq), "--log-level", "WARNING"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    urls = {"ours": f"http://127.0.0.1:{ours_port}", "mlx-lm": f"http://127.0.0.1:{peer_port}"}
    wait_ready(urls["ours"], ours)
    wait_ready(urls["mlx-lm"], peer)
    return urls, [ours, peer]


def export_peer_folder(model: str, folder: Path) -> None:
    code = ("import sys, mlx_engine; from mlx_engine.bench.mlx_lm_peer import mlx_lm_model; "
            "m = mlx_engine.load(sys.argv[1]); mlx_lm_model(m.path, sys.argv[2]); m.tokenizer.save_hf(sys.argv[2])")
    subprocess.run([sys.executable, "-c", code, model, str(folder)], check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--clients", nargs="+", type=int, default=[1, 4, 8, 16])
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    for model in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "peer"
            export_peer_folder(model, folder)
            urls, procs = start_servers(model, folder, max(args.clients))
            try:
                names = {"ours": model, "mlx-lm": "default_model"}
                for url_name, url in urls.items():  # warm-up: one short request each
                    one_request(url, names[url_name], [{"role": "user", "content": "Hi"}], 4)
                print(f"\n## {model}: {args.max_tokens} tokens per request, greedy; pid {os.getpid()}")
                print("| clients | server | tok/s | TTFT p50 / p95 ms | ITL p50 / p95 ms | tok/s ours / mlx-lm |")
                print("| --- | --- | --- | --- | --- | --- |")
                base = None
                for c in args.clients:
                    row = {}
                    for name in ("ours", "mlx-lm"):
                        row[name] = run_level(urls[name], names[name], c, args.max_tokens)
                    if base is None:
                        base = row["ours"]["tok_s"]
                    for name, r in row.items():
                        ratio = f"{row['ours']['tok_s'] / row['mlx-lm']['tok_s']:.2f}x" if name == "ours" else ""
                        print(f"| {c} | {name} | {r['tok_s']:.1f} | {pct(r['ttft'], .5) * 1000:.0f} / "
                              f"{pct(r['ttft'], .95) * 1000:.0f} | {pct(r['itl'], .5) * 1000:.0f} / "
                              f"{pct(r['itl'], .95) * 1000:.0f} | {ratio} |", flush=True)
                    print(f"|  | ours at {c} clients / ours at {args.clients[0]} | "
                          f"{row['ours']['tok_s'] / base:.2f}x |  |  |  |", flush=True)
                for name in ("ours", "mlx-lm"):
                    ratio = shared_prompt(urls[name], names[name], 16)
                    print(f"shared 1,500-token system prompt, {name}: later clients' TTFT / first's = {ratio:.2f}")
            finally:
                for p in procs:
                    p.terminate()
                for p in procs:
                    try:
                        p.wait(30)
                    except subprocess.TimeoutExpired:
                        p.kill()


if __name__ == "__main__":
    main()
