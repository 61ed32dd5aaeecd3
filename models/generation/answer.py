"""What the Python API returns for a whole answer: :class:`Answer` (the text, with the thinking and the statistics),
:class:`ChatReply` (an answer with tool calls) and :class:`ToolPrompt` (a conversation with tools, ready to run)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from mlx_engine.errors import IncompleteOutputError
from mlx_engine.models.text.reasoning import Thinking
from mlx_engine.models.generation.runner import GenerationStats
from mlx_engine.models.text.tools import ToolCall, ToolStyle, parse_tool_calls


@dataclass
class ToolPrompt:
    """A conversation with tools, ready to run: its ``tokens``, the ``response_format`` that forces a call (or
    None), the template's tool ``style`` and the ``names`` of the functions offered (None: no tools offered)."""

    tokens: list[int]
    response_format: Any
    style: ToolStyle
    names: set[str] | None

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """``(text, calls)`` of an answer: the calls to offered functions, and the rest of the text."""
        return parse_tool_calls(text, self.style, self.names) if self.names else (text, [])


@dataclass
class ChatReply:
    """An answer with tool calls: ``content`` (text, "" when the answer is only calls), ``tool_calls``
    (:class:`~mlx_engine.models.text.tools.ToolCall`: ``name``, ``arguments`` dict, ``id``), ``finish_reason``
    (``tool_calls``, ``stop`` or ``length``), the :class:`GenerationStats`, and a reasoning model's ``thinking``
    ("" when it did not think)."""

    content: str
    tool_calls: list[ToolCall]
    finish_reason: str
    stats: GenerationStats | None
    thinking: str = ""


class Answer(str):
    """The text of an answer (a ``str``), with a reasoning model's thinking apart in :attr:`thinking` ("" when it
    did not think) and the request's :class:`GenerationStats` in :attr:`stats`."""

    thinking: str
    stats: GenerationStats | None

    def __new__(cls, text: str, thinking: str = "", stats: GenerationStats | None = None) -> "Answer":
        self = super().__new__(cls, text)
        self.thinking, self.stats = thinking, stats
        return self


def collect_answer(pieces: Iterator["str | GenerationStats"]) -> tuple[str, str, GenerationStats | None]:
    """A stream's answer text, thinking text and statistics (None where the stream gave none)."""
    text, thinking, stats = [], [], None
    for p in pieces:
        if isinstance(p, Thinking):
            thinking.append(p)
        elif isinstance(p, str):
            text.append(p)
        else:
            stats = p
    return "".join(text), "".join(thinking), stats


def whole_answer(pieces: Iterator["str | GenerationStats"]) -> Answer:
    """A stream read to its end as one :class:`Answer`.

    Raises:
        IncompleteOutputError: the output was cut off before it was a complete value of the requested format.
    """
    text, thinking, stats = collect_answer(pieces)
    if stats is not None and stats.format_complete is False:
        raise IncompleteOutputError(
            f"the output was cut off ({'the context is full' if stats.context_full else 'max_tokens reached'}) "
            f"after {stats.generated_tokens} tokens, before it was a complete value of the requested format; "
            "raise max_tokens (the partial text is in this error's .text)", text)
    return Answer(text, thinking, stats)
