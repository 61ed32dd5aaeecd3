// CPU kernels of mlx-engine, as MLX primitives.
//
// qmatmul(x, w, scales, biases, group_size, bits): y = x @ dequantize(w, scales, biases).T for a weight in MLX's
// affine layout (mx.quantize with mode="affine"): element j of row n is
//     scales[n, j / group_size] * q[n, j] + biases[n, j / group_size],
// q an unsigned `bits`-bit integer at bit offset j * bits of the row's bytes (little-endian, lowest bits first).
// By default the activations stay float32: the result is the float32 product of x with the exactly dequantized
// weight (only the order of the sums differs from a dense matmul), so a lossless repack of a GGUF file gives the
// tokens of the float path. With activations="int8" (where the CPU has AVX-512 VNNI) x is quantized as llama.cpp
// quantizes it and the sums are integer ones (qmatmul_int8.inc). Why our own: MLX's CPU quantized_matmul is 2.4x
// slower than float32 for one row and 42x for 512 rows (measured on this project's machines); a decode step reads
// every weight once, so its speed is the weight's bytes.
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
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "mlx/version.h"
#include "half.h"
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
  const void* biases;  // [N, K / group_size], or null: the zero point 2**(bits - 1), bias = -2**(bits - 1) * scale
  float* out;  // [M, N]
  int M, N, K, group_size, bits, scale_type;
  const void* qx = nullptr;  // x quantized to int8 (vnni::QX), for the int8 kernel
};

using mlx_engine::half_to_float;

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
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi,avx512vnni,fma,f16c,avx2,bmi2")
namespace vnni {
using avx512::scale_at;
#include "qmatmul_int8.inc"
}
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

