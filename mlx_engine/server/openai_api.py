"""OpenAI-compatible routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
``/v1/images/generations`` (``/v1/images/edits`` is :mod:`mlx_engine.server.image_edits`). Errors in OpenAI's
``{"error": {"message", "type", "param", "code"}}`` form.

Field semantics follow OpenAI's API reference. Differences, stated rather than hidden: sampling is greedy unless
``temperature`` is given (the engine's default); a chat answer may run to the end of the context unless
``max_tokens`` / ``max_completion_tokens`` is given (as OpenAI); ``/v1/completions`` defaults to 16 tokens (as OpenAI);
``n`` (1 to 16) choices share the prompt's prefill and are decoded together, choice ``i`` sampling with seed
``seed + i``; ``logprobs`` / ``top_logprobs`` (chat: up to 20; completions: ``logprobs`` up to 5) are the natural
logs of the distribution each token was drawn from: after the penalties, the temperature and the top-k / top-p /
min-p filters (a filtered token: -9999), and at temperature 0 the model's own distribution (temperature 1), as
:mod:`mlx_engine.server.logprobs` shapes them; ``response_format`` (``json_object``, ``json_schema``; also ``regex`` and ``grammar``) is
enforced by a grammar on every token, ``strict`` or not; ``tools`` and ``tool_choice`` (``auto``, ``none``,
``required``, a named function: the last two forced by a grammar) with ``tool`` messages and assistant ``tool_calls``
going back into the template (:mod:`mlx_engine.models.text.tools`); ``image_url`` content parts with ``data:`` URLs go
to a model that reads images (URLs are not fetched); what the engine cannot do yet (``echo``, ``suffix``) is refused
with a 400, never ignored. OpenAI's Responses API is :mod:`mlx_engine.server.responses_api`, on the same chat core
(:mod:`mlx_engine.server.chat_core`).

Reasoning, as vLLM and llama-server give it: a reasoning model's thinking comes back in ``message.reasoning_content``
(streamed as ``delta.reasoning_content``), apart from ``content``; ``reasoning_effort`` (``none``, ``minimal``,
``low``, ``medium``, ``high``) and ``chat_template_kwargs`` (``{"enable_thinking": false}``...) reach the chat
template; an assistant message's ``reasoning_content`` (or ``reasoning``) goes back into the template.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import time
from dataclasses import replace
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mlx_engine import api
from mlx_engine.server import logprobs as lp_shapes
from mlx_engine.server.chat_core import ChatJob, chat_answers, choice_events, effort_vars, prepare_chat
from mlx_engine.server.http import (HTTPProblem, ServerState, generation_options, note, problem_from, read_json,
                                    until_done_or_disconnect, validate)
from mlx_engine.server.scheduler import JobStats
from mlx_engine.store import IMAGE_CATALOG

_FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}
MAX_CHOICES = 16  # n: each choice holds a sequence slot (or waits for one)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class ContentPart(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: Optional[str] = None


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(None, gt=0)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    speculative: Optional[str] = None  # ours: off, lookup, draft, mtp (speculative decoding); default the server's
    draft_tokens: Optional[int] = None

    def sampling(self, max_tokens: Optional[int] = None) -> dict[str, Any]:
        """The engine's option fields of the request (None = not given; ``max_tokens`` overrides its own)."""
        if self.seed is not None and self.n > 1 and not 0 <= self.seed <= 2**64 - self.n:
            raise HTTPProblem(400, f"seed must be in [0, 2**64 - n] with n = {self.n}: choice i samples with seed + i",
                              param="seed")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise HTTPProblem(400, "stop takes at most 4 sequences", param="stop")
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                "max_tokens": max_tokens or self.max_tokens, "stop": self.stop, "seed": self.seed,
                "frequency_penalty": self.frequency_penalty, "presence_penalty": self.presence_penalty,
                "repeat_penalty": self.repetition_penalty, "speculative": self.speculative,
                "draft_tokens": self.draft_tokens}


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    response_format: Optional[dict[str, Any]] = None
    tools: Optional[list[Any]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)

    def scored(self) -> Optional[int]:
        """How many alternatives each token's score lists; None: no scores."""
        if self.top_logprobs is not None and not self.logprobs:
            raise HTTPProblem(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_vars(self) -> dict[str, Any]:
        """The chat-template variables the request sets: ``chat_template_kwargs`` as given, and
        ``reasoning_effort`` (``none`` also turns ``enable_thinking`` off)."""
        given = dict(self.chat_template_kwargs or {})
        taken = sorted(set(given) & _TEMPLATE_OWN)
        if taken:
            raise HTTPProblem(400, f"chat_template_kwargs cannot set {', '.join(taken)}: the request's own fields "
                                   "give them", param="chat_template_kwargs")
        effort = effort_vars(self.reasoning_effort)  # the request's effort wins; kwargs' enable_thinking too
        return {**effort, **given, **{k: v for k, v in effort.items() if k == "reasoning_effort"}}


#: the template variables a request fills from its own fields
_TEMPLATE_OWN = {"messages", "tools", "documents", "add_generation_prompt"}


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int]]
    echo: bool = False
    suffix: Optional[str] = None
    logprobs: Optional[int] = Field(None, ge=0, le=5)

    def scored(self) -> Optional[int]:
        return self.logprobs


