"""One model over several ranks: the forward pass of a shard, and how rank 0 drives the others.

Rank 0 runs the engine as usual (tokenizer, runner, sampler, chat, server) on a :class:`DistributedModel`; the other
ranks run :func:`follow`, a loop that does what rank 0 tells it: every forward pass and every change to a KV cache
(``init``, ``reserve``, ``remove``, ``copy_prefix``, ``close``) goes to them as a small control message, so that every
rank's cache holds the same cells for its own layers (or heads). The tensors themselves (hidden states between
pipeline stages, the partial sums of tensor parallelism, the token sampled on rank 0 for the next decode step) move
inside the lazy graph, through the ``Group`` interface, so decode stays pipelined.

Every collective runs in the same order on every rank: rank 0 dispatches each forward pass as soon as it has built it
(whether or not its caller reads the logits), and the control message of the next one waits behind it on the
device's stream. A rank that is gone makes the others' next collective raise ``RuntimeError`` within moments (the
transport sees the connection close); :func:`follow` turns that into :class:`PeerLostError`. Where the transport
had already given that peer up (it died between two passes), rank 0's next control message would wait for ever:
rank 0's :attr:`DistributedModel.watch` ends the process then, with a message that says so.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any, Optional

import numpy as np

from mlx_engine.batch import Batch
from mlx_engine.errors import CacheError, EngineError, UnsupportedError
from mlx_engine.kvcache import Cache, FusedSteps
from mlx_engine.group import Group
from mlx_engine.ml import Backend, Context, DType, Tensor
from mlx_engine.models.layers.base import DecoderModel
from mlx_engine.models.layers.sharding import Plan, stage_rank

__all__ = ["DistributedModel", "MirroredCache", "PeerLostError", "follow"]


@contextlib.contextmanager
def _uninterrupted() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) back until the block ends: a step that one rank has told the others about must also
    run here, or the ranks' collectives would pair up wrongly and wait for ever. Only the main thread gets signals;
    elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[Any] = []
    previous = signal.signal(signal.SIGINT, lambda *a: caught.append(a))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught and callable(previous):
            previous(*caught[0])
        elif caught:
            raise KeyboardInterrupt


class PeerLostError(EngineError):
    """Another rank of the distributed run is gone (exited, killed, or its connection dropped)."""


def peer_lost(rank: int, e: BaseException) -> PeerLostError:
    return PeerLostError(f"rank {rank}: another rank of the distributed run is gone ({e}); stopping. Start every "
                         "rank again (mlx.launch restarts them all)")


class DistributedModel:
    """A :class:`DecoderModel` shard that runs its forward passes in step with the other ranks.

    Offers what the runner uses of a model (``forward``, ``make_cache``, ``dtype``, ``backend``, ``config`` and the
    rest through the shard). ``config`` is the whole model's (all heads); the shard's own is ``model.config``.

    Args:
        model: this rank's shard (its layers, or its heads of every layer).
        full_config: the model's config before sharding.
        group: the ranks. plan: this rank's share (:mod:`mlx_engine.models.layers.sharding`).
    """

    def __init__(self, model: DecoderModel, full_config: Any, group: Group, plan: Plan):
        self.model = model
        self.config = full_config
        self.group = group
        self.plan = plan
        self._next_cache = 0
        self.stopped = False
        #: each rank's share, from :meth:`rank_stats` at load (rank, layers, heads, weights_bytes, peak_bytes...)
        self.ranks: list[dict[str, Any]] = []
        #: rank 0: told when each control message starts and ends (``arm()``, ``disarm()``), or None; the loader's
        #: ends the process when a message takes too long (a peer gone between two passes)
        self.watch: Any = None
        self._pending: tuple[Context, Tensor] | None = None  # the pass last dispatched, until the next message

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    # ---- control messages (rank 0 -> the others) ------------------------------------------------------------------
    def send_control(self, op: str, **args: Any) -> None:
        """Rank 0: tell the other ranks to do ``op``. The pass dispatched before (whose collectives the message would
        wait behind) is waited for first, so that :attr:`watch` times the message alone: every other rank is waiting
        for it by then."""
        if self._pending is not None:
            ctx, out = self._pending
            self._pending = None
            ctx.evaluate(out)
        if self.watch is not None:
            self.watch.arm()
        try:
            self.group.broadcast_bytes(json.dumps({"op": op, **args}).encode())
        finally:
            if self.watch is not None:
                self.watch.disarm()

    def receive_control(self) -> dict[str, Any]:
        """Another rank: the next message from rank 0."""
        return json.loads(self.group.broadcast_bytes(None))

    def lost(self, e: BaseException) -> PeerLostError:
        """Rank 0: a collective failed because another rank is gone; the error to raise. No collective runs after
        this, :meth:`stop` included: the ring transport ends its thread for a peer once it fails that peer's
        transfers, so a later transfer to it would wait for ever."""
        self.stopped = True
        return peer_lost(self.group.rank, e)

    def stop(self) -> None:
        """Rank 0: let the other ranks' :func:`follow` return (idempotent; a gone peer is ignored here, and nothing
        is sent once :meth:`lost` has been called)."""
        if self.stopped or self.group.rank != 0:
            return
        self.stopped = True
        try:
            self.send_control("stop")
        except RuntimeError:
            pass

    def rank_stats(self) -> list[dict[str, Any]]:
        """Rank 0: each rank's layers, heads, weight bytes and peak memory, in rank order."""
        self.send_control("stats")
        return self._exchange_stats()

    def _exchange_stats(self) -> list[dict[str, Any]]:
        b = self.model.backend
        mine = {"rank": self.group.rank, "layers": [self.plan.layers.start, self.plan.layers.stop],
                "heads": list(self.plan.heads), "weights_bytes": int(b.weights_nbytes()),
                "peak_bytes": int(b.peak_memory()), "active_bytes": int(b.active_memory())}
        return [json.loads(x) for x in self.group.exchange(json.dumps(mine).encode())]

    # ---- rank 0's side ----------------------------------------------------------------------------------------
    def make_cache(self, kv_bits: int | None = None) -> "MirroredCache":
        cid = self._next_cache
        self._next_cache += 1
        return MirroredCache(self.model.make_cache(kv_bits), self, cid, kv_bits)

    def forward(self, ctx: Context, batch: Batch, cache: "MirroredCache", hidden_only: bool = False,
                output_layer: int | None = None) -> Tensor:
        """Logits ``[K, vocab]`` of the batch's outputs, computed across the ranks (see :meth:`DecoderModel.forward`;
        hidden states and embeddings in place of tokens are not offered here). Raises ``CacheFullError`` with
        nothing sent when the cache has no room."""
        if hidden_only or output_layer is not None or batch.embeddings is not None:
            raise UnsupportedError("a distributed model gives logits only (no hidden states or input embeddings)")
        on_device = not isinstance(batch.inputs, np.ndarray)
        with _uninterrupted():
            cache.inner.start_forward(ctx, batch)
            self.send_control("forward", cache=cache.cid, positions=batch.positions.tolist(),
                              sequences=batch.sequences.tolist(), outputs=batch.outputs.tolist(),
                              inputs=None if on_device else batch.inputs.tolist())
            out = self.run(ctx, batch, cache.inner)
            ctx.evaluate_async(out)  # every rank runs this pass's collectives now, whether or not the caller reads it
            self._pending = (ctx, out)
        return out

    # ---- every rank ---------------------------------------------------------------------------------------------
    def run(self, ctx: Context, batch: Batch, cache: Cache) -> Tensor:
        """This rank's share of one forward pass (after ``start_forward``): rank 0 returns the logits, another rank
        the tensor whose evaluation performs its share (its sends and collectives). ``batch.inputs`` is None on the
        other ranks when the tokens are on rank 0's device (the last sampled ones). Pipeline: rank 0 embeds and sends
        the hidden states to the first stage, which is why the other ranks need no tokens."""
        n = len(batch.positions)
        g, m = self.group, self.model
        if self.plan.mode == "tensor":
            if not isinstance(batch.inputs, np.ndarray):  # the sampled tokens, from rank 0 to everyone
                mine = (batch.inputs.reshape(n).astype(DType.INT32) if g.rank == 0
                        else ctx.zeros((n,), DType.INT32))
                batch = replace(batch, inputs=g.all_sum(mine))
            h = m.run_layers(ctx, batch, m.embed(ctx, batch), cache)
            return m.logits(ctx, batch, h) if g.rank == 0 else h
        stage, last = self.plan.stage, len(self.plan.stages) - 1
        shape = (1, n, self.config.hidden_size)
        if g.rank == 0:  # the last stage; it also holds the embeddings (tied to the head, or beside it) and embeds
            sent = g.send(m.embed(ctx, batch), stage_rank(0, g.size))
            h = g.depends(g.recv(shape, m.dtype, stage_rank(stage - 1, g.size)), sent)
        else:
            h = g.recv(shape, m.dtype, 0 if stage == 0 else stage_rank(stage - 1, g.size))
        h = m.run_layers(ctx, batch, h, cache)
        if stage == last:
            return m.logits(ctx, batch, h)
        return g.send(h, stage_rank(stage + 1, g.size))


