"""The device thread: the one thread that runs MLX work in the server.

MLX streams belong to the thread that made them, so every load, forward pass and denoising step runs here; the
HTTP side only hands work over and waits on futures or event queues. The loop runs queued calls (loads, unloads,
image generations), then one scheduling step of every text model, and sleeps when there is nothing to do. An image
generation runs as a call whose per-step callback runs the text models' steps, so text requests keep being answered
while an image is denoised.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from mlx_engine.parallel import serving_peer_lost
from mlx_engine.server.scheduler import TextScheduler

log = logging.getLogger("mlx_engine.server")


class DeviceWorker:
    """Owns the device thread. ``call``/``run`` from any thread; ``step_text`` and the scheduler list only on it."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._schedulers: list[TextScheduler] = []
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="mlx-engine-device", daemon=True)

    def start(self) -> None:
        self._thread.start()

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

    def _run_calls(self) -> None:
        while True:
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 -- handed to the waiting request
                fut.set_exception(e)

    def _loop(self) -> None:
        while not self._stopping:
            self._run_calls()
            if not self.step_text() and self._calls.empty():
                self._wake.wait(0.5)
                self._wake.clear()
        self.cancel_all()
        self._run_calls()

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel what runs and end the thread (waits at most ``timeout`` seconds)."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
