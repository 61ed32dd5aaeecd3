"""ollama-compatible routes: ``/api/chat``, ``/api/generate`` (NDJSON streaming, the default), ``/api/tags``,
``/api/show``, ``/api/ps``, ``/api/pull``, ``/api/delete``, ``/api/version``. Errors as ollama's ``{"error": "..."}``.

Semantics follow ollama's API documentation (docs/api.md): an empty ``messages`` / ``prompt`` loads the model (with
``keep_alive: 0``, unloads it); ``options`` take ``num_ctx``, ``num_predict``, ``temperature``, ``top_k``, ``top_p``,
``min_p``, ``seed``, ``stop``, ``repeat_penalty``, ``repeat_last_n``, ``presence_penalty``, ``frequency_penalty``
(and ours: ``speculative``, ``draft_tokens``);
runtime knobs of ollama's own runner (``num_thread``, ``num_gpu``, ...) are accepted and logged as ignored; options
that would change the output and that the engine does not have (``mirostat``, ``typical_p``) and ``context`` are
refused with a 400. ``images`` (base64, or ``data:`` URLs; never paths: the server reads no files for a client) go
to a model that reads images (Gemma 3 vision), and are refused with a 400 by one that does not. ``tools`` on
``/api/chat`` are offered to the model (ollama's choice is always automatic), calls come back in
``message.tool_calls`` and ``tool`` messages go back into the template. ``format`` (``"json"`` or a JSON schema) is
enforced by a grammar on every token. Durations are nanoseconds, as ollama's. A reasoning model's thinking comes back
apart from the answer, in ``message.thinking`` (``/api/chat``) or ``thinking`` (``/api/generate``); ``think`` (true,
false, ``"low"``, ``"medium"``, ``"high"``) reaches the chat template (``think: false`` turns ``enable_thinking``
off), and is refused with a 400 by a model that does not think; an assistant message's ``thinking`` goes back into
the template. ``logprobs`` (with ``top_logprobs``, 0 to 20) gives each token's log-probability in ``logprobs``, the
``ollama`` client's ``Logprob`` shape (:mod:`mlx_engine.server.logprobs`), on the line that carries its text.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import json
import logging
import time
from dataclasses import replace
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mlx_engine.errors import ModelNotFoundError
from mlx_engine.models.text.reasoning import think_markers
from mlx_engine.server.http import (HTTPProblem, ServerState, generation_options, inline_images, problem_from,
                                    read_json, text_events, validate, whole_answers)
from mlx_engine.server import logprobs as lp_shapes
from mlx_engine.server.pool import Loaded, parse_keep_alive
from mlx_engine.server.scheduler import JobStats
from mlx_engine.server.tool_stream import ToolStream
from mlx_engine.store import CATALOG
from mlx_engine.store.catalog import canonical_name, catalog_hint
from mlx_engine.version import __version__

log = logging.getLogger("mlx_engine.server")

_SAMPLING = {"temperature", "top_k", "top_p", "min_p", "seed", "stop", "repeat_penalty", "repeat_last_n",
             "presence_penalty", "frequency_penalty", "speculative", "draft_tokens"}  # the last two: ours
_RUNTIME = {"num_thread", "num_gpu", "main_gpu", "num_batch", "num_keep", "use_mmap", "use_mlock", "numa",
            "low_vram", "f16_kv", "vocab_only", "penalize_newline", "num_gqa", "rope_frequency_base",
            "rope_frequency_scale", "logits_all", "embedding_only"}
_UNSUPPORTED = {"mirostat": 0, "mirostat_tau": None, "mirostat_eta": None, "typical_p": 1.0, "tfs_z": 1.0}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class Message(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str = ""
    images: Optional[list[str]] = None


class _Common(_Strict):
    model: str = Field(min_length=1)
    stream: bool = True
    options: Optional[dict[str, Any]] = None
    keep_alive: Union[str, int, float, None] = None
    format: Union[str, dict[str, Any], None] = None
    think: Union[bool, str, None] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)

    def scored(self) -> Optional[int]:
        """How many alternatives each token's score lists (ollama: ``top_logprobs`` with ``logprobs``); None: no
        scores."""
        if self.top_logprobs and not self.logprobs:
            raise HTTPProblem(400, "top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


class ChatRequest(_Common):
    messages: list[Message] = []
    tools: Optional[list[Any]] = None


class GenerateRequest(_Common):
    prompt: str = ""
    system: Optional[str] = None
    raw: bool = False
    images: Optional[list[str]] = None
    context: Optional[list[int]] = None
    suffix: Optional[str] = None
    template: Optional[str] = None


class NameRequest(_Strict):
    model: Optional[str] = None
    name: Optional[str] = None  # older clients
    stream: bool = True

    def key(self) -> str:
        value = self.model or self.name
        if not value:
            raise HTTPProblem(400, "model is required")
        return value


def error_response(exc: BaseException) -> JSONResponse:
    p = problem_from(exc)
    return JSONResponse({"error": p.message}, status_code=p.status, headers=p.headers)


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat().replace("+00:00", "Z")


def _iso(ts: float) -> str:
    if not ts < 253402300799:  # "never" (inf), or past what a date holds: the end of year 9999
        ts = 253402300799
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).isoformat().replace("+00:00", "Z")


def _options(req: _Common, loaded: Loaded, tokens: list[int]):
    opts = dict(req.options or {})
    for name, neutral in _UNSUPPORTED.items():
        if name in opts and neutral is not None and opts[name] != neutral:
            raise HTTPProblem(400, f"option {name} is not supported by this engine (leave it at {neutral})")
    num_ctx = opts.pop("num_ctx", None)
    if num_ctx is not None:
        if isinstance(num_ctx, bool) or not isinstance(num_ctx, int) or num_ctx < 1:
            raise HTTPProblem(400, f"option num_ctx must be a positive integer, not {num_ctx!r}")
        if num_ctx > loaded.obj.context_length:
            raise HTTPProblem(400, f"num_ctx {num_ctx} is larger than the {loaded.obj.context_length} tokens this "
                                   "server holds per sequence; start it with a larger --context-length")
    context = min(num_ctx or loaded.obj.context_length, loaded.obj.context_length)
    if len(tokens) >= context:
        raise HTTPProblem(400, f"the prompt has {len(tokens)} tokens but the context holds {context}; shorten it "
                               "or raise num_ctx")
    left = context - len(tokens)
    num_predict = opts.pop("num_predict", None)
    if num_predict is not None and (isinstance(num_predict, bool) or not isinstance(num_predict, int)):
        raise HTTPProblem(400, f"option num_predict must be an integer, not {num_predict!r}")
    max_tokens = left if num_predict is None or num_predict < 0 else min(max(num_predict, 1), left)
    given: dict[str, Any] = {}
    for name, value in opts.items():
        if name in _SAMPLING:
            given[name] = value
        elif name not in _RUNTIME and name not in _UNSUPPORTED:
            log.warning("ignoring unknown option %s", name)
    raw = getattr(req, "raw", False) or None  # /api/generate's raw: the text stays raw, thinking markers too
    return generation_options({**given, "max_tokens": max_tokens, "format": req.format or None, "raw": raw},
                              default_max_tokens=left)


def _timings(stats: JobStats, load_s: float) -> dict[str, Any]:
    ns = 1_000_000_000
    return {"total_duration": int((stats.total_s + load_s) * ns), "load_duration": int(load_s * ns),
            "prompt_eval_count": stats.prompt_tokens - stats.cached_tokens,
            "prompt_eval_duration": int(stats.prefill_s * ns), "eval_count": stats.completion_tokens,
            "eval_duration": int(stats.decode_s * ns)}


def _no_token(text: str) -> None:
    """A vocabulary that holds nothing: ``show`` reads the thinking span from the template alone (unloaded)."""
    return None


def _details(info) -> dict[str, Any]:
    arch = info.architecture or ""
    fmt = "gguf" if str(info.path).endswith(".gguf") else "safetensors"
    return {"parent_model": "", "format": fmt, "family": arch, "families": [arch] if arch else None,
            "parameter_size": info.parameters_str if info.parameters else "", "quantization_level":
                info.quantization or ""}


def _digest(info) -> str:
    return hashlib.sha256(f"{info.name}:{info.path}:{info.size_bytes}".encode()).hexdigest()


def routes(state: ServerState) -> list[Route]:
    pool = state.pool

    async def _load(req: _Common) -> tuple[Loaded, float]:
        keep = parse_keep_alive(req.keep_alive) if req.keep_alive is not None else None
        t0 = time.time()
        loaded = await pool.text(req.model, keep)
        return loaded, time.time() - t0 if loaded.loaded_at >= t0 else 0.0  # load time only if it loaded now

    async def _load_only(req: _Common, request: Request, body: dict[str, Any]) -> Response:
        """An empty prompt: load the model, or with keep_alive 0 unload it (ollama's semantics)."""
        if req.keep_alive is not None and parse_keep_alive(req.keep_alive) == 0:
            key = pool.resolve_text(req.model).name
            await pool.unload(key)
            reason = "unload"
        else:
            await _load(req)
            reason = "load"
        return JSONResponse({"model": req.model, "created_at": _now(), **body, "done": True, "done_reason": reason})

    async def _answer(request: Request, req: _Common, loaded: Loaded, load_s: float, tokens: list[int],
                      options, chat: bool, tools: Any = None) -> Response:
        def body(text: str, calls: list | None = None, thinking: str = "") -> dict[str, Any]:
            if not chat:
                return {"response": text, **({"thinking": thinking} if thinking else {})}
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:  # ollama's form: arguments as an object
                message["tool_calls"] = [{"function": {"name": c.name, "arguments": c.arguments}} for c in calls]
            return {"message": message}

        def final(stats: JobStats, text: str, calls: list | None = None, thinking: str = "") -> dict[str, Any]:
            reason = "length" if stats.finish_reason == "length" else "stop"
            return {"model": req.model, "created_at": _now(), **body(text, calls, thinking), "done": True,
                    "done_reason": reason, **_timings(stats, load_s)}

        scored = req.scored()

        def scores(entries: list) -> dict[str, Any]:
            if scored is None or not entries:
                return {}
            return {"logprobs": lp_shapes.ollama(loaded.obj.tokenizer, entries, scored > 0)}

        if not req.stream:
            answers = await whole_answers(request, state, loaded, tokens, options, error_response,
                                          top_logprobs=scored)
            if isinstance(answers, Response):
                return answers
            answer = answers[0]
            stats = answer.stats
            request.scope.setdefault("state", {})["log"] = f"model={loaded.name} completion={stats.completion_tokens}"
            content, calls = tools.parse(answer.text) if tools is not None else (answer.text, [])
            return JSONResponse({**final(stats, content, calls, answer.thinking), **scores(answer.logprobs)})

        async def lines():
            held = ToolStream(tools)
            pending: list = []  # scores of tokens whose text is not sent yet

            def take() -> dict[str, Any]:
                out = scores(pending)
                pending.clear()
                return out
            try:
                async for kind, value in text_events(state, loaded, tokens, options, top_logprobs=scored):
                    if kind == "logprob":
                        pending.append(value)
                    elif kind == "thinking":
                        yield json.dumps({"model": req.model, "created_at": _now(), **body("", thinking=value),
                                          "done": False, **take()}, ensure_ascii=False) + "\n"
                    elif kind == "text":
                        value = held.feed(value)
                        if value:
                            yield json.dumps({"model": req.model, "created_at": _now(), **body(value),
                                              "done": False, **take()}, ensure_ascii=False) + "\n"
                    else:
                        rest, calls = held.finish()
                        if rest or calls:
                            yield json.dumps({"model": req.model, "created_at": _now(), **body(rest, calls),
                                              "done": False, **take()}, ensure_ascii=False) + "\n"
                        request.scope.setdefault("state", {})["log"] = (
                            f"model={loaded.name} completion={value.completion_tokens}")
                        yield json.dumps({**final(value, ""), **take()}) + "\n"
            except Exception as e:  # noqa: BLE001 -- the status is sent; the error goes in the stream
                # a final line that cannot pass for a complete answer: done_reason "error" and the error (the ollama
                # clients raise ResponseError on an "error" field)
                yield json.dumps({"model": req.model, "created_at": _now(), **body(""), "done": True,
                                  "done_reason": "error", "error": problem_from(e).message}) + "\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def chat(request: Request) -> Response:
        try:
            req = validate(ChatRequest, await read_json(request, state.max_body_bytes))
            if not req.messages:
                return await _load_only(req, request, {"message": {"role": "assistant", "content": ""}})
            if any(m.images for m in req.messages) and req.tools:
                raise HTTPProblem(400, "images and tools in one request are not supported yet")
            if any(m.role not in ("system", "user", "assistant", "tool") for m in req.messages):
                raise HTTPProblem(400, "message roles must be system, user, assistant or tool")
            loaded, load_s = await _load(req)
            template_vars = loaded.obj.template_vars(req.think)
            messages = []
            for m in req.messages:
                d: dict[str, Any] = {"role": m.role, "content": m.content}
                if m.images:
                    d["images"] = inline_images(m.images)
                for key in ("tool_calls", "thinking"):
                    if (m.model_extra or {}).get(key):
                        d[key] = m.model_extra[key]
                messages.append(d)
            tools = None
            if req.tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
                if req.tools and req.format:
                    raise HTTPProblem(400, "give tools or format, not both")
                tools = await asyncio.to_thread(loaded.obj.tool_prompt, messages, req.tools,  # ollama's: auto
                                                **template_vars)
                tokens = tools.tokens
            else:
                tokens, images = await asyncio.to_thread(loaded.obj.chat_inputs, messages, **template_vars)
            options = replace(_options(req, loaded, tokens), images=tuple(images if tools is None else ()))
            await asyncio.to_thread(loaded.obj.check_format, options)  # a 400 now, not an error mid-stream
        except Exception as e:  # noqa: BLE001
            return error_response(e)
        return await _answer(request, req, loaded, load_s, tokens, options, chat=True, tools=tools)

    async def generate(request: Request) -> Response:
        try:
            req = validate(GenerateRequest, await read_json(request, state.max_body_bytes))
            for name in ("context", "suffix", "template"):
                if getattr(req, name):
                    raise HTTPProblem(400, f"{name} is not supported by this server")
            if not req.prompt:
                return await _load_only(req, request, {"response": ""})
            loaded, load_s = await _load(req)
            template_vars = loaded.obj.template_vars(req.think)
            images: list = []
            if req.images:
                tokens, images = await asyncio.to_thread(loaded.obj.prompt_inputs, req.prompt,
                                                         inline_images(req.images), system=req.system,
                                                         raw=req.raw or None, **template_vars)
            elif req.raw:
                tokens = await asyncio.to_thread(loaded.obj.text_tokens, req.prompt)
            else:
                tokens, _ = await asyncio.to_thread(loaded.obj.prompt_inputs, req.prompt, system=req.system,
                                                    **template_vars)
            options = replace(_options(req, loaded, tokens), images=tuple(images))
            await asyncio.to_thread(loaded.obj.check_format, options)  # a 400 now, not an error mid-stream
        except Exception as e:  # noqa: BLE001
            return error_response(e)
        return await _answer(request, req, loaded, load_s, tokens, options, chat=False)

    async def tags(request: Request) -> Response:
        try:
            infos = await asyncio.to_thread(pool.store.list)
        except Exception as e:  # noqa: BLE001
            return error_response(e)
        models = []
        for i in infos:
            try:
                mtime = i.path.stat().st_mtime
            except OSError:
                mtime = time.time()
            models.append({"name": i.name, "model": i.name, "modified_at": _iso(mtime), "size": i.size_bytes,
                           "digest": _digest(i), "details": _details(i)})
        return JSONResponse({"models": models})

    async def show(request: Request) -> Response:
        try:
            req = validate(NameRequest, await read_json(request, state.max_body_bytes))
            info = await asyncio.to_thread(pool.show, req.key())
        except Exception as e:  # noqa: BLE001
            return error_response(e)
        arch = info.architecture or "unknown"
        model_info = {"general.architecture": arch, "general.parameter_count": info.parameters}
        if info.context_length:
            model_info[f"{arch}.context_length"] = info.context_length
        capabilities = ["completion"] + (["thinking"] if think_markers(info.chat_template, _no_token) else [])
        return JSONResponse({"license": info.license or "", "modelfile": f"FROM {info.path}\n", "parameters": "",
                             "template": info.chat_template or "", "details": _details(info),
                             "model_info": model_info, "capabilities": capabilities,
                             "modified_at": _iso(time.time())})

    async def ps(request: Request) -> Response:
        out = []
        for m in list(pool.models.values()):
            details: dict[str, Any] = {"format": "", "family": "", "parameter_size": "", "quantization_level": ""}
            if m.kind == "text":
                info = m.obj.info
                details = {"parent_model": "", "format": "gguf" if m.path.endswith(".gguf") else "safetensors",
                           "family": info["architecture"], "families": [info["architecture"]],
                           "parameter_size": "", "quantization_level": info["quantization"]}
            out.append({"name": m.name, "model": m.name, "size": m.nbytes, "size_vram": m.nbytes,
                        "digest": hashlib.sha256(m.path.encode()).hexdigest(), "details": details,
                        "expires_at": _iso(m.expires_at), "context_length": getattr(m.obj, "context_length", 0)})
        return JSONResponse({"models": out})

    async def pull(request: Request) -> Response:
        try:
            req = validate(NameRequest, await read_json(request, state.max_body_bytes))
            name = req.key()
            pool.store.check_name(name)  # a NUL byte or a traversal is a 400 now, before the pull starts
            if not pool.pull:
                raise HTTPProblem(403, f"pulls are disabled on this server: its operator started it with --no-pull; "
                                       f"ask them to pull {name!r} (mlx-engine pull)", kind="permission_error")
            if not name.startswith("hf:") and canonical_name(name) not in CATALOG:
                raise ModelNotFoundError(f"{name!r} is not in the catalog. {catalog_hint()}")
        except Exception as e:  # noqa: BLE001
            return error_response(e)
        task = asyncio.ensure_future(asyncio.to_thread(pool.store.pull, name, progress=False))
        if not req.stream:
            try:
                await task
            except Exception as e:  # noqa: BLE001
                return error_response(e)
            return JSONResponse({"status": "success"})

        async def lines():
            yield json.dumps({"status": "pulling manifest"}) + "\n"
            t0 = time.monotonic()
            while not task.done():
                await asyncio.wait({task}, timeout=1.0)
                if not task.done():
                    yield json.dumps({"status": f"pulling {name}", "elapsed": round(time.monotonic() - t0)}) + "\n"
            try:
                resolved = task.result()
            except Exception as e:  # noqa: BLE001
                yield json.dumps({"error": problem_from(e).message}) + "\n"
                return
            yield json.dumps({"status": "verifying sha256 digest"}) + "\n"
            yield json.dumps({"status": "writing manifest", "model": resolved.name}) + "\n"
            yield json.dumps({"status": "success"}) + "\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def delete(request: Request) -> Response:
        name = ""
        try:
            req = validate(NameRequest, await read_json(request, state.max_body_bytes))
            name = req.key()
            key = pool.resolve_text(name).name if name not in pool.models else name
            await pool.unload(key, force=True, reason="deleted")  # its files go: running answers end with an error
            await asyncio.to_thread(pool.store.remove, name)
        except ModelNotFoundError as e:
            return JSONResponse({"error": f"model '{name}' not found ({e})"}, status_code=404)
        except Exception as e:  # noqa: BLE001
            return error_response(e)
        return Response(status_code=200)

    async def version(request: Request) -> Response:
        return JSONResponse({"version": __version__})

    return [Route("/api/chat", chat, methods=["POST"]), Route("/api/generate", generate, methods=["POST"]),
            Route("/api/tags", tags, methods=["GET"]), Route("/api/show", show, methods=["POST"]),
            Route("/api/ps", ps, methods=["GET"]), Route("/api/pull", pull, methods=["POST"]),
            Route("/api/delete", delete, methods=["DELETE"]), Route("/api/version", version, methods=["GET"])]

