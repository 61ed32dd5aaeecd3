"""The windowed causal caches: :class:`CausalCache` with its window, memory or chunk fixed (ollama's
``NewSWACache``, ``NewSWAMemCache`` and ``NewChunkedAttentionCache``)."""

from __future__ import annotations

from typing import Optional

from mlx_engine.kvcache.base import ShiftFn
from mlx_engine.kvcache.causal import CausalCache


class SlidingWindowCache(CausalCache):
    """Sliding-window attention: the token at ``p`` sees positions ``p - window .. p`` of its sequence.

    Storage stays at most ``(window + max_batch)`` cells per sequence (a ring), however long the sequence runs.
    See :class:`CausalCache` for the arguments.
    """

    def __init__(self, window: int, shift_fn: Optional[ShiftFn] = None, kv_bits: Optional[int] = None,
                 kv_group_size: int = 64):
        super().__init__(shift_fn, kv_bits, kv_group_size, window=window)


class SlidingWindowMemoryCache(CausalCache):
    """A sliding window that keeps ``memory >= window`` positions before the lowest batch position of a sequence, so
    that a sequence can be rolled back up to ``memory - window`` positions and resumed (ollama's ``SWAMemCache``).
    Storage stays at most ``(memory + max_batch)`` cells per sequence."""

    def __init__(self, window: int, memory: int, shift_fn: Optional[ShiftFn] = None, kv_bits: Optional[int] = None,
                 kv_group_size: int = 64):
        super().__init__(shift_fn, kv_bits, kv_group_size, window=window, memory=memory)


class ChunkedAttentionCache(CausalCache):
    """Chunked attention (Llama 4): the token at ``p`` sees positions ``floor(p / chunk) * chunk .. p`` of its
    sequence; cells of earlier chunks are reused. Storage stays at most ``chunk + max_batch`` cells per sequence."""

    def __init__(self, chunk: int, shift_fn: Optional[ShiftFn] = None, kv_bits: Optional[int] = None,
                 kv_group_size: int = 64):
        super().__init__(shift_fn, kv_bits, kv_group_size, chunk=chunk)
