"""Decoder embedders (Qwen3-Embedding; any decoder whose checkpoint pools its hidden states): one of our decoder
models run over a packed batch of inputs, causally as it was trained, its final-normed hidden states pooled per
input.

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

    def __init__(self, model: DecoderModel, backend: Backend):
        c = model.config
        self.model, self.backend = model, backend
        self.config = DecoderEmbedderConfig(c.architecture, c.vocab_size, c.hidden_size, c.context_length)

    @classmethod
    def from_backend(cls, backend: Backend) -> "DecoderEncoder":
        """Raises UnsupportedError (an architecture we do not run) or WeightsError (a bad checkpoint)."""
        return cls(load_text_model(backend), backend)

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
