"""A draft model as a speculative drafter: a smaller model of the same vocabulary proposes the next tokens greedily.

The drafter keeps its own KV cache (a runner of the draft model, one sequence per target sequence) in step with the
target: each draft gets the target's tokens so far (prompt and accepted output), keeps the common prefix of what
its cache holds (the rejected part of its last draft is removed through the runner's prefix reuse, the cache's
``remove``), runs what is new (the accepted tail, usually one or two tokens) and then decodes ``k`` tokens by
argmax. A greedy drafter is deterministic (its ``q`` is one-hot), so the target's verification
(:func:`~mlx_engine.models.generation.speculative.verify_token`) keeps the target's output exactly: token for token
when greedy, in distribution when sampled (Leviathan et al. 2023, Algorithm 1).

Several sequences of one draft model draft together (:func:`draft_together`, the server's continuous batch): their
new tails run in one forward pass, then each draft position is one decode step over every sequence still drafting,
so a batch of ``B`` sequences costs ``k + 1`` draft passes, not ``B (k + 1)``. A sequence whose tail is long (a new
prompt) catches up by one prefill chunk per call and drafts nothing until it has, so that the others stall by at
most one chunk.

As llama.cpp's ``-md`` / ``--model-draft`` (``common/speculative.cpp``: greedy drafts from the draft model's own
context, the draft context trimmed to the common prefix) and mlx-lm's ``--draft-model``
(``speculative_generate_step``: the draft cache trimmed by the rejected count).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mlx_engine.errors import CacheFullError, InvalidRequestError
from mlx_engine.ml import DType

__all__ = ["DraftModel", "draft_together", "check_vocabulary"]


class DraftModel:
    """Greedy drafts from a draft model's runner.

    Args:
        runner: the draft model's :class:`~mlx_engine.models.generation.runner.Runner` (its own KV cache).
        sequence: the draft cache's sequence that shadows the target's sequence.
        vocab_size: the target's vocabulary size: a draft token at or beyond it (a padding row of the draft's
            output matrix) ends the draft.
    """

    def __init__(self, runner: Any, sequence: int, vocab_size: int):
        self.runner, self.sequence, self.vocab_size = runner, sequence, vocab_size

    def draft(self, tokens: Sequence[int], k: int) -> list[int]:
        """At most ``k`` tokens the draft model predicts (argmax, one forward pass each) after ``tokens`` (int ids:
        the target's prompt and accepted output); fewer when the draft's cache is full or it proposes an id
        outside the target's vocabulary. A new prompt is prefilled whole first."""
        return draft_together([(self, tokens, k)])[0]


def draft_together(jobs: Sequence[tuple[DraftModel, Sequence[int], int]],
                   catch_up: bool = False) -> list[list[int]]:
    """The drafts of several sequences of one draft model (``jobs``: ``(drafter, tokens, k)``, every drafter on the
    same runner, each sequence at most once), drafted together: one forward pass runs every sequence's new tail
    (the tokens its cache lacks), then each further draft token is one decode step over the sequences still
    drafting.

    A tail longer than the runner's ``prefill_chunk`` (or than what that pass has room left for) is prefilled on
    its own: whole, before the sequence drafts; with ``catch_up``, one chunk of it only, and the sequence drafts
    nothing this time (it catches up over later calls, and the others wait for one chunk at most). Returns each
    job's draft (int ids, at most its ``k``; none when ``k < 1``). A full draft cache ends the drafts where they
    are."""
    out: list[list[int]] = [[] for _ in jobs]
    live = [i for i, (_, _, k) in enumerate(jobs) if k >= 1]
    if not live:
        return out
    runner = jobs[live[0]][0].runner
    ctx = runner.backend.new_context()
    ks = [k for _, _, k in jobs]
    firsts: dict[int, int] = {}  # each job's first draft token
    runs, room = [], runner.prefill_chunk
    try:
        for i in live:
            d, tokens, _ = jobs[i]
            tokens = [int(t) for t in tokens]
            n = runner.rewind(d.sequence, tokens)
            if len(tokens) - n <= room:
                runs.append((i, tokens[n:], n))
                room -= len(tokens) - n
            elif not catch_up:
                logits, _ = runner.prefill(ctx, d.sequence, tokens)
                firsts[i] = _argmax(logits)[0]
            else:
                _, chunks = runner.prefill_chunks(ctx, d.sequence, tokens)
                next(chunks)  # one chunk now; the cache records it, and the next call goes on from there
                chunks.close()
        if runs:
            logits = runner.verify(ctx, [(jobs[i][0].sequence, ids, pos) for i, ids, pos in runs], last=True)
            firsts.update(zip((i for i, _, _ in runs), _argmax(logits)))
        drafting = []
        for i, t in firsts.items():
            if t < jobs[i][0].vocab_size:
                out[i].append(t)
                drafting.append(i)
        while drafting := [i for i in drafting if len(out[i]) < ks[i]]:
            # the last draft token is fed at the next call, if the target accepts it
            logits = runner.decode(ctx, [out[i][-1] for i in drafting],
                                   [len(jobs[i][1]) + len(out[i]) - 1 for i in drafting],
                                   [jobs[i][0].sequence for i in drafting])
            for i, t in zip(drafting, _argmax(logits)):
                if t < jobs[i][0].vocab_size:
                    out[i].append(t)
                else:
                    ks[i] = len(out[i])  # an id outside the target's vocabulary ends the draft
    except CacheFullError:
        pass  # the draft's context is full: what was drafted so far
    return out


def _argmax(logits: Any) -> list[int]:
    """The argmax of each row of ``logits`` ``[rows, vocab]``, as ints."""
    return [int(t) for t in np.asarray(logits.astype(DType.FLOAT32).argmax(axis=-1).numpy()).reshape(-1)]


def check_vocabulary(target: Any, draft: Any, target_name: str, draft_name: str) -> None:
    """Refuse a draft model whose tokenizer is not the target's: the same token text at every id (special tokens
    included), as llama.cpp's ``common_speculative_are_compatible`` checks. ``target`` and ``draft`` are
    :class:`~mlx_engine.models.text.tokenizer.Tokenizer` objects. Raises ``InvalidRequestError`` naming the first id
    that differs."""
    a = target.backend.get_vocab(with_added_tokens=True)
    b = draft.backend.get_vocab(with_added_tokens=True)
    if a == b:
        return
    by_id_a = {i: t for t, i in a.items()}
    by_id_b = {i: t for t, i in b.items()}
    first = min((i for i in set(by_id_a) | set(by_id_b) if by_id_a.get(i) != by_id_b.get(i)), default=0)
    raise InvalidRequestError(
        f"the draft model {draft_name} has another vocabulary than {target_name} ({len(b)} tokens against "
        f"{len(a)}; id {first} is {by_id_b.get(first)!r} against {by_id_a.get(first)!r}): a draft model must use the "
        "same tokenizer, e.g. a smaller model of the same family")