class ImageRequest(_Strict):
    prompt: str = Field(min_length=1)
    model: str = "shapes:64"
    n: int = Field(1, ge=1, le=8)
    size: Optional[str] = None
    response_format: Literal["b64_json", "url"] = "b64_json"
    seed: Optional[int] = Field(None, ge=0, lt=2**63)
    steps: Optional[int] = Field(None, ge=1, le=1000)
    guidance: Optional[float] = Field(None, ge=0, le=100)
    negative_prompt: Optional[str] = None


def error_response(exc: BaseException) -> JSONResponse:
    p = problem_from(exc)
    return JSONResponse({"error": {"message": p.message, "type": p.kind, "param": p.param, "code": p.status}},
                        status_code=p.status, headers=p.headers)


def _message_content(m: ChatMessage) -> "str | list[dict[str, Any]]":
    """The text of a message, or its parts when it has images (``image_url`` parts with ``data:`` URLs)."""
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    if not any(part.type == "image_url" for part in m.content):
        texts = []
        for part in m.content:
            if part.type != "text" or part.text is None:
                raise HTTPProblem(400, f"message content of type {part.type!r} is not supported: give text and "
                                       "image_url parts", param="messages")
            texts.append(part.text)
        return "".join(texts)
    parts = []
    for part in m.content:
        if part.type == "text" and part.text is not None:
            parts.append({"type": "text", "text": part.text})
        elif part.type == "image_url":
            url = (part.model_extra or {}).get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url.startswith("data:"):
                raise HTTPProblem(400, "an image_url must be a data: URL (base64); this server does not fetch URLs",
                                  param="messages")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise HTTPProblem(400, f"message content of type {part.type!r} is not supported: give text and "
                                   "image_url parts", param="messages")
    return parts


def _chat_messages(req: ChatRequest) -> list[dict[str, Any]]:
    out = []
    for m in req.messages:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": _message_content(m)}
        extra = m.model_extra or {}
        for key in ("tool_calls", "tool_call_id", "name", "reasoning_content", "reasoning"):
            if extra.get(key) is not None:
                d[key] = extra[key]
        out.append(d)
    return out


def _usage(stats: JobStats) -> dict[str, Any]:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens}}


