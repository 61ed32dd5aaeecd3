"""EmbeddingGemma (issue 64): Gemma 3 text attending both ways within a two-way sliding window, mean pooling, two
``Dense`` modules, ``Normalize``, its query / document prompts, against its oracles.

A small random transformers ``Gemma3TextModel`` (hidden 64, five sliding layers and a global one, ``use_bidirectional_attention``,
``sliding_window`` 8: a token sees ``|q - k| <= 4``, fewer than every text's tokens, so the window matters) with
smollm2's real BPE tokenizer, saved by sentence-transformers' own classes in EmbeddingGemma's layout (``1_Pooling``
mean, ``2_Dense`` 64 -> 128 and ``3_Dense`` 128 -> 64 without bias or activation, ``4_Normalize``, EmbeddingGemma's
prompts); llama.cpp's converter writes its GGUF (``gemma-embedding``, the Dense modules included). Ours against
``SentenceTransformer.encode`` on the folder and the GGUF, and against llama.cpp's own embeddings on the GGUF: cosine
similarity at least 0.9999 (float32) for every vector. The negative control drops the window's far end (the cache's
``set_causal`` before this issue): the vectors then leave sentence-transformers'.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import mlx_engine
from mlx_engine.kvcache.causal import CausalCache
from tests.hf_gguf import convert, llama_cpp_embeddings, peaked, save_tokenizer
from tests.test_embeddings import COSINE, TEXTS, cosines

#: EmbeddingGemma's ``config_sentence_transformers.json`` prompts (two of them).
PROMPTS = {"query": "task: search result | query: ", "document": "title: none | text: "}
WINDOW = 8


def _write(folder: Path, smollm2_gguf: Path) -> None:
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as st_modules
    from tokenizers import Tokenizer
    from transformers import Gemma3TextConfig, Gemma3TextModel

    base = folder.parent / "base"
    base.mkdir(parents=True)
    save_tokenizer(smollm2_gguf, base)
    vocab = Tokenizer.from_file(str(base / "tokenizer.json")).get_vocab_size()
    # six layers: Gemma 3's pattern (five sliding, one global), which llama.cpp's gemma-embedding assumes
    config = Gemma3TextConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, intermediate_size=128, query_pre_attn_scalar=16,
                              max_position_embeddings=512, sliding_window=WINDOW, use_bidirectional_attention=True)
    torch.manual_seed(0)
    model = Gemma3TextModel(config).eval()
    peaked(model, scale=1.0)
    model.save_pretrained(base)
    transformer = SentenceTransformer(str(base), device="cpu")  # Transformer, then mean Pooling
    first = st_modules.Dense(64, 128, bias=False, activation_function=torch.nn.Identity())
    second = st_modules.Dense(128, 64, bias=False, activation_function=torch.nn.Identity())
    for dense in (first, second):
        torch.nn.init.normal_(dense.linear.weight, std=0.3)
    st = SentenceTransformer(modules=[*transformer, first, second, st_modules.Normalize()], device="cpu",
                             prompts=PROMPTS)
    st.save(str(folder))
    # EmbeddingGemma's own file: the saver's would also list a chat "message" modality, which formats every text
    # through smollm2's chat template
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 2048, "do_lower_case": False}))


@pytest.fixture(scope="module")
def made(tmp_path_factory, smollm2_gguf) -> dict[str, Path]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    root = tmp_path_factory.mktemp("embgemma")
    _write(root / "hf", smollm2_gguf)
    # smollm's pre-tokenizer, as for Qwen3-Embedding's test: the converter's hash list does not know this vocabulary
    return {"hf": root / "hf", "f32": convert(root / "hf", root / "f32.gguf", "f32", pre="smollm",
                                              options=("--sentence-transformers-dense-modules",))}


@pytest.fixture(scope="module")
def st(made):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(made["hf"]), device="cpu")


def test_folder_against_sentence_transformers(made, st):
    assert json.loads((made["hf"] / "config.json").read_text())["sliding_window"] == WINDOW
    model = mlx_engine.load(str(made["hf"]))
    assert isinstance(model, mlx_engine.EmbeddingModel)
    assert (model.architecture, model.pooling, model.dim) == ("gemma3", "mean", 64)
    ids = model.tokenize(TEXTS)
    assert ids == [st.tokenizer(t)["input_ids"] for t in TEXTS] and max(map(len, ids)) > WINDOW + 1
    ours = model.embed(TEXTS)
    assert cosines(ours, st.encode(TEXTS)).min() >= COSINE, cosines(ours, st.encode(TEXTS))
    for name in PROMPTS:
        got = cosines(model.embed(TEXTS, prompt_name=name), st.encode(TEXTS, prompt_name=name))
        assert got.min() >= COSINE, (name, got)
    alone = np.concatenate([model.embed([t]) for t in TEXTS])  # packed inputs do not see each other
    assert np.abs(ours - alone).max() < 1e-5


def test_window_far_end_matters(made, st, monkeypatch):
    """The negative control: without the two-way window's upper bound (a token seeing every later token of its
    input, the lower bound alone) the vectors leave sentence-transformers'."""
    monkeypatch.setattr(CausalCache, "_sees_to", lambda self, p: None)
    model = mlx_engine.load(str(made["hf"]))
    assert cosines(model.embed(TEXTS), st.encode(TEXTS)).min() < 0.99


def test_gguf_against_sentence_transformers_and_llama_cpp(made, st):
    model = mlx_engine.load(str(made["f32"]))
    assert (model.architecture, model.pooling, model.dim) == ("gemma3", "mean", 64)
    ours = model.embed(TEXTS)
    theirs, tokens = llama_cpp_embeddings(made["f32"], TEXTS)
    assert model.tokenize(TEXTS) == tokens
    assert cosines(ours, theirs).min() >= COSINE, cosines(ours, theirs)
    assert cosines(ours, st.encode(TEXTS)).min() >= COSINE, cosines(ours, st.encode(TEXTS))
