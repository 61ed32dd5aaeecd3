"""Token sampling on the device: penalties, temperature, top-k, top-p, min-p, then a seeded categorical draw.

Everything runs through the ``mlx_engine.ml`` interfaces and stays lazy (no read-back to the host), so the runner can
dispatch decode step ``n + 1`` before token ``n`` is read.

Order (as Hugging Face transformers' logits warpers: repetition penalty, temperature, top-k, top-p, min-p):

1. ``repeat_penalty`` (llama.cpp ``llama_sampler_penalties``; Keskar et al. 2019, CTRL, arXiv:1909.05858): for each
   distinct token among the last ``repeat_last_n`` tokens of the history, ``l / p`` if ``l > 0`` else ``l * p``.
2. ``frequency_penalty``, ``presence_penalty`` (OpenAI's definition, "Parameter details" of the Chat Completions API):
   ``l - c * frequency_penalty - (c > 0) * presence_penalty`` with ``c`` the token's count in the whole history given.
3. temperature 0: greedy (argmax of the penalised logits). Otherwise ``l / temperature``.
4. top-k: keep the ``k`` largest (``transformers.TopKLogitsWarper``); ties at the k-th value are cut arbitrarily.
5. top-p: sort descending, keep a token when the probability mass of the tokens before it is below ``top_p``: the
   smallest set whose mass reaches ``top_p`` (Holtzman et al. 2019, arXiv:1904.09751; ``TopPLogitsWarper``).
6. min-p: keep tokens with ``p >= min_p * p_max``, i.e. ``l >= l_max + log(min_p)`` (Nguyen et al. 2024,
   arXiv:2407.01082; ``MinPLogitsWarper``).
7. a categorical draw from ``softmax`` of what is left, with a key split from ``ctx.random_key(seed)`` at each call.

mlx-lm's ``sample_utils`` differs in two documented ways: it applies top-p/min-p/top-k before dividing by the
temperature, and it adds the presence/frequency penalties over a fixed window; here the caller's ``history`` is the
window (the runner passes the last ``repeat_last_n`` tokens).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Any

from mlx_engine.errors import InvalidOptionError
from mlx_engine.ml import Context, DType, Tensor

__all__ = ["SamplerOptions", "Sampler", "apply_penalties"]

_NEG_INF = float("-inf")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class SamplerOptions:
    """How to pick the next token.

    Attributes:
        temperature: 0 (default) picks the most likely token; higher flattens the distribution. ``>= 0``.
        top_k: keep only the ``top_k`` most likely tokens; 0 turns it off. ``>= 0``.
        top_p: keep the smallest set of most likely tokens whose probability reaches ``top_p``; 1 turns it off.
            In ``(0, 1]``.
        min_p: drop tokens less likely than ``min_p`` times the most likely one; 0 turns it off. In ``[0, 1]``.
        repeat_penalty: llama.cpp's repetition penalty over the last ``repeat_last_n`` tokens; 1 turns it off. ``> 0``.
        repeat_last_n: how many of the latest tokens the repeat penalty looks at; 0 turns it off, -1 means all of
            the history. ``>= -1``.
        presence_penalty: subtracted once from the logit of every token present in the history (OpenAI). Finite.
        frequency_penalty: subtracted from a token's logit once per occurrence in the history (OpenAI). Finite.
        seed: the random seed (an int in ``[0, 2**64)``); None draws one at random.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    def validate(self) -> "SamplerOptions":
        """Check every field; returns ``self``.

        Raises:
            InvalidRequestError: naming the first invalid field, its value and the accepted range.
        """
        def bad(name: str, rule: str, hint: str = "") -> InvalidOptionError:
            return InvalidOptionError(name, getattr(self, name), rule, hint)

        t = self.temperature
        if not _is_number(t) or not math.isfinite(t) or t < 0:
            raise bad("temperature", "must be >= 0", "a finite number; 0 is greedy")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0", "0 turns it off")
        p = self.top_p
        if not _is_number(p) or not math.isfinite(p) or not 0 < p <= 1:
            raise bad("top_p", "must be in (0, 1]", "1 turns it off")
        m = self.min_p
        if not _is_number(m) or not math.isfinite(m) or not 0 <= m <= 1:
            raise bad("min_p", "must be in [0, 1]", "0 turns it off")
        r = self.repeat_penalty
        if not _is_number(r) or not math.isfinite(r) or r <= 0:
            raise bad("repeat_penalty", "must be > 0", "a finite number; 1 turns it off")
        if not _is_int(self.repeat_last_n) or self.repeat_last_n < -1:
            raise bad("repeat_last_n", "must be an integer >= -1",
                      "0 turns the repeat penalty off, -1 uses all the history")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not math.isfinite(v):
                raise bad(name, "must be a finite number", "0 turns it off")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise bad("seed", "must be an integer in [0, 2**64) or None")
        return self

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax (temperature 0)."""
        return self.temperature == 0

    @property
    def uses_history(self) -> bool:
        """True when a penalty is on, so :meth:`Sampler.sample` needs the token history."""
        return (self.repeat_penalty != 1.0 and self.repeat_last_n != 0) or self.presence_penalty != 0 \
            or self.frequency_penalty != 0


def _clean_history(ctx: Context, history: Tensor, vocab: int) -> Tensor:
    """History ``[N, T]`` as INT32 with every padding or out-of-range entry replaced by ``vocab``."""
    h = history.astype(DType.INT32) if history.dtype != DType.INT32 else history
    h = h.compare("<", 0).where(vocab, h)
    return h.compare(">", vocab).where(vocab, h)


def _presence(ctx: Context, idx: Tensor, n: int, vocab: int) -> Tensor:
    """FLOAT32 ``[N, vocab]``: 1 where a token occurs in ``idx`` (``[N, T]``, ``vocab`` marks no token), else 0."""
    table = ctx.zeros((n, vocab + 1), DType.FLOAT32)
    ones = ctx.full(idx.shape, 1.0, DType.FLOAT32)
    return table.put_along_axis(idx, ones, axis=-1)[:, :vocab]


def _counts(ctx: Context, idx: Tensor, n: int, vocab: int) -> Tensor:
    """FLOAT32 ``[N, vocab]``: how many times each token occurs in ``idx`` (``[N, T]``, ``vocab`` marks no token).

    Without a scatter-add: sort each row, find the start of each run of equal ids, take run lengths, and write each
    element's run length at its id (duplicates write the same value, so the scatter is deterministic)."""
    t = idx.shape[1]
    s = idx.take_along_axis(idx.argsort(axis=-1), axis=-1)  # [N, T] ascending
    prev = ctx.concatenate([ctx.full((n, 1), -1, DType.INT32), s[:, :t - 1]], axis=1)
    is_start = s.compare("!=", prev)
    run = is_start.astype(DType.INT32).cumsum(axis=-1) - 1  # [N, T] run index of each element
    pos = ctx.arange(0, t, DType.INT32).reshape(1, t) + ctx.zeros((n, t), DType.INT32)
    # starts[r] = first position of run r; starts[r] = t for runs that do not exist; column t + 1 takes the
    # writes of non-start elements and is ignored.
    target = is_start.where(run, t + 1)
    starts = ctx.full((n, t + 2), t, DType.INT32).put_along_axis(target, pos, axis=-1)
    lengths = starts[:, 1:t + 1] - starts[:, :t]  # [N, T] length of run r
    per_elem = lengths.take_along_axis(run, axis=-1).astype(DType.FLOAT32)
    table = ctx.zeros((n, vocab + 1), DType.FLOAT32).put_along_axis(s, per_elem, axis=-1)
    return table[:, :vocab]


