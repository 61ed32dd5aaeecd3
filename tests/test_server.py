"""The HTTP server with the real clients from PyPI (``openai``, ``ollama``), on a free loopback port.

Oracles: the Python API on the same weights (greedy text, ``generate_image`` pixels with the same seed).
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import ollama
import openai
import pytest
import uvicorn
from PIL import Image

import mlx_engine
from mlx_engine.server import ServerConfig, create_app
from tests.conftest import link_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    """A server in a thread of this process (so tests can look at its pool)."""

    def __init__(self, config: ServerConfig):
        self.app = create_app(config)
        self.state = self.app.server
        self.url = f"http://127.0.0.1:{config.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=config.port,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(600):
            if self.server.started:
                return
            time.sleep(0.1)
        raise RuntimeError("the server did not start")

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)

    def status(self) -> dict:
        return httpx.get(self.url + "/status").json()


@pytest.fixture(scope="module")
def store_root(tmp_path_factory, smollm2_gguf, gemma3_gguf):
    root = tmp_path_factory.mktemp("server-home")
    link_model(smollm2_gguf.parent, root)
    link_model(gemma3_gguf.parent, root)
    return root


@pytest.fixture(scope="module")
def server(store_root):
    srv = RunningServer(ServerConfig(port=free_port(), models=["smollm2:135m"], max_sequences=8,
                                     context_length=2048, store_root=str(store_root), max_body_bytes=2**20))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    return mlx_engine.Model("smollm2:135m", smollm2_gguf, context_length=2048)


def chat_alone(model, messages, max_tokens):
    model.runner.reset()
    return model.chat(messages, max_tokens=max_tokens)


def test_openai_chat_streamed_and_not(server, reference):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = chat_alone(reference, messages, 24)
    r = client.chat.completions.create(model="smollm2:135m", messages=messages, max_tokens=24)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(reference.chat_tokens(messages)) and r.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(model="smollm2:135m", messages=messages, max_tokens=24,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: from the cache
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_openai_completions_and_models(server, reference):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    reference.runner.reset()
    want = reference.generate("The capital of France is", raw=True, max_tokens=10)
    r = client.completions.create(model="smollm2:135m", prompt="The capital of France is", max_tokens=10)
    assert r.choices[0].text == want
    ids = {m.id for m in client.models.list()}
    assert {"smollm2:135m", "gemma3:270m", "shapes:64"} <= ids


def test_openai_image_matches_generate_image(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    r = client.images.generate(model="shapes:64", prompt="a red circle on a blue background", size="64x64",
                               extra_body={"seed": 7, "steps": 4})
    got = np.asarray(Image.open(io.BytesIO(base64.b64decode(r.data[0].b64_json))).convert("RGB"))
    want = np.asarray(mlx_engine.generate_image("a red circle on a blue background", seed=7, steps=4,
                                                width=64, height=64))
    assert got.shape == (64, 64, 3)
    np.testing.assert_array_equal(got, want)


def test_ollama_chat_generate_tags_show_ps(server, reference):
    client = ollama.Client(host=server.url)
    messages = [{"role": "user", "content": "Name three colours."}]
    want = chat_alone(reference, messages, 20)
    r = client.chat(model="smollm2:135m", messages=messages, options={"num_predict": 20})
    assert r.message.content == want and r.done and r.eval_count > 0 and r.prompt_eval_duration > 0
    streamed = "".join(p.message.content for p in client.chat(model="smollm2:135m", messages=messages,
                                                              stream=True, options={"num_predict": 20}))
    assert streamed == want
    reference.runner.reset()
    want_gen = reference.generate("Say hello.", max_tokens=12)
    assert client.generate(model="smollm2:135m", prompt="Say hello.", options={"num_predict": 12}).response == want_gen
    names = {m.model for m in client.list().models}
    assert {"smollm2:135m", "gemma3:270m"} <= names
    shown = client.show("smollm2:135m")
    assert shown.details.family == "llama" and "im_start" in shown.template
    running = {m.model: m for m in client.ps().models}
    assert "smollm2:135m" in running and running["smollm2:135m"].size > 0


def test_text_is_answered_while_an_image_is_denoised(server, reference):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    finished = {}

    def image():
        client.images.generate(model="shapes:64", prompt="a green square", size="64x64",
                               extra_body={"seed": 1, "steps": 400})
        finished["image"] = time.monotonic()
    t = threading.Thread(target=image)
    t.start()
    for _ in range(300):
        if server.status()["models"].get("shapes:64", {}).get("in_flight"):
            break
        time.sleep(0.05)
    messages = [{"role": "user", "content": "Name a fruit."}]
    r = client.chat.completions.create(model="smollm2:135m", messages=messages, max_tokens=8)
    finished["text"] = time.monotonic()
    t.join()
    assert finished["text"] < finished["image"]
    assert r.choices[0].message.content == chat_alone(reference, messages, 8)


def test_eight_concurrent_http_requests_match_alone(server, reference):
    questions = ["What is 2 + 2?", "Name a fruit.", "Who wrote Hamlet?", "What colour is the sky?",
                 "Say hi in French.", "What is ice?", "Name a planet.", "Count to three."]
    want = [chat_alone(reference, [{"role": "user", "content": q}], 16) for q in questions]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")

    def ask(q):
        return client.chat.completions.create(model="smollm2:135m", max_tokens=16,
                                              messages=[{"role": "user", "content": q}]).choices[0].message.content
    with ThreadPoolExecutor(8) as ex:
        got = list(ex.map(ask, questions))
    assert got == want


def test_disconnect_mid_stream_frees_the_cells(server):
    def cells():
        return server.status()["models"]["smollm2:135m"]["cells_in_use"]

    client = ollama.Client(host=server.url)  # reload the model: no finished conversation is kept, the pool is empty
    assert client.generate(model="smollm2:135m", prompt="", keep_alive=0).done_reason == "unload"
    assert client.generate(model="smollm2:135m", prompt="").done_reason == "load"
    assert server.status()["models"]["smollm2:135m"]["kv_cache"] == "float32"  # the default: the compute dtype
    base = cells()
    assert base == 0
    prompt = ", ".join(str(i) for i in range(40, 60)) + ","
    with httpx.stream("POST", server.url + "/v1/completions", json={
            "model": "smollm2:135m", "prompt": prompt, "max_tokens": 1000, "stream": True}, timeout=60) as r:
        for i, _line in enumerate(r.iter_lines()):
            if i > 6:
                # checked before leaving the loop: closing the line iterator closes the response, and the server
                # may notice the disconnect and free the cells before a check after the loop
                assert cells() > base
                break
        assert i > 6, "the stream ended early"
    for _ in range(100):
        if cells() == base and server.status()["models"]["smollm2:135m"]["decoding"] == 0:
            break
        time.sleep(0.1)
    assert cells() == base
    assert server.status()["models"]["smollm2:135m"]["decoding"] == 0


def _hostile_requests():
    good = {"model": "smollm2:135m", "messages": [{"role": "user", "content": "hi"}]}
    bodies = [b"", b"{", b"[]", b"null", b"\xff\xfe", b'"str"', b"{" * 5000 + b"}" * 5000, b"1e999999"]
    openai_variants = [
        {}, {"model": 3}, {"model": "smollm2:135m"}, {**good, "messages": []}, {**good, "messages": "hi"},
        {**good, "messages": [{"role": "wizard", "content": "x"}]}, {**good, "temperature": "hot"},
        {**good, "temperature": -1}, {**good, "temperature": float("nan")}, {**good, "top_p": 0},
        {**good, "max_tokens": 0}, {**good, "max_tokens": "3"}, {**good, "stop": 5}, {**good, "stop": ["a"] * 9},
        {**good, "seed": "x"}, {**good, "n": 0}, {**good, "stream": "yes"}, {**good, "model": "no-such-model"},
        {**good, "model": "../../etc/passwd"}, {**good, "messages": [{"role": "user", "content": "x " * 5000}]},
        {**good, "frequency_penalty": 9}, {**good, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}},
        {**good, "response_format": {"type": "regex", "pattern": "[a-"}}, {**good, "response_format": "json"},
        {**good, "response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nowhere"}}}},
        {**good, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        {**good, "tools": [{"type": "function"}]}, {**good, "logprobs": "x"}, {**good, "stream_options": 3},
    ]
    openai_variants += [{**good, field: value} for field in (
        "temperature", "top_p", "max_tokens", "seed", "n", "frequency_penalty", "presence_penalty", "top_k", "min_p")
        for value in ({}, [1], "x")]
    gen = {"model": "smollm2:135m", "prompt": "hi"}
    ollama_variants = [
        {}, {"model": 3}, {**gen, "prompt": 5}, {**gen, "options": "hot"}, {**gen, "options": {"temperature": "hot"}},
        {**gen, "options": {"temperature": -1}}, {**gen, "options": {"top_p": 0}},
        {**gen, "options": {"num_predict": "3"}}, {**gen, "options": {"stop": 5}}, {**gen, "options": {"seed": "x"}},
        {**gen, "options": {"num_ctx": 0}}, {**gen, "options": {"num_ctx": 99999}}, {**gen, "options": {"mirostat": 2}},
        {**gen, "options": {"repeat_penalty": 0}}, {**gen, "stream": "yes"}, {**gen, "model": "no-such-model"},
        {**gen, "model": "../../etc/passwd"}, {**gen, "prompt": "x " * 5000}, {**gen, "format": "yaml"},
        {**gen, "format": {"type": "object", "properties": {"a": {"type": "integer", "minimum": "x"}}}},
        {**gen, "format": {"type": "string", "pattern": "(unclosed"}}, {**gen, "format": 5},
        {**gen, "images": ["aGk="]}, {**gen, "keep_alive": "soon"}, {**gen, "keep_alive": [1]}, {**gen, "raw": "no"},
        {**gen, "context": [1, 2]}, {**gen, "system": 5},
        {"model": "smollm2:135m", "messages": [{"role": "wizard", "content": "x"}]},
        {"model": "smollm2:135m", "messages": "hi"}, {"model": "smollm2:135m", "messages": [{"content": "x"}]},
        {"model": "smollm2:135m", "messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]},
        {"model": "smollm2:135m", "messages": [{"role": "user", "content": "x " * 5000}]},
        {"model": "smollm2:135m", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "f"}]},
    ]
    out = []
    for path, variants in (("/v1/chat/completions", openai_variants), ("/v1/completions", openai_variants),
                           ("/api/chat", ollama_variants), ("/api/generate", ollama_variants)):
        for b in bodies:
            out.append(("POST", path, b))
        for v in variants:
            if path == "/api/chat" and {"raw", "context", "system"} & set(v):
                continue  # generate-only fields: a chat request ignores them, as ollama's does
            if path == "/api/chat" and "prompt" in v:
                msg = {"role": "user", "content": v["prompt"], **({"images": v["images"]} if "images" in v else {})}
                v = {**{k: x for k, x in v.items() if k not in ("prompt", "images")}, "messages": [msg]}
            elif path == "/api/generate" and "messages" in v:
                continue  # a generate request without a prompt is a legitimate "load the model"
            out.append(("POST", path, json.dumps(v, allow_nan=True).encode()))
    out += [("POST", "/api/show", b'{"model": "nope"}'), ("DELETE", "/api/delete", b'{"model": "nope"}'),
            ("POST", "/api/pull", b'{"model": 5}'), ("POST", "/api/pull", b'{"model": "not-in-catalog:1b"}'),
            ("GET", "/v1/chat/completions", b""), ("POST", "/v1/images/generations", b'{"prompt": "x", "size": "13x13"}'),
            ("POST", "/v1/images/generations", b'{"prompt": "x", "size": "99999x99999"}'),
            ("POST", "/v1/images/generations", b'{"prompt": "x", "size": "big"}'),
            ("POST", "/v1/images/generations", b'{"prompt": "x", "steps": 0}'),
            ("POST", "/v1/images/generations", b'{"prompt": "", "model": "shapes:64"}'),
            ("POST", "/v1/images/generations", b'{"prompt": "x", "model": "/etc"}'),
            ("POST", "/v1/images/generations", b'{"prompt": "x", "response_format": "url"}'),
            ("POST", "/v1/images/generations", b'{"prompt": "x", "model": "smollm2:135m"}'),
            ("POST", "/nope", b"{}"), ("POST", "/v1/chat/completions", b"x" * (2**20 + 10))]
    return out


def test_hostile_requests_get_4xx_and_the_server_keeps_serving(server, reference):
    requests = _hostile_requests()
    assert len(requests) >= 200
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for method, path, body in requests:
            r = c.request(method, path, content=body, headers={"Content-Type": "application/json"})
            assert 400 <= r.status_code < 500, (path, body[:80], r.status_code, r.text[:200])
            err = r.json()["error"]
            text = err if isinstance(err, str) else err["message"]
            assert text and "Traceback" not in text
            if path.startswith("/v1/"):
                assert isinstance(err, dict) and err["code"] == r.status_code
        big = c.post("/v1/chat/completions", json={"model": "smollm2:135m", "max_tokens": 4, "messages": [
            {"role": "user", "content": "x " * 5000}]})
        assert big.status_code == 400 and "context holds 2048" in big.json()["error"]["message"]
    test_openai_chat_streamed_and_not(server, reference)


def test_memory_budget_and_api_key(store_root):
    srv = RunningServer(ServerConfig(port=free_port(), store_root=str(store_root), memory_budget=10 * 2**20,
                                     api_key="sesame"))
    try:
        body = {"model": "smollm2:135m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(srv.url + "/v1/chat/completions", json=body).status_code == 401
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer sesame"},
                       timeout=60)
        assert r.status_code == 503
        assert "needs" in r.json()["error"]["message"] and "memory budget" in r.json()["error"]["message"]
        assert srv.state.pool.models == {}
    finally:
        srv.stop()
    with pytest.raises(mlx_engine.errors.InvalidRequestError, match="API key"):
        ServerConfig(host="0.0.0.0").check()


def test_ollama_load_unload_pull_delete(server):
    client = ollama.Client(host=server.url)
    assert client.generate(model="gemma3:270m", prompt="", keep_alive="1s").done_reason == "load"
    assert "gemma3:270m" in {m.model for m in client.ps().models}
    for _ in range(100):  # keep_alive: unloaded once idle that long
        if "gemma3:270m" not in {m.model for m in client.ps().models}:
            break
        time.sleep(0.1)
    assert "gemma3:270m" not in {m.model for m in client.ps().models}
    assert client.generate(model="gemma3:270m", prompt="").done_reason == "load"
    assert client.generate(model="gemma3:270m", prompt="", keep_alive=0).done_reason == "unload"
    assert "gemma3:270m" not in {m.model for m in client.ps().models}
    statuses = [p.status for p in client.pull("gemma3:270m", stream=True)]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    assert httpx.get(server.url + "/api/version").json()["version"] == mlx_engine.__version__
    client.delete("gemma3:270m")
    assert "gemma3:270m" not in {m.model for m in client.list().models}
    with pytest.raises(ollama.ResponseError) as e:
        client.delete("gemma3:270m")
    assert e.value.status_code == 404


def test_sigterm_during_streaming_ends_within_bounded_time(store_root):
    port = free_port()
    env = dict(os.environ, MLX_ENGINE_HOME=str(store_root), PYTHONUNBUFFERED="1")
    from mlx_engine.mlx import cpu_kernels

    activations = "float32" if cpu_kernels.int8_problem() else "int8"  # (--activations reaches the model)
    proc = subprocess.Popen([sys.executable, "-c", "from mlx_engine.cli.main import main; main()", "serve",
                             "--port", str(port), "--model", "smollm2:135m", "--context-length", "1024",
                             "--kv-bits", "16", "--activations", activations],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        status = httpx.get(url + "/status").json()["models"]["smollm2:135m"]
        assert (status["kv_cache"], status["activations"]) == ("float16", activations)  # --kv-bits, --activations
        prompt = ", ".join(str(i) for i in range(100, 120)) + ","
        lines = []
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                "model": "smollm2:135m", "prompt": prompt, "max_tokens": 900, "stream": True}) as r:
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 10:
                    t0 = time.monotonic()
                    proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert took < 20, took
    assert "Traceback" not in err and "Traceback" not in out, err
    assert "POST /v1/completions" in err  # the per-request log line, written when the stream ended
    assert lines[0].startswith("data: ")


def test_engine_errors_map_to_status_codes():
    from mlx_engine.errors import (InvalidOptionError, MemoryBudgetError, ModelNotFoundError, ServerBusyError,
                                   WeightsError)
    from mlx_engine.server.http import problem_from

    busy = problem_from(ServerBusyError("full", retry_after=2.4))
    assert (busy.status, busy.headers["Retry-After"]) == (429, "2")
    assert problem_from(MemoryBudgetError("x")).status == 503
    assert problem_from(ModelNotFoundError("x")).status == 404
    bad = problem_from(InvalidOptionError("temperature", -1, "must be >= 0"))
    assert (bad.status, bad.param) == (400, "temperature")
    assert problem_from(WeightsError("corrupt")).status == 500
    internal = problem_from(ZeroDivisionError("boom"))
    assert internal.status == 500 and "boom" not in internal.message and "ZeroDivisionError" in internal.message
