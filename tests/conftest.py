"""Shared fixtures.

The real models live in the default model store (``$MLX_ENGINE_HOME``, else the user's cache folder) and are pulled
on first use, so a second test run does not download them again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

# On an NVIDIA GPU cuBLAS rounds float32 matrix products through TF32 (a 10-bit mantissa) unless this is 0: the
# tests hold float32 results to float32 references, so they ask for IEEE float32 before MLX loads cuBLAS (no effect
# elsewhere).
os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")

from mlx_engine.store import Store, default_root  # noqa: E402

_SESSION_ROOT = default_root()  # read once, before any test changes the environment

# No test reaches the internet: ollama's registry is a closed loopback port unless a test starts its own.
os.environ["MLX_ENGINE_OLLAMA_REGISTRY"] = "http://127.0.0.1:9"


@pytest.fixture(scope="session")
def model_store() -> Store:
    """The default model store ($MLX_ENGINE_HOME or the user's cache folder, as the session started)."""
    return Store(_SESSION_ROOT)


@pytest.fixture(scope="session")
def smollm2_gguf(model_store: Store) -> Path:
    """``SmolLM2-135M-Instruct.Q4_1.gguf`` (llama architecture, instruct, ChatML template) in the store."""
    return model_store.pull("smollm2:135m", progress=False).path


@pytest.fixture(scope="session")
def gemma3_gguf(model_store: Store) -> Path:
    """``gemma-3-270m-q4_k_m.gguf`` (gemma3 architecture, base model, no chat template) in the store."""
    return model_store.pull("gemma3:270m", progress=False).path


@pytest.fixture(scope="module")
def smollm2_model(smollm2_gguf: Path):
    """SmolLM2 loaded once per test module (context 512), let go after it. Tests that change it must put it back."""
    import mlx_engine

    return mlx_engine.load(str(smollm2_gguf), progress=False, context_length=512)


def link_model(source_folder: Path, root: Path) -> Path:
    """Put a model of another store into the store at ``root`` without copying: its files as symbolic links, its
    manifest copied. Returns the new model folder."""
    dest = root / "models" / source_folder.name
    dest.mkdir(parents=True)
    for f in source_folder.iterdir():
        if f.name == "manifest.json":
            (dest / f.name).write_bytes(f.read_bytes())
        elif f.is_file() and not f.name.startswith("."):
            (dest / f.name).symlink_to(f.resolve())
    return dest


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty store: ``$MLX_ENGINE_HOME`` set to a fresh folder (and no ollama models) for this test."""
    root = tmp_path / "home"
    root.mkdir()
    monkeypatch.setenv("MLX_ENGINE_HOME", str(root))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "no-ollama"))
    return root


@pytest.fixture
def home_with_smollm2(home: Path, smollm2_gguf: Path) -> Path:
    """:func:`home` holding smollm2:135m (linked from the session's store)."""
    link_model(smollm2_gguf.parent, home)
    return home


@pytest.fixture
def smollm2_server(home_with_smollm2: Path):
    """An HTTP server (in this process, on a free loopback port) serving smollm2:135m from :func:`home_with_smollm2`;
    ``.url`` is its address."""
    from mlx_engine.server import ServerConfig
    from tests.test_server import RunningServer, free_port

    srv = RunningServer(ServerConfig(port=free_port(), models=["smollm2:135m"], max_sequences=4, context_length=2048,
                                     store_root=str(home_with_smollm2)))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def mlx_on_the_cpu():
    """MLX's default device set to the CPU for a module: our CPU kernels are held to MLX operations that run there
    too (on a GPU, MLX's float32 matmuls round through TF32)."""
    import mlx.core as mx

    before = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(before)


def passed_on_avx2(test_file: str, selection: str) -> int:
    """How many of ``test_file``'s tests that ``selection`` (pytest's ``-k``) picks pass in a process told to take
    the AVX2 copy of the CPU kernels ($MLX_ENGINE_CPU_ISA=avx2, which an AVX-512 machine never picks by itself);
    asserts that none fails."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", selection],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "MLX_ENGINE_CPU_ISA": "avx2"})
    assert r.returncode == 0, r.stdout[-3000:]
    return int(r.stdout.rsplit(" passed", 1)[0].split()[-1])


class NoText:
    """The runner's view of a tokenizer for token-level tests: no end-of-sequence id stops generation, no chat
    template, no thinking span."""

    eos_ids: frozenset = frozenset()
    chat_template = None

    @staticmethod
    def token_to_id(token: str) -> None:
        return None


def logits_for(model, runner, tokens, sequence: int = 0) -> np.ndarray:
    """First-step logits ``[vocab]`` (float32, host) of a prompt, a prefill through ``runner``: for parity checks
    against reference models."""
    from mlx_engine.ml import DType

    with model.backend.new_context() as ctx:
        runner.reset(sequence)
        logits, _ = runner.prefill(ctx, sequence, list(tokens))
        return logits.astype(DType.FLOAT32).numpy()[0]
