"""Decoder rerankers (issue 64): Qwen3-Reranker's layout against its oracles. A small random transformers
``Qwen3ForCausalLM`` (hidden 64, 2 layers, grouped-query attention, tied embeddings as Qwen3-Reranker-0.6B) with
smollm2's real BPE tokenizer (ChatML's ``<|im_start|>`` / ``<|im_end|>``, single tokens ``yes`` and ``no``), its
folder named as the real one's ``README.md`` heading names it; llama.cpp's converter makes its GGUF (``qwen3.pooling_type``
4, ``cls.output.weight`` the head's yes / no rows, ``tokenizer.chat_template.rerank``). Ours on the folder against the
model card's own transformers code (prefix, ``format_instruction``, suffix; ``p(yes)`` of the two-way softmax of the
last token's yes / no logits), ours on the GGUF against llama.cpp's rank pooling and its server's prompt: every score
within 1e-4.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import mlx_engine
from mlx_engine.errors import InvalidRequestError
from mlx_engine.models.embedding.rerank import QWEN3_RERANK_INSTRUCTION, QWEN3_RERANK_PREFIX, QWEN3_RERANK_SUFFIX
from tests.hf_gguf import convert, llama_cpp_rank, peaked, save_tokenizer
from tests.test_rerank import BOUND, DOCS, QUERY

CONTEXT = 128  # the folder's max_position_embeddings: a long document is cut there


@pytest.fixture(scope="module")
def made(tmp_path_factory, smollm2_gguf) -> dict[str, Path]:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    root = tmp_path_factory.mktemp("qwen3-rerank")
    folder = root / "hf"
    folder.mkdir()
    save_tokenizer(smollm2_gguf, folder)
    from tokenizers import Tokenizer
    vocab = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size()
    config = Qwen3Config(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=128,
                         max_position_embeddings=CONTEXT, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    peaked(model, scale=1.0)
    model.save_pretrained(folder)
    (folder / "README.md").write_text("# Qwen3-Reranker-0.6B\n\nA random model in its layout.\n")
    return {"hf": folder, "f32": convert(folder, root / "f32.gguf", "f32", pre="smollm")}


def _card_scores(folder: Path, query: str, docs: list[str], max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """The model card's code (each pair alone, so no padding): ``p(yes)`` and ``logit(yes) - logit(no)``."""
    import torch
    from transformers import Qwen3ForCausalLM, TokenizersBackend

    tokenizer = TokenizersBackend.from_pretrained(str(folder))
    model = Qwen3ForCausalLM.from_pretrained(str(folder)).eval()
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    prefix = tokenizer.encode(QWEN3_RERANK_PREFIX, add_special_tokens=False)
    suffix = tokenizer.encode(QWEN3_RERANK_SUFFIX, add_special_tokens=False)
    probs, logits = [], []
    for doc in docs:
        text = f"<Instruct>: {QWEN3_RERANK_INSTRUCTION}\n<Query>: {query}\n<Document>: {doc}"
        ids = tokenizer(text, truncation="longest_first", max_length=max_length - len(prefix) - len(suffix))
        with torch.no_grad():
            out = model(torch.tensor([prefix + ids["input_ids"] + suffix])).logits[0, -1].double()
        pair = torch.nn.functional.log_softmax(torch.stack([out[no], out[yes]]), dim=0)
        probs.append(float(pair[1].exp()))
        logits.append(float(out[yes] - out[no]))
    return np.array(probs), np.array(logits)


def _by_index(results: list[dict]) -> np.ndarray:
    return np.array([r["relevance_score"] for r in sorted(results, key=lambda r: r["index"])])


def test_folder_against_model_card(made):
    model = mlx_engine.load(str(made["hf"]))
    assert isinstance(model, mlx_engine.EmbeddingModel) and model.reranker is not None
    long_doc = " ".join(DOCS * 12)  # longer than the context: the card cuts the middle's end
    docs = DOCS + [long_doc]
    probs, logits = _card_scores(made["hf"], QUERY, docs, CONTEXT)
    ours = model.rerank(QUERY, docs)
    assert [r["index"] for r in ours] == list(np.argsort(-probs))
    assert np.abs(_by_index(ours) - probs).max() < BOUND, (_by_index(ours), probs)
    raw = _by_index(model.rerank(QUERY, docs, normalize=False))  # sentence-transformers' LogitScore: yes - no
    assert np.abs(raw - logits).max() < BOUND, (raw, logits)
    assert len(model.reranker.pair_tokens(QUERY, [long_doc])[0][0]) == CONTEXT
    with pytest.raises(InvalidRequestError, match="more than the model's 128"):
        model.rerank(QUERY, [long_doc], truncate=False)
    with pytest.raises(InvalidRequestError, match="a reranker .* not an embedding model"):
        model.embed(["a"])


def test_gguf_against_llama_cpp(made):
    model = mlx_engine.load(str(made["f32"]))
    assert model.reranker is not None and model.backend.metadata["qwen3.pooling_type"] == 4
    theirs, tokens = llama_cpp_rank(made["f32"], QUERY, DOCS)  # p(yes): llama.cpp's softmax over cls_out
    assert model.reranker.pair_tokens(QUERY, DOCS)[0] == tokens
    ours = _by_index(model.rerank(QUERY, DOCS))
    assert np.abs(ours - theirs).max() < BOUND, (ours, theirs)
    folder = _by_index(mlx_engine.load(str(made["hf"])).rerank(QUERY, DOCS))  # the converter keeps the model
    assert np.abs(ours - folder).max() < BOUND, (ours, folder)


def test_server_route(made):
    """``/v1/rerank`` on a decoder reranker: the API's scores."""
    import httpx

    from mlx_engine.server import ServerConfig
    from tests.test_server import RunningServer, free_port

    srv = RunningServer(ServerConfig(port=free_port(), models_dirs=[str(made["hf"].parent)]))
    try:
        want = mlx_engine.load(str(made["hf"])).rerank(QUERY, DOCS)
        body = {"model": str(made["hf"]), "query": QUERY, "documents": DOCS, "top_n": 3}
        got = httpx.post(srv.url + "/v1/rerank", json=body, timeout=60).json()
        assert [r["index"] for r in got["results"]] == [r["index"] for r in want[:3]]
        assert max(abs(a["relevance_score"] - b["relevance_score"]) for a, b in zip(got["results"], want)) < 1e-6
    finally:
        srv.stop()
