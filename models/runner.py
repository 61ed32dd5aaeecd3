"""The shared runner: chunked prefill, pipelined decode, several sequences in one batch, stop conditions, statistics.

One runner serves every architecture: it speaks to the model through ``forward(ctx, batch, cache)`` and keeps, per
sequence, the tokens whose keys and values are in the cache, so that a new request on a sequence prefills only what
differs from what is cached (a chat session's turn N prefills only the new message).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from mlx_engine.batch import Batch
from mlx_engine.errors import CacheFullError, InvalidRequestError
from mlx_engine.ml import DType, Tensor
from mlx_engine.models.base import DecoderModel
from mlx_engine.models.sampler import Sampler, SamplerOptions
from mlx_engine.models.tokenizer import Tokenizer


@dataclass
class GenerationStats:
    """Statistics of one request. Rates in tokens per second, times in seconds, memory in bytes.

    ``prompt_tokens`` counts the whole prompt; ``prefilled_tokens`` those actually run (the rest came from the cache).
    ``stop_reason`` is ``eos``, ``stop`` (a stop string), ``length`` (``max_tokens`` or the context is full) or
    ``interrupted`` (the caller stopped reading).
    """

    prompt_tokens: int = 0
    prefilled_tokens: int = 0
    prompt_tps: float = 0.0
    generated_tokens: int = 0
    decode_tps: float = 0.0
    ttft_s: float = 0.0
    peak_memory_bytes: int = 0
    stop_reason: str = ""

    def summary(self) -> str:
        """One line: prompt and decode speed, time to first token, peak memory."""
        return (f"prompt: {self.prompt_tokens} tokens ({self.prefilled_tokens} prefilled) at "
                f"{self.prompt_tps:.1f} tok/s | decode: {self.generated_tokens} tokens at {self.decode_tps:.1f} tok/s"
                f" | time to first token: {self.ttft_s * 1000:.0f} ms | peak memory: "
                f"{self.peak_memory_bytes / 2**20:.1f} MiB | stop: {self.stop_reason}")


@dataclass
class Request:
    """One generation request on one sequence.

    Attributes:
        tokens: the prompt's token ids (already templated and tokenized).
        sampler: sampling options (validated on construction of the runner's sampler).
        max_tokens: the most tokens to generate.
        stop: stop strings; generation ends before the first one, which is not returned.
        sequence: the cache sequence id to use.
    """

    tokens: Sequence[int]
    sampler: SamplerOptions = field(default_factory=SamplerOptions)
    max_tokens: int = 256
    stop: Sequence[str] = ()
    sequence: int = 0


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

    def __init__(self, model: DecoderModel, tokenizer: Tokenizer, *, context_length: int, max_sequences: int = 4,
                 prefill_chunk: int = 2048, kv_bits: int | None = None, reserve: bool = False):
        self.model = model
        self.tokenizer = tokenizer
        self.backend = model.backend
        self.context_length = context_length
        self.max_sequences = max_sequences
        self.prefill_chunk = prefill_chunk
        self.cache = model.make_cache(kv_bits)
        self.cache.init(self.backend, model.dtype, max_sequences, context_length, prefill_chunk)
        if reserve:
            with self.backend.new_context() as ctx:
                self.cache.reserve(ctx, model.layer_kv_shapes())
        self._cached: dict[int, list[int]] = {}

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

    def _check_request(self, req: Request) -> None:
        if len(req.tokens) == 0:
            raise InvalidRequestError("the prompt is empty; give at least one token of text")
        if not 0 <= req.sequence < self.max_sequences:
            raise InvalidRequestError(f"sequence {req.sequence} out of range: this runner holds "
                                      f"{self.max_sequences} sequences")
        if len(req.tokens) >= self.context_length:
            raise InvalidRequestError(
                f"the prompt has {len(req.tokens)} tokens but the context holds {self.context_length}; "
                f"shorten the prompt or load the model with a larger context_length")
        if req.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {req.max_tokens}")

    def _reuse(self, seq: int, tokens: Sequence[int]) -> int:
        """Drop what the cache holds for ``seq`` beyond its common prefix with ``tokens``; return that length."""
        cached = self._cached.get(seq, [])
        n = min(_common_prefix(cached, tokens), len(tokens) - 1)  # at least one token must run to give logits
        if n < len(cached):
            if n > 0 and not self.cache.can_resume(seq, n):
                n = 0
            self.cache.remove(seq, n, None)
            self._cached[seq] = cached[:n]
        return n

    # ---- prefill -----------------------------------------------------------------------------------------------
    def prefill(self, ctx, seq: int, tokens: Sequence[int]) -> tuple[Tensor, int]:
        """Run ``tokens`` of sequence ``seq`` through the model in chunks, reusing the cached prefix.

        Returns the logits ``[1, vocab]`` of the last token and how many tokens were run.
        Raises ``CacheFullError`` when the cache has no room.
        """
        start = self._reuse(seq, tokens)
        logits = None
        for begin in range(start, len(tokens), self.prefill_chunk):
            chunk = np.asarray(tokens[begin:begin + self.prefill_chunk], np.int32)
            logits = self.model.forward(ctx, Batch.single(chunk, begin, seq), self.cache)
            ctx.evaluate(logits)  # bound the graph (and the memory of intermediates) to one chunk
            self._cached.setdefault(seq, []).extend(int(t) for t in chunk)
        return logits, len(tokens) - start

    # ---- one request ------------------------------------------------------------------------------------------
    def generate_tokens(self, req: Request, stats: GenerationStats | None = None) -> Iterator[int]:
        """The generated token ids of one request, one at a time, up to ``max_tokens`` or a full context (the
        caller decides about end-of-sequence ids and stop strings by closing the generator).

        Decode is pipelined: step ``n + 1`` is dispatched to the device before token ``n`` is read back, so the
        host's work overlaps the device's (the first token goes out before step 2 is dispatched, not after). Every
        token yielded has been fed to the model (its step is built, if not yet run), so the cache then holds the
        prompt and exactly the tokens read so far. ``stats`` (if given) receives the timings.
        """
        self._check_request(req)
        stats = stats if stats is not None else GenerationStats()
        stats.prompt_tokens = len(req.tokens)
        seq = req.sequence
        self.backend.reset_peak_memory()
        t0 = time.perf_counter()
        ctx = self.backend.new_context()
        sampler = Sampler(req.sampler, ctx)
        logits, stats.prefilled_tokens = self.prefill(ctx, seq, list(req.tokens))
        last_n = req.sampler.repeat_last_n  # > 0: that many tokens; otherwise the whole history (llama.cpp: -1)
        history = (ctx.from_numpy(np.asarray(req.tokens[-last_n:] if last_n > 0 else req.tokens, np.int32)[None])
                   if req.sampler.uses_history else None)
        tok = sampler.sample(logits, history)
        ctx.evaluate_async(tok)
        pos = len(req.tokens)
        generated = 0
        t_first = None
        stats.stop_reason = "length"
        try:
            while True:
                more = generated + 1 < req.max_tokens and pos < self.context_length
                nxt = None
                if more:
                    if history is not None:
                        history = ctx.concatenate([history, tok.reshape(1, 1)], axis=1)
                        if last_n > 0:
                            history = history[:, -last_n:]
                    try:
                        step = self.model.forward(ctx, Batch(tok, [pos], [seq], [0]), self.cache)
                        nxt = sampler.sample(step, history)
                        if generated:
                            ctx.evaluate_async(nxt)
                    except CacheFullError:
                        more = False
                t = int(tok.item())
                if more:
                    self._cached[seq].append(t)
                    pos += 1
                generated += 1
                if t_first is None:
                    t_first = time.perf_counter()
                    stats.ttft_s = t_first - t0
                self._finish(stats, generated, t_first)
                yield t
                if not more:
                    return
                if generated == 1:
                    # The second step is dispatched once the first token is out: on MLX's CPU backend dispatching
                    # blocks until the step has nearly run, which would hold the first token back by a whole step.
                    ctx.evaluate_async(nxt)
                tok = nxt
        except GeneratorExit:
            self._finish(stats, generated, t_first)
            raise

    def stream(self, req: Request) -> Iterator["str | GenerationStats"]:
        """Generate for one request: yields text chunks (never half a UTF-8 character, never part of a stop
        string), then one :class:`GenerationStats`. Stops at an end-of-sequence id, a stop string, ``max_tokens``
        or a full context. Closing the generator early stops generation; the cache then holds exactly the tokens
        read so far."""
        stats = GenerationStats()
        tokens = self.generate_tokens(req, stats)
        eos = self.tokenizer.eos_ids
        detok = self.tokenizer.detokenizer()
        stops = [s for s in req.stop if s]
        hold = max((len(s) for s in stops), default=1) - 1  # text that could still become a stop string

        def stop_at(text: str) -> int:
            return min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)

        pending = ""
        try:
            for t in tokens:
                if t in eos:
                    stats.stop_reason = "eos"
                    break
                pending += detok.add(t)
                cut = stop_at(pending)
                if cut >= 0:
                    pending, stats.stop_reason = pending[:cut], "stop"
                    break
                if len(pending) > hold:
                    yield pending[:len(pending) - hold]
                    pending = pending[len(pending) - hold:]
            else:
                pending += detok.flush()
                cut = stop_at(pending)
                if cut >= 0:
                    pending, stats.stop_reason = pending[:cut], "stop"
        except GeneratorExit:
            stats.stop_reason = "interrupted"
            raise
        finally:
            tokens.close()
        if pending:
            yield pending
        yield stats

    def _finish(self, stats: GenerationStats, generated: int, t_first: float | None) -> None:
        now = time.perf_counter()
        stats.generated_tokens = generated
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
        eos = self.tokenizer.eos_ids
        firsts, samplers, pos = [], [], []
        for r in requests:
            self._check_request(r)
            logits, _ = self.prefill(ctx, r.sequence, list(r.tokens))
            samplers.append(Sampler(r.sampler, ctx))
            firsts.append(samplers[-1].sample(logits, None))
            pos.append(len(r.tokens))
        tokens = [int(t.item()) for t in firsts]
        out = [[t] for t in tokens]
        active = [i for i, r in enumerate(requests) if tokens[i] not in eos and r.max_tokens > 1]
        while active:
            active = [i for i in active if pos[i] < self.context_length]
            if not active:
                break
            batch = Batch(np.array([tokens[i] for i in active], np.int32), [pos[i] for i in active],
                          [requests[i].sequence for i in active], list(range(len(active))))
            logits = self.model.forward(ctx, batch, self.cache)
            sampled = [samplers[i].sample(logits[j:j + 1], None) for j, i in enumerate(active)]
            ctx.evaluate(*sampled)
            still = []
            for j, i in enumerate(active):
                self._cached[requests[i].sequence].append(tokens[i])
                pos[i] += 1
                tokens[i] = int(sampled[j].item())
                out[i].append(tokens[i])
                if tokens[i] not in eos and len(out[i]) < requests[i].max_tokens:
                    still.append(i)
            active = still
        return out


def logits_for(model: DecoderModel, runner: Runner, tokens: Sequence[int], sequence: int = 0) -> np.ndarray:
    """First-step logits ``[vocab]`` (float32, host) of a prompt: for parity checks against reference models."""
    with model.backend.new_context() as ctx:
        runner.reset(sequence)
        logits, _ = runner.prefill(ctx, sequence, list(tokens))
        return logits.astype(DType.FLOAT32).numpy()[0]
