"""Which architecture class reads which checkpoint, and the one loader of text checkpoints (model and tokenizer),
used by :func:`mlx_engine.load` and by the image pipelines' text encoders alike."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlx_engine.errors import EngineError, UnsupportedError
from mlx_engine.ml import Backend, DType
from mlx_engine.models.layers.base import DecoderModel
from mlx_engine.models.layers.config import DecoderConfig
from mlx_engine.models.arch.deepseek2 import DeepSeek2
from mlx_engine.models.arch.bert import ENCODER_ARCHITECTURES
from mlx_engine.models.arch.gemma2 import Gemma2
from mlx_engine.models.arch.gemma3 import Gemma3
from mlx_engine.models.arch.gemma4 import Gemma4
from mlx_engine.models.arch.glm4_moe import Glm4MoE
from mlx_engine.models.arch.glm4_moe_lite import Glm4MoeLite
from mlx_engine.models.arch.gpt_oss import GptOss
from mlx_engine.models.arch.granite import Granite
from mlx_engine.models.arch.granite_hybrid import GraniteHybrid
from mlx_engine.models.arch.lfm2 import LFM2
from mlx_engine.models.arch.llama import Llama
from mlx_engine.models.arch.llama4 import Llama4
from mlx_engine.models.arch.mistral3 import Mistral3
from mlx_engine.models.arch.mllama import Mllama
from mlx_engine.models.arch.olmo2 import Olmo2
from mlx_engine.models.arch.qwen2 import Qwen2, Qwen25VL
from mlx_engine.models.arch.phi3 import Phi3
from mlx_engine.models.arch.qwen3 import Qwen3
from mlx_engine.models.arch.qwen3_5 import Qwen35, Qwen35MoE
from mlx_engine.models.arch.qwen3_next import Qwen3Next
from mlx_engine.models.arch.qwen_moe import Qwen2MoE, Qwen3MoE
from mlx_engine.models.arch.smollm3 import SmolLM3
from mlx_engine.models.text.tokenizer import Tokenizer

# Names as GGUF's general.architecture and Hugging Face's model_type spell them.
ARCHITECTURES: dict[str, type[DecoderModel]] = {
    "llama": Llama, "mistral": Llama, "qwen2": Qwen2, "gemma2": Gemma2, "gemma3": Gemma3, "gemma3_text": Gemma3,
    "gemma-embedding": Gemma3,
    "qwen2_5_vl": Qwen25VL,
    "gemma4": Gemma4, "gemma4_text": Gemma4,
    "qwen3": Qwen3, "lfm2": LFM2, "qwen3_next": Qwen3Next, "qwen3next": Qwen3Next, "mllama": Mllama,
    "olmo2": Olmo2, "smollm3": SmolLM3,
    "qwen3_moe": Qwen3MoE, "qwen3moe": Qwen3MoE, "qwen2_moe": Qwen2MoE, "qwen2moe": Qwen2MoE,
    "phi3": Phi3, "granite": Granite, "mistral3": Mistral3, "ministral3": Mistral3,
    "deepseek2": DeepSeek2, "deepseek_v3": DeepSeek2, "kimi_k2": DeepSeek2,
    "qwen3_5": Qwen35, "qwen3_5_text": Qwen35, "qwen35": Qwen35,
    "qwen3_5_moe": Qwen35MoE, "qwen3_5_moe_text": Qwen35MoE, "qwen35moe": Qwen35MoE,
    "gpt_oss": GptOss, "gpt-oss": GptOss, "glm4_moe": Glm4MoE, "glm4moe": Glm4MoE,
    "glm4_moe_lite": Glm4MoeLite,
    "llama4": Llama4, "llama4_text": Llama4,
    "granitemoehybrid": GraniteHybrid, "granitehybrid": GraniteHybrid,
}


def checkpoint_architecture(backend: "Backend | Any") -> tuple[str, str]:
    """``(architecture, source)`` of a loaded checkpoint (or an open weight file); ``source`` is ``"gguf"`` or
    ``"hf"``."""
    meta = backend.metadata
    if "general.architecture" in meta:
        return str(meta["general.architecture"]), "gguf"
    arch = meta.get("model_type")
    if arch is None and meta.get("architectures"):
        arch = str(meta["architectures"][0]).lower().replace("forcausallm", "")
    if arch == "gemma3" and "text_config" in meta:
        arch = "gemma3"
    return str(arch), "hf"


def architecture_class(checkpoint: "Backend | Any") -> tuple[type[DecoderModel], str]:
    """The architecture class and the source (``gguf`` or ``hf``) of a loaded backend or an open weight file.
    Raises ``UnsupportedError`` naming the architectures we run."""
    arch, source = checkpoint_architecture(checkpoint)
    cls = ARCHITECTURES.get(arch)
    if cls is None and arch in ENCODER_ARCHITECTURES:
        raise UnsupportedError(f"{arch} is an embedding model, not a chat model: embed with it (mlx_engine.load(...)"
                               ".embed, `mlx-engine embed`, POST /v1/embeddings or /api/embed)")
    if cls is None:
        raise UnsupportedError(f"unknown model architecture {arch!r}; supported: "
                               f"{', '.join(sorted(set(ARCHITECTURES)))}")
    return cls, source


def half_dtype(path: Path) -> DType:
    """The 16-bit dtype the checkpoint at ``path`` computes in on a GPU (:attr:`DecoderModel.half_dtype`), read from
    its metadata alone; float16 where the file cannot be read or its architecture is unknown (the load itself then
    says what is wrong)."""
    from mlx_engine.weights import open_weights

    try:
        with open_weights(path) as wf:
            cls, _ = architecture_class(wf)
    except EngineError:
        return DType.FLOAT16
    return cls.half_dtype


def load_text_model(backend: Backend, part: Any = None) -> DecoderModel:
    """Build the architecture's model over a loaded backend (``part``: see :meth:`DecoderModel.from_backend`).

    Raises:
        UnsupportedError: the architecture is not one we support (the message names those we do).
        WeightsError: the checkpoint lacks tensors or config keys the architecture needs.
    """
    cls, source = architecture_class(backend)
    return cls.from_backend(backend, source, part)


@dataclass
class TextCheckpoint:
    """A loaded text checkpoint: its ``backend`` (weights, metadata, memory controls), the architecture's ``model``,
    and its ``tokenizer``. :meth:`close` drops the weights."""

    backend: Backend
    model: DecoderModel
    tokenizer: Tokenizer

    def close(self) -> None:
        if self.model.vision is not None:
            self.model.vision.close()
        self.backend.close()


def load_text_checkpoint(path: Path, make_backend: Callable[[Path], Backend], *,
                         tokenizer_folder: Path | None = None, part: Any = None,
                         mmproj: Path | None = None) -> TextCheckpoint:
    """Load a text model and its tokenizer from a GGUF file or a Hugging Face folder.

    A GGUF file holds its tokenizer in its metadata (``tokenizer.ggml.*``, the chat template); a folder's tokenizer
    is read from ``tokenizer_folder`` when given (a diffusers pipeline keeps it beside the text encoder), else from
    the folder itself. The backend is closed again when anything fails.

    Args:
        path: the ``.gguf`` file (an ollama blob has no extension) or the model folder.
        make_backend: ``make_backend(path) -> Backend`` (the API passes ``MLXBackend`` with its device and dtype).
        mmproj: llama.cpp's separate vision file for a Gemma 3 GGUF (``models.vision.Gemma3Vision.from_mmproj``).

    Raises:
        WeightsError: a corrupt or incomplete checkpoint or tokenizer. UnsupportedError: an architecture we do not
        run. KeyError: a tensor the architecture needs is missing (callers name their folder in the message).
    """
    from mlx_engine.models.vision.mllama_vision import MllamaVision
    from mlx_engine.models.vision.vision import Gemma3Vision

    path = Path(path)
    backend = make_backend(path)
    vision_backend = None
    try:
        model = load_text_model(backend, part)
        tokenizer = (Tokenizer.from_gguf(backend.metadata) if path.is_file()
                     else Tokenizer.from_folder(tokenizer_folder if tokenizer_folder is not None else path))
        if mmproj is not None:
            if model.architecture != "gemma3":
                raise UnsupportedError(f"an mmproj file goes with a Gemma 3 model, not {model.architecture}")
            vision_backend = make_backend(Path(mmproj))
            model.vision = Gemma3Vision.from_mmproj(vision_backend, model.config.hidden_size, tokenizer.token_to_id)
        elif part is None:
            # (Gemma 4's towers are not read: its text model runs without them)
            vision_class = {"mllama": MllamaVision, "gemma3": Gemma3Vision}.get(model.architecture)
            if vision_class is not None:
                model.vision = vision_class.from_backend(backend, model.config.hidden_size, tokenizer.token_to_id)
    except BaseException:
        if vision_backend is not None:
            vision_backend.close()
        backend.close()
        raise
    return TextCheckpoint(backend, model, tokenizer)


class _FileTensors:
    """A weight file's tensors as far as reading a config needs them: shapes, and the data of small ones."""

    def __init__(self, wf: Any):
        self.wf = wf
        self.names = set(wf.names())

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] if name in self.names else default

    def __getitem__(self, name: str) -> Any:
        if name not in self.names:
            raise KeyError(name)
        wf = self.wf

        class _T:
            shape = wf.shape(name)

            @staticmethod
            def numpy() -> np.ndarray:
                return np.asarray(wf.load(name))
        return _T()


def file_config(wf: Any) -> DecoderConfig:
    """The model config of an open weight file, read before any large tensor is (raises like loading does); what
    :func:`mlx_engine.models.layers.sharding.plan` divides among the ranks."""
    cls, source = architecture_class(wf)
    if source == "gguf":
        return cls.config_from_gguf(wf.metadata, _FileTensors(wf))
    return cls.config_from_hf(wf.metadata)
