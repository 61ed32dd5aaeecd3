"""benchmarks/speculative.py (issue 62): each drafter beside plain decode and beside llama.cpp's prompt lookup.

Oracle: each engine's own plain greedy tokens (speculation must not change them); the model drafting for itself must
have every draft accepted."""

from __future__ import annotations

import pytest


def test_the_speculative_bench_beside_llama_cpp(smollm2_gguf):
    """At tiny sizes (one round, no warm-up, 16 tokens, llama.cpp on one thread: on a shared 2-core machine its two
    threads wait for each other): every mode gives its engine's plain tokens, and the table has a row for
    llama.cpp's prompt lookup and the ratio of ours to it."""
    pytest.importorskip("llama_cpp")
    from benchmarks.speculative import measure, table

    rows = measure(str(smollm2_gguf), draft_model=str(smollm2_gguf), compare=True, rounds=1, tokens=16,
                   warm_up=False, threads=1)
    by = {(r["prompt"], r["mode"]): r for r in rows}
    assert len(rows) == 2 * 5 and all(r["same"] for r in rows)
    assert by[("copy", "ours draft")]["accepted"] == by[("copy", "ours draft")]["proposed"] > 0
    assert by[("copy", "ours lookup")]["accepted"] > 0 and by[("copy", "ours lookup")]["vs_llama_cpp"] > 0
    assert by[("copy", "llama.cpp lookup")]["decode_tps"] > 0
    assert "| copy | llama.cpp lookup |" in table(rows)
