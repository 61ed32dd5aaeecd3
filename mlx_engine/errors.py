"""The engine's error types.

Every failure caused by bad input (a missing or corrupt model file, an unknown architecture, an invalid option, a full
cache) is raised as an :class:`EngineError` subclass with a message that says what was wrong and what to do. This module
imports nothing of ours, so every layer may use it.
"""


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class WeightsError(EngineError):
    """A weights file is missing, truncated, corrupt, or of a type we cannot read. The message names the file."""


class UnsupportedError(EngineError):
    """A model architecture, tensor type, or operation that this engine does not support."""


class CacheFullError(EngineError):
    """The KV cache has no free cell for a batch. The message names the capacity; the cache is left unchanged."""


class CacheError(EngineError):
    """A KV cache operation that cannot be done (for example shifting a cell shared by several sequences)."""


class InvalidRequestError(EngineError, ValueError):
    """A request with an invalid argument (empty prompt, negative temperature, prompt longer than the context...)."""


class ChatTemplateError(InvalidRequestError):
    """A chat template that does not compile, that rejects the conversation (``raise_exception``), that fails while
    rendering, or that goes past a limit of the bounded sandbox (time, output size, the size of a value it builds).
    The message names the model where it is known, and the limit."""


class InvalidOptionError(InvalidRequestError):
    """One generation option with an invalid value: ``option`` (its name), ``value``, ``rule`` (what it must be,
    e.g. ``must be >= 0``) and ``hint`` (what its special values do, or "")."""

    def __init__(self, option: str, value: object, rule: str, hint: str = ""):
        self.option, self.value, self.rule, self.hint = option, value, rule, hint
        super().__init__(f"invalid option {option}={value!r}: it {rule}" + (f" ({hint})" if hint else ""))


class IncompleteOutputError(EngineError):
    """Structured output that ended before it matched its format (``max_tokens`` or a full context cut it off):
    ``text`` holds what was generated, which is not a complete value. Raised by the calls that return one string."""

    def __init__(self, message: str, text: str = ""):
        super().__init__(message)
        self.text = text


class ModelNotFoundError(EngineError):
    """A model name or path that does not resolve to a model."""


class PullError(EngineError):
    """A pull that failed (download error, wrong size or sha256, interrupted). Nothing of it is left in the store."""


class StoreError(EngineError):
    """The model store cannot be written (a read-only folder, a full disk). The message names the folder and what
    to do."""


class ServerBusyError(EngineError):
    """Every sequence slot is busy and the request queue is full; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class MemoryBudgetError(EngineError):
    """A model (or a request) needs more memory than the budget has free. The message gives both numbers."""


class GenerationInterruptedError(EngineError):
    """A generation ended before its answer was complete because its model went away under it: unloaded by another
    request, deleted, closed from another thread, or the server shutting down. ``reason`` says which
    (``unloaded``, ``deleted``, ``closed``, ``shutdown``); ``text`` holds what was generated before the cut. Never
    a short answer passed off as complete: retry the request (the model loads again on demand)."""

    def __init__(self, message: str, reason: str = "unloaded", text: str = ""):
        super().__init__(message)
        self.reason, self.text = reason, text
