// 16-lane float vectors (GCC / Clang vector extensions: one AVX-512 register, two AVX2, four NEON) and the math the
// kernels share (header only: inline functions).
#pragma once

#include <cstdint>
#include <cstring>

typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

// A function compiled for AVX-512, AVX2 and the baseline, picked at load time (GCC on x86-64).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PER_ISA __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PER_ISA
#endif
#define INLINE inline __attribute__((always_inline))

INLINE float hsum(f32x16 a) {  // pairwise halves: a few shuffles, not 16 scalar adds
  f32x8 b = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
  f32x4 c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
  return (c[0] + c[2]) + (c[1] + c[3]);
}

// exp(x) for x <= 0, 16 at once: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, Cody and Waite), exp(r) by
// Cephes' expf polynomial (relative error about 1e-7), times 2**n built in the exponent bits; 0 below -87 (where 2**n
// would leave the normal range; -inf included).
INLINE f32x16 exp_nonpositive(f32x16 x) {
  const f32x16 t = x * 1.44269504088896341f;
  const i32x16 n = __builtin_convertvector(t - 0.5f, i32x16);  // round half away from zero, t <= 0
  const f32x16 nf = __builtin_convertvector(n, f32x16);
  f32x16 r = x - nf * 0.693359375f;
  r = r - nf * -2.12194440e-4f;
  f32x16 p = f32x16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  const i32x16 bits = (n + 127) << 23;
  f32x16 scale;
  std::memcpy(&scale, &bits, 64);
  const i32x16 keep = x >= -87.f;
  f32x16 y = p * scale;
  i32x16 yi;
  std::memcpy(&yi, &y, 64);
  yi &= keep;
  std::memcpy(&y, &yi, 64);
  return y;
}
