"""The benchmark behind ``mlx-engine bench`` (:mod:`mlx_engine.bench.run`) and its peer engines
(:mod:`mlx_engine.bench.llama_cpp_peer`, :mod:`mlx_engine.bench.mlx_lm_peer`). It sits above the API and the runner,
which it drives; nothing below it imports it, and ``mlx_lm`` and ``llama_cpp`` are imported only here and by the
tests."""

from mlx_engine.bench.run import (COMPARED, LOWER_IS_BETTER, PEERS, PERPLEXITY_TEXT, BenchResult, BenchSizes,
                                  cpu_threads, file_weight_bytes, matmul_probe, openblas_gain, read_bandwidth,
                                  run_bench)
from mlx_engine.bench.table import format_table

__all__ = ["COMPARED", "LOWER_IS_BETTER", "PEERS", "PERPLEXITY_TEXT", "BenchResult", "BenchSizes",
           "cpu_threads", "file_weight_bytes", "format_table", "matmul_probe", "openblas_gain", "read_bandwidth",
           "run_bench"]
