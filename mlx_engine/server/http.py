"""What both HTTP APIs share: the server's state, bounded JSON bodies, request validation, errors mapped to status
codes, and text generation as an async stream of events from the device thread."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import pydantic
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from mlx_engine.errors import (EngineError, GenerationInterruptedError, InvalidRequestError, MemoryBudgetError,
                               ModelNotFoundError, ServerBusyError, UnsupportedError)
from mlx_engine.models.generation.options import GenerationOptions
from mlx_engine.server.metrics import Metrics
from mlx_engine.server.pool import Loaded, ModelPool
from mlx_engine.server.scheduler import JobStats, TextJob
from mlx_engine.server.worker import DeviceWorker

log = logging.getLogger("mlx_engine.server")

DEFAULT_MAX_BODY = 32 * 2**20


@dataclass
class ServerState:
    """What every route needs: the device thread, the models, limits and the metrics."""

    worker: DeviceWorker
    pool: ModelPool
    max_body_bytes: int = DEFAULT_MAX_BODY
    started_at: float = field(default_factory=time.time)
    startup_error: BaseException | None = None  # why loading the --model list failed (serve reports it)
    metrics: Metrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.pool)


class HTTPProblem(Exception):
    """An error to answer with ``status``; each API renders it in its own form."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None):
        # what an error echoes of the request may hold lone surrogates: escaped, so that the body always encodes
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers or {}


