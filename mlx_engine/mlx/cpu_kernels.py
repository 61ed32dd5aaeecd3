"""Our CPU kernels (``mlx_engine.mlx._kernels``, built from ``kernels/`` by setup.py at install), or why not.

``qmatmul`` is None when the module is missing (not built: no compiler or CMake at install, or
``MLX_ENGINE_NO_KERNELS=1``), was built against another MLX than the one installed, or fails its self-test; then
quantized weights run through MLX's own operations and :func:`status` says why. ``MLX_ENGINE_KERNELS=0`` turns them
off at run time.
"""

from __future__ import annotations

import importlib
import os
from typing import Callable

from mlx_engine.mlx.runtime import mx

qmatmul: "Callable | None" = None
_status = "not loaded"


def _self_test(fn) -> str | None:
    """Compare with MLX's dequantize + matmul on a small random problem for each bit width; None when all agree."""
    key = mx.random.key(7)
    for bits in (2, 3, 4, 5, 6, 8):
        k1, k2, key = mx.random.split(key, 3)
        w = mx.random.normal((40, 96), key=k1)
        x = mx.random.normal((3, 96), key=k2)
        q, s, b = mx.quantize(w, group_size=32, bits=bits)
        s, b = s.astype(mx.float16), b.astype(mx.float16)
        want = x @ mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), group_size=32, bits=bits).T
        err = mx.abs(fn(x, q, s, b, 32, bits) - want).max().item()
        if not err <= 1e-4 * (1 + mx.abs(want).max().item()):
            return f"{bits}-bit product off by {err:.3g}"
    return None


def _load() -> None:
    global qmatmul, _status
    if os.environ.get("MLX_ENGINE_KERNELS", "1").lower() in ("0", "false", "no", "off"):
        _status = "off (MLX_ENGINE_KERNELS=0)"
        return
    try:
        # by name: a compiled module, not a source file, which an import statement would make look like an import of
        # the mlx_engine.mlx package (and a cycle through its __init__)
        _kernels = importlib.import_module("mlx_engine.mlx._kernels")
    except ImportError as e:
        _status = f"not built ({e}); reinstall mlx-engine with a C++ compiler and CMake to build them"
        return
    if _kernels.mlx_version != mx.__version__.split(".dev")[0]:
        _status = (f"built for MLX {_kernels.mlx_version}, but MLX {mx.__version__} is installed; reinstall "
                   "mlx-engine to rebuild them")
        return
    try:
        with mx.stream(mx.cpu):
            problem = _self_test(_kernels.qmatmul)
    except Exception as e:  # a broken build must not stop the engine: it falls back to MLX's operations
        problem = f"{type(e).__name__}: {e}"
    if problem:
        _status = f"failed their self-test ({problem})"
        return
    qmatmul = _kernels.qmatmul
    _status = f"{_kernels.isa()}, {_kernels.threads()} threads"


def status() -> str:
    """The CPU kernels in one line: the instruction set and threads, or why they are not used."""
    return _status


_load()
