"""Decoder embedders (issue 64): Qwen3-Embedding's layout against its oracles. A small random transformers
``Qwen3Model`` (hidden 64, 2 layers, grouped-query attention) with smollm2's real BPE tokenizer, made to append
``<|endoftext|>`` to every text as Qwen3-Embedding's tokenizer does, saved in sentence-transformers' layout (last-token
pooling, ``Normalize``, Qwen3-Embedding's query instruction as the ``query`` prompt); llama.cpp's converter makes its
GGUF (``qwen3.pooling_type`` 3, from the folder's pooling config). Ours against sentence-transformers on the folder and
on the GGUF, and against llama.cpp's own embeddings (``Llama(embedding=True).embed``) on the GGUF: cosine similarity
at least 0.9999 for every vector.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import mlx_engine
from tests.hf_gguf import convert, llama_cpp_embeddings, peaked, save_tokenizer
from tests.test_embeddings import COSINE, TEXTS, cosines

QUERY = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"


def _write(folder: Path, smollm2_gguf: Path) -> None:
    import torch
    from tokenizers import Tokenizer, processors
    from transformers import Qwen3Config, Qwen3Model

    folder.mkdir(parents=True)
    save_tokenizer(smollm2_gguf, folder)
    path = folder / "tokenizer.json"
    tk = Tokenizer.from_file(str(path))
    eot = tk.token_to_id("<|endoftext|>")
    tk.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>", pair="$A $B <|endoftext|>",
                                                      special_tokens=[("<|endoftext|>", eot)])
    tk.save(str(path))
    config = Qwen3Config(vocab_size=tk.get_vocab_size(), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=512,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen3Model(config).eval()
    peaked(model, scale=1.0)
    model.save_pretrained(folder)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                  "pooling_mode_lasttoken": True}))
    (folder / "2_Normalize").mkdir()
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512}))
    (folder / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": QUERY, "document": ""}, "default_prompt_name": None}))


@pytest.fixture(scope="module")
def made(tmp_path_factory, smollm2_gguf) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen3-embed")
    _write(root / "hf", smollm2_gguf)
    # smollm's pre-tokenizer: the appended <|endoftext|> changes the converter's hash of it (as for the real model)
    return {"hf": root / "hf", "f32": convert(root / "hf", root / "f32.gguf", "f32", pre="smollm")}


@pytest.fixture(scope="module")
def st(made):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(made["hf"]), device="cpu")


def test_folder_against_sentence_transformers(made, st):
    model = mlx_engine.load(str(made["hf"]))
    assert isinstance(model, mlx_engine.EmbeddingModel)
    assert (model.architecture, model.pooling, model.dim) == ("qwen3", "last", 64)
    ids = model.tokenize(TEXTS)
    assert ids == [st.tokenizer(t)["input_ids"] for t in TEXTS] and all(x[-1] == ids[0][-1] for x in ids)
    ours = model.embed(TEXTS)
    assert cosines(ours, st.encode(TEXTS)).min() >= COSINE
    query = model.embed(TEXTS, prompt_name="query")
    assert cosines(query, st.encode(TEXTS, prompt_name="query")).min() >= COSINE
    alone = np.concatenate([model.embed([t]) for t in TEXTS])  # packed inputs do not see each other
    assert np.abs(ours - alone).max() < 1e-5


def test_gguf_against_sentence_transformers_and_llama_cpp(made, st):
    model = mlx_engine.load(str(made["f32"]))
    assert (model.architecture, model.pooling) == ("qwen3", "last")
    ours = model.embed(TEXTS)
    theirs, tokens = llama_cpp_embeddings(made["f32"], TEXTS)
    assert model.tokenize(TEXTS) == tokens
    assert cosines(ours, theirs).min() >= COSINE, cosines(ours, theirs)
    assert cosines(ours, st.encode(TEXTS)).min() >= COSINE
