// CPU kernels of mlx-engine, as MLX primitives.
//
// qmatmul(x, w, scales, biases, group_size, bits): y = x @ dequantize(w, scales, biases).T for a weight in MLX's
// affine layout (mx.quantize with mode="affine"): element j of row n is
//     scales[n, j / group_size] * q[n, j] + biases[n, j / group_size],
// q an unsigned `bits`-bit integer at bit offset j * bits of the row's bytes (little-endian, lowest bits first).
// The activations stay float32: the result is the float32 product of x with the exactly dequantized weight (only
// the order of the sums differs from a dense matmul), so a lossless repack of a GGUF file gives the tokens of the
// float path. Why our own: MLX's CPU quantized_matmul is 2.4x slower than float32 for one row and 42x for 512 rows
// (measured on this project's machines); a decode step reads every weight once, so its speed is the weight's bytes.
//
// Vectorized with GCC/Clang vector extensions (16 float lanes: one AVX-512 register, two AVX2 registers, four NEON
// registers); on x86-64 the row kernel is compiled for x86-64-v4 (AVX-512), v3 (AVX2 + FMA) and the baseline, and
// the loader picks one at run time. Rows of the output are split over the kernels' threads (pool.h).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "mlx/version.h"
#include "pool.h"
#include "strided.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

// ------------------------------------------------------------------------------------------------ the kernel

#define INLINE inline __attribute__((always_inline))

enum ScaleType { kF32 = 0, kF16 = 1, kBF16 = 2 };

struct Problem {
  const float* x;  // [M, K], for 4-bit weights reordered per 32 elements (see prepare_x)
  const uint8_t* w;  // [N, K * bits / 8]
  const void* scales;  // [N, K / group_size]
  const void* biases;  // [N, K / group_size]
  float* out;  // [M, N]
  int M, N, K, group_size, bits, scale_type;
};

// IEEE half -> float, exact for every value (the 2**112 product rescales normals and subnormals alike).
INLINE float half_to_float(uint16_t h) {
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
}
#undef QMM_AVX2
#pragma GCC pop_options
#endif
namespace generic {
#include "qmatmul_rows.inc"
}

using RowsFn = void (*)(const Problem&, int, int);

std::string isa() {
#ifdef X86_KERNELS
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi"))
    return "avx512";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "avx2";
  return "generic";
#elif defined(__aarch64__)
  return "neon";
#else
  return "generic";
#endif
}

RowsFn rows_for_cpu() {
  static const RowsFn fn = [] {
    std::string name = isa();
#ifdef X86_KERNELS
    if (name == "avx512") return &avx512::rows;
    if (name == "avx2") return &avx2::rows;
#endif
    return &generic::rows;
  }();
  return fn;
}

// x [M, K] -> the order the row kernel reads: for 4 bits, per 32 elements the 16 even ones then the 16 odd ones.
// (Into a buffer kept per thread: a decode step makes a few hundred products, and a fresh allocation for each showed
// up as a tenth of the step in malloc.)
const float* prepare_x(const float* x, int M, int K, int bits) {
  if (bits != 4) return x;
  static thread_local std::vector<float> xp;
  if (xp.size() < size_t(M) * K) xp.resize(size_t(M) * K);
  for (size_t c = 0; c < size_t(M) * K; c += 32) {
    for (int i = 0; i < 16; ++i) {
      xp[c + i] = x[c + 2 * i];
      xp[c + 16 + i] = x[c + 2 * i + 1];
    }
  }
  return xp.data();
}

void qmatmul_run(Problem p) {
  p.x = prepare_x(p.x, p.M, p.K, p.bits);
  RowsFn rows = rows_for_cpu();
  static const int64_t min_work =
      std::getenv("MLX_ENGINE_MIN_WORK") ? std::atoll(std::getenv("MLX_ENGINE_MIN_WORK")) : 1 << 17;
  const int64_t work = int64_t(p.M) * p.N * p.K;
  const int threads = mlx_engine::pool_threads();
  if (threads == 1 || p.N <= 16 || work < 2 * min_work) {
    rows(p, 0, p.N);
    return;
  }
  // Chunks of whole 16-row units, four per thread (fewer for a small product), claimed by whichever thread is free.
  const int units = (p.N + 15) / 16;
  const int chunks = int(std::min<int64_t>({units, 4 * threads, work / min_work}));
  mlx_engine::parallel_for(chunks, [&](int c) {
    const int n0 = std::min(p.N, units * c / chunks * 16), n1 = std::min(p.N, units * (c + 1) / chunks * 16);
    if (n0 < n1) rows(p, n0, n1);
  });
}

