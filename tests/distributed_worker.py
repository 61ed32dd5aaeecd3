"""Run by tests/test_distributed.py on every rank (or alone): load a model, write what rank 0 computed.

    python -m tests.distributed_worker MODEL_PATH MODE OUT.json   (MODE: single, pipeline or tensor)

Rank 0 writes, for each prompt, the first-step logits and 12 greedy tokens, then a 2-turn chat session's answers and
prefilled token counts, and each rank's share (layers, heads, weight bytes, peak memory). Other ranks write nothing:
``load`` serves rank 0 and ends their process.
"""

from __future__ import annotations

import json
import sys

import numpy as np

import mlx_engine
from mlx_engine.models.generation.runner import Request
from mlx_engine.models.generation.sampler import SamplerOptions

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, " * 40]
TURNS = ["Hello! Who are you?", "Name a color."]  # the second turn prefills only what is new


def main() -> None:
    path, mode, out = sys.argv[1], sys.argv[2], sys.argv[3]
    m = mlx_engine.load(path, progress=False, context_length=1024,
                        **({} if mode == "single" else {"parallel": mode, "transport": "ring"}))
    result = {"prompts": []}
    runner = m.runner
    for i, prompt in enumerate(PROMPTS):
        tokens = m.text_tokens(prompt)
        runner.reset(0)
        with m.backend.new_context() as ctx:
            logits, _ = runner.prefill(ctx, 0, tokens)
            first = logits.numpy()[0].astype(np.float64)
        runner.reset(0)
        greedy = list(runner.generate_tokens(Request(tokens, max_tokens=12, sampler=SamplerOptions(temperature=0))))
        result["prompts"].append({"logits": first.tolist(), "tokens": greedy})
    session = m.chat_session(temperature=0, max_tokens=12) if m.has_chat_template else None
    turns = []
    transcript = ""
    for text in TURNS:
        if session is not None:
            pieces = list(session.send(text))
        else:  # a base model: a growing transcript, as a client that resends the conversation does
            transcript += f"Q: {text}\nA:"
            pieces = list(m.stream(transcript, raw=True, temperature=0, max_tokens=12))
            transcript += "".join(p for p in pieces if isinstance(p, str)) + "\n"
        stats = pieces[-1]
        turns.append({"text": "".join(p for p in pieces if isinstance(p, str)), "prefilled": stats.prefilled_tokens,
                      "prompt": stats.prompt_tokens})
    result["chat"] = turns
    result["ranks"] = m.distributed.rank_stats() if m.distributed else [{"weights_bytes": m.weights_bytes}]
    with open(out, "w") as f:
        json.dump(result, f)
    m.close()


if __name__ == "__main__":
    main()
