// float16 -> float32 over arrays (half.h), and the widening of a 16-bit float array to float32 as an MLX primitive.
//
// widen(x): x float16 or bfloat16 -> float32, exact (bit for bit MLX's astype, NaNs kept NaNs). Why our own: MLX's
// CPU backend converts one element at a time through its software float16; a KV cache kept as float16 that goes to
// attention apart (a sliding window's wrapped ring) is widened on every decode step, where that conversion took a
// large share of the step.
#include <nanobind/nanobind.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "half.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "pool.h"
#include "strided.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx,f16c"))) void halves_f16c(const uint16_t* h, float* f, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  for (; i < n; ++i) f[i] = mlx_engine::half_to_float(h[i]);
}
#endif

void bfloats_to_floats(const uint16_t* h, float* f, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t w = uint32_t(h[i]) << 16;
    std::memcpy(f + i, &w, 4);
  }
}

}  // namespace

void mlx_engine::halves_to_floats(const uint16_t* h, float* f, int64_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool f16c = __builtin_cpu_supports("f16c");
  if (f16c) return halves_f16c(h, f, n);
#endif
  for (int64_t i = 0; i < n; ++i) f[i] = mlx_engine::half_to_float(h[i]);
}

namespace {

class Widen : public mx::UnaryPrimitive {
 public:
  explicit Widen(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(inputs[0]);
    encoder.set_output_array(out);
    encoder.dispatch([inputs, out]() mutable {
      static thread_local std::vector<uint8_t> buf;
      const uint16_t* h = static_cast<const uint16_t*>(mlx_engine::row_major(inputs[0], buf));
      const bool half = inputs[0].dtype() == mx::float16;
      float* f = out.data<float>();
      const int64_t n = int64_t(out.size()), chunk = int64_t(1) << 16;
      mlx_engine::parallel_for(int((n + chunk - 1) / chunk), [&](int c) {
        const int64_t i = c * chunk, m = std::min(chunk, n - i);
        half ? mlx_engine::halves_to_floats(h + i, f + i, m) : bfloats_to_floats(h + i, f + i, m);
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlx_engine widen runs on the CPU only; use astype on a GPU");
  }

  // astype's gradient: the cotangent narrowed back to the input's dtype.
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>&, const std::vector<mx::array>&) override {
    return {mx::astype(cotangents[0], primals[0].dtype())};
  }

  const char* name() const override { return "MLXEngineWiden"; }

  bool is_equivalent(const mx::Primitive&) const override { return true; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }
};

mx::array widen(const mx::array& x) {
  if (x.dtype() != mx::float16 && x.dtype() != mx::bfloat16)
    throw std::invalid_argument("widen: x must be float16 or bfloat16");
  return mx::array(x.shape(), mx::float32, std::make_shared<Widen>(mx::default_stream(mx::Device::cpu)), {x});
}

}  // namespace

void register_half(nb::module_& m) {
  m.def("widen", &widen, nb::arg("x"), "float16 or bfloat16 x as float32 (exact, as astype), on the CPU stream.");
}
