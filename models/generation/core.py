"""The generation core: one sequence's state and the step that feeds it a token, shared by every generation loop.

mlx-lm splits generation in two (``generate_step``: logits to tokens; ``stream_generate``: tokens to text and
stopping). Here the split is the same, and both halves live in one object per sequence, :class:`SequenceState`:

- :meth:`SequenceState.sample` (device, lazy): the logits of a step to a token, with the request's sampler and random
  key, its penalties' history and its grammar's mask;
- :meth:`SequenceState.accept` (host): the token read back is fed to the grammar, appended to the history, turned
  into text pieces (stop strings, a reasoning model's thinking kept apart), and the stop conditions are checked
  (end of sequence, a stop string, the grammar's end, ``max_tokens``, a full context): :attr:`finish_reason`.

The runner's single-request loop (pipelined: it samples step ``n + 1`` before token ``n`` is read, passing the unread
token as ``pending``), its batch loop and the server's scheduler call these two and nothing else per sequence.
Speculative decoding (:mod:`mlx_engine.models.generation.speculative`) feeds the verified tokens through :meth:`accept` one by
one, so the grammar and the stop conditions see each of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mlx_engine.ml import Context, DType, Tensor
from mlx_engine.models.generation.sampler import Sampler
from mlx_engine.models.text.text_assembly import TextAssembler

__all__ = ["SequenceState"]


class SequenceState:
    """One sequence's generation state.

    Args:
        prompt: the prompt's token ids (the start of the penalties' history).
        sampler: the request's sampler (it holds the random key).
        max_tokens: the most tokens to generate (>= 1).
        context_length: the most tokens the sequence may hold (prompt and output).
        constraint: the grammar state (``allowed`` / ``advance`` / ``stopped`` / ``accepting``), or None.
        text: the text assembler (stop strings, end of sequence, thinking apart), or None for tokens only.
        eos_ids: without a text assembler, the ids that end the sequence (empty: none does; the tokens-only loop
            runs to ``max_tokens`` as a benchmark wants).
        top_logprobs: None (default) scores nothing; an int ``k >= 0`` makes :meth:`sample` also compute the
            sampled token's log-probability and the ``k`` most likely tokens' (:attr:`logprob`), at the cost of a
            second pass over the logits and a read-back per token (so the batch's argmax fast path is off). The
            scores are read by the next :meth:`accept`, so a scored sequence accepts each token before it samples
            the next (the server's scheduler does; the pipelined single-request loop does not score).

    Attributes:
        tokens: the generated token ids accepted so far.
        finish_reason: ``""`` while running, then ``eos``, ``stop`` (a stop string or the grammar's end) or
            ``length`` (``max_tokens``, or a full context: then :attr:`context_full`).
        format_complete: with a grammar, whether the text is a complete value of it; None without one.
        logprob: with ``top_logprobs``, the last accepted token's score ``(token, logprob, [(id, logprob), ...])``
            (the top list most likely first), None for a token that ended the sequence as end-of-sequence (OpenAI
            and ollama leave it out). Log-probabilities are natural logs, ``-inf`` for a token the filters removed.
    """

    def __init__(self, prompt: Sequence[int], sampler: Sampler, *, max_tokens: int, context_length: int,
                 constraint: Any = None, text: TextAssembler | None = None, eos_ids: Sequence[int] = (),
                 top_logprobs: int | None = None):
        self.prompt_length = len(prompt)
        self.sampler = sampler
        self.max_tokens = max_tokens
        self.context_length = context_length
        self.constraint = constraint
        self.text = text
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        self.tokens: list[int] = []
        self._history = [int(t) for t in prompt] if sampler.options.uses_history else None
        self.finish_reason = ""
        self.context_full = False
        self.format_complete: bool | None = None
        self.top_logprobs = top_logprobs
        self.logprob: tuple[int, float, list[tuple[int, float]]] | None = None
        self._scores: tuple[Tensor, Tensor | None, Tensor | None] | None = None  # lazy, read back by accept

    @property
    def generated(self) -> int:
        return len(self.tokens)

    @property
    def plain_greedy(self) -> bool:
        """Argmax of the raw logits is this sequence's token (no penalty, no grammar): a batch may take it at once."""
        return self.sampler.options.greedy and self._history is None and self.constraint is None \
            and self.top_logprobs is None

    def history(self, ctx: Context, pending: Tensor | None = None) -> Tensor | None:
        """INT32 ``[1, T]``: the penalties' window (the last ``repeat_last_n`` of prompt and output, with the unread
        ``pending`` token ``[1]`` last), or None when no penalty is on."""
        if self._history is None:
            return None
        n = self.sampler.options.repeat_last_n  # > 0: that many tokens; otherwise the whole history (llama.cpp: -1)
        h = ctx.from_numpy(np.asarray(self._history, np.int32)[None])
        if pending is not None:
            h = ctx.concatenate([h, pending.reshape(1, 1)], axis=1)
        return h[:, -n:] if n > 0 else h

    def allowed(self, ctx: Context, width: int) -> Tensor | None:
        """BOOL ``[1, width]``: the grammar's mask for the next token, or None without a grammar."""
        return self.constraint.allowed(ctx, width) if self.constraint is not None else None

    def sample(self, ctx: Context, logits: Tensor, pending: Tensor | None = None) -> Tensor:
        """The next token, INT32 ``[1]`` (lazy), from logits ``[1, vocab]``. ``pending``: a token sampled but not yet
        read back and accepted (the pipelined loop); it must then have no grammar (the mask needs the token)."""
        allowed = None
        if self.constraint is not None:
            assert pending is None, "a grammar's mask needs the previous token accepted first"
            allowed = self.allowed(ctx, logits.shape[-1])
        history = self.history(ctx, pending)
        token = self.sampler.sample(logits, history, allowed)
        if self.top_logprobs is not None:
            self._scores = self._score(logits, history, allowed, token)
        return token

    def _score(self, logits: Tensor, history: Tensor | None, allowed: Tensor | None,
               token: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Lazy log-probabilities of the distribution ``token`` was drawn from (:meth:`Sampler.process`: mask,
        penalties, temperature, filters; greedy: the penalised logits at temperature 1): the token's ``[1, 1]``
        and the top ``k``'s ids and values ``[1, k]`` (most likely first), ``log_softmax(z) = z - logsumexp(z)``."""
        masked = logits.astype(DType.FLOAT32)
        if allowed is not None:
            masked = allowed.where(masked, float("-inf"))
        z = self.sampler.process(masked, history)
        lp = z - z.logsumexp(axis=-1, keepdims=True)
        chosen = lp.take_along_axis(token.reshape(1, 1), axis=-1)
        k = min(self.top_logprobs, lp.shape[-1])
        if k == 0:
            return chosen, None, None
        top = (-lp).argpartition(k - 1, axis=-1)[:, :k]  # unordered; sorted on the host
        return chosen, top, lp.take_along_axis(top, axis=-1)

    def probabilities(self, ctx: Context, logits: Tensor) -> np.ndarray:
        """float64 ``[vocab]``: the distribution :meth:`sample` draws the next token from, for logits ``[1, vocab]``
        (the grammar's mask, the penalties, the temperature and the filters applied; greedy: one-hot at the argmax).
        What speculative decoding's rejection rule compares a draft with."""
        allowed = self.allowed(ctx, logits.shape[-1])
        masked = logits.astype(DType.FLOAT32) if allowed is None else allowed.where(logits.astype(DType.FLOAT32),
                                                                                     float("-inf"))
        z = self.sampler.process(masked, self.history(ctx)).numpy()[0].astype(np.float64)
        if self.sampler.options.greedy:
            p = np.zeros_like(z)
            p[int(np.argmax(z))] = 1.0
            return p
        p = np.exp(z - z.max())
        return p / p.sum()

    def room(self) -> bool:
        """Whether the last accepted token can be fed to the model (its position is inside the context)."""
        return self.prompt_length + self.generated - 1 < self.context_length

    def accept(self, token: int, *, cache_full: bool = False) -> list[tuple[str, str]]:
        """The step's host half: feed ``token`` to the grammar, the history and the text; check the stop conditions.

        ``cache_full``: the cache refused the next step (the loop found it), which ends the sequence as a full
        context. Returns the ``(kind, text)`` pieces to show now (kind ``thinking`` or ``answer``; see
        :class:`~mlx_engine.models.text.text_assembly.TextAssembler`); sets :attr:`finish_reason` when the sequence ends.
        A token after the end is ignored. Raises ``InvalidRequestError`` when the grammar engine fails.
        """
        if self.finish_reason:
            return []
        token = int(token)
        self.tokens.append(token)
        self._read_scores(token)
        if self._history is not None:
            self._history.append(token)
        complete = False
        if self.constraint is not None:
            self.constraint.advance(token)
            complete = self.constraint.stopped  # the grammar ended: nothing may follow
            self.format_complete = complete or self.constraint.accepting
        pieces = self.text.add(token) if self.text is not None else []
        if self.text is not None and self.text.stop_reason:
            return self._end(self.text.stop_reason, pieces)
        if self.text is None and token in self.eos_ids:
            return self._end("eos", pieces)
        if complete:
            return self._end("stop", pieces + self._flush())
        if self.generated >= self.max_tokens:
            return self._end("length", pieces + self._flush())
        if cache_full or not self.room():
            self.context_full = True
            return self._end("length", pieces + self._flush())
        return pieces

    def _read_scores(self, token: int) -> None:
        scores, self._scores = self._scores, None
        if scores is None:
            self.logprob = None
            return
        chosen, top, vals = scores
        pairs: list[tuple[int, float]] = []
        if top is not None:
            pairs = sorted(zip(top.numpy()[0].tolist(), vals.numpy()[0].tolist()), key=lambda p: -p[1])
        self.logprob = (token, float(chosen.numpy().reshape(-1)[0]), [(int(i), float(v)) for i, v in pairs])

    def finish(self, reason: str) -> list[tuple[str, str]]:
        """End the sequence from outside (the caller stopped reading: ``interrupted``); returns the held-back text."""
        if self.finish_reason:
            return []
        return self._end(reason, self._flush())

    def _flush(self) -> list[tuple[str, str]]:
        return self.text.flush() if self.text is not None else []

    def _end(self, reason: str, pieces: list[tuple[str, str]]) -> list[tuple[str, str]]:
        if self.text is not None and self.text.stop_reason:
            reason = self.text.stop_reason  # a stop string found in the held-back text wins
        if reason == "stop" and self.text is not None and self.text.stop_reason == "stop" and self.format_complete:
            self.format_complete = False  # a stop string cut the text the grammar had accepted
        self.finish_reason = reason
        if reason == "eos":
            self.logprob = None  # the end-of-sequence token is no part of the answer
        return pieces