class MirroredCache(Cache, FusedSteps):
    """Rank 0's KV cache, whose every change the other ranks repeat on theirs (each for its own layers or heads).

    Reads (``get``, ``can_resume``...) stay local; ``start_forward`` travels with the forward pass's message. A
    change that fails here (``remove`` of a shared cell, say) is not sent, so the ranks never disagree."""

    def __init__(self, inner: Cache, owner: DistributedModel, cid: int, kv_bits: int | None):
        self.inner = inner
        self.owner = owner
        self.cid = cid
        self.kv_bits = kv_bits

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def set_layer(self, layer: int) -> None:
        self.inner.set_layer(layer)

    def put(self, ctx: Context, key: Tensor, value: Tensor) -> None:
        self.inner.put(ctx, key, value)

    def get(self, ctx: Context) -> tuple[Tensor, Tensor, Optional[Tensor]]:
        return self.inner.get(ctx)

    def attend(self, ctx: Context, q: Tensor, key: Tensor, value: Tensor, scale: float, angles: Any, dims: int,
               traditional: bool) -> Optional[Tensor]:
        inner = self.inner
        return inner.attend(ctx, q, key, value, scale, angles, dims, traditional) if isinstance(inner, FusedSteps) \
            else None

    def step_tensors(self, ctx: Context, layers: Sequence[int]) -> Optional[tuple[list[Tensor], list[Tensor]]]:
        return None  # a distributed model's step is never traced whole: its ranks exchange tensors within it

    def load_step_tensors(self, cells: Sequence[Tensor], storage: Sequence[Tensor]) -> None:
        raise CacheError("a distributed model's cache has no tensors for a decode step compiled whole")

    def set_config(self, config: Any) -> None:
        self.inner.set_config(config)

    def init(self, backend: Backend, dtype: DType, max_sequences: int, capacity: int, max_batch: int) -> None:
        with _uninterrupted():
            self.inner.init(backend, dtype, max_sequences, capacity, max_batch)
            self.owner.send_control("init", cache=self.cid, kv_bits=self.kv_bits, dtype=dtype.value,
                                    max_sequences=max_sequences, capacity=capacity, max_batch=max_batch)

    def start_forward(self, ctx: Context, batch: Batch, reserve: bool = False) -> None:
        raise UnsupportedError("a distributed model's cache starts its forward passes itself")

    def reserve(self, ctx: Context, layer_shapes: Sequence[Any]) -> None:
        with _uninterrupted():
            self.inner.reserve(ctx, layer_shapes)
            self.owner.send_control("reserve", cache=self.cid)

    def copy_prefix(self, src_seq: int, dst_seq: int, length: int) -> None:
        with _uninterrupted():
            self.inner.copy_prefix(src_seq, dst_seq, length)
            self.owner.send_control("copy_prefix", cache=self.cid, args=[src_seq, dst_seq, length])

    def can_resume(self, seq: int, pos: int) -> bool:
        return self.inner.can_resume(seq, pos)

    def remove(self, seq: int, begin: int, end: Optional[int]) -> None:
        with _uninterrupted():
            self.inner.remove(seq, begin, end)
            self.owner.send_control("remove", cache=self.cid, args=[seq, begin, end])

    def close(self) -> None:
        with _uninterrupted():
            self.inner.close()
            if not self.owner.stopped:
                self.owner.send_control("close", cache=self.cid)

    def nbytes(self) -> int:
        return self.inner.nbytes()


