"""Speculative decoding: a drafter proposes tokens, one forward pass of the model verifies them all.

A drafter guesses the next ``k`` tokens; the model runs the last accepted token and the ``k`` guesses in one pass
(``k + 1`` positions, ``k + 1`` rows of logits) and the guesses are accepted left to right while the model agrees;
the first disagreement is replaced by the model's own token, so every verification step yields between 1 and
``k + 1`` tokens, and the output is the model's own (token for token when greedy; in distribution when sampled).

- Greedy: accept a draft token while it equals the argmax of its row.
- Sampled: the rejection rule of Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding",
  arXiv:2211.17192, Algorithm 1) and Chen et al. 2023 (arXiv:2302.01318): accept draft ``x`` with probability
  ``min(1, p(x) / q(x))``, else draw from ``norm(max(0, p - q))``. A deterministic drafter has a one-hot ``q``, so
  that is: accept with probability ``p(x)``, else draw from ``p`` with ``x`` removed and renormalised
  (:func:`verify_token`). The output distribution is then ``p`` exactly.

The first drafter is prompt lookup (:class:`PromptLookup`): the longest match of the last ``n`` tokens
(``n`` from 3 down to 1) earlier in the prompt and the output, whose continuation is the draft (llama.cpp's
``--lookup``, transformers' ``prompt_lookup_num_tokens``, vLLM's ``ngram``). It costs no model and helps where the
output copies the input (rewriting, editing code, quoting a document). The second is a draft model of the same
vocabulary (:class:`~mlx_engine.models.generation.draft_model.DraftModel`); the third the model's own
multi-token-prediction layer (:class:`~mlx_engine.models.generation.mtp.MTPDrafter`: DeepSeek V3, GLM-4.5).
The server's scheduler verifies several sequences' drafts in one pass with :func:`plan_all`, :func:`judge` and
:func:`record`, the parts :func:`speculate` is made of.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from mlx_engine.errors import CacheFullError, InvalidRequestError
from mlx_engine.kvcache.recurrent import RecurrentCache
from mlx_engine.ml import Context, DType, Tensor
from mlx_engine.models.generation.draft_model import DraftModel, draft_together
from mlx_engine.models.generation.mtp import MTPDrafter, MTPHead
from mlx_engine.models.generation.core import SequenceState

__all__ = ["Drafter", "PromptLookup", "DraftLength", "verify_token", "SPECULATIVE_MODES", "make_drafter", "plan",
           "plan_all", "judge", "record", "speculate"]

#: the values of the ``speculative`` option
SPECULATIVE_MODES = ("off", "lookup", "draft", "mtp")


class Drafter(Protocol):
    """What proposes draft tokens. ``draft(tokens, k)``: at most ``k`` guesses of the tokens that follow ``tokens``
    (prompt and output so far, int ids), possibly none."""

    def draft(self, tokens: Sequence[int], k: int) -> list[int]: ...


class PromptLookup:
    """Prompt lookup (n-gram) drafting: find the last ``n`` tokens earlier in ``tokens`` (the latest such place,
    ``n`` from ``max_ngram`` down to ``min_ngram``) and propose the tokens that followed it.

    Source: Saxena 2023, "Prompt Lookup Decoding" (transformers' ``PromptLookupCandidateGenerator``); llama.cpp's
    ``common_ngram_cache`` (``--lookup``).
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def draft(self, tokens: Sequence[int], k: int) -> list[int]:
        arr = np.asarray(tokens, np.int64)
        if k < 1 or len(arr) < 2:
            return []
        for n in range(min(self.max_ngram, len(arr) - 1), self.min_ngram - 1, -1):
            pattern = arr[-n:]
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # starts 0 .. len - 1 - n
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n  # the latest match: the nearest context to copy from
                return [int(t) for t in arr[start:start + k]]
        return []


class DraftLength:
    """The draft length, adapted to how much of each draft the model accepts: one longer after a fully accepted
    draft, halved after a draft rejected at its first token, within ``1 .. most``. A rejected one-token draft also
    pauses drafting (``rest`` passes without a draft: 2, then 4, 8 and at most 16 for each such rejection in a row;
    an accepted draft token ends the run), since a pass over a rejected draft costs more than a plain step and
    gains nothing: on text that does not repeat, prompt lookup finds one-token matches that are almost never right.
    """

    def __init__(self, most: int):
        self.most = most
        self.k = most
        self.rest = 0  # passes left without a draft
        self._misses = 0  # one-token drafts rejected in a row

    @property
    def next(self) -> int:
        """Draft tokens for the next pass: ``k``, or 0 while drafting pauses."""
        return 0 if self.rest else self.k

    def update(self, proposed: int, accepted: int) -> None:
        if not proposed:
            self.rest = max(0, self.rest - 1)
            return
        if accepted:
            self._misses = 0
        if accepted == proposed:
            self.k = min(self.most, self.k + 1)
        elif accepted == 0:
            if self.k == 1:
                self._misses += 1
                self.rest = min(2 ** self._misses, 16)
            self.k = max(1, self.k // 2)


def verify_token(p: np.ndarray, draft: int, rng: np.random.Generator) -> tuple[int, bool]:
    """One draft token through the rejection rule for a deterministic drafter (one-hot ``q``).

    Args:
        p: the target's probabilities of this position, float ``[V]`` summing to 1 (after the sampler's penalties,
            temperature, filters and the grammar's mask).
        draft: the drafted token id.
        rng: the request's random generator.

    Returns:
        ``(token, accepted)``: ``(draft, True)`` with probability ``p[draft]``, else a token drawn from ``p`` with
        ``draft`` removed and renormalised, and False. Source: Leviathan et al. 2023, Algorithm 1, with ``q``
        one-hot.
    """
    pd = float(p[draft])
    if rng.random() < pd:
        return int(draft), True
    rest = np.asarray(p, np.float64).copy()
    rest[draft] = 0.0
    total = rest.sum()
    if total <= 0.0:  # p put all its mass on the draft (rounding): nothing else can be drawn
        return int(draft), True
    return int(rng.choice(len(rest), p=rest / total)), False


def make_drafter(mode: str, *, cache: Any = None, architecture: str = "", draft_runner: Any = None,
                 sequence: int = 0, vocab_size: int = 0, mtp: Callable[[], MTPHead] | None = None) -> Drafter | None:
    """The drafter of a ``speculative`` option value: None for ``off``; :class:`PromptLookup` for ``lookup``;
    :class:`~mlx_engine.models.generation.draft_model.DraftModel` on ``draft_runner``'s ``sequence`` for ``draft``;
    :class:`~mlx_engine.models.generation.mtp.MTPDrafter` on the head ``mtp()`` gives for ``mtp``.

    Raises ``InvalidRequestError`` for another value, ``draft`` without a draft model, ``mtp`` without MTP layers
    (``mtp()`` raises it, or no ``mtp``), or a target ``cache`` that cannot take a rejected draft back (recurrent
    layers of ``architecture``)."""
    if mode not in SPECULATIVE_MODES:
        raise InvalidRequestError(f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, got {mode!r}")
    if mode == "off":
        return None
    if any(isinstance(c, RecurrentCache) for c in getattr(cache, "caches", [cache])):
        raise InvalidRequestError(f"speculative decoding is not available for {architecture}: its recurrent layers "
                                  "cannot take back a rejected draft; use --speculative off")
    if mode == "lookup":
        return PromptLookup()
    if mode == "mtp":
        if mtp is None:
            raise InvalidRequestError(f"speculative=mtp needs the model's multi-token-prediction layers; "
                                      f"{architecture} has none here: use --speculative lookup")
        return MTPDrafter(mtp(), sequence, vocab_size)
    if draft_runner is None:
        raise InvalidRequestError("speculative=draft needs a draft model: load the model with --draft-model NAME "
                                  "(Python: load(..., draft_model=NAME)), or use --speculative lookup")
    return DraftModel(draft_runner, sequence, vocab_size)


def plan(state: SequenceState, prompt: Sequence[int], drafter: Drafter, length: DraftLength) -> tuple[list[int], int]:
    """The next verification pass of a sequence: ``(ids, pos)``, its last accepted token followed by a draft of at
    most ``length.next`` tokens (within what ``max_tokens`` and the context leave), and the position of ``ids[0]``."""
    return plan_all([(state, prompt, drafter, length)])[0]


def plan_all(runs: Sequence[tuple[SequenceState, Sequence[int], Drafter, DraftLength]],
             catch_up: bool = False) -> list[tuple[list[int], int]]:
    """:func:`plan` for several sequences (``runs``: ``(state, prompt, drafter, length)`` each), the sequences that
    draft with one draft model drafting together (:func:`~mlx_engine.models.generation.draft_model.draft_together`,
    with its ``catch_up``: the server's, so that a new prompt reaches the draft model one chunk per step)."""
    ks = [min(length.next, st.max_tokens - st.generated - 1, st.context_length - (st.prompt_length + st.generated))
          for st, _, _, length in runs]
    drafts: list[list[int]] = [[] for _ in runs]
    together: dict[int, list[int]] = {}  # the runs of each draft model (by its runner)
    for i, (st, prompt, drafter, _) in enumerate(runs):
        if isinstance(drafter, DraftModel):
            together.setdefault(id(drafter.runner), []).append(i)
        elif ks[i] > 0:
            drafts[i] = drafter.draft([*prompt, *st.tokens], ks[i])
    for group in together.values():
        got = draft_together([(runs[i][2], [*runs[i][1], *runs[i][0].tokens], ks[i]) for i in group], catch_up)
        for i, d in zip(group, got):
            drafts[i] = d
    return [([st.tokens[-1], *d], st.prompt_length + st.generated - 1) for (st, _, _, _), d in zip(runs, drafts)]


def judge(ctx: Context, state: SequenceState, ids: list[int], logits: Tensor, rng: np.random.Generator,
          greedy_rows: np.ndarray | None = None) -> tuple[list[tuple[int, list[tuple[str, str]]]], int]:
    """Feed the verified tokens of one pass to ``state`` one by one (its grammar and stop conditions see each).

    ``logits``: ``[len(ids), vocab]``, row ``i`` the target's prediction after ``ids[i]``; ``greedy_rows``: int
    ``[len(ids)]``, their argmax, when ``state.plain_greedy`` (computed once for a whole batch). Returns the
    ``(token, pieces)`` accepted and ``fed``: how many of ``ids`` stay in the cache (the last token and the
    accepted draft tokens; the rest is to be rolled back). Raises ``InvalidRequestError`` when the grammar fails."""
    draft, out, fed = ids[1:], [], 1
    if greedy_rows is None and state.plain_greedy:
        greedy_rows = logits.astype(DType.FLOAT32).argmax(axis=-1).numpy()
    for i in range(len(ids)):
        if greedy_rows is not None:
            t = int(greedy_rows[i])
        else:
            p = state.probabilities(ctx, logits[i:i + 1])
            if i < len(draft):
                t, _ = verify_token(p, draft[i], rng)
            else:
                t = int(np.argmax(p)) if state.sampler.options.greedy else int(rng.choice(len(p), p=p))
        out.append((t, state.accept(t)))
        if state.finish_reason or i == len(draft) or t != draft[i]:
            break
        fed += 1
    return out, fed


def record(stats: Any, length: DraftLength, proposed: int, fed: int) -> None:
    """Count one verification pass (``stats``: ``verify_steps``, ``draft_proposed``, ``draft_accepted``) and adapt
    the draft length."""
    stats.verify_steps += 1
    stats.draft_proposed += proposed
    stats.draft_accepted += fed - 1
    length.update(proposed, fed - 1)


def speculate(ctx: Context, state: SequenceState, prompt: Sequence[int], drafter: Drafter, length: DraftLength,
              verify: Callable[[list[int], int], Tensor], keep: Callable[[list[int], int, int], None],
              rng: np.random.Generator, stats: Any) -> Iterator[tuple[int, list[tuple[str, str]]]]:
    """The speculative decode loop of one sequence whose first token ``state`` has accepted: ``(token, pieces)``
    per generated token until ``state`` finishes.

    Each step drafts (:func:`plan`), runs the last accepted token and the draft in one pass (``verify(ids, pos)``:
    logits ``[len(ids), vocab]`` of ``ids`` at positions ``pos ..``; raises ``CacheFullError`` with the cache
    unchanged), feeds the verified tokens to ``state`` (:func:`judge`), then ``keep(ids, pos, n)``: the first ``n``
    of ``ids`` stay in the cache, the rest of the draft is rolled back, before any token of the step is handed out.
    ``stats`` (a ``GenerationStats``) counts the passes and draft tokens (:func:`record`).
    """
    while not state.finish_reason:
        ids, pos = plan(state, prompt, drafter, length)
        logits = _verified(verify, ids, pos)
        if logits is None and len(ids) > 1:  # no room for the draft: one token, as a plain step
            ids, length.k = ids[:1], 1
            logits = _verified(verify, ids, pos)
        if logits is None:
            state.context_full = True
            pieces = state.finish("length")
            if pieces:
                yield -1, pieces  # the held-back text (no token: the context is full)
            return
        out, fed = judge(ctx, state, ids, logits, rng)
        keep(ids, pos, fed)
        record(stats, length, len(ids) - 1, fed)
        yield from out


def _verified(verify: Callable[[list[int], int], Tensor], ids: list[int], pos: int) -> Tensor | None:
    try:
        return verify(ids, pos)
    except CacheFullError:  # the cache is left unchanged
        return None
