// The quantized product's problem and its parallel runner (qmatmul.cpp), for the primitives built on it
// (gather_qmatmul.cpp).
#pragma once

#include <cstdint>
#include <vector>

namespace mlx_engine {

enum ScaleType { kF32 = 0, kF16 = 1, kBF16 = 2 };

// y [M, N] = x [M, K] @ dequantize(w, scales, biases).T, the weight in MLX's affine layout (see qmatmul.cpp).
struct Problem {
  const float* x;  // [M, K], for 4-bit weights reordered per 32 elements (see prepare_x)
  const uint8_t* w;  // [N, K * bits / 8]
  const void* scales;  // [N, K / group_size]
  const void* biases;  // [N, K / group_size], or null: the zero point 2**(bits - 1), bias = -2**(bits - 1) * scale
  float* out;  // [M, N]
  int M, N, K, group_size, bits, scale_type;
  const void* qx = nullptr;  // x quantized to int8 (vnni::QX), for the int8 kernel
};

// Products of one x (every problem's x, M and K the same) with one or more weights as one parallel job; int8: x
// quantized to int8 and the int8 kernel, where the CPU has it.
void qmatmul_run(std::vector<Problem>& ps, bool int8);

}  // namespace mlx_engine
