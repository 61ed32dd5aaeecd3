"""Embeddings at the Python API: :func:`mlx_engine.load` returns an :class:`EmbeddingModel` for an encoder checkpoint
(BERT, XLM-RoBERTa, nomic-bert, ModernBERT), whose :meth:`~EmbeddingModel.embed` turns texts into float32 vectors. Re-exported by
:mod:`mlx_engine.api`.

>>> model = mlx_engine.load("path/to/all-MiniLM-L6-v2")     # a sentence-transformers folder or a GGUF file
>>> model.embed(["a cat", "a dog"]).shape                    # (2, 384), each row of L2 norm 1
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from mlx_engine.errors import EngineError, InvalidRequestError
from mlx_engine.mlx import MLXBackend
from mlx_engine.models.embedding.embedder import Embedder, is_embedder
from mlx_engine.models.embedding.rerank import Reranker


def is_embedding_checkpoint(path: Path) -> bool:
    """Whether the model file or folder at ``path`` is one we embed with (:func:`is_embedder`, from its metadata and
    ``modules.json`` alone);
    False where it cannot be read (the load then says what is wrong)."""
    from mlx_engine.weights import open_weights

    try:
        with open_weights(path) as wf:
            return is_embedder(wf.metadata, path)
    except (EngineError, OSError):
        return False


class EmbeddingModel:
    """A loaded embedding model. Thread-safe: calls are serialized by a lock.

    Attributes:
        name: the name it was loaded by. architecture: ``bert``, ``xlm-roberta``, ``nomic-bert`` or a decoder's
            (``qwen3``).
        dim: the vector width. reranker: a :class:`Reranker` for a cross-encoder or a decoder reranker
            (:meth:`rerank`), else None.
        context_length: the most tokens of one input (longer ones are truncated, or refused with ``truncate=False``).
        pooling: ``mean``, ``cls`` or ``last``. prompts: the model's named prompts (``{"query": "..."}``).
        info: architecture, parameters, quantization, context_length, embedding_length, pooling, source, path.
    """

    def __init__(self, name: str, path: Path, *, source: str = "file", license: str | None = None,
                 device: str | None = None, dtype: str | None = None):
        t0 = time.perf_counter()
        # weights as stored: an embedding model is small, and requantizing a float one would move its vectors
        self.backend = MLXBackend(path, device=device, dtype=dtype, requantize=0)
        try:
            self.embedder = Embedder(self.backend, Path(path))
        except BaseException:
            self.backend.close()
            raise
        config = self.embedder.encoder.config
        self.reranker = Reranker(self.embedder) if self.embedder.ranks else None
        self.name, self.path = name, Path(path)
        self.architecture = config.architecture
        self.dim = self.embedder.dim
        self.context_length = self.embedder.spec.max_tokens
        self.pooling = self.embedder.spec.pooling
        self.prompts = dict(self.embedder.spec.prompts)
        self.tokenizer = self.embedder.tokenizer
        types = getattr(self.backend, "tensor_types", {})
        quant = max(set(types.values()), key=list(types.values()).count) if types else "unknown"
        shapes = getattr(self.backend, "tensor_shapes", [])
        self.info = {"architecture": self.architecture, "parameters": sum(int(np.prod(s)) for s in shapes),
                     "quantization": quant, "context_length": self.context_length, "embedding_length": self.dim,
                     "pooling": self.pooling, "license": license, "source": source, "path": str(path)}
        self.weights_bytes = self.backend.weights_nbytes()
        self.load_seconds = time.perf_counter() - t0
        self._lock = threading.Lock()
        self._closed = False

    def tokenize(self, texts: Sequence[str], *, prompt_name: str | None = None, truncate: bool = True,
                 fit: bool = True) -> list[list[int]]:
        """Token ids of each text as :meth:`embed` runs them (see :meth:`Embedder.tokenize`; ``fit=False``: not cut
        to :attr:`context_length`)."""
        return self.embedder.tokenize(_texts(texts), prompt_name=prompt_name, truncate=truncate, fit=fit)

    def embed(self, texts: "str | Sequence[str]", *, dimensions: int | None = None, normalize: bool = True,
              truncate: bool = True, prompt_name: str | None = None) -> np.ndarray:
        """Embeddings float32 ``[n, dimensions or dim]`` of ``texts`` (one string: ``n = 1``), run in padded batches.

        Args:
            dimensions: keep the first ``dimensions`` components (Matryoshka models), normalized after the cut.
            normalize: L2-normalize each vector (the default, as sentence-transformers' ``Normalize`` and OpenAI);
                False: the pooled vectors as they are.
            truncate: cut an input longer than :attr:`context_length` (the default); False: refuse it.
            prompt_name: one of :attr:`prompts` to put before each text (``"query"``...); None: the model's default
                prompt, if it has one.

        Raises:
            InvalidRequestError: an empty or non-string text, ``dimensions`` out of ``1..dim``, an unknown
                ``prompt_name``, an input too long with ``truncate=False``, a closed model.
        """
        ids = self.tokenize(texts, prompt_name=prompt_name, truncate=truncate)
        return self.embed_tokens(ids, dimensions=dimensions, normalize=normalize, truncate=truncate)

    def embed_tokens(self, inputs: Sequence[Sequence[int]], *, dimensions: int | None = None, normalize: bool = True,
                     truncate: bool = True) -> np.ndarray:
        """Embeddings of token-id inputs (as given: no special tokens added), as :meth:`embed`."""
        if self.reranker is not None:
            raise InvalidRequestError(f"{self.name} is a reranker (a cross-encoder), not an embedding model: use "
                                      "rerank")
        inputs = [self.embedder.fit(list(x), truncate, i) for i, x in enumerate(inputs)]
        with self._lock:
            if self._closed:
                raise InvalidRequestError(f"{self.name} was closed; load it again")
            return self.embedder.embed_ids(inputs, dimensions=dimensions, normalize=normalize)

    def rerank(self, query: str, documents: Sequence[str], *, top_n: int | None = None, normalize: bool = True,
               truncate: bool = True) -> list[dict[str, Any]]:
        """Relevance of each document to ``query`` by a cross-encoder, best first: ``[{"index": i,
        "relevance_score": s}, ...]`` (``index`` into ``documents``; at most ``top_n`` entries).

        ``normalize``: the score through a sigmoid, in 0..1 (sentence-transformers' ``CrossEncoder.predict`` for a
        one-label model, Jina's and Cohere's scores); False: the raw logit (llama.cpp's server's
        ``relevance_score``). ``truncate``: a pair longer than the context is cut, the longer part first; False:
        refused.

        Raises:
            InvalidRequestError: an empty or non-string query or document, no documents, ``top_n`` below 1, a pair
                too long with ``truncate=False``, a closed model, or a model that embeds and does not rerank.
        """
        if self.reranker is None:
            raise InvalidRequestError(f"{self.name} is an embedding model, not a reranker (a cross-encoder with a "
                                      "classification head): use embed")
        if isinstance(documents, str) or not isinstance(documents, (list, tuple)) or not documents:
            raise InvalidRequestError("documents must be a non-empty list of strings")
        if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
            raise InvalidRequestError(f"top_n must be a positive integer, not {top_n!r}")
        ids, types = self.reranker.pair_tokens(query, documents, truncate)
        with self._lock:
            if self._closed:
                raise InvalidRequestError(f"{self.name} was closed; load it again")
            logits = self.reranker.scores(ids, types)
        scores = 1.0 / (1.0 + np.exp(-logits.astype(np.float64))) if normalize else logits.astype(np.float64)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:top_n]
        return [{"index": i, "relevance_score": float(scores[i])} for i in order]

    def close(self) -> None:
        """Let go of the weights; later calls raise InvalidRequestError."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self.backend.close()


def _texts(texts: Any) -> list[str]:
    if isinstance(texts, str):
        return [texts]
    if not isinstance(texts, (list, tuple)) or not texts:
        raise InvalidRequestError(f"texts must be a string or a non-empty list of strings, not {texts!r:.80}")
    return list(texts)
