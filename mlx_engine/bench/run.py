"""The benchmark behind ``mlx-engine bench``: this engine and (optionally) its peers on the same file, side by side:
llama.cpp on the GGUF file as shipped (:mod:`mlx_engine.bench.llama_cpp_peer`) and mlx-lm on the same weights
dequantized to float32 (:mod:`mlx_engine.bench.mlx_lm_peer`).

Figures (medians over ``reps`` repetitions after one warm-up run of each; the engines alternate run by run, and the
order flips every repetition, so that a busy machine slows both alike):

- ``prefill_512``, ``prefill_2048``: prompt tokens per second for a prompt of that many tokens on an empty cache,
  i.e. prompt tokens over the time to the first token (as mlx-lm and ``GenerationStats`` count it);
- ``decode``: generated tokens per second over ``decode_tokens`` (128) greedy tokens after a 128-token prompt,
  counted from the first token to the last;
- ``ttft``: seconds to the first token of that 128-token prompt;
- ``peak_memory``: the device's peak bytes during the 2048-token and the decode runs, counting this engine's weights,
  KV cache and intermediates (what the other engine holds is subtracted); llama.cpp's (in a process of its own):
  on a CPU under Linux, its process's resident high-water mark over its resident memory before the model's load,
  which counts its compute buffers as far as they are touched (elsewhere its weights and context state only);
  ``peak_counts`` says what each engine's figure counts;
- ``bandwidth_share``: decode tokens/s times the bytes a decode step must read (every weight used per token, the
  output head included, plus the keys and values it attends to at the middle of the run), over the memory bandwidth
  of a large copy (read + written bytes over its time, as STREAM counts a copy; on the CPU on as many threads as
  the engine computes on);
- ``file_limit_share``: the figure a user compares: decode tokens/s times the bytes of the file's weight tensors,
  over the read bandwidth of the engine's device (a sum over a large array, on the CPU split over as many threads
  as the engine computes on); 1.0 is the limit the file's own bytes set, whatever engine reads them. Both
  bandwidths are measured in every repetition, right after its decode runs, and each share is the median over the
  repetitions of their decode over their own bandwidth (a shared machine's bandwidth drifts by a third from one
  minute to the next);
- ``weights_over_file``: the bytes of weights this engine holds over the file's tensor bytes;
- ``perplexity``: of a fixed English text (the first ``perplexity_tokens`` tokens of ``PERPLEXITY_TEXT``), every
  engine's own logits, scored the same way; with llama.cpp also ``perplexity_f32`` among its figures: its perplexity
  on an F32 copy of the file's weights, where its products take float activations as ours do by default
  (:mod:`mlx_engine.bench.float_reference`; ``float_reference`` says how it was measured, or why not);
- ``decode_ctx_short`` / ``decode_ctx_long``: decode tokens/s after 128 and 4096 tokens of context, of every engine
  (compared: at 4096 a step reads the KV cache's bytes beside the weights, as many again as smollm2's weights with
  float32 keys and values; sliding-window layers keep it nearly flat), each prompt prefilled once and every
  repetition decoding from its end; ``long_context_ratio``: long over short, for each;
- ``chat_ttft_turn1`` / ``chat_ttft_turn10``: time to first token of turn 1 and turn 10 (the last turn: 3 in a quick
  run) of one chat session, each turn prefilling only its new message;
- ``structured_decode`` / ``structured_ratio``: this engine's decode tokens/s under a JSON Schema (an array of
  integers that cannot end early: a grammar mask computed and applied on every token), and its ratio to free decode
  of as many tokens after the same prompt, the two alternating: what structured output costs per token;
- ``openblas``: the time of a float32 matmul in a child process with ``MLX_ENGINE_OPENBLAS=0`` (the ``mlx[cpu]``
  wheel's reference BLAS) over the same in a child with the default (OpenBLAS loaded first): the gain on Linux.

``ratios[peer]`` maps each compared figure to ours divided by that peer's: above 1 is better for rates, below 1 is
better for ``ttft``, ``peak_memory`` and ``perplexity``. Prompts are random token ids from a fixed seed; decoding is greedy and never stops
early, in both engines.

This module imports no ``mlx``: the engine is driven through :mod:`mlx_engine.api` and the ``ml`` interfaces, the
peers through their own modules.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from mlx_engine.bench.float_reference import float_reference_perplexity
from mlx_engine.bench.text import PERPLEXITY_TEXT
from mlx_engine.ml import DType

COMPARED = ("decode", "prefill_512", "prefill_2048", "ttft", "peak_memory", "perplexity", "decode_ctx_short",
            "decode_ctx_long")
LOWER_IS_BETTER = ("ttft", "peak_memory", "perplexity")
PEERS = ("llama.cpp", "mlx-lm")


@dataclass
class BenchSizes:
    """Token counts of each figure. The figure names keep the full-size counts (``prefill_512``...) also in a
    ``quick`` run, whose real counts are these."""

    prefill_short: int = 512
    prefill_long: int = 2048
    decode_prompt: int = 128
    decode_tokens: int = 128
    context_short: int = 128
    context_long: int = 4096
    context_tokens: int = 32
    chat_turns: int = 10
    chat_tokens: int = 24
    copy_bytes: int = 256 * 2**20
    matmul_n: int = 1024
    perplexity_tokens: int = 1024

    @classmethod
    def quick(cls) -> "BenchSizes":
        """Tiny sizes for a smoke run (seconds, not minutes): the numbers are not meaningful."""
        return cls(prefill_short=48, prefill_long=96, decode_prompt=16, decode_tokens=8, context_short=16,
                   context_long=160, context_tokens=4, chat_turns=3, chat_tokens=4, copy_bytes=64 * 2**20,
                   matmul_n=192, perplexity_tokens=48)


@dataclass
class BenchResult:
    """Everything one bench run measured (see the module docstring). Times in seconds, memory in bytes, rates in
    tokens per second, bandwidth in bytes per second. ``runs`` keeps every timed run behind the medians (per engine
    and figure: ``ttft_s``, ``decode_tps``, ``peak_bytes``, ``tokens``)."""

    model: str
    device: str
    dtype: str
    kv_cache: str  # what the KV cache keeps keys and values as: float32, float16, bfloat16, 8-bit or 4-bit
    machine: dict[str, Any]
    sizes: dict[str, int]
    reps: int
    ours: dict[str, float] = field(default_factory=dict)
    peers: dict[str, dict[str, float]] = field(default_factory=dict)
    ratios: dict[str, dict[str, float]] = field(default_factory=dict)
    # the medians of the bandwidths measured in each repetition (and, ``*_runs``, each of them)
    bandwidth: dict[str, Any] = field(default_factory=dict)
    openblas: dict[str, Any] = field(default_factory=dict)
    runs: dict[str, dict[str, list[dict[str, float]]]] = field(default_factory=dict)
    peak_counts: dict[str, str] = field(default_factory=dict)  # per engine: what its peak_memory counts
    # with llama.cpp: how its perplexity on the weights as F32 (peers["llama.cpp"]["perplexity_f32"]) was measured,
    # or why it was not (mlx_engine.bench.float_reference)
    float_reference: str = ""
    seconds: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    """``n`` token ids drawn from a fixed seed, away from the low ids where special tokens usually live."""
    rng = np.random.default_rng(seed)
    lo = min(1000, vocab // 4)
    return rng.integers(lo, max(lo + 1, min(vocab, 32000)), n).tolist()


# ---------------------------------------------------------------------------------------------- this engine's side


class EngineSide:
    """This engine, measured run by run. Every run gets a fresh runner (an empty KV cache), as mlx-lm gets a
    fresh prompt cache."""

    name = "mlx-engine"
    peak_counts = "MLX's peak of allocated bytes"

    def __init__(self, model: Any):
        self.model = model
        self.backend = model.backend

    def _runner(self, max_sequences: int = 1) -> Any:
        from mlx_engine.models.generation.runner import Runner

        m = self.model
        return Runner(m.text_model, m.tokenizer, context_length=m.context_length, max_sequences=max_sequences,
                      kv_bits=m.kv_bits)

    def run(self, tokens: list[int], max_tokens: int) -> dict[str, float]:
        """Same contract as :meth:`mlx_engine.bench.mlx_lm_peer.MLXLMPeer.run`."""
        from mlx_engine.models.generation.runner import Request

        runner = self._runner()
        others = self.backend.active_memory() - self.backend.weights_nbytes()
        req = Request(list(tokens), max_tokens=max_tokens)
        t0 = time.perf_counter()
        first = None
        n = 0
        for _ in runner.generate_tokens(req):  # resets the peak first
            n += 1
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        peak = self.backend.peak_memory() - others
        runner.cache.close()
        return {"ttft_s": first - t0, "decode_tps": (n - 1) / (end - first) if n > 1 and end > first else 0.0,
                "peak_bytes": float(peak), "tokens": float(n)}

    def perplexity(self, tokens: list[int]) -> float:
        """``exp`` of the mean negative log-likelihood of ``tokens[1:]`` (see :meth:`Runner.perplexity`)."""
        import math

        runner = self._runner()
        with self.backend.new_context() as ctx:
            nll, _ = runner.perplexity(ctx, tokens)
        runner.cache.close()
        return math.exp(nll)

    def decode_at_context(self, prompt: list[int], tokens: int, reps: int) -> float:
        """Median decode tokens/s of ``tokens`` tokens after ``prompt``: the prompt is prefilled once, and every
        repetition rewinds to its end (the runner reuses the cached prompt) and decodes again."""
        from mlx_engine.models.generation.runner import GenerationStats, Request

        runner = self._runner()
        rates = []
        for i in range(reps + 1):
            stats = GenerationStats()
            for _ in runner.generate_tokens(Request(list(prompt), max_tokens=tokens), stats):
                pass
            if i:  # the first run prefilled the prompt and warmed up
                rates.append(stats.decode_tps)
        runner.cache.close()
        return _median(rates)

    def structured_decode(self, prompt: list[int], tokens: int, reps: int) -> tuple[float, float]:
        """Median decode tokens/s of ``tokens`` tokens after ``prompt``, free and under a JSON Schema that cannot
        end sooner (an array of at least ``tokens`` integers), alternating; the prompt is prefilled once."""
        from mlx_engine.api import GenerationOptions
        from mlx_engine.models.generation.runner import GenerationStats, Request

        fmt = GenerationOptions.parse({"json_schema": {"type": "array", "items": {"type": "integer"},
                                                       "minItems": tokens}}).response_format
        runner = self._runner()
        free, held = [], []
        for i in range(reps + 1):
            for rates, f in ((free, None), (held, fmt)):
                stats = GenerationStats()
                for _ in runner.generate_tokens(Request(list(prompt), max_tokens=tokens, response_format=f), stats):
                    pass
                if i:  # the first round prefilled the prompt, built the grammar's tokenizer and warmed up
                    rates.append(stats.decode_tps)
        runner.cache.close()
        return _median(free), _median(held)

    def chat_ttft(self, turns: int, max_tokens: int) -> list[float]:
        """Time to first token of each turn of one chat session (greedy answers of at most ``max_tokens``)."""
        from mlx_engine.api import ChatSession

        seq = self.model.runner.max_sequences - 1
        session = ChatSession(self.model, seq, "You are a helpful assistant. Answer in one short sentence.",
                              {"max_tokens": max_tokens})
        out = []
        topics = ["rivers", "the moon", "bread", "bicycles", "volcanoes", "music", "glass", "bees", "trains",
                  "paper", "salt", "clouds"]
        try:
            for i in range(turns):
                for _ in session.send(f"Tell me one fact about {topics[i % len(topics)]}."):
                    pass
                out.append(session.last_stats.ttft_s)
        finally:
            session.clear()
        return out

    def bytes_per_token(self, context: int) -> int:
        """Bytes a single-token decode step must read at ``context`` tokens of context: every weight a token uses
        (the embedding table only as the tied output head; its one looked-up row is ignored) plus the keys and values
        each layer attends to (a sliding-window layer sees at most ``window + 1`` of them)."""
        tm = self.model.text_model
        c = tm.config
        seen: set[int] = set()
        total = 0

        def add(t: Any) -> None:
            nonlocal total
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                total += t.nbytes

        for lw in tm.layers.values():
            for t in lw.values():
                add(t)
        add(tm.w.get("model.norm.weight"))
        add(tm.head)
        from mlx_engine.kvcache.storage import kv_value_bytes

        per_value = kv_value_bytes(self.model.kv_bits, tm.dtype.itemsize)
        for i in range(c.num_layers):
            visible = min(context, c.sliding_window + 1) if tm.is_sliding(i) and c.sliding_window else context
            total += tm.kv_width(i) * visible * per_value
        return int(total)

    def copy_bandwidth(self, nbytes: int, reps: int = 5) -> float:
        """Memory bandwidth in bytes/s (read + written) of a copy of ``nbytes``, median of ``reps``. On the CPU the
        copy is NumPy's (``memcpy`` between buffers already touched, so that no page fault is timed; MLX allocates
        a fresh output per operation), split over the threads this engine computes on (:func:`cpu_threads`); on a
        GPU it is a copy through the backend."""
        if getattr(self.backend, "device", "cpu") == "cpu":
            src = np.ones(max(1, nbytes // 4), np.float32)
            dst = np.zeros_like(src)
            return 2 * src.nbytes / _timed_on_threads(lambda lo, hi: np.copyto(dst[lo:hi], src[lo:hi]), src.size,
                                                      reps)
        n, seconds = self._device_pass(nbytes, reps, lambda x: x + 1.0)
        return 2 * n / seconds

    def read_bandwidth(self, nbytes: int, reps: int = 5) -> float:
        """Memory read bandwidth in bytes/s of the device this engine runs on: on the CPU, :func:`read_bandwidth`;
        on a GPU, a sum over ``nbytes`` of float32 through the backend (one pass over device memory), median of
        ``reps``."""
        if getattr(self.backend, "device", "cpu") == "cpu":
            return read_bandwidth(nbytes, reps)
        n, seconds = self._device_pass(nbytes, reps, lambda x: x.sum())
        return n / seconds

    def _device_pass(self, nbytes: int, reps: int, op: Callable[[Any], Any]) -> tuple[int, float]:
        """``op`` over ``nbytes`` of float32 on the backend's device: the array's bytes and the median seconds of
        ``reps`` evaluations after one untimed."""
        ctx = self.backend.new_context()
        x = ctx.full((max(1, nbytes // 4),), 1.0, DType.FLOAT32)
        ctx.evaluate(x)
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            y = op(x)
            ctx.evaluate(y)
            times.append(time.perf_counter() - t0)
            del y
        ctx.close()
        return x.nbytes, _median(times[1:])


# --------------------------------------------------------------------------------------------------- OpenBLAS probe


def matmul_probe(n: int, reps: int = 3) -> dict[str, Any]:
    """Median seconds of an ``n x n`` float32 matmul on the CPU through the MLX backend, and the BLAS in use. Run in
    a child process by :func:`openblas_gain` (the BLAS is chosen when ``mlx`` is first imported)."""
    from mlx_engine.mlx import MLXBackend, blas_description

    backend = MLXBackend(None, device="cpu")
    ctx = backend.new_context()
    rng = np.random.default_rng(0)
    a = ctx.from_numpy(rng.standard_normal((n, n), dtype=np.float32))
    b = ctx.from_numpy(rng.standard_normal((n, n), dtype=np.float32))
    ctx.evaluate(a, b)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        ctx.evaluate(a @ b)
        times.append(time.perf_counter() - t0)
    return {"seconds": _median(times[1:]), "blas": blas_description()}


def _probe_child(n: int, openblas: bool) -> dict[str, Any]:
    env = dict(os.environ)
    env["MLX_ENGINE_DEVICE"] = "cpu"
    if openblas:
        env.pop("MLX_ENGINE_OPENBLAS", None)
    else:
        env["MLX_ENGINE_OPENBLAS"] = "0"
    code = f"import json; from mlx_engine.bench import matmul_probe; print(json.dumps(matmul_probe({int(n)})))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"the matmul probe failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def openblas_gain(n: int, pairs: int = 3) -> dict[str, Any]:
    """The matmul time with the reference BLAS over the time with the default (OpenBLAS on Linux), each measured in
    its own child process, ``pairs`` children of each kind alternating (medians). ``gain`` is that ratio (about 1
    where nothing differs, e.g. on macOS)."""
    default, reference = [], []
    for _ in range(pairs):
        default.append(_probe_child(n, True))
        reference.append(_probe_child(n, False))
    d = _median([r["seconds"] for r in default])
    r = _median([r["seconds"] for r in reference])
    return {"matmul_n": n, "default_seconds": d, "default_blas": default[0]["blas"], "reference_seconds": r,
            "reference_blas": reference[0]["blas"], "gain": r / d}


# ------------------------------------------------------------------------------------------------------- the bench


def cpu_threads() -> int:
    """The threads this engine's CPU kernels compute on (``$MLX_ENGINE_CPU_THREADS``, else the CPUs this process
    may run on), which the bandwidth passes and llama.cpp use too."""
    try:
        asked = int(os.environ.get("MLX_ENGINE_CPU_THREADS", "0"))
    except ValueError:
        asked = 0
    if asked > 0:
        return asked
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _timed_on_threads(part: Callable[[int, int], Any], n: int, reps: int) -> float:
    """Median seconds, over ``reps`` after one untimed, of ``part(lo, hi)`` run on :func:`cpu_threads` threads at
    once over equal slices of ``[0, n)`` (NumPy lets go of the GIL in its loops, so the slices run in parallel: one
    core alone does not reach the memory's bandwidth; figures in docs/performance.md)."""
    from concurrent.futures import ThreadPoolExecutor

    k = max(1, min(cpu_threads(), n))
    bounds = [(n * i // k, n * (i + 1) // k) for i in range(k)]
    times = []
    with ThreadPoolExecutor(k) as pool:
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            list(pool.map(lambda b: part(*b), bounds))
            times.append(time.perf_counter() - t0)
    return _median(times[1:])


def read_bandwidth(nbytes: int, reps: int = 5) -> float:
    """Memory read bandwidth in bytes/s: a sum over ``nbytes`` of float32 already in memory (NumPy, one pass, split
    over :func:`cpu_threads` threads), median of ``reps``. The limit a decode step that reads every weight once can
    reach."""
    a = np.ones(max(1, nbytes // 4), np.float32)
    return a.nbytes / _timed_on_threads(lambda lo, hi: a[lo:hi].sum(), a.size, reps)


def file_weight_bytes(path: Any) -> int:
    """Bytes of the weight tensors in a model file (a GGUF file's tensor data; a folder's safetensors files)."""
    from pathlib import Path

    from mlx_engine.weights import GGUFFile

    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        with GGUFFile(p) as wf:
            return sum(wf.info(n).nbytes for n in wf.names())
    files = [p] if p.is_file() else sorted(p.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files)


def _load_peer(name: str, path: Any, n_ctx: int, say: Callable[[str], None], on_gpu: bool = False) -> Any:
    """The peer engine ``name`` on ``path``; with ``on_gpu`` (this engine runs on a GPU) llama.cpp offloads every
    layer to its GPU build (mlx-lm runs on MLX's default device either way)."""
    if name == "mlx-lm":
        from mlx_engine.bench.mlx_lm_peer import MLXLMPeer

        say("loading mlx-lm on the same weights (dequantized by the gguf package, float32)")
        return MLXLMPeer(path)
    from mlx_engine.bench.llama_cpp_peer import LlamaCppPeer

    say("loading llama.cpp on the same GGUF file" + (", every layer on the GPU" if on_gpu else ""))
    return LlamaCppPeer(path, n_ctx, threads=cpu_threads(), gpu_layers=-1 if on_gpu else 0)


def run_bench(model_name: str, *, reps: int = 3, compare: "list[str] | tuple[str, ...] | str | None" = None,
              quick: bool = False, kv_bits: int | None = None, activations: str | None = None,
              progress: Callable[[str], None] | None = None) -> BenchResult:
    """Measure ``model_name`` (and each peer in ``compare``: ``"llama.cpp"``, ``"mlx-lm"``) on the same file, ours
    with the KV cache ``kv_bits`` and the ``activations`` asked for (as :func:`mlx_engine.api.load`'s).

    Raises:
        InvalidRequestError: an unknown peer, llama.cpp on a file that is not GGUF, or ``reps < 1``.
        EngineError: a peer that is not installed (the message says how to install it).
        ModelNotFoundError, WeightsError: as :func:`mlx_engine.api.load`.
    """
    from mlx_engine.api import load
    from mlx_engine.errors import EngineError, InvalidRequestError

    names = [compare] if isinstance(compare, str) else list(dict.fromkeys(compare or ()))
    for n in names:
        if n not in PEERS:
            raise InvalidRequestError(f"cannot compare with {n!r}; the peer engines are {', '.join(PEERS)}")
    if reps < 1:
        raise InvalidRequestError(f"reps must be at least 1, got {reps}")
    say = progress or (lambda _msg: None)
    sizes = BenchSizes.quick() if quick else BenchSizes()
    t_start = time.perf_counter()

    say(f"loading {model_name}")
    n_ctx = max(sizes.context_long, sizes.prefill_long) + sizes.decode_tokens + 64
    model = load(model_name, progress=False, context_length=n_ctx, kv_bits=kv_bits, activations=activations)
    if "llama.cpp" in names and model.path.suffix != ".gguf":
        raise InvalidRequestError(f"llama.cpp reads GGUF files; {model.name} is {model.path.name}")
    ours = EngineSide(model)
    peers = []
    for n in names:
        try:
            peers.append(_load_peer(n, model.path, n_ctx, say, on_gpu=model.backend.device != "cpu"))
        except RuntimeError as e:
            raise EngineError(str(e)) from None
    vocab = model.text_model.config.vocab_size
    engines = [ours] + peers

    # (figure, prompt length, tokens to generate)
    runs = {
        "prefill_512": (sizes.prefill_short, 1),
        "prefill_2048": (sizes.prefill_long, 1),
        "decode": (sizes.decode_prompt, sizes.decode_tokens),
    }
    prompts = {k: random_prompt(n, vocab, seed=i) for i, (k, (n, _)) in enumerate(runs.items())}
    samples: dict[str, dict[str, list[dict[str, float]]]] = {e.name: {k: [] for k in runs} for e in engines}
    # the bandwidths, measured in each repetition right after its decode runs: on a shared machine they drift by a
    # third from one minute to the next (docs/performance.md), so each repetition's decode
    # is set against the bandwidth of its own minute
    reads, copies = [], []
    for rep in range(reps + 1):  # rep 0 is the warm-up
        say("warm-up" if rep == 0 else f"repetition {rep} of {reps}")
        order = engines if rep % 2 == 0 else engines[::-1]
        for key, (_, gen) in runs.items():
            for e in order:
                r = e.run(prompts[key], gen)
                if rep:
                    samples[e.name][key].append(r)
        if rep:
            reads.append(ours.read_bandwidth(sizes.copy_bytes))
            copies.append(ours.copy_bandwidth(sizes.copy_bytes))

    def figures(name: str) -> dict[str, float]:
        s = samples[name]
        return {
            "prefill_512": _median([sizes.prefill_short / r["ttft_s"] for r in s["prefill_512"]]),
            "prefill_2048": _median([sizes.prefill_long / r["ttft_s"] for r in s["prefill_2048"]]),
            "decode": _median([r["decode_tps"] for r in s["decode"]]),
            "ttft": _median([r["ttft_s"] for r in s["decode"]]),
            "peak_memory": _median([max(a["peak_bytes"], b["peak_bytes"])
                                    for a, b in zip(s["prefill_2048"], s["decode"])]),
        }

    file_bytes = file_weight_bytes(model.path)
    bpt = ours.bytes_per_token(sizes.decode_prompt + sizes.decode_tokens // 2)

    def add_shares(f: dict[str, float], name: str, weights_bytes: float) -> None:
        # the median over repetitions of each one's decode over its own bandwidth
        decodes = [r["decode_tps"] for r in samples[name]["decode"]]
        f["weights_bytes"] = float(weights_bytes)
        f["weights_over_file"] = weights_bytes / file_bytes
        f["bytes_per_token"] = float(bpt)
        f["bandwidth_share"] = _median([d * bpt / c for d, c in zip(decodes, copies)])
        f["file_limit_share"] = _median([d * file_bytes / r for d, r in zip(decodes, reads)])

    say("perplexity")
    ppl_tokens = model.text_tokens(PERPLEXITY_TEXT)[:sizes.perplexity_tokens]
    result_ours = figures(ours.name)
    add_shares(result_ours, ours.name, model.backend.weights_nbytes())
    result_ours["perplexity"] = ours.perplexity(ppl_tokens)

    say(f"decode at {sizes.context_short} and {sizes.context_long} tokens of context")
    at_context: dict[str, dict[str, float]] = {e.name: {} for e in engines}
    for key, n, seed in (("decode_ctx_short", sizes.context_short, 7), ("decode_ctx_long", sizes.context_long, 8)):
        prompt = random_prompt(n, vocab, seed)
        for e in engines:  # each prefills the prompt once, then decodes from its end in every repetition
            at_context[e.name][key] = e.decode_at_context(prompt, sizes.context_tokens, reps)
    for name, f in at_context.items():
        f["long_context_ratio"] = f["decode_ctx_long"] / f["decode_ctx_short"]
    result_ours.update(at_context[ours.name])

    say("decode under a JSON schema")
    free, held = ours.structured_decode(random_prompt(sizes.context_short, vocab, 9), sizes.context_tokens, reps)
    result_ours["structured_decode"] = held
    result_ours["structured_ratio"] = held / free

    say(f"chat: {sizes.chat_turns} turns")
    turns = [ours.chat_ttft(sizes.chat_turns, sizes.chat_tokens) for _ in range(reps)]
    result_ours["chat_ttft_turn1"] = _median([t[0] for t in turns])
    result_ours["chat_ttft_turn10"] = _median([t[-1] for t in turns])
    result_ours["chat_turn_ratio"] = result_ours["chat_ttft_turn10"] / result_ours["chat_ttft_turn1"]

    result = BenchResult(
        model=model.name, device=model.backend_name, dtype=model.text_model.dtype.value, kv_cache=model.kv_cache_type,
        machine={"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                 "cpus": os.cpu_count() or 0},
        sizes=asdict(sizes), reps=reps, ours=result_ours,
        bandwidth={"copy_bytes_per_s": _median(copies), "read_bytes_per_s": _median(reads),
                   "copy_bytes_per_s_runs": copies, "read_bytes_per_s_runs": reads,
                   "copy_bytes": float(sizes.copy_bytes), "file_weight_bytes": float(file_bytes)},
        runs=samples, peak_counts={ours.name: ours.peak_counts},
    )
    for peer in peers:
        p = figures(peer.name)
        add_shares(p, peer.name, peer.weights_bytes)
        p["perplexity"] = peer.perplexity(ppl_tokens)
        p.update(at_context[peer.name])
        if peer.name == "llama.cpp":
            value, result.float_reference = float_reference_perplexity(
                lambda path: peer.perplexity(ppl_tokens, path=path), model.path, say)
            if value is not None:
                p["perplexity_f32"] = value
        result.peers[peer.name] = p
        result.peak_counts[peer.name] = peer.peak_counts
        result.ratios[peer.name] = {k: result_ours[k] / p[k] for k in COMPARED}

    say("OpenBLAS gain (matmul in child processes)")
    result.openblas = openblas_gain(sizes.matmul_n, pairs=reps)
    result.seconds = time.perf_counter() - t_start
    for peer in peers:
        close = getattr(peer, "close", None)
        if close is not None:
            close()
    model.close()
    return result
