"""The server answers only the clients its user meant (Host, Origin, Content-Type) and serves the store, not the disk.

Real HTTP against one server on a loopback port, with the real ``openai`` and ``ollama`` clients where they apply.
Oracles: the browser's rules (a cross-origin request carries ``Origin``; a rebinding attack carries the attacker's
``Host``; text/plain, form and multipart bodies need no preflight), and the server's answer for an unknown name.
"""

from __future__ import annotations

import httpx
import ollama
import openai
import pytest

from mlx_engine.errors import InvalidRequestError
from mlx_engine.server import ServerConfig
from mlx_engine.server.guard import BrowserGuard, host_name
from tests.conftest import link_model
from tests.test_server import RunningServer, free_port

CHAT = {"model": "smollm2:135m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def srv(tmp_path_factory, smollm2_gguf, gemma3_gguf):
    home = tmp_path_factory.mktemp("guard-home")
    link_model(smollm2_gguf.parent, home)
    escape = tmp_path_factory.mktemp("escape")
    (escape / "elsewhere.gguf").symlink_to(gemma3_gguf)  # a link inside a --models-dir to a file outside it
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OLLAMA_MODELS", str(home / "no-ollama"))  # the answers must not depend on this machine's ollama
        server = RunningServer(ServerConfig(
            port=free_port(), models=["smollm2:135m"], max_sequences=2, context_length=512, store_root=str(home),
            allowed_hosts=["myhost.lan"], allowed_origins=["https://good.example"],
            models_dirs=[str(smollm2_gguf.parent), str(escape)], pull=False))
        server.escape = escape
        yield server
        server.stop()


def _openai(srv, **headers) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, default_headers=headers)


# ---- browser safety ----------------------------------------------------------------------------------------------
def test_cross_origin_requests_and_rebinding_are_refused(srv):
    with pytest.raises(openai.PermissionDeniedError) as e:
        _openai(srv, Origin="http://evil.example").chat.completions.create(**CHAT)
    assert e.value.status_code == 403 and "http://evil.example" in e.value.body["message"]
    assert "--allowed-origins" in e.value.body["message"] and e.value.body["code"] == 403
    with pytest.raises(openai.PermissionDeniedError) as e:
        _openai(srv, Host="attacker.example").chat.completions.create(**CHAT)
    assert "attacker.example" in e.value.body["message"] and "--allowed-hosts" in e.value.body["message"]
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=srv.url, headers={"Host": "attacker.example:11435"}).list()
    assert e.value.status_code == 403 and "attacker.example" in e.value.error
    # what a page would have done: unload the model with a no-preflight request; refused, and nothing unloaded
    r = httpx.post(srv.url + "/api/generate", json={"model": "smollm2:135m", "keep_alive": 0},
                   headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and isinstance(r.json()["error"], str)
    assert "access-control-allow-origin" not in r.headers
    assert "smollm2:135m" in srv.state.pool.models
    preflight = httpx.options(srv.url + "/v1/chat/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 403 and "access-control-allow-origin" not in preflight.headers


def test_bodies_a_page_may_send_without_preflight_are_refused(srv):
    r = httpx.post(srv.url + "/v1/chat/completions", content=b'{"model": "smollm2:135m"}',
                   headers={"Content-Type": "text/plain;charset=UTF-8"})
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    r = httpx.post(srv.url + "/api/generate", data={"model": "smollm2:135m", "keep_alive": "0"})
    assert r.status_code == 415 and "application/x-www-form-urlencoded" in r.json()["error"]
    r = httpx.post(srv.url + "/api/pull", files={"model": ("m", b"gemma3:270m")})
    assert r.status_code == 415 and "multipart/form-data" in r.json()["error"]
    # JSON types, and no type at all (as some clients send), are read
    assert httpx.post(srv.url + "/api/show", content=b'{"model": "smollm2:135m"}').status_code == 200
    for kind in ("application/json; charset=utf-8", "application/vnd.api+json"):
        r = httpx.post(srv.url + "/api/show", content=b'{"model": "smollm2:135m"}', headers={"Content-Type": kind})
        assert r.status_code == 200, (kind, r.text)


def test_allowed_origins_and_hosts_are_answered(srv):
    for origin in ("http://localhost:5173", "https://good.example", "vscode-webview://abc"):
        r = _openai(srv, Origin=origin).chat.completions.with_raw_response.create(**CHAT)
        assert r.http_response.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        assert r.parse().choices[0].message.content
    assert _openai(srv, Host="myhost.lan:8080").models.list().data
    assert ollama.Client(host=srv.url, headers={"Host": "app.localhost:3000"}).list().models is not None
    assert httpx.get(srv.url + "/api/version", headers={"Host": "[::1]:11435"}).status_code == 200
    r = httpx.options(srv.url + "/v1/chat/completions", headers={
        "Origin": "https://good.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert r.status_code == 204 and r.headers["access-control-allow-origin"] == "https://good.example"
    allowed = {h.strip().lower() for h in r.headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "content-type", "x-api-key"} <= allowed
    assert "POST" in r.headers["access-control-allow-methods"]


def test_hosts_beyond_loopback_and_config_checks():
    import socket

    def ok(bound, host):
        return BrowserGuard(None, bound=bound).host_allowed(host)

    assert host_name("[::1]:80") == "::1" and host_name("LocalHost.:1") == "localhost"
    assert host_name("localhost:x") is None and host_name("[]") is None
    assert ok("127.0.0.1", "localhost:1") and ok("127.0.0.1", "a.b.localhost") and ok("127.0.0.1", "127.0.0.9")
    assert not ok("127.0.0.1", "attacker.example")
    if not socket.gethostname().lower().endswith("localhost"):
        assert not ok("127.0.0.1", socket.gethostname())
    # bound to every address: the machine's own name and addresses too, never someone else's
    assert ok("0.0.0.0", socket.gethostname()) and ok("0.0.0.0", "0.0.0.0:11435")
    assert not ok("0.0.0.0", "192.0.2.1") and not ok("0.0.0.0", "attacker.example")
    assert ok("10.1.2.3", "10.1.2.3:80") and not ok("10.1.2.3", "10.1.2.4")
    for bad in ({"allowed_origins": ["example.com"]}, {"allowed_hosts": ["http://x.example/"]},
                {"models_dirs": ["/no/such/folder"]}):
        with pytest.raises(InvalidRequestError):
            ServerConfig(**bad).check()


# ---- the store, not the disk ---------------------------------------------------------------------------------------
def test_paths_outside_the_models_dirs_are_answered_as_unknown_names(srv, smollm2_gguf, gemma3_gguf, tmp_path):
    def ask(model):
        return (httpx.post(srv.url + "/v1/chat/completions", json={**CHAT, "model": model}),
                httpx.post(srv.url + "/api/chat", json={**CHAT, "model": model, "stream": False}),
                httpx.post(srv.url + "/api/show", json={"model": model}))

    outside = tmp_path / "model.gguf"
    before = ask(str(outside))
    outside.write_bytes(gemma3_gguf.read_bytes()[:4096])  # now it exists (a GGUF's start): still unknown
    after = ask(str(outside))
    for b, a in zip(before, after):
        assert b.status_code == a.status_code == 404 and b.content == a.content
    assert "--models-dir" in after[0].json()["error"]["message"]
    name = "zzzz-no-model"
    unknown = ask(name)
    for path_answer, name_answer in zip(after, unknown):
        assert path_answer.text.replace(str(outside), "X") == name_answer.text.replace(name, "X")
    for refused in (str(gemma3_gguf), str(srv.escape / "elsewhere.gguf"),
                    str(smollm2_gguf.parent / ".." / gemma3_gguf.parent.name / gemma3_gguf.name),
                    "file://" + str(gemma3_gguf)):
        r = httpx.post(srv.url + "/api/generate", json={"model": refused, "prompt": "hi", "stream": False})
        assert r.status_code == 404 and f"model {refused!r} not found" in r.json()["error"], r.text
    assert not any(m != "smollm2:135m" for m in srv.state.pool.models)


def test_a_path_inside_a_models_dir_is_served(srv, smollm2_gguf):
    r = ollama.Client(host=srv.url).generate(model=str(smollm2_gguf), prompt="Say hi.", options={"num_predict": 3})
    assert r.done and r.eval_count > 0
    assert str(smollm2_gguf.resolve()) in srv.state.pool.models
    ollama.Client(host=srv.url).generate(model=str(smollm2_gguf), prompt="", keep_alive=0)  # unload: leave room


def test_images_are_bytes_never_paths(srv, tmp_path):
    picture = tmp_path / "a.png"
    picture.write_bytes(b"\x89PNG\r\n\x1a\n")
    for image in (str(picture), "file://" + str(picture), "../" + picture.name):
        for path, body in (("/api/chat", {"model": "smollm2:135m", "stream": False, "messages": [
                {"role": "user", "content": "what is this?", "images": [image]}]}),
                           ("/api/generate", {"model": "smollm2:135m", "stream": False, "prompt": "what is this?",
                                              "images": [image]})):
            r = httpx.post(srv.url + path, json=body)
            assert r.status_code == 400 and "reads no files" in r.json()["error"], (image, r.text)
    with pytest.raises(openai.BadRequestError, match="data: URL"):
        _openai(srv).chat.completions.create(model="smollm2:135m", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "file://" + str(picture)}}]}])