// Whether this CPU has the int8 kernel (AVX-512 with VNNI).
bool int8_supported() {
#ifdef X86_KERNELS
  return isa() == "avx512" && __builtin_cpu_supports("avx512vnni");
#else
  return false;
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

// Products of one x with several weights (a layer's q, k and v share x) as one parallel job: output rows in units of
// 16 over all the products, in chunks claimed by whichever thread is free (pool.h). A product too small to be worth a
// second thread on its own (a decode step's k and v) is split with the rest.
// int8: x quantized to int8 and the int8 kernel, where the CPU has it.
void qmatmul_run(std::vector<Problem>& ps, bool int8) {
  const int M = ps[0].M, K = ps[0].K;
  RowsFn rows = rows_for_cpu();
#ifdef X86_KERNELS
  static const bool vnni_here = int8_supported();
  if (int8 && vnni_here) {
    bool nib = false, own = false;  // the layouts of x_q these widths read
    for (auto& p : ps) (p.bits == 4 ? nib : own) = true;
    const void* qx = &vnni::quantize_x(ps[0].x, M, K, nib, own);
    for (auto& p : ps) p.qx = qx;
    rows = &vnni::rows;
  } else
#endif
  {
    const float* reordered = nullptr;
    for (auto& p : ps) {
      if (p.bits == 4 && !reordered) reordered = prepare_x(p.x, M, K, 4);
      if (p.bits == 4) p.x = reordered;
    }
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
    for (auto& p : ps) rows(p, 0, p.N);
    return;
  }
  // four chunks per thread (fewer for a small job)
  const int chunks = int(std::min<int64_t>({units, 4 * threads, work / min_work}));
  mlx_engine::parallel_for(chunks, [&](int c) {
    const int u0 = int(int64_t(units) * c / chunks), u1 = int(int64_t(units) * (c + 1) / chunks);
    for (size_t i = 0; i < ps.size(); ++i) {
      const int a = std::max(u0, first[i]), b = std::min(u1, first[i + 1]);
      if (a < b) rows(ps[i], (a - first[i]) * 16, std::min(ps[i].N, (b - first[i]) * 16));
    }
  });
}

// ------------------------------------------------------------------------------------------------ the primitive

// y_i = x @ dequantize(w_i, scales_i, biases_i).T for one x and one or more weights: inputs x, then w, scales and
// biases of each weight; one float32 output per weight.
class QMatmul : public mx::Primitive {
 public:
  // out_shapes: empty, or each output's shape as given to qmatmul_many
  // symmetric[i]: weight i has no biases (its scales stand in their place among the inputs), see Problem::biases
  // int8: x quantized to int8 (see qmatmul_int8.inc) where the CPU has the kernel
  QMatmul(mx::Stream stream, std::vector<int> group_sizes, std::vector<int> bits, std::vector<bool> symmetric,
          std::vector<mx::Shape> out_shapes, bool int8)
      : mx::Primitive(stream),
        group_sizes_(std::move(group_sizes)),
        bits_(std::move(bits)),
        symmetric_(std::move(symmetric)),
        out_shapes_(std::move(out_shapes)),
        int8_(int8) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    for (auto& out : outputs) out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    for (auto& out : outputs) encoder.set_output_array(out);
    encoder.dispatch([inputs, outputs, gs = group_sizes_, bits = bits_, symmetric = symmetric_,
                      int8 = int8_]() mutable {
      static thread_local std::vector<std::vector<uint8_t>> buffers;  // (strided.h)
      if (buffers.size() < inputs.size()) buffers.resize(inputs.size());
      std::vector<const void*> data(inputs.size());
      for (size_t i = 0; i < inputs.size(); ++i) data[i] = mlx_engine::row_major(inputs[i], buffers[i]);
      const mx::array& x = inputs[0];
      std::vector<Problem> ps(outputs.size());
      for (size_t i = 0; i < ps.size(); ++i) {
        Problem& p = ps[i];
        const mx::array& scales = inputs[2 + 3 * i];
        p.x = static_cast<const float*>(data[0]);
        p.w = static_cast<const uint8_t*>(data[1 + 3 * i]);
        p.scales = data[2 + 3 * i];
        p.biases = symmetric[i] ? nullptr : data[3 + 3 * i];
        p.out = outputs[i].data<float>();
        p.N = inputs[1 + 3 * i].shape(0);
        p.K = x.shape(-1);
        p.M = int(x.size() / p.K);
        p.group_size = gs[i];
        p.bits = bits[i];
        p.scale_type = scales.dtype() == mx::float32 ? kF32 : scales.dtype() == mx::float16 ? kF16 : kBF16;
      }
      qmatmul_run(ps, int8);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlx_engine qmatmul runs on the CPU only; use mx.quantized_matmul on a GPU");
  }

  const char* name() const override { return "MLXEngineQMatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const QMatmul&>(other);
    return group_sizes_ == o.group_sizes_ && bits_ == o.bits_ && symmetric_ == o.symmetric_ &&
           out_shapes_ == o.out_shapes_ && int8_ == o.int8_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    if (!out_shapes_.empty()) return out_shapes_;
    std::vector<mx::Shape> shapes;
    for (size_t i = 1; i < inputs.size(); i += 3) {
      mx::Shape shape = inputs[0].shape();
      shape.back() = inputs[i].shape(0);
      shapes.push_back(shape);
    }
    return shapes;
  }

 private:
  std::vector<int> group_sizes_, bits_;
  std::vector<bool> symmetric_;
  std::vector<mx::Shape> out_shapes_;
  bool int8_;
};

// The checks of one weight against x [..., K]; returns N.
int check_weight(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                 int group_size, int bits) {  // (biases: the scales again for a symmetric weight)
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
  return N;
}

// `out_shapes` (optional): the shape of each output, of the same size as x.shape[:-1] + [N_i] (its row-major
// elements are those; a decode step's queries come out as [1, heads, 1, head_dim], with no reshape node).
std::vector<mx::array> qmatmul_many(const mx::array& x, const std::vector<mx::array>& ws,
                                    const std::vector<mx::array>& scales,
                                    const std::vector<std::optional<mx::array>>& biases,
                                    const std::vector<int>& group_sizes, const std::vector<int>& bits,
                                    const std::optional<std::vector<std::vector<int>>>& out_shapes,
                                    const std::string& activations) {
  if (activations != "float32" && activations != "int8")
    throw std::invalid_argument("qmatmul: activations must be \"float32\" or \"int8\", not \"" + activations + "\"");
  const size_t n = ws.size();
  if (n == 0 || scales.size() != n || biases.size() != n || group_sizes.size() != n || bits.size() != n ||
      (out_shapes && out_shapes->size() != n))
    throw std::invalid_argument(
        "qmatmul_many: give one or more weights, each with its scales, biases, group size and bits (and shape)");
  mx::Stream s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs{mx::astype(x, mx::float32, s)};
  std::vector<mx::Shape> shapes;
  std::vector<bool> symmetric(n);
  for (size_t i = 0; i < n; ++i) {
    symmetric[i] = !biases[i].has_value();
    const mx::array& b = biases[i] ? *biases[i] : scales[i];
    mx::Shape shape = x.shape();
    shape.back() = check_weight(x, ws[i], scales[i], b, group_sizes[i], bits[i]);
    if (out_shapes) {
      mx::Shape given((*out_shapes)[i].begin(), (*out_shapes)[i].end());
      int64_t want = 1, got = 1;
      for (int d : shape) want *= d;
      for (int d : given) {
        if (d < 0) throw std::invalid_argument("qmatmul_many: an output shape has a negative size");
        got *= d;
      }
      if (got != want)
        throw std::invalid_argument("qmatmul_many: output shape " + std::to_string(i) + " has " + std::to_string(got) +
                                    " elements, the product has " + std::to_string(want));
      shape = given;
    }
    shapes.push_back(shape);
    inputs.insert(inputs.end(), {ws[i], scales[i], b});
  }
  // No graph node beyond the products themselves (the primitive takes its inputs in any layout).
  auto ys = mx::array::make_arrays(shapes, std::vector<mx::Dtype>(n, mx::float32),
                                   std::make_shared<QMatmul>(s, group_sizes, bits, symmetric,
                                                             out_shapes ? shapes : std::vector<mx::Shape>{},
                                                             activations == "int8"),
                                   inputs);
  for (auto& y : ys) y = mx::astype(y, x.dtype(), s);
  return ys;
}

mx::array qmatmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                  const std::optional<mx::array>& biases, int group_size, int bits, const std::string& activations) {
  return qmatmul_many(x, {w}, {scales}, {biases}, {group_size}, {bits}, std::nullopt, activations)[0];
}

}  // namespace

