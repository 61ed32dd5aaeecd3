// RoPE's rotation of rows of float32 features from a table of cosines and sines (rope.cpp, and the fused decode
// attention of attention.cpp, which must give the same bits).
#pragma once

#include <cstdint>
#include <cstring>

namespace mlx_engine {

// x [B, H, T, D] row-major -> out: the first `dims` features of each row rotated by its table row (row t, or row b
// when T == 1 and R == B != T), the rest copied. See rope.cpp for the arithmetic (MLX's fallback's, unfused).
inline __attribute__((optimize("fp-contract=off"))) void rotate(const float* x, const float* cs, const float* sn,
                                                                float* out, int64_t B, int64_t H, int64_t T, int64_t D,
                                                                int64_t R, int dims, bool traditional) {
  const int half = dims / 2;
  const bool per_batch = T == 1 && R == B && R != T;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t row = per_batch ? b : t;
        const float* c = cs + row * half;
        const float* s = sn + row * half;
        const float* xi = x + ((b * H + h) * T + t) * D;
        float* o = out + ((b * H + h) * T + t) * D;
        if (traditional) {
          for (int i = 0; i < half; ++i) {
            const float x1 = xi[2 * i], x2 = xi[2 * i + 1];
            const float a = x1 * c[i], b2 = x2 * s[i], e = x1 * s[i], f = x2 * c[i];
            o[2 * i] = a - b2;
            o[2 * i + 1] = e + f;
          }
        } else {
          for (int i = 0; i < half; ++i) {
            const float x1 = xi[i], x2 = xi[i + half];
            const float a = x1 * c[i], b2 = x2 * s[i], e = x1 * s[i], f = x2 * c[i];
            o[i] = a - b2;
            o[i + half] = e + f;
          }
        }
        if (dims < D) std::memcpy(o + dims, xi + dims, (D - dims) * sizeof(float));
      }
}

}  // namespace mlx_engine
