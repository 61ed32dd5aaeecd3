"""Embedding throughput (issue 64): embeddings per second for ``--inputs`` texts of ``--tokens`` tokens each (special
tokens counted) on one GGUF file, this engine beside llama.cpp (``llama-cpp-python``, ``Llama(embedding=True).embed``,
as many threads as this process may use), in alternating rounds; the best round of each and their ratio.

Texts are made of words drawn from a fixed list (seed 0) and cut to exactly ``--tokens`` tokens by the file's own
tokenizer, so both engines run the same tokens. llama.cpp runs in a process of its own, which imports it before any
other native library (see ``mlx_engine/bench/llama_cpp_peer.py``).

Run: ``python benchmarks/embed_throughput.py MODEL.gguf [--inputs 1000] [--tokens 64] [--rounds 3]``.
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
    """``count`` texts of exactly ``tokens`` tokens each (special tokens counted) by ``model``'s tokenizer."""
    import numpy as np

    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        words = list(rng.choice(WORDS, tokens))  # at least one token a word: more than enough
        while len(model.tokenize([" ".join(words)], fit=False)[0]) > tokens:
            words.pop()
        out.append(" ".join(words))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--inputs", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import mlx_engine

    model = mlx_engine.load(args.model)
    texts = texts_of(model, args.inputs, args.tokens)
    lengths = [len(x) for x in model.tokenize(texts)]
    peer = subprocess.Popen([sys.executable, "-c", _PEER, args.model, str(64 * args.tokens)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    peer.stdin.write(json.dumps(texts) + "\n")
    peer.stdin.flush()
    assert peer.stdout.readline().strip() == "ready", "llama.cpp did not load the model"
    model.embed(texts[:8])
    ours, theirs = [], []
    for _ in range(args.rounds):  # alternating: ours, then one round of the peer's, which waits on its pipe
        t0 = time.perf_counter()
        model.embed(texts)
        ours.append(time.perf_counter() - t0)
        peer.stdin.write("go\n")
        peer.stdin.flush()
        theirs.append(float(peer.stdout.readline()))
    peer.stdin.close()
    peer.wait()
    ours_rate, theirs_rate = args.inputs / min(ours), args.inputs / min(theirs)
    print(json.dumps({"model": os.path.basename(args.model), "inputs": args.inputs,
                      "tokens": [min(lengths), max(lengths)], "threads": len(os.sched_getaffinity(0)),
                      "ours_per_s": round(ours_rate, 1), "llama_cpp_per_s": round(theirs_rate, 1),
                      "ratio": round(ours_rate / theirs_rate, 3)}))


if __name__ == "__main__":
    main()
