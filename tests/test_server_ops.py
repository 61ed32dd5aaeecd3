"""logprobs, ``n`` > 1, ``/metrics`` and a 12-turn agent loop, with the real ``openai``, ``ollama`` and ``anthropic``
clients against one server on a loopback port.

Oracles: the model's own log-softmax on the same weights through the Python API (``logits_for``: a prefill of the
prompt and the answer's tokens), the same request's single answers for ``n`` (greedy; seed ``s + i``), the
``prometheus_client`` parser, and the chat template's token counts for the agent loop.
"""

from __future__ import annotations

import anthropic
import httpx
import numpy as np
import ollama
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import mlx_engine
from mlx_engine.models.runner import logits_for
from mlx_engine.server import ServerConfig
from tests.conftest import link_model
from tests.test_server import RunningServer, free_port

MODEL = "smollm2:135m"
HELLO = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_gguf):
    root = tmp_path_factory.mktemp("ops-home")
    link_model(smollm2_gguf.parent, root)
    srv = RunningServer(ServerConfig(port=free_port(), models=[MODEL], max_sequences=4, context_length=2048,
                                     store_root=str(root)))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    return mlx_engine.Model(MODEL, smollm2_gguf, context_length=2048)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def log_softmax_rows(reference, prompt: list[int], answer: list[int], temperature: float = 1.0) -> np.ndarray:
    """float64 ``[len(answer), vocab]``: the model's log-probabilities of each answer position (logits / T)."""
    rows = []
    for k in range(len(answer)):
        z = logits_for(reference.text_model, reference.runner, prompt + answer[:k]).astype(np.float64) / temperature
        rows.append(z - z.max() - np.log(np.exp(z - z.max()).sum()))
    reference.runner.reset()
    return np.stack(rows)


@pytest.fixture(scope="module")
def ids(reference):
    """The answer's token ids from each score's ``bytes`` (the vocabulary's first id with those bytes)."""
    tok = reference.tokenizer
    table: dict[bytes, int] = {}
    for i in range(tok.vocab_size):
        table.setdefault(tok.token_bytes(i), i)
    return lambda content: [table[bytes(c.bytes)] for c in content]


def test_chat_logprobs_are_the_models_log_softmax(oai, reference, ids):
    """Greedy and sampled at T = 0.7: each token's logprob and its top 5 against log_softmax(logits / T)."""
    prompt = reference.chat_tokens(HELLO)
    for temperature in (0.0, 0.7):
        r = oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, logprobs=True, top_logprobs=5,
                                        temperature=temperature, seed=3)
        content = r.choices[0].logprobs.content
        assert len(content) == r.usage.completion_tokens == 6
        answer = ids(content)
        assert reference.tokenizer.decode(answer) == r.choices[0].message.content
        want = log_softmax_rows(reference, prompt, answer, temperature or 1.0)
        for k, c in enumerate(content):
            assert abs(c.logprob - want[k, answer[k]]) < 2e-3, (temperature, k, c.logprob, want[k, answer[k]])
            best = np.argsort(-want[k])[:5]
            assert [a.logprob for a in c.top_logprobs] == pytest.approx(want[k, best].tolist(), abs=2e-3)
        if temperature == 0:
            assert all(c.logprob == c.top_logprobs[0].logprob for c in content)  # greedy took the best
