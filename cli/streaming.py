"""Streaming an answer to the terminal, shared by ``run`` and ``chat``: Ctrl-C handling, a reasoning model's
thinking shown apart from the answer, and the model's one-line description."""

from __future__ import annotations

import signal
import sys

from mlx_engine.store import format_count

_DIM, _RESET = "\x1b[2m", "\x1b[0m"


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class ThinkingView:
    """Where a reasoning model's thinking is shown: framed by ``Thinking...`` and ``...done thinking.`` as ollama
    frames it, before the answer; dimmed on ``out`` when ``out`` is a terminal; on ``err`` (dimmed when that is a
    terminal) when ``out`` is piped or a file, so that ``out`` holds the answer alone; nowhere when ``hide``."""

    def __init__(self, out, err=None, hide: bool = False):
        err = err if err is not None else sys.stderr
        self.dest = None if hide else (out if _isatty(out) else err)
        self.dim = self.dest is not None and _isatty(self.dest)
        self._open = False
        self._last = ""

    def write(self, text: str) -> None:
        if self.dest is None or not text:
            return
        if not self._open:
            self.dest.write((_DIM if self.dim else "") + "Thinking...\n")
            self._open = True
        self.dest.write(text)
        self.dest.flush()
        self._last = text

    def close(self) -> None:
        """End the thinking (before the answer's first piece, and when the stream ends)."""
        if not self._open:
            return
        self._open = False
        self.dest.write(("" if self._last.endswith("\n") else "\n") + "...done thinking.\n\n" +
                        (_RESET if self.dim else ""))
        self.dest.flush()


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


def stream_to(out, generator, stop: StopOnInterrupt, thinking: ThinkingView | None = None):
    """Write the answer's chunks of ``generator`` to ``out`` as they come, and its thinking chunks to ``thinking``
    (default: a :class:`ThinkingView` of ``out``); returns ``(stats or None, answer text, interrupted)``. The generator
    is closed when Ctrl-C is pressed (or on any error), which keeps a chat's partial answer."""
    from mlx_engine.api import Thinking  # here, not at the top: the store commands start without the API

    stats = None
    text = []
    thinking = thinking if thinking is not None else ThinkingView(out)
    try:
        for item in generator:
            if isinstance(item, Thinking):
                thinking.write(item)
            elif isinstance(item, str):
                thinking.close()
                out.write(item)
                out.flush()
                text.append(item)
            else:
                stats = item
            if stop.hit:
                break
    finally:
        thinking.close()
        generator.close()
    return stats, "".join(text), stop.hit