// ------------------------------------------------------------------------------------------------ the primitive

class QMatmul : public mx::UnaryPrimitive {
 public:
  QMatmul(mx::Stream stream, int group_size, int bits)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    encoder.dispatch([inputs, out, gs = group_size_, bits = bits_]() mutable {
      static thread_local std::vector<uint8_t> buffers[4];  // (strided.h)
      const void* data[4];
      for (int i = 0; i < 4; ++i) data[i] = mlx_engine::row_major(inputs[i], buffers[i]);
      const mx::array& x = inputs[0];
      const mx::array& scales = inputs[2];
      Problem p;
      p.x = static_cast<const float*>(data[0]);
      p.w = static_cast<const uint8_t*>(data[1]);
      p.scales = data[2];
      p.biases = data[3];
      p.out = out.data<float>();
      p.N = inputs[1].shape(0);
      p.K = x.shape(-1);
      p.M = int(x.size() / p.K);
      p.group_size = gs;
      p.bits = bits;
      p.scale_type = scales.dtype() == mx::float32 ? kF32 : scales.dtype() == mx::float16 ? kF16 : kBF16;
      qmatmul_run(p);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlx_engine qmatmul runs on the CPU only; use mx.quantized_matmul on a GPU");
  }

  const char* name() const override { return "MLXEngineQMatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const QMatmul&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

 private:
  int group_size_, bits_;
};

mx::array qmatmul(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                  int group_size, int bits) {
  if (bits != 2 && bits != 3 && bits != 4 && bits != 5 && bits != 6 && bits != 8)
    throw std::invalid_argument("qmatmul: bits must be 2, 3, 4, 5, 6 or 8, not " + std::to_string(bits));
  if (group_size != 32 && group_size != 64 && group_size != 128)
    throw std::invalid_argument("qmatmul: group_size must be 32, 64 or 128, not " + std::to_string(group_size));
  if (w.ndim() != 2 || w.dtype() != mx::uint32) throw std::invalid_argument("qmatmul: w must be 2-D uint32");
  int N = w.shape(0);
  int K = int(int64_t(w.shape(1)) * 32 / bits);
  if (x.ndim() < 1 || x.shape(-1) != K)
    throw std::invalid_argument("qmatmul: x's last axis must be " + std::to_string(K));
  if (K % group_size) throw std::invalid_argument("qmatmul: the row length is not a multiple of group_size");
  mx::Shape gshape{N, K / group_size};
  if (scales.shape() != gshape || biases.shape() != gshape || scales.dtype() != biases.dtype())
    throw std::invalid_argument("qmatmul: scales and biases must both be [N, K / group_size] of one dtype");
  if (scales.dtype() != mx::float32 && scales.dtype() != mx::float16 && scales.dtype() != mx::bfloat16)
    throw std::invalid_argument("qmatmul: scales must be float32, float16 or bfloat16");
  mx::Stream s = mx::default_stream(mx::Device::cpu);
  // No graph node beyond the product itself (the primitive takes its inputs in any layout).
  mx::Shape out_shape = x.shape();
  out_shape.back() = N;
  mx::array y(out_shape, mx::float32, std::make_shared<QMatmul>(s, group_size, bits),
              {mx::astype(x, mx::float32, s), w, scales, biases});
  return mx::astype(y, x.dtype(), s);
}

}  // namespace

void register_rope(nb::module_& m);       // rope.cpp
void register_attention(nb::module_& m);  // attention.cpp
void register_norm(nb::module_& m);       // norm.cpp
void register_activation(nb::module_& m);  // activation.cpp

NB_MODULE(_kernels, m) {
  m.doc() = "mlx-engine's CPU kernels (MLX primitives)";
  m.def("qmatmul", &qmatmul, nb::arg("x"), nb::arg("w"), nb::arg("scales"), nb::arg("biases"),
        nb::arg("group_size"), nb::arg("bits"),
        "x [..., K] @ dequantize(w, scales, biases).T -> [..., N] in x's dtype, on the CPU stream.");
  register_rope(m);
  register_attention(m);
  register_norm(m);
  register_activation(m);
  m.def("threads", [] { return mlx_engine::pool_threads(); }, "Threads the kernels use.");
  m.def("isa", &isa, "The instruction set the kernels were picked for.");
  m.attr("mlx_version") = std::to_string(MLX_VERSION_MAJOR) + "." + std::to_string(MLX_VERSION_MINOR) + "." +
                          std::to_string(MLX_VERSION_PATCH);
}
