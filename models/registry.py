"""Which architecture class reads which checkpoint."""

from __future__ import annotations

from mlx_engine.errors import UnsupportedError
from mlx_engine.ml import Backend
from models.base import DecoderModel
from models.gemma3 import Gemma3
from models.llama import Llama
from models.qwen3 import Qwen3

# Names as GGUF's general.architecture and Hugging Face's model_type spell them.
ARCHITECTURES: dict[str, type[DecoderModel]] = {
    "llama": Llama, "mistral": Llama, "gemma3": Gemma3, "gemma3_text": Gemma3, "qwen3": Qwen3,
}


def checkpoint_architecture(backend: Backend) -> tuple[str, str]:
    """``(architecture, source)`` of a loaded checkpoint; ``source`` is ``"gguf"`` or ``"hf"``."""
    meta = backend.metadata
    if "general.architecture" in meta:
        return str(meta["general.architecture"]), "gguf"
    arch = meta.get("model_type")
    if arch is None and meta.get("architectures"):
        arch = str(meta["architectures"][0]).lower().replace("forcausallm", "")
    if arch == "gemma3" and "text_config" in meta:
        arch = "gemma3"
    return str(arch), "hf"


def load_text_model(backend: Backend) -> DecoderModel:
    """Build the architecture's model over a loaded backend.

    Raises:
        UnsupportedError: the architecture is not one we support (the message names those we do).
        WeightsError: the checkpoint lacks tensors or config keys the architecture needs.
    """
    arch, source = checkpoint_architecture(backend)
    cls = ARCHITECTURES.get(arch)
    if cls is None:
        raise UnsupportedError(f"unknown model architecture {arch!r}; supported: "
                               f"{', '.join(sorted(set(ARCHITECTURES)))}")
    return cls.from_backend(backend, source)
