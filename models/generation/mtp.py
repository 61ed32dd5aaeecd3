"""Multi-token prediction (MTP) heads as a speculative drafter: DeepSeek V3's MTP module and GLM-4.5's next-token
prediction layer (``num_nextn_predict_layers``: the layers past ``num_hidden_layers`` in the checkpoint).

The MTP layer at position ``j`` reads the model's hidden state ``h_j`` and the embedding of the next token
``t_{j+1}``, and predicts the token after it, ``t_{j+2}`` (the DeepSeek-V3 technical report, section 2.2):

    x_j = eh_proj [enorm(E t_{j+1}); hnorm(h_j)]     (the embedding first, as the checkpoints are trained)
    y_j = block(x_j)                                  (a decoder layer of the model's own kind, always MoE, attending
                                                       over the MTP layer's own KV cache of positions <= j)
    logits_j = head(shared_head.norm(y_j))

``h_j`` is the model's last hidden state after its final norm: what transformers' ``MTPCandidateGenerator`` passes
(``hidden_states[-1]``) and llama.cpp's ``h_nextn`` is. ``E`` and ``head`` are the layer's own ``embed_tokens`` and
``shared_head.head`` where the checkpoint has them, else the model's (llama.cpp's ``graph_mtp``). The MTP layer runs
at the hidden state's position ``j``; transformers runs it at ``j + 1``, which changes no score (RoPE is relative).

Drafting ``k`` tokens with the one MTP layer these models ship: the first from the model's own hidden state, each
further one by feeding the layer its own normed output ``shared_head.norm(y)`` as the next ``h`` with the token it
just drafted, as llama.cpp's ``draft-mtp`` and vLLM do with one layer (transformers drafts one token per MTP layer).
Those chained cells are removed from the MTP cache after the draft: the cache keeps only the cells computed from the
model's own hidden states, which the model's passes (prefill chunks and verifications) hand over
(:meth:`MTPHead.observe`) and the next draft consumes. The drafts are greedy (a one-hot ``q``), so the model's
verification keeps its output exactly (:mod:`~mlx_engine.models.generation.speculative`).

References: transformers' ``modeling_layers.py`` (``MtpLayer``, ``MtpModel``) and
``generation/candidate_generator.py`` (``MTPCandidateGenerator``); llama.cpp's ``src/models/glm4-moe.cpp`` and
``deepseek2.cpp`` (``graph_mtp``) and ``common/speculative.cpp`` (``draft-mtp``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from mlx_engine.batch import Batch
from mlx_engine.errors import CacheFullError
from mlx_engine.ml import Context, DType, Tensor
from mlx_engine.models.layers.nextn import MTP_OWN, MTP_PREFIX

__all__ = ["MTPHead", "MTPDrafter"]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class MTPHead:
    """A model's first MTP layer, run as a one-layer model of the model's own architecture with its own KV cache.

    Args:
        model: the target :class:`~mlx_engine.models.layers.base.DecoderModel`, its weights holding ``mtp.0.*``
            (:func:`~mlx_engine.models.layers.nextn.mtp_weights`).
        context_length, max_sequences, prefill_chunk, kv_bits: the MTP cache's, as the target runner's.

    Raises:
        ValueError: the model has no MTP layer (:meth:`available` says so first).
        WeightsError: the MTP layer's tensors do not fit the model's config.
    """

    def __init__(self, model: Any, *, context_length: int, max_sequences: int, prefill_chunk: int,
                 kv_bits: int | None = None):
        if not self.available(model):
            raise ValueError(f"the {model.architecture} model has no multi-token-prediction layer")
        w, p = model.w, MTP_PREFIX + "0."
        block = {"model.layers.0." + n[len(p):]: t for n, t in w.items()
                 if n.startswith(p) and n[len(p):] not in MTP_OWN}
        block["model.embed_tokens.weight"] = w.get(p + "embed_tokens.weight", w["model.embed_tokens.weight"])
        block["model.norm.weight"] = w.get(p + "shared_head.norm.weight", w["model.norm.weight"])
        block["lm_head.weight"] = w.get(p + "shared_head.head.weight", model.head)
        c = model.config
        # one layer, always a mixture of experts (transformers' get_mtp_config: first_k_dense_replace = 0)
        extra = {"dense_layers": 0} if hasattr(c, "dense_layers") else {}
        config = dataclasses.replace(c, num_layers=1, layer_types=["full_attention"], **extra)
        self.model = type(model)(config, block, model.backend)
        for n in [n for n in w if n.startswith(p) and n[len(p):] not in MTP_OWN]:
            del w[n]  # the one-layer model holds the block now (its experts stacked: the per-expert tensors let go)
        self.model.use_context(context_length)
        self.backend = model.backend
        self.eps = c.rms_norm_eps
        self.enorm, self.hnorm, self.eh_proj = w[p + "enorm.weight"], w[p + "hnorm.weight"], w[p + "eh_proj.weight"]
        self.embed = block["model.embed_tokens.weight"]
        self.prefill_chunk = prefill_chunk
        self.cache = self.model.make_cache(kv_bits)
        self.cache.init(self.backend, self.model.dtype, max_sequences, context_length, prefill_chunk)
        #: the sequences whose requests draft with this head (the runner hands their hidden states over)
        self.active: set[int] = set()
        self._tokens: dict[int, list[int]] = {}  # per sequence: t_0 .. t_m, the cache holding positions 0 .. m - 1
        self._rows: dict[int, list[tuple[int, Tensor]]] = {}  # per sequence: (position, hidden [n, D]) not yet used

    @staticmethod
    def available(model: Any) -> bool:
        """Whether ``model``'s weights hold an MTP layer (``mtp.0.eh_proj.weight``)."""
        return MTP_PREFIX + "0.eh_proj.weight" in model.w

    # ---- bookkeeping -------------------------------------------------------------------------------------------
    def follow(self, seq: int, on: bool) -> None:
        """Start (``on``) or stop following sequence ``seq``: taking its hidden states, drafting for it."""
        if on:
            self.active.add(seq)
        else:
            self.active.discard(seq)
            self.forget(seq)

    def forget(self, seq: int) -> None:
        """Drop what is held for sequence ``seq`` (its cells, its hidden states): the model's cache forgot it."""
        self._truncate(seq, 0)
        self._tokens.pop(seq, None)
        self._rows.pop(seq, None)

    def share(self, src: int, dst: int, n: int) -> None:
        """Sequence ``dst`` now starts with the first ``n`` tokens of ``src`` in the model's cache: it takes the
        MTP cells of those positions (``copy_prefix``) and the unused hidden states there."""
        self._truncate(dst, 0)
        have = min(len(self._tokens.get(src, ())) - 1, n - 1)
        if have > 0:
            self.cache.copy_prefix(src, dst, have)
            self._tokens[dst] = self._tokens[src][:have + 1]
        self._rows[dst] = [(pos, rows[:max(0, n - pos)]) for pos, rows in self._rows.get(src, []) if pos < n]

    def _truncate(self, seq: int, entries: int) -> None:
        tokens = self._tokens.get(seq, [])
        if len(tokens) - 1 > entries:
            self.cache.remove(seq, entries, None)
            self._tokens[seq] = tokens[:entries + 1] if entries > 0 else []

    def observe(self, seq: int, pos: int, hidden: Tensor) -> None:
        """The model ran positions ``pos ..`` of ``seq``: their final-normed hidden states ``hidden [n, D]``
        (float, the compute dtype) are kept until a draft uses them. What the model held beyond ``pos`` is gone, so
        are the MTP cells from there on (they read the hidden states of those positions)."""
        self._truncate(seq, pos)
        kept = [(p, rows[:pos - p]) for p, rows in self._rows.get(seq, []) if p < pos]
        self._rows[seq] = [*kept, (pos, hidden)]

    def observe_runs(self, runs: Sequence[tuple[int, int, int]], hidden: Tensor) -> None:
        """:meth:`observe` for each followed sequence of one forward pass: ``runs`` its runs of tokens in order
        (``(sequence, first position, count)``), ``hidden [N, D]`` the pass's hidden states."""
        at = 0
        for seq, pos, n in runs:
            if int(seq) in self.active:
                self.observe(int(seq), int(pos), hidden[at:at + n])
            at += n

    def catch_up(self, ctx: Context, seq: int, tokens: Sequence[int]) -> None:
        """:meth:`advance` a followed sequence as far as ``tokens`` (prompt tokens known ahead) allow, so that the
        hidden states of a long prompt are used chunk by chunk rather than held; a full MTP cache leaves it for the
        draft to find."""
        if seq in self.active:
            try:
                self.advance(ctx, seq, tokens)
            except CacheFullError:
                pass

    def _rows_for(self, ctx: Context, seq: int, start: int, end: int) -> Tensor | None:
        """The hidden states ``[end - start, D]`` of positions ``start .. end - 1`` (None: not all are held)."""
        parts, at = [], start
        for p, rows in self._rows.get(seq, []):
            if p <= at < p + rows.shape[0]:
                take = rows[at - p:min(end, p + rows.shape[0]) - p]
                parts.append(take)
                at += take.shape[0]
                if at >= end:
                    break
        if at < end:
            return None
        return parts[0] if len(parts) == 1 else ctx.concatenate(parts, axis=0)

    # ---- the layer ---------------------------------------------------------------------------------------------
    def run(self, ctx: Context, seq: int, tokens: Sequence[int], hidden: Tensor, pos: int,
            outputs: Sequence[int] | None = None) -> tuple[Tensor, Tensor]:
        """The MTP layer on ``tokens`` (the next tokens ``t_{j+1}``, int ids) and ``hidden [n, D]`` (the model's
        final-normed ``h_j``) at positions ``pos ..`` of ``seq``, its cells put in the MTP cache. Returns the logits
        ``[len(outputs), vocab]`` of the rows ``outputs`` (default: the last) and the normed outputs ``[n, D]``
        (``shared_head.norm(y)``, what a chained draft feeds back as ``h``). Raises ``CacheFullError`` with the cache
        unchanged when it has no room."""
        ids = ctx.from_numpy(np.asarray(tokens, np.int32), DType.INT32)
        e = self.embed.take(ids, axis=0).astype(self.model.dtype).rms_norm(self.enorm, self.eps)
        h = hidden.astype(self.model.dtype).rms_norm(self.hnorm, self.eps)
        x = ctx.concatenate([e, h], axis=-1).linear(self.eh_proj)
        n = len(tokens)
        batch = Batch(np.asarray(tokens, np.int32), np.arange(pos, pos + n), np.full(n, seq),
                      [n - 1] if outputs is None else outputs, embeddings=x)
        return self.model.forward(ctx, batch, self.cache, hidden_too=True)

    def advance(self, ctx: Context, seq: int, tokens: Sequence[int]) -> tuple[Tensor, Tensor] | None:
        """Bring ``seq``'s MTP cache up to ``tokens`` (the model's tokens so far, prompt and accepted output, whose
        hidden states the model has handed over up to ``len(tokens) - 2``): the cells of positions ``0 ..
        len(tokens) - 2``. Returns the last cell's logits ``[1, vocab]`` (the prediction of the token after
        ``tokens``) and normed output ``[1, D]``; None when there is nothing to run or a hidden state is missing (a
        prefix the model reused from before this head followed the sequence). Raises ``CacheFullError``."""
        held = self._tokens.get(seq, [])
        n = _common_prefix(held, tokens)
        self._truncate(seq, max(0, n - 1))
        start, end = max(0, min(n, len(held)) - 1), len(tokens) - 1
        if end <= start:
            return None
        rows = self._rows_for(ctx, seq, start, end)
        if rows is None:
            return None
        got = None
        for b in range(start, end, self.prefill_chunk):
            e = min(end, b + self.prefill_chunk)
            logits, out = self.run(ctx, seq, tokens[b + 1:e + 1], rows[b - start:e - start], b)
            got = logits, out[-1:]
            ctx.evaluate(*got)
            self._tokens[seq] = [int(t) for t in tokens[:e + 1]]
        self._rows[seq] = [(max(p, end), r[max(0, end - p):]) for p, r in self._rows.get(seq, [])
                           if p + r.shape[0] > end]
        return got

    def draft(self, seq: int, tokens: Sequence[int], k: int, vocab_size: int) -> list[int]:
        """At most ``k`` greedy drafts of the tokens after ``tokens`` (:meth:`advance`, then the layer chained on
        its own output); fewer when the MTP cache is full or a draft is an id at or beyond ``vocab_size`` (a padding
        row of the output matrix), none when a hidden state is missing."""
        if k < 1:
            return []
        ctx = self.backend.new_context()
        out: list[int] = []
        chained = 0
        try:
            got = self.advance(ctx, seq, tokens)
            if got is None:
                return []
            logits, hidden = got
            while True:
                t = int(logits.astype(DType.FLOAT32).argmax(axis=-1).numpy().reshape(-1)[0])
                if t >= vocab_size:
                    break
                out.append(t)
                if len(out) >= k:
                    break
                logits, hidden = self.run(ctx, seq, [t], hidden, len(tokens) - 2 + len(out))
                chained += 1
        except CacheFullError:
            pass  # what was drafted so far
        finally:
            if chained:  # cells of drafted tokens, not the model's: gone before the model verifies
                self.cache.remove(seq, len(tokens) - 1, None)
        return out


class MTPDrafter:
    """The MTP head's greedy drafts for one sequence (a :class:`~mlx_engine.models.generation.speculative.Drafter`).

    Args:
        head: the model's :class:`MTPHead`.
        sequence: the sequence it drafts for (the model's and the head's cache alike).
        vocab_size: the tokenizer's vocabulary size: a draft at or beyond it ends the draft.
    """

    def __init__(self, head: MTPHead, sequence: int, vocab_size: int):
        self.head, self.sequence, self.vocab_size = head, sequence, vocab_size
        head.follow(sequence, True)

    def draft(self, tokens: Sequence[int], k: int) -> list[int]:
        """At most ``k`` tokens the MTP layer predicts after ``tokens`` (int ids: prompt and accepted output)."""
        return self.head.draft(self.sequence, tokens, k, self.vocab_size)
