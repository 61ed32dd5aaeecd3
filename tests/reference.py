"""Reference models for parity tests: mlx-lm's own ``llama`` / ``gemma3_text`` classes on weights that the ``gguf``
package dequantizes, independent of our readers and models (the code lives in ``mlx_engine.bench.mlx_lm_peer``, which
the benchmark uses too)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from mlx_engine.bench.mlx_lm_peer import dequantized_tensors, mlx_lm_greedy, mlx_lm_model  # noqa: F401


def mlx_lm_folder(path: "str | Path") -> Path:
    """The float32 mlx-lm folder of :func:`mlx_lm_model` for the GGUF file ``path`` (``config.json``,
    ``model.safetensors``), written once into the test cache (``tests.hf_gguf.cache_root()``): the ``gguf`` package
    takes a minute to read and dequantize gemma3's file, mlx-lm's ``load_model`` a second to read the folder. Keyed by
    the file's bytes, the versions of ``gguf``, ``mlx`` and ``mlx-lm`` and the source of the code that dequantizes and
    names the weights; folders unused for two weeks are removed."""
    from importlib import metadata

    from mlx_engine.bench import float_reference, mlx_lm_peer
    from tests.hf_gguf import cache_root

    path = Path(path)
    h = hashlib.sha256()
    for name in ("gguf", "mlx", "mlx-lm"):
        h.update(f"{name}={metadata.version(name)};".encode())
    for module in (mlx_lm_peer, float_reference):
        h.update(Path(module.__file__).read_bytes())
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    root = cache_root() / "mlx-lm"
    folder = root / f"{path.stem}-{h.hexdigest()[:24]}"
    if (folder / "config.json").exists():
        os.utime(folder)
        return folder
    root.mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".part-"))
    try:
        mlx_lm_model(path, folder=tmp)
        with contextlib.suppress(OSError):  # another process put the same folder there first
            os.replace(tmp, folder)  # config.json comes with the folder, whole
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    old = folder.stat().st_mtime - 14 * 86400
    for other in root.iterdir():  # folders unused for two weeks (older versions' keys)
        if other.stat().st_mtime < old:
            shutil.rmtree(other, ignore_errors=True)
    return folder


def cached_mlx_lm_model(path: "str | Path"):
    """:func:`mlx_lm_model` of the GGUF file ``path``, read by mlx-lm's own ``load_model`` from
    :func:`mlx_lm_folder`."""
    from mlx_lm.utils import load_model

    return load_model(mlx_lm_folder(path))[0]
