// Weights in transparent huge pages (Linux), for the CPU kernels that stream them.
//
// huge_pages(arrays) -> bytes: the evaluated arrays' memory, merged into spans (allocations less than 2 MiB apart,
// the gaps being the heap's other blocks), is marked MADV_HUGEPAGE and collapsed into 2 MiB pages now
// (MADV_COLLAPSE, Linux 6.1 on; a best effort: an older kernel, THP turned off, or no free huge page leaves the pages
// as they are). Returns the bytes the calls covered (0 off Linux). Why: a decode step reads every weight once, and
// MLX's allocator takes them from malloc, which under the usual THP setting (madvise) maps 4 KiB pages: a TLB miss
// every 4 KiB of a large embedding (the gain is in docs/performance.md).
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "mlx/mlx.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

#if defined(__linux__) && !defined(MADV_COLLAPSE)
#define MADV_COLLAPSE 25  // linux/mman.h since 6.1; older headers lack it (then the kernel refuses it: harmless)
#endif

int64_t huge_pages(const std::vector<mx::array>& arrays) {
#if defined(__linux__)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;
  for (const auto& a : arrays) {
    if (!a.is_available() || a.nbytes() == 0) continue;
    const uintptr_t p = reinterpret_cast<uintptr_t>(a.data<uint8_t>());
    spans.emplace_back(p, p + a.nbytes());
  }
  std::sort(spans.begin(), spans.end());
  std::vector<std::pair<uintptr_t, uintptr_t>> merged;
  for (const auto& s : spans) {
    if (!merged.empty() && s.first <= merged.back().second + kHuge)
      merged.back().second = std::max(merged.back().second, s.second);
    else
      merged.push_back(s);
  }
  int64_t covered = 0;
  for (const auto& [lo, hi] : merged) {
    const uintptr_t start = (lo + kHuge - 1) & ~(kHuge - 1), end = hi & ~(kHuge - 1);
    if (end <= start) continue;
    void* p = reinterpret_cast<void*>(start);
    if (madvise(p, end - start, MADV_HUGEPAGE) != 0) continue;
    madvise(p, end - start, MADV_COLLAPSE);  // best effort (see above)
    covered += int64_t(end - start);
  }
  return covered;
#else
  (void)arrays;
  return 0;
#endif
}

}  // namespace

void register_hugepages(nb::module_& m) {
  m.def("huge_pages", &huge_pages, nb::arg("arrays"),
        "Back the evaluated arrays' memory with transparent huge pages where the OS has them (Linux: MADV_HUGEPAGE "
        "and MADV_COLLAPSE over their 2 MiB-aligned spans); returns the bytes covered (0 elsewhere).");
}
