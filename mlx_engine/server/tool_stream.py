"""Streaming an answer that may be a tool call: text is passed on as it comes, except an answer whose beginning may
still turn into a call (``<tool_call>``, or a JSON object for Llama 3's form), which is held until it ends and then
parsed into calls. (Calls after some plain text reach the client as text when streaming; the non-streamed answer
parses them wherever they are.)"""

from __future__ import annotations

from typing import Any

from mlx_engine.models.tools import ToolCall, may_be_tool_call


class ToolStream:
    """One streamed answer; ``prompt`` is the request's :class:`mlx_engine.api.ToolPrompt`, or None (no tools)."""

    def __init__(self, prompt: Any):
        self.prompt = prompt
        self.holding = prompt is not None and prompt.names is not None
        self.held = ""

    def feed(self, text: str) -> str:
        """The text to send now (maybe ``""``)."""
        if not self.holding:
            return text
        self.held += text
        if may_be_tool_call(self.held, self.prompt.style):
            return ""
        self.holding = False
        out, self.held = self.held, ""
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end: the held text that is not a call, and the calls."""
        held, self.held = self.held, ""
        if not held:
            return "", []
        return self.prompt.parse(held)
