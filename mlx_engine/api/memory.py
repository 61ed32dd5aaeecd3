"""The process's memory: how much it holds (resident, MLX's active, cached and peak bytes) and giving freed memory back
to the system (the server's device thread does so when idle)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

from mlx_engine.mlx import MLXBackend

__all__ = ["memory_in_use", "memory_stats", "limit_buffer_cache", "release_memory"]


def memory_in_use() -> int:
    """Bytes of device memory the process holds now (MLX's active memory)."""
    return MLXBackend().active_memory()


def memory_stats() -> dict[str, int | None]:
    """The process's memory now, in bytes: ``resident`` (RSS, from ``/proc``; None where there is none, as on macOS),
    and MLX's ``mlx_active`` (arrays alive), ``mlx_cache`` (freed buffers kept for reuse) and ``mlx_peak`` (the most
    active since start)."""
    b = MLXBackend()
    return {"resident": _resident_bytes(), "mlx_active": b.active_memory(), "mlx_cache": b.cache_memory(),
            "mlx_peak": b.peak_memory()}


def _resident_bytes() -> int | None:
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def limit_buffer_cache(nbytes: int) -> int:
    """Keep at most ``nbytes`` of freed buffers for reuse (MLX's cache limit), or MLX's own default where that is
    lower. Returns the limit now in force, bytes."""
    b = MLXBackend()
    default = b.set_cache_limit(nbytes)
    if default < nbytes:
        b.set_cache_limit(default)
    return min(default, nbytes)


def release_memory(collect: bool = True) -> None:
    """Give freed memory back to the system: with ``collect``, Python's unreachable cycles are collected first (arrays
    they hold are freed; about 0.1 s for a server), then MLX's buffer cache and the heap's free pages are returned
    (``Backend.clear_cache``)."""
    if collect:
        gc.collect()
    MLXBackend().clear_cache()
