"""A draft model as a speculative drafter: a smaller model of the same vocabulary proposes the next tokens greedily.

The drafter keeps its own KV cache (a runner of the draft model, one sequence per target sequence) in step with the
target: each :meth:`DraftModel.draft` call gets the target's tokens so far (prompt and accepted output), keeps the
common prefix of what its cache holds (the rejected part of its last draft is removed through the runner's prefix
reuse, the cache's ``remove``), runs what is new (the accepted tail, usually one or two tokens) and then decodes
``k`` tokens by argmax. A greedy drafter is deterministic (its ``q`` is one-hot), so the target's verification
(:func:`~mlx_engine.models.generation.speculative.verify_token`) keeps the target's output exactly: token for token when greedy,
in distribution when sampled (Leviathan et al. 2023, Algorithm 1).

As llama.cpp's ``-md`` / ``--model-draft`` (``common/speculative.cpp``: greedy drafts from the draft model's own
context, the draft context trimmed to the common prefix) and mlx-lm's ``--draft-model``
(``speculative_generate_step``: the draft cache trimmed by the rejected count).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlx_engine.errors import CacheFullError, InvalidRequestError
from mlx_engine.ml import DType

__all__ = ["DraftModel", "check_vocabulary"]


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
        self.ctx = runner.backend.new_context()

    def draft(self, tokens: Sequence[int], k: int) -> list[int]:
        """At most ``k`` tokens the draft model predicts (argmax, one forward pass each) after ``tokens`` (int ids:
        the target's prompt and accepted output); fewer when the draft's cache is full or it proposes an id
        outside the target's vocabulary."""
        if k < 1:
            return []
        r, seq, out = self.runner, self.sequence, []
        try:
            logits, _ = r.prefill(self.ctx, seq, [int(t) for t in tokens])  # reuses the common prefix
            pos = len(tokens)
            while True:
                t = int(logits.astype(DType.FLOAT32).argmax(axis=-1).numpy()[0])
                if t >= self.vocab_size:
                    break
                out.append(t)
                if len(out) == k:  # the last draft token is fed at the next call, if the target accepts it
                    break
                logits = r.decode(self.ctx, [t], [pos], [seq])
                pos += 1
        except CacheFullError:
            pass  # the draft's context is full: what was drafted so far
        return out


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
