"""Continuous batching for one text model, with a prefix cache across requests.

The model's KV cache is one pool of cells shared by ``max_sequences`` sequence slots (ollama's ``kvcache.Causal``
design). Each call of :meth:`TextScheduler.step`, on the device thread:

1. drops cancelled requests (their cells are freed at once);
2. admits queued requests while a slot is free (a request of a group of ``n`` choices after its group's first has
   been prefilled, so that it shares that prompt instead of prefilling it again). A request whose prompt starts with tokens some slot already holds
   reuses them: a finished conversation's slot is taken over and trimmed to the common prefix; a running request's
   prefix is shared through the cache's ``copy_prefix`` (cells are shared, not copied), for every cache kind,
   sliding-window layers included (when the window has already moved past the prefix, ``can_resume`` says so and
   the prompt is prefilled in full). A free slot is an empty one, else the least recently used finished one;
3. runs one prefill chunk (``prefill_chunk`` tokens) of the oldest admitted request, so that running decodes stall by
   at most one chunk;
4. runs one decode step for every decoding request together: one token per sequence in one forward pass, each
   request sampled with its own options and random key, and masked by its own grammar when it asked for structured
   output (the masks are computed on the host while the device runs the step). A request with speculative decoding
   (``speculative``, or the server's ``--speculative`` default) puts its last token and its draft in the same pass
   (every sequence's drafts verified together); its verified tokens are fed to its state one by one and the
   rejected cells removed from its sequence (:mod:`~mlx_engine.models.generation.speculative`). With a draft model
   (the runner's ``draft``) each sequence has its own sequence of the draft model's cache, and the sequences'
   drafts are drafted together, one draft-model pass per draft token; a new prompt reaches the draft model one
   prefill chunk per step (the sequence decodes plainly until then). With the model's multi-token-prediction
   layer (``mtp``) each sequence drafts on its own from the hidden states of its last pass
   (:mod:`~mlx_engine.models.generation.mtp`). Each sequence's draft length adapts to its own acceptance
   (:class:`~mlx_engine.models.generation.speculative.DraftLength`).

A finished request's slot keeps its tokens for reuse until the slot is needed (least recently used first): the cache
was reserved at load for ``max_sequences`` full contexts, and that reserved pool is the prefix cache's byte budget.
With a prompt cache on disk (:mod:`~mlx_engine.server.prompt_cache`) a finished conversation is also copied to the
host and queued for writing, and a request whose prompt starts with a saved prefix longer than any slot's gets it
put into its slot from the file before its prefill.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlx_engine.errors import (CacheFullError, EngineError, GenerationInterruptedError, InvalidRequestError,
                               ServerBusyError)
from mlx_engine.ml import DType
from mlx_engine.models.generation.core import SequenceState
from mlx_engine.models.generation.options import GenerationOptions
from mlx_engine.models.text.reasoning import THINKING
from mlx_engine.models.generation.runner import Runner
from mlx_engine.models.vision.images import prompt_keys
from mlx_engine.models.generation.speculative import DraftLength, judge, plan_all, record
from mlx_engine.api.parallel import serving_peer_lost
from mlx_engine.server.prompt_cache import ModelPromptCache

log = logging.getLogger("mlx_engine.server")

Emit = Callable[[str, Any], None]
"""``emit(kind, value)``: ``("text", str)`` for each piece of the answer and ``("thinking", str)`` for each piece of a
reasoning model's thinking (before the answer), ``("logprob", (token, logprob, top))`` before a token's text when
the job scores tokens, then ``("done", JobStats)`` or ``("error", exception)``.
Called on the device thread; it must only hand the event over (for example ``loop.call_soon_threadsafe``)."""


@dataclass
class JobStats:
    """What one request cost. Times in seconds (from submission), token counts.

    ``finish_reason``: ``stop`` (an end-of-sequence token or a stop string), ``length`` (``max_tokens`` or the full
    context) or ``cancelled``; ``stop_sequence``: the stop string that ended the answer (None for any other end).
    ``cached_tokens``: prompt tokens served from the prefix cache (not prefilled). ``token_gaps_s``: the time
    between each generated token and the next (inter-token latency; 0 between tokens of one verified draft). With
    speculative decoding: ``verify_steps`` (passes that verified a draft), ``draft_proposed`` and
    ``draft_accepted`` (draft tokens).
    """

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = ""
    stop_sequence: str | None = None
    queued_s: float = 0.0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0
    token_gaps_s: list[float] = field(default_factory=list)
    verify_steps: int = 0
    draft_proposed: int = 0
    draft_accepted: int = 0


class TextJob:
    """One text request: prompt tokens and options in, events out through ``emit``.

    ``cancel()`` may be called from any thread; the request stops within one step and frees its cells.
    ``top_logprobs``: None, or score each token (``emit("logprob", (token, logprob, top))`` before its text;
    :attr:`SequenceState.logprob`). ``leader``: the first request of a group with the same prompt (``n`` choices):
    this one is admitted once the leader's prompt is in the cache, and shares it.
    """

    def __init__(self, tokens: Sequence[int], options: GenerationOptions, emit: Emit, *,
                 top_logprobs: int | None = None, leader: "TextJob | None" = None):
        self.tokens = [int(t) for t in tokens]
        self.options = options
        self.images = list(options.images)  # at their places of tokens
        self.keys = prompt_keys(self.tokens, self.images)  # what the cache remembers (images by their pixels)
        self.emit = emit
        self.cancelled = False
        self.stats = JobStats(prompt_tokens=len(self.tokens))
        self.t_submit = time.perf_counter()
        self.t_start = self.t_first = 0.0
        self.seq = -1
        self.next_token = -1
        self.chunks_left = 0
        self.chunks: Any = None
        self.state: SequenceState | None = None  # the generation core's state: sampler, grammar, text, stops
        self.ctx: Any = None
        self.top_logprobs = top_logprobs
        self.leader = leader
        self.released = False
        self.t_last = 0.0
        self.drafter: Any = None  # speculative decoding: the drafter, its draft length and random generator
        self.length: DraftLength | None = None
        self.rng: np.random.Generator | None = None

    def cancel(self) -> None:
        self.cancelled = True

    @property
    def generated(self) -> int:
        return self.state.generated if self.state is not None else 0

    def ready(self) -> bool:
        """Whether it may be admitted: no leader, or the leader's prompt is prefilled (or it will never be)."""
        lead = self.leader
        return lead is None or bool(lead.t_first) or lead.released or lead.cancelled

    @property
    def pos(self) -> int:
        """The position the next fed token takes (= tokens the cache holds for this request)."""
        return len(self.tokens) + self.generated - 1


