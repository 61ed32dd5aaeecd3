"""Reasoning kept apart from the answer: the thinking span of a reasoning model (Qwen3, DeepSeek-R1 and its
distills, QwQ, Magistral...) parsed out of the generated text as it streams, and a response format's grammar held
back until that span has closed.

The span is the text between an opening and a closing marker (``<think>`` ... ``</think>`` for most models; the
pairs in :data:`MARKER_PAIRS`), found from the chat template's text, else from the vocabulary's tokens
(:func:`think_markers`). It counts only at the start of the output (after optional whitespace): once the answer has
begun, a marker is plain text, as llama.cpp's and ollama's parsers read it. A prompt may open the span for the model
(DeepSeek-R1's and Qwen3-Thinking's templates end the generation prompt with ``<think>\\n``): then the output starts
inside it (:func:`prompt_opens_span`). Whitespace right after either marker and before the closing one is dropped
(ollama's parser does the same), so ``<think>\\nabc\\n</think>\\n\\nHi`` gives the thinking ``abc`` and the answer
``Hi``.

gpt-oss's harmony format is read by :class:`HarmonyParser` (the same ``feed`` / ``flush`` interface, chosen where
:meth:`mlx_engine.models.generation.runner.Runner.reasoning` makes one per request): each message of the output is a header
(``<|start|>assistant<|channel|>NAME<|message|>``) and a body up to ``<|end|>``, ``<|return|>`` or ``<|call|>``; the
``analysis`` channel's bodies are the thinking, the others' (``final``, ``commentary``) the answer (OpenAI's harmony
format, as the ``openai-harmony`` package and llama.cpp's ``common/chat.cpp`` read it). A message to a recipient (a
tool call: ``to=functions.NAME`` in its header, before or after the channel) passes into the answer whole, in one
form, ``<|start|>assistant to=functions.NAME<|channel|>commentary<|message|>ARGS<|call|>``, for the tool-call parser
(:mod:`mlx_engine.models.text.tools`).
"""

from __future__ import annotations

import re

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlx_engine.errors import InvalidOptionError

__all__ = ["Thinking", "ThinkMarkers", "MARKER_PAIRS", "HARMONY", "HarmonyParser", "think_markers",
           "prompt_opens_span", "ReasoningParser",
           "DeferredConstraint", "THINKING", "ANSWER", "THINK_LEVELS", "parse_think", "think_template_vars"]

THINKING, ANSWER = "thinking", "answer"
#: the reasoning-effort levels ``think`` takes beside true and false (ollama's ``--think high``, OpenAI's
#: ``reasoning_effort``)
THINK_LEVELS = ("low", "medium", "high")


class Thinking(str):
    """A streamed piece of the model's reasoning (a ``str``: the plain ``str`` pieces of a stream are the answer)."""

    __slots__ = ()


@dataclass(frozen=True)
class ThinkMarkers:
    """The text that opens and closes a thinking span."""

    open: str
    close: str


#: Known spans: DeepSeek-R1, Qwen3, QwQ and most others; Magistral; Seed-OSS; Cohere's Command A Reasoning.
MARKER_PAIRS = (ThinkMarkers("<think>", "</think>"), ThinkMarkers("[THINK]", "[/THINK]"),
                ThinkMarkers("<seed:think>", "</seed:think>"),
                ThinkMarkers("<|START_THINKING|>", "<|END_THINKING|>"))


#: gpt-oss's harmony format: its analysis channel's opening and its messages' end (:class:`HarmonyParser` reads it)
HARMONY = ThinkMarkers("<|channel|>analysis<|message|>", "<|end|>")


def think_markers(chat_template: str | None, token_to_id: Callable[[str], Any]) -> ThinkMarkers | None:
    """The thinking span of a model: :data:`HARMONY` when the chat template (else the vocabulary) has harmony's
    ``<|channel|>`` and ``<|message|>``, else the first pair of :data:`MARKER_PAIRS` whose two markers are both in the
    chat template's text, else both single tokens of the vocabulary (``token_to_id`` gives None for a text that is
    not a token); None for a model that does not think."""
    if (chat_template and "<|channel|>" in chat_template and "<|message|>" in chat_template) or (
            token_to_id("<|channel|>") is not None and token_to_id("<|message|>") is not None):
        return HARMONY
    if chat_template:
        for pair in MARKER_PAIRS:
            if pair.open in chat_template and pair.close in chat_template:
                return pair
    for pair in MARKER_PAIRS:
        if token_to_id(pair.open) is not None and token_to_id(pair.close) is not None:
            return pair
    return None


