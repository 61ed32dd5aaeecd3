"""llama.cpp as a peer engine: the GGUF file as shipped, through ``llama-cpp-python`` (which vendors llama.cpp and
builds it at install; the ``bench`` extra), on as many threads as this engine uses.

Used by ``mlx-engine bench --compare llama.cpp``: the same runs as for this engine (a prompt of random token ids, then
greedy tokens) and the perplexity of a fixed text, scored the same way as :meth:`Runner.perplexity` (every token after
the first, one window). llama.cpp quantizes activations to 8 bits for its quantized products; we keep them float32.

llama.cpp runs in a process of its own, which imports it before any other native library: its CUDA build crashed
(a segmentation fault as it read the model's vocabulary) in a process that had loaded MLX, or NumPy, first, on an
H100 machine whose llama.cpp was built with another C++ compiler than its Python's libraries. Its own process also
keeps its memory and threads out of this engine's figures. Requests and replies are lines of JSON on the child's
standard input and on a copy of its standard output (its own standard output goes to its standard error, so that
nothing llama.cpp prints can break a reply).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("mlx_engine.bench")

# The child: llama.cpp first, then this module's serve() (which imports NumPy and the scorer).
_CHILD = "import llama_cpp  # noqa: F401\nfrom mlx_engine.bench.llama_cpp_peer import serve\nserve()\n"


# What a run's ``peak_bytes`` counts, by the child's word for it.
PEAK_COUNTS = {"resident": "its process's resident memory (high-water mark since before the model's load)",
               "state": "its weights and context state (KV cache, logits); its compute buffers uncounted"}


class LlamaCppPeer:
    """One llama.cpp context on ``path`` with ``n_ctx`` cells and ``threads`` threads (default: the CPUs this
    process may use), ``gpu_layers`` layers offloaded to a GPU build's device (-1: all; 0, the default: the CPU),
    in a child process. ``weights_bytes`` is llama.cpp's own count of the model's tensor bytes. ``lookup``: above 0,
    llama-cpp-python's prompt-lookup speculative decoding (``LlamaPromptLookupDecoding``, its default n-grams of up
    to 2 tokens) drafting that many tokens per pass.

    ``repack``: whether llama.cpp's extra buffer types (weights repacked for its CPU kernels, AMX tiles among them)
    are on. They are, unless a first prefill with them kills llama.cpp's process: its AMX path faulted on a prefill
    (a general protection fault at ``ldtilecfg``) on a virtual machine whose CPU reports AMX; the peer then runs
    without them, and says so here.

    Raises:
        RuntimeError: llama-cpp-python is not installed (the message says how to install it), or llama.cpp's
            process failed (the message ends with what it printed).
    """

    name = "llama.cpp"
    peak_counts = "not measured yet"

    def __init__(self, path: "str | Path", n_ctx: int, threads: int | None = None, gpu_layers: int = 0,
                 lookup: int = 0):
        if importlib.util.find_spec("llama_cpp") is None:
            raise RuntimeError("llama.cpp is not installed; pip install 'mlx-engine[bench]' (it builds llama.cpp "
                               "from the llama-cpp-python source distribution, ~15 minutes on 2 cores)")
        self.path = str(path)
        self.threads = threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                   else os.cpu_count() or 1)
        self.gpu_layers = gpu_layers
        for self.repack in (True, False):
            self._log = tempfile.TemporaryFile()
            self._proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=self._log, text=True)
            try:
                info = self._ask(op="open", path=self.path, n_ctx=n_ctx, threads=self.threads,
                                 gpu_layers=gpu_layers, lookup=lookup, repack=self.repack)
                break
            except RuntimeError as e:
                self.close()  # the child and its log go with the failed load
                if not self.repack or self._proc.returncode >= 0:
                    raise
                log.warning("llama.cpp died on its first prefill (%s); running it without repacked weights", e)
        self.weights_bytes = float(info["weights_bytes"])
        self.version = info["version"]

    def _ask(self, **request: Any) -> dict[str, Any]:
        try:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        reply = json.loads(line) if line.strip() else {"error": f"its process ended (exit {self._proc.wait()})"}
        if "error" in reply:
            self._log.seek(0)
            printed = self._log.read().decode("utf-8", "replace").strip().splitlines()[-5:]
            raise RuntimeError(f"llama.cpp failed: {reply['error']}" + ("; it printed: " + " | ".join(printed)
                                                                        if printed else ""))
        return reply

    def run(self, tokens: list[int], max_tokens: int) -> dict[str, float]:
        """Prefill ``tokens`` on an empty cache and generate ``max_tokens`` greedy tokens (never stopping early).
        Same contract as :meth:`mlx_engine.bench.run.EngineSide.run` (timed in llama.cpp's process), except
        ``peak_bytes``: on a CPU under Linux, the growth of llama.cpp's process's resident memory from before the
        model's load to its high-water mark during the run (``VmHWM`` in ``/proc/self/status``, reset before the
        run): the file's pages it maps and reads, its repacked tensors, KV cache, logits and the compute buffers its
        scheduler reserves, as far as they are touched (those buffers are sized for a whole batch of logits: 514 MiB
        for gemma3's 262144-token vocabulary at 512 tokens, most of it never written). Elsewhere (a GPU's memory,
        or no ``/proc``): its weights plus its context state (KV cache and logits, as ``llama_state_get_size``
        counts them), its compute buffers uncounted. The peer's ``peak_counts`` then says which it was."""
        return self.generate(tokens, max_tokens)[0]

    def generate(self, tokens: list[int], max_tokens: int) -> tuple[dict[str, float], list[int]]:
        """:meth:`run`, and the generated token ids."""
        reply = self._ask(op="run", tokens=[int(t) for t in tokens], max_tokens=int(max_tokens))
        self.peak_counts = PEAK_COUNTS[reply["result"].pop("peak_counts")]
        return reply["result"], reply["ids"]

    def decode_at_context(self, prompt: list[int], tokens: int, reps: int) -> float:
        """Median decode tokens/s of ``tokens`` greedy tokens after ``prompt``, as
        :meth:`mlx_engine.bench.run.EngineSide.decode_at_context` measures ours: the prompt is prefilled once, and
        every repetition (after one untimed) keeps its cells but for the last token, which it feeds again
        (llama-cpp-python's prefix reuse), then decodes."""
        reply = self._ask(op="context", tokens=[int(t) for t in prompt], max_tokens=int(tokens), reps=int(reps))
        return float(reply["decode_tps"])

    def perplexity(self, tokens: list[int], path: "str | None" = None) -> float:
        """``exp`` of the mean negative log-likelihood of ``tokens[1:]`` given their prefixes, from llama.cpp's
        logits for every position (a second context that keeps them all), on the opened file or on the GGUF file
        ``path`` (another form of its weights: see :mod:`mlx_engine.bench.float_reference`)."""
        return float(self._ask(op="perplexity", tokens=[int(t) for t in tokens], path=path)["perplexity"])

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._proc.stdin.write(json.dumps({"op": "close"}) + "\n")
                self._proc.stdin.close()
                self._proc.wait(timeout=30)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._proc.stdout.close()
        self._log.close()


