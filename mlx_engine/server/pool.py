"""The models a server holds: loaded on first request, under one memory budget, unloaded after ``keep_alive``.

Memory is accounted when a model loads: a text model's KV cache is reserved at load for ``max_sequences`` full
contexts, so that what it will use is known then; the bytes counted are the growth of the device's active memory
across the load. When a model does not fit, idle models are unloaded (least recently used first); when it still does
not fit it is refused with :class:`MemoryBudgetError` (HTTP 503) giving what it needs and what is free, never a crash
in the middle of a request.

Which models a request may name: the store's and the catalog's names, models pulled with ollama, files and folders
under the operator's ``--models-dir`` folders (after symbolic links and ``..`` are resolved), and what the operator
loaded with ``--model``. Any other path is answered exactly as an unknown name is, so that the answer never tells
whether the path exists.

A text model may have a draft model (``serve --draft-model``): a smaller model of its vocabulary, loaded beside it
with the same context length, sequences and KV cache type, counted in its memory and unloaded with it; its
requests speculate with it by default (:mod:`~mlx_engine.server.scheduler`).

``keep_alive`` follows ollama: a duration (``"5m"``, ``"30s"``, ``"1h"``, or a number of seconds); 0 unloads the model
as soon as its requests are done; a negative value keeps it loaded until the server stops.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_engine import api
from mlx_engine.errors import InvalidRequestError, MemoryBudgetError, ModelNotFoundError
from mlx_engine.server.prompt_cache import PromptDiskCache
from mlx_engine.server.scheduler import TextScheduler
from mlx_engine.server.worker import DeviceWorker
from mlx_engine.store import Store, image_model_path, parse_registry_name
from mlx_engine.store.catalog import CATALOG, canonical_name
from mlx_engine.store.format import format_bytes
from mlx_engine.store.resolve import close_names

log = logging.getLogger("mlx_engine.server")

_DURATION = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_GRACE_S = 2.0
_UNLOAD_POLL_S = 0.05  # how often a waiting unload looks whether its model's requests have finished
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
_MAX_KEEP_ALIVE = (2**63 - 1) / 1e9  # seconds: the longest duration ollama (Go's time.Duration) can hold


def parse_keep_alive(value: Any, option: str = "keep_alive") -> float:
    """Seconds from an ollama ``keep_alive``: a number of seconds or a duration string (``"5m"``, ``"1h30m"`` is
    not accepted; ``"90m"`` is). As ollama (``api/types.go``, ``Duration.UnmarshalJSON``): a negative value means
    forever (returned as ``inf``); a duration longer than ollama can hold (about 292 years, Go's
    ``time.Duration``) is refused, as ollama refuses ``"99999999h"``.

    Raises:
        InvalidRequestError: anything else (NaN, text that is not a duration, a duration too long).
    """
    if isinstance(value, bool):
        raise InvalidRequestError(f"{option} must be a duration such as \"5m\" or a number of seconds, not {value!r}")
    try:
        if isinstance(value, (int, float)):
            seconds = float(value)
        elif isinstance(value, str) and len(value) <= 64 and (mo := _DURATION.match(value)):
            seconds = float(mo.group(1)) * _UNIT[mo.group(2)]
        else:
            raise InvalidRequestError(f"{option} must be a duration such as \"5m\", \"30s\" or \"1h\", or a "
                                      f"number of seconds, not {value!r:.80}")
    except OverflowError:  # an integer past float's range, 10**400 say
        seconds = float("inf") if value > 0 else float("-inf")
    if seconds != seconds:
        raise InvalidRequestError(f"{option} must be a number, not NaN")
    if seconds > _MAX_KEEP_ALIVE:
        raise InvalidRequestError(f"{option} is too long (the longest is {_MAX_KEEP_ALIVE:.0f} seconds); give a "
                                  "negative value to keep the model loaded until the server stops")
    return float("inf") if seconds < 0 else seconds


def parse_bytes(value: str) -> int:
    """``"12GiB"``, ``"800MB"``, ``"1.5G"`` or a plain number of bytes. Raises ``InvalidRequestError``."""
    mo = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)\s*", str(value), re.I)
    if not mo:
        raise InvalidRequestError(f"not a size: {value!r}; give for example 12GiB, 800MB or a number of bytes")
    scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[mo.group(2).upper()]
    return int(float(mo.group(1)) * scale)


def default_memory_budget() -> int:
    """Three quarters of the machine's physical memory."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.75)
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


