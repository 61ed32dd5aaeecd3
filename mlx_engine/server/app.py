"""The server: one ASGI app (Starlette on uvicorn) with the OpenAI (Chat Completions, Responses), Anthropic (Messages)
and ollama routes over one device thread.

Starlette, not FastAPI: the APIs answer errors in different shapes and stream in different framings (server-sent
events, NDJSON), so each route reads its JSON body itself under a size limit and validates it with pydantic; FastAPI's
automatic validation would have to be overridden route by route, and Starlette is the layer FastAPI is built on.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import ipaddress
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from mlx_engine import api
from mlx_engine.errors import EngineError, InvalidRequestError
from mlx_engine.ml import ACTIVATIONS
from mlx_engine.server import (anthropic_api, embeddings_api, image_edits, ollama_api, openai_api, rerank_api,
                               responses_api)
from mlx_engine.server.guard import BrowserGuard, check_hosts, check_origins, error_response, split_list
from mlx_engine.server.http import DEFAULT_MAX_BODY, HTTPProblem, ServerState
from mlx_engine.server.metrics import CONTENT_TYPE, Metrics
from mlx_engine.server.pool import ModelPool
from mlx_engine.server.prompt_cache import PromptDiskCache
from mlx_engine.server.worker import DeviceWorker
from mlx_engine.store import Store

log = logging.getLogger("mlx_engine.server")

API_KEY_ENV = "MLX_ENGINE_API_KEY"


@dataclass
class ServerConfig:
    """What ``mlx-engine serve`` takes (see its ``--help``). Sizes in bytes, times in seconds."""

    host: str = "127.0.0.1"
    port: int = 11435
    models: list[str] = field(default_factory=list)
    max_sequences: int = 4
    context_length: int | None = 4096
    keep_alive: float = 300.0
    memory_budget: int | None = None
    api_key: str | None = None
    kv_bits: int | None = None  # the KV cache's type (mlx_engine.load's kv_bits)
    activations: str | None = None  # what the CPU's quantized products do with x (mlx_engine.load's activations)
    prefill_chunk: int = 512
    max_queue: int = 64
    speculative: str | None = None  # the speculative mode of requests that set none (None: draft with a draft model)
    draft_models: list[str] = field(default_factory=list)  # DRAFT (for every --model) or TARGET=DRAFT
    max_body_bytes: int = DEFAULT_MAX_BODY
    shutdown_timeout: float = 5.0
    read_timeout: float = 30.0  # seconds for a request's headers, and the longest pause inside its body
    store_root: str | None = None  # the model store (default: $MLX_ENGINE_HOME or the cache folder)
    parallel: str | None = None  # split the one --model over the ranks of mlx.launch: pipeline or tensor
    transport: str = "any"
    allowed_hosts: list[str] = field(default_factory=list)  # Host names answered besides local ones (guard.py)
    allowed_origins: list[str] = field(default_factory=list)  # origins answered besides ollama's defaults
    models_dirs: list[str] = field(default_factory=list)  # folders whose model files requests may name
    pull: bool = True  # False: /api/pull is refused (--no-pull)
    prompt_cache_dir: str | None = None  # the prompt cache on disk (prompt_cache.py), or None: off
    prompt_cache_size: int = 20 * 2**30  # bytes its files may take together

    def check(self) -> None:
        """Raises InvalidRequestError for a value the server cannot run with."""
        for name in ("max_sequences", "prefill_chunk", "max_queue", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"--{name.replace('_', '-')} must be at least 1")
        if self.context_length is not None and self.context_length < 2:
            raise InvalidRequestError("--context-length must be at least 2")
        if not 0 < self.read_timeout <= 3600:
            raise InvalidRequestError(f"--read-timeout must be more than 0 and at most 3600 seconds, not "
                                      f"{self.read_timeout}")
        if not 0 <= self.port <= 65535:
            raise InvalidRequestError(f"--port must be in 0..65535, not {self.port}")
        if self.activations is not None and self.activations not in ACTIVATIONS:
            raise InvalidRequestError(
                f"--activations must be one of {', '.join(ACTIVATIONS)}, not {self.activations!r}")
        self.draft_pairs()
        if self.parallel is not None and len(self.models) != 1:
            raise InvalidRequestError("--parallel needs exactly one --model: the model split over the ranks")
        try:
            check_hosts(split_list(self.allowed_hosts))
            check_origins(split_list(self.allowed_origins))
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        for d in self.models_dirs:
            if not os.path.isdir(os.path.expanduser(d)):
                raise InvalidRequestError(f"--models-dir {d}: no such folder; give a folder that holds model files")
        if self.prompt_cache_size < 1:
            raise InvalidRequestError("--prompt-cache-size must be at least 1 byte, e.g. 20GB")
        if self.prompt_cache_dir is not None:
            d = Path(self.prompt_cache_dir).expanduser()
            try:
                d.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise InvalidRequestError(f"--prompt-cache-dir {d}: cannot make the folder ({e.strerror or e})") \
                    from None
            if not os.access(d, os.W_OK | os.X_OK):
                raise InvalidRequestError(f"--prompt-cache-dir {d}: the folder is not writable")
        if not is_loopback(self.host) and not self.api_key:
            raise InvalidRequestError(
                f"binding {self.host} exposes the server beyond this machine: set an API key with --api-key or "
                f"${API_KEY_ENV} (clients then send 'Authorization: Bearer KEY')")

    def draft_pairs(self) -> list[tuple[str, str]]:
        """``(target, draft)`` of each ``--draft-model``: ``TARGET=DRAFT`` as given, a bare ``DRAFT`` for every
        ``--model`` (image models are passed over when the pairs are used). Raises ``InvalidRequestError`` for a
        bare one without ``--model``, or one with an empty side."""
        pairs = []
        for value in self.draft_models:
            target, sep, draft = value.rpartition("=") if not os.path.exists(value) else ("", "", value)
            if sep and not (target.strip() and draft.strip()):
                raise InvalidRequestError(f"--draft-model {value!r}: give DRAFT or TARGET=DRAFT (model names or paths)")
            if not sep and not self.models:
                raise InvalidRequestError(f"--draft-model {value}: which model does it draft for? Give --model "
                                          f"TARGET, or --draft-model TARGET={value}")
            pairs += [(target.strip(), draft.strip())] if sep else [(m, value) for m in self.models]
        return pairs


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _AccessLog:
    """Pure ASGI middleware: one log line per request (method, path, status, model, tokens, time), written when the
    response (a stream included) has ended, and counted in the metrics; refusals of the checks behind it included."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = {"code": 0}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.request(scope, status["code"])
            note = scope.get("state", {}).get("log", "")
            log.info("%s %s %s %s %.0f ms", scope.get("method"), scope.get("path", ""), status["code"] or "-", note,
                     (time.perf_counter() - t0) * 1000)


