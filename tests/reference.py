"""Reference models for parity tests: mlx-lm's own ``llama`` / ``gemma3_text`` classes on weights that the ``gguf``
package dequantizes, independent of our readers and models (the code lives in ``mlx_engine.bench.mlx_lm_peer``, which
the benchmark uses too)."""

from __future__ import annotations

from mlx_engine.bench.mlx_lm_peer import dequantized_tensors, mlx_lm_greedy, mlx_lm_model  # noqa: F401
