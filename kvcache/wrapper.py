"""The wrapper cache: one cache per layer type (ollama's ``WrapperCache``).

Gemma 3 mixes sliding-window and global layers; a vision-language model mixes self-attention and cross-attention
layers. ``WrapperCache([swa, causal], layer_cache)`` routes ``set_layer(layer)`` (and so ``put`` and ``get``) to
``caches[layer_cache(layer)]`` and forwards everything else to all of its caches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional, Union

from mlx_engine.kvcache.base import Cache, EncoderInputs, FusedSteps, LayerShape
from mlx_engine.errors import CacheError
from mlx_engine.batch import Batch
from mlx_engine.ml import Backend, CacheConfig, Context, DType, RopeAngles, Tensor


class WrapperCache(Cache, FusedSteps, EncoderInputs):
    """Holds several caches and routes each layer to one of them.

    Args:
        caches: the caches, one per layer type.
        layer_cache: the index into ``caches`` for each layer: a list (``layer_cache[layer]``) or a function of the
            layer number.

    ``start_forward`` and ``remove`` are all-or-nothing: every cache checks first, and only when all can proceed do
    they all change (so a ``CacheFullError`` of one leaves all of them unchanged). ``can_resume`` is True only when
    every cache can resume.
    """

    def __init__(self, caches: Sequence[Cache], layer_cache: Union[Callable[[int], int], Sequence[int]]):
        if not caches:
            raise ValueError("a WrapperCache needs at least one cache")
        self.caches = list(caches)
        self.layer_cache = layer_cache
        self._cur: Cache = self.caches[0]
        self._step_split: list[tuple[int, int]] = []  # per cache: its cells and storage tensors in step_tensors
        self._step_routes: dict[tuple[int, ...], list[list[int]]] = {}  # layers -> each cache's share of them

    def cache_index(self, layer: int) -> int:
        """Which of ``caches`` serves ``layer``; raises ``ValueError`` when the routing gives no valid index."""
        lc = self.layer_cache
        try:
            i = lc(layer) if callable(lc) else lc[layer]
        except IndexError:
            raise ValueError(f"layer {layer} has no cache in the layer_cache list of {len(lc)} entries") from None
        if not 0 <= i < len(self.caches):
            raise ValueError(f"layer {layer} is routed to cache {i}, but there are {len(self.caches)} caches")
        return i

    def init(self, backend: Backend, dtype: DType, max_sequences: int, capacity: int, max_batch: int) -> None:
        for c in self.caches:
            c.init(backend, dtype, max_sequences, capacity, max_batch)

    def set_config(self, config: CacheConfig) -> None:
        for c in self.caches:
            c.set_config(config)

    def set_layer(self, layer: int) -> None:
        self._cur = self.caches[self.cache_index(layer)]
        self._cur.set_layer(layer)

    def start_forward(self, ctx: Context, batch: Batch, reserve: bool = False) -> None:
        self.prepare_forward(ctx, batch, reserve)()

    def prepare_forward(self, ctx: Context, batch: Batch, reserve: bool = False) -> Callable[[], None]:
        commits = [c.prepare_forward(ctx, batch, reserve) for c in self.caches]

        def commit() -> None:
            for f in commits:
                f()
        return commit

    def set_causal(self, ctx: Context, both_ways: Sequence[tuple[int, int]], window_both_ways: bool = False) -> None:
        for c in self.caches:
            c.set_causal(ctx, both_ways, window_both_ways)

    def put(self, ctx: Context, key: Tensor, value: Tensor) -> None:
        self._cur.put(ctx, key, value)

    def get(self, ctx: Context) -> tuple[Tensor, Tensor, Optional[Tensor]]:
        return self._cur.get(ctx)

    def attend(self, ctx: Context, q: Tensor, key: Tensor, value: Tensor, scale: float, angles: Optional[RopeAngles],
               dims: int, traditional: bool) -> Optional[Tensor]:
        cur = self._cur
        return cur.attend(ctx, q, key, value, scale, angles, dims, traditional) if isinstance(cur, FusedSteps) else None

    def step_tensors(self, ctx: Context, layers: Sequence[int]) -> Optional[tuple[list[Tensor], list[Tensor]]]:
        cells: list[Tensor] = []
        storage: list[Tensor] = []
        self._step_split = []
        key = tuple(layers)
        if key not in self._step_routes:  # (a decode step asks this every token: the routing, once)
            self._step_routes[key] = [[layer for layer in layers if self.cache_index(layer) == i]
                                      for i in range(len(self.caches))]
        for c, mine in zip(self.caches, self._step_routes[key]):
            got = ([], []) if not mine else c.step_tensors(ctx, mine) if isinstance(c, FusedSteps) else None
            if got is None:
                return None
            cells += got[0]
            storage += got[1]
            self._step_split.append((len(got[0]), len(got[1])))
        return cells, storage

    def load_step_tensors(self, cells: Sequence[Tensor], storage: Sequence[Tensor]) -> None:
        split = self._step_split
        if len(split) != len(self.caches) or sum(n for n, _ in split) != len(cells) \
                or sum(m for _, m in split) != len(storage):
            raise CacheError("load_step_tensors takes the tensors of step_tensors, after it")
        a = b = 0
        for c, (n, m) in zip(self.caches, split):
            if (n or m) and isinstance(c, FusedSteps):
                c.load_step_tensors(cells[a:a + n], storage[b:b + m])
            a, b = a + n, b + m

    def encoder_inputs(self) -> list[tuple[int, int, int]]:
        cur = self._cur
        return cur.encoder_inputs() if isinstance(cur, EncoderInputs) else []

    def reserve(self, ctx: Context, layer_shapes: Sequence[LayerShape]) -> None:
        for i, c in enumerate(self.caches):
            c.reserve(ctx, [s if s is not None and self.cache_index(layer) == i else None
                            for layer, s in enumerate(layer_shapes)])

    def copy_prefix(self, src_seq: int, dst_seq: int, length: int) -> None:
        for c in self.caches:
            c.copy_prefix(src_seq, dst_seq, length)

    def can_resume(self, seq: int, pos: int) -> bool:
        return all(c.can_resume(seq, pos) for c in self.caches)

    def remove(self, seq: int, begin: int, end: Optional[int]) -> None:
        self.prepare_remove(seq, begin, end)()

    def prepare_remove(self, seq: int, begin: int, end: Optional[int]) -> Callable[[], None]:
        commits = [c.prepare_remove(seq, begin, end) for c in self.caches]

        def commit() -> None:
            for f in commits:
                f()
        return commit

    def close(self) -> None:
        for c in self.caches:
            c.close()

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.caches)
