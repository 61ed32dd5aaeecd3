"""The device thread: the one thread that runs MLX work in the server.

MLX streams belong to the thread that made them, so every load, forward pass and denoising step runs here; the
HTTP side only hands work over and waits on futures or event queues. The loop runs queued calls (loads, unloads,
image generations), then one scheduling step of every text model, and sleeps when there is nothing to do. An image
generation runs as a call whose per-step callback runs the text models' steps, so text requests keep being answered
while an image is denoised.

Memory. The thread gives freed memory back to the system (:func:`mlx_engine.api.release_memory`: MLX's buffer cache
and the C heap's free pages) once it has been idle for ``_IDLE_S`` after work or an unload, and every
``_RELEASE_EVERY_S`` while busy (mlx-lm clears MLX's cache every 256 decoded tokens and after each prefill chunk; we
go by time, since on CPU a release also returns pages that the next steps must fault in again). MLX's cache is held
to ``BUFFER_CACHE_LIMIT`` in between. Without this a 30-minute soak's server grew from 651 MiB resident at its fifth
minute to 754 MiB at the end (+16 %) while MLX's active memory stayed flat: freed buffers kept in glibc's heap.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from mlx_engine import api
from mlx_engine.api.parallel import serving_peer_lost
from mlx_engine.server.scheduler import TextScheduler

log = logging.getLogger("mlx_engine.server")

BUFFER_CACHE_LIMIT = 1 << 30  # bytes of freed buffers MLX keeps for reuse (its default on Metal is all of memory)
_IDLE_S = 0.5  # no work for this long: freed memory goes back to the system
_RELEASE_EVERY_S = 30.0  # while busy


class DeviceWorker:
    """Owns the device thread. ``call``/``run`` from any thread; ``step_text`` and the scheduler list only on it."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._schedulers: list[TextScheduler] = []
        self._wake = threading.Event()
        self._stopping = False
        self._dirty = False  # memory was freed since it was last given back: give it back when idle
        self._thread = threading.Thread(target=self._loop, name="mlx-engine-device", daemon=True)

    def start(self) -> None:
        api.limit_buffer_cache(BUFFER_CACHE_LIMIT)
        self._thread.start()

    def release_soon(self) -> None:
        """A model was let go: give its memory back to the system once the device thread is idle (by then the
        requests and the pool have dropped their references to it)."""
        self._dirty = True

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn`` on the device thread between scheduling steps; its result or exception lands in the future."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, fut))
        self._wake.set()
        return fut

    async def run(self, fn: Callable[[], Any]) -> Any:
        """``call`` awaited from the event loop."""
        return await asyncio.wrap_future(self.call(fn))

    def wake(self) -> None:
        """New text work was submitted."""
        self._wake.set()

    def add_scheduler(self, scheduler: TextScheduler) -> None:
        self._schedulers.append(scheduler)

    def remove_scheduler(self, scheduler: TextScheduler) -> None:
        if scheduler in self._schedulers:
            self._schedulers.remove(scheduler)

    def cancel_all(self) -> None:
        """End every queued and running text request (each gets its final event). Device thread only."""
        for s in list(self._schedulers):
            s.close()

    def step_text(self) -> bool:
        """One step of every text model; whether any has work left. Device thread only."""
        busy = False
        for s in list(self._schedulers):
            try:
                busy |= s.step()
            except Exception as e:  # noqa: BLE001 -- a scheduler bug must not stop the device thread
                if s.distributed and isinstance(e, RuntimeError):  # a rank of its split model is gone
                    s.fail_all(serving_peer_lost(e))
                    continue
                log.exception("text scheduling step failed")
        return busy

    def _run_calls(self) -> bool:
        """Run the queued calls; whether there were any."""
        ran = False
        while True:
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return ran
            ran = True
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 -- handed to the waiting request
                fut.set_exception(e)

    def _loop(self) -> None:
        released = time.monotonic()
        while not self._stopping:
            busy = self._run_calls()
            busy = self.step_text() or busy
            self._dirty |= busy
            idle = not busy and self._calls.empty()
            if idle:
                idle = not self._wake.wait(_IDLE_S)  # nothing came for _IDLE_S
                self._wake.clear()
            if self._dirty and (idle or time.monotonic() - released >= _RELEASE_EVERY_S):
                self._dirty = False
                api.release_memory(collect=idle)  # a full garbage collection would stall running answers
                released = time.monotonic()
        self.cancel_all()
        self._run_calls()

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel what runs and end the thread (waits at most ``timeout`` seconds)."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