class _Auth:
    """Pure ASGI middleware: the API key check (``/`` and ``/health`` stay open for health probes). The key comes as
    ``Authorization: Bearer KEY`` (OpenAI's and ollama's clients) or ``x-api-key: KEY`` (Anthropic's)."""

    def __init__(self, app, api_key: str | None):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and self.api_key and path not in ("/", "/health") and not self._authorized(scope):
            message = "missing or wrong API key: send 'Authorization: Bearer KEY' (or 'x-api-key: KEY')"
            return await error_response(path, 401, message, "authentication_error")(scope, receive, send)
        await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        want = self.api_key.encode()
        for k, v in scope.get("headers", []):
            if k == b"authorization":
                got = v.decode("latin-1")
                if got.startswith("Bearer ") and hmac.compare_digest(got[7:].strip().encode("latin-1"), want):
                    return True
            elif k == b"x-api-key" and hmac.compare_digest(v.strip(), want):
                return True
        return False


def create_app(config: ServerConfig):
    """The ASGI app. The device thread starts with the app's lifespan and the ``config.models`` load then."""
    worker = DeviceWorker()
    disk = (PromptDiskCache(config.prompt_cache_dir, config.prompt_cache_size)
            if config.prompt_cache_dir is not None else None)
    pool = ModelPool(worker, context_length=config.context_length, max_sequences=config.max_sequences,
                     kv_bits=config.kv_bits, prefill_chunk=config.prefill_chunk, memory_budget=config.memory_budget,
                     keep_alive=config.keep_alive, max_queue=config.max_queue, store=Store(config.store_root),
                     speculative=config.speculative,
                     parallel=config.parallel, transport=config.transport, activations=config.activations,
                     models_dirs=config.models_dirs, pull=config.pull, prompt_cache=disk)
    state = ServerState(worker, pool, max_body_bytes=config.max_body_bytes)

    async def expire_loop():
        while True:
            await asyncio.sleep(1.0)
            try:
                await pool.expire()
            except Exception:  # noqa: BLE001 -- keep expiring later models
                log.exception("unloading an idle model failed")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker.start()
        try:
            for target, draft in config.draft_pairs():
                if pool.image_path(target) is None:
                    await asyncio.to_thread(pool.add_draft, target, draft)
            for name in config.models:
                pool.permit(name)  # the operator chose it: requests may name its path too
                if pool.image_path(name) is not None:
                    await pool.image(name, float("inf"))
                else:
                    resolved = await asyncio.to_thread(pool.store.resolve, name, pull=True, progress=False)
                    pool.permit(resolved.name)  # a folder given: the file found in it
                    if config.parallel is not None:
                        pool.parallel_model = resolved.name
                    await pool.text(resolved.name, float("inf"))
        except BaseException as e:
            state.startup_error = e  # serve() reports it as one "Error:" line
            worker.stop(timeout=config.shutdown_timeout)
            if disk is not None:
                disk.close()
            raise
        expiry = asyncio.ensure_future(expire_loop())
        try:
            yield
        finally:
            expiry.cancel()
            worker.stop(timeout=config.shutdown_timeout)
            if disk is not None:
                disk.close()  # the conversations that ended last are written before the process goes

    async def root(request: Request) -> Response:
        return PlainTextResponse("mlx-engine is running")

    async def status(request: Request) -> Response:
        models = {}
        for name, m in list(pool.models.items()):
            models[name] = {"kind": m.kind, "bytes": m.nbytes, "in_flight": m.in_flight,
                            **({"kv_cache": m.obj.kv_cache_type, "activations": m.obj.activations,
                                "draft_model": m.obj.draft.name if m.obj.draft is not None else None}
                               if m.kind == "text" else {}),
                            **(m.scheduler.load() if m.scheduler else {})}
        return JSONResponse({"memory_budget": pool.memory_budget, "memory": api.memory_stats(), "models": models,
                             **({"prompt_cache": disk.stats()} if disk is not None else {})})

    async def metrics(request: Request) -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    async def not_found(request: Request, exc) -> Response:
        code = getattr(exc, "status_code", 404)
        message = f"{request.method} {request.url.path}: " + ("no such endpoint" if code == 404 else
                                                               "method not allowed" if code == 405 else str(exc))
        return error_response(request.url.path, code, message, "invalid_request_error")

    async def internal(request: Request, exc: Exception) -> Response:
        log.error("internal error", exc_info=exc)
        body = f"internal server error ({type(exc).__name__}); the server log has the details"
        return error_response(request.url.path, 500, body, "server_error")

    routes = [Route("/", root, methods=["GET", "HEAD"]), Route("/health", root, methods=["GET"]),
              Route("/status", status, methods=["GET"]), Route("/metrics", metrics, methods=["GET"]),
              *openai_api.routes(state), *responses_api.routes(state), *anthropic_api.routes(state),
              *ollama_api.routes(state), *embeddings_api.routes(state),
              *rerank_api.routes(state), *image_edits.routes(state)]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={404: not_found, 405: not_found, HTTPProblem: not_found,
                                        Exception: internal})
    guarded = BrowserGuard(_Auth(app, config.api_key), bound=config.host, allowed_hosts=config.allowed_hosts,
                           allowed_origins=config.allowed_origins)
    state.metrics.routes = routes
    wrapped = _AccessLog(guarded, state.metrics)
    wrapped.server = state  # for tests and embedding: the pool and the device thread
    return wrapped


