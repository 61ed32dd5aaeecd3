"""Embeddings (issue 64) against their oracles: sentence-transformers on small random BERT models saved in its own
folder layout with a real WordPiece tokenizer (trained by ``tokenizers``), llama.cpp's converter on those folders and
llama.cpp's own embeddings (``llama-cpp-python``, ``Llama(embedding=True).embed``) on the converted files, and the real
``openai`` and ``ollama`` clients against the server. Every vector must have cosine similarity at least 0.9999 with
the oracle's (float32).

Two models: ``mean`` (mean pooling, then ``Normalize``, as all-MiniLM) and ``cls`` (CLS pooling, no ``Normalize``,
query / document prompts and a 16-token ``max_seq_length``, as bge), hidden 64, 2 layers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mlx_engine
from mlx_engine.errors import InvalidRequestError, UnsupportedError
from tests.doc_examples import blocks, commands
from tests.hf_gguf import convert, llama_cpp_embeddings, peaked, quantize

COSINE = 0.9999
CORPUS = ("The quick brown fox jumps over the lazy dog near the river bank, while a small bird sings in the old oak "
          "tree and the farmer walks slowly home across the wide green field after a long day of honest work.")
TEXTS = ["The quick brown fox jumps over the lazy dog.", "a small bird",
         "Honest work across the wide green field after a long day, the farmer walks home slowly. Zebra!"]
PROMPTS = {"query": "query: ", "document": ""}


def write_wordpiece(folder: Path) -> int:
    """A WordPiece tokenizer trained on :data:`CORPUS` saved in ``folder`` (created) as BertTokenizerFast saves it;
    returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizerFast

    folder.mkdir(parents=True)
    tk = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tk.normalizer = normalizers.BertNormalizer(lowercase=True)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.train_from_iterator([CORPUS] * 4, trainers.WordPieceTrainer(
        vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
    tk.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", tk.token_to_id("[CLS]")), ("[SEP]", tk.token_to_id("[SEP]"))])
    tk.decoder = decoders.WordPiece()
    # padded to a fixed length and cut, as all-MiniLM-L6-v2's tokenizer.json is: the engine must undo both
    tk.enable_padding(pad_id=0, pad_token="[PAD]", length=128)
    tk.enable_truncation(max_length=128)
    BertTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]",
                      cls_token="[CLS]", mask_token="[MASK]", do_lower_case=True).save_pretrained(folder)
    return tk.get_vocab_size()


def _write(folder: Path, pooling: str, normalize: bool, max_seq_length: int, seed: int) -> None:
    """A sentence-transformers folder: a random BertModel (transformers' own class), a WordPiece tokenizer trained on
    :data:`CORPUS`, modules.json, the pooling config, Normalize when asked, and prompts."""
    import torch
    from transformers import BertConfig, BertModel

    vocab = write_wordpiece(folder)
    config = BertConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=128)
    torch.manual_seed(seed)
    model = BertModel(config).eval()
    peaked(model, scale=1.0, seed=seed)
    model.save_pretrained(folder)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir()
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, f"pooling_mode_{'mean_tokens' if pooling == 'mean' else 'cls_token'}": True}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    (folder / "config_sentence_transformers.json").write_text(json.dumps({"prompts": PROMPTS,
                                                                          "default_prompt_name": None}))


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    """The two folders, their llama.cpp-converted GGUF files (F32) and ``mean``'s quantized to Q8_0 by llama.cpp."""
    root = tmp_path_factory.mktemp("embed")
    _write(root / "mean", "mean", True, 128, 0)
    _write(root / "cls", "cls", False, 16, 1)
    made = {"mean": root / "mean", "cls": root / "cls",
            "mean.f32": convert(root / "mean", root / "mean-f32.gguf", "f32", pre="bert-bge"),
            "cls.f32": convert(root / "cls", root / "cls-f32.gguf", "f32", pre="bert-bge")}
    made["mean.q8_0"] = quantize(made["mean.f32"], root / "mean-q8_0.gguf", "Q8_0")
    return made


