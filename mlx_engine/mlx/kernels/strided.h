// The kernels take their inputs in any layout (a graph node to make an input row-major costs a dispatch, and nearly
// every input is row-major already); a strided view is gathered here first.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "mlx/array.h"

namespace mlx_engine {

// The data of `a` in row-major order: its own when it is row-major, else its elements copied into `buf`, a run of
// its last axis at a time where that axis is contiguous (a prefill's queries and keys, transposed to [1, H, L, Dh]
// views: Dh floats a copy), else one by one.
inline const void* row_major(const mlx::core::array& a, std::vector<uint8_t>& buf) {
  if (a.flags().row_contiguous) return a.data<uint8_t>();
  const size_t item = a.itemsize();
  const int nd = int(a.ndim());
  buf.resize(a.size() * item);
  const uint8_t* src = a.data<uint8_t>();
  const bool runs = nd > 0 && a.strides()[nd - 1] == 1;
  const int64_t run = runs ? a.shape(nd - 1) : 1;  // elements per copy
  const int outer = runs ? nd - 1 : nd;  // the axes walked
  std::vector<int64_t> idx(nd, 0);
  for (size_t i = 0, n = a.size(); i < n; i += run) {
    int64_t off = 0;
    for (int d = 0; d < outer; ++d) off += idx[d] * int64_t(a.strides()[d]);
    std::memcpy(buf.data() + i * item, src + off * int64_t(item), run * item);
    for (int d = outer - 1; d >= 0; --d) {
      if (++idx[d] < a.shape(d)) break;
      idx[d] = 0;
    }
  }
  return buf.data();
}

// The data of each of a primitive's inputs in row-major order (row_major), the copies in buffers of the calling
// thread, valid until its next call.
inline std::vector<const void*> row_major_all(const std::vector<mlx::core::array>& inputs) {
  static thread_local std::vector<std::vector<uint8_t>> buffers;
  if (buffers.size() < inputs.size()) buffers.resize(inputs.size());
  std::vector<const void*> data(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) data[i] = row_major(inputs[i], buffers[i]);
  return data;
}

}  // namespace mlx_engine
