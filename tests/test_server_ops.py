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
from mlx_engine.server import ServerConfig
from tests.conftest import link_model, logits_for
from tests.doc_examples import blocks
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
            assert abs(c.logprob - want[k, answer[k]]) < 1e-3, (temperature, k, c.logprob, want[k, answer[k]])
            best = np.argsort(-want[k])[:5]
            assert [a.logprob for a in c.top_logprobs] == pytest.approx(want[k, best].tolist(), abs=1e-3)
        if temperature == 0:
            assert all(c.logprob == c.top_logprobs[0].logprob for c in content)  # greedy took the best


def test_logprobs_are_after_the_filters(oai):
    """With top_k = 2 (an extra field the openai client does not type: ``extra_body``) the distribution drawn
    from has two tokens: their probabilities sum to 1 and the third alternative was removed (-9999, OpenAI's
    floor)."""
    r = oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, logprobs=True, top_logprobs=3,
                                    temperature=1.0, seed=5, extra_body={"top_k": 2})
    for c in r.choices[0].logprobs.content:
        first, second, third = (a.logprob for a in c.top_logprobs)
        assert np.exp(first) + np.exp(second) == pytest.approx(1.0, abs=1e-5) and third == -9999.0
        assert c.logprob in (first, second)


def test_streamed_and_legacy_and_ollama_logprobs_agree(oai, server, ids):
    """The same greedy answer's scores streamed (chat), as the legacy completions shape and through ollama's
    client equal the non-streamed chat scores."""
    whole = oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, logprobs=True, top_logprobs=2)
    want = [(c.token, c.logprob) for c in whole.choices[0].logprobs.content]
    streamed = []
    for chunk in oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, logprobs=True,
                                             top_logprobs=2, stream=True):
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            streamed += [(c.token, c.logprob) for c in chunk.choices[0].logprobs.content]
    assert streamed == want
    client = ollama.Client(host=server.url)
    o = client.chat(model=MODEL, messages=HELLO, options={"num_predict": 5, "temperature": 0}, logprobs=True,
                    top_logprobs=2)
    assert [(p.token, p.logprob) for p in o.logprobs] == want
    assert all(len(p.top_logprobs) == 2 for p in o.logprobs)
    lines = [p for part in client.chat(model=MODEL, messages=HELLO, options={"num_predict": 5, "temperature": 0},
                                       logprobs=True, stream=True) for p in (part.logprobs or [])]
    assert [(p.token, p.logprob) for p in lines] == want
    prompt = server.state.pool.models[MODEL].obj.chat_tokens(HELLO)
    legacy = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=5, logprobs=3)
    lp = legacy.choices[0].logprobs
    assert list(zip(lp.tokens, lp.token_logprobs)) == want
    assert lp.text_offset[0] == 0 and all(len(t) == 3 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == legacy.choices[0].text


def test_n_choices_share_the_prompt(oai, server):
    """n = 4 greedy: four equal answers; n = 3 sampled with seed s: choice i equals the single answer of seed s + i.
    The prompt is prefilled once: the later choices take it from the cache."""
    msgs = [{"role": "user", "content": "Tell me a short story about a cat named Tom."}]
    r = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, n=4)
    texts = [c.message.content for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and len(set(texts)) == 1 and texts[0]
    assert r.usage.completion_tokens == 4 * 8
    many = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, n=3, temperature=1.0, seed=11)
    singles = [oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=1.0,
                                           seed=11 + i).choices[0].message.content for i in range(3)]
    assert [c.message.content for c in many.choices] == singles
    assert len(set(singles)) > 1  # the seeds differ, so do the answers
    streamed: dict[int, str] = {}
    for chunk in oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, n=3, temperature=1.0,
                                             seed=11, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert [streamed[i] for i in range(3)] == singles


def scrape(server) -> dict[tuple[str, tuple], float]:
    """``/metrics`` parsed by ``prometheus_client``: ``(sample name, sorted labels) -> value``."""
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def test_metrics_move_with_requests(oai, server):
    """Counters and histograms move by what a request did; an n = 4 request prefills its prompt once (the other
    three choices take all of it but the last token from the cache); the gauges describe the loaded model."""
    before = scrape(server)
    msgs = [{"role": "user", "content": "Count from one to twenty in French words, please."}]
    r = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, n=4)
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, top_p=7)
    after = scrape(server)
    m = (("model", MODEL),)

    def moved(name, labels=m):
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)
    prompt = r.usage.prompt_tokens
    assert moved("mlx_engine_prompt_tokens_total") == 4 * prompt
    assert moved("mlx_engine_cached_tokens_total") >= 3 * (prompt - 1)
    assert moved("mlx_engine_generated_tokens_total") == r.usage.completion_tokens == 16
    assert moved("mlx_engine_time_to_first_token_seconds_count") == 4
    assert moved("mlx_engine_inter_token_latency_seconds_count") == 4 * 3
    route = (("method", "POST"), ("route", "/v1/chat/completions"), ("status", "200"))
    assert moved("mlx_engine_requests_total", route) == 1
    assert moved("mlx_engine_requests_total", (("method", "POST"), ("route", "/v1/chat/completions"),
                                               ("status", "400"))) == 1
    httpx.get(server.url + "/no/such/path/" + "x" * 40)
    assert scrape(server)[("mlx_engine_requests_total", (("method", "GET"), ("route", "other"),
                                                         ("status", "404")))] >= 1
    assert after[("mlx_engine_models_loaded", ())] == 1
    assert after[("mlx_engine_model_bytes", (("kind", "text"), ("model", MODEL)))] > 50e6
    assert after[("mlx_engine_queue_length", m)] == 0 and after[("mlx_engine_running_requests", m)] == 0
    assert after[("mlx_engine_kv_cells_in_use", m)] >= prompt  # finished conversations stay for reuse


