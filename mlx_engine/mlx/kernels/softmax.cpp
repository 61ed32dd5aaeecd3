// Softmax over the last axis, as MLX's CPU backend computes it, bit for bit, but vectorized and on every thread of
// the pool (an MLX primitive on the CPU).
//
// softmax(x)_i = exp(x_i - m) / sum_j exp(x_j - m), m = max_j x_j (the usual shift: Bridle 1990). MLX's CPU softmax
// on x86-64 (mlx/backend/cpu/softmax.cpp with one-lane Simd) computes each exp with MLX's own approximation
// (mlx/backend/cpu/simd/math.h: 2**(x log2 e) split into an integer power and Cephes' polynomial in fused
// multiply-adds, which it calls from the C library one at a time), sums them in order from 0, and multiplies by
// 1 / sum; all on one thread. It took about half of a 2048-token prefill of smollm2 (perf, this project's 2-core
// machines). Here the same operations, each rounded as there, run 16 elements at a time (the file is compiled with
// -ffp-contract=off: a product and a sum that MLX rounds apart are never fused), and the sums run 16 rows at a time,
// each row's in order: the same bits, several times faster (tested against mx.softmax bit for bit). One difference:
// a row whose every element is -inf (every key hidden) gives zeros, where MLX's gives NaN.
#include <nanobind/nanobind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "pool.h"
#include "strided.h"
#include "vecmath.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

INLINE f32x16 fma16(f32x16 a, f32x16 b, float c) {
  f32x16 r;
  for (int i = 0; i < 16; ++i) r[i] = __builtin_fmaf(a[i], b[i], c);
  return r;
}

// MLX's simd::exp (see the top), lane by lane the same operations.
INLINE f32x16 mlx_exp(f32x16 x_init) {
  const float inf = std::numeric_limits<float>::infinity();
  f32x16 x = x_init * 1.442695f;  // log2(e)
  f32x16 ipart = x + 0.5f;
  for (int i = 0; i < 16; ++i) ipart[i] = __builtin_floorf(ipart[i]);
  const f32x16 fpart = x - ipart;
  x = f32x16{} + 1.535336188319500e-4f;
  x = fma16(x, fpart, 1.339887440266574e-3f);
  x = fma16(x, fpart, 9.618437357674640e-3f);
  x = fma16(x, fpart, 5.550332471162809e-2f);
  x = fma16(x, fpart, 2.402264791363012e-1f);
  x = fma16(x, fpart, 6.931472028550421e-1f);
  x = fma16(x, fpart, 1.000000000000000f);
  const i32x16 epart = (__builtin_convertvector(ipart, i32x16) + 127) << 23;
  f32x16 two_n;
  std::memcpy(&two_n, &epart, 64);
  f32x16 r = two_n * x;
  r = x_init != x_init ? x_init : r;
  r = x_init > 88.f ? f32x16{} + inf : r;
  r = x_init < -88.f ? f32x16{} : r;
  return r;
}

// Rows [r0, r1) of x [rows, n] into out (which may be x: each element is read before it is written).
PER_ISA void softmax_rows(const float* x, float* out, int64_t r0, int64_t r1, int64_t n) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t rb = r0; rb < r1; rb += 16) {
    const int rows = int(std::min<int64_t>(16, r1 - rb));
    float tops[16], sums[16] = {};
    for (int l = 0; l < rows; ++l) {  // each row's maximum (the same in any order), then its exps
      const float* xr = x + (rb + l) * n;
      float* o = out + (rb + l) * n;
      f32x16 vt = f32x16{} + ninf;
      for (int64_t i = 0; i + 16 <= n; i += 16) {
        f32x16 v;
        std::memcpy(&v, xr + i, 64);
        vt = v > vt ? v : vt;
      }
      float top = ninf;
      for (int j = 0; j < 16; ++j) top = vt[j] > top ? vt[j] : top;
      for (int64_t i = n - n % 16; i < n; ++i) top = xr[i] > top ? xr[i] : top;
      tops[l] = top;
      if (top == ninf) {  // every key hidden: no weight at all (its sum, below, is then 0 and unused)
        std::memset(o, 0, sizeof(float) * n);
        continue;
      }
      for (int64_t i = 0; i < n; i += 16) {
        const int64_t m = std::min<int64_t>(16, n - i);
        f32x16 v{};
        std::memcpy(&v, xr + i, m * 4);
        v = mlx_exp(v - top);
        std::memcpy(o + i, &v, m * 4);
      }
    }
    // the sums, each row's from 0 in element order as MLX adds them; 16 rows side by side keep the adds busy
    for (int64_t i = 0; i < n; ++i)
      for (int l = 0; l < rows; ++l) sums[l] += out[(rb + l) * n + i];
    for (int l = 0; l < rows; ++l) {
      if (tops[l] == ninf) continue;
      float* o = out + (rb + l) * n;
      const float inv = 1.f / sums[l];
      for (int64_t i = 0; i < n; ++i) o[i] *= inv;
    }
  }
}

class Softmax : public mx::UnaryPrimitive {
 public:
  explicit Softmax(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    // in place where MLX lets the scores go (as its own softmax does): a prefill's scores and probabilities are not
    // held at once
    const mx::array& x = inputs[0];
    if (x.is_donatable() && x.flags().row_contiguous)
      out.copy_shared_buffer(x);
    else
      out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(inputs[0]);
    encoder.set_output_array(out);
    encoder.dispatch([x = inputs[0], out]() mutable {
      std::vector<uint8_t> buf;  // a prefill's scores, if not row-major: freed after
      const float* xd = static_cast<const float*>(mlx_engine::row_major(x, buf));
      const int64_t n = x.shape(-1), rows = n ? int64_t(x.size()) / n : 0;  // x has an axis (softmax checks)
      // chunks of 16 rows, or more for short rows (about 64 Ki elements): many per thread in a prefill
      const int64_t per = 16 * std::max<int64_t>(1, (int64_t(1) << 12) / std::max<int64_t>(n, 1));
      const int chunks = int((rows + per - 1) / per);
      float* o = out.data<float>();
      mlx_engine::parallel_for(chunks, [&](int c) {
        softmax_rows(xd, o, c * per, std::min(rows, (c + 1) * per), n);
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlx_engine softmax runs on the CPU only; use mx.softmax on a GPU");
  }

  // The gradient is that of MLX's own softmax: training/train_image.py differentiates through the image models'
  // attention, which runs here on the CPU.
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    auto fn = [](const std::vector<mx::array>& in) {
      return std::vector<mx::array>{mx::softmax(in[0], std::vector<int>{-1}, true)};
    };
    return mx::vjp(fn, primals, cotangents).second;
  }

  const char* name() const override { return "MLXEngineSoftmax"; }

  bool is_equivalent(const mx::Primitive&) const override { return true; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }
};

mx::array softmax(const mx::array& x) {
  if (x.dtype() != mx::float32) throw std::invalid_argument("softmax: x must be float32");
  if (x.ndim() < 1) throw std::invalid_argument("softmax: x must have at least one axis");
  mx::Stream s = mx::default_stream(mx::Device::cpu);
  return mx::array(x.shape(), mx::float32, std::make_shared<Softmax>(s), {x});
}

}  // namespace

void register_softmax(nb::module_& m) {
  m.def("softmax", &softmax, nb::arg("x"),
        "Softmax of float32 x over its last axis, the bits of MLX's CPU softmax (a row of -inf only: zeros, not "
        "NaN), vectorized and threaded, on the CPU stream.");
}
