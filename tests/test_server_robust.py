"""The server under stress (issue 58): no answer cut short in silence, hostile input as 4xx, slow clients timed out,
start-up failures as one ``Error:`` line, and clean exits of the Python API used from two threads.

Oracles: the same request alone (greedy text), the clients' own error types (``openai.APIError``,
``ollama.ResponseError``), the exit status of child processes.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import ollama
import openai
import pytest
import uvicorn

import mlx_engine
from mlx_engine.errors import GenerationInterruptedError, InvalidRequestError
from mlx_engine.server import ServerConfig, create_app
from mlx_engine.server.pool import parse_keep_alive
from mlx_engine.server.timeouts import read_timeout_protocol
from tests.conftest import link_model

MODEL = "smollm2:135m"
COUNTING = ", ".join(str(i) for i in range(10, 40)) + ","  # a prompt the model continues for a long time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server in a thread of this process, with our read-timeout protocol."""

    def __init__(self, config: ServerConfig, read_timeout: float = 30.0):
        self.app = create_app(config)
        self.state = self.app.server
        self.url = f"http://127.0.0.1:{config.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=config.port, log_level="warning",
                                                    lifespan="on", http=read_timeout_protocol(read_timeout)))
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


@pytest.fixture(scope="module")
def smollm2_source(smollm2_gguf):
    return smollm2_gguf.parent


@pytest.fixture(scope="module")
def store_root(tmp_path_factory, smollm2_source):
    root = tmp_path_factory.mktemp("robust-home")
    link_model(smollm2_source, root)
    return root


@pytest.fixture(scope="module")
def server(store_root):
    srv = Server(ServerConfig(port=free_port(), models=[MODEL], max_sequences=6, context_length=1024,
                              store_root=str(store_root)), read_timeout=2.0)
    yield srv
    srv.stop()


def _completion(url: str, max_tokens: int) -> str:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": COUNTING, "max_tokens": max_tokens},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


# ------------------------------------------------------------------------------------------ no silent truncation


def test_keep_alive_0_waits_for_running_requests(server):
    alone = _completion(server.url, 120)
    started = threading.Barrier(3)
    results = {}

    def stream(i):
        with httpx.stream("POST", server.url + "/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": COUNTING, "max_tokens": 120, "stream": True}) as r:
            lines = []
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    if len(lines) == 2:
                        started.wait(60)
            results[i] = lines

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    started.wait(60)
    assert server.state.pool.models[MODEL].scheduler.load()["decoding"] > 0  # the unload comes mid-answer
    r = httpx.post(server.url + "/api/generate", json={"model": MODEL, "prompt": "", "keep_alive": 0}, timeout=120)
    for t in threads:
        t.join(120)
    assert r.status_code == 200 and r.json()["done_reason"] == "unload"
    assert MODEL not in {m["name"] for m in httpx.get(server.url + "/api/ps").json()["models"]}
    assert len(results) == 2
    for lines in results.values():  # whole answers: the unload waited for them
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert all("error" not in e for e in events)
        assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        assert "".join(e["choices"][0]["text"] for e in events) == alone  # whole, as alone
    assert _completion(server.url, 4)  # loads again on demand


