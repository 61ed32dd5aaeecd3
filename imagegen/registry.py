"""Which pipeline class loads which diffusers folder: chosen by ``model_index.json``'s ``_class_name``, as diffusers'
``DiffusionPipeline.from_pretrained`` chooses it. A new image model (FLUX, Qwen-Image) adds its class here."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlx_engine.errors import UnsupportedError
from mlx_engine.imagegen.flux import KONTEXT_CLASSES, PIPELINE_CLASSES as _FLUX_CLASSES
from mlx_engine.imagegen.flux import FluxKontextPipeline, FluxPipeline
from mlx_engine.imagegen.flux2 import PIPELINE_CLASSES as _FLUX2_CLASSES
from mlx_engine.imagegen.flux2 import Flux2Pipeline
from mlx_engine.imagegen.pipeline import read_model_index
from mlx_engine.imagegen.qwen_image import PIPELINE_CLASSES as _QWEN_IMAGE_CLASSES
from mlx_engine.imagegen.qwen_image import QwenImagePipeline
from mlx_engine.imagegen.qwen_image_edit import PIPELINE_CLASSES as _QWEN_EDIT_CLASSES
from mlx_engine.imagegen.qwen_image_edit import PLUS_CLASSES as _QWEN_EDIT_PLUS_CLASSES
from mlx_engine.imagegen.qwen_image_edit import QwenImageEditPipeline, QwenImageEditPlusPipeline
from mlx_engine.imagegen.zimage import PIPELINE_CLASSES as _ZIMAGE_CLASSES
from mlx_engine.imagegen.zimage import ZImagePipeline
from mlx_engine.ml import Backend

#: ``_class_name`` -> the pipeline class that loads such a folder.
PIPELINES: dict[str, type] = {**{name: ZImagePipeline for name in _ZIMAGE_CLASSES},
                               **{name: FluxPipeline for name in _FLUX_CLASSES},
                               **{name: FluxKontextPipeline for name in KONTEXT_CLASSES},
                               **{name: QwenImagePipeline for name in _QWEN_IMAGE_CLASSES},
                               **{name: QwenImageEditPipeline for name in _QWEN_EDIT_CLASSES},
                               **{name: QwenImageEditPlusPipeline for name in _QWEN_EDIT_PLUS_CLASSES},
                               **{name: Flux2Pipeline for name in _FLUX2_CLASSES}}


def load_pipeline(folder: "str | os.PathLike[str]", make_backend: Callable[[Path], Backend], **options: Any):
    """The pipeline of a diffusers folder, loaded: ``PIPELINES[model_index["_class_name"]](folder, make_backend,
    **options)`` (options: ``quantize``, ``keep_text_encoder``, ``resolve_model``, ``memory_check``).

    Raises:
        ModelNotFoundError: no such folder, or no ``model_index.json``. UnsupportedError: a pipeline class this
        engine does not run (the message lists those it does). WeightsError: as the pipeline's loading.
    """
    path = Path(os.fspath(folder))
    name = read_model_index(path).get("_class_name")
    cls = PIPELINES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise UnsupportedError(f"{path}: pipeline {name!r} is not supported; this engine runs "
                               f"{', '.join(sorted(PIPELINES))} folders")
    return cls(path, make_backend, **options)