def serve(config: ServerConfig) -> None:
    """Run the server until SIGINT or SIGTERM: uvicorn stops accepting, gives running requests
    ``config.shutdown_timeout`` seconds, then ends them with an error event (never a finish that looks complete) and
    the device thread stops.

    Raises:
        EngineError: the server could not start: the address cannot be bound (checked first, before any model
            loads), or a ``--model`` cannot be found or loaded (a memory budget too small, say).
    """
    import uvicorn

    from mlx_engine.server.timeouts import read_timeout_protocol

    config.check()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    sock = bind_socket(config.host, config.port)
    app = create_app(config)
    state = app.server
    worker = state.worker

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # Running requests end now, each with its error event, so that every stream closes cleanly and the
            # graceful shutdown does not wait for answers nobody will read.
            if not self.should_exit:
                log.info("stopping: ending running requests")
                worker.call(worker.cancel_all)
            super().handle_exit(sig, frame)

    # uvicorn logs a failed start-up with the traceback; serve's caller prints the error itself
    quiet = _DropWhile(lambda: state.startup_error is not None)
    logging.getLogger("uvicorn.error").addFilter(quiet)
    try:
        with sock:
            Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                  http=read_timeout_protocol(config.read_timeout),
                                  timeout_graceful_shutdown=config.shutdown_timeout)).run(sockets=[sock])
    except SystemExit:
        if state.startup_error is None:  # uvicorn exits 3 when the lifespan failed: ours is raised below
            raise
    finally:
        logging.getLogger("uvicorn.error").removeFilter(quiet)
    error = state.startup_error
    if isinstance(error, EngineError):
        raise error
    if error is not None:
        raise EngineError(f"the server could not start: {type(error).__name__}: {error}") from error


class _DropWhile(logging.Filter):
    def __init__(self, condition):
        super().__init__()
        self.condition = condition

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.condition()


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening), so that an address in use is reported before any
    model loads. Raises ``InvalidRequestError`` naming the address and what to do."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (OSError, UnicodeError) as e:
        raise InvalidRequestError(f"cannot listen on {host}:{port}: the host does not resolve ({e})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart while old sockets linger
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise InvalidRequestError(f"port {port} on {host} is in use (another server?): stop it or choose "
                                      "another --port") from None
        raise InvalidRequestError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def api_key_from_env() -> str | None:
    return os.environ.get(API_KEY_ENV) or None
