"""Streaming an answer to the terminal, shared by ``run`` and ``chat``: Ctrl-C handling and the model's one-line
description."""

from __future__ import annotations

import signal

from mlx_engine.store import format_count


def describe_model(model) -> str:
    """``name (architecture, parameters, quantization) on device, KV cache type`` of a loaded model."""
    info = getattr(model, "info", {}) or {}
    bits = [info.get("architecture") or getattr(model, "architecture", None)]
    params = info.get("parameters")
    if isinstance(params, int):
        bits.append(format_count(params))
    elif params:
        bits.append(str(params))
    if info.get("quantization"):
        bits.append(str(info["quantization"]))
    desc = ", ".join(b for b in bits if b)
    kv = getattr(model, "kv_cache_type", None)
    return f"{model.name} ({desc}) on {model.backend_name}" + (f", KV cache {kv}" if kv else "")


class StopOnInterrupt:
    """While active, the first Ctrl-C only sets :attr:`hit` (checked between streamed chunks, so the generator is
    closed at a clean point); a second Ctrl-C raises ``KeyboardInterrupt`` at once."""

    def __init__(self) -> None:
        self.hit = False
        self._old = None

    def _handler(self, signum, frame) -> None:
        if self.hit:
            raise KeyboardInterrupt
        self.hit = True

    def __enter__(self) -> "StopOnInterrupt":
        self.hit = False
        try:
            self._old = signal.signal(signal.SIGINT, self._handler)
        except ValueError:  # not the main thread: leave Ctrl-C as it is
            self._old = None
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


def context_full_notice(model) -> str:
    """What to print when an answer was cut off because the context was full."""
    return (f"[the answer was cut off: the context of {model.context_length} tokens is full; give a larger "
            "--context-length (or /clear in chat)]")


def stream_to(out, generator, stop: StopOnInterrupt):
    """Write the text chunks of ``generator`` to ``out`` as they come; returns ``(stats or None, text, interrupted)``.
    The generator is closed when Ctrl-C is pressed (or on any error), which keeps a chat's partial answer."""
    stats = None
    text = []
    try:
        for item in generator:
            if isinstance(item, str):
                out.write(item)
                out.flush()
                text.append(item)
            else:
                stats = item
            if stop.hit:
                break
    finally:
        generator.close()
    return stats, "".join(text), stop.hit
