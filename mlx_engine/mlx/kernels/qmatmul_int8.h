// x quantized to int8 for qmatmul's int8 kernels (AVX-512 VNNI: qmatmul_int8.inc; AVX2: qmatmul_int8_avx2.inc),
// the one layout both read, so that either gives the same integer sums.
//
// x is quantized as llama.cpp quantizes activations for its integer dot products, which depends on the weight's type
// (ggml-cpu's type_traits: vec_dot_type):
// - Q8_0 / Q8_1 blocks (quantize_row_q8_0 / _q8_1 of ggml-cpu's x86 quants.c), for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
//   IQ4_NL and float scales: per 32 elements q = round(x * 127 / max|x|) (to nearest even), q in [-127, 127],
//   d = max|x| / 127 held in float16 (as_stored), the biases' sums d * sum(q) in float16 too (Q8_1's s);
// - Q8_K blocks (quantize_row_q8_K_ref of ggml-quants.c, which x86 runs), for the K-quants Q2_K .. Q6_K and IQ4_XS
//   (the weights of two-level scales here: int8_per_256): per 256 elements q = round(x * 127 / max|x|), d = 1 / (127
//   / max|x|) in float32 (llama.cpp's q and d are these negated where its signed max is positive: the same products),
//   the sums d * sum(q) per 32 in float32. A record keeps a d per lane, so all those of a 256 hold the same d.
// int16 activations (AVX-512 VNNI only): d = max|x| / 32639, q = round(x / d) = 256 hi + lo with hi and lo both in
// [-128, 127] (hi = (q + 128) >> 8), each part a record's int8 bytes as above; the kernel sums w_q * hi and w_q * lo
// with the same vpdpbusd and takes (sum_hi << 8) + sum_lo, exact in int32. x's rounding is then at most
// max|x| / 65278 per element, 257x finer than int8's.
#pragma once

#include <cstdint>
#include <vector>

#include "half.h"

namespace mlx_engine::int8 {

// A block's d, and the sum d * sum(x_q) that biases meet, as llama.cpp's Q8_0 and Q8_1 blocks hold them: in float16
// (GGML_CPU_FP32_TO_FP16). Its products multiply the integer sums by these, not by the float32 d.
inline float as_stored(float v) { return half_to_float(float_to_half(v)); }

// x quantized, as the row kernels read it: per row, one record per kernel step holding the step's x_q and the
// 16 lanes of d and of the x_q sums that its 16 int32 sums meet (lane l: bytes 4l .. 4l + 3 of the step's x_q, as
// vpdpbusd, or AVX2's vpmaddubsw and vpmaddwd, sum them), so that a step reads one place per row of x (with separate
// arrays, 4 rows of x took 12 pointers, more than the registers, and the many-row kernel spilled). A row's last 128
// (nibble order) or 64 (own order) elements are padded with zeros, so that every step is whole registers: what the
// weight register holds past the row's end is multiplied by those zeros.
struct QX {
  int K4, K8;          // K rounded up to 128 and to 64
  const uint8_t* p4;   // [M, K4 / 128] records of 256 bytes, for 4-bit weights: x_q per 128 elements, the 64 even
                       // ones then the 64 odd ones (the nibbles' order; a last partial 128: its even ones, zeros to
                       // 64, its odd ones, zeros); 16 floats, lane l the d of block l / 4 (0 past the row); 16 int32,
                       // lane l minus the sum of the 8 x_q that lane l of the sums meets (4 even, 4 odd)
  const uint8_t* p8;   // [M, K8 / 64] records of 192 bytes, for other widths: x_q per 64 elements in order; lane l
                       // of the floats the d of block l / 8; of the int32s minus the sum of x_q 4l .. 4l + 3
  const float* sx[3];  // [M, K / 32], [M, K / 64], [M, K / 128]: sums of x's rounded values (d * x_q) per 32, 64, 128
  bool x16 = false;    // int16: records of kRecord4x16 / kRecord8x16 bytes, the hi bytes where the int8 ones are, then
                       // the lo bytes in the same order, then the d and the (16-bit) x_q sums as above
};
constexpr int kRecord4 = 256, kRecord8 = 192;
constexpr int kRecord4x16 = 384, kRecord8x16 = 256;

// Buffers of one quantized x (kept per thread: a decode step makes a few hundred products).
struct QXBuffers {
  std::vector<uint8_t> p4, p8;
  std::vector<float> sx32, sx64, sx128;
};

// One instruction set's quantization of row m of x [M, K] into b (sized, the padding zeroed, by quantize_x): the
// records of the nibble order if `nib`, those of the own order if `own`, and the row's sums per 32 (sx32).
using QuantizeRowFn = void (*)(const float* x, int K, int m, bool nib, bool own, QXBuffers& b);

// The d of each lane of a record (16 floats): lane l that of block first + l / lanes_per_block, 0 past the row's
// `blocks`.
inline void record_scales(float* out, const float* d, int first, int lanes_per_block, int blocks) {
  for (int l = 0; l < 16; ++l) out[l] = first + l / lanes_per_block < blocks ? d[first + l / lanes_per_block] : 0.f;
}

// x [M, K] quantized (K a multiple of 32) by `row` (x16: an int16 one), into buffers of the calling thread: valid
// until its next call with the same `slot` (0 or 1: a job whose weights take x quantized two ways keeps both);
// the records of the nibble order (for 4-bit weights) if `nib`, those of the own order (other widths) if `own`. Many
// rows (prefill) are split over the kernels' threads. (qmatmul.cpp)
const QX& quantize_x(const float* x, int M, int K, bool nib, bool own, QuantizeRowFn row, bool x16 = false,
                     int slot = 0);

}  // namespace mlx_engine::int8
