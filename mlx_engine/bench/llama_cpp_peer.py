"""llama.cpp as a peer engine: the GGUF file as shipped, through ``llama-cpp-python`` (which vendors llama.cpp and
builds it at install; the ``bench`` extra), on as many threads as this engine uses.

Used by ``mlx-engine bench --compare llama.cpp``: the same runs as for this engine (a prompt of random token ids, then
greedy tokens) and the perplexity of a fixed text, scored the same way as :meth:`Runner.perplexity` (every token after
the first, one window). llama.cpp quantizes activations to 8 bits for its quantized products; we keep them float32.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import numpy as np

from mlx_engine.models.runner import sum_nll


class LlamaCppPeer:
    """One llama.cpp context on ``path`` with ``n_ctx`` cells and ``threads`` threads (default: the CPUs this
    process may use), ``gpu_layers`` layers offloaded to a GPU build's device (-1: all; 0, the default: the CPU).
    ``weights_bytes`` is llama.cpp's own count of the model's tensor bytes.

    Raises:
        RuntimeError: llama-cpp-python is not installed (the message says how to install it).
    """

    name = "llama.cpp"

    def __init__(self, path: "str | Path", n_ctx: int, threads: int | None = None, gpu_layers: int = 0):
        try:
            import llama_cpp
        except ImportError as e:
            raise RuntimeError("llama.cpp is not installed; pip install 'mlx-engine[bench]' (it builds llama.cpp "
                               f"from the llama-cpp-python source distribution, ~15 minutes on 2 cores): {e}") from None
        self._llama_cpp = llama_cpp
        self.path = str(path)
        self.threads = threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                   else os.cpu_count() or 1)
        self.gpu_layers = gpu_layers
        self.llm = llama_cpp.Llama(self.path, n_ctx=n_ctx, n_batch=512, n_threads=self.threads,
                                   n_threads_batch=self.threads, n_gpu_layers=gpu_layers, verbose=False)
        self.weights_bytes = float(llama_cpp.llama_model_size(self.llm.model))
        self.version = getattr(llama_cpp, "__version__", "?")

    def run(self, tokens: list[int], max_tokens: int) -> dict[str, float]:
        """Prefill ``tokens`` on an empty cache and generate ``max_tokens`` greedy tokens (never stopping early).
        Same contract as :meth:`mlx_engine.bench.run.EngineSide.run`, except ``peak_bytes``: llama.cpp's weights
        plus its context state after the run (KV cache and logits, as ``llama_state_get_size`` counts them); its
        compute buffers are not counted (it shares this process with the other engines, so its resident memory
        cannot be told apart)."""
        t0 = time.perf_counter()
        first = None
        n = 0
        for _ in self.llm.generate(list(tokens), temp=0.0, reset=True):
            n += 1
            if first is None:
                first = time.perf_counter()
            if n >= max_tokens:
                break
        end = time.perf_counter()
        return {"ttft_s": first - t0, "decode_tps": (n - 1) / (end - first) if n > 1 and end > first else 0.0,
                "peak_bytes": self.weights_bytes + float(self._llama_cpp.llama_state_get_size(self.llm.ctx)),
                "tokens": float(n)}

    def perplexity(self, tokens: list[int]) -> float:
        """``exp`` of the mean negative log-likelihood of ``tokens[1:]`` given their prefixes, from llama.cpp's
        logits for every position (a second context that keeps them all)."""
        llm = self._llama_cpp.Llama(self.path, n_ctx=max(len(tokens), 8), n_batch=512, n_threads=self.threads,
                                    n_threads_batch=self.threads, n_gpu_layers=self.gpu_layers, logits_all=True,
                                    verbose=False)
        try:
            llm.eval(list(tokens))
            logits = np.asarray(llm.scores[:len(tokens) - 1])
        finally:
            llm.close()
        return math.exp(sum_nll(logits, np.asarray(tokens[1:], np.int64)) / (len(tokens) - 1))

    def close(self) -> None:
        self.llm.close()
