"""Reranking with cross-encoders: a (query, document) pair through a BERT-family encoder (BERT, XLM-RoBERTa,
ModernBERT) with a classification head, one relevance score per document.

References: sentence-transformers' ``CrossEncoder.predict`` (the tokenizer's pair encoding, truncated longest
first; ``Sigmoid`` on a one-label model's logit by default); transformers' ``BertForSequenceClassification``
(token types 0 for the query and 1 for the document; pooler then classifier); llama.cpp's server
``format_prompt_rerank`` (a GGUF's pair: ``[BOS] query [EOS] [SEP] document [EOS]``, each where the vocabulary's
``add_bos`` / ``add_eos`` / ``add_sep`` say, token type 0 throughout) and ``LLAMA_POOLING_TYPE_RANK``.

A decoder reranker (Qwen3-Reranker) scores a prompt instead of a pair encoding. From a folder, the prompt of its
model card (Qwen's ``format_instruction``, ``prefix`` and ``suffix``, each tokenized apart, the middle cut at its end
where too long); from a GGUF, the file's ``tokenizer.chat_template.rerank`` (llama.cpp's converter writes it) with
``{query}`` and ``{document}`` replaced, tokenized whole with its special tokens and nothing added (llama.cpp's
server's ``format_prompt_rerank``).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from mlx_engine.errors import InvalidRequestError, UnsupportedError, WeightsError
from mlx_engine.models.arch.bert import ENCODER_ARCHITECTURES
from mlx_engine.models.embedding.embedder import Embedder

#: Qwen3-Reranker's prompt (its model card's ``prefix``, ``suffix`` and default instruction).
QWEN3_RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
                       "the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
                       "<|im_start|>user\n")
QWEN3_RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"

#: llama.cpp's ``add_bos`` / ``add_eos`` / ``add_sep`` when a GGUF does not say, by ``tokenizer.ggml.model``
#: (``llama_vocab::impl::load``).
_ADD_DEFAULTS = {"bert": (True, False, True), "llama": (True, False, False), "t5": (False, True, False)}


class Reranker:
    """An :class:`Embedder` whose encoder has a classification head (or a decoder's yes / no head), as a
    reranker.

    Raises UnsupportedError at construction for a checkpoint without one."""

    def __init__(self, embedder: Embedder):
        if not embedder.ranks:
            raise UnsupportedError("this model has no classification head: it embeds (embed), it does not rerank")
        self.embedder = embedder
        self.limit = embedder.spec.max_tokens
        md = embedder.backend.metadata
        #: a decoder reranker's prompt ``(head, middle, tail)``, ``{query}`` / ``{document}`` in the middle
        self.template: tuple[str, str, str] | None = None
        if embedder.encoder.config.architecture not in ENCODER_ARCHITECTURES:
            self.template = _decoder_template(md) if embedder.gguf else (
                QWEN3_RERANK_PREFIX, f"<Instruct>: {QWEN3_RERANK_INSTRUCTION}\n<Query>: {{query}}\n<Document>: "
                                     "{document}", QWEN3_RERANK_SUFFIX)
        self._specials = _gguf_pair_specials(md) if embedder.gguf and self.template is None else None

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
        if self.template is not None:
            return self._prompt_tokens(query, documents, truncate), None
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

    def _prompt_tokens(self, query: str, documents: Sequence[str], truncate: bool) -> list[list[int]]:
        """A decoder reranker's prompt ids of each pair: head, middle (query and document in), tail."""
        tk = self.embedder.tokenizer.backend
        head, middle, tail = self.template  # type: ignore[misc]
        head_ids = tk.encode(head, add_special_tokens=False).ids if head else []
        tail_ids = tk.encode(tail, add_special_tokens=False).ids if tail else []
        room = self.limit - len(head_ids) - len(tail_ids)
        out = []
        for i, doc in enumerate(documents):
            if not isinstance(doc, str) or not doc:
                raise InvalidRequestError(f"document {i} must be a non-empty string, not {doc!r:.60}")
            # llama.cpp's order: the query first, then the document (string_replace_all)
            ids = tk.encode(middle.replace("{query}", query).replace("{document}", doc), add_special_tokens=False).ids
            if len(ids) > room:
                if not truncate:
                    raise InvalidRequestError(f"document {i} with the query makes a prompt of "
                                              f"{len(ids) + len(head_ids) + len(tail_ids)} tokens, more than the "
                                              f"model's {self.limit}; shorten it or let it be truncated "
                                              "(truncate: true)")
                if room < 1:
                    raise InvalidRequestError(f"the model's context leaves no room for document {i}")
                ids = ids[:room]  # the card's truncation of the middle string: its end goes first
            out.append(head_ids + list(ids) + tail_ids)
        return out

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


def _decoder_template(md: Any) -> tuple[str, str, str]:
    """A reranker GGUF's prompt: ``tokenizer.chat_template.rerank`` as ``("", template, "")`` (cut after the
    document where it is too long, the tail kept). Raises WeightsError for a file without one."""
    template = md.get("tokenizer.chat_template.rerank")
    if not isinstance(template, str) or "{document}" not in template:
        raise WeightsError("a decoder reranker's GGUF holds its prompt as tokenizer.chat_template.rerank, with "
                           "{query} and {document}; this one has none")
    at = template.index("{document}") + len("{document}")
    return "", template[:at], template[at:]


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
