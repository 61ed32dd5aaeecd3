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


class ModelNotFoundError(EngineError):
    """A model name or path that does not resolve to a model."""