def prompt_opens_span(prompt_tail: str, markers: ThinkMarkers) -> bool:
    """Whether a prompt ending with ``prompt_tail`` leaves the span open (its last opening marker comes after its
    last closing one): the model's output then starts inside the thinking."""
    opened = prompt_tail.rfind(markers.open)
    return opened >= 0 and opened > prompt_tail.rfind(markers.close)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


# parser phases: before any output (a span may open), inside the span, right after a marker (whitespace is eaten),
# in the answer (everything passes)
_START, _IN, _EAT_IN, _EAT_OUT, _OUT = range(5)


class ReasoningParser:
    """Text deltas in, ``(kind, text)`` pieces out (kind :data:`THINKING` or :data:`ANSWER`), robust to a marker
    split over any number of deltas: text that may still become a marker is held until it is known.

    Args:
        markers: the span's markers.
        inside: the prompt opened the span (:func:`prompt_opens_span`): the output starts in the thinking.
    """

    def __init__(self, markers: ThinkMarkers, inside: bool = False):
        self.markers = markers
        self._phase = _EAT_IN if inside else _START
        self._held = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        """The pieces ``text`` completes (maybe none)."""
        out: list[tuple[str, str]] = []
        text = self._held + text
        self._held = ""
        while text:
            if self._phase == _OUT:
                out.append((ANSWER, text))
                break
            if self._phase in (_EAT_IN, _EAT_OUT):
                text = text.lstrip()
                if text:
                    self._phase = _IN if self._phase == _EAT_IN else _OUT
                continue
            if self._phase == _START:
                head = text.lstrip()
                if head.startswith(self.markers.open):
                    text, self._phase = head[len(self.markers.open):], _EAT_IN
                elif self.markers.open.startswith(head):  # whitespace, or a beginning of the marker: wait
                    self._held = text
                    break
                else:
                    self._phase = _OUT
                continue
            # inside the span: up to the closing marker; hold what may begin it, and trailing whitespace
            i = text.find(self.markers.close)
            if i >= 0:
                if text[:i].rstrip():
                    out.append((THINKING, text[:i].rstrip()))
                text, self._phase = text[i + len(self.markers.close):], _EAT_OUT
                continue
            keep = _partial_suffix(text, self.markers.close)
            body = text[:len(text) - keep]
            stripped = body.rstrip()
            self._held = body[len(stripped):] + text[len(text) - keep:]
            if stripped:
                out.append((THINKING, stripped))
            break
        return _merged(out)

    def flush(self) -> list[tuple[str, str]]:
        """At the end of the output: what was held (a partial marker is text; trailing whitespace of the thinking
        and an output of whitespace alone are dropped)."""
        held, self._held = self._held, ""
        if self._phase == _START and held.strip():
            return [(ANSWER, held)]
        if self._phase == _IN and held.rstrip():
            return [(THINKING, held.rstrip())]
        return []


# a header opens with these (after the prompt's ``<|start|>assistant``, a recipient may come first: `` to=...``)
_HEADERS = ("<|start|>", "<|channel|>", "to=")
_ENDS = ("<|end|>", "<|return|>", "<|call|>")
_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]+)")
#: how a message to a recipient (a tool call) passes into the answer: its opening, then the body and :data:`CALL_END`
CALL_OPEN, CALL_END = "<|start|>assistant to={}<|channel|>commentary<|message|>", "<|call|>"
#: a header longer than this is not one (the text is held no further)
_MAX_HEADER = 256


