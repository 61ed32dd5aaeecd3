// The quantized product's problem and its parallel runner (qmatmul.cpp), for the primitives built on it
// (gather_qmatmul.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mlx/array.h"

namespace mlx_engine {

// kU8: a K-quant's two-level scales (GGUF Q4_K, Q5_K): scales and biases are 6-bit integers sc and m (uint8), and
// Problem::super holds per 8 groups (256 elements) two float16 d and -dmin; scale = d * sc, bias = -dmin * m (each
// an exact float32 product). Held so, a Q4_K weight takes 4.625 bits per element (the file's 4.5), where float32
// scales and biases took 6.
enum ScaleType { kF32 = 0, kF16 = 1, kBF16 = 2, kU8 = 3 };

// y [M, N] = x [M, K] @ dequantize(w, scales, biases).T, the weight in MLX's affine layout (see qmatmul.cpp).
struct Problem {
  const float* x;  // [M, K], for 4-bit weights reordered per 32 elements (see prepare_x)
  const uint8_t* w;  // [N, K * bits / 8]
  const void* scales;  // [N, K / group_size]
  const void* biases;  // [N, K / group_size], or null: the zero point 2**(bits - 1), bias = -2**(bits - 1) * scale
  float* out;  // [M, N]
  int M, N, K, group_size, bits, scale_type;
  const void* qx = nullptr;  // x quantized to int8 (vnni::QX), for the int8 kernel
  const void* super = nullptr;  // kU8: float16 [N, K / group_size / 8, 2], (d, -dmin) per 8 groups
  int ldo = 0;  // the row stride of out (N, but for a block of a weight's rows)
};

// Products of one x (every problem's x, M and K the same) with one or more weights as one parallel job; int8: x
// quantized to int8 and the int8 kernel, where the CPU has it. Problems of kU8 scales run per block of rows, their
// scales and biases made float32 first.
void qmatmul_run(std::vector<Problem>& ps, bool int8);

// The checks of two-level scales: scales and biases uint8 of shape gshape ([..., groups]), super float16
// [..., groups / 8, 2]; throws std::invalid_argument naming `who`.
void check_factored(const mlx::core::Shape& gshape, const mlx::core::array& scales, const mlx::core::array& biases,
                    const mlx::core::array& super, const std::string& who);

}  // namespace mlx_engine
