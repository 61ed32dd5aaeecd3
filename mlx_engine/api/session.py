"""A conversation with a loaded model whose KV cache persists between turns (``Model.chat_session``)."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from mlx_engine.errors import InvalidRequestError
from mlx_engine.models.generation.options import GenerationOptions
from mlx_engine.models.text.reasoning import Thinking
from mlx_engine.models.layers.base import DecoderModel
from mlx_engine.models.generation.runner import GenerationStats, Runner
from mlx_engine.models.vision.images import prompt_keys

__all__ = ["ChatSession"]


class SessionModel(Protocol):
    """What a session needs of :class:`mlx_engine.api.Model` (stated here so that this floor does not import the one
    above it): the runner and model it prefills on, the context it fits in, the lock that serializes requests and
    the templating of a conversation."""

    runner: Runner
    text_model: DecoderModel
    context_length: int
    _lock: threading.RLock

    def chat_inputs(self, messages: list[dict[str, Any]], **template_vars: Any) -> tuple[list[int], list]: ...

    def template_vars(self, think: Any) -> dict[str, Any]: ...

    def _serialized(self, pieces: Iterator[Any]) -> Iterator[Any]: ...


class ChatSession:
    """A conversation whose KV cache persists between turns: turn N prefills only the new message (the runner
    reuses the longest cached prefix of the templated conversation), on sliding-window layers too.

    Attributes:
        messages: the conversation so far (system message first when set).
        options: the default generation options of ``send`` (mutable).
    """

    def __init__(self, model: SessionModel, sequence: int, system: str | None, options: dict[str, Any]):
        self.model = model
        self.sequence = sequence
        self.options = dict(options)
        self.messages: list[dict[str, str]] = []
        self.last_stats: GenerationStats | None = None
        self.set_system(system)

    def set_system(self, text: str | None) -> None:
        """Set (or with None remove) the system message."""
        self.messages = [m for m in self.messages if m["role"] != "system"]
        if text:
            self.messages.insert(0, {"role": "system", "content": text})

    def clear(self) -> None:
        """Forget the conversation (the system message stays)."""
        self.messages = [m for m in self.messages if m["role"] == "system"]
        with self.model._lock:
            self.model.runner.reset(self.sequence)

    def send(self, text: str, images: Any = None, **options: Any) -> Iterator["str | GenerationStats"]:
        """Add a user message (with ``images``: paths, bytes, base64 strings or PIL images, for a model with a
        vision part) and stream the answer: text chunks (a reasoning model's thinking as
        :class:`~mlx_engine.models.text.reasoning.Thinking` chunks first), then one :class:`GenerationStats`. If the
        caller stops reading (closes the generator), the partial answer is kept in the conversation (its thinking in
        the message's ``thinking``)."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"a message must be a string, not {type(text).__name__}")
        if not text.strip():
            raise InvalidRequestError("the message is empty; type some text")
        before = list(self.messages)
        self.messages.append({"role": "user", "content": text, **({"images": list(images)} if images else {})})
        return self._answer(options, before)

    def regenerate(self, **options: Any) -> Iterator["str | GenerationStats"]:
        """Drop the last answer and answer the last user message again."""
        before = list(self.messages)
        if self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        if not self.messages or self.messages[-1]["role"] != "user":
            self.messages = before
            raise InvalidRequestError("there is no user message to answer again")
        return self._answer(options, before)

    def _answer(self, options: dict[str, Any], before: list[dict[str, str]]) -> Iterator["str | GenerationStats"]:
        """Stream the answer to the conversation; a turn that fails (before or while answering) is rolled back to
        ``before``, so the next turn does not inherit it."""
        try:
            opts = {**self.options, **options}
            opts.pop("system", None)
            opts.pop("raw", None)
            parsed = GenerationOptions.parse(opts)
            tokens, images = self.model.chat_inputs(self.messages, **self.model.template_vars(parsed.think))
            req = parsed.request(tokens, self.sequence, images)
        except BaseException:
            self.messages = before
            raise
        return self._record(self.model._serialized(self.model.runner.stream(req)), before)

    def _record(self, pieces: Iterator["str | GenerationStats"],
                before: list[dict[str, str]]) -> Iterator["str | GenerationStats"]:
        answer: list[str] = []
        thinking: list[str] = []
        failed = False
        try:
            for p in pieces:
                if isinstance(p, Thinking):
                    thinking.append(p)
                elif isinstance(p, str):
                    answer.append(p)
                else:
                    self.last_stats = p
                yield p
        except GeneratorExit:  # the caller stopped reading (Ctrl-C): the partial answer stays
            raise
        except BaseException:
            failed = True
            raise
        finally:
            pieces.close()
            if failed:
                self.messages = before
            else:  # the thinking goes back to the template as the message's reasoning (Qwen3's reads it)
                self.messages.append({"role": "assistant", "content": "".join(answer),
                                      **({"thinking": "".join(thinking)} if thinking else {})})

    def prefill(self) -> int:
        """Run the conversation through the model now, so that the next turn prefills only its new message (after
        :meth:`load`, say). Returns how many tokens ran (0 when the cache already held them, or there is nothing
        but a system message).

        Raises:
            InvalidRequestError: the conversation does not fit the context (the next turn could not run either).
        """
        if not any(m["role"] != "system" for m in self.messages):
            return 0
        tokens, images = self.model.chat_inputs(self.messages)
        if len(tokens) >= self.model.context_length:
            raise InvalidRequestError(
                f"the conversation takes {len(tokens)} tokens but the context holds {self.model.context_length}; "
                "load the model with a larger context length (--context-length, context_length=) or /clear")
        with self.model._lock:
            if self.model.runner.common_prefix(self.sequence, prompt_keys(tokens, images)) == len(tokens):
                return 0
            with self.model.text_model.backend.new_context() as ctx:
                _, ran = self.model.runner.prefill(ctx, self.sequence, tokens, images)
        return ran

    def tokens_used(self) -> int:
        """Tokens the conversation takes in the context now (its templated messages; 0 when empty)."""
        if not any(m["role"] != "system" for m in self.messages):
            return 0
        return len(self.model.chat_inputs(self.messages)[0])

    #: the largest conversation file :meth:`load` reads (bytes): far more text than any context holds
    MAX_FILE_BYTES = 16 * 2**20

    def save(self, path: "str | Path") -> None:
        """Write the conversation and options as JSON (to a temporary file first, then renamed: an existing file is
        never left half-written).

        Raises:
            InvalidRequestError: the file cannot be written (the message says why).
        """
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            tmp.write_text(json.dumps({"messages": self.messages, "options": self.options}, indent=2),
                           encoding="utf-8")
            tmp.replace(path)
        except (OSError, ValueError) as e:
            with contextlib.suppress(OSError, ValueError):
                tmp.unlink()
            raise InvalidRequestError(f"cannot save the conversation to {path}: {getattr(e, 'strerror', None) or e}"
                                      ) from None

    def load(self, path: "str | Path") -> None:
        """Read a conversation written by :meth:`save` (its cache is rebuilt by :meth:`prefill`, else on the next
        turn). The file is checked whole (size, JSON, messages, options) before anything of the session changes.

        Raises:
            InvalidRequestError: a missing, unreadable, too large or malformed file (the message says what).
        """
        path = Path(path)
        try:
            if not path.is_file():
                raise InvalidRequestError(f"no such file: {path}")
        except (OSError, ValueError):
            raise InvalidRequestError(f"no such file: {path}") from None
        try:
            size = path.stat().st_size
            if size > self.MAX_FILE_BYTES:
                raise ValueError(f"it holds {size:,} bytes, more than the {self.MAX_FILE_BYTES:,} a conversation "
                                 "file may")
            data = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
                raise ValueError("it has no list of messages")
            messages = data["messages"]
            for m in messages:
                if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                        and isinstance(m.get("thinking", ""), str)):
                    raise ValueError(f"a message is not a {{'role': str, 'content': str}} dict: {m!r:.100}")
            options = data.get("options", {})
            if not isinstance(options, dict):
                raise ValueError(f"its options are a {type(options).__name__}, not a dict")
            GenerationOptions.parse({**self.options, **options})
        except InvalidRequestError as e:
            raise InvalidRequestError(f"{path}: not a saved conversation ({e})") from None
        except (OSError, ValueError, RecursionError) as e:
            raise InvalidRequestError(f"{path}: not a saved conversation ({getattr(e, 'strerror', None) or e})"
                                      ) from None
        self.messages = [{"role": m["role"], "content": m["content"],
                          **({"thinking": m["thinking"]} if m.get("thinking") else {})} for m in messages]
        self.options.update(options)
