// IEEE half -> float for the kernels that read float16 scales (qmatmul.cpp, qtake.cpp) or a float16 KV cache
// (attention.cpp, half.cpp).
#pragma once

#include <cstdint>
#include <cstring>

namespace mlx_engine {

// Exact for every value (the 2**112 product rescales normals and subnormals alike); a NaN comes out quiet.
inline float half_to_float(uint16_t h) {
  uint32_t em = uint32_t(h & 0x7fff) << 13;
  float f;
  if ((h & 0x7c00) == 0x7c00) {
    em |= (h & 0x3ff) ? 0x7fc00000 : 0x7f800000;  // inf, or a NaN made quiet (as F16C and MLX's astype make it)
    std::memcpy(&f, &em, 4);
  } else {
    std::memcpy(&f, &em, 4);
    f *= 0x1p112f;
  }
  return (h & 0x8000) ? -f : f;
}

// n float16 values as float32 (exact): F16C where the CPU has it (checked once; half.cpp).
void halves_to_floats(const uint16_t* h, float* f, int64_t n);

}  // namespace mlx_engine
