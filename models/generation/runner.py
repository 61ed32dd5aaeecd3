"""The shared runner: chunked prefill, pipelined decode, several sequences in one batch, stop conditions, statistics.

One runner serves every architecture: it speaks to the model through ``forward(ctx, batch, cache)`` and keeps, per
sequence, the tokens whose keys and values are in the cache, so that a new request on a sequence prefills only what
differs from what is cached (a chat session's turn N prefills only the new message).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from mlx_engine.batch import Batch
from mlx_engine.errors import CacheFullError, InvalidRequestError
from mlx_engine.kvcache import Checkpoints
from mlx_engine.ml import DType, Tensor
from mlx_engine.models.layers.base import DecoderModel
from mlx_engine.models.text.constraint import Constraint, GrammarTokenizer, ResponseFormat
from mlx_engine.models.generation.core import SequenceState
from mlx_engine.models.generation.draft_model import check_vocabulary
from mlx_engine.models.generation.mtp import MTPHead
from mlx_engine.models.generation.speculative import DraftLength, Drafter, make_drafter, speculate
from mlx_engine.models.vision.images import PromptImage, prompt_keys
from mlx_engine.models.text.reasoning import (HARMONY, DeferredConstraint, HarmonyParser, ReasoningParser,
                                         prompt_opens_span, think_markers)
from mlx_engine.models.generation.sampler import Sampler, SamplerOptions
from mlx_engine.models.generation.scoring import sum_nll
from mlx_engine.models.generation.stats import GenerationStats
from mlx_engine.models.text.text_assembly import TextAssembler, typed_pieces
from mlx_engine.models.text.tokenizer import Tokenizer


@dataclass
class Request:
    """One generation request on one sequence.

    Attributes:
        tokens: the prompt's token ids (already templated and tokenized).
        sampler: sampling options (validated on construction of the runner's sampler).
        max_tokens: the most tokens to generate.
        stop: stop strings; generation ends before the first one, which is not returned.
        sequence: the cache sequence id to use.
        response_format: what the output must match (structured output), or None for free text.
        images: images at explicit places of ``tokens`` (their placeholder tokens), for a model with a vision part.
        reasoning: keep a reasoning model's thinking span apart from the answer (False: raw text, as a plain
            completion wants it).
        speculative: ``off``, ``lookup`` (prompt lookup drafts), ``draft`` (the attached draft model's drafts) or
            ``mtp`` (the model's multi-token-prediction layer's drafts); None: ``draft`` when the runner has a draft
            model (:meth:`Runner.attach_draft`), else ``off``.
        draft_tokens: the most draft tokens one verification step checks (the draft length adapts within 1..this).
    """

    tokens: Sequence[int]
    sampler: SamplerOptions = field(default_factory=SamplerOptions)
    max_tokens: int = 256
    stop: Sequence[str] = ()
    sequence: int = 0
    response_format: ResponseFormat | None = None
    images: Sequence[PromptImage] = ()
    reasoning: bool = True
    speculative: str | None = None
    draft_tokens: int = 8


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


class Runner:
    """Runs requests for one model.

    Args:
        model: the text model.
        tokenizer: its tokenizer (end-of-sequence ids, streaming detokenizer).
        context_length: the most tokens a sequence may hold (the cache's capacity).
        max_sequences: how many sequences the cache holds at once.
        prefill_chunk: the most tokens in one forward pass (prefill runs in chunks of this size).
        kv_bits: quantize the KV cache to 8 or 4 bits (None: the compute dtype).
        reserve: allocate the cache's worst case now, so that a model that cannot fit fails here.
    """

    def __init__(self, model: DecoderModel, tokenizer: Tokenizer | None, *, context_length: int, max_sequences: int = 4,
                 prefill_chunk: int = 2048, kv_bits: int | None = None, reserve: bool = False):
        self.model = model
        self.tokenizer = tokenizer
        self.backend = model.backend
        self.context_length = context_length
        self.max_sequences = max_sequences
        self.prefill_chunk = prefill_chunk
        self._grammar_tokenizer: GrammarTokenizer | None = None
        self._grammar_lock = threading.Lock()
        self.cache = model.make_cache(kv_bits)
        # an image's rows are never split over two forward passes: a pass may hold a whole image
        image_rows = model.vision.tokens_per_image if model.vision is not None else 0
        self.cache.init(self.backend, model.dtype, max_sequences, context_length, max(prefill_chunk, image_rows))
        if reserve:
            with self.backend.new_context() as ctx:
                self.cache.reserve(ctx, model.layer_kv_shapes())
        self._cached: dict[int, list[int]] = {}
        self.draft: Runner | None = None  # a draft model's runner (attach_draft)
        self.kv_bits, self.name = kv_bits, ""  # the name: the model's, for messages (the API sets it)
        self.mtp: MTPHead | None = None  # the multi-token-prediction head, built by the first request for it
        #: the model's thinking span (None: it does not think, or there is no tokenizer to tell)
        self.think_markers = (think_markers(tokenizer.chat_template, tokenizer.token_to_id)
                              if tokenizer is not None else None)

    # ---- cache bookkeeping -------------------------------------------------------------------------------------
    def cached_tokens(self, sequence: int = 0) -> list[int]:
        """The tokens whose keys and values the cache holds for ``sequence``, in position order."""
        return list(self._cached.get(sequence, []))

    def reset(self, sequence: int | None = None) -> None:
        """Forget a sequence (or all of them)."""
        for seq in ([sequence] if sequence is not None else list(self._cached)):
            if self._cached.get(seq):
                self.cache.remove(seq, 0, None)
            self._cached.pop(seq, None)
            if self.mtp is not None:
                self.mtp.forget(seq)

    def adopt(self, sequence: int, keys: Sequence[int]) -> None:
        """Record ``keys`` as what the cache holds for ``sequence`` (its cells were put in from a snapshot)."""
        self._cached[sequence] = [int(k) for k in keys]

    def _check_request(self, req: Request) -> None:
        if len(req.tokens) == 0:
            raise InvalidRequestError("the prompt is empty; give at least one token of text")
        if not 0 <= req.sequence < self.max_sequences:
            raise InvalidRequestError(f"sequence {req.sequence} out of range: this runner holds "
                                      f"{self.max_sequences} sequences")
        if len(req.tokens) >= self.context_length:
            raise InvalidRequestError(
                f"the prompt has {len(req.tokens)} tokens but the context holds {self.context_length}; "
                f"shorten the prompt or load the model with a larger context length (--context-length, "
                f"context_length=)")
        if req.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {req.max_tokens}")
        if req.images and self.model.vision is None:
            raise InvalidRequestError(f"{self.model.architecture} model without a vision part: it cannot read images")
        for im in req.images:
            if not 0 <= im.start < im.start + im.count <= len(req.tokens):
                raise InvalidRequestError(f"an image at tokens {im.start}..{im.start + im.count - 1} of a prompt of "
                                          f"{len(req.tokens)}")

    def rewind(self, seq: int, tokens: Sequence[int], images: Sequence[PromptImage] = ()) -> int:
        """Drop what the cache holds for ``seq`` beyond its common prefix with ``tokens`` (cache keys: see
        :func:`prompt_keys`; at most ``len(tokens) - 1``, whole images; a recurrent state: back to its nearest
        checkpoint); return that length: ``tokens`` from there on are what ``seq`` must run next."""
        cached = self._cached.get(seq, [])
        n = min(_common_prefix(cached, tokens), len(tokens) - 1)  # at least one token must run to give logits
        n = min([im.start for im in images if im.start < n < im.start + im.count], default=n)  # whole images
        if n < len(cached):
            n = self.cache.restore_point(seq, n) if n > 0 else 0  # a recurrent state: its nearest checkpoint
            self.cache.remove(seq, n, None)
            self._cached[seq] = cached[:n]
        return n

    # ---- structured output -------------------------------------------------------------------------------------
    def grammar_tokenizer(self) -> GrammarTokenizer:
        """The grammar engine's view of this model's vocabulary, built on first use and kept."""
        with self._grammar_lock:  # the server's request threads and its device thread may ask at once
            if self._grammar_tokenizer is None:
                tk = self.tokenizer
                self._grammar_tokenizer = GrammarTokenizer(tk.backend.to_str(), tk.vocab_size, tk.eos_ids)
            return self._grammar_tokenizer

    def constraint(self, req: Request) -> "Constraint | DeferredConstraint | None":
        """The grammar state of ``req`` (None without a ``response_format``); for a model that thinks, one that
        applies after the thinking span (:class:`~mlx_engine.models.text.reasoning.DeferredConstraint`). Raises
        ``InvalidRequestError`` for a grammar this vocabulary cannot follow or that cannot fit ``max_tokens``."""
        if req.response_format is None:
            return None
        inner = Constraint(self.grammar_tokenizer(), req.response_format, req.max_tokens)
        if self.think_markers is None or not req.reasoning:
            return inner
        return DeferredConstraint(inner, self.tokenizer.detokenizer(), self.think_markers,
                                  self.tokenizer.token_to_id(self.think_markers.open), self._starts_inside(req.tokens))

    # ---- reasoning ---------------------------------------------------------------------------------------------
    #: prompt tokens read to tell whether a prompt leaves the thinking span open (templates open it at the very end)
    PROMPT_TAIL = 64

    def _starts_inside(self, tokens: Sequence[int]) -> bool:
        tail = self.tokenizer.decode([int(t) for t in tokens[-self.PROMPT_TAIL:]])
        return prompt_opens_span(tail, self.think_markers)

    def reasoning(self, req: Request) -> ReasoningParser | HarmonyParser | None:
        """The thinking parser of ``req`` (None for a model whose template and vocabulary have no thinking span, or
        a request for raw text; gpt-oss's harmony channels: :class:`HarmonyParser`), starting inside the span when
        the prompt opened it."""
        if self.think_markers is None or not req.reasoning:
            return None
        if self.think_markers is HARMONY:
            return HarmonyParser(self._starts_inside(req.tokens))
        return ReasoningParser(self.think_markers, self._starts_inside(req.tokens))

    def text_assembler(self, req: Request) -> TextAssembler:
        """The text assembly of ``req``: its stop strings, and its thinking kept apart."""
        return TextAssembler(self.tokenizer, req.stop, self.reasoning(req))

    def _checkpoints(self) -> "Checkpoints | None":
        """The cache, where it keeps checkpoints the runner should ask for (a recurrent state); else None."""
        cache = self.cache
        return cache if isinstance(cache, Checkpoints) and cache.keeps_checkpoints else None

    # ---- prefill -----------------------------------------------------------------------------------------------
    def chunk_bounds(self, start: int, end: int, spans: Sequence[tuple[int, int]] = ()) -> list[tuple[int, int]]:
        """The ``[begin, end)`` ranges in which positions ``start .. end - 1`` of a prompt are prefilled: chunks of
        at most ``prefill_chunk`` tokens; with a cache that rolls back only to checkpoints (a recurrent state),
        chunks also end on its checkpoint grid, and the prompt's last token runs alone after a checkpoint, so that
        the same prompt can be answered again (a regenerated reply, an edited last message) by running one token
        instead of the whole prompt. No chunk ends inside one of ``spans`` (an image's ``[begin, end)``): the cut
        moves to the image's start, or, when the image starts the chunk, to its end."""
        ck = self._checkpoints()
        cuts = {p + 1 for p in ck.checkpoint_grid(start, end - 1)} if ck else set()  # on the checkpoint grid
        if ck and end - start > 1:
            cuts.add(end - 1)
        bounds, b = [], start
        for e in sorted(cuts | {end}):
            while b < e:
                bounds.append((b, min(b + self.prefill_chunk, e)))
                b = bounds[-1][1]
        if not spans:
            return bounds
        out: list[tuple[int, int]] = []
        b = start
        for _, e in bounds:
            for lo, hi in spans:
                if lo < e < hi:
                    e = lo if lo > b else hi
            if e > b:
                out.append((b, e))
                b = e
        return out

    def prefill_chunks(self, ctx, seq: int, tokens: Sequence[int],
                       images: Sequence[PromptImage] = ()) -> tuple[int, Iterator[Tensor]]:
        """Prefill ``tokens`` of sequence ``seq`` one chunk at a time, reusing the cached prefix.

        Returns ``(reused, chunks)``: how many leading tokens came from the cache, and an iterator that runs one
        chunk of at most ``prefill_chunk`` tokens per ``next()`` (evaluated, so that the graph and the memory of
        intermediates stay bounded to one chunk) and yields that chunk's last-token logits ``[1, vocab]``; the last
        one yielded is the prompt's. A scheduler interleaves decode steps of other sequences between chunks.
        Raises ``CacheFullError`` (from ``next()``) when the cache has no room. ``images`` sit at their places of
        ``tokens``; each runs through the vision encoder (in a context of its own) when its chunk comes.
        """
        keys = prompt_keys(tokens, images)
        start = self.rewind(seq, keys, images)
        bounds = self.chunk_bounds(start, len(tokens), [(im.start, im.start + im.count) for im in images])
        ck = self._checkpoints()
        states = self.cache if isinstance(self.cache, Checkpoints) else None

        def chunks() -> Iterator[Tensor]:
            for begin, end in bounds:
                chunk = np.asarray(tokens[begin:end], np.int32)
                if ck and end == len(tokens) - 1:
                    ck.request_checkpoint(seq)
                batch = Batch.single(chunk, begin, seq)
                batch.images = [(im.start - begin, self.model.vision.encode(im.pixels))
                                for im in images if begin <= im.start < end]
                logits = self._forward(ctx, batch, [(seq, begin, end - begin)])
                ctx.evaluate(logits, *(states.state_tensors() if states else ()))
                self._cached.setdefault(seq, []).extend(keys[begin:end])
                if self.mtp is not None:  # the MTP head runs what it can now, keeping few hidden states
                    self.mtp.catch_up(ctx, seq, tokens[:end + 1])
                yield logits
        return start, chunks()

    def prefill(self, ctx, seq: int, tokens: Sequence[int], images: Sequence[PromptImage] = ()) -> tuple[Tensor, int]:
        """Run ``tokens`` of sequence ``seq`` through the model in chunks, reusing the cached prefix.

        Returns the logits ``[1, vocab]`` of the last token and how many tokens were run.
        Raises ``CacheFullError`` when the cache has no room.
        """
        start, chunks = self.prefill_chunks(ctx, seq, tokens, images)
        logits = None
        for logits in chunks:
            pass
        return logits, len(tokens) - start

    def perplexity(self, ctx, tokens: Sequence[int], seq: int = 0, chunk: int = 128) -> tuple[float, int]:
        """Mean negative log-likelihood (natural log, per token) of ``tokens[1:]`` given their prefixes, in one
        window (the sequence is reset first), and how many tokens were scored. ``exp`` of it is the perplexity, the
        figure ``llama-perplexity`` prints (which scores the second half of each window; the bench compares like
        with like). Runs ``chunk`` tokens per forward pass so that the logits held stay ``[chunk, vocab]``.
        Raises ``InvalidRequestError`` for fewer than 2 tokens or more than the context; ``CacheFullError``."""
        if len(tokens) < 2:
            raise InvalidRequestError("perplexity needs at least 2 tokens")
        if len(tokens) > self.context_length:
            raise InvalidRequestError(f"{len(tokens)} tokens do not fit the context of {self.context_length}")
        self.reset(seq)
        nll = 0.0
        for begin in range(0, len(tokens) - 1, chunk):
            ids = np.asarray(tokens[begin:begin + chunk], np.int32)
            batch = Batch(ids, np.arange(begin, begin + len(ids)), np.full(len(ids), seq), np.arange(len(ids)))
            logits = self.model.forward(ctx, batch, self.cache).astype(DType.FLOAT32).numpy()
            self._cached.setdefault(seq, []).extend(int(t) for t in ids)
            targets = np.asarray(tokens[begin + 1:begin + 1 + len(ids)], np.int64)
            nll += sum_nll(logits[:len(targets)], targets)
        return nll / (len(tokens) - 1), len(tokens) - 1

    # ---- several sequences, one token each (continuous batching) ----------------------------------------------
    def decode(self, ctx, tokens: Sequence[int], positions: Sequence[int], sequences: Sequence[int]) -> Tensor:
        """One decode step over several sequences in one forward pass: ``tokens[i]`` at ``positions[i]`` of
        ``sequences[i]`` (each sequence at most once). Returns logits ``[K, vocab]`` in that order (lazy), and
        records the tokens as cached. Raises ``CacheFullError`` with the cache unchanged when it has no room."""
        return self.verify(ctx, [(s, [t], p) for t, p, s in zip(tokens, positions, sequences)])

    def share_prefix(self, src: int, dst: int, tokens: Sequence[int]) -> int:
        """Make ``dst`` (emptied first) share the cells of the longest common prefix of ``src``'s cached tokens and
        ``tokens`` (at most ``len(tokens) - 1``: one token must run to give logits), through the cache's
        ``copy_prefix``. Returns the number of shared tokens; 0 when the cache could not resume ``dst`` there (a
        sliding window that has moved past the prefix), in which case ``dst`` is left empty."""
        self.reset(dst)
        n = min(_common_prefix(self._cached.get(src, []), tokens), len(tokens) - 1)
        if n > 0:
            n = self.cache.restore_point(src, n)  # a recurrent state is shared at one of its checkpoints
        if n <= 0:
            return 0
        self.cache.copy_prefix(src, dst, n)
        if not self.cache.can_resume(dst, n):
            self.cache.remove(dst, 0, None)
            return 0
        self._cached[dst] = list(tokens[:n])
        if self.mtp is not None:
            self.mtp.share(src, dst, n)
        return n

    def cached_length(self, seq: int) -> int:
        """How many tokens the cache holds for ``seq``."""
        return len(self._cached.get(seq, ()))

    def common_prefix(self, seq: int, tokens: Sequence[int]) -> int:
        """Length of the common prefix of ``seq``'s cached tokens and ``tokens``."""
        return _common_prefix(self._cached.get(seq, []), tokens)

    def cells_in_use(self) -> int:
        """Cells of the KV cache owned by at least one sequence (summed over the caches of a wrapper)."""
        return sum(c.cells_in_use() for c in getattr(self.cache, "caches", [self.cache]))

    def cells_kept(self) -> int:
        """Cells that hold the tokens recorded for the sequences (the prefix cache's finished conversations and the
        running requests). With no forward pass under way it equals :meth:`cells_in_use` unless cells leaked."""
        lengths = [self.cached_length(s) for s in range(self.max_sequences)]
        return sum(c.cells_below(lengths) for c in getattr(self.cache, "caches", [self.cache]))

    # ---- one request ------------------------------------------------------------------------------------------
    def sequence_state(self, req: Request, ctx, *, text: bool = True, eos: bool = False,
                       top_logprobs: int | None = None) -> SequenceState:
        """The generation core's state of ``req`` (:class:`~mlx_engine.models.generation.core.SequenceState`): its sampler
        (random key from ``ctx``), grammar, and with ``text`` its text assembly (stop strings, end of sequence,
        thinking apart); without text, ``eos`` makes an end-of-sequence id end it; ``top_logprobs`` (None: off)
        scores each token. Raises ``InvalidRequestError`` for bad sampler options or a grammar this vocabulary
        cannot follow."""
        return SequenceState(req.tokens, Sampler(req.sampler, ctx), max_tokens=req.max_tokens,
                             context_length=self.context_length, constraint=self.constraint(req),
                             text=self.text_assembler(req) if text else None,
                             eos_ids=self.tokenizer.eos_ids if eos else (), top_logprobs=top_logprobs)

    def generate_tokens(self, req: Request, stats: GenerationStats | None = None) -> Iterator[int]:
        """The generated token ids of one request, one at a time, up to ``max_tokens``, a full context or the end
        of its grammar (the caller decides about end-of-sequence ids and stop strings by closing the generator).

        Decode is pipelined: step ``n + 1`` is dispatched to the device before token ``n`` is read back, so the
        host's work overlaps the device's (the first token goes out before step 2 is dispatched, not after). Every
        token yielded has been fed to the model (its step is built, if not yet run), so the cache then holds the
        prompt and exactly the tokens read so far. ``stats`` (if given) receives the timings.
        """
        for token, _ in self._generate(req, stats if stats is not None else GenerationStats(), text=False):
            yield token

    def stream(self, req: Request) -> Iterator["str | GenerationStats"]:
        """Generate for one request: yields text chunks (never half a UTF-8 character, never part of a stop
        string; a reasoning model's thinking as :class:`~mlx_engine.models.text.reasoning.Thinking` chunks, the answer as
        plain ``str``), then one :class:`GenerationStats`. Stops at an end-of-sequence id, a stop string, ``max_tokens``
        or a full context. Closing the generator early stops generation; the cache then holds exactly the tokens
        read so far."""
        stats = GenerationStats()
        steps = self._generate(req, stats, text=True)
        try:
            for _, pieces in steps:
                yield from typed_pieces(pieces)
        except GeneratorExit:
            stats.stop_reason = "interrupted"
            raise
        finally:
            steps.close()
        yield stats

    def _generate(self, req: Request, stats: GenerationStats, *, text: bool) -> Iterator[tuple[int, list]]:
        """The single-request loop: ``(token, text pieces)`` per generated token, through the generation core
        (:class:`SequenceState`), until its finish reason is set (see :meth:`generate_tokens` for the pipelining)."""
        self._check_request(req)
        stats.prompt_tokens = len(req.tokens)
        seq = req.sequence
        self.backend.reset_peak_memory()
        t0 = time.perf_counter()
        ctx = self.backend.new_context()
        drafter = self.drafter(req)
        state = self.sequence_state(req, ctx, text=text)
        logits, stats.prefilled_tokens = self.prefill(ctx, seq, list(req.tokens), req.images)
        steps = (self._pipelined(ctx, req, state, logits) if drafter is None else
                 self._speculative(ctx, req, state, logits, drafter, stats))
        t_first = None
        try:
            for t, pieces in steps:
                if t_first is None:
                    t_first = time.perf_counter()
                    stats.ttft_s = t_first - t0
                self._finish(stats, state, t_first)
                yield t, pieces
        finally:
            steps.close()
            self._finish(stats, state, t_first)

    def _pipelined(self, ctx, req: Request, state: SequenceState, logits: Tensor) -> Iterator[tuple[int, list]]:
        """One token per forward pass; step ``n + 1`` is dispatched before token ``n`` is read back."""
        seq = req.sequence
        tok = state.sample(ctx, logits)
        ctx.evaluate_async(tok)
        pos = len(req.tokens)
        while True:
            more = state.generated + 1 < req.max_tokens and pos < self.context_length
            nxt = step = None
            full = False
            if more:
                try:
                    step = self.model.forward(ctx, Batch(tok, [pos], [seq], [0]), self.cache)
                    if state.constraint is None:
                        nxt = state.sample(ctx, step, pending=tok)
                        if state.generated:
                            ctx.evaluate_async(nxt)
                    else:  # the device runs the step while the host reads the token and computes the mask
                        ctx.evaluate_async(step)
                except CacheFullError:
                    more, full = False, True
            t = int(tok.item())
            if more:
                self._cached[seq].append(t)
                pos += 1
            pieces = state.accept(t, cache_full=full)
            if more and state.constraint is not None and not state.finish_reason:
                nxt = state.sample(ctx, step)
            yield t, pieces
            if state.finish_reason:
                return
            if state.generated == 1:
                # The second step is dispatched once the first token is out: on MLX's CPU backend dispatching
                # blocks until the step has nearly run, which would hold the first token back by a whole step.
                ctx.evaluate_async(nxt)
            tok = nxt

    def _speculative(self, ctx, req: Request, state: SequenceState, logits: Tensor, drafter: Drafter,
                     stats: GenerationStats) -> Iterator[tuple[int, list]]:
        """Drafted tokens verified several per forward pass (:func:`~mlx_engine.models.generation.speculative.speculate`); the
        rejected part of each draft is removed from the cache (:meth:`truncate`)."""
        seq = req.sequence
        t = int(state.sample(ctx, logits).item())
        yield t, state.accept(t)

        def keep(ids: list[int], pos: int, n: int) -> None:
            self.truncate(seq, pos + n)

        seed = req.sampler.seed if req.sampler.seed is not None else secrets.randbits(63)
        yield from speculate(ctx, state, req.tokens, drafter, DraftLength(req.draft_tokens),
                             lambda ids, pos: self.verify(ctx, [(seq, ids, pos)]), keep,
                             np.random.default_rng(seed), stats)

    def verify(self, ctx, drafts: Sequence[tuple[int, Sequence[int], int]], *, last: bool = False) -> Tensor:
        """One forward pass over several sequences' runs of tokens: ``(sequence, ids, pos)`` puts ``ids`` at
        positions ``pos ..`` of ``sequence`` (each sequence at most once). Returns logits ``[sum of len(ids),
        vocab]`` (lazy), every row, in that order (with ``last``: ``[len(drafts), vocab]``, the row of each run's
        last token), and records the tokens as cached (:meth:`truncate` takes back a rejected draft). Raises
        ``CacheFullError`` with the cache unchanged when it has no room."""
        ids = np.concatenate([np.asarray(d[1], np.int32) for d in drafts])
        positions = np.concatenate([np.arange(p, p + len(t)) for _, t, p in drafts])
        sequences = np.concatenate([np.full(len(t), s) for s, t, _ in drafts])
        outputs = np.cumsum([len(t) for _, t, _ in drafts]) - 1 if last else np.arange(len(ids))
        logits = self._forward(ctx, Batch(ids, positions, sequences, outputs), [(s, p, len(t)) for s, t, p in drafts])
        for s, t, _ in drafts:
            self._cached.setdefault(int(s), []).extend(int(x) for x in t)
        return logits

    def _forward(self, ctx, batch: Batch, runs: Sequence[tuple[int, int, int]]) -> Tensor:
        """The model's logits of ``batch``; its hidden states go to the MTP head for the sequences it drafts for
        (``runs``: each run of the batch's tokens as ``(sequence, first position, count)``, in order)."""
        if self.mtp is None or not any(int(s) in self.mtp.active for s, _, _ in runs):
            return self.model.forward(ctx, batch, self.cache)
        logits, hidden = self.model.forward(ctx, batch, self.cache, hidden_too=True)
        self.mtp.observe_runs(runs, hidden)
        return logits

    def mtp_head(self) -> MTPHead:
        """The model's multi-token-prediction head (built at the first call). Raises ``InvalidRequestError`` naming
        the model when its checkpoint holds no MTP layer."""
        if self.mtp is None:
            if not MTPHead.available(self.model):
                raise InvalidRequestError(
                    f"speculative=mtp needs multi-token-prediction layers, and {self.name or 'this model'} "
                    f"({self.model.architecture}) has none loaded: they are read for DeepSeek V3 and GLM-4.5 "
                    "checkpoints that hold them (num_nextn_predict_layers); use --speculative lookup or a draft model")
            self.mtp = MTPHead(self.model, context_length=self.context_length, max_sequences=self.max_sequences,
                               prefill_chunk=self.prefill_chunk, kv_bits=self.kv_bits)
        return self.mtp

    def truncate(self, seq: int, length: int) -> None:
        """Keep the first ``length`` cached tokens of ``seq``: the cells past them are removed from the cache (a
        rejected draft)."""
        if length < len(self._cached.get(seq, ())):
            self.cache.remove(seq, length, None)
            self._cached[seq] = self._cached[seq][:length]

    def attach_draft(self, draft: "Runner", target_name: str, draft_name: str) -> None:
        """Use ``draft`` (a runner of a smaller model, with at least this runner's sequences) as the drafter of
        ``speculative="draft"`` requests, and by default. Raises ``InvalidRequestError`` when its vocabulary is
        not this model's or it holds fewer sequences."""
        check_vocabulary(self.tokenizer, draft.tokenizer, target_name, draft_name)
        if draft.max_sequences < self.max_sequences:
            raise InvalidRequestError(f"the draft model {draft_name} holds {draft.max_sequences} sequences but "
                                      f"{target_name} {self.max_sequences}; load it with as many")
        self.draft = draft

    def drafter(self, req: Request) -> Drafter | None:
        """The drafter of ``req`` (None: no speculation); ``speculative`` None means ``draft`` when a draft model
        is attached, else ``off``. Raises ``InvalidRequestError`` for an unknown mode, ``draft`` without a draft
        model, ``mtp`` without MTP layers, a draft length out of range, or a model whose cache cannot take a
        rejected draft back."""
        mode = req.speculative or ("draft" if self.draft is not None else "off")
        if self.mtp is not None and mode != "mtp":
            self.mtp.follow(req.sequence, False)
        drafter = make_drafter(mode, cache=self.cache, architecture=self.model.architecture, draft_runner=self.draft,
                               sequence=req.sequence, mtp=self.mtp_head,
                               vocab_size=(getattr(self.tokenizer, "vocab_size", 0) or self.model.config.vocab_size)
                               if self.draft is not None or mode == "mtp" else 0)
        if drafter is not None and (isinstance(req.draft_tokens, bool) or not isinstance(req.draft_tokens, int)
                                    or req.draft_tokens < 1):
            raise InvalidRequestError(f"draft_tokens must be an integer >= 1, got {req.draft_tokens!r}")
        return drafter

    def _finish(self, stats: GenerationStats, state: SequenceState, t_first: float | None) -> None:
        now = time.perf_counter()
        generated = state.generated
        stats.generated_tokens = generated
        stats.stop_reason = state.finish_reason or stats.stop_reason or "length"  # keeps an ``interrupted``
        stats.context_full = state.context_full
        stats.format_complete = state.format_complete
        if stats.ttft_s > 0:
            stats.prompt_tps = stats.prefilled_tokens / stats.ttft_s
        if t_first is not None and generated > 1 and now > t_first:
            stats.decode_tps = (generated - 1) / (now - t_first)
        stats.peak_memory_bytes = self.backend.peak_memory()

    # ---- several sequences in one batch ------------------------------------------------------------------------
    def generate_batch(self, requests: Sequence[Request]) -> list[list[int]]:
        """Decode several requests together: each is prefilled on its own sequence, then every decode step runs one
        token of each unfinished sequence in a single forward pass. Returns the generated token ids of each
        request (the end-of-sequence token included when one was produced)."""
        if len(requests) > self.max_sequences:
            raise InvalidRequestError(f"{len(requests)} requests but the runner holds {self.max_sequences} sequences")
        if len({r.sequence for r in requests}) != len(requests):
            raise InvalidRequestError("each request of a batch needs its own sequence id")
        ctx = self.backend.new_context()
        states = [self.sequence_state(r, ctx, text=False, eos=True) for r in requests]  # each row its own grammar
        firsts = []
        for r, st in zip(requests, states):
            self._check_request(r)
            logits, _ = self.prefill(ctx, r.sequence, list(r.tokens), r.images)
            firsts.append(st.sample(ctx, logits))
        for st, t in zip(states, firsts):
            st.accept(int(t.item()))
        active = [i for i, st in enumerate(states) if not st.finish_reason]
        while active:
            logits = self.decode(ctx, [states[i].tokens[-1] for i in active],
                                 [len(requests[i].tokens) + states[i].generated - 1 for i in active],
                                 [requests[i].sequence for i in active])
            sampled = [states[i].sample(ctx, logits[j:j + 1]) for j, i in enumerate(active)]
            ctx.evaluate(*sampled)
            for j, i in enumerate(active):
                states[i].accept(int(sampled[j].item()))
            active = [i for i in active if not states[i].finish_reason]
        return [st.tokens for st in states]