@pytest.fixture(scope="module")
def st(made):
    """sentence-transformers' models on the two folders (from disk only)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    return {k: SentenceTransformer(str(made[k]), device="cpu") for k in ("mean", "cls")}


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_folders_against_sentence_transformers(made, st):
    for kind in ("mean", "cls"):
        model = mlx_engine.load(str(made[kind]))
        assert isinstance(model, mlx_engine.EmbeddingModel) and model.pooling == kind and model.dim == 64
        ours = model.embed(TEXTS)
        ref = st[kind].encode(TEXTS, normalize_embeddings=True)
        assert ours.dtype == np.float32 and ours.shape == (3, 64)
        assert np.allclose(np.linalg.norm(ours, axis=1), 1, atol=1e-6)
        assert cosines(ours, ref).min() >= COSINE, (kind, cosines(ours, ref))
        assert model.tokenize(TEXTS[:2]) == [st[kind].tokenizer(t)["input_ids"][:16] for t in TEXTS[:2]]
        # unnormalized: as the pipeline pools (no Normalize module in "cls")
        raw = model.embed(TEXTS, normalize=False)
        if kind == "cls":
            assert np.allclose(raw, st[kind].encode(TEXTS), rtol=1e-4, atol=1e-4)
        # Matryoshka: the first 16 components, renormalized (sentence-transformers' truncate_dim, then normalize)
        cut = st[kind].encode(TEXTS, truncate_dim=16, normalize_embeddings=True)
        assert cosines(model.embed(TEXTS, dimensions=16), cut).min() >= COSINE
    # the prompts of config_sentence_transformers.json
    q = model.embed(TEXTS, prompt_name="query")
    assert cosines(q, st["cls"].encode(TEXTS, prompt_name="query")).min() >= COSINE
    assert cosines(q, model.embed(["query: " + t for t in TEXTS])).min() > 0.999999
    with pytest.raises(InvalidRequestError, match="prompt_name 'passage'"):
        model.embed(TEXTS, prompt_name="passage")


def test_truncation(made, st):
    """``cls`` cuts at 16 tokens (its max_seq_length) as sentence-transformers does, keeping [SEP]; truncate=False
    refuses, naming both lengths."""
    model = mlx_engine.load(str(made["cls"]))
    long = TEXTS[2] * 3
    ids = model.tokenize([long])[0]
    assert len(ids) == 16 and ids == st["cls"].tokenizer(long, truncation=True, max_length=16)["input_ids"]
    assert cosines(model.embed([long]), st["cls"].encode([long])).min() >= COSINE
    with pytest.raises(InvalidRequestError, match=r"input 0 has \d+ tokens, more than the model's 16"):
        model.embed([long], truncate=False)


def test_gguf_against_sentence_transformers_and_llama_cpp(made, st):
    """The converter's files: ours against sentence-transformers (F32) and against llama.cpp's own embeddings on the
    same file (F32 and Q8_0, ours running Q8_0 as stored), token ids equal to llama.cpp's."""
    for key, kind in (("mean.f32", "mean"), ("mean.q8_0", "mean"), ("cls.f32", "cls")):
        model = mlx_engine.load(str(made[key]))
        assert model.architecture == "bert" and model.pooling == kind
        ours = model.embed(TEXTS)
        theirs, tokens = llama_cpp_embeddings(made[key], TEXTS)
        assert model.tokenize(TEXTS) == [t[:model.context_length] for t in tokens]
        assert cosines(ours, theirs).min() >= COSINE, (key, cosines(ours, theirs))
        if key.endswith("f32"):  # a GGUF keeps no max_seq_length: its inputs are cut at the model's context
            limit, st[kind].max_seq_length = st[kind].max_seq_length, model.context_length
            try:
                ref = st[kind].encode(TEXTS)
            finally:
                st[kind].max_seq_length = limit
            assert cosines(ours, ref).min() >= COSINE, (key, cosines(ours, ref))


def test_batches_match_single_inputs(made):
    """One padded forward pass gives each input the vector it gets alone (the mask hides the padding)."""
    model = mlx_engine.load(str(made["mean"]))
    together = model.embed(TEXTS)
    alone = np.concatenate([model.embed([t]) for t in TEXTS])
    assert np.abs(together - alone).max() < 1e-5


def test_refusals(made, smollm2_gguf):
    with pytest.raises(UnsupportedError, match="embedding model, not a chat model"):
        mlx_engine.Model("mean", made["mean"])
    model = mlx_engine.load(str(made["mean"]))
    with pytest.raises(InvalidRequestError, match="dimensions must be an integer from 1 to 64"):
        model.embed(TEXTS, dimensions=65)
    with pytest.raises(InvalidRequestError, match="input 1 must be a non-empty string"):
        model.embed(["a", ""])
    with pytest.raises(InvalidRequestError, match="token ids from 0 to"):
        model.embed_tokens([[2, 10_000]])


def test_cli(made, st):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    exe = [sys.executable, "-m", "mlx_engine.cli.main", "embed"]
    got = subprocess.run(exe + [str(made["mean.f32"]), *TEXTS[:2]], capture_output=True, text=True, env=env)
    assert got.returncode == 0, got.stderr
    rows = [json.loads(line) for line in got.stdout.splitlines()]
    assert cosines(rows, st["mean"].encode(TEXTS[:2])).min() >= COSINE
    got = subprocess.run(exe + [str(made["cls"]), "--json", "--dimensions", "8", TEXTS[0]], capture_output=True,
                         text=True, env=env)
    out = json.loads(got.stdout)
    assert out["dimensions"] == 8 and len(out["embeddings"]) == 1
    got = subprocess.run(exe + [str(made["cls"]), "--no-truncate", TEXTS[2] * 3], capture_output=True, text=True,
                         env=env)
    assert got.returncode == 1 and got.stderr.startswith("Error: input 0 has") and "Traceback" not in got.stderr


