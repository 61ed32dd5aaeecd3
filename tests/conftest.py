"""Shared fixtures.

The real models live in the default model store (``$MLX_ENGINE_HOME``, else the user's cache folder) and are pulled
on first use, so a second test run does not download them again.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mlx_engine.store import Store


@pytest.fixture(scope="session")
def model_store() -> Store:
    """The default model store, as it was when the session started (before any test changes the environment)."""
    return Store()


@pytest.fixture(scope="session")
def smollm2_gguf(model_store: Store) -> Path:
    """``SmolLM2-135M-Instruct.Q4_1.gguf`` (llama architecture, instruct, ChatML template) in the store."""
    return model_store.pull("smollm2:135m", progress=False).path


@pytest.fixture(scope="session")
def gemma3_gguf(model_store: Store) -> Path:
    """``gemma-3-270m-q4_k_m.gguf`` (gemma3 architecture, base model, no chat template) in the store."""
    return model_store.pull("gemma3:270m", progress=False).path
