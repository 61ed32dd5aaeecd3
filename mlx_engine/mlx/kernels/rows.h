// Row operations that several kernels share: a primitive of their own (norm.cpp, activation.cpp), and the prologue
// and epilogue of a quantized product (qmatmul.cpp), which thus computes the same bits as the operations apart.
#pragma once

#include <cstdint>

namespace mlx_engine {

// Rows of x [rows, D] (plus residual, into sum, when given) through RMSNorm times w (or none) into out (which may be
// x itself); MLX's CPU arithmetic of mx.fast.rms_norm (norm.cpp). Over the kernels' threads where there are enough
// rows; a decode step's single row runs on the calling thread.
void norm_rows(const float* x, const float* residual, const float* w, float* sum, float* out, int64_t rows,
               int64_t D, float eps);

// out[i] = act(x[i]) (* up[i] when up is given) for n elements; kind 0 SiLU, 1 tanh-form GELU (activation.cpp).
void activate_all(const float* x, const float* up, float* out, int64_t n, int kind);

}  // namespace mlx_engine
