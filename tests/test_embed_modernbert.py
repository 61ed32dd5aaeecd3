"""ModernBERT embedders (issue 64) against their oracles. A small random transformers ``ModernBertModel`` (hidden 64,
3 layers: layer 0 global, 1 and 2 local; a local window of 8 keys each way, so that the test texts reach past it;
its two RoPE bases apart) with smollm2's real BPE tokenizer made to put ``<|im_start|>`` and ``<|im_end|>`` around
each text (ModernBERT's own puts ``[CLS]`` and ``[SEP]``), saved in sentence-transformers' layout (mean pooling,
``Normalize``); llama.cpp's converter makes its GGUF. The pinned converter writes the layer norms' epsilon as
``modern-bert.attention.layer_norm_rms_epsilon``, which its own loader does not read (it wants
``layer_norm_epsilon`` and refuses the file): llama.cpp runs a copy with the key named as its loader reads it. Ours against sentence-transformers on the folder and the GGUF,
and against llama.cpp's embeddings on the GGUF: cosine similarity at least 0.9999 for every vector.
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

# one text longer than the global layer's reach of a local window (16 keys): the window must be right
LONG = TEXTS + [" ".join(TEXTS * 2)]


@pytest.fixture(scope="module")
def made(tmp_path_factory, smollm2_gguf) -> dict[str, Path]:
    import torch
    from transformers import ModernBertModel

    root = tmp_path_factory.mktemp("modernbert")
    folder = root / "hf"
    config = small_config(smollm2_gguf, folder)
    torch.manual_seed(0)
    model = ModernBertModel(config).eval()
    peaked(model, scale=1.0)
    model.save_pretrained(folder)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                  "pooling_mode_mean_tokens": True}))
    (folder / "2_Normalize").mkdir()
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512}))
    f32 = convert(folder, root / "f32.gguf", "f32", pre="smollm")
    return {"hf": folder, "f32": f32, "llama.cpp": with_eps_key(f32, root / "f32-eps.gguf")}


def small_config(smollm2_gguf: Path, folder: Path, **extra):
    """The test's ``ModernBertConfig`` (``extra`` keys beside), its tokenizer saved in ``folder`` (created): smollm2's,
    putting ``<|im_start|>`` and ``<|im_end|>`` around a text and ``<|im_start|> A <|im_end|> B <|im_end|>`` around a
    pair, as ModernBERT's own puts ``[CLS]`` and ``[SEP]``; without smollm2's chat template, as ModernBERT's (a
    ``CrossEncoder`` would put a pair through a template)."""
    from tokenizers import Tokenizer, processors
    from transformers import ModernBertConfig

    folder.mkdir()
    save_tokenizer(smollm2_gguf, folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    path = folder / "tokenizer.json"
    tk = Tokenizer.from_file(str(path))
    first, last = tk.token_to_id("<|im_start|>"), tk.token_to_id("<|im_end|>")
    tk.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A <|im_end|>", pair="<|im_start|> $A <|im_end|> $B <|im_end|>",
        special_tokens=[("<|im_start|>", first), ("<|im_end|>", last)])
    tk.save(str(path))
    return ModernBertConfig(vocab_size=tk.get_vocab_size(), hidden_size=64, intermediate_size=96,
                            num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=512,
                            local_attention=16, global_attn_every_n_layers=3, global_rope_theta=160000.0,
                            local_rope_theta=10000.0, pad_token_id=0, bos_token_id=first, eos_token_id=last,
                            cls_token_id=first, sep_token_id=last, **extra)


def with_eps_key(src: Path, out: Path) -> Path:
    """A copy of ``src`` with ``layer_norm_epsilon`` beside the converter's ``layer_norm_rms_epsilon``."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    reader = gguf.GGUFReader(src)
    eps = reader.fields["modern-bert.attention.layer_norm_rms_epsilon"].contents()
    writer = gguf.GGUFWriter(out, arch="modern-bert", endianess=reader.endianess)
    key = MetadataDetails(gguf.GGUFValueType.FLOAT32, eps)
    copy_with_new_metadata(reader, writer, {"modern-bert.attention.layer_norm_epsilon": key}, [])
    return out


@pytest.fixture(scope="module")
def st(made):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(made["hf"]), device="cpu")


def test_folder_against_sentence_transformers(made, st):
    model = mlx_engine.load(str(made["hf"]))
    assert (model.architecture, model.pooling, model.dim) == ("modernbert", "mean", 64)
    ids = model.tokenize(LONG)
    assert ids == [st.tokenizer(t)["input_ids"] for t in LONG] and len(ids[-1]) > 40
    ours = model.embed(LONG)
    assert cosines(ours, st.encode(LONG)).min() >= COSINE, cosines(ours, st.encode(LONG))
    alone = np.concatenate([model.embed([t]) for t in LONG])  # padding hidden from every layer
    assert np.abs(ours - alone).max() < 1e-5


def test_gguf_against_sentence_transformers_and_llama_cpp(made, st):
    model = mlx_engine.load(str(made["f32"]))
    assert model.architecture == "modern-bert"
    ours = model.embed(LONG)
    theirs, tokens = llama_cpp_embeddings(made["llama.cpp"], LONG)
    assert model.tokenize(LONG) == tokens
    assert cosines(ours, theirs).min() >= COSINE, cosines(ours, theirs)
    assert cosines(ours, st.encode(LONG)).min() >= COSINE
