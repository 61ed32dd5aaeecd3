"""sentence-transformers' ``Dense`` modules after pooling (issue 64; EmbeddingGemma's 768 -> 3072 -> 768 head): a
small random BERT folder (tests/test_embeddings.py's) given two ``Dense`` modules by sentence-transformers' own
classes and saver (64 -> 32 with a bias and ``Tanh``, 32 -> 48 without a bias and ``Identity``), then ``Normalize``.
Ours against ``SentenceTransformer.encode``: cosine similarity at least 0.9999 for every vector; a module we do not
run is refused by name.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import mlx_engine
from mlx_engine.errors import UnsupportedError
from tests.test_embeddings import COSINE, TEXTS, _write, cosines


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    root = tmp_path_factory.mktemp("dense")
    _write(root / "bert", "mean", False, 128, 0)
    base = SentenceTransformer(str(root / "bert"), device="cpu")
    torch.manual_seed(0)
    first = models.Dense(64, 32, bias=True, activation_function=torch.nn.Tanh())
    second = models.Dense(32, 48, bias=False, activation_function=torch.nn.Identity())
    for dense in (first, second):
        torch.nn.init.normal_(dense.linear.weight, std=0.5)
    model = SentenceTransformer(modules=[*base, first, second, models.Normalize()], device="cpu")
    model.save(str(root / "st"))
    return root / "st"


def test_dense_against_sentence_transformers(folder):
    from sentence_transformers import SentenceTransformer

    types = [m["type"].rsplit(".", 1)[-1] for m in json.loads((folder / "modules.json").read_text())]
    assert types[2:4] == ["Dense", "Dense"]  # the saver's own layout
    model = mlx_engine.load(str(folder))
    assert model.dim == 48
    ours = model.embed(TEXTS)
    theirs = SentenceTransformer(str(folder), device="cpu").encode(TEXTS)
    assert ours.shape == theirs.shape and cosines(ours, theirs).min() >= COSINE, cosines(ours, theirs)


def test_unknown_module_refused(folder, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    modules = json.loads((bad / "modules.json").read_text())
    modules[2]["type"] = "sentence_transformers.models.LayerNorm"
    (bad / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(UnsupportedError, match="a 'LayerNorm' module"):
        mlx_engine.load(str(bad))
