// The kernels take their inputs in any layout (a graph node to make an input row-major costs a dispatch, and nearly
// every input is row-major already); a strided view is gathered here first.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "mlx/array.h"

namespace mlx_engine {

// The data of `a` in row-major order: its own when it is row-major, else its elements copied one by one into `buf`.
inline const void* row_major(const mlx::core::array& a, std::vector<uint8_t>& buf) {
  if (a.flags().row_contiguous) return a.data<uint8_t>();
  const size_t item = a.itemsize();
  const int nd = int(a.ndim());
  buf.resize(a.size() * item);
  const uint8_t* src = a.data<uint8_t>();
  std::vector<int64_t> idx(nd, 0);
  for (size_t i = 0, n = a.size(); i < n; ++i) {
    int64_t off = 0;
    for (int d = 0; d < nd; ++d) off += idx[d] * int64_t(a.strides()[d]);
    std::memcpy(buf.data() + i * item, src + off * int64_t(item), item);
    for (int d = nd - 1; d >= 0; --d) {
      if (++idx[d] < a.shape(d)) break;
      idx[d] = 0;
    }
  }
  return buf.data();
}

}  // namespace mlx_engine
