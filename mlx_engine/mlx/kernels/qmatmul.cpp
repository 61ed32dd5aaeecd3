// CPU kernels of mlx-engine, as MLX primitives.
//
// qmatmul(x, w, scales, biases, group_size, bits): y = x @ dequantize(w, scales, biases).T for a weight in MLX's
// affine layout (mx.quantize with mode="affine"): element j of row n is
//     scales[n, j / group_size] * q[n, j] + biases[n, j / group_size],
// q an unsigned `bits`-bit integer at bit offset j * bits of the row's bytes (little-endian, lowest bits first).
// By default the activations stay float32: the result is the float32 product of x with the exactly dequantized
// weight (only the order of the sums differs from a dense matmul), so a lossless repack of a GGUF file gives the
// tokens of the float path. With activations="int8" (where the CPU has AVX-512 VNNI, or AVX2) x is quantized as
// llama.cpp quantizes it and the sums are integer ones (qmatmul_int8.inc, qmatmul_int8_avx2.inc); "int16" (the
// same CPUs) quantizes it to 16 bits per 32 elements, two int8 parts through the same integer sums. Why our own:
// MLX's CPU quantized_matmul dequantizes as it goes and is slower than a float32 product; a decode step reads every
// weight once, so its speed is the weight's bytes.
//
// Vectorized with GCC/Clang vector extensions (16 float lanes: one AVX-512 register, two AVX2 registers, four NEON
// registers); on x86-64 the row kernel is compiled for x86-64-v4 (AVX-512), v3 (AVX2 + FMA) and the baseline, and
// the loader picks one at run time. Rows of the output are split over the kernels' threads (pool.h).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "mlx/version.h"
#include "half.h"
#include "pool.h"
#include "qmatmul.h"
#include "qmatmul_int8.h"
#include "rows.h"
#include "strided.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

// ------------------------------------------------------------------------------------------------ the kernel

#define INLINE inline __attribute__((always_inline))

using mlx_engine::kBF16;
using mlx_engine::kE8M0;
using mlx_engine::kF16;
using mlx_engine::kF32;
using mlx_engine::kI8;
using mlx_engine::Problem;
using mlx_engine::half_to_float;
using mlx_engine::zero_point_of;

// One copy of the row kernel per instruction set; `rows_for_cpu` picks one once.
#if defined(__x86_64__) && defined(__GNUC__)
#define X86_KERNELS 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi,fma,f16c,avx2,bmi2")
#define QMM_AVX512 1
namespace avx512 {
#include "qmatmul_rows.inc"
}
#undef QMM_AVX512
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")
#define QMM_AVX2 1
namespace avx2 {
#include "qmatmul_rows.inc"
namespace i8 {
#include "qmatmul_int8_avx2.inc"
}
}
#undef QMM_AVX2
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi,avx512vnni,fma,f16c,avx2,bmi2")
namespace vnni {
using avx512::scale_at;
#include "qmatmul_int8.inc"
}
#pragma GCC pop_options
#else
// Portable vector extensions, for CPUs with neither (NEON on arm64 comes through them). x86-64 has no such copy:
// every x86-64 CPU of the last decade has AVX2, and a third copy of the row kernel was a fifth of the build's time.
namespace generic {
#include "qmatmul_rows.inc"
}
#endif

using RowsFn = void (*)(const Problem&, int, int);
using FactoredFn = void (*)(const Problem&, int, int, float*, float*);

// The int8 kernel for this CPU: "vnni" (AVX-512 with VNNI), "avx2" (any other CPU with AVX2, an AVX-512 one
// without VNNI included), or "" (none).
std::string int8_isa() {
#ifdef X86_KERNELS
  const std::string name = mlx_engine::isa();
  if (name == "avx512" && __builtin_cpu_supports("avx512vnni")) return "vnni";
  return name == "avx512" || name == "avx2" ? "avx2" : "";
#else
  return "";
#endif
}

bool int8_supported() { return !int8_isa().empty(); }
bool int16_supported() { return !int8_isa().empty(); }

RowsFn rows_for_cpu() {
  static const RowsFn fn = [] {
    std::string name = mlx_engine::isa();
#ifdef X86_KERNELS
    if (name == "avx512") return &avx512::rows;
    if (name == "avx2") return &avx2::rows;
    throw std::runtime_error("the quantized kernels need AVX2 and FMA on x86-64, which this CPU lacks");
#else
    return &generic::rows;
#endif
  }();
  return fn;
}

// The conversion of two-level scales for this CPU (the row kernel's instruction set).
FactoredFn factored_for_cpu() {
  static const FactoredFn fn = [] {
#ifdef X86_KERNELS
    return mlx_engine::isa() == "avx512" ? &avx512::factored : &avx2::factored;
#else
    return &generic::factored;
#endif
  }();
  return fn;
}

