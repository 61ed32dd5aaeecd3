"""XLM-RoBERTa embedders and rerankers (issue 64: bge-m3, bge-reranker-v2-m3) against their oracles. A SentencePiece
Unigram model trained by ``sentencepiece`` on the test corpus, saved as XLM-R ships it (``sentencepiece.bpe.model``,
and the ``tokenizer.json`` transformers' ``XLMRobertaTokenizer`` converts from it); a small random transformers
``XLMRobertaModel`` (hidden 64, 2 layers, positions from ``pad_token_id + 1``, one token type) in sentence-transformers'
layout with CLS pooling and ``Normalize`` (as bge-m3), and an ``XLMRobertaForSequenceClassification`` (one label, as
bge-reranker-v2-m3); llama.cpp's converter makes their GGUF files (``bert`` with a ``t5`` Unigram vocabulary).

Bounds: cosine similarity at least 0.9999 for every vector (float32), every rerank score within 1e-4; token ids equal
to the oracle's.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
import pytest

import mlx_engine
from tests.hf_gguf import convert, llama_cpp_embeddings, llama_cpp_rank, peaked
from tests.test_embeddings import COSINE, CORPUS, TEXTS, cosines
from tests.test_rerank import BOUND, DOCS, QUERY


def _tokenizer(folder: Path) -> int:
    """A Unigram SentencePiece model trained on the corpus and the test texts, saved in ``folder`` (created) with the
    tokenizer.json transformers converts from it; returns the vocabulary size (fairseq's four specials, the pieces,
    ``<mask>``)."""
    import sentencepiece as spm
    from transformers import XLMRobertaTokenizer

    folder.mkdir(parents=True)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter([CORPUS] * 8 + TEXTS + [QUERY]), model_writer=model,
                                   model_type="unigram", vocab_size=120, hard_vocab_limit=False, minloglevel=2)
    (folder / "sentencepiece.bpe.model").write_bytes(model.getvalue())
    tk = XLMRobertaTokenizer.from_pretrained(str(folder))
    tk.save_pretrained(folder)
    return len(tk)


def _config(vocab: int, **extra):
    from transformers import XLMRobertaConfig

    # bge-m3's shape in small: pad 1, positions from 2, one token type, layer norm epsilon 1e-5
    return XLMRobertaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=128, max_position_embeddings=130, pad_token_id=1, type_vocab_size=1,
                            layer_norm_eps=1e-5, **extra)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    import torch
    from transformers import XLMRobertaForSequenceClassification, XLMRobertaModel

    root = tmp_path_factory.mktemp("xlmr")
    m3 = root / "m3"
    vocab = _tokenizer(m3)
    torch.manual_seed(0)
    model = XLMRobertaModel(_config(vocab), add_pooling_layer=False).eval()
    peaked(model, scale=1.0)
    model.save_pretrained(m3)
    (m3 / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (m3 / "1_Pooling").mkdir()
    (m3 / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                             "pooling_mode_cls_token": True}))
    (m3 / "2_Normalize").mkdir()
    rr = root / "rr"
    _tokenizer(rr)
    model = XLMRobertaForSequenceClassification(_config(vocab, num_labels=1)).eval()
    peaked(model, scale=1.0, seed=1)
    model.save_pretrained(rr)
    return {"m3": m3, "m3.f32": convert(m3, root / "m3.gguf", "f32"),
            "rr": rr, "rr.f32": convert(rr, root / "rr.gguf", "f32")}


def test_embeddings(made):
    """Folder against sentence-transformers; the converter's GGUF against llama.cpp and sentence-transformers."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(made["m3"]), device="cpu")
    ref = st.encode(TEXTS)
    folder = mlx_engine.load(str(made["m3"]))
    assert (folder.architecture, folder.pooling, folder.dim, folder.context_length) == ("xlm-roberta", "cls", 64, 128)
    assert folder.tokenize(TEXTS) == [st.tokenizer(t)["input_ids"] for t in TEXTS]
    ours = folder.embed(TEXTS)
    assert cosines(ours, ref).min() >= COSINE, cosines(ours, ref)
    alone = np.concatenate([folder.embed([t]) for t in TEXTS])  # padding is masked, positions do not move
    assert np.abs(ours - alone).max() < 1e-5
    gguf = mlx_engine.load(str(made["m3.f32"]))
    assert (gguf.architecture, gguf.pooling) == ("bert", "cls")
    ours = gguf.embed(TEXTS)
    theirs, tokens = llama_cpp_embeddings(made["m3.f32"], TEXTS)
    assert gguf.tokenize(TEXTS) == tokens == folder.tokenize(TEXTS)
    assert cosines(ours, theirs).min() >= COSINE, cosines(ours, theirs)
    assert cosines(ours, ref).min() >= COSINE, cosines(ours, ref)

def test_position_offset_matters(made, monkeypatch):
    """Positions counted from row 0 of the table instead of ``pad_token_id + 1`` fall outside the bound: the test
    above can see the offset."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    from mlx_engine.models.arch import bert

    monkeypatch.setattr(bert, "position_offset", lambda config: 0)
    wrong = mlx_engine.load(str(made["m3"])).embed(TEXTS)
    ref = SentenceTransformer(str(made["m3"]), device="cpu").encode(TEXTS)
    assert cosines(wrong, ref).min() < COSINE, cosines(wrong, ref)


def test_rerank(made):
    """Folder against ``CrossEncoder.predict`` (raw logits and sigmoid); GGUF against llama.cpp's rank pooling."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(str(made["rr"]), device="cpu")
    pairs = [(QUERY, d) for d in DOCS]
    ref = ce.predict(pairs, activation_fn=torch.nn.Identity())
    model = mlx_engine.load(str(made["rr"]))
    assert model.reranker is not None and model.architecture == "xlm-roberta"
    ids, _ = model.reranker.pair_tokens(QUERY, DOCS)
    assert ids == [ce.tokenizer(QUERY, d)["input_ids"] for d in DOCS]  # <s> q </s></s> d </s>
    raw = {r["index"]: r["relevance_score"] for r in model.rerank(QUERY, DOCS, normalize=False)}
    got = np.array([raw[i] for i in range(len(DOCS))])
    assert np.abs(got - ref).max() < BOUND, (got, ref)
    sig = {r["index"]: r["relevance_score"] for r in model.rerank(QUERY, DOCS)}
    assert max(abs(sig[i] - s) for i, s in enumerate(ce.predict(pairs))) < BOUND
    gguf = mlx_engine.load(str(made["rr.f32"]))
    theirs, tokens = llama_cpp_rank(made["rr.f32"], QUERY, DOCS)
    assert gguf.reranker.pair_tokens(QUERY, DOCS)[0] == tokens == ids
    raw = {r["index"]: r["relevance_score"] for r in gguf.rerank(QUERY, DOCS, normalize=False)}
    got = np.array([raw[i] for i in range(len(DOCS))])
    assert np.abs(got - theirs).max() < BOUND, (got, theirs)
    # XLM-R's converter keeps the whole head and XLM-R has one token type: the GGUF scores are the folder's too
    assert np.abs(got - ref).max() < BOUND, (got, ref)
