"""Speculative decoding's speed: decode with each drafter beside plain decode, and beside llama.cpp's prompt lookup.

    python -m benchmarks.speculative smollm2:135m --draft-model PATH --compare llama.cpp --rounds 3 --tokens 128

On the same GGUF file and the same prompts (token ids from the model's chat template: a *copy* prompt that asks to
repeat a paragraph word for word, where prompt lookup should gain, and a *free* prompt, a short story, where it
should not), each round runs every mode once, greedy, ``--tokens`` tokens that never stop early, on a fresh cache:

- ours: ``off`` (plain decode), ``lookup`` (prompt lookup), ``draft`` (the ``--draft-model``, when given);
- with ``--compare llama.cpp`` (llama-cpp-python, a process of its own, as many threads as ours): plain decode, and
  its prompt-lookup speculative decoding (``LlamaPromptLookupDecoding``: n-grams of up to 2 tokens, the first
  match; ours: up to 3, the latest) drafting as many tokens per pass as ours at most (``--draft-tokens``).

The modes alternate within a round and the order flips every round, so that a busy machine slows all alike. It
prints, per prompt and mode, the median decode tokens/s over the rounds, the draft tokens accepted, the tokens per
verification pass, and two ratios, each the median of the rounds' ratios: over the same engine's plain decode,
and (``lookup``) ours over llama.cpp's. ``same`` says whether every run's tokens equal that engine's plain tokens
(they must: speculation changes the speed, not the output).

Not a test: the machine is shared and noisy; read the ratios, and measure on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from mlx_engine.bench.text import PERPLEXITY_TEXT

#: the Gettysburg Address, from the bench's perplexity text
PARAGRAPH = PERPLEXITY_TEXT[PERPLEXITY_TEXT.index("Four score"):PERPLEXITY_TEXT.index(" We the People")]
PROMPTS = {"copy": "Repeat this paragraph exactly, word for word:\n\n" + PARAGRAPH,
           "free": "Write a short story about a dragon who learns to bake bread."}


def _ours(model: Any, tokens: list[int], n: int, mode: str, k: int) -> tuple[dict[str, float], list[int]]:
    """One greedy run of ``n`` tokens on a fresh cache (the draft model's too): figures and the tokens."""
    from mlx_engine.models.generation.runner import GenerationStats, Request
    from mlx_engine.models.generation.sampler import SamplerOptions

    for runner in (model.runner, model.runner.draft):
        if runner is not None:
            runner.reset()
    stats = GenerationStats()
    req = Request(list(tokens), SamplerOptions(temperature=0.0), n, (), 0, speculative=mode, draft_tokens=k)
    ids, first = [], None
    for t in model.runner.generate_tokens(req, stats):
        ids.append(t)
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return {"decode_tps": (len(ids) - 1) / (end - first) if len(ids) > 1 else 0.0,
            "proposed": float(stats.draft_proposed), "accepted": float(stats.draft_accepted),
            "passes": float(stats.verify_steps)}, ids


def measure(model_name: str, *, draft_model: str | None = None, compare: bool = False, rounds: int = 3,
            tokens: int = 128, draft_tokens: int = 8, warm_up: bool = True, threads: int | None = None,
            say=lambda _msg: None) -> list[dict[str, Any]]:
    """The rows of the table (see the module docstring), after a round that warms up (unless not ``warm_up``),
    llama.cpp on ``threads`` threads (default: as many as ours). One row per prompt and mode, with ``decode_tps``
    (median), ``runs`` (each round's tokens/s), ``accepted`` / ``proposed`` (summed over the rounds),
    ``per_pass``, ``vs_plain`` and ``vs_llama_cpp`` (medians of per-round ratios; None where there is none) and
    ``same``."""
    import mlx_engine
    from mlx_engine.bench.llama_cpp_peer import LlamaCppPeer
    from mlx_engine.bench.run import cpu_threads

    model = mlx_engine.load(model_name, progress=False, context_length=1024, draft_model=draft_model)
    say(f"loaded {model.name}" + (f" with the draft model {model.draft.name}" if model.draft else ""))
    modes: dict[str, Any] = {f"ours {m}": (lambda t, mode=m: _ours(model, t, tokens, mode, draft_tokens))
                             for m in ("off", "lookup", *(("draft",) if draft_model else ()))}
    peers = []
    try:
        if compare:
            for name, lookup in (("llama.cpp off", 0), ("llama.cpp lookup", draft_tokens)):
                peers.append(LlamaCppPeer(model.path, 1024, threads=threads or cpu_threads(), lookup=lookup))
                say(f"{name}: llama.cpp {peers[-1].version}, repacked weights {'on' if peers[-1].repack else 'off'}")
                modes[name] = (lambda t, peer=peers[-1]: peer.generate(t, tokens))
        prompts = {k: model.chat_tokens([{"role": "user", "content": p}]) for k, p in PROMPTS.items()}
        runs: dict[tuple[str, str], list[tuple[dict[str, float], list[int]]]] = {}
        for r in range(0 if warm_up else 1, rounds + 1):  # round 0 warms up
            say("warm-up" if r == 0 else f"round {r} of {rounds}")
            names = list(modes) if r % 2 == 0 else list(modes)[::-1]
            for key, prompt in prompts.items():
                for name in names:
                    result = modes[name](prompt)
                    if r:
                        runs.setdefault((key, name), []).append(result)
    finally:
        for peer in peers:
            peer.close()
        model.close()
    return [_row(key, name, runs) for key in prompts for name in modes]


def _row(key: str, name: str, runs: dict) -> dict[str, Any]:
    mine = runs[(key, name)]
    engine = name.rsplit(" ", 1)[0]
    plain = runs[(key, f"{engine} off")]
    rates = [f["decode_tps"] for f, _ in mine]
    proposed = sum(f.get("proposed", 0.0) for f, _ in mine)
    accepted = sum(f.get("accepted", 0.0) for f, _ in mine)
    passes = sum(f.get("passes", 0.0) for f, _ in mine)
    peer = runs.get((key, "llama.cpp lookup")) if name == "ours lookup" else None

    def ratio(other):
        return statistics.median(a[0]["decode_tps"] / b[0]["decode_tps"] for a, b in zip(mine, other))

    return {"prompt": key, "mode": name, "decode_tps": statistics.median(rates), "runs": rates,
            "proposed": proposed, "accepted": accepted, "per_pass": (accepted + passes) / passes if passes else None,
            "vs_plain": ratio(plain), "vs_llama_cpp": ratio(peer) if peer else None,
            "same": all(ids == p_ids for (_, ids), (_, p_ids) in zip(mine, plain))}


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    out = ["| prompt | mode | decode tok/s (runs) | drafts accepted | tokens per pass | vs plain | vs llama.cpp "
           "lookup | same tokens |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        runs = ", ".join(f"{x:.1f}" for x in r["runs"])
        drafts = f"{r['accepted']:.0f} / {r['proposed']:.0f}" if r["proposed"] else ""
        per_pass = f"{r['per_pass']:.2f}" if r["per_pass"] else ""
        peer = f"{r['vs_llama_cpp']:.2f}" if r["vs_llama_cpp"] else ""
        out.append(f"| {r['prompt']} | {r['mode']} | {r['decode_tps']:.1f} ({runs}) | {drafts} | {per_pass} | "
                   f"{r['vs_plain']:.2f} | {peer} | {'yes' if r['same'] else 'NO'} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="a GGUF model: catalog name or path")
    ap.add_argument("--draft-model", default=None, help="a draft model of the same vocabulary (name or path)")
    ap.add_argument("--compare", choices=["llama.cpp"], default=None, help="also llama.cpp, plain and lookup")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--draft-tokens", type=int, default=8)
    a = ap.parse_args(argv)
    rows = measure(a.model, draft_model=a.draft_model, compare=a.compare is not None, rounds=a.rounds,
                   tokens=a.tokens, draft_tokens=a.draft_tokens, say=lambda m: print(m, file=sys.stderr))
    print(table(rows))
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