def test_no_pull_refuses_pulls(srv):
    client = ollama.Client(host=srv.url)
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("gemma3:270m")
    assert e.value.status_code == 403 and "--no-pull" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="gemma3:270m", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 404 and "--no-pull" in e.value.error
    assert "gemma3:270m" not in {m.model for m in client.list().models}


def test_the_cli_takes_the_options_and_their_environment_variables(monkeypatch, tmp_path):
    import os

    from click.testing import CliRunner

    import mlx_engine.server as server_package
    from mlx_engine.cli.serve import serve

    got = []
    monkeypatch.setattr(server_package, "serve", got.append)  # the config the server would run with
    monkeypatch.setattr(os, "_exit", lambda code: None)
    env = {"MLX_ENGINE_ALLOWED_HOSTS": "a.lan,b.lan", "MLX_ENGINE_ORIGINS": "'https://x.example'",
           "MLX_ENGINE_NO_PULL": "1"}
    r = CliRunner().invoke(serve, ["--models-dir", str(tmp_path), "--allowed-hosts", "c.lan"], env=env)
    assert r.exit_code == 0, r.output
    assert got[0].pull is False and got[0].models_dirs == [str(tmp_path)]
    assert got[0].allowed_hosts == ["c.lan"] and got[0].allowed_origins == ["'https://x.example'"]
    guard = BrowserGuard(None, bound="127.0.0.1", allowed_origins=got[0].allowed_origins,
                         allowed_hosts=["a.lan,b.lan"])
    assert guard.origin_allowed("https://x.example", None) and guard.host_allowed("b.lan:80")
    r = CliRunner().invoke(serve, [], env=env)
    assert got[1].allowed_hosts == ["a.lan,b.lan"] and got[1].pull is False