def apply_penalties(ctx: Context, logits: Tensor, history: Tensor | None, options: SamplerOptions) -> Tensor:
    """The repeat, frequency and presence penalties (formulas in the module docstring).

    Args:
        logits: ``[N, V]`` float.
        history: INT32 ``[N, T]``, each row's previous tokens in order (latest last); entries ``< 0`` (or ``>= V``)
            are padding and may sit anywhere. None: no penalties.
        options: the penalty fields are read.

    Returns:
        FLOAT32 ``[N, V]``.
    """
    logits = logits.astype(DType.FLOAT32) if logits.dtype != DType.FLOAT32 else logits
    if history is None or not options.uses_history or history.ndim != 2 or history.shape[1] == 0:
        return logits
    n, v = logits.shape
    idx = _clean_history(ctx, history, v)
    if options.repeat_penalty != 1.0 and options.repeat_last_n != 0:
        win = idx
        last_n = options.repeat_last_n
        if 0 < last_n < idx.shape[1]:
            valid = idx.compare("<", v).astype(DType.INT32)
            c = valid.cumsum(axis=-1)
            total = c[:, -1:]
            keep = c.compare(">", total - last_n)
            win = keep.where(idx, v)
        present = _presence(ctx, win, n, v).compare(">", 0)
        p = float(options.repeat_penalty)
        penalised = logits.compare(">", 0).where(logits / p, logits * p)
        logits = present.where(penalised, logits)
    if options.frequency_penalty != 0 or options.presence_penalty != 0:
        counts = _counts(ctx, idx, n, v)
        if options.frequency_penalty != 0:
            logits = logits - counts * float(options.frequency_penalty)
        if options.presence_penalty != 0:
            logits = logits - counts.compare(">", 0).where(float(options.presence_penalty), 0.0)
    return logits