def test_doc_examples(made, st, tmp_path):
    """docs/embeddings.md's examples as written, with ``./all-MiniLM-L6-v2`` the small ``mean`` folder."""
    (tmp_path / "all-MiniLM-L6-v2").symlink_to(made["mean"])
    env = dict(os.environ, HF_HUB_OFFLINE="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    page = [b for b in blocks() if b.file == "docs/embeddings.md"]
    sh = [c for b in page if b.lang == "sh" for c in commands(b.text)]
    python = [b.text for b in page if b.lang == "python"]
    assert sh and python
    for command in sh:
        got = subprocess.run(command, shell=True, cwd=tmp_path, capture_output=True, text=True, env=env)
        assert got.returncode == 0, (command, got.stderr)
        first = json.loads(got.stdout.splitlines()[0])
        first = first["embeddings"][0] if isinstance(first, dict) else first
        assert cosines([first[:8]], st["mean"].encode(["a cat"], truncate_dim=len(first[:8]))).min() >= COSINE
    for text in python:
        got = subprocess.run([sys.executable, "-c", text], cwd=tmp_path, capture_output=True, text=True, env=env)
        assert got.returncode == 0, got.stderr


@pytest.fixture(scope="module")
def server(made, smollm2_gguf):
    from tests.test_server import RunningServer, free_port
    from mlx_engine.server import ServerConfig

    srv = RunningServer(ServerConfig(port=free_port(), models_dirs=[str(made["mean"].parent),
                                                                    str(smollm2_gguf.parent)]))
    yield srv
    srv.stop()


def test_openai_client(server, made, st):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    name = str(made["mean"])
    ref = st["mean"].encode(TEXTS)
    batch = client.embeddings.create(model=name, input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.index for d in batch.data] == [0, 1, 2] and batch.usage.prompt_tokens > 0
    assert [d.truncated for d in batch.data] == [False] * 3  # none is longer than the model's 128 tokens
    long = client.embeddings.create(model=name, input=[TEXTS[2] * 12, TEXTS[0]])
    assert [d.truncated for d in long.data] == [True, False] and long.usage.prompt_tokens < 128 + 20
    assert cosines([d.embedding for d in batch.data], ref).min() >= COSINE
    one = client.embeddings.create(model=name, input=TEXTS[1], encoding_format="float")
    assert len(one.data) == 1 and cosines([one.data[0].embedding], ref[1:2]).min() >= COSINE
    cut = client.embeddings.create(model=name, input=TEXTS, dimensions=16)
    assert cosines([d.embedding for d in cut.data], st["mean"].encode(TEXTS, truncate_dim=16)).min() >= COSINE
    assert abs(np.linalg.norm(cut.data[0].embedding) - 1) < 1e-5
    ids = mlx_engine.load(name).tokenize(TEXTS[:2])
    by_ids = client.embeddings.create(model=name, input=ids)
    assert cosines([d.embedding for d in by_ids.data], ref[:2]).min() >= COSINE
    import openai

    with pytest.raises(openai.BadRequestError, match="chat model, not an embedding model"):
        client.embeddings.create(model=str(smollm2_path(made, server)), input="x")


def smollm2_path(made, server) -> Path:
    return next(d for d in server.state.pool.models_dirs if (d / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()) \
        / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_ollama_client(server, made, st):
    import ollama

    client = ollama.Client(host=server.url)
    name = str(made["cls"])
    ref = st["cls"].encode(TEXTS)
    batch = client.embed(model=name, input=TEXTS)
    assert len(batch.embeddings) == 3 and cosines(batch.embeddings, ref).min() >= COSINE
    assert np.allclose(np.linalg.norm(batch.embeddings, axis=1), 1, atol=1e-5)
    one = client.embed(model=name, input=TEXTS[0], dimensions=16)
    assert cosines(one.embeddings, st["cls"].encode(TEXTS[:1], truncate_dim=16)).min() >= COSINE
    old = client.embeddings(model=name, prompt=TEXTS[1])  # not normalized, as ollama's older route
    assert np.allclose(old.embedding, ref[1], rtol=1e-4, atol=1e-4)
    long = client.embed(model=name, input=TEXTS[2] * 3)  # cut at 16 tokens
    assert long.prompt_eval_count == 16
    import httpx  # the cut input is flagged (issue 64 item 4), a field the ollama client does not read

    flags = httpx.post(server.url + "/api/embed", json={"model": name, "input": [TEXTS[2] * 3, TEXTS[0]]}).json()
    assert flags["truncated"] == [True, False]
    with pytest.raises(ollama.ResponseError, match="more than the model's 16") as e:
        client.embed(model=name, input=TEXTS[2] * 3, truncate=False)
    assert e.value.status_code == 400
