"""nomic-bert (nomic-embed-text) proven on llama.cpp (issue 64): transformers has no nomic-bert class and no model
hub is reachable, so a small random nomic-bert GGUF is written with gguf-py's writer in the key and tensor layout that
llama.cpp's converter writes for ``NomicBertModel`` (``conversion/bert.py``: fused ``attn_qkv``, SwiGLU
``ffn_gate`` / ``ffn_up`` / ``ffn_down`` without biases, no position table, ``rope.freq_base``, mean pooling,
``attention.causal`` false, a WordPiece vocabulary in llama.cpp's phantom-space form). Ours against llama.cpp's own
embeddings (``Llama(embedding=True).embed``) on that file: cosine similarity at least 0.9999, token ids equal.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import mlx_engine
from tests.hf_gguf import llama_cpp_embeddings
from tests.test_embeddings import COSINE, TEXTS, cosines, write_wordpiece

D, FF, LAYERS, HEADS, CONTEXT = 64, 128, 2, 4, 128


def _write(path: Path, folder: Path) -> None:
    import gguf

    ids = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]
    vocab = sorted(ids, key=ids.get)
    special = {t for t in vocab if t.startswith("[") and t.endswith("]")}
    # llama.cpp's phantom-space vocabulary (BertModel.set_vocab): word starts get U+2581, "##" pieces lose it
    tokens = [t if t in special else t[2:] if t.startswith("##") else "\u2581" + t for t in vocab]
    types = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in vocab]
    w = gguf.GGUFWriter(str(path), "nomic-bert")
    w.add_context_length(CONTEXT)
    w.add_embedding_length(D)
    w.add_feed_forward_length(FF)
    w.add_block_count(LAYERS)
    w.add_head_count(HEADS)
    w.add_layer_norm_eps(1e-12)
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType.MEAN)
    w.add_rope_freq_base(1000.0)
    w.add_token_type_count(2)
    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre("bert-bge")
    w.add_token_list(tokens)
    w.add_token_types(types)
    for key, token in (("bos", "[CLS]"), ("sep", "[SEP]"), ("unk", "[UNK]"), ("pad", "[PAD]"), ("mask", "[MASK]")):
        getattr(w, f"add_{key}_token_id")(vocab.index(token))
    rng = np.random.default_rng(0)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)

    w.add_tensor("token_embd.weight", matrix(len(vocab), D) * 4)
    w.add_tensor("token_types.weight", matrix(2, D))
    w.add_tensor("token_embd_norm.weight", norm())
    w.add_tensor("token_embd_norm.bias", (0.1 * rng.standard_normal(D)).astype(np.float32))
    for i in range(LAYERS):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_qkv.weight", matrix(3 * D, D) * 2)
        w.add_tensor(p + "attn_output.weight", matrix(D, D))
        w.add_tensor(p + "ffn_up.weight", matrix(FF, D))
        w.add_tensor(p + "ffn_gate.weight", matrix(FF, D))
        w.add_tensor(p + "ffn_down.weight", matrix(D, FF))
        for name in ("attn_output_norm", "layer_output_norm"):
            w.add_tensor(p + name + ".weight", norm())
            w.add_tensor(p + name + ".bias", (0.1 * rng.standard_normal(D)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def nomic(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("nomic")
    write_wordpiece(root / "tok")
    _write(root / "nomic.gguf", root / "tok")
    return root / "nomic.gguf"


def test_against_llama_cpp(nomic):
    model = mlx_engine.load(str(nomic))
    assert (model.architecture, model.pooling, model.dim) == ("nomic-bert", "mean", D)
    ours = model.embed(TEXTS)
    theirs, tokens = llama_cpp_embeddings(nomic, TEXTS)
    assert model.tokenize(TEXTS) == tokens
    assert cosines(ours, theirs).min() >= COSINE, cosines(ours, theirs)
    # RoPE and the SwiGLU MLP matter: a position-blind or plain-GELU model would not agree this closely
    assert cosines(ours[:1], theirs[1:2]).min() < 0.99
