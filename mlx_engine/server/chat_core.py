"""What the chat-shaped routes share (OpenAI Chat Completions, OpenAI Responses, Anthropic Messages): a conversation
made into a prompt (the chat template, tools and their forcing grammar, a response format, images), and its answer
as events with the tool calls parsed out of the text, streamed or whole.

Each API converts its request into chat messages in OpenAI's form (``role``, ``content`` as text or ``text`` /
``image_url`` parts, assistant ``tool_calls`` and ``reasoning_content``, ``tool`` messages with ``tool_call_id``) and
its tools into OpenAI's function list; from there one path runs them (:func:`prepare_chat`, :func:`chat_events`,
:func:`chat_answer`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from mlx_engine.api import ToolPrompt
from mlx_engine.models.generation.options import GenerationOptions
from mlx_engine.models.text.tools import ToolCall
from mlx_engine.server.http import (HTTPProblem, ServerState, generation_options, group_events, remaining_context,
                                    whole_answers)
from mlx_engine.server.pool import Loaded
from mlx_engine.server.scheduler import JobStats
from mlx_engine.server.tool_stream import ToolStream


@dataclass
class ChatJob:
    """A conversation ready to run: the model, the prompt's ``tokens``, the engine's ``options`` (images included)
    and the ``tools`` prompt (None: no tools in the conversation); ``n`` choices, each token scored with its
    ``top_logprobs`` most likely alternatives when that is set (:func:`mlx_engine.server.http.group_events`)."""

    loaded: Loaded
    tokens: list[int]
    options: GenerationOptions
    tools: ToolPrompt | None
    n: int = 1
    top_logprobs: int | None = None

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        """``(text, calls)`` of a whole answer: the calls to offered tools parsed out of it."""
        return self.tools.parse(text) if self.tools is not None else (text, [])


@dataclass
class ChatAnswer:
    """A whole answer: its ``text`` (without the calls), a reasoning model's ``thinking`` ("" when it did not think),
    the tool ``calls``, the request's :class:`JobStats` and, when asked, each token's ``(token, logprob, top)``."""

    text: str
    thinking: str
    calls: list[ToolCall]
    stats: JobStats
    logprobs: list = field(default_factory=list)


async def prepare_chat(loaded: Loaded, messages: list[dict[str, Any]], sampling: dict[str, Any], *,
                       tools: list | None = None, tool_choice: Any = None, response_format: Any = None,
                       template_vars: dict[str, Any] | None = None) -> ChatJob:
    """The prompt and options of a conversation (OpenAI-form ``messages`` and ``tools``; ``tool_choice`` as Chat
    Completions spells it). ``sampling``: the engine's option fields (None = not given); ``max_tokens`` unset runs to
    the end of the context. The response format is compiled here, so that one the model cannot follow is a 400 before
    anything is sent.

    Raises:
        HTTPProblem: 400 for tools and a response format together.
        InvalidRequestError: a malformed conversation, tool, format or option (the routes answer 400).
    """
    template_vars = template_vars or {}
    prompt = None
    images: list = []
    if tools or tool_choice or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        if tools and response_format:
            raise HTTPProblem(400, "give tools or a response format, not both", param="response_format")
        prompt = await asyncio.to_thread(loaded.obj.tool_prompt, messages, tools, tool_choice, **template_vars)
        tokens = prompt.tokens
        response_format = prompt.response_format
    else:
        tokens, images = await asyncio.to_thread(loaded.obj.chat_inputs, messages, **template_vars)
    options = generation_options({**sampling, "response_format": response_format},
                                 default_max_tokens=remaining_context(loaded, tokens))
    options = replace(options, images=tuple(images))
    await asyncio.to_thread(loaded.obj.check_format, options)
    return ChatJob(loaded, tokens, options, prompt)


async def choice_events(state: ServerState, job: ChatJob) -> AsyncIterator[tuple[int, str, Any]]:
    """The answers of ``job.n`` choices as they come, as ``(index, kind, value)``: ``("thinking", str)``,
    ``("logprob", (token, logprob, top))``, ``("text", str)`` (text that may begin a tool call held back until the
    answer ends), then ``("calls", list[ToolCall])`` (maybe empty) and ``("done", JobStats)`` for each choice.
    Raises the request's error; closing it early cancels the request
    (:func:`mlx_engine.server.http.group_events`)."""
    held = [ToolStream(job.tools) for _ in range(job.n)]
    async with contextlib.aclosing(group_events(state, job.loaded, job.tokens, job.options, n=job.n,
                                                top_logprobs=job.top_logprobs)) as events:
        async for i, kind, value in events:
            if kind == "text":
                value = held[i].feed(value)
                if value:
                    yield i, kind, value
            elif kind == "done":
                rest, calls = held[i].finish()
                if rest:
                    yield i, "text", rest
                yield i, "calls", calls
                yield i, kind, value
            else:
                yield i, kind, value


async def chat_events(state: ServerState, job: ChatJob) -> AsyncIterator[tuple[str, Any]]:
    """One choice's events as ``(kind, value)`` (:func:`choice_events`)."""
    async with contextlib.aclosing(choice_events(state, job)) as events:
        async for _, kind, value in events:
            yield kind, value


async def chat_answers(request: Request, state: ServerState, job: ChatJob,
                       error_response: Any) -> "list[ChatAnswer] | Response":
    """The whole answers of ``job.n`` choices, or the response to send instead (499 when the client left;
    ``error_response(exc)``, the API's own error form, when it failed)."""
    answers = await whole_answers(request, state, job.loaded, job.tokens, job.options, error_response, n=job.n,
                                  top_logprobs=job.top_logprobs)
    if isinstance(answers, Response):
        return answers
    out = []
    for a in answers:
        content, calls = job.split(a.text)
        out.append(ChatAnswer(content, a.thinking, calls, a.stats, a.logprobs))
    return out


async def chat_answer(request: Request, state: ServerState, job: ChatJob,
                      error_response: Any) -> "ChatAnswer | Response":
    """One choice's whole answer (:func:`chat_answers`), or the response to send instead."""
    answers = await chat_answers(request, state, job, error_response)
    return answers if isinstance(answers, Response) else answers[0]


def effort_vars(effort: str | None) -> dict[str, Any]:
    """The chat-template variables of a reasoning effort (``none``, ``minimal``, ``low``, ``medium``, ``high``):
    ``reasoning_effort``, and ``enable_thinking`` false for ``none`` (Qwen3's switch)."""
    if effort is None:
        return {}
    return {"reasoning_effort": effort, **({"enable_thinking": False} if effort == "none" else {})}


def join_parts(parts: list[dict[str, Any]]) -> "str | list[dict[str, Any]]":
    """A message's content from OpenAI-form ``text`` / ``image_url`` parts: the texts joined by newlines when there is
    no image (what every chat template takes), else the parts."""
    if any(p["type"] != "text" for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)
