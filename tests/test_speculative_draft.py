"""Speculative decoding with a draft model, and in the server's continuous batching (issue 62).

Oracle: the target's own plain greedy tokens (no speculation), token for token; in the server, the real ``openai``
client's answers without speculation. A draft model that is the target itself must have every draft token accepted;
a small random model of the same vocabulary (smollm2's tokenizer) must change nothing but the acceptance."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
from pathlib import Path

import pytest

import mlx_engine
from mlx_engine.errors import InvalidRequestError
from mlx_engine.models.generation.runner import GenerationStats, Request
from mlx_engine.models.generation.sampler import SamplerOptions
from mlx_engine.server import ServerConfig
from mlx_engine.server.scheduler import TextScheduler
from tests.hf_gguf import peaked, save_tokenizer
from tests.test_server import RunningServer, free_port
from tests.test_server_scheduler import alone, run_until, submit
from tests.test_speculative import PARAGRAPH

PROMPTS = ["Repeat this paragraph exactly:\n\n" + PARAGRAPH, "Write a short story about a dragon.",
           "Copy this text: " + PARAGRAPH[:150], "List the first five planets of the solar system."]


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory, smollm2_gguf) -> Path:
    """A random Llama of smollm2's vocabulary (hidden 64, 2 layers) saved by transformers with smollm2's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("draft")
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    peaked(model)
    model.save_pretrained(folder)
    save_tokenizer(smollm2_gguf, folder)
    return folder


@pytest.fixture(scope="module")
def target(smollm2_gguf):
    """smollm2 drafting for itself, loaded through the public ``draft_model=``."""
    m = mlx_engine.load(str(smollm2_gguf), progress=False, context_length=512, draft_model=str(smollm2_gguf))
    yield m
    m.close()


def _tokens(model, tokens, speculative, n=40, **kw):
    model.runner.reset(0)
    stats = GenerationStats()
    req = Request(tokens, SamplerOptions(**kw), n, (), 0, speculative=speculative)
    return list(model.runner.generate_tokens(req, stats)), stats


def test_the_target_drafting_for_itself_is_always_accepted(target):
    tokens = target.chat_tokens([{"role": "user", "content": PROMPTS[1]}])  # free writing: lookup finds nothing
    plain, _ = _tokens(target, tokens, "off", temperature=0)
    fast, stats = _tokens(target, tokens, None, temperature=0)  # a draft model attached: drafts by default
    assert fast == plain
    assert stats.draft_proposed > 30 and stats.draft_accepted == stats.draft_proposed
    assert stats.verify_steps < len(plain) // 3
    # sampled: the same seed gives the same tokens again
    a = list(target.stream(PROMPTS[1], max_tokens=20, temperature=0.8, seed=5, draft_tokens=4))
    b = list(target.stream(PROMPTS[1], max_tokens=20, temperature=0.8, seed=5, draft_tokens=4))
    assert a[:-1] == b[:-1] and a[-1].generated_tokens == 20 and a[-1].draft_accepted > 0


def test_a_small_random_draft_model_changes_only_the_acceptance(target, random_draft, smollm2_gguf):
    draft = mlx_engine.load(str(random_draft), progress=False, context_length=512)
    own = target.runner.draft
    try:
        target.runner.attach_draft(draft.runner, "smollm2", "random")
        tokens = target.chat_tokens([{"role": "user", "content": PROMPTS[1]}])
        plain, _ = _tokens(target, tokens, "off", temperature=0)
        fast, stats = _tokens(target, tokens, "draft", temperature=0)
        assert fast == plain
        assert stats.draft_proposed > 0 and stats.draft_accepted < stats.draft_proposed / 2
    finally:
        target.runner.draft = own
        draft.close()


def test_a_draft_model_of_another_vocabulary_is_refused(random_draft, tmp_path):
    """The random model's own tokenizer with two tokens' ids swapped: one id off is another vocabulary."""
    other = tmp_path / "other"
    shutil.copytree(random_draft, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(InvalidRequestError, match=r"the draft model .*other has another vocabulary than .*draft.*id "
                                                  r"\d+ is '[ab]'"):
        mlx_engine.load(str(random_draft), progress=False, context_length=64, draft_model=str(other))


def test_the_scheduler_verifies_four_sequences_drafts_in_one_pass(target):
    """Three requests with lookup (the scheduler's default here) and one without, batched: each gives its tokens
    alone; the cache holds exactly the accepted tokens (every rejected cell removed)."""
    m = target
    prompts = [m.chat_tokens([{"role": "user", "content": p}]) for p in PROMPTS]
    want = [alone(m, p, 40, speculative="off") for p in prompts]
    sched = TextScheduler(m.runner, speculative="lookup")
    got = [submit(sched, p, 40)[1] for p in prompts[:3]] + [submit(sched, prompts[3], 40, speculative="off")[1]]
    run_until(sched, lambda: all(c.done for c in got))
    assert [c.error for c in got] == [None] * 4
    assert [c.answer for c in got] == want
    assert got[0].stats.draft_accepted > 10 and got[3].stats.verify_steps == 0
    assert m.runner.cells_in_use() == sum(len(p) + c.stats.completion_tokens - 1 for p, c in zip(prompts, got))
    m.runner.reset()


def test_server_speculation_gives_the_plain_answers(home_with_smollm2):
    from openai import OpenAI

    srv = RunningServer(ServerConfig(port=free_port(), models=["smollm2:135m"], max_sequences=4, context_length=1024,
                                     store_root=str(home_with_smollm2)))
    try:
        client = OpenAI(base_url=srv.url + "/v1", api_key="none")

        def ask(prompt, **extra):
            r = client.chat.completions.create(model="smollm2:135m", messages=[{"role": "user", "content": prompt}],
                                               temperature=0, max_tokens=40, extra_body=extra or None)
            return r.choices[0].message.content

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            plain = list(pool.map(ask, PROMPTS))
            fast = list(pool.map(lambda p: ask(p, speculative="lookup", draft_tokens=6), PROMPTS))
        assert fast == plain and len(set(plain)) == 4
        status = next(v for k, v in srv.status()["models"].items() if k.startswith("smollm2"))
        assert status["draft_accepted"] > 10 and status["verify_steps"] < 4 * 39
        with pytest.raises(Exception, match="needs a draft model"):
            ask(PROMPTS[0], speculative="draft")
    finally:
        srv.stop()
