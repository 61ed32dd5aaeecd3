"""Reranking with cross-encoders: a (query, document) pair through a BERT encoder with a classification head, one
relevance score per document.

References: sentence-transformers' ``CrossEncoder.predict`` (the tokenizer's pair encoding, truncated longest
first; ``Sigmoid`` on a one-label model's logit by default); transformers' ``BertForSequenceClassification``
(token types 0 for the query and 1 for the document; pooler then classifier); llama.cpp's server
``format_prompt_rerank`` (a GGUF's pair: ``[BOS] query [EOS] [SEP] document [EOS]``, each where the vocabulary's
``add_bos`` / ``add_eos`` / ``add_sep`` say, token type 0 throughout) and ``LLAMA_POOLING_TYPE_RANK``.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from mlx_engine.errors import InvalidRequestError, UnsupportedError
from mlx_engine.models.embedding.embedder import Embedder

#: llama.cpp's ``add_bos`` / ``add_eos`` / ``add_sep`` when a GGUF does not say, by ``tokenizer.ggml.model``
#: (``llama_vocab::impl::load``).
_ADD_DEFAULTS = {"bert": (True, False, True), "llama": (True, False, False), "t5": (False, True, False)}


class Reranker:
    """An :class:`Embedder` whose encoder has a classification head, as a reranker.

    Raises UnsupportedError at construction for a checkpoint without one."""

    def __init__(self, embedder: Embedder):
        if not embedder.ranks:
            raise UnsupportedError("this model has no classification head: it embeds (embed), it does not rerank")
        self.embedder = embedder
        self.limit = embedder.spec.max_tokens
        self._specials = _gguf_pair_specials(embedder.backend.metadata) if embedder.gguf else None

    def pair_tokens(self, query: str, documents: Sequence[str], truncate: bool = True
                    ) -> tuple[list[list[int]], list[list[int]] | None]:
        """``(ids, types)`` of each (query, document) pair; ``types`` None for a GGUF (all 0, as llama.cpp runs).
        A pair longer than the model's context is cut, the longer part first (``longest_first``).

        Raises:
            InvalidRequestError: a query or document that is not a non-empty string; a pair too long with
                ``truncate=False``, or whose query alone fills the context.
        """
        if not isinstance(query, str) or not query:
            raise InvalidRequestError(f"query must be a non-empty string, not {query!r:.60}")
        tk = self.embedder.tokenizer.backend
        q = tk.encode(query, add_special_tokens=False)
        ids, types = [], []
        for i, doc in enumerate(documents):
            if not isinstance(doc, str) or not doc:
                raise InvalidRequestError(f"document {i} must be a non-empty string, not {doc!r:.60}")
            d = tk.encode(doc, add_special_tokens=False)
            if self._specials is None:
                extra = tk.num_special_tokens_to_add(is_pair=True)
            else:
                first, middle, last = self._specials
                extra = len(first) + len(middle) + len(last)
            qn, dn = _fit(len(q.ids), len(d.ids), self.limit - extra, truncate, i)
            if self._specials is None:
                qe, de = tk.encode(query, add_special_tokens=False), d
                qe.truncate(qn)
                de.truncate(dn)
                pair = tk.post_process(qe, de, add_special_tokens=True)
                ids.append(list(pair.ids))
                types.append(list(pair.type_ids))
            else:
                ids.append(first + q.ids[:qn] + middle + d.ids[:dn] + last)
        return ids, (types if self._specials is None else None)

    def scores(self, ids: Sequence[Sequence[int]], types: Sequence[Sequence[int]] | None) -> np.ndarray:
        """The classifier's first output (the relevance logit), float32 ``[len(ids)]``, in padded batches."""
        e = self.embedder
        out = np.zeros(len(ids), np.float32)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        start = 0
        while start < len(order):
            end = start + 1
            while end < len(order) and (end + 1 - start) * len(ids[order[end]]) <= e.encoder.batch_tokens:
                end += 1
            rows = order[start:end]
            with e.backend.new_context() as ctx:
                got = e.encoder.rank(ctx, [ids[i] for i in rows], None if types is None else [types[i] for i in rows])
            out[rows] = got[:, 0]
            start = end
        return out


def _fit(qn: int, dn: int, room: int, truncate: bool, index: int) -> tuple[int, int]:
    """Lengths of query and document within ``room`` tokens, the longer cut first (transformers' longest_first)."""
    if qn + dn <= room:
        return qn, dn
    if not truncate:
        raise InvalidRequestError(f"document {index} with the query has {qn + dn} tokens, more than the model's "
                                  f"{room}; shorten it or let it be truncated (truncate: true)")
    if room < 2:
        raise InvalidRequestError(f"the model's context leaves no room for document {index}")
    while qn + dn > room:
        if qn > dn:
            qn -= 1
        else:
            dn -= 1
    return qn, dn


def _gguf_pair_specials(md: Any) -> tuple[list[int], list[int], list[int]]:
    """The ids before the query, between query and document, and after the document, as llama.cpp's server puts
    them (``format_prompt_rerank``, without a ``rerank`` chat template)."""
    bos_d, eos_d, sep_d = _ADD_DEFAULTS.get(str(md.get("tokenizer.ggml.model")), (False, False, False))
    wpm = md.get("tokenizer.ggml.model") == "bert"  # llama.cpp's WPM ids when the file names none
    bos = md.get("tokenizer.ggml.bos_token_id", 101 if wpm else None)
    eos = md.get("tokenizer.ggml.eos_token_id")
    sep = md.get("tokenizer.ggml.seperator_token_id", 102 if wpm else None)
    if eos is None:
        eos = sep
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", bos_d)) and bos is not None
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", eos_d)) and eos is not None
    add_sep = bool(md.get("tokenizer.ggml.add_sep_token", sep_d)) and sep is not None
    first = [int(bos)] if add_bos else []
    middle = ([int(eos)] if add_eos else []) + ([int(sep)] if add_sep else [])
    last = [int(eos)] if add_eos else []
    return first, middle, last