void register_rope(nb::module_& m);       // rope.cpp
void register_attention(nb::module_& m);  // attention.cpp
void register_norm(nb::module_& m);       // norm.cpp
void register_activation(nb::module_& m);  // activation.cpp
void register_qtake(nb::module_& m);       // qtake.cpp

NB_MODULE(_kernels, m) {
  m.doc() = "mlx-engine's CPU kernels (MLX primitives)";
  m.def("qmatmul", &qmatmul, nb::arg("x"), nb::arg("w"), nb::arg("scales"), nb::arg("biases").none(),
        nb::arg("group_size"), nb::arg("bits"), nb::arg("activations") = "float32",
        "x [..., K] @ dequantize(w, scales, biases).T -> [..., N] in x's dtype, on the CPU stream; biases None: "
        "-2**(bits - 1) * scales (a symmetric weight); activations \"int8\": x quantized per 32 elements to int8 "
        "first (llama.cpp's Q8_0), where int8_supported().");
  m.def("qmatmul_many", &qmatmul_many, nb::arg("x"), nb::arg("ws"), nb::arg("scales"), nb::arg("biases"),
        nb::arg("group_sizes"), nb::arg("bits"), nb::arg("out_shapes") = nb::none(),
        nb::arg("activations") = "float32",
        "[x @ dequantize(w_i, scales_i, biases_i).T for each weight], as one graph node and one parallel job "
        "(a biases_i of None: -2**(bits_i - 1) * scales_i); "
        "out_shapes: each result's shape (its elements in row-major order), instead of x.shape[:-1] + [N_i].");
  register_rope(m);
  register_attention(m);
  register_norm(m);
  register_activation(m);
  register_qtake(m);
  m.def("threads", [] { return mlx_engine::pool_threads(); }, "Threads the kernels use.");
  m.def("isa", &isa, "The instruction set the kernels were picked for.");
  m.def("int8_supported", &int8_supported, "Whether qmatmul's int8 activations run here (AVX-512 VNNI).");
  m.attr("mlx_version") = std::to_string(MLX_VERSION_MAJOR) + "." + std::to_string(MLX_VERSION_MINOR) + "." +
                          std::to_string(MLX_VERSION_PATCH);
}
