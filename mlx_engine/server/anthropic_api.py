"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``, what the ``anthropic``
SDK and Claude Code speak. Errors in Anthropic's ``{"type": "error", "error": {"type", "message"}}`` form.

Shapes follow Anthropic's API reference (and the ``anthropic`` package's ``types``); the mapping onto a chat
conversation follows llama.cpp's server (``tools/server/server-chat.cpp``, ``server_chat_convert_anthropic_to_oai``):
``system`` (a string or text blocks) becomes the system message; ``text`` and ``image`` (base64 ``source``) blocks the
message's content; an assistant's ``tool_use`` blocks its tool calls and ``thinking`` blocks its reasoning; a user's
``tool_result`` blocks ``tool`` messages (before the user's text, where Anthropic puts them). ``tools`` (``name``,
``description``, ``input_schema``) and ``tool_choice`` (``auto``, ``any``, ``tool``, ``none``: ``any`` and ``tool``
forced by a grammar) run as Chat Completions' do (:mod:`mlx_engine.server.chat_core`).

Differences, stated rather than hidden: sampling is greedy unless ``temperature`` is given; ``thinking``
(``enabled`` / ``disabled``) switches a reasoning model's thinking on or off through its chat template, its
``budget_tokens`` is not enforced (``max_tokens`` bounds thinking and answer together), and a model that does not
think answers without ``thinking`` blocks (their ``signature`` is empty: nothing is signed); ``metadata``, ``cache_control``
and ``disable_parallel_tool_use`` are accepted and have no effect; a conversation must end with a user turn
(continuing an assistant turn is refused); ``usage.input_tokens`` counts the prompt tokens that were prefilled and
``cache_read_input_tokens`` those the prefix cache served (Anthropic's split: their sum is the prompt).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mlx_engine.models.text.tools import ToolCall
from mlx_engine.server.chat_core import ChatJob, chat_answer, chat_events, join_parts, prepare_chat
from mlx_engine.server.guard import anthropic_error
from mlx_engine.server.http import HTTPProblem, ServerState, note, problem_from, read_json, validate
from mlx_engine.server.scheduler import JobStats


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class Block(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: Union[str, list[Block]]


class Tool(_Strict):
    name: str
    description: Optional[str] = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    type: Optional[str] = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class Thinking(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[int] = Field(None, ge=1)


class CountRequest(_Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: Union[str, list[Block], None] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None


class MessagesRequest(CountRequest):
    max_tokens: int = Field(ge=1, le=2**31 - 1)
    stop_sequences: Optional[list[str]] = Field(None, max_length=16)
    temperature: Optional[float] = Field(None, ge=0, le=1)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0, le=2**31 - 1)
    stream: bool = False
    metadata: Optional[dict[str, Any]] = None


def error_response(exc: BaseException) -> JSONResponse:
    """An error in Anthropic's form, its type from the status (``guard.ANTHROPIC_ERRORS``)."""
    p = problem_from(exc)
    return JSONResponse(anthropic_error(p.status, p.message), status_code=p.status, headers=p.headers)


def _text_of(blocks: list[Block], where: str) -> str:
    texts = []
    for i, b in enumerate(blocks):
        text = (b.model_extra or {}).get("text")
        if b.type != "text" or not isinstance(text, str):
            raise HTTPProblem(400, f"{where}.{i}: only text blocks are supported here, got {b.type!r:.40}",
                              param=where.split(".")[0])
        texts.append(text)
    return "\n".join(texts)


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source")
    if not isinstance(source, dict) or source.get("type") != "base64":
        raise HTTPProblem(400, f"{where}: an image's source must be {{\"type\": \"base64\", \"media_type\", "
                               "\"data\"}; this server does not fetch URLs", param="messages")
    media, data = source.get("media_type"), source.get("data")
    if not isinstance(media, str) or not media.startswith("image/") or not isinstance(data, str):
        raise HTTPProblem(400, f"{where}: an image's source needs media_type (image/png, ...) and base64 data",
                          param="messages")
    return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, content = block.get("tool_use_id"), block.get("content", "")
    if not isinstance(call_id, str):
        raise HTTPProblem(400, f"{where}: a tool_result needs the tool_use_id of its tool_use", param="messages")
    if isinstance(content, list) and all(isinstance(c, dict) and c.get("type") == "text"
                                         and isinstance(c.get("text"), str) for c in content):
        content = "\n".join(c["text"] for c in content)
    if not isinstance(content, str):
        raise HTTPProblem(400, f"{where}: a tool_result's content must be a string or text blocks (images in tool "
                               "results are not supported)",
                          param="messages")
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _message(m: Message, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages (a user's tool results first, as ``tool`` messages)."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    thinking = []
    for i, block in enumerate(m.content):
        b, at = {"type": block.type, **(block.model_extra or {})}, f"{where}.content.{i}"
        kind = (m.role, block.type)
        if block.type == "text" and isinstance(b.get("text"), str):
            parts.append({"type": "text", "text": b["text"]})
        elif kind == ("user", "image"):
            parts.append(_image_part(b, at))
        elif kind == ("user", "tool_result"):
            results.append(_tool_result(b, at))
        elif kind == ("assistant", "tool_use"):
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) \
                    or not isinstance(b.get("input", {}), dict):
                raise HTTPProblem(400, f"{at}: a tool_use needs an id, a name and an input object", param="messages")
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}})
        elif kind == ("assistant", "thinking") and isinstance(b.get("thinking"), str):
            thinking.append(b["thinking"])
        elif kind == ("assistant", "redacted_thinking"):
            continue  # encrypted by another server: nothing a template can show
        else:
            raise HTTPProblem(400, f"{at}: a {m.role} message's {block.type!r:.40} block is not supported (give "
                                   "text, image and tool_result blocks in user messages; text, tool_use and thinking "
                                   "in assistant messages)", param="messages")
    out = list(results)
    if parts or calls or thinking or not results:
        msg: dict[str, Any] = {"role": m.role, "content": join_parts(parts) if parts else ""}
        if calls:
            msg["tool_calls"] = calls
        if thinking:
            msg["reasoning_content"] = "\n".join(thinking)
        out.append(msg)
    return out


def _conversation(req: CountRequest) -> list[dict[str, Any]]:
    messages = []
    if req.system:
        system = req.system if isinstance(req.system, str) else _text_of(req.system, "system")
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        messages += _message(m, f"messages.{i}")
    if req.messages[-1].role != "user":
        raise HTTPProblem(400, "the last message must be the user's: continuing an assistant message (a prefill) is "
                               "not supported by this server", param="messages")
    return messages


def _tools(req: CountRequest) -> tuple[list | None, Any]:
    """OpenAI's function list and tool choice of the request's ``tools`` and ``tool_choice``."""
    tools = None
    if req.tools:
        for t in req.tools:
            if t.type not in (None, "custom"):
                raise HTTPProblem(400, f"tool {t.name!r:.64} is a server tool ({t.type!r:.40}): this server runs "
                                       "only client tools (name, description, input_schema)", param="tools")
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                   "parameters": t.input_schema}} for t in req.tools]
    choice = req.tool_choice
    if choice is None:
        return tools, None
    if choice.type == "tool":
        if not choice.name:
            raise HTTPProblem(400, "tool_choice of type tool needs the tool's name", param="tool_choice")
        return tools, {"type": "function", "function": {"name": choice.name}}
    return tools, {"auto": "auto", "any": "required", "none": "none"}[choice.type]


async def _job(state: ServerState, req: CountRequest, sampling: dict[str, Any]) -> ChatJob:
    messages = _conversation(req)
    tools, choice = _tools(req)
    loaded = await state.pool.text(req.model)
    think = None if req.thinking is None or req.thinking.type == "adaptive" else req.thinking.type == "enabled"
    template_vars = loaded.obj.template_vars(think) if loaded.obj.thinks else {}
    return await prepare_chat(loaded, messages, sampling, tools=tools, tool_choice=choice,
                              template_vars=template_vars)


def _usage(stats: JobStats) -> dict[str, int]:
    return {"input_tokens": stats.prompt_tokens - stats.cached_tokens, "output_tokens": stats.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": stats.cached_tokens}


def _stop(stats: JobStats, calls: list[ToolCall]) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence``."""
    if calls:
        return "tool_use", None
    if stats.finish_reason == "length":
        return "max_tokens", None
    if stats.stop_sequence is not None:
        return "stop_sequence", stats.stop_sequence
    return "end_turn", None


def _tool_use(call: ToolCall, whole: bool = True) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": call.arguments if whole else {}}


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


def routes(state: ServerState) -> list[Route]:
    async def messages(request: Request) -> Response:
        try:
            req = validate(MessagesRequest, await read_json(request, state.max_body_bytes))
            job = await _job(state, req, {"max_tokens": req.max_tokens, "stop": req.stop_sequences,
                                          "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k})
        except Exception as e:  # noqa: BLE001 -- every failure gets the API's own error form
            return error_response(e)
        mid = "msg_" + uuid.uuid4().hex[:24]
        head = {"id": mid, "type": "message", "role": "assistant", "model": job.loaded.name}
        if not req.stream:
            answer = await chat_answer(request, state, job, error_response)
            if isinstance(answer, Response):
                return answer
            note(request, job.loaded.name, answer.stats)
            content: list[dict[str, Any]] = []
            if answer.thinking:
                content.append({"type": "thinking", "thinking": answer.thinking, "signature": ""})
            if answer.text or not answer.calls:
                content.append({"type": "text", "text": answer.text})
            content += [_tool_use(c) for c in answer.calls]
            reason, sequence = _stop(answer.stats, answer.calls)
            return JSONResponse({**head, "content": content, "stop_reason": reason, "stop_sequence": sequence,
                                 "usage": _usage(answer.stats)})
        return StreamingResponse(_stream(request, state, job, head), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def count_tokens(request: Request) -> Response:
        try:
            req = validate(CountRequest, await read_json(request, state.max_body_bytes))
            job = await _job(state, req, {})
        except Exception as e:  # noqa: BLE001
            return error_response(e)
        note(request, job.loaded.name)
        return JSONResponse({"input_tokens": len(job.tokens)})

    return [Route("/v1/messages", messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"])]


async def _stream(request: Request, state: ServerState, job: ChatJob, head: dict[str, Any]):
    """Anthropic's server-sent events: ``message_start``, a ``ping``, each content block as ``content_block_start``,
    its deltas (``thinking_delta``, ``text_delta``, ``input_json_delta``) and ``content_block_stop``, then
    ``message_delta`` (stop reason, usage) and ``message_stop``; a failure mid-answer ends it with an ``error``
    event (the SDK raises it), never with ``message_stop``. ``message_start``'s usage counts the whole prompt as
    input (what the prefix cache serves is known once the request is admitted); ``message_delta``'s usage, which
    clients take as the final one, gives the split."""
    yield _event("message_start", {"message": {
        **head, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": len(job.tokens), "output_tokens": 0}}})
    yield _event("ping", {})
    index, open_kind = -1, None

    def switch(kind: str | None, block: dict[str, Any] | None = None) -> list[str]:
        nonlocal index, open_kind
        out = [_event("content_block_stop", {"index": index})] if open_kind is not None else []
        open_kind = kind
        if kind is not None:
            index += 1
            out.append(_event("content_block_start", {"index": index, "content_block": block}))
        return out

    calls: list[ToolCall] = []
    try:
        async for kind, value in chat_events(state, job):
            if kind == "thinking":
                if open_kind != "thinking":
                    for e in switch("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                        yield e
                yield _event("content_block_delta", {"index": index, "delta": {"type": "thinking_delta",
                                                                                "thinking": value}})
            elif kind == "text":
                if open_kind != "text":
                    for e in switch("text", {"type": "text", "text": ""}):
                        yield e
                yield _event("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": value}})
            elif kind == "calls":
                calls = value
                for c in calls:  # each call's input whole, in one delta: the calls are parsed when the answer ends
                    for e in switch("tool_use", _tool_use(c, whole=False)):
                        yield e
                    yield _event("content_block_delta", {"index": index, "delta": {
                        "type": "input_json_delta", "partial_json": json.dumps(c.arguments, ensure_ascii=False)}})
            else:
                if index < 0:  # an empty answer still has its text block
                    for e in switch("text", {"type": "text", "text": ""}):
                        yield e
                for e in switch(None):
                    yield e
                note(request, job.loaded.name, value)
                reason, sequence = _stop(value, calls)
                yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                               "usage": _usage(value)})
                yield _event("message_stop", {})
    except Exception as e:  # noqa: BLE001 -- the status is sent; the error goes in the stream
        p = problem_from(e)
        note(request, job.loaded.name)
        yield _event("error", {"error": anthropic_error(p.status, p.message)["error"]})
