"""The model store: model names, the catalog, pulling, and the on-disk store.

One job a module: :mod:`~mlx_engine.store.catalog` (the named models), :mod:`~mlx_engine.store.resolve` (what a model
argument means), :mod:`~mlx_engine.store.wheels` (catalog pulls from PyPI wheels), :mod:`~mlx_engine.store.hub`
(``hf:`` pulls), :mod:`~mlx_engine.store.ollama` (models pulled with ollama), :mod:`~mlx_engine.store.manifest`
(the layout on disk, manifests and atomic writes), :mod:`~mlx_engine.store.info` (what ``list`` and ``show`` print),
:mod:`~mlx_engine.store.format` (numbers as printed), :mod:`~mlx_engine.store.integrity` (pulled files checked
against their recorded sha256), :mod:`~mlx_engine.store.space` (free disk space), :mod:`~mlx_engine.store.child`
(pip dies with the pull), and :class:`Store` tying them together.
"""

from mlx_engine.errors import PullError
from mlx_engine.store.catalog import (CATALOG, DEFAULT_IMAGE_MODEL, DEFAULT_MODEL, IMAGE_CATALOG, CatalogEntry,
                                      WheelMember, canonical_name, image_model_path)
from mlx_engine.store.format import format_bytes, format_count
from mlx_engine.store.info import ModelInfo
from mlx_engine.store.manifest import ResolvedModel, default_root, safe_name
from mlx_engine.store.ollama import ollama_models_dir
from mlx_engine.store.registry import parse_registry_name
from mlx_engine.store.store import Store

__all__ = [
    "parse_registry_name",
    "CATALOG", "DEFAULT_IMAGE_MODEL", "DEFAULT_MODEL", "IMAGE_CATALOG", "CatalogEntry", "ModelInfo", "PullError",
    "ResolvedModel", "Store", "WheelMember", "canonical_name", "default_root", "format_bytes", "format_count",
    "image_model_path", "ollama_models_dir", "safe_name",
]