def serve() -> None:
    """The child's loop: one JSON request per line on standard input, one JSON reply per line (``{"error": ...}``
    for a failed request) until ``close`` or the end of input."""
    import llama_cpp
    import numpy as np

    from mlx_engine.models.generation.scoring import sum_nll

    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever llama.cpp prints goes to standard error
    llm, opened, before_load = None, {}, None
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        if op == "close":
            break
        try:
            if op == "open":
                opened = request
                before_load = _proc_status_bytes("VmRSS")
                lookup = None
                if request["lookup"]:
                    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

                    lookup = LlamaPromptLookupDecoding(num_pred_tokens=request["lookup"])
                if not request["repack"]:
                    from llama_cpp import llama_cpp as bindings

                    _without_repacking(bindings)
                llm = llama_cpp.Llama(request["path"], n_ctx=request["n_ctx"], n_batch=512,
                                      n_threads=request["threads"], n_threads_batch=request["threads"],
                                      n_gpu_layers=request["gpu_layers"], draft_model=lookup, verbose=False)
                # a first prefill (within the context asked for): it dies here if its kernels do
                llm.eval(llm.tokenize(b"Hello " * 64)[:max(1, request["n_ctx"] - 1)])
                llm.reset()
                reply = {"weights_bytes": float(llama_cpp.llama_model_size(llm.model)),
                         "version": getattr(llama_cpp, "__version__", "?")}
            elif op == "run":
                resident = opened["gpu_layers"] == 0 and before_load is not None and _reset_peak()
                ids: list[int] = []
                reply = {"result": _timed_run(llm, request["tokens"], request["max_tokens"], ids), "ids": ids}
                if resident:
                    peak = _proc_status_bytes("VmHWM") - before_load
                else:
                    peak = (float(llama_cpp.llama_model_size(llm.model))
                            + float(llama_cpp.llama_state_get_size(llm.ctx)))
                reply["result"].update(peak_bytes=float(peak), peak_counts="resident" if resident else "state")
            elif op == "context":
                rates = [_timed_run(llm, request["tokens"], request["max_tokens"])["decode_tps"]
                         for _ in range(request["reps"] + 1)]
                reply = {"decode_tps": float(np.median(rates[1:]))}  # the first run prefilled the prompt
            elif op == "perplexity":
                tokens = request["tokens"]
                scorer = llama_cpp.Llama(request.get("path") or opened["path"], n_ctx=max(len(tokens), 8), n_batch=512,
                                         n_threads=opened["threads"], n_threads_batch=opened["threads"],
                                         n_gpu_layers=opened["gpu_layers"], logits_all=True, verbose=False)
                try:
                    scorer.eval(list(tokens))
                    logits = np.asarray(scorer.scores[:len(tokens) - 1])
                finally:
                    scorer.close()
                nll = sum_nll(logits, np.asarray(tokens[1:], np.int64)) / (len(tokens) - 1)
                reply = {"perplexity": math.exp(nll)}
            else:
                reply = {"error": f"unknown request {op!r}"}
        except Exception as e:  # noqa: BLE001 - any failure goes back to the bench as a message
            reply = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    if llm is not None:
        llm.close()