def follow(model: DistributedModel) -> None:
    """A rank other than 0: do what rank 0 says until it says stop.

    Raises:
        PeerLostError: rank 0 (or another rank) is gone.
    """
    backend = model.model.backend
    caches: dict[int, Cache] = {}
    ctx = backend.new_context()
    try:
        while True:
            msg = model.receive_control()
            op = msg["op"]
            if op == "stop":
                return
            if op == "stats":
                model._exchange_stats()
                continue
            if op == "init":
                cache = model.model.make_cache(msg["kv_bits"])
                cache.init(backend, DType(msg["dtype"]), msg["max_sequences"], msg["capacity"], msg["max_batch"])
                caches[msg["cache"]] = cache
                continue
            cache = caches[msg["cache"]]
            if op == "forward":
                inputs = np.asarray(msg["inputs"], np.int32) if msg["inputs"] is not None else None
                batch = Batch(inputs, msg["positions"], msg["sequences"], msg["outputs"])
                cache.start_forward(ctx, batch)
                ctx.evaluate(model.run(ctx, batch, cache))
            elif op == "reserve":
                cache.reserve(ctx, model.model.layer_kv_shapes())
            elif op == "remove":
                cache.remove(*msg["args"])
            elif op == "copy_prefix":
                cache.copy_prefix(*msg["args"])
            elif op == "close":
                cache.close()
                del caches[msg["cache"]]
    except RuntimeError as e:
        raise peer_lost(model.group.rank, e) from None