class Sampler:
    """Samples one token per row of a logits matrix. One sampler per request: it keeps the random key.

    Args:
        options: validated here.
        ctx: the context that makes the sampler's tensors (``zeros``, ``arange``, ``categorical``, keys).

    Raises:
        InvalidRequestError: invalid options.
    """

    def __init__(self, options: SamplerOptions, ctx: Context):
        self.options = options.validate()
        self.ctx = ctx
        seed = options.seed if options.seed is not None else secrets.randbits(63)
        self._key = ctx.random_key(seed)

    def _next_key(self) -> Any:
        self._key, sub = self.ctx.split_key(self._key)
        return sub

    def _sorted_filtered(self, logits: Tensor) -> tuple[Tensor, Tensor] | None:
        """Tempered logits ``[N, V]`` -> (``index`` ``[N, W]``, ``kept`` ``[N, W]``): the ``W`` best tokens in
        descending order and their logits with ``-inf`` where a filter removes them (``W = top_k`` when top-k is on,
        else ``V``). None when no filter is on.

        Top-k selects with ``argpartition`` and sorts only the ``k`` survivors (a sort of a 262k vocabulary is
        many times the cost of the selection)."""
        o = self.options
        n, v = logits.shape
        use_k = 0 < o.top_k < v
        if not (use_k or o.top_p < 1.0 or o.min_p > 0.0):
            return None
        if use_k:
            top = (-logits).argpartition(o.top_k - 1, axis=-1)[:, :o.top_k]  # [N, k], unordered
            vals = logits.take_along_axis(top, axis=-1)
            order = vals.argsort(axis=-1, descending=True)
            index = top.take_along_axis(order, axis=-1)
            ls = vals.take_along_axis(order, axis=-1)
        else:
            index = logits.argsort(axis=-1, descending=True)
            ls = logits.take_along_axis(index, axis=-1)
        if o.top_p < 1.0:
            p = ls.softmax(axis=-1)
            before = p.cumsum(axis=-1) - p  # mass of the more likely tokens
            ls = before.compare("<", float(o.top_p)).where(ls, _NEG_INF)
        if o.min_p > 0.0:
            threshold = ls[:, :1] + math.log(o.min_p)
            ls = ls.compare(">=", threshold).where(ls, _NEG_INF)
        return index, ls

    def process(self, logits: Tensor, history: Tensor | None = None) -> Tensor:
        """The logits the categorical draw uses, in vocabulary order: penalised, divided by the temperature, and
        ``-inf`` where top-k/top-p/min-p remove a token. FLOAT32 ``[N, V]``. At temperature 0, the penalised
        logits (the argmax is taken over them)."""
        logits = apply_penalties(self.ctx, _as_2d(logits), history, self.options)
        if self.options.greedy:
            return logits
        logits = logits / float(self.options.temperature)
        filtered = self._sorted_filtered(logits)
        if filtered is None:
            return logits
        index, ls = filtered
        n, v = logits.shape
        return self.ctx.full((n, v), _NEG_INF, DType.FLOAT32).put_along_axis(index, ls, axis=-1)

    def sample(self, logits: Tensor, history: Tensor | None = None, allowed: Tensor | None = None) -> Tensor:
        """One token per row.

        Args:
            logits: ``[N, V]`` (or ``[V]``) float logits.
            history: INT32 ``[N, T]`` previous tokens of each row, latest last, padded with -1; needed only when a
                penalty is on (:attr:`SamplerOptions.uses_history`).
            allowed: BOOL ``[N, V]`` (or ``[1, V]``): the tokens a grammar allows (structured output); the others
                get ``-inf`` before anything else, so no penalty or filter can bring them back.

        Returns:
            INT32 ``[N]`` token ids (lazy: nothing is read back to the host).
        """
        logits = _as_2d(logits)
        if allowed is not None:
            logits = allowed.where(logits.astype(DType.FLOAT32), _NEG_INF)
        logits = apply_penalties(self.ctx, logits, history, self.options)
        if self.options.greedy:
            return logits.argmax(axis=-1).astype(DType.INT32)
        logits = logits / float(self.options.temperature)
        filtered = self._sorted_filtered(logits)
        key = self._next_key()
        if filtered is None:
            return self.ctx.categorical(logits, key).astype(DType.INT32)
        index, ls = filtered
        n = ls.shape[0]
        r = self.ctx.categorical(ls, key).astype(DType.INT32).reshape(n, 1)
        return index.take_along_axis(r, axis=-1).reshape(n).astype(DType.INT32)


def _as_2d(logits: Tensor) -> Tensor:
    if logits.ndim == 1:
        return logits.reshape(1, logits.shape[0])
    if logits.ndim != 2:
        raise ValueError(f"logits must be [N, V] (or [V]), got shape {logits.shape}")
    return logits