def is_path(name: str) -> bool:
    """Whether a model argument names a file or folder rather than a model: it has a path separator (and is no
    ``hf:`` or ollama ``namespace/model:tag`` name), starts like a path, ends in ``.gguf``, or exists."""
    if name.startswith("hf:"):
        return False
    if name.startswith(("/", "~", ".")) or "\\" in name or name.lower().endswith(".gguf"):
        return True
    if ("/" in name or os.sep in name) and parse_registry_name(name) is None:
        return True
    try:
        return Path(name).exists()  # a file or folder in the server's working folder (the store looks there first)
    except (OSError, ValueError):
        return False


def _real_path(name: str) -> Path | None:
    """``name`` as an absolute path with symbolic links and ``..`` resolved; None for one the system cannot take."""
    try:
        return Path(name).expanduser().resolve()
    except (OSError, ValueError, RuntimeError):
        return None


@dataclass
class Loaded:
    """One loaded model. ``kind`` is ``text`` (``obj`` an :class:`mlx_engine.api.Model`, with its scheduler),
    ``embed`` (an :class:`mlx_engine.api.EmbeddingModel`) or ``image`` (``obj`` an image pipeline)."""

    name: str
    kind: str
    obj: Any
    nbytes: int
    keep_alive: float
    scheduler: TextScheduler | None = None
    path: str = ""
    loaded_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)
    in_flight: int = 0  # requests being served (images, embeddings; text requests are counted by the scheduler too)
    pinned: bool = False  # split over the ranks of a distributed run: loaded once, never unloaded
    unloading: bool = False  # an unload waits for its requests: new ones wait for it to end, then load it again

    @property
    def expires_at(self) -> float:
        return self.last_used + self.keep_alive

    def idle(self) -> bool:
        return self.in_flight == 0 and (self.scheduler is None or not self.scheduler.busy())