def _without_repacking(bindings: Any) -> None:
    """Make llama-cpp-python's models load without llama.cpp's extra buffer types (``use_extra_bufts``: repacked
    weights, AMX): its ``Llama`` takes its model parameters from ``llama_model_default_params`` and offers no
    argument for that one."""
    default = bindings.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    bindings.llama_model_default_params = params


def _proc_status_bytes(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in bytes; None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Resets this process's resident high-water mark (``VmHWM``) to its resident memory now (Linux's
    ``/proc/self/clear_refs``, value 5); False where that cannot be done."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _proc_status_bytes("VmHWM") is not None
    except OSError:
        return False


def _timed_run(llm: Any, tokens: list[int], max_tokens: int, ids: "list[int] | None" = None) -> dict[str, float]:
    """Greedy ``max_tokens`` tokens after ``tokens`` on a fresh cache, timed; the tokens appended to ``ids``."""
    t0 = time.perf_counter()
    first = None
    n = 0
    for t in llm.generate(list(tokens), temp=0.0, reset=True):
        if ids is not None:
            ids.append(int(t))
        n += 1
        if first is None:
            first = time.perf_counter()
        if n >= max_tokens:
            break
    end = time.perf_counter()
    return {"ttft_s": first - t0, "decode_tps": (n - 1) / (end - first) if n > 1 and end > first else 0.0,
            "tokens": float(n)}