// x [M, K] -> the order the row kernel reads: for 4 bits, per 32 elements the 16 even ones then the 16 odd ones;
// with `blocks` (decode on AVX-512, see Problem::x_blocks) per 128 elements the transposed 16 x 8, and x's sums per
// 32, 64 and 128 elements into `sums` (three pointers). (Into buffers kept per thread: a decode step makes a few
// hundred products, and a fresh allocation for each showed up as a tenth of the step in malloc.)
const float* prepare_x(const float* x, int M, int K, int bits, bool blocks, const float** sums) {
  if (bits != 4) return x;
  static thread_local std::vector<float> xp, sx;
  if (blocks) {
    const int K128 = (K + 127) / 128 * 128;
    // 64-byte aligned: the kernel's loads of x would each cross two cache lines otherwise
    xp.assign(size_t(M) * K128 + 15, 0.f);
    float* base = xp.data() + (16 - reinterpret_cast<uintptr_t>(xp.data()) / 4 % 16) % 16;
    sx.resize(size_t(M) * (K / 32 + K / 64 + K / 128));
    float* s32 = sx.data();
    float* s64 = s32 + size_t(M) * (K / 32);
    float* s128 = s64 + size_t(M) * (K / 64);
    for (int m = 0; m < M; ++m) {
      const float* xm = x + size_t(m) * K;
      float* out = base + size_t(m) * K128;
      for (int k0 = 0; k0 < K; k0 += 8)  // (K a multiple of 32)
        for (int j = 0; j < 8; ++j) out[k0 / 128 * 128 + j * 16 + k0 % 128 / 8] = xm[k0 + j];
      float* a = s32 + size_t(m) * (K / 32);
      for (int g = 0; g < K / 32; ++g) {
        float t[8] = {};  // eight sums side by side (one chain of 32 additions took a few microseconds a product)
        for (int i = 0; i < 32; i += 8)
          for (int j = 0; j < 8; ++j) t[j] += xm[32 * g + i + j];
        a[g] = ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
      }
      for (int g = 0; g < K / 64; ++g) s64[size_t(m) * (K / 64) + g] = a[2 * g] + a[2 * g + 1];
      for (int g = 0; g < K / 128; ++g)
        s128[size_t(m) * (K / 128) + g] = (a[4 * g] + a[4 * g + 1]) + (a[4 * g + 2] + a[4 * g + 3]);
    }
    sums[0] = s32, sums[1] = s64, sums[2] = s128;
    return base;
  }
  if (xp.size() < size_t(M) * K) xp.resize(size_t(M) * K);
  for (size_t c = 0; c < size_t(M) * K; c += 32) {
    for (int i = 0; i < 16; ++i) {
      xp[c + i] = x[c + 2 * i];
      xp[c + 16 + i] = x[c + 2 * i + 1];
    }
  }
  return xp.data();
}

// Whether the int8 kernel runs p: groups of 16 only symmetric (Q6_K, Q3_K: x's sums per 16, which biases would meet,
// are not kept) and on AVX2 (`avx2`) only below 8 bits (its 8-bit lanes mix both 16s of 32 elements), a codebook
// weight in groups of 32 only, and not at all with int16 activations on AVX2 (`avx2_x16`: its sign trick cannot take a
// lo byte of -128; qmatmul_int8_avx2.inc).
bool int8_kernel_takes(const Problem& p, bool avx2, bool avx2_x16) {
  if (p.group_size == 16) return !p.biases && !(avx2 && p.bits == 8);
  return !p.codebook || (p.group_size == 32 && !avx2_x16);
}

// Whether int8 activations quantize x per 256 elements for p (llama.cpp's Q8_K, qmatmul_int8.h): its vec_dot_type for
// the K-quants (Q2_K .. Q6_K) and IQ4_XS, which are the weights held with two-level scales (their rows multiples of
// 256: check_factored).
bool int8_per_256(const Problem& p) { return p.super != nullptr; }

// Output rows [n0, n1) of p with the row kernel `rows` (`int8_rows` where p has x quantized); a problem of two-level
// (or E8M0) scales per block of 64 rows, the block's scales and biases made float32 first by `factored` into a buffer
// of the thread (the kernels then read them as any other float32 scales: the same values, so the same bits as a
// weight held with float32 scales).
void run_rows(RowsFn float_rows, RowsFn int8_rows, FactoredFn factored, const Problem& p, int n0, int n1) {
  const RowsFn rows = p.qx ? int8_rows : float_rows;
  if (p.scale_type != mlx_engine::kU8 && p.scale_type != kI8 && p.scale_type != kE8M0)
    return rows(p, n0, n1);
  constexpr int kBlock = 64;
  const int groups = p.K / p.group_size;
  const size_t row_bytes = size_t(p.K) * p.bits / 8;
  static thread_local std::vector<float> buf;
  buf.resize(2 * size_t(kBlock) * groups);
  float *s = buf.data(), *b = s + size_t(kBlock) * groups;
  for (int nb = n0; nb < n1; nb += kBlock) {
    const int count = std::min(kBlock, n1 - nb);
    factored(p, nb, count, s, b);
    Problem q = p;
    // (a symmetric weight's biases are made by the kernels from its scales, or not at all: see row_dot)
    q.w = p.w + size_t(nb) * row_bytes, q.scales = s, q.biases = p.biases ? b : nullptr, q.super = nullptr;
    q.scale_type = mlx_engine::kF32, q.out = p.out + nb, q.N = count;
    rows(q, 0, count);
  }
}

}  // namespace