QUESTIONS = ["Name a fruit.", "Name a colour.", "Name an animal.", "Name a country.", "Name a river.",
             "Name a planet.", "Name a tree.", "Name a metal.", "Name a bird.", "Name a city.", "Name a sport.",
             "Name a flower."]


def _chat_turns(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "You are terse."}]
    for q in QUESTIONS:
        messages.append({"role": "user", "content": q})
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        yield r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens


def _responses_turns(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    previous = None
    for q in QUESTIONS:
        r = client.responses.create(model=MODEL, input=q, instructions="You are terse.", max_output_tokens=4,
                                    previous_response_id=previous)
        previous = r.id
        yield r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens


def _messages_turns(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    messages: list[dict] = []
    for q in QUESTIONS:
        messages.append({"role": "user", "content": q})
        m = client.messages.create(model=MODEL, max_tokens=4, system="You are terse.", messages=messages)
        messages.append({"role": "assistant", "content": m.content[0].text if m.content else ""})
        yield m.usage.input_tokens + m.usage.cache_read_input_tokens, m.usage.cache_read_input_tokens


@pytest.mark.parametrize("turns", [_chat_turns, _responses_turns, _messages_turns],
                         ids=["chat", "responses", "messages"])
def test_agent_loop_of_12_turns_prefills_only_the_new_tokens(server, turns):
    """Twelve turns of a growing conversation: from the second on, the whole previous prompt comes from the
    prefix cache (usage's cached tokens), so only the tokens after it (the last answer, the new question) are
    prefilled."""
    before = 0
    seen = 0
    for turn, (prompt, cached) in enumerate(turns(server)):
        assert prompt > before
        if turn:
            assert cached >= before, (turn, prompt, cached, before)  # every earlier turn from the cache
        before = prompt
        seen += 1
    assert seen == 12


@pytest.mark.parametrize("route,body", [
    ("/v1/chat/completions", {"logprobs": "x"}),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 99}),
    ("/v1/chat/completions", {"top_logprobs": 2}),
    ("/v1/chat/completions", {"logprobs": 1}),
    ("/v1/chat/completions", {"n": 0}),
    ("/v1/chat/completions", {"n": 10**9}),
    ("/v1/chat/completions", {"n": "2"}),
    ("/v1/chat/completions", {"n": 2, "seed": 2**64 - 1, "temperature": 1.0}),
    ("/v1/chat/completions", {"n": 2, "seed": 2**64 - 1, "temperature": 1.0, "stream": True}),
    ("/v1/completions", {"logprobs": 6}),
    ("/v1/completions", {"logprobs": True}),
    ("/v1/completions", {"n": -1}),
    ("/api/chat", {"logprobs": "x", "stream": False}),
    ("/api/chat", {"logprobs": True, "top_logprobs": 99, "stream": False}),
    ("/api/generate", {"top_logprobs": 3, "stream": False}),
])
def test_hostile_new_fields_are_4xx(server, route, body):
    base = {"model": MODEL, "max_tokens": 2}
    base.update({"prompt": "Hi"} if route in ("/v1/completions", "/api/generate") else
                {"messages": [{"role": "user", "content": "Hi"}]})
    r = httpx.post(server.url + route, json={**base, **body})
    assert 400 <= r.status_code < 500, (route, body, r.status_code, r.text)
    assert "error" in r.json()


def test_the_docs_examples_run(server, capsys):
    """docs/server.md's logprobs, n and /metrics examples as written, against this module's server."""
    examples = [b.text for b in blocks("python") if b.file == "docs/server.md"
                and ("top_logprobs=2" in b.text or "text_string_to_metric_families" in b.text)]
    assert len(examples) == 2
    for text in examples:
        exec(compile(text.replace("http://127.0.0.1:11435", server.url), "docs/server.md", "exec"), {})
    out = capsys.readouterr().out
    assert "-" in out.splitlines()[0] and out.count("[") >= 3 and f"('{MODEL}'," in out
