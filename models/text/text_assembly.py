"""Text assembly of one request: token ids to text, stop strings, and a reasoning model's thinking kept apart."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from mlx_engine.models.text.reasoning import ANSWER, THINKING, ReasoningParser, Thinking
from mlx_engine.models.text.tokenizer import Tokenizer

__all__ = ["TextAssembler", "typed_pieces"]


class TextAssembler:
    """Token ids in, text out, for one request: stops at an end-of-sequence id or a stop string, never gives half a
    UTF-8 character or a piece of text that could still become a stop string, and keeps a reasoning model's thinking
    apart from its answer (``reasoning``: the request's :class:`~mlx_engine.models.text.reasoning.ReasoningParser`, or
    None for a model that does not think).

    ``add(token)`` returns the ``(kind, text)`` pieces that are safe to show now (kind ``thinking`` or ``answer``;
    maybe none); once :attr:`stop_reason` is set (``eos`` or ``stop``; :attr:`stop_sequence` names the stop string)
    the request is over and later tokens are ignored. ``flush()`` returns what was held back when generation ends for another reason (``max_tokens``, a full
    context). Stop strings are looked for in the answer only: the thinking is never cut by one (a stop string that a
    model's reasoning happens to contain would otherwise end the request before its answer began).
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), reasoning: ReasoningParser | None = None):
        self._eos = tokenizer.eos_ids
        self._detok = tokenizer.detokenizer()
        self._reasoning = reasoning
        self._stops = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1  # text that could still become a stop string
        self._pending = ""
        self.stop_reason = ""
        self.stop_sequence: str | None = None  # the stop string that ended the text (Anthropic reports it)

    def _stop_at(self, text: str) -> int:
        found = [(i, s) for i, s in ((text.find(s), s) for s in self._stops) if i >= 0]
        if not found:
            return -1
        i, self.stop_sequence = min(found, key=lambda f: f[0])
        return i

    def _split(self, pieces: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """Thinking pieces pass on; answer text joins the pending text that stop strings are looked for in."""
        out = []
        for kind, text in pieces:
            if kind == THINKING:
                out.append((kind, text))
            else:
                self._pending += text
        return out

    def _parse(self, text: str, final: bool = False) -> list[tuple[str, str]]:
        if self._reasoning is None:
            self._pending += text
            return []
        return self._split(self._reasoning.feed(text) + (self._reasoning.flush() if final else []))

    def add(self, token: int) -> list[tuple[str, str]]:
        if self.stop_reason:
            return []
        if token in self._eos:
            self.stop_reason = "eos"
            return self._parse("", final=True) + self._take(len(self._pending))
        out = self._parse(self._detok.add(token))
        cut = self._stop_at(self._pending)
        if cut >= 0:
            self.stop_reason = "stop"
            return out + self._take(cut, drop_rest=True)
        return out + self._take(max(0, len(self._pending) - self._hold))

    def flush(self) -> list[tuple[str, str]]:
        if self.stop_reason:
            return []
        out = self._parse(self._detok.flush(), final=True)
        cut = self._stop_at(self._pending)
        if cut >= 0:
            self.stop_reason = "stop"
            return out + self._take(cut, drop_rest=True)
        return out + self._take(len(self._pending))

    def _take(self, n: int, drop_rest: bool = False) -> list[tuple[str, str]]:
        out, self._pending = self._pending[:n], ("" if drop_rest else self._pending[n:])
        return [(ANSWER, out)] if out else []


def typed_pieces(pieces: list[tuple[str, str]]) -> Iterator[str]:
    """A text assembler's pieces as a stream's chunks: thinking as :class:`Thinking`, the answer as ``str``."""
    for kind, text in pieces:
        yield Thinking(text) if kind == THINKING else text
