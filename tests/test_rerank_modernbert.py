"""ModernBERT cross-encoders (issue 64: gte-reranker-modernbert-base, the ms-marco ModernBERT rerankers) against their
oracles. Two small random transformers ``ModernBertForSequenceClassification`` models (one label; the encoder of
tests/test_embed_modernbert.py: 3 layers, a 16-key local window that the long document overflows), one pooling by
``cls`` and one by ``mean`` before the head, with smollm2's real tokenizer putting ``<|im_start|>`` / ``<|im_end|>``
around a pair as ModernBERT's own puts ``[CLS]`` / ``[SEP]``; llama.cpp's converter makes their GGUF files
(llama.cpp runs the copy with the epsilon key its loader reads, as in that module). Ours on the folder against
sentence-transformers' ``CrossEncoder.predict`` (raw logits and its default sigmoid); ours on the GGUF against
``CrossEncoder`` too (llama.cpp's pair is the tokenizer's here) and against llama.cpp's rank pooling
(``LLAMA_POOLING_TYPE_RANK``, pairs as its server's ``format_prompt_rerank`` puts them), ours then with llama.cpp's
float16-table GELU in place of the model's exact one (docs/embeddings.md has the figures with either GELU):
every score within 1e-4.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import mlx_engine
from tests.hf_gguf import convert, llama_cpp_rank, peaked
from tests.test_embed_modernbert import small_config, with_eps_key
from tests.test_embeddings import TEXTS

QUERY = "where does the farmer walk"
DOCS = TEXTS + ["the old oak tree", " ".join(TEXTS * 2)]  # the last pair reaches past the local window
BOUND = 1e-4
POOLINGS = ("cls", "mean")


@pytest.fixture(scope="module")
def made(tmp_path_factory, smollm2_gguf) -> dict[str, dict[str, Path]]:
    import torch
    from transformers import ModernBertForSequenceClassification

    root = tmp_path_factory.mktemp("modernbert-rerank")
    out = {}
    for pooling in POOLINGS:
        folder = root / pooling
        config = small_config(smollm2_gguf, folder, num_labels=1, classifier_pooling=pooling)
        torch.manual_seed(0)
        model = ModernBertForSequenceClassification(config).eval()
        peaked(model, scale=1.0)
        model.save_pretrained(folder)
        f32 = convert(folder, root / f"{pooling}.gguf", "f32", pre="smollm")
        out[pooling] = {"hf": folder, "f32": f32, "llama.cpp": with_eps_key(f32, root / f"{pooling}-eps.gguf")}
    return out


@pytest.mark.parametrize("pooling", POOLINGS)
def test_folder_against_cross_encoder(made, pooling):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(str(made[pooling]["hf"]), device="cpu")
    pairs = [(QUERY, d) for d in DOCS]
    model = mlx_engine.load(str(made[pooling]["hf"]))
    assert model.reranker.embedder.encoder.rank_pooling == pooling
    ids, _ = model.reranker.pair_tokens(QUERY, DOCS)
    assert ids == [ce.tokenizer(QUERY, d)["input_ids"] for d in DOCS] and len(ids[-1]) > 40
    raw = model.rerank(QUERY, DOCS, normalize=False)
    ref = ce.predict(pairs, activation_fn=torch.nn.Identity())
    got = np.array([r["relevance_score"] for r in sorted(raw, key=lambda r: r["index"])])
    assert np.abs(got - ref).max() < BOUND, (got, ref)
    assert [r["index"] for r in raw] == list(np.argsort(-ref))
    sig = ce.predict(pairs)  # CrossEncoder's default for one label: a sigmoid
    top = model.rerank(QUERY, DOCS, top_n=2)
    assert len(top) == 2 and all(abs(r["relevance_score"] - sig[r["index"]]) < BOUND for r in top)


@pytest.mark.parametrize("pooling", POOLINGS)
def test_gguf_against_cross_encoder_and_llama_cpp(made, pooling, monkeypatch):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from sentence_transformers import CrossEncoder

    from mlx_engine.mlx.tensor import MLXTensor

    model = mlx_engine.load(str(made[pooling]["f32"]))
    assert model.reranker.embedder.encoder.rank_pooling == pooling  # modern-bert.classifier.pooling_type
    ids = model.reranker.pair_tokens(QUERY, DOCS)[0]
    ce = CrossEncoder(str(made[pooling]["hf"]), device="cpu")
    assert ids == [ce.tokenizer(QUERY, d)["input_ids"] for d in DOCS]  # llama.cpp's pair is the tokenizer's here
    got = np.array([r["relevance_score"] for r in sorted(model.rerank(QUERY, DOCS, normalize=False),
                                                          key=lambda r: r["index"])])
    ref = ce.predict([(QUERY, d) for d in DOCS], activation_fn=torch.nn.Identity())
    assert np.abs(got - ref).max() < BOUND, (got, ref)
    theirs, tokens = llama_cpp_rank(made[pooling]["llama.cpp"], QUERY, DOCS)
    assert ids == tokens
    # llama.cpp's GELU is not the model's (up to 8e-4 on these scores): with it in our graph, the rest must agree
    monkeypatch.setattr(MLXTensor, "gelu", _ggml_gelu)
    got = np.array([r["relevance_score"] for r in sorted(model.rerank(QUERY, DOCS, normalize=False),
                                                          key=lambda r: r["index"])])
    assert np.abs(got - theirs).max() < BOUND, (got, theirs)


def _ggml_gelu(self, approximate: bool = False):
    """llama.cpp's CPU GELU and GeGLU (``ggml_vec_gelu_f32`` / ``ggml_vec_geglu_f32`` under ``GGML_GELU_FP16``): the
    input rounded to float16 indexes a float16 table of the tanh form; 0 at or below -10, the input at or above 10."""
    import mlx.core as mx

    from mlx_engine.mlx.tensor import MLXTensor

    x = self.a.astype(mx.float32)
    h = x.astype(mx.float16).astype(mx.float32)
    y = (0.5 * h * (1.0 + mx.tanh(0.7978845608028654 * h * (1.0 + 0.044715 * h * h)))).astype(mx.float16)
    return MLXTensor(mx.where(x <= -10.0, 0.0, mx.where(x >= 10.0, x, y.astype(mx.float32))).astype(self.a.dtype))


def test_server_route(made):
    """``/v1/rerank`` gives the API's scores."""
    import httpx

    from mlx_engine.server import ServerConfig
    from tests.test_server import RunningServer, free_port

    folder = made["mean"]["hf"]
    srv = RunningServer(ServerConfig(port=free_port(), models_dirs=[str(folder.parent)]))
    try:
        want = mlx_engine.load(str(folder)).rerank(QUERY, DOCS)
        got = httpx.post(srv.url + "/v1/rerank", json={"model": str(folder), "query": QUERY, "documents": DOCS},
                         timeout=60).json()
        assert [r["index"] for r in got["results"]] == [r["index"] for r in want]
        assert max(abs(a["relevance_score"] - b["relevance_score"]) for a, b in zip(got["results"], want)) < 1e-6
    finally:
        srv.stop()


@pytest.mark.parametrize("key, value", [("classifier_activation", "silu"), ("classifier_pooling", "max")])
def test_a_head_we_do_not_run_is_refused(made, tmp_path, key, value):
    import json
    import shutil

    from mlx_engine.errors import WeightsError

    folder = shutil.copytree(made["cls"]["hf"], tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(WeightsError, match=f"{key} is '{value}'"):
        mlx_engine.load(str(folder))