class HarmonyParser:
    """:class:`ReasoningParser`'s interface for gpt-oss's harmony output: text deltas in, ``(kind, text)`` pieces out,
    the ``analysis`` channel's message bodies as :data:`THINKING`, every other channel's (and text outside any
    header) as :data:`ANSWER`; headers and end markers dropped. A marker split over deltas is held until known.

    Args:
        inside: the prompt opened an analysis message (:func:`prompt_opens_span` with :data:`HARMONY`).
    """

    def __init__(self, inside: bool = False):
        self._in_body = inside
        self._kind = THINKING if inside else ANSWER
        self._call = False  # the body is a message to a recipient (a tool call)
        self._held = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        """The pieces ``text`` completes (maybe none)."""
        out: list[tuple[str, str]] = []
        text = self._held + text
        self._held = ""
        while text:
            if not self._in_body:
                head = text.lstrip()
                if any(head.startswith(h) for h in _HEADERS):
                    i = head.find("<|message|>")
                    if i < 0 and len(head) <= _MAX_HEADER:  # the header goes on
                        self._held = text
                        break
                    if i >= 0:
                        channel = head[:i].partition("<|channel|>")[2].split("<|")[0].split(" ")[0].strip()
                        to = _RECIPIENT.search(head[:i])
                        self._call = to is not None and to.group(1) != "assistant"
                        self._kind = THINKING if channel == "analysis" and not self._call else ANSWER
                        if self._call:
                            out.append((ANSWER, CALL_OPEN.format(to.group(1))))
                        text = head[i + len("<|message|>"):]
                    self._in_body = True
                    continue
                if any(h.startswith(head) for h in _HEADERS):  # whitespace, or a beginning of a header: wait
                    self._held = text
                    break
                self._kind, self._in_body = ANSWER, True  # plain text: the answer
                continue
            ends = [(text.find(e), e) for e in _ENDS if e in text]
            if ends:
                i, end = min(ends)
                if text[:i]:
                    out.append((self._kind, text[:i]))
                if self._call:
                    out.append((ANSWER, CALL_END))
                text, self._in_body, self._call = text[i + len(end):], False, False
                continue
            keep = max(_partial_suffix(text, e) for e in _ENDS)
            self._held = text[len(text) - keep:]
            if text[:len(text) - keep]:
                out.append((self._kind, text[:len(text) - keep]))
            break
        return _merged(out)

    def flush(self) -> list[tuple[str, str]]:
        """At the end of the output: a held partial marker in a body is text; an unfinished header is dropped; a tool
        call cut off (or ended by ``<|call|>`` as a stop token, its text not given) is closed."""
        held, self._held = self._held, ""
        out = [(self._kind, held)] if self._in_body and held else []
        if self._in_body and self._call:
            out.append((ANSWER, CALL_END))
            self._call = False
        return _merged(out)


def _merged(pieces: list[tuple[str, str]]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for kind, text in pieces:
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))
    return out


class DeferredConstraint:
    """A response format's grammar (a :class:`~mlx_engine.models.text.constraint.Constraint`) that applies to the answer
    only: free while the output is inside the thinking span, from the token after the closing marker on the grammar
    alone. At the output's start the opening marker is allowed beside what the grammar allows, when it is one token
    (a marker of several tokens cannot open a span under a grammar). Offers the Constraint's interface
    (``allowed``, ``advance``, ``stopped``, ``accepting``), so every generation loop applies it unchanged.

    Args:
        inner: the grammar state. detokenizer: a fresh streaming detokenizer of the model (it reads the span's
            tokens to find the closing marker). markers: the span's. open_id: the opening marker's token id, or
            None. inside: the prompt opened the span.
    """

    def __init__(self, inner: Any, detokenizer: Any, markers: ThinkMarkers, open_id: int | None, inside: bool):
        self.inner = inner
        self.format = inner.format
        self._detok = detokenizer
        self._close = markers.close
        self._open_id = open_id
        self._thinking = inside
        self._started = False  # the grammar has taken a token: no span may open any more
        self._tail = ""

    def allowed(self, ctx: Any, width: int) -> Any:
        """BOOL ``[1, width]`` (or None: any token, inside the span)."""
        if self._thinking:
            return None
        mask = self.inner.allowed_numpy(width)
        if not self._started and self._open_id is not None and self._open_id < width:
            mask[self._open_id] = True
        return ctx.from_numpy(mask[None])

    def advance(self, token: int) -> None:
        """Feed the sampled token. Raises ``InvalidRequestError`` as the grammar's ``advance``."""
        if self._thinking:
            self._tail += self._detok.add(token)
            if self._close in self._tail:
                self._thinking, self._started = False, True
            self._tail = self._tail[-len(self._close):]
            return
        if not self._started and token == self._open_id:
            self._thinking = True
            return
        self._started = True
        self.inner.advance(token)

    @property
    def stopped(self) -> bool:
        return not self._thinking and self.inner.stopped

    @property
    def accepting(self) -> bool:
        return not self._thinking and self.inner.accepting


def parse_think(value: Any) -> "bool | str | None":
    """The ``think`` option: None (the template's default), True / False, or a level of :data:`THINK_LEVELS`.

    Raises:
        InvalidOptionError: any other value.
    """
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in THINK_LEVELS:
        return value.strip().lower()
    raise InvalidOptionError("think", value, f"must be true, false or one of {', '.join(THINK_LEVELS)}")


def think_template_vars(think: "bool | str | None") -> dict[str, Any]:
    """The chat-template variables that carry ``think``: ``enable_thinking`` (Qwen3's and most templates' switch),
    ``thinking`` (DeepSeek-V3.1's), and for a level ``reasoning_effort`` (gpt-oss's). None: no variable (the
    template's default)."""
    if think is None:
        return {}
    on = bool(think)
    out: dict[str, Any] = {"enable_thinking": on, "thinking": on}
    if isinstance(think, str):
        out["reasoning_effort"] = think
    return out