std::string mlx_engine::isa() {
#ifdef X86_KERNELS
  __builtin_cpu_init();
  const char* asked = std::getenv("MLX_ENGINE_CPU_ISA");
  const bool avx2_only = asked && std::string(asked) == "avx2";
  if (!avx2_only && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi"))
    return "avx512";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "avx2";
  return "x86-64 without AVX2";
#elif defined(__aarch64__)
  return "neon";
#else
  return "generic";
#endif
}

namespace {
// kvalues_iq4nl and kvalues_mxfp4 (llama.cpp's ggml-common.h) plus 128
const uint8_t kIQ4NL[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
const uint8_t kMXFP4[16] = {128, 129, 130, 131, 132, 134, 136, 140, 128, 127, 126, 125, 124, 122, 120, 116};
}  // namespace

const uint8_t* mlx_engine::codebook_levels(int id) {
  return id == kCodebookIQ4NL ? kIQ4NL : id == kCodebookMXFP4 ? kMXFP4 : nullptr;
}

void mlx_engine::check_codebook(int id, int bits, bool biases, mx::Dtype dtype, bool factored,
                                const std::string& who) {
  if (id != kNoCodebook && id != kCodebookIQ4NL && id != kCodebookMXFP4)
    throw std::invalid_argument(who + ": codebook must be 0 (none), 1 (IQ4_NL's levels) or 2 (MXFP4's), not " +
                                std::to_string(id));
  if (id != kNoCodebook && (bits != 4 || biases))
    throw std::invalid_argument(who + ": a codebook weight has 4 bits and no biases");
  if (dtype == mx::uint8 && !factored && id != kCodebookMXFP4)
    throw std::invalid_argument(who + ": uint8 scales without super scales are E8M0 exponents, an MXFP4 codebook "
                                      "weight's (codebook 2) only");
}

int mlx_engine::scale_type_of(mx::Dtype dtype, bool factored) {
  if (factored) return dtype == mx::int8 ? kI8 : kU8;
  return dtype == mx::float32 ? kF32 : dtype == mx::float16 ? kF16 : dtype == mx::uint8 ? kE8M0 : kBF16;
}

int mlx_engine::check_factored(const mx::Shape& gshape, int group_size, const mx::array& scales,
                               const mx::array* biases, const mx::array& super, const std::string& who) {
  const bool is_signed = scales.dtype() == mx::int8;
  if (group_size != 16 && group_size != 32)
    throw std::invalid_argument(who + ": two-level scales take groups of 16 or 32, not " + std::to_string(group_size));
  if (scales.shape() != gshape || (!is_signed && scales.dtype() != mx::uint8) ||
      (!is_signed && (!biases || biases->shape() != gshape || biases->dtype() != mx::uint8)) || (is_signed && biases))
    throw std::invalid_argument(who + ": two-level scales must be uint8 [..., K / group_size] with biases the same, or "
                                      "int8 without biases");
  const int per_super = 256 / group_size;
  mx::Shape sshape = gshape;
  sshape.back() = gshape.back() / per_super;
  sshape.push_back(is_signed ? 1 : 2);
  if (gshape.back() % per_super || super.shape() != sshape || super.dtype() != mx::float16)
    throw std::invalid_argument(who + ": super scales must be float16 [..., K / 256, " + (is_signed ? "1" : "2") +
                                "] (the row length a multiple of 256)");
  return is_signed ? mlx_engine::kI8 : mlx_engine::kU8;
}

void mlx_engine::check_group(int group_size, int bits, const std::string& who) {
  if (group_size != 16 && group_size != 32 && group_size != 64 && group_size != 128)
    throw std::invalid_argument(who + ": group_size must be 16, 32, 64 or 128, not " + std::to_string(group_size));
  if (group_size == 16 && bits == 4)
    throw std::invalid_argument(who + ": 4-bit weights take groups of 32, 64 or 128, not 16");
}

void mlx_engine::factored_scales(const Problem& p, int n0, int count, float* s, float* b) {
  factored_for_cpu()(p, n0, count, s, b);
}

const mlx_engine::int8::QX& mlx_engine::int8::quantize_x(const float* x, int M, int K, bool nib, bool own,
                                                         QuantizeRowFn row, bool x16, int slot) {
  static thread_local QXBuffers buffers[2];
  static thread_local QX quantized[2];
  QXBuffers& b = buffers[slot];
  QX& q = quantized[slot];
  const int blocks = K / 32, K4 = (K + 127) / 128 * 128, K8 = (K + 63) / 64 * 64;
  if (nib) b.p4.assign(size_t(M) * (K4 / 128) * (x16 ? kRecord4x16 : kRecord4), 0);
  if (own) b.p8.assign(size_t(M) * (K8 / 64) * (x16 ? kRecord8x16 : kRecord8), 0);
  b.sx32.resize(size_t(M) * blocks), b.sx64.resize(size_t(M) * (K / 64) + 1), b.sx128.resize(size_t(M) * (K / 128) + 1);
  const int chunks = std::min(M / 16, 4 * pool_threads());
  if (chunks <= 1) {
    for (int m = 0; m < M; ++m) row(x, K, m, nib, own, b);
  } else {
    QXBuffers& mine = b;  // (a thread_local named in the lambda would be each worker's own)
    parallel_for(chunks, [&](int c) {
      for (int m = int(int64_t(M) * c / chunks), e = int(int64_t(M) * (c + 1) / chunks); m < e; ++m)
        row(x, K, m, nib, own, mine);
    });
  }
  // the sums per 64 and 128 (groups of those sizes) from those per 32
  for (int m = 0; m < M; ++m) {
    const float* sx = b.sx32.data() + size_t(m) * blocks;
    float* s64 = b.sx64.data() + size_t(m) * (K / 64);
    for (int g = 0; g < K / 64; ++g) s64[g] = sx[2 * g] + sx[2 * g + 1];
    float* s128 = b.sx128.data() + size_t(m) * (K / 128);
    for (int g = 0; g < K / 128; ++g) s128[g] = (sx[4 * g] + sx[4 * g + 1]) + (sx[4 * g + 2] + sx[4 * g + 3]);
  }
  q = {K4, K8, b.p4.data(), b.p8.data(), {b.sx32.data(), b.sx64.data(), b.sx128.data()}, x16};
  return q;
}

mlx_engine::Activations mlx_engine::parse_activations(const std::string& name, const std::string& who) {
  if (name == "float32") return kActFloat32;
  if (name == "int8") return kActInt8;
  if (name == "int16") {
    // checked here, where the graph is built, not in the kernel (an error there would surface from evaluation)
    if (!int16_supported())
      throw std::invalid_argument(who + ": int16 activations need AVX-512 VNNI or AVX2, which this CPU lacks");
    return kActInt16;
  }
  throw std::invalid_argument(who + ": activations must be \"float32\", \"int8\" or \"int16\", not \"" + name +
                              "\"");
}

// Products of one x with several weights (a layer's q, k and v share x) as one parallel job: output rows in units of
// 16 over all the products, in chunks claimed by whichever thread is free (pool.h). A product too small to be worth a
// second thread on its own (a decode step's k and v) is split with the rest.
// act int8 or int16: x quantized so and the integer kernel, where the CPU has it (int16 only reaches here where it
// has AVX-512 VNNI or AVX2: parse_activations).
void mlx_engine::qmatmul_run(std::vector<Problem>& ps, Activations act) {
  const int M = ps[0].M, K = ps[0].K;
  // int16 pays for few rows of x (decode steps) and loses to float32 for many (a prompt's products), so products of
  // kInt16MaxRows rows or more take the float32 kernel (docs/internals/cpu-kernels.md).
  if (act == kActInt16 && M >= kInt16MaxRows) act = kActFloat32;
  const RowsFn rows = rows_for_cpu();
  RowsFn int8_rows = nullptr;
  const FactoredFn factored = factored_for_cpu();
  for (auto& p : ps) p.qx = nullptr;
#ifdef X86_KERNELS
  static const std::string int8_here = int8_isa();
  if (act != kActFloat32 && !int8_here.empty()) {
    const bool vnni_here = int8_here == "vnni", x16 = act == kActInt16;
    // x quantized once per way its weights take it (kind 1: int8 per 256, Q8_K; 0: per 32, or int16)
    const auto kind = [x16](const Problem& p) { return int(!x16 && int8_per_256(p)); };
    bool nib[2] = {}, own[2] = {};  // per kind, the layouts of x_q these widths read
    for (auto& p : ps)
      if (int8_kernel_takes(p, !vnni_here, x16 && !vnni_here)) (p.bits == 4 ? nib : own)[kind(p)] = true;
    for (int k = 0; k < 2; ++k) {
      if (!nib[k] && !own[k]) continue;
      using mlx_engine::int8::QuantizeRowFn;
      const QuantizeRowFn quantize_row =
          x16 ? (vnni_here ? &vnni::quantize_row16 : &avx2::i8::quantize_row16)
          : k ? (vnni_here ? &vnni::quantize_row<true> : &avx2::i8::quantize_row<true>)
              : (vnni_here ? &vnni::quantize_row<false> : &avx2::i8::quantize_row<false>);
      const void* qx = &mlx_engine::int8::quantize_x(ps[0].x, M, K, nib[k], own[k], quantize_row, x16, k);
      for (auto& p : ps)
        if (int8_kernel_takes(p, !vnni_here, x16 && !vnni_here) && kind(p) == k) p.qx = qx;
      int8_rows = vnni_here ? &vnni::rows : &avx2::i8::rows;
    }
  }
#endif
  const float* reordered = nullptr;  // x in the float32 kernel's order for its 4-bit weights
#ifdef X86_KERNELS
  static const bool avx512_here = rows == &avx512::rows;
  const bool blocks = avx512_here && M < 4;
#else
  const bool blocks = false;
#endif
  const float* sums[3] = {nullptr, nullptr, nullptr};  // with blocks: x's sums per 32, 64 and 128 elements
  for (auto& p : ps) {
    if (p.qx || p.bits != 4) continue;
    if (!reordered) reordered = prepare_x(p.x, M, K, 4, blocks, sums);
    p.x = reordered;
    p.x_blocks = blocks;
    p.xsums = blocks ? sums[p.group_size == 32 ? 0 : p.group_size == 64 ? 1 : 2] : nullptr;
  }
  static const int64_t min_work =
      std::getenv("MLX_ENGINE_MIN_WORK") ? std::atoll(std::getenv("MLX_ENGINE_MIN_WORK")) : 1 << 17;
  std::vector<int> first(ps.size() + 1, 0);  // each product's first unit
  int64_t work = 0;
  for (size_t i = 0; i < ps.size(); ++i) {
    first[i + 1] = first[i] + (ps[i].N + 15) / 16;
    work += int64_t(M) * ps[i].N * K;
  }
  const int units = first.back();
  const int threads = mlx_engine::pool_threads();
  if (threads == 1 || units <= 1 || work < 2 * min_work) {
    for (auto& p : ps) run_rows(rows, int8_rows, factored, p, 0, p.N);
    return;
  }
  // four chunks per thread (fewer for a small job)
  const int chunks = int(std::min<int64_t>({units, 4 * threads, work / min_work}));
  mlx_engine::parallel_for(chunks, [&](int c) {
    const int u0 = int(int64_t(units) * c / chunks), u1 = int(int64_t(units) * (c + 1) / chunks);
    for (size_t i = 0; i < ps.size(); ++i) {
      const int a = std::max(u0, first[i]), b = std::min(u1, first[i + 1]);
      if (a < b)
        run_rows(rows, int8_rows, factored, ps[i], (a - first[i]) * 16, std::min(ps[i].N, (b - first[i]) * 16));
    }
  });
}

size_t mlx_engine::Stage::weight_inputs() const {
  size_t n = 3 * bits.size();
  for (size_t i = 0; i < bits.size(); ++i) n += out_norms[i] + factored[i];
  return n;
}

bool mlx_engine::Stage::operator==(const Stage& o) const {
  return group_sizes == o.group_sizes && bits == o.bits && symmetric == o.symmetric && out_norms == o.out_norms &&
         factored == o.factored && codebook == o.codebook && prologue == o.prologue && eps == o.eps && act == o.act;
}

std::vector<mx::array> mlx_engine::HeldInputs::split(std::vector<mx::array> all) {
  std::vector<mx::array> graph;
  Kept kept;
  kept.places.assign(all.size(), false);
  for (size_t i = 0; i < all.size(); ++i) {
    kept.places[i] = i > 0 && !all[i].is_tracer() && all[i].is_available();
    (kept.places[i] ? kept.arrays : graph).push_back(std::move(all[i]));
  }
  kept_ = std::make_shared<const Kept>(std::move(kept));
  return graph;
}

std::vector<mx::array> mlx_engine::HeldInputs::join(const std::vector<mx::array>& inputs) const {
  const Kept& k = *kept_;
  if (k.arrays.empty()) return inputs;
  std::vector<mx::array> all;
  all.reserve(k.places.size());
  for (size_t i = 0, g = 0, j = 0; i < k.places.size(); ++i) all.push_back(k.places[i] ? k.arrays[j++] : inputs[g++]);
  return all;
}

bool mlx_engine::HeldInputs::operator==(const HeldInputs& o) const {
  const Kept &a = *kept_, &b = *o.kept_;
  if (a.places != b.places || a.arrays.size() != b.arrays.size()) return false;
  for (size_t i = 0; i < a.arrays.size(); ++i)
    if (a.arrays[i].id() != b.arrays[i].id()) return false;
  return true;
}

mx::Shape mlx_engine::out_shape(const mx::Shape& product, const std::optional<std::vector<int>>& given,
                                const std::string& who, size_t i) {
  if (!given) return product;
  int64_t want = 1, got = 1;
  for (int d : product) want *= d;
  for (int d : *given) {
    if (d < 0) throw std::invalid_argument(who + ": an output shape has a negative size");
    got *= d;
  }
  if (got != want)
    throw std::invalid_argument(who + ": output shape " + std::to_string(i) + " has " + std::to_string(got) +
                                " elements, the product has " + std::to_string(want));
  return mx::Shape(given->begin(), given->end());
}

void mlx_engine::run_stage(const Stage& st, const std::vector<mx::array>& inputs, const std::vector<const void*>& data,
                           size_t w0, const float* x, int M, int K, const float* const* pro, float* sum,
                           float* const* outs, const int* norm_dims) {
  // x after the prologue: a decode step's in a buffer kept per thread, a prefill's freed after it
  static thread_local std::vector<float> row_buf;
  std::vector<float> rows_buf;
  if (st.prologue != kNone) {
    std::vector<float>& buf = M <= 16 ? row_buf : rows_buf;
    buf.resize(size_t(M) * K);
    if (st.prologue == kNorm)
      norm_rows(x, nullptr, pro[0], nullptr, buf.data(), M, K, st.eps);
    else if (st.prologue == kAddNorm)
      norm_rows(x, pro[0], pro[1], sum, buf.data(), M, K, st.eps);
    else
      activate_all(x, pro[0], buf.data(), int64_t(M) * K, st.prologue == kSiLU ? 0 : 1);
    x = buf.data();
  }
  std::vector<Problem> ps(st.bits.size());
  size_t super_at = w0 + 3 * ps.size();  // the super scales, after the norms' weights
  for (size_t i = 0; i < ps.size(); ++i) super_at += st.out_norms[i];
  for (size_t i = 0; i < ps.size(); ++i) {
    Problem& p = ps[i];
    const mx::array& scales = inputs[w0 + 1 + 3 * i];
    p.x = x;
    p.w = static_cast<const uint8_t*>(data[w0 + 3 * i]);
    p.scales = data[w0 + 1 + 3 * i];
    p.biases = st.symmetric[i] ? nullptr : data[w0 + 2 + 3 * i];
    p.out = outs[i];
    p.N = p.ldo = inputs[w0 + 3 * i].shape(0);
    p.K = K;
    p.M = M;
    p.group_size = st.group_sizes[i];
    p.bits = st.bits[i];
    p.codebook = mlx_engine::codebook_levels(st.codebook[i]);
    p.scale_type = mlx_engine::scale_type_of(scales.dtype(), st.factored[i]);
    if (st.factored[i]) p.super = data[super_at++];
  }
  qmatmul_run(ps, st.act);
  size_t norm_at = w0 + 3 * ps.size();
  for (size_t i = 0; i < ps.size(); ++i) {
    if (!st.out_norms[i]) continue;
    const int64_t D = norm_dims[i];
    norm_rows(outs[i], nullptr, static_cast<const float*>(data[norm_at++]), nullptr, outs[i],
              int64_t(M) * ps[i].N / D, D, st.eps);
  }
}

namespace {

// ------------------------------------------------------------------------------------------------ the primitive

using mlx_engine::kAddNorm;
using mlx_engine::kNone;
using mlx_engine::kNorm;
using mlx_engine::kSiLU;
using mlx_engine::prologue_inputs;
using mlx_engine::Stage;
const char* const kPrologueNames[] = {"none", "norm", "add_norm", "silu", "gelu_tanh"};

// y_i = x @ dequantize(w_i, scales_i, biases_i).T for one x and one or more weights (a Stage): inputs x and the
// prologue's, then the stage's weights; one float32 output per weight (after the prologue's sum, for kAddNorm). An
// output with a norm is RMSNorm-ed over its last axis in place after the product (a layer's query and key norms per
// head, Gemma 3's norms after its projections).
class QMatmul : public mx::Primitive {
 public:
  // out_shapes: empty, or each output's shape as given to qmatmul_many
  // held: the inputs it keeps (see HeldInputs)
  QMatmul(mx::Stream stream, Stage stage, std::vector<mx::Shape> out_shapes, mlx_engine::HeldInputs held)
      : mx::Primitive(stream),
        stage_(std::make_shared<const Stage>(std::move(stage))),
        out_shapes_(std::move(out_shapes)),
        held_(std::move(held)) {}

  void eval_cpu(const std::vector<mx::array>& graph_inputs, std::vector<mx::array>& outputs) override {
    for (auto& out : outputs) out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : graph_inputs) encoder.set_input_array(a);
    for (auto& out : outputs) encoder.set_output_array(out);
    encoder.dispatch([graph_inputs, outputs, stage = stage_, held = held_]() mutable {
      const Stage& st = *stage;
      const std::vector<mx::array> inputs = held.join(graph_inputs);
      const std::vector<const void*> data = mlx_engine::row_major_all(inputs);
      const mx::array& x = inputs[0];
      const int K = x.shape(-1), M = int(x.size() / K), npro = prologue_inputs(st.prologue);
      const float* pro[2] = {};
      for (int i = 0; i < npro; ++i) pro[i] = static_cast<const float*>(data[1 + i]);
      const size_t y0 = st.prologue == kAddNorm, n = st.bits.size();
      std::vector<float*> outs(n);
      std::vector<int> dims(n);
      for (size_t i = 0; i < n; ++i) outs[i] = outputs[y0 + i].data<float>(), dims[i] = outputs[y0 + i].shape(-1);
      mlx_engine::run_stage(st, inputs, data, 1 + npro, static_cast<const float*>(data[0]), M, K, pro,
                            y0 ? outputs[0].data<float>() : nullptr, outs.data(), dims.data());
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlx_engine qmatmul runs on the CPU only; use mx.quantized_matmul on a GPU");
  }

  const char* name() const override { return "MLXEngineQMatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const QMatmul&>(other);
    return *stage_ == *o.stage_ && out_shapes_ == o.out_shapes_ && held_ == o.held_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& graph_inputs) override {
    const std::vector<mx::array> inputs = held_.join(graph_inputs);
    std::vector<mx::Shape> shapes;
    if (stage_->prologue == kAddNorm) shapes.push_back(inputs[0].shape());
    if (!out_shapes_.empty()) {
      shapes.insert(shapes.end(), out_shapes_.begin(), out_shapes_.end());
      return shapes;
    }
    for (size_t i = 0, w0 = 1 + prologue_inputs(stage_->prologue); i < stage_->bits.size(); ++i) {
      mx::Shape shape = inputs[0].shape();
      shape.back() = inputs[w0 + 3 * i].shape(0);
      shapes.push_back(shape);
    }
    return shapes;
  }

 private:
  std::shared_ptr<const Stage> stage_;  // shared with the tasks (a copy per dispatch is a dozen allocations)
  std::vector<mx::Shape> out_shapes_;
  mlx_engine::HeldInputs held_;
};

}  // namespace

namespace {

// The checks of a weight for a product with x [..., Kx] (biases: the scales again for a symmetric weight; super:
// two-level scales); returns N.
int check_weight(int Kx, const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size, int bits,
                 const mx::array* super, const std::string& who) {
  if (bits != 2 && bits != 3 && bits != 4 && bits != 5 && bits != 6 && bits != 8)
    throw std::invalid_argument(who + ": bits must be 2, 3, 4, 5, 6 or 8, not " + std::to_string(bits));
  mlx_engine::check_group(group_size, bits, who);
  if (w.ndim() != 2 || w.dtype() != mx::uint32) throw std::invalid_argument(who + ": w must be 2-D uint32");
  int N = w.shape(0);
  int K = int(int64_t(w.shape(1)) * 32 / bits);
  if (Kx != K) throw std::invalid_argument(who + ": x's last axis must be " + std::to_string(K));
  if (K % group_size || K % 32)
    throw std::invalid_argument(who + ": the row length is not a multiple of group_size and of 32");
  mx::Shape gshape{N, K / group_size};
  if (super) {
    mlx_engine::check_factored(gshape, group_size, scales, scales.dtype() == mx::int8 ? nullptr : &biases, *super, who);
    return N;
  }
  if (scales.shape() != gshape || biases.shape() != gshape || scales.dtype() != biases.dtype())
    throw std::invalid_argument(who + ": scales and biases must both be [N, K / group_size] of one dtype");
  if (scales.dtype() != mx::float32 && scales.dtype() != mx::float16 && scales.dtype() != mx::bfloat16 &&
      scales.dtype() != mx::uint8)  // (uint8: E8M0, see check_codebook)
    throw std::invalid_argument(who + ": scales must be float32, float16 or bfloat16");
  return N;
}

}  // namespace

int mlx_engine::add_weight(Stage& st, std::vector<mx::array>& inputs, std::vector<mx::array>& supers, int K,
                           const mx::array& w, const mx::array& scales,
                           const std::optional<mx::array>& biases, int group_size, int bits,
                           const std::optional<mx::array>& super, int codebook, const std::string& who) {
  if (super && scales.dtype() != mx::int8 && !biases)
    throw std::invalid_argument(who + ": two-level uint8 scales need their biases (mins)");
  if (super && scales.dtype() == mx::int8 && biases)
    throw std::invalid_argument(who + ": two-level int8 scales are a symmetric weight's: give no biases");
  mlx_engine::check_codebook(codebook, bits, biases.has_value(), scales.dtype(), super.has_value(), who);
  const mx::array& b = biases ? *biases : scales;
  const int N = check_weight(K, w, scales, b, group_size, bits, super ? &*super : nullptr, who);
  st.group_sizes.push_back(group_size);
  st.bits.push_back(bits);
  st.symmetric.push_back(!biases);
  st.out_norms.push_back(false);
  st.factored.push_back(bool(super));
  st.codebook.push_back(codebook);
  inputs.insert(inputs.end(), {w, scales, b});
  if (super) supers.push_back(*super);
  return N;
}

namespace {

// The checks of a prologue's inputs (see Prologue) against x [..., K]; returns the Prologue.
int check_prologue(const mx::array& x, const std::string& name, const std::vector<mx::array>& in) {
  int prologue = -1;
  for (int i = 0; i < 5; ++i)
    if (name == kPrologueNames[i]) prologue = i;
  if (prologue < 0)
    throw std::invalid_argument("qmatmul_many: prologue must be none, norm, add_norm, silu or gelu_tanh, not " + name);
  if (int(in.size()) != prologue_inputs(prologue))
    throw std::invalid_argument("qmatmul_many: prologue " + name + " takes " +
                                std::to_string(prologue_inputs(prologue)) + " inputs, not " + std::to_string(in.size()));
  if (prologue == kNone) return prologue;
  if (x.dtype() != mx::float32) throw std::invalid_argument("qmatmul_many: a prologue needs float32 x");
  const mx::Shape norm_shape{x.shape(-1)};
  for (size_t i = 0; i < in.size(); ++i) {
    const bool is_weight = prologue == kNorm || (prologue == kAddNorm && i == 1);
    if (in[i].dtype() != mx::float32 || in[i].shape() != (is_weight ? norm_shape : x.shape()))
      throw std::invalid_argument("qmatmul_many: prologue " + name + "'s input " + std::to_string(i) +
                                  " must be float32 of shape " + (is_weight ? "[K]" : "x's"));
  }
  return prologue;
}

// `out_shapes` (optional): the shape of each output, of the same size as x.shape[:-1] + [N_i] (its row-major
// elements are those; a decode step's queries come out as [1, heads, 1, head_dim], with no reshape node).
// `prologue` and its inputs, `out_norms` and `eps`: see Prologue and QMatmul.
std::vector<mx::array> qmatmul_many(const mx::array& x, const std::vector<mx::array>& ws,
                                    const std::vector<mx::array>& scales,
                                    const std::vector<std::optional<mx::array>>& biases,
                                    const std::vector<int>& group_sizes, const std::vector<int>& bits,
                                    const std::optional<std::vector<std::vector<int>>>& out_shapes,
                                    const std::string& activations, const std::string& prologue_name,
                                    const std::vector<mx::array>& prologue_in,
                                    const std::optional<std::vector<std::optional<mx::array>>>& out_norms,
                                    float eps,
                                    const std::optional<std::vector<std::optional<mx::array>>>& supers,
                                    const std::optional<std::vector<int>>& codebooks) {
  const mlx_engine::Activations act = mlx_engine::parse_activations(activations, "qmatmul");
  const size_t n = ws.size();
  if (n == 0 || scales.size() != n || biases.size() != n || group_sizes.size() != n || bits.size() != n ||
      (out_shapes && out_shapes->size() != n) || (out_norms && out_norms->size() != n) ||
      (supers && supers->size() != n) || (codebooks && codebooks->size() != n))
    throw std::invalid_argument(
        "qmatmul_many: give one or more weights, each with its scales, biases, group size and bits (and shape, and "
        "norm)");
  const int prologue = check_prologue(x, prologue_name, prologue_in);
  mx::Stream s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs{mx::astype(x, mx::float32, s)};
  inputs.insert(inputs.end(), prologue_in.begin(), prologue_in.end());
  std::vector<mx::Shape> shapes;
  Stage st;
  st.prologue = prologue, st.eps = eps, st.act = act;
  std::vector<mx::array> super_inputs;
  for (size_t i = 0; i < n; ++i) {
    mx::Shape shape = x.shape();
    shape.back() = mlx_engine::add_weight(st, inputs, super_inputs, x.ndim() ? x.shape(-1) : -1, ws[i], scales[i],
                                          biases[i], group_sizes[i],
                                          bits[i], supers ? (*supers)[i] : std::nullopt,
                                          codebooks ? (*codebooks)[i] : 0, "qmatmul");
    shapes.push_back(mlx_engine::out_shape(shape, out_shapes ? std::optional((*out_shapes)[i]) : std::nullopt,
                                           "qmatmul_many", i));
  }
  for (size_t i = 0; out_norms && i < n; ++i) {
    const auto& w = (*out_norms)[i];
    if (!w) continue;
    if (w->dtype() != mx::float32 || w->shape() != mx::Shape{shapes[i].back()})
      throw std::invalid_argument("qmatmul_many: output " + std::to_string(i) + "'s norm weight must be float32 [" +
                                  std::to_string(shapes[i].back()) + "]");
    st.out_norms[i] = true;
    inputs.push_back(*w);
  }
  inputs.insert(inputs.end(), super_inputs.begin(), super_inputs.end());
  std::vector<mx::Shape> all_shapes = shapes;
  if (prologue == kAddNorm) all_shapes.insert(all_shapes.begin(), x.shape());
  // No graph node beyond the products themselves (the primitive takes its inputs in any layout).
  mlx_engine::HeldInputs held;
  inputs = held.split(std::move(inputs));
  auto ys = mx::array::make_arrays(all_shapes, std::vector<mx::Dtype>(all_shapes.size(), mx::float32),
                                   std::make_shared<QMatmul>(s, std::move(st),
                                                             out_shapes ? shapes : std::vector<mx::Shape>{},
                                                             std::move(held)),
                                   inputs);
  for (auto& y : ys) y = mx::astype(y, x.dtype(), s);
  return ys;
}

mx::array qmatmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                  const std::optional<mx::array>& biases, int group_size, int bits, const std::string& activations,
                  const std::optional<mx::array>& super, int codebook) {
  return qmatmul_many(x, {w}, {scales}, {biases}, {group_size}, {bits}, std::nullopt, activations, "none", {},
                      std::nullopt, 0.f, std::vector<std::optional<mx::array>>{super}, std::vector<int>{codebook})[0];
}

}  // namespace

void register_rope(nb::module_& m);       // rope.cpp
void register_attention(nb::module_& m);  // attention.cpp
void register_norm(nb::module_& m);       // norm.cpp
void register_activation(nb::module_& m);  // activation.cpp
void register_qtake(nb::module_& m);       // qtake.cpp
void register_half(nb::module_& m);        // half.cpp
void register_softmax(nb::module_& m);     // softmax.cpp
void register_gather_qmatmul(nb::module_& m);  // gather_qmatmul.cpp
void register_hugepages(nb::module_& m);  // hugepages.cpp
void register_output_mlp(nb::module_& m);  // output_mlp.cpp

NB_MODULE(_kernels, m) {
  m.doc() = "mlx-engine's CPU kernels (MLX primitives)";
  m.def("qmatmul", &qmatmul, nb::arg("x"), nb::arg("w"), nb::arg("scales"), nb::arg("biases").none(),
        nb::arg("group_size"), nb::arg("bits"), nb::arg("activations") = "float32",
        nb::arg("super").none() = nb::none(), nb::arg("codebook") = 0,
        "x [..., K] @ dequantize(w, scales, biases).T -> [..., N] in x's dtype, on the CPU stream; biases None: "
        "-2**(bits - 1) * scales (a symmetric weight); codebook (4 bits, no biases): element scale * kvalues[q], "
        "1: llama.cpp's kvalues_iq4nl (GGUF's IQ4_NL and IQ4_XS), 2: its kvalues_mxfp4 (E2M1 doubled, GGUF's MXFP4 "
        "with scales 2**(e - 128)), 0: none; activations \"int8\": x quantized to int8 first "
        "as llama.cpp does (per 32 elements, its Q8_0; with super scales per 256, its Q8_K), where "
        "int8_supported(); \"int16\": to 16 bits (d = max|x| / 32639), where "
        "int16_supported(); super: two-level scales per 256 elements, either float16 "
        "[N, K / 256, 2] with scales and biases uint8 integers sc and m, scale = super[.., 0] * sc, bias = "
        "super[.., 1] * m (GGUF's Q4_K, Q5_K, Q2_K), or float16 [N, K / 256, 1] with int8 scales sc and no biases, "
        "scale = super[.., 0] * sc (GGUF's Q6_K, Q3_K); group_size 16 (but for 4 bits), 32, 64 or 128.");
  m.def("qmatmul_many", &qmatmul_many, nb::arg("x"), nb::arg("ws"), nb::arg("scales"), nb::arg("biases"),
        nb::arg("group_sizes"), nb::arg("bits"), nb::arg("out_shapes") = nb::none(),
        nb::arg("activations") = "float32", nb::arg("prologue") = "none",
        nb::arg("prologue_inputs") = std::vector<mx::array>{}, nb::arg("out_norms") = nb::none(),
        nb::arg("eps") = 0.f, nb::arg("supers") = nb::none(), nb::arg("codebooks") = nb::none(),
        "[x @ dequantize(w_i, scales_i, biases_i).T for each weight], as one graph node and one parallel job "
        "(a biases_i of None: -2**(bits_i - 1) * scales_i; supers[i]: weight i's two-level scales, as qmatmul's "
        "super; codebooks[i]: weight i's codebook, as qmatmul's); "
        "out_shapes: each result's shape (its elements in row-major order), instead of x.shape[:-1] + [N_i]; "
        "prologue, on float32 x first: \"norm\" (inputs [w]: x = rms_norm(x, w, eps)), \"add_norm\" "
        "([residual, w]: s = x + residual, x = rms_norm(s, w, eps), s returned first), \"silu\" or "
        "\"gelu_tanh\" ([up]: x = act(x) * up); out_norms[i] (a float32 weight or None): result i "
        "rms_norm-ed over its last axis with it. The same bits as the operations apart (rms_norm, add_rms_norm, "
        "activation).");
  register_rope(m);
  register_attention(m);
  register_norm(m);
  register_activation(m);
  register_half(m);
  register_qtake(m);
  register_softmax(m);
  register_gather_qmatmul(m);
  register_hugepages(m);
  register_output_mlp(m);
  m.def("threads", [] { return mlx_engine::pool_threads(); }, "Threads the kernels use.");
  m.def("isa", &mlx_engine::isa, "The instruction set the kernels were picked for.");
  m.def("int8_supported", &int8_supported, "Whether qmatmul's int8 activations run here (AVX-512 VNNI, or AVX2).");
  m.def("int16_supported", &int16_supported, "Whether qmatmul's int16 activations run here (AVX-512 VNNI, or AVX2).");
  m.def("int16_max_rows", [] { return mlx_engine::kInt16MaxRows; },
        "int16 activations apply to products of fewer rows of x than this; more take the float32 kernel.");
  m.attr("mlx_version") = std::to_string(MLX_VERSION_MAJOR) + "." + std::to_string(MLX_VERSION_MINOR) + "." +
                          std::to_string(MLX_VERSION_PATCH);
}