def problem_from(exc: BaseException) -> HTTPProblem:
    """The status code and message for an exception raised while serving a request. Anything that is not an engine
    error is an internal error: logged with its traceback, answered with a 500 that carries no traceback."""
    if isinstance(exc, HTTPProblem):
        return exc
    if isinstance(exc, ServerBusyError):
        return HTTPProblem(429, str(exc), kind="rate_limit_error",
                           headers={"Retry-After": str(max(1, round(exc.retry_after)))})
    if isinstance(exc, GenerationInterruptedError):  # the model went away mid-answer: the server's side, retryable
        return HTTPProblem(503, str(exc), kind="server_error", headers={"Retry-After": "1"})
    if isinstance(exc, MemoryBudgetError):
        return HTTPProblem(503, str(exc), kind="server_error")
    if isinstance(exc, ModelNotFoundError):
        return HTTPProblem(404, str(exc), kind="not_found_error", param="model")
    if isinstance(exc, (InvalidRequestError, UnsupportedError)):
        return HTTPProblem(400, str(exc), param=getattr(exc, "option", None))
    if isinstance(exc, EngineError):
        log.error("request failed: %s", exc)
        return HTTPProblem(500, str(exc), kind="server_error")
    log.error("internal error", exc_info=exc)
    return HTTPProblem(500, f"internal server error ({type(exc).__name__}); the server log has the details",
                       kind="server_error")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, read at most ``limit`` bytes. Raises :class:`HTTPProblem` (413, 499, 400 when empty)."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise HTTPProblem(413, f"the request body is larger than the server's limit of {limit} bytes")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise HTTPProblem(413, f"the request body is larger than the server's limit of {limit} bytes")
    except ClientDisconnect:  # the client left (or was timed out) mid-body: nobody reads an answer
        request.scope.setdefault("state", {})["log"] = "client disconnected while sending the body"
        raise HTTPProblem(499, "the client disconnected while sending the request body") from None
    if not body:
        raise HTTPProblem(400, "the request has no body; send a JSON object")
    return bytes(body)


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The request body as a JSON object, read at most ``limit`` bytes. Raises :class:`HTTPProblem` (413, 400)."""
    body = await read_body(request, limit)
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise HTTPProblem(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise HTTPProblem(400, f"the request body must be a JSON object, not {type(data).__name__}")
    check_strings(data)
    return data


def check_strings(value: Any, where: str = "") -> None:
    """Refuse (400) a string anywhere in a parsed JSON body that holds a NUL character or a lone UTF-16 surrogate
    (JSON's ``"\\ud800"`` decodes to one): neither is text a model, a tokenizer or a file name can take. The error
    names the field; what it echoes is escaped. Iterative, so its depth is bounded by the JSON parser's."""
    stack = [(where, value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, dict):
            stack.extend((f"{path}.{k}" if path else str(k), x) for k, x in v.items())
            stack.extend((f"{path} (a key)", k) for k in v)
        elif isinstance(v, list):
            stack.extend((f"{path}.{i}" if path else str(i), x) for i, x in enumerate(v))
        elif isinstance(v, str) and ("\x00" in v or not v.isascii()):
            if "\x00" in v:
                raise HTTPProblem(400, f"{path or 'the body'} holds a NUL character (\\u0000); remove it",
                                  param=path.split(".")[0] or None)
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                bad = v[e.start:e.end].encode("utf-8", "backslashreplace").decode()
                raise HTTPProblem(400, f"{path or 'the body'} holds a lone UTF-16 surrogate ({bad}): text must be "
                                       "valid Unicode (surrogates come in pairs)",
                                  param=path.split(".")[0] or None) from None


def validate(schema: type[pydantic.BaseModel], data: dict[str, Any]) -> Any:
    """``schema`` filled from ``data``; a 400 that names every wrong field otherwise."""
    try:
        return schema.model_validate(data)
    except pydantic.ValidationError as e:
        parts = []
        for err in e.errors()[:8]:
            where = ".".join(str(x) for x in err["loc"]) or "body"
            parts.append(f"{where}: {err['msg']}")
        first = e.errors()[0]["loc"] if e.errors() else ()
        raise HTTPProblem(400, "invalid request: " + "; ".join(parts),
                          param=str(first[0]) if first else None) from None
    except RecursionError:
        raise HTTPProblem(400, "invalid request: nested too deeply") from None


def inline_images(entries: list[str], field: str = "images") -> list[bytes]:
    """The bytes of request images given inline: base64 text (ollama's form) or ``data:`` URLs with base64.

    A server reads no files for a client: a path or ``file:`` URL is refused, never looked up.

    Raises:
        HTTPProblem: 400 naming the entry and what to send instead.
    """
    out = []
    for i, entry in enumerate(entries):
        where = f"{field}[{i}]"
        if entry.startswith(("/", "./", "../", "~", "file:")) or "\\" in entry:
            raise HTTPProblem(400, f"{where} looks like a file path; this server reads no files for a client: send "
                                   "the image's bytes as base64 or a data: URL", param=field)
        data = entry
        if entry.startswith("data:"):
            head, _, data = entry.partition(",")
            if ";base64" not in head:
                raise HTTPProblem(400, f"{where}: a data: URL must be base64 (data:image/png;base64,...)", param=field)
        try:
            out.append(base64.b64decode(data, validate=True))
        except (binascii.Error, ValueError):
            raise HTTPProblem(400, f"{where} is not valid base64: send the image's bytes as base64 or a data: URL "
                                   "(this server reads no files for a client)", param=field) from None
    return out


def generation_options(given: dict[str, Any], *, default_max_tokens: int) -> GenerationOptions:
    """The engine's options from an API's fields (None = not given). Raises InvalidRequestError."""
    opts = {k: v for k, v in given.items() if v is not None}
    opts.setdefault("max_tokens", default_max_tokens)
    return GenerationOptions.parse(opts)


async def watch_disconnect(request: Request) -> None:
    """Returns when the client goes away (for requests whose answer is not streamed)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_done_or_disconnect(request: Request, work: Any) -> Any:
    """Await ``work`` (a coroutine); if the client disconnects first, cancel it and raise ``asyncio.CancelledError``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(watch_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise asyncio.CancelledError("client disconnected")
    finally:
        watcher.cancel()


async def group_events(state: ServerState, loaded: Loaded, tokens: list[int], options: GenerationOptions, *,
                       n: int = 1, top_logprobs: int | None = None) -> AsyncIterator[tuple[int, str, Any]]:
    """Submit ``n`` text requests on one prompt (the choices of one API request) and yield their events as
    ``(index, kind, value)``: ``("thinking", str)`` and ``("text", str)`` pieces, ``("logprob", (token, logprob,
    top))`` before each token's text when ``top_logprobs`` is set, then ``("done", JobStats)`` once per choice.

    Choice ``i`` samples with seed ``seed + i`` (none given: each draws its own); choices after the first wait for
    the first's prompt to be in the cache and share it (:class:`~mlx_engine.server.scheduler.TextJob`'s leader).

    Raises the first error of any choice (an engine error: 4xx; anything else: 500). Closing the iterator early (the
    client went away) cancels every choice, which frees their cells within one step.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    seed = options.sampler.seed
    jobs: list[TextJob] = []
    for i in range(n):
        opts = options if i == 0 or seed is None else replace(options, sampler=replace(options.sampler, seed=seed + i))
        opts.sampler.validate()  # seed + i past the range is the request's error
        jobs.append(TextJob(tokens, opts, lambda kind, value, i=i: loop.call_soon_threadsafe(
            queue.put_nowait, (i, kind, value)), top_logprobs=top_logprobs, leader=jobs[0] if jobs else None))
    loaded.in_flight += 1
    try:
        for job in jobs:
            loaded.scheduler.submit(job)
        state.worker.wake()
        running = n
        while running:
            i, kind, value = await queue.get()
            if kind == "error":
                raise value
            if kind == "done":
                state.metrics.finished(loaded.name, value)
                running -= 1
            yield i, kind, value
    finally:
        for job in jobs:
            if not job.stats.finish_reason:
                job.cancel()
        state.worker.wake()
        loaded.in_flight -= 1
        loaded.last_used = time.time()


async def text_events(state: ServerState, loaded: Loaded, tokens: list[int], options: GenerationOptions, *,
                      top_logprobs: int | None = None) -> AsyncIterator[tuple[str, Any]]:
    """One request's events as ``(kind, value)`` (:func:`group_events` with one choice)."""
    async with contextlib.aclosing(group_events(state, loaded, tokens, options, top_logprobs=top_logprobs)) as events:
        async for _, kind, value in events:
            yield kind, value


@dataclass
class TextAnswer:
    """A whole answer of one choice: its ``text``, its ``thinking`` ("" when the model did not think), its
    :class:`JobStats` and, when asked, its tokens' ``logprobs`` (``(token, logprob, top)`` each)."""

    text: str
    thinking: str
    stats: JobStats
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)


async def generate_texts(state: ServerState, loaded: Loaded, tokens: list[int], options: GenerationOptions, *,
                         n: int = 1, top_logprobs: int | None = None) -> list[TextAnswer]:
    """The whole answers of ``n`` choices (:func:`group_events`), in order."""
    pieces = [{"text": [], "thinking": []} for _ in range(n)]
    answers = [TextAnswer("", "", JobStats()) for _ in range(n)]
    async for i, kind, value in group_events(state, loaded, tokens, options, n=n, top_logprobs=top_logprobs):
        if kind == "done":
            answers[i].stats = value
        elif kind == "logprob":
            answers[i].logprobs.append(value)
        else:
            pieces[i][kind].append(value)
    for a, p in zip(answers, pieces):
        a.text, a.thinking = "".join(p["text"]), "".join(p["thinking"])
    return answers


async def whole_answers(request: Request, state: ServerState, loaded: Loaded, tokens: list[int],
                        options: GenerationOptions, error_response: Any, *, n: int = 1,
                        top_logprobs: int | None = None) -> "list[TextAnswer] | Response":
    """A request answered in one piece: its choices' answers, or the response to send instead: 499 when the client
    left (the request is cancelled), the API's own error form (``error_response(exc)``) when it failed."""
    try:
        return await until_done_or_disconnect(request, generate_texts(state, loaded, tokens, options, n=n,
                                                                      top_logprobs=top_logprobs))
    except asyncio.CancelledError:
        return Response(status_code=499)
    except Exception as e:  # noqa: BLE001 -- each API renders the error in its own form
        return error_response(e)


def note(request: Request, model: str, stats: JobStats | None = None) -> None:
    """What the access log line of ``request`` says after its status: the model, and the tokens once known; with
    speculative decoding the draft tokens accepted of those proposed and the tokens per verification pass."""
    spec = ""
    if stats and stats.verify_steps:
        spec = (f" drafts={stats.draft_accepted}/{stats.draft_proposed} "
                f"tokens/pass={(stats.draft_accepted + stats.verify_steps) / stats.verify_steps:.2f}")
    request.scope.setdefault("state", {})["log"] = (
        f"model={model}" + (f" prompt={stats.prompt_tokens} cached={stats.cached_tokens} "
                            f"completion={stats.completion_tokens}{spec}" if stats else ""))


def remaining_context(loaded: Loaded, tokens: list[int]) -> int:
    """Tokens left in the context after the prompt (at least 1, so the prompt check gives the clear error)."""
    return max(1, loaded.obj.context_length - len(tokens))