class _Slot:
    __slots__ = ("seq", "job", "last_used")

    def __init__(self, seq: int):
        self.seq, self.job, self.last_used = seq, None, 0.0


class TextScheduler:
    """Schedules text requests of one model (see the module docstring).

    Args:
        runner: the model's runner (its cache holds ``runner.max_sequences`` slots).
        max_queue: requests that may wait for a slot; beyond that :meth:`submit` raises ``ServerBusyError``.
        speculative: the ``speculative`` mode of requests that do not set one (``off``, ``lookup``, ``draft``,
            ``mtp``); None: ``draft`` when the runner has a draft model, else ``off``. Where the default cannot run
            (``draft`` without a draft model, ``mtp`` without MTP layers, a recurrent model) a request that did not
            choose decodes plainly.
    """

    def __init__(self, runner: Runner, *, max_queue: int = 64, speculative: str | None = None,
                 prompt_cache: "ModelPromptCache | None" = None):
        self.runner = runner
        self.prompt_cache = prompt_cache  # the prompt cache on disk (--prompt-cache-dir), or None
        self.speculative = speculative
        self.drafts = {"verify_steps": 0, "draft_proposed": 0, "draft_accepted": 0}  # totals, for /status
        self.backend = runner.backend
        self.max_queue = max_queue
        self.distributed = getattr(runner.model, "group", None) is not None  # split over mlx.launch's ranks
        self._slots = [_Slot(s) for s in range(runner.max_sequences)]
        self._pending: deque[TextJob] = deque()
        self._lock = threading.Lock()
        self._prefilling: list[TextJob] = []
        self._decoding: list[TextJob] = []
        self._unloaded = False

    # ---- any thread ---------------------------------------------------------------------------------------------
    def submit(self, job: TextJob) -> None:
        """Queue a request. Raises ``InvalidRequestError`` (a prompt that does not fit the context) or
        ``ServerBusyError`` (the queue is full)."""
        if not job.tokens:
            raise InvalidRequestError("the prompt is empty; give at least one token of text")
        if len(job.tokens) >= self.runner.context_length:
            raise InvalidRequestError(
                f"the prompt has {len(job.tokens)} tokens but the context holds {self.runner.context_length}; "
                "shorten the prompt or start the server with a larger --context-length")
        with self._lock:
            if self._unloaded:
                raise ServerBusyError("the model was unloaded while this request was being prepared; retry",
                                      retry_after=1.0)
            free = sum(1 for s in self._slots if s.job is None)  # requests about to be admitted do not queue
            if len(self._pending) >= self.max_queue + free:
                raise ServerBusyError(f"all {len(self._slots)} sequences are busy and {len(self._pending)} requests "
                                      "are queued; retry shortly", retry_after=1.0)
            self._pending.append(job)

    def load(self) -> dict[str, int]:
        """Running, prefilling and queued requests; the cache's cells in use, the cells holding the tokens recorded
        for the slots (``cells_kept``: equal to ``cells_in_use`` when no request runs, else cells leaked) and those
        tokens (``tokens_kept``: the prefix cache's conversations and the running requests); speculative decoding's
        totals (verification passes, draft tokens proposed and accepted), with ``acceptance_rate`` (accepted over
        proposed) and ``tokens_per_verification`` (the tokens a pass gave: the accepted draft tokens and the model's
        own) once a pass ran. For status and tests."""
        with self._lock:
            queued = len(self._pending)
        runner, d = self.runner, self.drafts
        rates = {}
        if d["verify_steps"]:
            rates = {"acceptance_rate": d["draft_accepted"] / d["draft_proposed"] if d["draft_proposed"] else 0.0,
                     "tokens_per_verification": (d["draft_accepted"] + d["verify_steps"]) / d["verify_steps"]}
        return {"decoding": len(self._decoding), "prefilling": len(self._prefilling), "queued": queued,
                "cells_in_use": runner.cells_in_use(), "cells_kept": runner.cells_kept(),
                "tokens_kept": sum(runner.cached_length(s.seq) for s in self._slots), "slots": len(self._slots),
                **d, **rates}

    def busy(self) -> bool:
        return bool(self._pending or self._prefilling or self._decoding)

    # ---- device thread ------------------------------------------------------------------------------------------
    def step(self) -> bool:
        """One scheduling step (see the module docstring). Returns whether work remains."""
        self._drop_cancelled()
        self._admit()
        if self._prefilling:
            self._prefill_one()
        if self._decoding:
            self._decode()
        return self.busy()

    def _drop_cancelled(self) -> None:
        with self._lock:
            gone = [j for j in self._pending if j.cancelled]
            for j in gone:
                self._pending.remove(j)
        for j in gone:
            j.stats.finish_reason = "cancelled"
            j.emit("done", j.stats)
        for j in [j for j in self._prefilling + self._decoding if j.cancelled]:
            self._finish(j, "cancelled")

    def _admit(self) -> None:
        while True:
            free = [s for s in self._slots if s.job is None]
            with self._lock:
                job = next((j for j in self._pending if j.ready()), None) if free else None
                if job is None:
                    return
                self._pending.remove(job)
            try:
                self._start(job, free)
            except EngineError as e:
                self._fail(job, e)
            except RuntimeError as e:
                if not self.distributed:
                    raise
                self.fail_all(serving_peer_lost(e), job)  # a rank of the split model is gone
                return

    def _start(self, job: TextJob, free: list[_Slot]) -> None:
        runner, tokens = self.runner, job.tokens
        req = job.options.request(tokens)
        chosen = req.speculative is not None
        req.speculative = req.speculative or self.speculative
        best, n = None, 0
        for s in self._slots:
            k = min(runner.common_prefix(s.seq, job.keys), len(tokens) - 1)
            if k > n:
                best, n = s, k
        found = self.prompt_cache.find(job.keys, n) if self.prompt_cache is not None else None
        if found is not None:  # the disk holds a longer prefix: put it into a free slot, prefill from there
            dst = min(free, key=lambda s: (runner.cached_length(s.seq) > 0, s.last_used))
            if not self.prompt_cache.restore(runner, dst.seq, found[0]) and best is not None and best is not dst:
                runner.share_prefix(best.seq, dst.seq, job.keys)  # the file failed: what memory holds
        elif best is not None and best.job is None:
            dst = best  # a finished conversation continues: trimmed to the common prefix by prefill_chunks
        else:
            # an empty slot first, else the least recently used finished one
            dst = min(free, key=lambda s: (runner.cached_length(s.seq) > 0, s.last_used))
            if best is not None:
                runner.share_prefix(best.seq, dst.seq, job.keys)
                if runner.draft is not None:  # the draft model's cache follows: the prefix need not run on it
                    runner.draft.share_prefix(best.seq, dst.seq, tokens)
        dst.job, job.seq = job, dst.seq
        req.sequence = dst.seq
        try:
            if job.top_logprobs is not None and req.speculative not in (None, "off"):
                if chosen:
                    raise InvalidRequestError("logprobs and speculative decoding cannot be asked together (a "
                                              "verified draft's tokens are scored in one pass); drop one of them")
                req.speculative = "off"  # the server's default gives way to the request's logprobs
            job.drafter = runner.drafter(req)
        except InvalidRequestError:
            if chosen:
                raise
            job.drafter = None  # the server's default on a model that cannot speculate (recurrent): plain decode
        if job.drafter is not None:
            job.length = DraftLength(req.draft_tokens)
            job.rng = np.random.default_rng(req.sampler.seed if req.sampler.seed is not None else secrets.randbits(63))
        ctx = self.backend.new_context()
        job.state = runner.sequence_state(req, ctx, top_logprobs=job.top_logprobs)
        reused, job.chunks = runner.prefill_chunks(ctx, dst.seq, tokens, job.images)
        job.ctx = ctx
        job.chunks_left = len(runner.chunk_bounds(reused, len(tokens),
                                                  [(im.start, im.start + im.count) for im in job.images]))
        job.stats.cached_tokens = reused
        job.t_start = time.perf_counter()
        job.stats.queued_s = job.t_start - job.t_submit
        self._prefilling.append(job)

    def _prefill_one(self) -> None:
        job = self._prefilling[0]
        try:
            logits = next(job.chunks)
            job.chunks_left -= 1
            if job.chunks_left > 0:
                return
            tok = job.state.sample(job.ctx, logits)
            job.ctx.evaluate(tok)
            t = int(tok.item())
        except EngineError as e:
            self._fail(job, e)
            return
        except Exception as e:  # noqa: BLE001 -- one request's failure must not stop the others
            if self.distributed and isinstance(e, RuntimeError):
                self.fail_all(serving_peer_lost(e))
                return
            log.exception("prefill failed")
            self._fail(job, e)
            return
        self._prefilling.pop(0)
        job.t_first = time.perf_counter()
        job.stats.prefill_s = job.t_first - job.t_start
        job.stats.ttft_s = job.t_first - job.t_submit
        self._accept(job, t)

    def _decode(self) -> None:
        jobs = list(self._decoding)
        if any(j.drafter is not None for j in jobs):
            self._verify(jobs)
            return
        ctx = self.backend.new_context()
        try:
            logits = self.runner.decode(ctx, [j.next_token for j in jobs], [j.pos for j in jobs],
                                        [j.seq for j in jobs])
            toks = self._sampled(ctx, jobs, logits, list(range(len(jobs))))
        except Exception as e:  # noqa: BLE001 -- fail this batch's requests, keep serving
            self._step_failed(jobs, e)
            return
        for j, t in zip(jobs, toks):
            self._accept(j, t)

    def _sampled(self, ctx, jobs: list[TextJob], logits, rows: list[int]) -> list[int]:
        """The next token of each of ``jobs`` from its row ``rows[i]`` of ``logits`` (one step each)."""
        if all(j.state.plain_greedy for j in jobs):
            sampled = logits.astype(DType.FLOAT32).argmax(axis=-1).astype(DType.INT32)
            ctx.evaluate(sampled)
            picked = sampled.numpy()
            return [int(picked[r]) for r in rows]
        if any(j.state.constraint is not None for j in jobs):
            ctx.evaluate_async(logits)  # the device runs the step while the host computes the masks
        out = [j.state.sample(ctx, logits[r:r + 1]) for j, r in zip(jobs, rows)]
        ctx.evaluate(*out)
        return [int(t.item()) for t in out]

    def _verify(self, jobs: list[TextJob]) -> None:
        """One pass over every decoding request, each speculating one with its last token and its draft (a
        request without speculation with its last token alone); then each request's verified tokens are fed to its
        state and its rejected cells removed. A cache without room for the drafts runs one token each."""
        ctx = self.backend.new_context()
        try:
            drafting = [j for j in jobs if j.drafter is not None]
            planned = dict(zip(drafting, plan_all([(j.state, j.tokens, j.drafter, j.length) for j in drafting],
                                                  catch_up=True)))
            runs = [planned.get(j, ([j.next_token], j.pos)) for j in jobs]
            try:
                logits = self.runner.verify(ctx, [(j.seq, ids, pos) for j, (ids, pos) in zip(jobs, runs)])
            except CacheFullError:
                runs = [(ids[:1], pos) for ids, pos in runs]
                logits = self.runner.verify(ctx, [(j.seq, ids, pos) for j, (ids, pos) in zip(jobs, runs)])
            starts = np.cumsum([0] + [len(ids) for ids, _ in runs])
            greedy = (logits.astype(DType.FLOAT32).argmax(axis=-1).numpy()
                      if any(j.state.plain_greedy for j in jobs) else None)
            plain = [i for i, j in enumerate(jobs) if j.drafter is None]
            toks = dict(zip(plain, self._sampled(ctx, [jobs[i] for i in plain], logits, [starts[i] for i in plain])))
        except Exception as e:  # noqa: BLE001 -- fail this batch's requests, keep serving
            self._step_failed(jobs, e)
            return
        for i, (j, (ids, pos)) in enumerate(zip(jobs, runs)):
            if j.drafter is None:
                self._accept(j, toks[i])
                continue
            a, b = int(starts[i]), int(starts[i + 1])
            try:
                out, fed = judge(ctx, j.state, ids, logits[a:b], j.rng,
                                 greedy[a:b] if greedy is not None and j.state.plain_greedy else None)
            except EngineError as e:
                self._fail(j, e)
                continue
            self.runner.truncate(j.seq, pos + fed)
            record(j.stats, j.length, len(ids) - 1, fed)
            for k, v in (("verify_steps", 1), ("draft_proposed", len(ids) - 1), ("draft_accepted", fed - 1)):
                self.drafts[k] += v
            self._took(j, out)

    def _step_failed(self, jobs: list[TextJob], e: Exception) -> None:
        if self.distributed and isinstance(e, RuntimeError):
            self.fail_all(serving_peer_lost(e))
            return
        if not isinstance(e, EngineError):
            log.exception("decode step failed")
        for j in jobs:
            self._fail(j, e)

    def _accept(self, job: TextJob, token: int) -> None:
        """A sampled token: emit its text, then finish the request or queue the token for the next step."""
        try:
            pieces = job.state.accept(token)  # the generation core: grammar, text, stop conditions
        except EngineError as e:
            self._fail(job, e)
            return
        if job.state.logprob is not None:
            job.emit("logprob", job.state.logprob)
        self._took(job, [(token, pieces)])

    def _took(self, job: TextJob, accepted: list[tuple[int, list[tuple[str, str]]]]) -> None:
        """Tokens the state accepted (with their text pieces): emit the text, then finish the request or queue its
        last token for the next step."""
        now = time.perf_counter()
        for _, pieces in accepted:
            if job.t_last:
                job.stats.token_gaps_s.append(now - job.t_last)
            job.t_last = now
            self._emit(job, pieces)
        if job.state.finish_reason:
            self._finish(job, "length" if job.state.finish_reason == "length" else "stop")  # eos, a stop string
            return
        job.next_token = accepted[-1][0]
        if job not in self._decoding:
            self._decoding.append(job)

    @staticmethod
    def _emit(job: TextJob, pieces: list[tuple[str, str]]) -> None:
        for kind, text in pieces:
            job.emit("thinking" if kind == THINKING else "text", text)

    def _release(self, job: TextJob, *, drop_cells: bool) -> None:
        for q in (self._prefilling, self._decoding):
            if job in q:
                q.remove(job)
        job.released = True
        if job.chunks is not None:
            job.chunks.close()
        if job.seq >= 0:
            slot = self._slots[job.seq]
            slot.job, slot.last_used = None, time.perf_counter()
            if drop_cells:
                self.runner.reset(job.seq)

    def _finish(self, job: TextJob, reason: str) -> None:
        self._release(job, drop_cells=reason == "cancelled")
        now = time.perf_counter()
        st = job.stats
        st.finish_reason, st.completion_tokens = reason, job.generated
        if job.state is not None and job.state.text is not None:
            st.stop_sequence = job.state.text.stop_sequence
        st.decode_s = now - job.t_first if job.t_first else 0.0
        st.total_s = now - job.t_submit
        job.emit("done", st)
        if self.prompt_cache is not None and reason != "cancelled" and job.seq >= 0:
            try:  # the writer thread saves it; here only the copy of its cells to the host
                self.prompt_cache.save_sequence(self.runner, job.seq)
            except Exception:  # noqa: BLE001 -- the answer is given; a snapshot that fails is only not saved
                log.exception("prompt cache: taking a snapshot failed")

    def _fail(self, job: TextJob, error: Exception) -> None:
        self._release(job, drop_cells=True)  # the cache may hold a partial chunk: start this slot afresh
        job.emit("error", error)

    def fail_all(self, error: Exception, *starting: TextJob) -> None:
        """The model cannot run any more (a rank of a split model is gone): every request (and those ``starting``)
        ends with ``error``, and later submits fail; the KV cache is not touched (its every change would need the
        lost rank)."""
        with self._lock:
            self._unloaded = True
            pending, self._pending = list(self._pending), deque()
        for j in [*starting, *pending, *self._prefilling, *self._decoding]:
            j.emit("error", error)
        self._prefilling, self._decoding = [], []

    def close(self, unloaded: bool = False, reason: str = "shutdown") -> None:
        """End every queued and running request with :class:`GenerationInterruptedError` (``reason``: why the model
        went away: ``shutdown``, ``unloaded``, ``deleted``), never with a finish that looks complete; with
        ``unloaded`` later submits fail too. A request its own client cancelled just ends (nobody reads it)."""
        with self._lock:
            self._unloaded = self._unloaded or unloaded
            pending, self._pending = list(self._pending), deque()
        for j in pending + self._prefilling + self._decoding:
            if j.cancelled:
                self._finish(j, "cancelled")
                continue
            self._fail(j, interrupted(reason, j.generated))


_WHY = {"shutdown": "the server is shutting down", "unloaded": "another request unloaded the model",
        "deleted": "the model was deleted", "closed": "the model was closed"}


def interrupted(reason: str, generated: int) -> GenerationInterruptedError:
    """The error of a request cut after ``generated`` tokens because its model went away (``reason``)."""
    return GenerationInterruptedError(
        f"the answer is incomplete: {_WHY.get(reason, reason)} after {generated} generated tokens; retry the request",
        reason)
