"""Decoder embedders (Qwen3-Embedding; any decoder whose checkpoint pools its hidden states): one of our decoder
models run over a packed batch of inputs, causally as it was trained, its final-normed hidden states pooled per
input.

A decoder reranker (Qwen3-Reranker) scores a prompt holding a (query, document) pair by its last token's logits of
``yes`` and ``no`` (:meth:`DecoderEncoder.rank`); the prompt is built in ``models/embedding/rerank.py``.

References: sentence-transformers' ``models/Pooling.py`` (``pooling_mode_lasttoken``: the hidden state of each
input's last real token) over transformers' ``Qwen3Model`` (final ``norm`` applied); llama.cpp's
``llm_graph_context::build_pooling`` (``LLAMA_POOLING_TYPE_LAST`` on ``result_norm``), which Qwen3-Embedding's GGUF
selects with ``qwen3.pooling_type = 3``.

Inputs are packed, not padded: one ``Batch`` holds every input's tokens, each its own sequence, and a causal cache
made for that pass alone keeps each input's attention to its own earlier tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from mlx_engine.batch import Batch
from mlx_engine.errors import WeightsError
from mlx_engine.ml import Backend, Context, DType
from mlx_engine.models.layers.base import DecoderModel
from mlx_engine.models.registry import load_text_model

#: The most tokens of one packed pass: the causal cache's mask is ``[tokens, tokens]``.
DECODER_BATCH_TOKENS = 2048


@dataclass
class DecoderEmbedderConfig:
    """What the embedding pipeline reads of a decoder: architecture, vocab_size, hidden_size, context_length."""

    architecture: str
    vocab_size: int
    hidden_size: int
    context_length: int


class DecoderEncoder:
    """A decoder model as an encoder for embeddings. Attributes: model (:class:`DecoderModel`), config
    (:class:`DecoderEmbedderConfig`), batch_tokens (the most tokens of one pass)."""

    batch_tokens = DECODER_BATCH_TOKENS

    def __init__(self, model: DecoderModel, backend: Backend, rank_rows: np.ndarray | None = None):
        c = model.config
        self.model, self.backend = model, backend
        self.config = DecoderEmbedderConfig(c.architecture, c.vocab_size, c.hidden_size, c.context_length)
        #: float32 ``[2, hidden_size]``: the output head's rows of ``yes`` and ``no`` (a reranker), else None
        self.rank_rows = rank_rows

    @classmethod
    def from_backend(cls, backend: Backend, rank_tokens: tuple[int, int] | None = None) -> "DecoderEncoder":
        """A decoder embedder; with ``rank_tokens`` (the ids of ``yes`` and ``no``), a decoder reranker.

        The reranker's head is the output head's rows of those tokens (a folder's ``lm_head``, or the tied token
        embedding); a GGUF holds them as ``cls.output.weight`` ``[2, hidden]`` (llama.cpp's converter,
        ``Qwen3Model._get_cls_out_tensor``: ``yes`` then ``no``), ``rank_tokens`` then unused.

        Raises UnsupportedError (an architecture we do not run) or WeightsError (a bad checkpoint, or a reranker
        GGUF without ``cls.output.weight`` ``[2, hidden]``)."""
        model = load_text_model(backend)
        if rank_tokens is None:
            return cls(model, backend)
        head = backend.weights.get("cls.output.weight") if "general.architecture" in backend.metadata \
            else model.head.rows(list(rank_tokens))
        if head is None or tuple(head.shape) != (2, model.config.hidden_size):
            raise WeightsError("a decoder reranker's GGUF holds its yes / no head as cls.output.weight "
                               f"[2, {model.config.hidden_size}]; this one has "
                               f"{'none' if head is None else list(head.shape)}")
        return cls(model, backend, head.dequantize().astype(DType.FLOAT32).numpy())

    @property
    def has_rank_head(self) -> bool:
        """Whether this decoder scores pairs (a yes / no head): a reranker."""
        return self.rank_rows is not None

    def rank(self, ctx: Context, inputs: Sequence[Sequence[int]], types: Sequence[Sequence[int]] | None = None
             ) -> np.ndarray:
        """Relevance logits float32 ``[len(inputs), 1]`` of prompt inputs: ``logit(yes) - logit(no)`` at each
        input's last token, whose sigmoid is ``p(yes)`` of the two-way softmax that Qwen3-Reranker's model card
        computes (``log_softmax`` over the stacked yes / no logits) and llama.cpp's ``LLAMA_POOLING_TYPE_RANK``
        gives (``ggml_soft_max`` over ``cls_out``'s two outputs, its score the first). ``types`` is ignored (a
        decoder has no token types). Raises WeightsError when the model has no yes / no head."""
        if self.rank_rows is None:
            raise WeightsError(f"the {self.config.architecture} checkpoint is not a reranker: it has no yes / no head")
        logits = self.pooled(ctx, inputs, "last").astype(np.float64) @ self.rank_rows.T.astype(np.float64)
        return (logits[:, :1] - logits[:, 1:]).astype(np.float32)

    def pooled(self, ctx: Context, inputs: Sequence[Sequence[int]], mode: str) -> np.ndarray:
        """Pooled final-normed hidden states, float32 ``[len(inputs), hidden_size]``: ``last`` the last token's,
        ``cls`` the first token's, ``mean`` the mean over each input's tokens. Raises ValueError for another mode."""
        lengths = np.array([len(x) for x in inputs], np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        batch = Batch(np.concatenate([np.asarray(x, np.int32) for x in inputs]),
                      np.concatenate([np.arange(n, dtype=np.int32) for n in lengths]),
                      np.concatenate([np.full(n, s, np.int32) for s, n in enumerate(lengths)]))
        cache = self.model.make_cache()
        cache.init(self.backend, self.model.dtype, len(inputs), int(lengths.max()), len(batch))
        try:
            h = self.model.forward(ctx, batch, cache, hidden_only=True)[0]  # [N, D]
            if mode in ("last", "cls"):
                rows = starts + (lengths - 1 if mode == "last" else 0)
                out = h.take(ctx.from_numpy(rows.astype(np.int32)), axis=0)
            elif mode == "mean":  # a [B, N] matrix of 1 / length over each input's rows
                weights = np.zeros((len(inputs), len(batch)), np.float32)
                for b, (s, n) in enumerate(zip(starts, lengths)):
                    weights[b, s:s + n] = 1.0 / n
                out = ctx.from_numpy(weights).matmul(h.astype(DType.FLOAT32))
            else:
                raise ValueError(f"pooling {mode!r}: mean, cls and last are the ones we run")
            vectors = out.astype(DType.FLOAT32).numpy()
        finally:
            cache.close()
        return vectors
