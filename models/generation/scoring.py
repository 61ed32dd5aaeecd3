"""Scoring a text: the negative log-likelihood of its tokens under a model's logits (:meth:`Runner.perplexity`, the
bench's peers)."""

from __future__ import annotations

import numpy as np

__all__ = ["sum_nll"]


def sum_nll(logits: np.ndarray, targets: np.ndarray, block: int = 8) -> float:
    """Sum over rows of ``-log softmax(logits[i])[targets[i]]`` (natural log), in float64: ``logits`` ``[n, vocab]``,
    ``targets`` int ``[n]``. The one scoring of :meth:`Runner.perplexity` and of the bench's peers. Runs ``block``
    rows at a time, so that its float64 temporaries stay a few MiB (the whole ``[128, 262144]`` of Gemma 3's chunk
    in float64 is 256 MiB a temporary, and fresh memory of that size is slow to fault in)."""
    total = 0.0
    for i in range(0, len(targets), block):
        rows = np.asarray(logits[i:i + block], np.float64)
        top = rows.max(axis=-1)
        log_z = top + np.log(np.exp(rows - top[:, None]).sum(axis=-1))
        total += float((log_z - rows[np.arange(len(rows)), targets[i:i + block]]).sum())
    return total
