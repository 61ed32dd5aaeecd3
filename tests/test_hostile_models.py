"""Hostile model files: 300 mutations of the scalar metadata and tensor shapes of a tiny GGUF made here, each loaded
and asked for one answer. Every outcome is an answer or an ``EngineError``, none slower than 10 s, and the child
that runs them all stays under 2 GB (issue: hardening). A failure reproduces with
``python tests/hostile_gguf.py SEED COUNT FOLDER``.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
COUNT = 300


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile-models")
    proc = subprocess.run([sys.executable, str(HERE / "hostile_gguf.py"), "1", str(COUNT), str(folder)],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    return lines[:-1], lines[-1]


def test_every_mutation_gives_an_answer_or_an_engine_error(fuzz):
    results, _ = fuzz
    assert len(results) == COUNT
    raw = [r for r in results if not (r["outcome"] == "answer" or r["outcome"].startswith("EngineError: "))]
    assert not raw, raw[:5]
    outcomes = collections.Counter(r["outcome"].split(":")[0] for r in results)
    # the fuzz reaches both: files that still load and answer, and files refused
    assert outcomes["answer"] >= 30 and outcomes["EngineError"] >= 100, outcomes


def test_the_errors_name_what_is_wrong(fuzz):
    results, _ = fuzz
    for r in results:
        if r["outcome"].startswith("EngineError") and r["mutation"].startswith("tensor ") \
                and "shorter rows" in r["mutation"] and "token_embd" not in r["mutation"]:
            assert "shape" in r["outcome"], r


def test_time_and_memory_are_bounded(fuzz):
    results, memory = fuzz
    slow = [r for r in results if r["seconds"] > 10]
    assert not slow, slow[:3]
    grown_mb = (memory["peak_kb"] - memory["base_kb"]) / 1024
    assert memory["peak_kb"] / 1024 < 2048 and grown_mb < 2048, memory


@pytest.mark.parametrize("key,value,message", [
    ("llama.rope.freq_base", float("nan"), "rope_theta"),
    ("llama.attention.layer_norm_rms_epsilon", -1e-5, "rms_norm_eps"),
    ("llama.attention.head_count", 0, "head_count"),
    ("llama.block_count", 0x7FFFFFFF, "layers"),
])
def test_silent_garbage_is_refused_at_load(tmp_path, key, value, message):
    sys.path.insert(0, str(HERE))
    try:
        import hostile_gguf
    finally:
        sys.path.remove(str(HERE))
    import mlx_engine
    from mlx_engine.errors import WeightsError

    meta, tensors = hostile_gguf.base_model("llama")
    meta[key] = (value, None)
    path = hostile_gguf.write(tmp_path / "m.gguf", "llama", meta, tensors)
    with pytest.raises(WeightsError, match=message):
        mlx_engine.load(str(path), progress=False)
