"""The weights' memory in transparent huge pages (Linux): the kernel's huge_pages call keeps every value, covers the
2 MiB-aligned spans of the arrays it is given, and the CPU backend calls it on a model's weights after the load."""

from __future__ import annotations

import re
import sys

import gguf
import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from mlx_engine.mlx import MLXBackend, cpu_kernels  # noqa: E402
from tests.test_weights_gguf import quantized, write_gguf  # noqa: E402

needs_kernels = pytest.mark.skipif(cpu_kernels.qmatmul is None, reason="the CPU kernels are not built here")

pytestmark = pytest.mark.usefixtures("mlx_on_the_cpu")


def _huge_kib(lo: int, hi: int) -> int:
    """AnonHugePages (KiB) of this process's mappings that overlap [lo, hi)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) < hi and int(m.group(2), 16) > lo
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


@needs_kernels
def test_huge_pages_keep_the_values_and_cover_the_aligned_spans():
    a = mx.arange(3 << 20, dtype=mx.int32)  # 12 MiB
    b = mx.ones((100,))  # too small to hold a huge page
    mx.eval(a, b)
    want = np.array(a)
    covered = cpu_kernels.huge_pages([a, b])
    np.testing.assert_array_equal(np.array(a), want)
    assert np.array(b).sum() == 100
    if not sys.platform.startswith("linux"):
        assert covered == 0
        return
    # the 2 MiB-aligned part of a's 12 MiB (and none of b's 400 bytes, unless next to a)
    assert 8 << 20 <= covered <= 14 << 20
    assert cpu_kernels.huge_pages([]) == 0 and cpu_kernels.huge_pages([b]) == 0
    lo = np.array(a, copy=False).__array_interface__["data"][0]
    setting = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    if "[never]" not in setting:  # collapsed now (MADV_COLLAPSE), where the kernel has free huge pages
        assert _huge_kib(lo, lo + a.nbytes) >= 2048


@needs_kernels
def test_the_cpu_backend_puts_its_weights_in_huge_pages(tmp_path):
    _, raw = quantized((4096, 1024), gguf.GGMLQuantizationType.Q8_0)
    write_gguf(tmp_path / "w.gguf", {"w": (raw, gguf.GGMLQuantizationType.Q8_0)})
    backend = MLXBackend(tmp_path / "w.gguf", device="cpu")
    try:
        expected = sys.platform.startswith("linux")
        assert (backend.huge_page_bytes >= 2 << 20) == expected  # 4 MiB of weights: at least one aligned span
        w = backend.weights["w"]
        x = mx.random.normal((1, 1024), key=mx.random.key(0))
        y = cpu_kernels.qmatmul(x, w.w, w.scales, w.biases, 32, 8)
        want = np.array(x) @ np.array(w.a).T
        np.testing.assert_allclose(np.array(y), want, rtol=0, atol=1e-4 * np.abs(want).max())
    finally:
        backend.close()
