"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``, what Codex and the
OpenAI Agents SDK speak. Errors in OpenAI's ``{"error": {"message", "type", "param", "code"}}`` form.

Shapes follow OpenAI's API reference (and the ``openai`` package's ``types/responses``); the mapping onto a chat
conversation follows llama.cpp's server (``tools/server/server-chat.cpp``,
``server_chat_convert_responses_to_chatcmpl``): ``instructions`` become the system message; ``input`` is a string
(one user message) or items: messages (``input_text`` / ``input_image`` parts, an assistant's ``output_text``),
``function_call`` (an assistant's tool call), ``function_call_output`` (a ``tool`` message) and ``reasoning`` (an
assistant's thinking). Function ``tools``, ``tool_choice`` (``auto``, ``none``, ``required``, a named function: the
last two forced by a grammar) and ``text.format`` (``json_schema``, ``json_object``: enforced on every token) run as
Chat Completions' do (:mod:`mlx_engine.server.chat_core`).

``store`` (default true) keeps the response, with the conversation that led to it, in memory (the
:data:`STORED_RESPONSES` most recently used; a restart forgets them) for ``GET``, ``DELETE`` and a later request's
``previous_response_id``, whose conversation then continues (its ``instructions`` are not carried over, as OpenAI's).
A reasoning model's thinking comes back as a ``reasoning`` item (``content`` of ``reasoning_text``; no summary);
``reasoning.effort`` reaches the chat template. ``usage.input_tokens_details.cached_tokens`` counts the prompt tokens
the prefix cache served; ``output_tokens_details.reasoning_tokens`` the thinking's tokens (counted by tokenizing it).
Sampling is greedy unless ``temperature`` is given. Hosted tools (web search, file search...) and ``top_logprobs``
are refused with a 400, never ignored.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mlx_engine.server.chat_core import ChatAnswer, ChatJob, chat_answer, chat_events, effort_vars, join_parts, \
    prepare_chat
from mlx_engine.server.http import HTTPProblem, ServerState, note, problem_from, read_json, validate
from mlx_engine.server.openai_api import error_response
from mlx_engine.server.scheduler import JobStats

#: responses kept for GET, DELETE and previous_response_id (least recently used dropped first)
STORED_RESPONSES = 1000


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextFormat(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text", "json_schema", "json_object"]


class TextConfig(_Strict):
    format: Optional[TextFormat] = None


class Reasoning(_Strict):
    effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None


class ResponsesRequest(_Strict):
    model: str
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[Literal["auto", "none", "required"], dict[str, Any], None] = None
    text: Optional[TextConfig] = None
    reasoning: Optional[Reasoning] = None
    max_output_tokens: Optional[int] = Field(None, ge=1, le=2**31 - 1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    store: bool = True
    previous_response_id: Optional[str] = None
    stream: bool = False
    metadata: Optional[dict[str, str]] = None
    parallel_tool_calls: Optional[bool] = None


class ResponseStore:
    """The stored responses: id to ``(response, conversation)``, at most ``limit``, least recently used dropped.
    Thread-safe (the routes run on the event loop, tests read it from theirs)."""

    def __init__(self, limit: int = STORED_RESPONSES):
        self.limit = limit
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        with self._lock:
            self._items[response["id"]] = (response, conversation)
            self._items.move_to_end(response["id"])
            while len(self._items) > self.limit:
                self._items.popitem(last=False)

    def get(self, rid: str) -> "tuple[dict[str, Any], list[dict[str, Any]]] | None":
        with self._lock:
            item = self._items.get(rid)
            if item is not None:
                self._items.move_to_end(rid)
            return item

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._items.pop(rid, None) is not None


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise HTTPProblem(400, f"{where} must be a string", param="input")
    return value


def _parts(content: Any, where: str, assistant: bool) -> "str | list[dict[str, Any]]":
    """A message item's content as a chat message's: text, or text and image parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise HTTPProblem(400, f"{where}.content must be a string or a list of content parts", param="input")
    parts = []
    for i, part in enumerate(content):
        at = f"{where}.content.{i}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text") and (assistant or kind == "input_text"):
            parts.append({"type": "text", "text": _text(part.get("text"), at + ".text")})
        elif kind == "refusal" and assistant:
            parts.append({"type": "text", "text": _text(part.get("refusal"), at + ".refusal")})
        elif kind == "input_image" and not assistant:
            url = part.get("image_url")
            if not isinstance(url, str) or not url.startswith("data:"):
                raise HTTPProblem(400, f"{at}: an input_image must have an image_url that is a data: URL (base64); "
                                       "this server does not fetch URLs or files", param="input")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise HTTPProblem(400, f"{at}: content parts of type {kind!r:.40} are not supported here (give "
                                   "input_text and input_image parts; output_text in assistant messages)",
                              param="input")
    return join_parts(parts)


def _items(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: an assistant's message, function calls and reasoning in a row make one
    assistant message."""
    out: list[dict[str, Any]] = []

    def assistant() -> dict[str, Any]:
        if not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": ""})
        return out[-1]

    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise HTTPProblem(400, f"{where}.role must be user, system, developer or assistant", param="input")
            content = _parts(item.get("content"), where, role == "assistant")
            if role == "assistant":
                msg = assistant()
                if msg["content"]:
                    msg["content"] += "\n"
                msg["content"] += content if isinstance(content, str) else ""
            else:
                out.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            name, args = _text(item.get("name"), where + ".name"), _text(item.get("arguments"), where + ".arguments")
            call_id = _text(item.get("call_id"), where + ".call_id")
            assistant().setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):
                output = _parts(output, where, False)
            out.append({"role": "tool", "tool_call_id": _text(item.get("call_id"), where + ".call_id"),
                        "content": _text(output, where + ".output")})
        elif kind == "reasoning":
            texts = [c.get("text") for c in item.get("content") or [] if isinstance(c, dict)]
            if not all(isinstance(t, str) for t in texts):
                raise HTTPProblem(400, f"{where}.content: reasoning_text parts need a text", param="input")
            if texts:
                assistant()["reasoning_content"] = "\n".join(texts)
        else:
            raise HTTPProblem(400, f"{where}: items of type {kind!r:.40} are not supported (give messages, "
                                   "function_call, function_call_output and reasoning items)", param="input")
    return out


def _tools(req: ResponsesRequest) -> tuple[list | None, Any]:
    """Chat Completions' function list and tool choice of the request's."""
    tools = None
    if req.tools:
        for i, t in enumerate(req.tools):
            if t.get("type") != "function":
                raise HTTPProblem(400, f"tools.{i}: only function tools are supported, not {t.get('type')!r:.40} "
                                       "(this server runs no hosted tools)", param="tools")
        tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
                 for t in req.tools]
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise HTTPProblem(400, "tool_choice must be auto, none, required or {\"type\": \"function\", \"name\": "
                                   "...}", param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


def _response_format(req: ResponsesRequest) -> Any:
    fmt = req.text.format if req.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    extra = fmt.model_extra or {}
    return {"type": "json_schema", "json_schema": {k: extra[k] for k in ("name", "schema", "strict") if k in extra}}


class _Turn:
    """One response being made: the request, the conversation it runs, and the response object's fields."""

    def __init__(self, req: ResponsesRequest, conversation: list[dict[str, Any]], job: ChatJob):
        self.req, self.conversation, self.job = req, conversation, job
        self.id = "resp_" + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def response(self, status: str, output: list[dict[str, Any]], stats: JobStats | None = None,
                 thinking: str = "", error: dict[str, Any] | None = None) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format if req.text and req.text.format else None
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": error,
               "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete" else None),
               "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
               "model": self.job.loaded.name, "output": output, "parallel_tool_calls": True,
               "previous_response_id": req.previous_response_id,
               "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
               "store": req.store, "temperature": req.temperature, "top_p": req.top_p,
               "text": {"format": ({"type": fmt.type, **(fmt.model_extra or {})} if fmt else {"type": "text"})},
               "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "truncation": "disabled",
               "metadata": req.metadata or {}, "usage": None}
        if stats is not None:
            reasoning = len(self.job.loaded.obj.tokenizer.encode(thinking, add_bos=False)) if thinking else 0
            out["usage"] = {"input_tokens": stats.prompt_tokens,
                            "input_tokens_details": {"cached_tokens": stats.cached_tokens},
                            "output_tokens": stats.completion_tokens,
                            "output_tokens_details": {"reasoning_tokens": reasoning},
                            "total_tokens": stats.prompt_tokens + stats.completion_tokens}
        return out

    def finished(self, store: ResponseStore, answer: ChatAnswer, output: list[dict[str, Any]]) -> dict[str, Any]:
        """The final response object; stored (with the conversation continued by the answer) when asked."""
        status = "incomplete" if answer.stats.finish_reason == "length" and not answer.calls else "completed"
        response = self.response(status, output, answer.stats, answer.thinking)
        if self.req.store:
            said: dict[str, Any] = {"role": "assistant", "content": answer.text}
            if answer.calls:
                said["tool_calls"] = [c.openai() for c in answer.calls]
            if answer.thinking:
                said["reasoning_content"] = answer.thinking
            store.put(response, self.conversation + [said])
        return response


def _reasoning_item(rid: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": rid, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def _message_item(mid: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": mid, "status": status, "role": "assistant", "content": content}


def _call_item(call: Any, arguments: str | None = None, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id,
            "name": call.name, "status": status,
            "arguments": json.dumps(call.arguments, ensure_ascii=False) if arguments is None else arguments}


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def _output(answer: ChatAnswer) -> list[dict[str, Any]]:
    out = [_reasoning_item(_new_id("rs_"), answer.thinking)] if answer.thinking else []
    if answer.text or not answer.calls:
        out.append(_message_item(_new_id("msg_"), answer.text))
    return out + [_call_item(c) for c in answer.calls]


def routes(state: ServerState) -> list[Route]:
    store = ResponseStore()

    async def create(request: Request) -> Response:
        try:
            req = validate(ResponsesRequest, await read_json(request, state.max_body_bytes))
            if req.top_logprobs:
                raise HTTPProblem(400, "top_logprobs are not supported by this server yet", param="top_logprobs")
            conversation: list[dict[str, Any]] = []
            if req.previous_response_id is not None:
                previous = store.get(req.previous_response_id)
                if previous is None:
                    raise HTTPProblem(400, f"previous response {req.previous_response_id!r:.80} is not stored here "
                                           "(never made, made with store false, deleted, or forgotten: the server "
                                           f"keeps the {store.limit} most recent)", param="previous_response_id")
                conversation = list(previous[1])
            conversation += ([{"role": "user", "content": req.input}] if isinstance(req.input, str)
                             else _items(req.input))
            messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
            tools, choice = _tools(req)
            loaded = await state.pool.text(req.model)
            job = await prepare_chat(loaded, messages, {"max_tokens": req.max_output_tokens,
                                                        "temperature": req.temperature, "top_p": req.top_p},
                                     tools=tools, tool_choice=choice, response_format=_response_format(req),
                                     template_vars=effort_vars(req.reasoning.effort if req.reasoning else None))
        except Exception as e:  # noqa: BLE001 -- every failure gets the API's own error form
            return error_response(e)
        turn = _Turn(req, conversation, job)
        if not req.stream:
            answer = await chat_answer(request, state, job, error_response)
            if isinstance(answer, Response):
                return answer
            note(request, loaded.name, answer.stats)
            return JSONResponse(turn.finished(store, answer, _output(answer)))
        return StreamingResponse(_stream(request, state, turn, store), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def get(request: Request) -> Response:
        rid = request.path_params["rid"]
        item = store.get(rid)
        if item is None:
            return error_response(HTTPProblem(404, f"no stored response has the id {rid!r:.80}",
                                              kind="not_found_error", param="response_id"))
        return JSONResponse(item[0])

    async def delete(request: Request) -> Response:
        rid = request.path_params["rid"]
        if not store.delete(rid):
            return error_response(HTTPProblem(404, f"no stored response has the id {rid!r:.80}",
                                              kind="not_found_error", param="response_id"))
        return JSONResponse({"id": rid, "object": "response", "deleted": True})

    return [Route("/v1/responses", create, methods=["POST"]),
            Route("/v1/responses/{rid}", get, methods=["GET"]),
            Route("/v1/responses/{rid}", delete, methods=["DELETE"])]


async def _stream(request: Request, state: ServerState, turn: _Turn, store: ResponseStore):
    """The Responses API's typed server-sent events, each with its ``sequence_number``: ``response.created``,
    ``response.in_progress``; per output item ``response.output_item.added``, its deltas
    (``response.reasoning_text.delta``; ``response.content_part.added``, ``response.output_text.delta``; or
    ``response.function_call_arguments.delta``), their ``.done`` events and ``response.output_item.done``; then
    ``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut it). A failure mid-answer ends it
    with ``error`` and ``response.failed``."""
    seq = 0
    output: list[dict[str, Any]] = []
    texts = {"thinking": "", "text": ""}
    open_kind: str | None = None

    def event(kind: str, **data: Any) -> str:
        nonlocal seq
        seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **data})}\n\n"

    def close() -> list[str]:
        """The events that finish the open item."""
        nonlocal open_kind
        if open_kind is None:
            return []
        i, item = len(output) - 1, output[-1]
        if open_kind == "thinking":
            item.update(_reasoning_item(item["id"], texts["thinking"]))
            done = [event("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                          text=texts["thinking"])]
        else:
            item.update(_message_item(item["id"], texts["text"]))
            part = item["content"][0]
            done = [event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                          text=texts["text"], logprobs=[]),
                    event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                          part=part)]
        open_kind = None
        return done + [event("response.output_item.done", output_index=i, item=item)]

    def start(kind: str) -> list[str]:
        nonlocal open_kind
        out = close()
        open_kind = kind
        if kind == "thinking":
            item = _reasoning_item(_new_id("rs_"), "", "in_progress")
            output.append(item)
            return out + [event("response.output_item.added", output_index=len(output) - 1, item=dict(item))]
        item = _message_item(_new_id("msg_"), None, "in_progress")
        output.append(item)
        i = len(output) - 1
        return out + [event("response.output_item.added", output_index=i, item=dict(item, content=[])),
                      event("response.content_part.added", item_id=item["id"], output_index=i, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    yield event("response.created", response=turn.response("in_progress", []))
    yield event("response.in_progress", response=turn.response("in_progress", []))
    calls: list = []
    try:
        async for kind, value in chat_events(state, turn.job):
            if kind in ("thinking", "text"):
                if open_kind != kind:
                    for e in start(kind):
                        yield e
                texts[kind] += value
                i, item_id = len(output) - 1, output[-1]["id"]
                yield event("response.reasoning_text.delta" if kind == "thinking" else "response.output_text.delta",
                            item_id=item_id, output_index=i, content_index=0, delta=value,
                            **({} if kind == "thinking" else {"logprobs": []}))
            elif kind == "calls":
                calls = value
                if not calls and not texts["text"] and open_kind != "text":
                    for e in start("text"):  # an empty answer still has its message
                        yield e
                for e in close():
                    yield e
                for c in calls:  # each call's arguments whole, in one delta: the calls are parsed at the end
                    item = _call_item(c)
                    output.append(item)
                    i = len(output) - 1
                    yield event("response.output_item.added", output_index=i,
                                item=_call_item(c, arguments="", status="in_progress"))
                    yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                                delta=item["arguments"])
                    yield event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                name=c.name, arguments=item["arguments"])
                    yield event("response.output_item.done", output_index=i, item=item)
            else:
                note(request, turn.job.loaded.name, value)
                answer = ChatAnswer(texts["text"], texts["thinking"], calls, value)
                response = turn.finished(store, answer, output)
                yield event("response.incomplete" if response["status"] == "incomplete" else "response.completed",
                            response=response)
    except Exception as e:  # noqa: BLE001 -- the status is sent; the error goes in the stream
        p = problem_from(e)
        note(request, turn.job.loaded.name)
        yield event("error", code=p.kind, message=p.message, param=p.param)
        yield event("response.failed", response=turn.response("failed", output,
                                                               error={"code": p.kind, "message": p.message}))
