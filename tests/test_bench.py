"""``mlx-engine bench``: a quick run against llama.cpp and mlx-lm on smollm2 gives one JSON object with every figure,
positive and consistent with each other (no speed is asserted: speed is shown by the benchmark, not by tests)."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
from click.testing import CliRunner

from mlx_engine.cli.main import main
from mlx_engine.bench import COMPARED, BenchResult, cpu_threads, format_table

FIGURES = ("prefill_512", "prefill_2048", "decode", "ttft", "peak_memory", "weights_bytes", "bytes_per_token",
           "bandwidth_share", "file_limit_share", "weights_over_file", "perplexity", "decode_ctx_short",
           "decode_ctx_long", "long_context_ratio")
PEER_NAMES = ("llama.cpp", "mlx-lm")
OURS_ONLY = ("chat_ttft_turn1", "chat_ttft_turn10", "chat_turn_ratio", "structured_decode", "structured_ratio")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory, smollm2_gguf):
    from tests.conftest import link_model

    home = tmp_path_factory.mktemp("bench-home")
    link_model(smollm2_gguf.parent, home)
    env = {"MLX_ENGINE_HOME": str(home), "OLLAMA_MODELS": str(home / "no-ollama")}
    # --kv-bits 16: ours with float16 keys and values, as llama.cpp keeps them (the default cache differs only in
    # the bytes it counts per value)
    r = CliRunner().invoke(main, ["bench", "smollm2:135m", "--quick", "--json", "--compare", "llama.cpp",
                                  "--compare", "mlx-lm", "--kv-bits", "16"], env=env, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def _positive(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def test_quick_json_has_every_figure(quick_run):
    d = quick_run
    assert d["model"] == "smollm2:135m" and d["dtype"] == "float32" and tuple(d["peers"]) == PEER_NAMES
    assert d["kv_cache"] == "float16"
    assert list(d["peak_counts"]) == ["mlx-engine", *PEER_NAMES]
    if sys.platform.startswith("linux") and "cpu" in d["device"]:  # llama.cpp's compute buffers counted too
        assert "resident memory" in d["peak_counts"]["llama.cpp"]
    assert d["reps"] == 1 and d["sizes"]["prefill_long"] < 512  # --quick sizes, one repetition
    assert set(COMPARED) == {"decode", "prefill_512", "prefill_2048", "ttft", "peak_memory", "perplexity",
                             "decode_ctx_short", "decode_ctx_long"}
    for name in PEER_NAMES:
        assert set(d["ratios"][name]) == set(COMPARED)
    for side, keys in [(d["ours"], FIGURES + OURS_ONLY)] + [(d["peers"][n], FIGURES) for n in PEER_NAMES]:
        for k in keys:
            assert _positive(side[k]), (k, side.get(k))
    for k in ("gain", "default_seconds", "reference_seconds"):
        assert _positive(d["openblas"][k]), k
    for k in ("copy_bytes_per_s", "read_bytes_per_s", "file_weight_bytes"):
        assert _positive(d["bandwidth"][k]), k
    assert _positive(d["seconds"])
    for engine in ("mlx-engine",) + PEER_NAMES:  # the runs behind the medians
        for figure in ("prefill_512", "prefill_2048", "decode"):
            (run,) = d["runs"][engine][figure]
            assert _positive(run["ttft_s"])
        assert d["runs"][engine]["decode"][0]["tokens"] == d["sizes"]["decode_tokens"]


def test_quick_json_figures_are_consistent(quick_run, smollm2_gguf):
    d = quick_run
    ours = d["ours"]
    file_bytes = d["bandwidth"]["file_weight_bytes"]
    assert 90e6 <= file_bytes <= smollm2_gguf.stat().st_size  # the Q4_1 file's tensors, without its header
    for name in PEER_NAMES:
        peer, ratio = d["peers"][name], d["ratios"][name]
        for k in COMPARED:
            assert ratio[k] == pytest.approx(ours[k] / peer[k], rel=1e-9)
    # llama.cpp and this engine hold the file's quantized tensors (Q4_1 with float16 scales is the same 5 bits a
    # weight); mlx-lm holds them as float32 (135M parameters)
    assert ours["weights_over_file"] <= 1.1 and d["peers"]["llama.cpp"]["weights_over_file"] <= 1.1
    assert 134e6 * 4 <= d["peers"]["mlx-lm"]["weights_bytes"] <= 136e6 * 4
    # the bandwidths are measured once per repetition (one here), each repetition's decode set against its own
    bw = d["bandwidth"]
    (read,), (copy,) = bw["read_bytes_per_s_runs"], bw["copy_bytes_per_s_runs"]
    assert (bw["read_bytes_per_s"], bw["copy_bytes_per_s"]) == (read, copy)
    for name, side in [("mlx-engine", ours)] + list(d["peers"].items()):
        (decode,) = [r["decode_tps"] for r in d["runs"][name]["decode"]]
        assert side["weights_over_file"] == pytest.approx(side["weights_bytes"] / file_bytes, rel=1e-9)
        assert side["file_limit_share"] == pytest.approx(decode * file_bytes / read, rel=1e-9)
        assert side["bandwidth_share"] == pytest.approx(decode * side["bytes_per_token"] / copy, rel=1e-9)
        assert side["perplexity"] < 1000  # an English text, an instruct model: far from uniform (49152)
    # a decode step reads about every weight held (the embedding table is the tied output head)
    assert 0.95 * ours["weights_bytes"] <= ours["bytes_per_token"] <= 1.1 * ours["weights_bytes"]
    assert ours["peak_memory"] >= ours["weights_bytes"]
    # perplexity: with float32 activations, ours on the exact weights and mlx-lm's float32 model agree closely; with int8 activations (MLX_ENGINE_ACTIVATIONS=int8: llama.cpp's Q8
    # blocks) ours moves about as far from the float model as llama.cpp does; both stay near llama.cpp
    if "int8 activations" in d["device"]:
        assert ours["perplexity"] == pytest.approx(d["peers"]["mlx-lm"]["perplexity"], rel=0.03)
    else:
        assert ours["perplexity"] == pytest.approx(d["peers"]["mlx-lm"]["perplexity"], rel=1e-3)
    assert ours["perplexity"] == pytest.approx(d["peers"]["llama.cpp"]["perplexity"], rel=0.05)
    # llama.cpp on an F32 copy of the file's weights takes float activations: ours (float32 activations) matches it
    # far closer than llama.cpp on the file itself (int8 activations: about 4 % away over these 48 tokens)
    reference = d["peers"]["llama.cpp"]["perplexity_f32"]
    assert "F32 copy" in d["float_reference"] and _positive(reference)
    if "int8 activations" not in d["device"]:
        assert ours["perplexity"] == pytest.approx(reference, rel=5e-3)
    for side in [ours, *d["peers"].values()]:  # every engine decodes after both contexts
        assert side["long_context_ratio"] == pytest.approx(side["decode_ctx_long"] / side["decode_ctx_short"],
                                                           rel=1e-9)
    assert ours["chat_turn_ratio"] == pytest.approx(ours["chat_ttft_turn10"] / ours["chat_ttft_turn1"], rel=1e-9)
    ob = d["openblas"]
    assert ob["gain"] == pytest.approx(ob["reference_seconds"] / ob["default_seconds"], rel=1e-9)
    assert "MLX_ENGINE_OPENBLAS=0" in ob["reference_blas"] or "reference" in ob["reference_blas"] \
        or "Accelerate" in ob["reference_blas"]


def test_table_says_which_way_is_better(quick_run):
    table = format_table(BenchResult(**quick_run))
    lines = table.splitlines()
    assert lines[0].split() == ["figure", "mlx-engine", "llama.cpp", "ratio", "vs", "llama.cpp", "mlx-lm", "ratio",
                                "vs", "mlx-lm"]
    assert sum("lower is better" in ln for ln in lines) == 4  # time to first token, peak memory, weights, perplexity
    assert sum("higher is better" in ln for ln in lines) == 7
    assert "decode at 160 over 16 tokens of context: mlx-engine " in table and ", llama.cpp " in table
    assert "OpenBLAS gain" in table and "turn 1 / turn 3" in table and "read bandwidth" in table
    assert "float32, KV cache float16;" in table
    assert "llama.cpp's perplexity on the file's weights dequantized to F32" in table


def test_bench_rejects_an_unknown_peer():
    r = CliRunner().invoke(main, ["bench", "smollm2:135m", "--compare", "vllm"])
    assert r.exit_code == 2 and "llama.cpp" in r.output and "mlx-lm" in r.output


_FAKE_LLAMA_CPP = """
import json, os, signal
__version__ = "fake"
class Llama:
    def __init__(self, path, **kw):
        with open(os.environ["FAKE_LLAMA_LOG"], "a") as f:
            f.write(json.dumps(kw) + "\\n")
        if os.environ.get("FAKE_LLAMA_FAIL") == "open":
            raise ValueError("cannot read the model")
        self.model = self.ctx = None
    def tokenize(self, text, add_bos=True):
        return [1] * len(text.split())
    def eval(self, tokens):
        from llama_cpp import llama_cpp as bindings
        if os.environ.get("FAKE_LLAMA_FAIL") == "amx" and bindings.llama_model_default_params().use_extra_bufts:
            os.kill(os.getpid(), signal.SIGSEGV)  # what llama.cpp's AMX path does on some virtual machines
    def reset(self):
        pass
    def generate(self, tokens, temp=0.0, reset=True):
        print("llama.cpp chatter on standard output")
        if os.environ.get("FAKE_LLAMA_FAIL") == "crash":
            os._exit(3)
        buffer = b"\\x01" * (64 << 20)  # a compute buffer, written: 64 MiB resident while tokens come
        while True:
            yield 1
    def close(self):
        pass
