"""Reranking (issue 64) against its oracles: a small random transformers ``BertForSequenceClassification`` (hidden 64,
2 layers, one label, distinct token-type rows) with a trained WordPiece tokenizer, saved as sentence-transformers'
``CrossEncoder`` reads it; llama.cpp's converter makes its GGUF. Ours on the folder against ``CrossEncoder.predict``
(raw logits and its default sigmoid), ours on the GGUF against llama.cpp's rank pooling (``Llama(embedding=True,
pooling_type=LLAMA_POOLING_TYPE_RANK)``, pairs as its server's ``format_prompt_rerank`` puts them): every score within
1e-4. llama.cpp's converter drops BERT's pooler and llama.cpp gives every token type 0, so the GGUF's scores are
llama.cpp's, not the folder's: both are checked apart.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import mlx_engine
from mlx_engine.errors import InvalidRequestError
from tests.hf_gguf import convert, llama_cpp_rank, peaked
from tests.test_embeddings import TEXTS, write_wordpiece

QUERY = "where does the farmer walk"
DOCS = TEXTS + ["the old oak tree"]
BOUND = 1e-4


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    root = tmp_path_factory.mktemp("rerank")
    vocab = write_wordpiece(root / "hf")
    config = BertConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=128, num_labels=1)
    torch.manual_seed(0)
    model = BertForSequenceClassification(config).eval()
    peaked(model, scale=1.0)
    model.save_pretrained(root / "hf")
    return {"hf": root / "hf", "f32": convert(root / "hf", root / "f32.gguf", "f32", pre="bert-bge")}


def test_folder_against_cross_encoder(made):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(str(made["hf"]), device="cpu")
    pairs = [(QUERY, d) for d in DOCS]
    model = mlx_engine.load(str(made["hf"]))
    raw = model.rerank(QUERY, DOCS, normalize=False)
    ref = ce.predict(pairs, activation_fn=torch.nn.Identity())
    assert [r["index"] for r in raw] == list(np.argsort(-ref))
    got = np.array([r["relevance_score"] for r in sorted(raw, key=lambda r: r["index"])])
    assert np.abs(got - ref).max() < BOUND, (got, ref)
    top = model.rerank(QUERY, DOCS, top_n=2)  # CrossEncoder's default: a sigmoid on the one logit
    sig = ce.predict(pairs)
    assert len(top) == 2 and all(abs(r["relevance_score"] - sig[r["index"]]) < BOUND for r in top)
    assert top[0]["relevance_score"] >= top[1]["relevance_score"]
    with pytest.raises(InvalidRequestError, match="a reranker .* not an embedding model"):
        model.embed(["a"])
    with pytest.raises(InvalidRequestError, match="document 1 must be a non-empty string"):
        model.rerank(QUERY, ["a", ""])


def test_gguf_against_llama_cpp(made):
    model = mlx_engine.load(str(made["f32"]))
    ours = {r["index"]: r["relevance_score"] for r in model.rerank(QUERY, DOCS, normalize=False)}
    theirs, tokens = llama_cpp_rank(made["f32"], QUERY, DOCS)
    assert model.reranker.pair_tokens(QUERY, DOCS)[0] == tokens
    got = np.array([ours[i] for i in range(len(DOCS))])
    assert np.abs(got - theirs).max() < BOUND, (got, theirs)


def test_embedder_does_not_rerank(made, tmp_path):
    from tests.test_embeddings import _write

    _write(tmp_path / "e", "mean", True, 128, 0)
    with pytest.raises(InvalidRequestError, match="an embedding model, not a reranker"):
        mlx_engine.load(str(tmp_path / "e")).rerank(QUERY, DOCS)


def test_server_routes(made):
    """``/v1/rerank`` and ``/rerank`` in llama.cpp's, Jina's and Cohere's shape, the same scores as the API."""
    import httpx

    from mlx_engine.server import ServerConfig
    from tests.test_server import RunningServer, free_port

    srv = RunningServer(ServerConfig(port=free_port(), models_dirs=[str(made["hf"].parent)]))
    try:
        want = mlx_engine.load(str(made["hf"])).rerank(QUERY, DOCS)
        body = {"model": str(made["hf"]), "query": QUERY, "documents": DOCS}
        got = httpx.post(srv.url + "/v1/rerank", json=body, timeout=60).json()
        assert [r["index"] for r in got["results"]] == [r["index"] for r in want]
        assert max(abs(a["relevance_score"] - b["relevance_score"]) for a, b in zip(got["results"], want)) < 1e-6
        assert got["usage"]["prompt_tokens"] > 0 and "document" not in got["results"][0]
        two = httpx.post(srv.url + "/rerank", json={**body, "top_n": 2, "return_documents": True,
                                                     "documents": [{"text": d} for d in DOCS]}, timeout=60).json()
        assert [r["index"] for r in two["results"]] == [r["index"] for r in want[:2]]
        assert two["results"][0]["document"] == {"text": DOCS[want[0]["index"]]}
        bad = httpx.post(srv.url + "/v1/rerank", json={**body, "documents": []}, timeout=60)
        assert bad.status_code == 400 and "documents is empty" in bad.text
        refused = httpx.post(srv.url + "/v1/embeddings", json={"model": str(made["hf"]), "input": "a"}, timeout=60)
        assert refused.status_code == 400 and "a reranker" in refused.text
    finally:
        srv.stop()