def test_forced_unload_ends_four_streams_with_an_error(server, store_root, smollm2_source):
    """A delete (a forced unload) while four streams and one plain request run: every one ends with the error form
    of its API, none with ``stop``."""
    assert _completion(server.url, 2)
    ready = threading.Barrier(6)
    outcome: dict[str, object] = {}

    def openai_stream(name):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        finishes = []
        try:
            for i, chunk in enumerate(client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=600,
                                                                stream=True)):
                finishes += [c.finish_reason for c in chunk.choices if c.finish_reason]
                if i == 2:
                    ready.wait(60)
            outcome[name] = ("finished", finishes)
        except openai.APIError as e:
            outcome[name] = ("APIError", finishes, str(e))

    def ollama_stream(name):
        client = ollama.Client(host=server.url)
        try:
            for i, part in enumerate(client.generate(model=MODEL, prompt=COUNTING, raw=True, stream=True,
                                                     options={"num_predict": 600})):
                if i == 2:
                    ready.wait(60)
            outcome[name] = ("finished", part.done_reason)
        except ollama.ResponseError as e:
            outcome[name] = ("ResponseError", str(e))

    def raw_stream(name):
        with httpx.stream("POST", server.url + "/v1/completions", timeout=120, json={
                "model": MODEL, "stream": True, "max_tokens": 600, "prompt": COUNTING}) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 6:
                    ready.wait(60)
        outcome[name] = ("lines", [x for x in lines if x])

    def plain(name):
        ready.wait(60)  # submitted last: queued or running when the delete comes
        r = httpx.post(server.url + "/api/generate", timeout=120, json={
            "model": MODEL, "prompt": COUNTING, "raw": True, "stream": False, "options": {"num_predict": 600}})
        outcome[name] = ("status", r.status_code, r.json())

    workers = [threading.Thread(target=f, args=(n,)) for n, f in (
        ("openai-1", openai_stream), ("openai-2", openai_stream), ("ollama", ollama_stream), ("raw", raw_stream),
        ("plain", plain))]
    for t in workers:
        t.start()
    ready.wait(60)
    time.sleep(0.5)  # the plain request is in
    try:
        ollama.Client(host=server.url).delete(MODEL)
        for t in workers:
            t.join(120)
    finally:
        link_model(smollm2_source, store_root)  # back in the store for the other tests
    for name in ("openai-1", "openai-2"):
        kind, finishes, *message = outcome[name]
        assert kind == "APIError" and "stop" not in finishes, outcome[name]
        assert "model was deleted" in message[0]
    assert outcome["ollama"][0] == "ResponseError" and "model was deleted" in outcome["ollama"][1]
    lines = outcome["raw"][1]
    final, error = json.loads(lines[-2][6:]), json.loads(lines[-1][6:])
    assert final["choices"][0]["finish_reason"] == "error"  # then the error event, and no [DONE]
    assert error["error"]["code"] == 503 and "incomplete" in error["error"]["message"]
    assert "data: [DONE]" not in lines
    kind, status, body = outcome["plain"]
    assert status == 503 and "incomplete" in body["error"], outcome["plain"]


def test_close_from_another_thread_raises(smollm2_gguf):
    model = mlx_engine.Model(MODEL, smollm2_gguf, context_length=512)
    got: dict[str, object] = {}
    first = threading.Event()

    def work():
        pieces = []
        try:
            for p in model.stream(COUNTING, raw=True, max_tokens=400):
                pieces.append(p)
                first.set()
            got["result"] = pieces
        except GenerationInterruptedError as e:
            got["error"] = e

    t = threading.Thread(target=work)
    t.start()
    assert first.wait(60)
    model.close()
    t.join(60)
    assert "error" in got, got
    assert got["error"].reason == "closed" and got["error"].text  # what was generated before the cut
    with pytest.raises(InvalidRequestError, match="closed"):
        model.generate("hi", max_tokens=2)


# ---------------------------------------------------------------------------------------------------- clean exits

TWO_THREADS = r"""
import sys, threading
import mlx_engine
m = mlx_engine.load(sys.argv[1], progress=False, context_length=256)
prompts = ["What is 2+2?", "Name a colour.", "Say hello.", "Count to three."]
alone = [m.generate(p, max_tokens=8) for p in prompts]
out = {}
def work(i):
    out[i] = "".join(p for p in m.stream(prompts[i], max_tokens=8) if isinstance(p, str))
ts = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
for t in ts: t.start()
for t in ts: t.join()
print("ok" if [out.get(i) for i in range(len(prompts))] == alone else "mismatch")
"""


def test_two_threads_exit_cleanly(smollm2_gguf):
    """The Python API from several threads (test_hostile_inputs' program as a script), 12 runs in parallel pairs:
    every one exits 0 with the answers of the model alone. Before the fix an abort at interpreter exit (MLX's
    per-thread compile cache freed after join) came in 2 of 16 such runs here, up to a quarter under load, and a
    thread failed in the chat template's sandbox (its limits were shared by the threads) in 1 of 16."""
    def run(_):
        p = subprocess.run([sys.executable, "-c", TWO_THREADS, str(smollm2_gguf)], capture_output=True, text=True,
                           timeout=300)
        return p.returncode, p.stdout.strip(), p.stderr[-500:]

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, range(12)))
    assert all(r[:2] == (0, "ok") for r in results), results


# ------------------------------------------------------------------------------------------------ hostile input


def _hostile():
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    gen = {"model": MODEL, "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
    raw = [  # raw JSON: "\ud800" is a lone surrogate once decoded
        ("/v1/chat/completions", b'{"model": "smollm2:135m", "messages": [{"role": "user", "content": "a\\ud800"}]}'),
        ("/v1/chat/completions", b'{"model": "smollm2:135m\\udc00", "messages": [{"role": "user", "content": "x"}]}'),
        ("/v1/chat/completions", b'{"model": "\\ud800", "messages": [{"role": "user", "content": "x"}]}'),
        ("/v1/chat/completions", b'{"model": "smollm2:135m", "stop": ["\\ud83d"], "messages": [{"role": "user", '
                                 b'"content": "x"}]}'),
        ("/v1/completions", b'{"model": "smollm2:135m", "prompt": "\\udfff"}'),
        ("/api/generate", b'{"model": "smollm2:135m", "prompt": "\\ud800x"}'),
        ("/api/chat", b'{"model": "smollm2:135m", "messages": [{"role": "user", "content": "\\ud800"}]}'),
        ("/api/generate", b'{"model": "smollm2:135m", "prompt": "hi", "keep_alive": 1' + b"0" * 400 + b"}"),
        ("/api/generate", b'{"model": "smollm2:135m", "prompt": "hi", "keep_alive": 1e300}'),
        ("/api/generate", b'{"model": "smollm2:135m", "prompt": "hi", "keep_alive": 1e999}'),
        ("/api/generate", b'{"model": "smollm2:135m", "prompt": "hi", "keep_alive": NaN}'),
        ("/api/generate", b'{"model": "smollm2:135m", "prompt": "", "keep_alive": 1e300}'),
    ]
    out = [(path, body) for path, body in raw]
    for body in ({**chat, "messages": [{"role": "user", "content": "a\x00b"}]}, {**chat, "model": "smollm2\x00"},
                 {**chat, "stop": ["\x00"]}):
        out.append(("/v1/chat/completions", json.dumps(body).encode()))
    for keep in ("99999999h", "9999999999999s", "1e400"):
        out.append(("/api/generate", json.dumps({**gen, "keep_alive": keep}).encode()))
    out.append(("/api/generate", json.dumps({**gen, "prompt": "nul\x00"}).encode()))
    return out


@pytest.mark.parametrize("path,body", _hostile())
def test_hostile_input_is_a_4xx_and_ps_keeps_answering(server, path, body):
    r = httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    err = r.json()["error"]
    message = err if isinstance(err, str) else err["message"]
    assert message and "Traceback" not in message and "internal" not in message
    ps = httpx.get(server.url + "/api/ps", timeout=30)
    assert ps.status_code == 200 and isinstance(ps.json()["models"], list)


def test_negative_keep_alive_is_forever_as_ollama(server):
    r = httpx.post(server.url + "/api/generate", json={"model": MODEL, "prompt": "", "keep_alive": -1}, timeout=60)
    assert r.status_code == 200 and r.json()["done_reason"] == "load"
    ps = {m["name"]: m for m in httpx.get(server.url + "/api/ps").json()["models"]}
    assert ps[MODEL]["expires_at"].startswith("9999-")
    assert _completion(server.url, 3)  # and it answers
    httpx.post(server.url + "/api/generate", json={"model": MODEL, "prompt": "", "keep_alive": "5m"}, timeout=60)


def test_parse_keep_alive_bounds():
    assert parse_keep_alive(-5) == parse_keep_alive("-1m") == parse_keep_alive(-10**400) == float("inf")
    assert parse_keep_alive("90m") == 5400.0 and parse_keep_alive(0) == 0.0
    for bad in (10**400, 1e300, float("inf"), "99999999h", float("nan"), "x" * 1000, True):
        with pytest.raises(InvalidRequestError):
            parse_keep_alive(bad)


# ------------------------------------------------------------------------------------------------- slow clients


def test_slowloris_is_cut_within_the_read_timeout_while_others_are_served(server):
    sock = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
    sock.settimeout(0.05)
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100
    t0, got, served = time.monotonic(), b"", 0
    try:
        for byte in request:  # one header byte a second (2 s read timeout in this module's server)
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            try:
                chunk = sock.recv(4096)
                got += chunk
                if not chunk:
                    break
            except socket.timeout:
                pass
            except OSError:
                break
            assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # others are served
            served += 1
            if time.monotonic() - t0 > 15:
                break
            time.sleep(0.95)
    finally:
        sock.close()
    took = time.monotonic() - t0
    assert b" 408 " in got.split(b"\r\n")[0] + b" ", got[:200]
    assert 1.5 < took < 5.0, took
    assert served >= 2


def test_disconnect_mid_body_is_one_info_line(server, caplog):
    caplog.set_level(logging.INFO, logger="mlx_engine.server")
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 500\r\n\r\n{\"model\": ")
        time.sleep(0.3)
    for _ in range(50):
        if any("/v1/chat/completions" in r.getMessage() for r in caplog.records):
            break
        time.sleep(0.1)
    lines = [r for r in caplog.records if "/v1/chat/completions" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO, [r.getMessage() for r in caplog.records]
    assert " 499 " in lines[0].getMessage() and "disconnected" in lines[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


# ----------------------------------------------------------------------------------------- start-up failures


def test_serve_startup_failures_are_one_error_line(store_root):
    env = dict(os.environ, MLX_ENGINE_HOME=str(store_root))
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    cases = {
        "a bad --model": (["--model", "no-such-model-here"], "no-such-model-here"),
        "a tiny --memory-budget": (["--model", MODEL, "--memory-budget", "1MB"], "memory budget"),
        "a port in use": (["--port", str(taken.getsockname()[1])], "is in use"),
    }

    def run(args):
        port = [] if "--port" in args else ["--port", str(free_port())]
        return subprocess.run([sys.executable, "-c", "from mlx_engine.cli.main import main; main()", "serve",
                               *port, *args], env=env, capture_output=True, text=True, timeout=300)

    try:
        with ThreadPoolExecutor(3) as pool:
            results = dict(zip(cases, pool.map(run, [a for a, _ in cases.values()])))
    finally:
        taken.close()
    for name, p in results.items():
        errors = [ln for ln in p.stderr.splitlines() if ln.startswith("Error: ")]
        assert p.returncode == 1, (name, p.returncode, p.stderr[-1500:])
        assert "Traceback" not in p.stderr and len(errors) == 1, (name, p.stderr[-1500:])
        assert cases[name][1] in errors[0], (name, errors)


# ------------------------------------------------------------------------------------------ memory over time


def _status(server) -> dict:
    r = httpx.get(server.url + "/status", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _settled(server, model: str) -> dict:
    """/status once no request of ``model`` runs or waits (and the device thread has been idle a second)."""
    for _ in range(300):
        m = _status(server)["models"].get(model, {})
        if not (m.get("decoding") or m.get("prefilling") or m.get("queued")):
            time.sleep(1.0)
            return _status(server)
        time.sleep(0.1)
    raise AssertionError(f"requests of {model} still running: {m}")


def test_dropped_streams_leave_no_cell_outside_the_prefix_cache(server):
    """Streams dropped after a few chunks and whole answers: afterwards every cell in use holds a token that the
    prefix cache records for its conversation (cells_in_use == cells_kept), and the cache keeps what it recorded."""
    def drop(i):
        with httpx.stream("POST", server.url + "/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": f"{i}, " + COUNTING, "max_tokens": 200, "stream": True}) as r:
            for k, _ in enumerate(r.iter_lines()):
                if k >= 2 + i:
                    break

    with ThreadPoolExecutor(5) as ex:
        list(ex.map(drop, range(3)))
        list(ex.map(lambda n: _completion(server.url, n), (5, 9)))
    m = _settled(server, MODEL)["models"][MODEL]
    assert m["cells_in_use"] > 0 and m["cells_in_use"] == m["cells_kept"], m
    assert m["cells_kept"] <= m["tokens_kept"], m  # shared prefixes hold one cell for several conversations


def test_memory_goes_back_after_an_unload_and_when_idle(server):
    """/status gives the process's memory; an unload frees the model's MLX arrays, and once the server is idle
    MLX's buffer cache is empty (given back to the system, not kept for reuse)."""
    assert _completion(server.url, 8)
    loaded = _settled(server, MODEL)
    mem = loaded["memory"]
    assert mem["resident"] > mem["mlx_active"] > loaded["models"][MODEL]["bytes"] * 0.9, mem
    assert mem["mlx_cache"] == 0, mem
    r = httpx.post(server.url + "/api/generate", json={"model": MODEL, "prompt": "", "keep_alive": 0}, timeout=120)
    assert r.status_code == 200 and r.json()["done_reason"] == "unload"
    time.sleep(1.0)
    after = _status(server)
    assert MODEL not in after["models"] and after["memory"]["mlx_cache"] == 0, after
    assert after["memory"]["mlx_active"] <= mem["mlx_active"] - loaded["models"][MODEL]["bytes"] * 0.9, (mem, after)


def test_the_soak_benchmark_runs(store_root):
    """benchmarks/soak.py, as docs/server-errors.md gives it but for a quarter of a minute with three clients: it
    starts its server, every kind of traffic gets its expected answer, and it exits 0 (its own verdict: no error, no
    request left running, no traceback or 500 in the server's log, a clean server exit)."""
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, MLX_ENGINE_HOME=str(store_root))
    env.pop("MLX_ENGINE_API_KEY", None)
    p = subprocess.run([sys.executable, str(repo / "benchmarks" / "soak.py"), "--minutes", "0.25", "--clients", "3",
                        "--timeout", "60"], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-2000:])
    all_line = next(ln for ln in p.stdout.splitlines() if ln.startswith("all "))
    requests, ok, expected_4xx, errors = (int(x) for x in all_line.split()[1:5])
    assert requests > 3 and ok > 0 and errors == 0 and ok + expected_4xx == requests, p.stdout
