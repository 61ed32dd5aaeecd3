// IEEE half -> float for the kernels that read float16 scales (qmatmul.cpp, qtake.cpp).
#pragma once

#include <cstdint>
#include <cstring>

namespace mlx_engine {

// Exact for every value (the 2**112 product rescales normals and subnormals alike).
inline float half_to_float(uint16_t h) {
  uint32_t em = uint32_t(h & 0x7fff) << 13;
  float f;
  if ((h & 0x7c00) == 0x7c00) {
    em |= 0x7f800000;  // inf / nan
    std::memcpy(&f, &em, 4);
  } else {
    std::memcpy(&f, &em, 4);
    f *= 0x1p112f;
  }
  return (h & 0x8000) ? -f : f;
}

}  // namespace mlx_engine
