"""Embedding throughput (issue 64): embeddings per second for ``--inputs`` texts of ``--tokens`` tokens each (special
tokens counted) on one GGUF file, this engine beside llama.cpp (``llama-cpp-python``, ``Llama(embedding=True).embed``,
as many threads as this process may use), in alternating rounds; the best round of each and their ratio.

Texts are made of words drawn from a fixed list (seed 0), exactly ``--tokens`` tokens each by the file's own
tokenizer, so both engines run the same tokens. llama.cpp runs in a process of its own, which imports it before any
other native library (see ``mlx_engine/bench/llama_cpp_peer.py``). Each round's seconds go to standard error as they
come; the figures, one JSON line, to standard output.

Run: ``python benchmarks/embed_throughput.py MODEL.gguf`` (1,000 inputs of 64 tokens, 3 rounds: the issue's figure);
``--smoke`` for a quick check that both engines run (32 inputs, 1 round).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

_PEER = """
import json, os, sys, time
import llama_cpp
texts = json.loads(sys.stdin.readline())
n = int(sys.argv[2])
llm = llama_cpp.Llama(sys.argv[1], embedding=True, n_ctx=n, n_batch=n, n_ubatch=n, n_seq_max=64,
                      n_threads=len(os.sched_getaffinity(0)), verbose=False)
llm.embed(texts[:8])
print("ready", flush=True)
for _ in sys.stdin:  # one round a line: never while the other engine runs
    t0 = time.perf_counter()
    llm.embed(texts, normalize=True)
    print(json.dumps(time.perf_counter() - t0), flush=True)
"""

WORDS = ("the quick brown fox jumps over lazy dog near river bank while small bird sings in old oak tree and farmer "
         "walks slowly home across wide green field after long day of honest work under grey sky with rain coming "
         "soon over hills where children play and teachers read books about history science music art").split()


def texts_of(model, count: int, tokens: int) -> list[str]:
    """``count`` texts of exactly ``tokens`` tokens each (special tokens counted) by ``model``'s tokenizer: random
    words while they fit, then the words that still fit, shortest first. Raises SystemExit where ``tokens`` cannot be
    reached (fewer than the special tokens, or no word of one token)."""
    import numpy as np

    def length(words: list[str]) -> int:
        return len(model.tokenize([" ".join(words)], fit=False)[0])

    rng = np.random.default_rng(0)
    by_size = sorted(WORDS, key=lambda w: length([w]))
    out = []
    for _ in range(count):
        words: list[str] = []
        for w in list(rng.choice(WORDS, tokens)) + by_size * tokens:
            n = length(words + [w])
            if n <= tokens:
                words.append(w)
            if n == tokens:
                break
        else:
            raise SystemExit(f"cannot make a text of exactly {tokens} tokens with this tokenizer; try another "
                             "--tokens")
        out.append(" ".join(words))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a GGUF embedding model (both engines read this file)")
    ap.add_argument("--inputs", type=int, default=1000, help="texts embedded in each round (default 1000)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens of each text, special tokens counted (default 64)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each engine, alternating (default 3)")
    ap.add_argument("--smoke", action="store_true", help="a quick check that both engines run: 32 inputs, 1 round")
    args = ap.parse_args()
    if args.smoke:
        args.inputs, args.rounds = 32, 1
    if not os.path.isfile(args.model):
        ap.error(f"{args.model} is not a file: give the path of a GGUF embedding model")
    if min(args.inputs, args.tokens, args.rounds) < 1:
        ap.error("--inputs, --tokens and --rounds must be at least 1")
    import mlx_engine

    model = mlx_engine.load(args.model)
    texts = texts_of(model, args.inputs, args.tokens)
    lengths = [len(x) for x in model.tokenize(texts)]
    peer = subprocess.Popen([sys.executable, "-c", _PEER, args.model, str(64 * args.tokens)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    peer.stdin.write(json.dumps(texts) + "\n")
    peer.stdin.flush()
    if peer.stdout.readline().strip() != "ready":
        raise SystemExit(f"llama.cpp did not load {args.model} (exit status {peer.wait()}); its messages are above")
    model.embed(texts[:8])
    ours, theirs = [], []
    for r in range(args.rounds):  # alternating: ours, then one round of the peer's, which waits on its pipe
        t0 = time.perf_counter()
        model.embed(texts)
        ours.append(time.perf_counter() - t0)
        peer.stdin.write("go\n")
        peer.stdin.flush()
        line = peer.stdout.readline()
        if not line:
            raise SystemExit(f"llama.cpp stopped in round {r + 1} (exit status {peer.wait()}); its messages are above")
        theirs.append(float(line))
        print(f"round {r + 1}/{args.rounds}: ours {ours[-1]:.2f} s, llama.cpp {theirs[-1]:.2f} s", file=sys.stderr,
              flush=True)
    peer.stdin.close()
    peer.wait()
    ours_rate, theirs_rate = args.inputs / min(ours), args.inputs / min(theirs)
    print(json.dumps({"model": os.path.basename(args.model), "inputs": args.inputs,
                      "tokens": [min(lengths), max(lengths)], "threads": len(os.sched_getaffinity(0)),
                      "ours_per_s": round(ours_rate, 1), "llama_cpp_per_s": round(theirs_rate, 1),
                      "ratio": round(ours_rate / theirs_rate, 3)}))


if __name__ == "__main__":
    main()
