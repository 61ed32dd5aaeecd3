"""Importing MLX the right way: a fast BLAS first on Linux CPU, then the device choice.

Environment variables:
    MLX_ENGINE_DEVICE: ``cpu``, ``gpu`` (Metal or CUDA, whichever MLX has), ``metal`` or ``cuda``. Default: Metal
        where available, else CUDA, else CPU.
    MLX_ENGINE_OPENBLAS: ``0`` stops us loading a system OpenBLAS before MLX on Linux. The ``mlx[cpu]`` wheel links the
        reference BLAS; OpenBLAS loaded first with ``RTLD_GLOBAL`` supplies a much faster ``sgemm``.
    OPENBLAS_THREAD_TIMEOUT: set to 4 unless given, before we look for OpenBLAS (the library reads it as it loads,
        so whether or not one is then found): OpenBLAS's threads then sleep as soon as a call ends, where by default
        they spin on ``sched_yield`` for 2**28 cycles. MLX calls BLAS in a prefill (attention), not in a decode step,
        whose threads the spinning ones would hold back.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading

from mlx_engine.errors import EngineError

_OPENBLAS_NAMES = ("libopenblas.so.0", "libopenblas.so", "libopenblasp-r0.so")
_blas = "system default"


def _load_openblas() -> str:
    """Load OpenBLAS globally before MLX on Linux; return a description of the BLAS in use."""
    if not sys.platform.startswith("linux"):
        return "Accelerate" if sys.platform == "darwin" else "system default"
    if "mlx.core" in sys.modules:
        return "as loaded before mlx_engine (mlx was imported first)"
    if os.environ.get("MLX_ENGINE_OPENBLAS", "1").lower() in ("0", "false", "no", "off"):
        return "reference BLAS (OpenBLAS disabled by MLX_ENGINE_OPENBLAS=0)"
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # read when the library loads
    for name in _OPENBLAS_NAMES:
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            return f"OpenBLAS ({name})"
        except OSError:
            continue
    return "reference BLAS (no system OpenBLAS found; install libopenblas0-pthread for ~30x faster matmuls)"


_blas = _load_openblas()

matvec_block = 0
"""Largest weight, in elements, that :meth:`MLXTensor.linear` hands to BLAS as one matrix-vector product (0: no
limit). On the CPU with OpenBLAS it is 10^6: OpenBLAS (0.3.x, x86-64 SkylakeX-class kernels) runs an sgemm with
``M * N * K <= 100**3`` through its small-matrix kernel, which streams the weight once, and anything larger through
the packed path, more slowly (docs/internals/cpu-kernels.md). Set by :func:`select_device`."""

on_cpu = False
"""True when :func:`select_device` chose the CPU: quantized products then run through our CPU kernels."""

import mlx.core as mx  # noqa: E402  (must come after the BLAS is loaded)


def blas_description() -> str:
    """Which BLAS MLX's CPU backend uses in this process, in words."""
    return _blas


def _cuda_available() -> bool:
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available())


def select_device(requested: str | None = None) -> str:
    """Set MLX's default device and return its name: ``"metal"``, ``"cuda"`` or ``"cpu"``.

    ``requested`` (or ``MLX_ENGINE_DEVICE``) overrides the automatic choice. Raises ``EngineError`` when the
    requested device is not available.
    """
    want = (requested or os.environ.get("MLX_ENGINE_DEVICE") or "auto").lower()
    fix = "--device cpu (device='cpu')" if requested else "MLX_ENGINE_DEVICE=cpu"  # what the user set
    metal = mx.metal.is_available()
    cuda = _cuda_available()
    if want == "auto":
        want = "metal" if metal else "cuda" if cuda else "cpu"
    if want == "gpu":
        if not (metal or cuda):
            raise EngineError(f"device 'gpu' requested but MLX sees neither Metal nor CUDA; use {fix}")
        want = "metal" if metal else "cuda"
    if want == "metal" and not metal or want == "cuda" and not cuda:
        raise EngineError(f"device {want!r} requested but it is not available here; use {fix}")
    if want not in ("metal", "cuda", "cpu"):
        raise EngineError(f"unknown device {want!r}; use cpu, gpu, metal or cuda")
    mx.set_default_device(mx.cpu if want == "cpu" else mx.gpu)
    global matvec_block, on_cpu
    matvec_block = 1_000_000 if want == "cpu" and _blas.startswith("OpenBLAS") else 0
    on_cpu = want == "cpu"
    return want


class _ThreadEnd:
    """Lives in a thread-local slot of a thread that ran MLX work; let go when that thread ends (while it still holds
    the interpreter: Python clears a thread's locals before ``Thread.join`` returns)."""

    def __del__(self) -> None:
        # MLX keeps this thread's ``mx.compile`` traces (which hold Python objects) and its default stream in C++
        # thread-locals. Left to the thread's C++ exit they are freed after join() has returned, and their Python
        # objects then take the interpreter's lock; when the main thread is finalizing the interpreter by then, that
        # ends the thread with a forced unwind through a noexcept destructor: std::terminate, exit 134 after a
        # correct run. So: wait for the work in flight (a pipelined decode step), free them here, now.
        try:
            mx.synchronize()
            mx.clear_streams()
        except Exception:  # noqa: BLE001 -- a thread's end must not raise; the process goes on
            pass


_thread_end = threading.local()


def watch_thread_exit() -> None:
    """Call on a thread about to run MLX work: its MLX thread state is freed when it ends (see :class:`_ThreadEnd`).
    The main thread needs none (MLX frees its state in an ``atexit`` hook)."""
    if getattr(_thread_end, "slot", None) is None and threading.current_thread() is not threading.main_thread():
        _thread_end.slot = _ThreadEnd()


def trim_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim(0)``); whether the C library has it.

    On Linux MLX's CPU allocator takes its buffers from ``malloc``. glibc raises its mmap threshold each time a large
    mmapped block is freed (up to 32 MiB), so later buffers of those sizes come from the heap arenas, and their freed
    pages stay in the process (resident) until trimmed: in a 30-minute soak the server's RSS went from 402 to 754 MiB
    while MLX's active memory stayed flat, with 130-390 MiB free inside glibc's arenas. A no-op (False) where the C
    library has no ``malloc_trim`` (as macOS's)."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True


@functools.cache
def _malloc_trim():
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn
