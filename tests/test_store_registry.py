"""Pulling by ollama names from a registry server started here on loopback (ollama's OCI-style API), serving the real
smollm2 GGUF: an interrupted download resumes, a wrong digest or a truncated blob leaves nothing that looks like a
model, and `run NAME` with an unknown name is an error, never a silent fallback."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import mlx_engine
from mlx_engine.errors import PullError
from mlx_engine.store import Store
from mlx_engine.store.registry import MODEL_LAYER, parse_registry_name

LICENSE = b"Apache License 2.0\n\nThe full text would follow.\n"
TEMPLATE = b"{{ .Prompt }}"


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Registry:
    """A registry on a free loopback port. ``models[name:tag] = (blob bytes or path, digest override)``."""

    def __init__(self, gguf_path):
        self.gguf = gguf_path.read_bytes()
        self.gguf_digest = _digest(self.gguf)
        self.blobs = {self.gguf_digest: self.gguf, _digest(LICENSE): LICENSE, _digest(TEMPLATE): TEMPLATE,
                      "sha256:" + "0" * 64: self.gguf}  # served under a digest its bytes do not have
        self.ranges: list[str | None] = []
        self.delay = 0.0  # seconds per 256 KiB sent
        self.truncate_at: int | None = None
        self.extra: set[str] = set()  # more model names served (as the real GGUF)
        reg = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                mo = re.fullmatch(r"/v2/library/([^/]+)/manifests/([^/]+)", self.path)
                if mo:
                    return self._manifest(mo.group(1), mo.group(2))
                mo = re.fullmatch(r"/v2/library/[^/]+/blobs/(sha256:[0-9a-f]{64})", self.path)
                if mo and mo.group(1) in reg.blobs:
                    return self._blob(reg.blobs[mo.group(1)])
                self.send_error(404)

            def _manifest(self, model, tag):
                model_digest = {"tinychat": reg.gguf_digest, "baddigest": "sha256:" + "0" * 64,
                                "truncated": reg.gguf_digest, **{n: reg.gguf_digest for n in reg.extra}}.get(model)
                if model_digest is None or tag not in ("135m", "latest"):
                    return self.send_error(404)
                body = json.dumps({"schemaVersion": 2, "layers": [
                    {"mediaType": MODEL_LAYER, "digest": model_digest, "size": len(reg.gguf)},
                    {"mediaType": "application/vnd.ollama.image.license", "digest": _digest(LICENSE),
                     "size": len(LICENSE)},
                    {"mediaType": "application/vnd.ollama.image.template", "digest": _digest(TEMPLATE),
                     "size": len(TEMPLATE)}]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _blob(self, data):
                rng = self.headers.get("Range")
                if data is reg.gguf:
                    reg.ranges.append(rng)
                start = int(re.fullmatch(r"bytes=(\d+)-", rng).group(1)) if rng else 0
                self.send_response(206 if rng else 200)
                if rng:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                end = len(data) if reg.truncate_at is None or data is not reg.gguf else reg.truncate_at
                try:
                    for i in range(start, end, 1 << 18):
                        self.wfile.write(data[i:min(i + (1 << 18), end)])
                        if reg.delay:
                            time.sleep(reg.delay)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


@pytest.fixture
def registry(smollm2_gguf, home, monkeypatch):
    reg = Registry(smollm2_gguf)
    monkeypatch.setenv("MLX_ENGINE_OLLAMA_REGISTRY", reg.url)
    yield reg
    reg.close()


def test_registry_names():
    assert parse_registry_name("llama3.2").name == "llama3.2:latest"
    assert parse_registry_name("gemma3:4b").name == "gemma3:4b"
    assert parse_registry_name("user/model:q4").name == "user/model:q4"
    for bad in ("What is", "./x.gguf", "hf:org/repo", "a/b/c", "Hello", ""):
        assert parse_registry_name(bad) is None, bad


def test_pull_resumes_after_sigkill_and_the_model_runs(registry, home):
    registry.delay = 0.02  # about 13 MB/s: the pull is still running when it is killed
    env = dict(os.environ)
    proc = subprocess.Popen([sys.executable, "-c", "from mlx_engine.cli.main import main; main()", "pull",
                             "tinychat:135m", "-q"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    partial = home / "models" / "tinychat-135m" / ".model.gguf.partial"
    for _ in range(600):
        if partial.exists() and partial.stat().st_size > 8 << 20:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    kept = partial.stat().st_size
    assert 0 < kept < len(registry.gguf)
    assert Store(home).find("tinychat:135m") is None  # nothing looks like a model yet
    registry.delay = 0.0
    resolved = Store(home).pull("tinychat:135m", progress=False)
    assert registry.ranges[-1] is not None and int(registry.ranges[-1][6:-1]) >= kept  # it resumed
    assert resolved.path.read_bytes() == registry.gguf and not partial.exists()
    assert resolved.license == "Apache License 2.0"
    model = mlx_engine.load("tinychat:135m", pull=False)
    assert model.generate("What is the capital of France?", max_tokens=8).strip()
    show = Store(home).show("tinychat:135m")
    assert show.architecture == "llama" and show.source == "ollama-registry"


def test_a_wrong_digest_or_a_truncated_blob_leaves_no_model(registry, home):
    with pytest.raises(PullError, match="does not verify"):
        Store(home).pull("baddigest:135m", progress=False)
    folder = home / "models" / "baddigest-135m"
    assert Store(home).find("baddigest:135m") is None
    assert not (folder / "model.gguf").exists() and not list(folder.glob(".*.partial"))
    registry.truncate_at = 5 << 20
    with pytest.raises(PullError, match="pull again to resume"):
        Store(home).pull("truncated:135m", progress=False)
    assert Store(home).find("truncated:135m") is None
    assert not (home / "models" / "truncated-135m" / "model.gguf").exists()
    with pytest.raises(mlx_engine.errors.ModelNotFoundError, match="ollama registry"):
        Store(home).pull("nosuchmodel:1b", progress=False)


def test_run_with_an_unknown_name_is_an_error_not_a_fallback(registry, home):
    r = subprocess.run([sys.executable, "-c", "from mlx_engine.cli.main import main; main()", "run", "llama3.2",
                        "Hi"], env=dict(os.environ), capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("Error: unknown model 'llama3.2'") and "Traceback" not in r.stderr
    assert "nor in ollama's registry" in r.stderr and 'mlx-engine run "llama3.2 Hi"' in r.stderr