def llama_model_size(model):
    return 1000
def llama_state_get_size(ctx):
    return 24
"""


@pytest.fixture
def fake_llama_cpp(tmp_path, monkeypatch):
    """``_FAKE_LLAMA_CPP`` first on the path of the processes started from here; returns the file its ``Llama``
    writes its arguments to."""
    (tmp_path / "llama_cpp").mkdir()
    (tmp_path / "llama_cpp" / "__init__.py").write_text(_FAKE_LLAMA_CPP)
    (tmp_path / "llama_cpp" / "llama_cpp.py").write_text(  # the bindings: the model's default parameters
        "class Params:\n    use_extra_bufts = True\ndef llama_model_default_params():\n    return Params()\n")
    path = [str(tmp_path)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(tmp_path / "calls.jsonl"))
    return tmp_path / "calls.jsonl"


@pytest.mark.parametrize("on_gpu", [False, True])
def test_llama_cpp_runs_where_the_engine_runs_in_its_own_process(on_gpu, fake_llama_cpp):
    """llama.cpp runs in a child process (its CUDA build crashed in a process that had loaded MLX first), which
    offloads every layer to the GPU where this engine runs on one (``n_gpu_layers=-1``) and none on the CPU. A fake
    ``llama_cpp`` on the child's path records what it is given; what it prints cannot break the replies."""
    from mlx_engine.bench.run import _load_peer

    peer = _load_peer("llama.cpp", "model.gguf", 256, lambda _m: None, on_gpu=on_gpu)
    try:
        r = peer.run([5, 6, 7], 4)
    finally:
        peer.close()
    opened = json.loads(fake_llama_cpp.read_text())
    assert opened["n_gpu_layers"] == (-1 if on_gpu else 0)
    assert opened["n_threads"] == opened["n_threads_batch"] == cpu_threads()  # the threads this engine computes on
    assert peer.version == "fake" and peer.weights_bytes == 1000.0
    assert r["tokens"] == 4.0 and r["ttft_s"] >= 0 and r["decode_tps"] > 0
    if on_gpu or not sys.platform.startswith("linux"):  # weights plus state, as llama.cpp counts them
        assert r["peak_bytes"] == 1024.0 and "compute buffers uncounted" in peer.peak_counts
    else:  # what its process held: the 64 MiB buffer the run wrote counts (less what it freed since the load)
        assert 60 * 2**20 <= r["peak_bytes"] <= 96 * 2**20 and "resident memory" in peer.peak_counts