class ModelPool:
    """Loads, finds and unloads models for the server; every device action runs on the :class:`DeviceWorker`."""

    def __init__(self, worker: DeviceWorker, *, context_length: int | None = None, max_sequences: int = 4,
                 kv_bits: int | None = None, prefill_chunk: int = 512, memory_budget: int | None = None,
                 keep_alive: float = 300.0, max_queue: int = 64, store: Store | None = None,
                 parallel: str | None = None, transport: str = "any", activations: str | None = None,
                 models_dirs: "list[str] | tuple[str, ...]" = (), pull: bool = True, speculative: str | None = None,
                 prompt_cache: PromptDiskCache | None = None):
        self.worker = worker
        self.prompt_cache = prompt_cache  # the prompt cache on disk, shared by the text models (None: off)
        #: the folders whose files requests may name (resolved), the paths the operator loaded, whether pulls run
        self.models_dirs = tuple(Path(d).expanduser().resolve() for d in models_dirs)
        self.operator_paths: set[Path] = set()
        self.pull = pull
        #: ``--parallel``: the mode, and (once resolved) the one model split over the ranks (``parallel_model``)
        self.parallel, self.transport = parallel, transport
        self.parallel_model: str | None = None
        self.context_length = context_length
        self.max_sequences = max_sequences
        self.kv_bits = kv_bits
        self.activations = activations
        self.prefill_chunk = prefill_chunk
        self.memory_budget = memory_budget or default_memory_budget()
        self.keep_alive = keep_alive
        self.max_queue = max_queue
        self.speculative = speculative
        self.drafts: dict[str, Any] = {}  # a text model's name: its draft model's ResolvedModel (add_draft)
        self.store = store or Store()
        self.models: dict[str, Loaded] = {}
        self._load_lock = asyncio.Lock()

    # ---- names ---------------------------------------------------------------------------------------------------
    def permit(self, model: str) -> None:
        """Let requests name ``model``'s path (when it is one): the operator gave it with ``--model``."""
        if is_path(model) and (p := _real_path(model)) is not None:
            self.operator_paths.add(p)

    def served_name(self, name: str) -> str:
        """``name`` as the store should resolve it: a name unchanged, a path resolved when the server serves it.

        Raises:
            ModelNotFoundError: a path outside the ``--models-dir`` folders (the unknown-name error).
        """
        if not is_path(name):
            return name
        p = _real_path(name)
        if p is not None and (p in self.operator_paths or any(p.is_relative_to(d) for d in self.models_dirs)):
            return str(p)
        raise self.unknown(name)

    def unknown(self, name: str) -> ModelNotFoundError:
        """The error for a model this server does not have; the same for a name and for a refused path."""
        close = close_names(self.store, name)
        return ModelNotFoundError(
            f"model {name!r} not found: this server has no model of that name (GET /v1/models and /api/tags list "
            "them). " + (f"Close names: {', '.join(close)}. " if close else "")
            + "Model files are served only from the folders the server was started with (--models-dir). "
            + self.pull_hint(name))

    def pull_hint(self, name: str) -> str:
        if not self.pull:
            return "Pulls are disabled on this server (its operator started it with --no-pull)."
        return f"Pull it first (POST /api/pull or `mlx-engine pull {name}`)."

    def resolve_text(self, name: str):
        """The store's :class:`ResolvedModel` for a text model name (never pulls). Raises ModelNotFoundError."""
        if not isinstance(name, str) or not name.strip():
            raise InvalidRequestError("no model given: set \"model\" to a model name (GET /v1/models lists them)")
        return self._from_store(name.strip(), lambda served: self.store.resolve(served, pull=False, progress=False))

    def show(self, name: str):
        """The store's :class:`ModelInfo` for a model a request names (``/api/show``). Raises ModelNotFoundError."""
        return self._from_store(name, self.store.show)

    def _from_store(self, name: str, ask: Any) -> Any:
        """``ask(served name)``, a model the store does not have answered as :meth:`unknown` (catalog and ``hf:``
        names keep the store's answer, which says how to pull them)."""
        served = self.served_name(name)
        try:
            return ask(served)
        except ModelNotFoundError as e:
            if served != name or is_path(name):
                raise  # a path the server serves: the store's own answer about a folder the operator chose
            if name.startswith("hf:") or canonical_name(name) in CATALOG:
                raise ModelNotFoundError(f"{e} {self.pull_hint(name)}") from None
            raise self.unknown(name) from None

    def image_path(self, name: str | None) -> Path | None:
        """The folder of an image model name (a packaged one, or a diffusers folder the server serves), or None if
        not an image model."""
        if name is None:
            return None
        packaged = image_model_path(name)
        if packaged is not None:
            return packaged
        try:
            p = Path(self.served_name(name))
        except ModelNotFoundError:
            return None
        return p if (p / "model_index.json").is_file() else None

    def add_draft(self, target: str, draft: str) -> str:
        """Serve the text model ``target`` with the draft model ``draft`` (names or paths the operator gave; both
        resolved now, catalog models pulled as ``--model`` is). Its vocabulary is checked when ``target`` loads.
        Returns the target's name. Device-free; call it off the event loop.

        Raises:
            ModelNotFoundError: either resolves to nothing. InvalidRequestError: ``draft`` is an embedding model.
        """
        resolved = {}
        for name in (target, draft):
            self.permit(name)  # the operator chose it: requests may name its path too
            resolved[name] = self.store.resolve(name, pull=True, progress=False)
            self.permit(resolved[name].name)
        if api.is_embedding_checkpoint(resolved[draft].path):
            raise InvalidRequestError(f"--draft-model {draft} is an embedding model, not a text model")
        self.drafts[resolved[target].name] = resolved[draft]
        return resolved[target].name

    # ---- loading -------------------------------------------------------------------------------------------------
    async def text(self, name: str, keep_alive: float | None = None) -> Loaded:
        """The loaded text model for ``name``, loading it on first use."""
        resolved = await asyncio.to_thread(self.resolve_text, name)
        return await self._get(resolved.name, "text", resolved, keep_alive)

    async def embedder(self, name: str, keep_alive: float | None = None) -> Loaded:
        """The loaded embedding model for ``name``, loading it on first use. Raises InvalidRequestError for a chat
        model (it gives no embeddings here), ModelNotFoundError as :meth:`text`."""
        resolved = await asyncio.to_thread(self.resolve_text, name)
        if not await asyncio.to_thread(api.is_embedding_checkpoint, resolved.path):
            raise InvalidRequestError(f"{name} is a chat model, not an embedding model: embeddings and reranking come "
                                      "from BERT, nomic-bert and decoder embedders (Qwen3-Embedding) and from "
                                      "cross-encoders (a sentence-transformers folder or their GGUF)")
        return await self._get(resolved.name, "embed", resolved, keep_alive)

    async def image(self, name: str, keep_alive: float | None = None) -> Loaded:
        """The loaded image model for ``name`` (``shapes:64`` or a diffusers folder), loading it on first use."""
        path = self.image_path(name)
        if path is None:
            raise ModelNotFoundError(f"{name}: no such image model; use shapes:64 or a diffusers Z-Image folder under "
                                     "the server's --models-dir folders")
        return await self._get(name, "image", path, keep_alive)

    async def _get(self, key: str, kind: str, what: Any, keep_alive: float | None) -> Loaded:
        while (old := self.models.get(key)) is not None and old.unloading:  # wait for it to go, then load it again
            await asyncio.sleep(_UNLOAD_POLL_S)
        async with self._load_lock:
            m = self.models.get(key)
            if m is None:
                m = await self.worker.run(lambda: self._load(key, kind, what))
                self.models[key] = m
                log.info("loaded %s (%s, %s)", key, kind, format_bytes(m.nbytes))
            elif m.kind != kind:
                label = {"image": "an image", "embed": "an embedding"}.get(m.kind, f"a {m.kind}")
                raise InvalidRequestError(f"{key} is {label} model; use it "
                                          f"with the {m.kind} endpoints")
        if keep_alive is not None and not m.pinned:
            m.keep_alive = keep_alive
        m.last_used = time.time()
        return m

    def _used(self) -> int:
        return sum(m.nbytes for m in self.models.values())

    def _load(self, key: str, kind: str, what: Any) -> Loaded:
        """Device thread: load, measure, and make room under the budget (or refuse)."""
        before = api.memory_in_use()
        pinned = kind == "text" and key == self.parallel_model
        if kind == "text":
            obj = self._text_model(what, self.context_length, pinned)
            if (draft := self.drafts.get(key)) is not None:
                try:
                    obj.attach_draft(self._text_model(draft, obj.context_length, False))
                except BaseException:
                    obj.close()
                    raise
            path = str(what.path)
        elif kind == "embed":
            obj = api.EmbeddingModel(what.name, what.path, source=what.source, license=what.license)
            path = str(what.path)
        else:
            obj = api.load_image_model(key)
            path = str(what)
        need = max(0, api.memory_in_use() - before)
        try:
            self._make_room(key, need)
        except MemoryBudgetError:
            obj.close()
            raise
        m = Loaded(key, kind, obj, need, float("inf") if pinned else self.keep_alive, path=path, pinned=pinned)
        if kind == "text":
            disk = (self.prompt_cache.for_model(key, path, obj.runner.cache)
                    if self.prompt_cache is not None and not pinned else None)
            m.scheduler = TextScheduler(obj.runner, max_queue=self.max_queue, speculative=self.speculative,
                                        prompt_cache=disk)
            self.worker.add_scheduler(m.scheduler)
        return m

    def _text_model(self, what: Any, context_length: int | None, pinned: bool) -> "api.Model":
        return api.Model(what.name, what.path, source=what.source, license=what.license,
                         context_length=context_length, kv_bits=self.kv_bits, max_sequences=self.max_sequences,
                         prefill_chunk=self.prefill_chunk, reserve=True, parallel=self.parallel if pinned else None,
                         transport=self.transport, activations=self.activations)

    def _make_room(self, key: str, need: int) -> None:
        free = self.memory_budget - self._used()
        for m in sorted((m for m in self.models.values() if m.idle()), key=lambda m: m.last_used):
            if need <= free:
                break
            log.info("unloading %s to make room for %s", m.name, key)
            self._unload_now(m)
            free = self.memory_budget - self._used()
        if need > free:
            raise MemoryBudgetError(
                f"{key} needs {format_bytes(need)} but only {format_bytes(max(free, 0))} of the "
                f"{format_bytes(self.memory_budget)} memory budget is free (models in use: "
                f"{', '.join(self.models) or 'none'}); retry when they are idle, unload one (keep_alive 0), or start "
                "the server with a larger --memory-budget or a smaller --context-length / --max-sequences")

    def _unload_now(self, m: Loaded, reason: str = "unloaded") -> None:
        """Device thread. Requests still running end with ``GenerationInterruptedError`` (``reason``)."""
        if self.models.get(m.name) is not m:
            return  # unloaded already (two unloads of one model met on the device thread)
        if m.scheduler is not None:
            self.worker.remove_scheduler(m.scheduler)
            m.scheduler.close(unloaded=True, reason=reason)
        m.obj.close()
        self.models.pop(m.name, None)
        self.worker.release_soon()

    async def unload(self, key: str, *, force: bool = False, reason: str = "unloaded") -> bool:
        """Unload a model. Whether it was loaded.

        Without ``force`` (ollama's ``keep_alive: 0``) the model is marked to unload: this waits until its running
        and queued requests have finished, then unloads it; requests for it that come meanwhile wait for the unload
        and load it again (as ollama's scheduler does), so that a busy model is unloaded in bounded time. The wait
        goes on if the caller is cancelled. With ``force`` (a delete) running requests end at once with
        ``GenerationInterruptedError`` (``reason``), never with a finish that looks complete.
        """
        m = self.models.get(key)
        if m is None:
            return False
        if m.pinned:
            raise InvalidRequestError(f"{key} is split over the ranks of this distributed server and stays loaded "
                                      "until the server stops")
        if force:
            await self.worker.run(lambda: self._unload_now(m, reason))
        else:
            m.unloading = True
            await asyncio.shield(asyncio.ensure_future(self._unload_when_idle(m, reason)))
        log.info("unloaded %s", key)
        return True

    async def _unload_when_idle(self, m: Loaded, reason: str) -> None:
        while self.models.get(m.name) is m and not m.idle():
            await asyncio.sleep(_UNLOAD_POLL_S)
        await self.worker.run(lambda: self._unload_now(m, reason))

    async def expire(self) -> None:
        """Unload idle models whose keep_alive has passed."""
        now = time.time()
        for m in list(self.models.values()):
            # the grace covers a request between finding its model and submitting to it (templating, tokenizing)
            if m.idle() and now >= max(m.expires_at, m.last_used + _GRACE_S):
                await self.unload(m.name)

    async def close(self) -> None:
        for key in list(self.models):
            await self.unload(key, force=True, reason="shutdown")
