"""Streaming an answer that may hold tool calls: text is passed on as it comes, except from where a call may begin
(an answer's start for every form: ``<tool_call>``, or a JSON object for Llama 3's; and a ``<tool_call>`` tag after
some plain text), which is held until the answer ends and then parsed into calls."""

from __future__ import annotations

from typing import Any

from mlx_engine.models.text.tools import ToolCall, call_start, may_be_tool_call


class ToolStream:
    """One streamed answer; ``prompt`` is the request's :class:`mlx_engine.models.generation.answer.ToolPrompt`, or None (no tools)."""

    def __init__(self, prompt: Any):
        self.prompt = prompt
        self.tools = prompt is not None and prompt.names is not None
        self.holding = self.tools  # the answer so far may still turn out to be a call
        self.held = ""

    def feed(self, text: str) -> str:
        """The text to send now (maybe ``""``)."""
        if not self.tools:
            return text
        self.held += text
        out = ""
        while self.held:
            if self.holding:
                if may_be_tool_call(self.held, self.prompt.style):
                    break
                self.holding = False
            i = call_start(self.held, self.prompt.style)
            if i is None:
                out, self.held = out + self.held, ""
                break
            if i == 0 and not may_be_tool_call(self.held, self.prompt.style):
                out, self.held = out + self.held[0], self.held[1:]  # a "<" that starts no tag: on past it
                continue
            out, self.held = out + self.held[:i], self.held[i:]
            self.holding = True
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end: the held text that is not a call, and the calls."""
        held, self.held = self.held, ""
        if not held:
            return "", []
        return self.prompt.parse(held)
