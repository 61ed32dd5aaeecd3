"""``mlx-engine bench``: a quick run against mlx-lm on smollm2 gives one JSON object with every figure, positive and
consistent with each other (no speed is asserted: speed is shown by the benchmark, not by tests)."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from mlx_engine.cli.main import main
from mlx_engine.bench import COMPARED, BenchResult, format_table

FIGURES = ("prefill_512", "prefill_2048", "decode", "ttft", "peak_memory", "weights_bytes", "bytes_per_token",
           "bandwidth_share")
OURS_ONLY = ("decode_ctx_short", "decode_ctx_long", "long_context_ratio", "chat_ttft_turn1", "chat_ttft_turn10",
             "chat_turn_ratio")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory, smollm2_gguf):
    from tests.conftest import link_model

    home = tmp_path_factory.mktemp("bench-home")
    link_model(smollm2_gguf.parent, home)
    env = {"MLX_ENGINE_HOME": str(home), "OLLAMA_MODELS": str(home / "no-ollama")}
    r = CliRunner().invoke(main, ["bench", "smollm2:135m", "--quick", "--json", "--compare", "mlx-lm"], env=env,
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def _positive(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def test_quick_json_has_every_figure(quick_run):
    d = quick_run
    assert d["model"] == "smollm2:135m" and d["dtype"] == "float32" and d["peer_name"] == "mlx-lm"
    assert d["reps"] == 1 and d["sizes"]["prefill_long"] < 512  # --quick sizes, one repetition
    assert set(d["ratio"]) == set(COMPARED) == {"decode", "prefill_512", "prefill_2048", "ttft", "peak_memory"}
    for side, keys in (("ours", FIGURES + OURS_ONLY), ("peer", FIGURES)):
        for k in keys:
            assert _positive(d[side][k]), (side, k, d[side].get(k))
    for k in ("gain", "default_seconds", "reference_seconds"):
        assert _positive(d["openblas"][k]), k
    assert _positive(d["bandwidth"]["copy_bytes_per_s"]) and _positive(d["seconds"])
    for engine in ("mlx-engine", "mlx-lm"):  # the runs behind the medians
        for figure in ("prefill_512", "prefill_2048", "decode"):
            (run,) = d["runs"][engine][figure]
            assert _positive(run["ttft_s"]) and _positive(run["peak_bytes"])
        assert d["runs"][engine]["decode"][0]["tokens"] == d["sizes"]["decode_tokens"]


def test_quick_json_figures_are_consistent(quick_run):
    d = quick_run
    ours, peer, ratio = d["ours"], d["peer"], d["ratio"]
    for k in COMPARED:
        assert ratio[k] == pytest.approx(ours[k] / peer[k], rel=1e-9)
    # both engines hold the same float32 weights (smollm2: 135M parameters); the peak counts them, and a decode
    # step reads about all of them (the embedding table is the tied output head)
    assert ours["weights_bytes"] == pytest.approx(peer["weights_bytes"], rel=0.01)
    assert 134e6 * 4 <= ours["weights_bytes"] <= 136e6 * 4
    for side in (ours, peer):
        assert side["peak_memory"] >= side["weights_bytes"]
        assert 0.95 * side["weights_bytes"] <= side["bytes_per_token"] <= 1.1 * side["weights_bytes"]
        assert side["bandwidth_share"] == pytest.approx(
            side["decode"] * side["bytes_per_token"] / d["bandwidth"]["copy_bytes_per_s"], rel=1e-9)
    assert ours["bytes_per_token"] == peer["bytes_per_token"]
    assert ours["long_context_ratio"] == pytest.approx(ours["decode_ctx_long"] / ours["decode_ctx_short"], rel=1e-9)
    assert ours["chat_turn_ratio"] == pytest.approx(ours["chat_ttft_turn10"] / ours["chat_ttft_turn1"], rel=1e-9)
    ob = d["openblas"]
    assert ob["gain"] == pytest.approx(ob["reference_seconds"] / ob["default_seconds"], rel=1e-9)
    assert "MLX_ENGINE_OPENBLAS=0" in ob["reference_blas"] or "reference" in ob["reference_blas"] \
        or "Accelerate" in ob["reference_blas"]


def test_table_says_which_way_is_better(quick_run):
    table = format_table(BenchResult(**quick_run))
    lines = table.splitlines()
    assert lines[0].split() == ["figure", "mlx-engine", "mlx-lm", "ratio"]
    assert sum("lower is better" in ln for ln in lines) == 2  # time to first token, peak memory
    assert sum("higher is better" in ln for ln in lines) == 4
    assert "OpenBLAS gain" in table and "turn 1 / turn 3" in table


def test_bench_rejects_an_unknown_peer():
    r = CliRunner().invoke(main, ["bench", "smollm2:135m", "--compare", "llama.cpp"])
    assert r.exit_code == 2 and "llama.cpp" in r.output