def _total(first: JobStats, all_stats: list[JobStats]) -> JobStats:
    """The usage of a request's choices: the prompt (and its cached part) once, as the first choice's; the
    generated tokens of every choice (OpenAI counts ``n`` so)."""
    return replace(first, completion_tokens=sum(s.completion_tokens for s in all_stats))


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def routes(state: ServerState) -> list[Route]:
    async def chat_completions(request: Request) -> Response:
        try:
            req = validate(ChatRequest, await read_json(request, state.max_body_bytes))
            messages = _chat_messages(req)
            loaded = await state.pool.text(req.model)
            job = await prepare_chat(loaded, messages, req.sampling(req.max_completion_tokens), tools=req.tools,
                                     tool_choice=req.tool_choice, response_format=req.response_format,
                                     template_vars=req.template_vars())
            job = replace(job, n=req.n, top_logprobs=req.scored())
        except Exception as e:  # noqa: BLE001 -- every failure gets the API's own error form
            return error_response(e)
        return await _answer(request, job, req, chat=True)

    async def completions(request: Request) -> Response:
        try:
            req = validate(CompletionRequest, await read_json(request, state.max_body_bytes))
            if req.echo or req.suffix:
                raise HTTPProblem(400, "echo and suffix are not supported by this server", param="echo")
            loaded = await state.pool.text(req.model)
            prompt = req.prompt
            if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
                if len(prompt) != 1:
                    raise HTTPProblem(400, "give one prompt per request", param="prompt")
                prompt = prompt[0]
            if isinstance(prompt, str):
                if not prompt:
                    raise HTTPProblem(400, "the prompt is empty", param="prompt")
                tokens = await asyncio.to_thread(loaded.obj.text_tokens, prompt)
            else:
                vocab = loaded.obj.tokenizer.vocab_size
                if not prompt or not all(0 <= t < vocab for t in prompt):
                    raise HTTPProblem(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
                tokens = list(prompt)
            # a plain completion's text stays raw, thinking markers too
            options = replace(generation_options(req.sampling(), default_max_tokens=16), raw=True)
        except Exception as e:  # noqa: BLE001
            return error_response(e)
        return await _answer(request, ChatJob(loaded, tokens, options, None, n=req.n, top_logprobs=req.scored()), req,
                             chat=False)

    async def _answer(request, job: ChatJob, req, *, chat: bool) -> Response:
        loaded = job.loaded
        tokenizer = loaded.obj.tokenizer
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        scored = job.top_logprobs is not None

        thinks = chat and loaded.obj.thinks  # a reasoning model's answers carry reasoning_content

        def scores(entries: list, offset: int = 0) -> Optional[dict[str, Any]]:
            if not scored:
                return None
            if chat:
                return {"content": lp_shapes.openai_content(tokenizer, entries), "refusal": None}
            return lp_shapes.legacy(tokenizer, entries, offset)

        def choice(i: int, text: str | None, finish: str | None, delta: bool, thinking: str | None = None,
                   logprobs: Optional[dict[str, Any]] = None) -> dict[str, Any]:
            if not chat:
                return {"index": i, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
            if delta:
                body = {"content": text} if text is not None else {}
                if thinking is not None:
                    body = {"reasoning_content": thinking}
                return {"index": i, "delta": body, "logprobs": logprobs, "finish_reason": finish}
            message = {"role": "assistant", "content": text or ""}
            if thinks:
                message["reasoning_content"] = thinking or None
            return {"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish}

        if not req.stream:
            answers = await chat_answers(request, state, job, error_response)
            if isinstance(answers, Response):
                return answers
            stats = _total(answers[0].stats, [a.stats for a in answers])
            note(request, loaded.name, stats)
            bodies = []
            for i, answer in enumerate(answers):
                body = choice(i, answer.text, _FINISH[answer.stats.finish_reason], False, answer.thinking,
                              scores(answer.logprobs))
                if answer.calls:  # OpenAI's form: content null, the calls, finish_reason tool_calls
                    body = {**body, "finish_reason": "tool_calls", "message": {
                        **body["message"], "content": answer.text or None,
                        "tool_calls": [c.openai() for c in answer.calls]}}
                bodies.append(body)
            return JSONResponse({"id": rid, "object": kind, "created": created, "model": loaded.name,
                                 "choices": bodies, "usage": _usage(stats)})

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunk_kind = kind + ".chunk" if chat else kind

        async def events():
            head = {"id": rid, "object": chunk_kind, "created": created, "model": loaded.name}
            if chat:
                for i in range(job.n):
                    yield _sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                     "logprobs": None, "finish_reason": None}]})
            calls: dict[int, list] = {}
            held: dict[int, list] = {i: [] for i in range(job.n)}  # scores not yet sent, per choice
            offsets = [0] * job.n  # characters sent per choice (legacy text_offset)
            done: list[JobStats] = []

            def take(i: int) -> Optional[dict[str, Any]]:
                entries, held[i] = held[i], []
                return scores(entries, offsets[i]) if entries else None
            try:
                async for i, what, value in choice_events(state, job):
                    if what == "logprob":
                        held[i].append(value)
                    elif what == "thinking":
                        yield _sse({**head, "choices": [choice(i, None, None, True, value, take(i))]})
                    elif what == "text":
                        yield _sse({**head, "choices": [choice(i, value, None, True, None, take(i))]})
                        offsets[i] += len(value)
                    elif what == "calls":
                        calls[i] = value
                        for k, c in enumerate(value):  # one delta per call, its arguments whole
                            yield _sse({**head, "choices": [{"index": i, "delta": {"tool_calls": [c.openai(k)]},
                                                             "logprobs": None, "finish_reason": None}]})
                    else:
                        done.append(value)
                        finish = "tool_calls" if calls.get(i) else _FINISH[value.finish_reason]
                        yield _sse({**head, "choices": [choice(i, None if chat else "", finish, True, None,
                                                               take(i))]})
                note(request, loaded.name, _total(done[0], done))
                if include_usage:
                    yield _sse({**head, "choices": [], "usage": _usage(_total(done[0], done))})
            except Exception as e:  # noqa: BLE001 -- the status is sent; the error goes in the stream
                # A final chunk whose finish_reason is "error" (vLLM's name for a failed request) for readers that
                # stop at the first finish_reason, then the error event (the openai client raises APIError on it);
                # no [DONE], which would say the answer is complete.
                p = problem_from(e)
                note(request, loaded.name)
                yield _sse({**head, "choices": [choice(0, None if chat else "", "error", True)]})
                yield _sse({"error": {"message": p.message, "type": p.kind, "param": p.param, "code": p.status}})
                return
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def list_models(request: Request) -> Response:
        try:
            infos = await asyncio.to_thread(state.pool.store.list)
        except Exception as e:  # noqa: BLE001
            return error_response(e)
        names = [i.name for i in infos] + [n for n in IMAGE_CATALOG if n not in {i.name for i in infos}]
        names += [n for n in state.pool.models if n not in names]
        created = int(state.started_at)
        return JSONResponse({"object": "list", "data": [
            {"id": n, "object": "model", "created": created, "owned_by": "mlx-engine"} for n in names]})

    async def images(request: Request) -> Response:
        try:
            req = validate(ImageRequest, await read_json(request, state.max_body_bytes))
            width, height = image_size(req)
            loaded = await state.pool.image(req.model)
        except Exception as e:  # noqa: BLE001
            return error_response(e)
        job = ImageJob()
        try:
            data = await until_done_or_disconnect(request, generate_images(state, loaded, req, width, height, job))
        except asyncio.CancelledError:
            job.cancelled = True
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001
            return error_response(e)
        note(request, loaded.name)
        return JSONResponse({"created": int(time.time()), "data": data})

    return [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/images/generations", images, methods=["POST"])]


def image_size(req: ImageRequest) -> tuple[int | None, int | None]:
    """``(width, height)`` of an image request's ``size`` (None for ``auto`` or none), after checking its
    ``response_format``. Raises :class:`HTTPProblem` (400)."""
    if req.response_format != "b64_json":
        raise HTTPProblem(400, "only response_format \"b64_json\" is supported (this server keeps no image "
                               "files to link to)", param="response_format")
    if not req.size or req.size == "auto":
        return None, None
    mo = re.fullmatch(r"(\d{1,5})x(\d{1,5})", req.size)
    if not mo:
        raise HTTPProblem(400, f"size must be WIDTHxHEIGHT (for example 64x64), not {req.size!r}", param="size")
    return int(mo.group(1)), int(mo.group(2))


class ImageJob:
    """An image request in flight: ``cancelled`` is set when its client goes away."""

    cancelled = False


class ImageCancelled(Exception):
    """The client went away while its image was being denoised."""


async def generate_images(state: ServerState, loaded, req: ImageRequest, width, height, job: ImageJob,
                          edit_images: "list[bytes] | None" = None) -> list[dict]:
    """The ``data`` entries of ``/v1/images/generations`` (and ``/v1/images/edits``, with the uploaded
    ``edit_images``): ``req.n`` PNGs, seeds ``seed, seed + 1, ...``, made on the device thread."""
    seed = req.seed if req.seed is not None else int.from_bytes(uuid.uuid4().bytes[:7], "big")
    out = []
    loaded.in_flight += 1
    try:
        for i in range(req.n):
            def make(seed=seed + i) -> tuple[bytes, dict]:
                def step(*_):  # after each denoising step: text requests get a step too
                    if job.cancelled:
                        raise ImageCancelled()
                    state.worker.step_text()
                img = api.generate_image(req.prompt, model=loaded.obj, negative_prompt=req.negative_prompt,
                                         width=width, height=height, steps=req.steps, guidance=req.guidance,
                                         seed=seed, callback=step, edit_images=edit_images)
                buf = io.BytesIO()
                api.save_image(img, buf)
                return buf.getvalue(), img.info["parameters"]
            png, params = await state.worker.run(make)
            out.append({"b64_json": base64.b64encode(png).decode(), "revised_prompt": req.prompt,
                        "seed": params.get("seed"), "steps": params.get("steps"), "guidance": params.get("guidance"),
                        "width": params.get("width"), "height": params.get("height")})
    except ImageCancelled:
        raise asyncio.CancelledError() from None
    finally:
        loaded.in_flight -= 1
        loaded.last_used = time.time()
    return out