def test_cpu_threads_follow_the_engine(monkeypatch):
    monkeypatch.setenv("MLX_ENGINE_CPU_THREADS", "3")
    assert cpu_threads() == 3
    monkeypatch.delenv("MLX_ENGINE_CPU_THREADS")
    assert cpu_threads() == len(os.sched_getaffinity(0))


def test_bandwidth_passes_split_the_array_over_the_engines_threads(monkeypatch):
    """The read and copy passes cover every element exactly once, in as many slices at once as the engine has
    threads (one core alone does not reach the memory's bandwidth)."""
    import threading

    from mlx_engine.bench.run import _timed_on_threads

    monkeypatch.setenv("MLX_ENGINE_CPU_THREADS", "3")
    seen, threads, lock = [], set(), threading.Lock()

    def part(lo, hi):
        with lock:
            seen.append((lo, hi))
            threads.add(threading.get_ident())

    assert _timed_on_threads(part, 1000, reps=2) >= 0
    assert len(seen) == 3 * 3  # one untimed pass and two timed, 3 slices each
    assert sorted(seen[:3]) == [(0, 333), (333, 666), (666, 1000)] and sorted(seen[3:6]) == sorted(seen[:3])
    assert 1 <= len(threads) <= 3


def test_llama_cpp_whose_first_prefill_dies_runs_without_repacked_weights(fake_llama_cpp, monkeypatch):
    """llama.cpp killed by a signal on its first prefill (its AMX kernels faulted on a virtual machine) is started
    again without its extra buffer types, and says so."""
    from mlx_engine.bench.llama_cpp_peer import LlamaCppPeer

    monkeypatch.setenv("FAKE_LLAMA_FAIL", "amx")
    peer = LlamaCppPeer("model.gguf", 256)
    try:
        assert peer.repack is False and peer.run([1, 2], 2)["tokens"] == 2.0
    finally:
        peer.close()


@pytest.mark.parametrize("fail", ["open", "crash"])
def test_a_failing_llama_cpp_is_a_clear_error(fail, fake_llama_cpp, monkeypatch):
    """An error in llama.cpp, or its process dying, comes back as a RuntimeError that says so (the bench turns it
    into its error message), never a hang."""
    from mlx_engine.bench.llama_cpp_peer import LlamaCppPeer

    monkeypatch.setenv("FAKE_LLAMA_FAIL", fail)
    with pytest.raises(RuntimeError, match="cannot read the model" if fail == "open" else r"process ended \(exit 3\)"):
        peer = LlamaCppPeer("model.gguf", 256)
        try:
            peer.run([1, 2], 2)
        finally:
            peer.close()
