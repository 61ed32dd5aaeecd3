"""A decode step compiled whole: one traced graph from the token id to the logits.

Per-layer compiled blocks (``DecoderModel._compiled_block``) still cost the host a Python call per block and per
attention, a sizeable share of a small model's step, and on a CPU the host's time is not hidden behind the
device's (both cores run the step's products). Traced whole, the step replays from
``Backend.compile``'s cache in one call; what changes from one step to the next goes in as tensors: the token id,
the RoPE angles of its position (or the position, where the backend rotates from positions: a GPU), and the KV
cache's cells and storage (``FusedSteps.step_tensors``). A step that the cache cannot give so (several tokens, a wrapped
sliding-window ring, a quantized cache, storage about to grow) runs block by block, as before, with the same result.
On a GPU, where a step of a small model is bound by per-operation launches and graph building, the step's attention
is MLX operations that read the cells from their array (``Context.cached_attention`` with ``angles=None``).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from mlx_engine.batch import Batch
from mlx_engine.kvcache import Cache, FusedSteps
from mlx_engine.ml import Context, RopeAngles, Tensor



class SteppedModel(Protocol):
    """What a whole step reads of its model (:class:`mlx_engine.models.layers.base.DecoderModel` is one; named so,
    rather than imported, because the model imports this module)."""

    layers: Mapping[int, Any]  # layer index -> its weights
    config: Any  # a DecoderConfig: rope_dims, head_dim
    dtype: Any

    def _rope(self, layer: int) -> tuple[float, float, Any]: ...

    def embed(self, ctx: Context, batch: Batch) -> Tensor: ...

    def run_layers(self, ctx: Context, batch: Batch, h: Tensor, cache: Cache, **kw: Any) -> Tensor: ...

    def logits(self, ctx: Context, batch: Batch, h: Tensor) -> Tensor: ...


class NotWholeStep(Exception):
    """Raised while tracing when a layer's attention cannot take the cache's fused path (the backend has none for
    these tensors): the step would hold numbers of this position, so the model runs block by block instead."""


class WholeStep:
    """The compiled decode step of one model (held by it; it holds the model weakly, so no cycle keeps a closed
    model's weights alive through the trace, which holds them as constants)."""

    def __init__(self, model: SteppedModel, compile: Callable[[Callable[..., Any]], Callable[..., Any]]):
        self._model = weakref.ref(model)
        me = weakref.ref(self)  # the traced function holds this weakly too: no cycle keeps the trace's constants

        def traced(ids: Tensor, *args: Tensor) -> tuple[Tensor, ...]:
            return me()._traced(ids, *args)
        self._fn = compile(traced)
        self.usable = True  # False once a trace found a layer the fused path cannot take (it stays so)
        self._call: tuple[Context, "Cache", Batch, list[int], list[tuple]] | None = None  # what a trace reads
        self._cells = 0
        self._rope_kinds: dict[tuple, tuple] | None = None  # (base, scale, id(freqs)) -> (base, scale, freqs)

    def run(self, ctx: Context, batch: Batch, cache: "Cache") -> Tensor | None:
        """Logits ``[1, vocab]`` of a one-token ``batch`` (after ``cache.start_forward``), its keys and values
        stored; ``None`` (nothing computed or stored) where the step cannot run compiled whole."""
        model = self._model()
        layers = list(model.layers)
        state = cache.step_tensors(ctx, layers) if isinstance(cache, FusedSteps) else None
        if state is None:
            return None
        cells, storage = state
        pos, dims = int(batch.positions[0]), model.config.rope_dims or model.config.head_dim
        if self._rope_kinds is None:  # the model's distinct RoPEs, found once (30 lookups a step otherwise)
            kinds: dict[tuple, tuple] = {}
            for i in layers:
                base, scale, freqs = model._rope(i)
                kinds.setdefault((base, scale, None if freqs is None else id(freqs)), (base, scale, freqs))
            self._rope_kinds = kinds
        ropes = {key: ctx.rope_angles(pos, 1, dims, base, scale, freqs, model.dtype)
                 for key, (base, scale, freqs) in self._rope_kinds.items()}
        # the angles of each RoPE, or where the backend rotates from positions (a GPU), the position
        rope_in = ([t for at in ropes.values() for t in (at.cos, at.sin)] if all(ropes.values()) else
                   [ctx.from_numpy(np.array([pos], np.int32))])
        ids = batch.inputs if isinstance(batch.inputs, Tensor) else ctx.from_numpy(batch.inputs)
        self._call, self._cells = (ctx, cache, batch, layers, list(ropes) if len(rope_in) > 1 else []), len(cells)
        try:
            out = self._fn(ids, *rope_in, *cells, *storage)
        except NotWholeStep:
            cache.load_step_tensors(cells, storage)  # the trace left its placeholders there
            self.usable = False
            return None
        finally:
            self._call = None
        cache.load_step_tensors(cells, out[1:])
        return out[0]

    def _traced(self, ids: Tensor, *args: Tensor) -> tuple[Tensor, ...]:
        """The step on placeholders (run once per shape by ``Backend.compile``): ``(logits, *storage')``."""
        model = self._model()
        ctx, cache, batch, layers, ropes = self._call
        n = 2 * len(ropes) if ropes else 1
        angles = {key: RopeAngles(args[2 * j], args[2 * j + 1]) for j, key in enumerate(ropes)} if ropes else None
        cache.load_step_tensors(args[n:n + self._cells], args[n + self._cells:])
        b = Batch(ids, batch.positions, batch.sequences, batch.outputs)
        h = model.run_layers(ctx, b, model.embed(ctx, b), cache, angles=angles, whole=True,
                             pos_tensor=None if ropes else args[0])
        _, storage = cache.step_tensors(ctx, layers)
        return (model.logits(ctx, b, h), *storage)
