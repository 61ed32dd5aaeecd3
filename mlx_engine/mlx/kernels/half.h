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

// float -> IEEE half, rounded to nearest even as F16C's vcvtps2ph (immediate 0) rounds: normals, subnormals, overflow
// to infinity, a NaN quiet.
inline uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return sign | (x > 0x7f800000u ? 0x7e00 : 0x7c00);
  if (x >= 0x477ff000u) return sign | 0x7c00;  // 65520 and more: past the largest half's rounding range
  if (x < 0x38800000u) {
    // below 2**-14, a subnormal half (or zero), in steps of 2**-24: added to 0.5, whose float ulp is 2**-24, the
    // adder rounds |f| to that step (nearest even), and the sum's low bits are the half's
    float a;
    std::memcpy(&a, &x, 4);
    a += 0.5f;
    uint32_t r;
    std::memcpy(&r, &a, 4);
    return sign | uint16_t(r - 0x3f000000u);
  }
  // a normal half: the exponent rebiased (-112 << 23), the 13 dropped bits rounded to nearest even
  x += 0xc8000fffu + ((x >> 13) & 1u);
  return sign | uint16_t(x >> 13);
}

// n float16 values as float32 (exact): F16C where the CPU has it (checked once; half.cpp).
void halves_to_floats(const uint16_t* h, float* f, int64_t n);

}  // namespace mlx_engine
