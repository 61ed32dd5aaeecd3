// SiLU and tanh-approximated GELU, vectorized, as MLX primitives on the CPU.
//
// activation(x, kind, up): kind 0 SiLU, x * sigmoid(x) (Elfwing et al. 2018); kind 1 GELU in the tanh form (Hendrycks &
// Gimpel 2016), 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), as mlx.nn.gelu_approx, computed as
// x * sigmoid(2 sqrt(2 / pi) (x + 0.044715 x^3)) (the same function). float32; sigmoid from vecmath.h's exp, within a
// few units in the last place of MLX's 1 / (1 + exp(-x)) (further for GELU at negative x, where MLX's 1 + tanh
// cancels). Why: MLX's CPU backend evaluates these through the C library's scalar expf / tanhf, one element at a
// time, over every element of a layer's MLP: a few percent of a decode step, and a prefill's tokens times that.
// With `up` (a gated MLP's up projection, x's shape): act(x) * up, one graph node where there were two (each node
// of a decode step costs a hand-over between threads in MLX's CPU scheduler); the same values as the two.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "pool.h"
#include "rows.h"
#include "strided.h"
#include "vecmath.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

INLINE f32x16 neg_abs(f32x16 x) { return x < 0.f ? x : -x; }

// 1 / (1 + e) for x >= 0, e / (1 + e) below (1 - 1 / (1 + e) would cancel), e = exp(-|x|).
INLINE f32x16 sigmoid16(f32x16 x) {
  const f32x16 e = exp_nonpositive(neg_abs(x)), y = 1.f / (1.f + e);
  return x < 0.f ? e * y : y;
}

INLINE f32x16 silu16(f32x16 x) { return x * sigmoid16(x); }

// 0.5 x (1 + tanh z) = x sigmoid(2 z): the same function, without the cancellation of 1 + tanh z for negative z.
INLINE f32x16 gelu_tanh16(f32x16 x) {
  return x * sigmoid16(1.5957691216057308f * (x + 0.044715f * (x * x * x)));
}

PER_ISA void activate(const float* x, const float* up, float* out, int64_t n, int kind) {
  // m elements from i: with m = 16 (a constant once inlined) the copies are a register's loads and store; a copy of
  // a run-time size is a call to memcpy, so only the last, partial register takes one
  const auto span = [&](int64_t i, int64_t m) __attribute__((always_inline)) {
    f32x16 v{};
    std::memcpy(&v, x + i, m * 4);
    v = kind == 0 ? silu16(v) : gelu_tanh16(v);
    if (up) {
      f32x16 u{};
      std::memcpy(&u, up + i, m * 4);
      v = v * u;
    }
    std::memcpy(out + i, &v, m * 4);
  };
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) span(i, 16);
  if (i < n) span(i, n - i);
}

}  // namespace

void mlx_engine::activate_all(const float* x, const float* up, float* out, int64_t n, int kind) {
  const int64_t chunk = 1 << 14;
  const int chunks = int((n + chunk - 1) / chunk);
  parallel_for(chunks, [&](int c) {  // one chunk (a decode step's) runs here, on this thread
    activate(x + c * chunk, up ? up + c * chunk : nullptr, out + c * chunk, std::min(chunk, n - c * chunk), kind);
  });
}

namespace {

class Activation : public mx::UnaryPrimitive {
 public:
  Activation(mx::Stream stream, int kind) : mx::UnaryPrimitive(stream), kind_(kind) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    encoder.dispatch([inputs, out, kind = kind_]() mutable {
      static thread_local std::vector<uint8_t> buf, up_buf;
      const float* x = static_cast<const float*>(mlx_engine::row_major(inputs[0], buf));
      const float* up =
          inputs.size() > 1 ? static_cast<const float*>(mlx_engine::row_major(inputs[1], up_buf)) : nullptr;
      mlx_engine::activate_all(x, up, out.data<float>(), int64_t(out.size()), kind);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlx_engine activation runs on the CPU only; use mlx.nn's on a GPU");
  }

  // Training differentiates through the inference code (training/train_image.py): the gradient is that of MLX's
  // own form of the function.
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    const int kind = kind_;
    auto fn = [kind](const std::vector<mx::array>& in) {
      const mx::array& x = in[0];
      auto gelu = [&x] {
        mx::array inner = mx::multiply(mx::array(0.7978845608028654f),
                                       mx::add(x, mx::multiply(mx::array(0.044715f), mx::power(x, mx::array(3.f)))));
        return mx::multiply(mx::multiply(mx::array(0.5f), x), mx::add(mx::array(1.f), mx::tanh(inner)));
      };
      mx::array y = kind == 0 ? mx::multiply(x, mx::sigmoid(x)) : gelu();
      return std::vector<mx::array>{in.size() > 1 ? mx::multiply(y, in[1]) : y};
    };
    auto grads = mx::vjp(fn, primals, cotangents).second;
    std::vector<mx::array> wanted;
    for (int i : argnums) wanted.push_back(grads[i]);
    return wanted;
  }

  const char* name() const override { return kind_ == 0 ? "MLXEngineSiLU" : "MLXEngineGeluTanh"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return kind_ == static_cast<const Activation&>(other).kind_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  int kind_;
};

mx::array activation(const mx::array& x, int kind, const std::optional<mx::array>& up) {
  if (x.dtype() != mx::float32) throw std::invalid_argument("activation: x must be float32");
  if (kind != 0 && kind != 1) throw std::invalid_argument("activation: kind must be 0 (SiLU) or 1 (GELU, tanh form)");
  if (up && (up->dtype() != mx::float32 || up->shape() != x.shape()))
    throw std::invalid_argument("activation: up must be float32 of x's shape");
  mx::Stream s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs{x};
  if (up) inputs.push_back(*up);
  return mx::array(x.shape(), mx::float32, std::make_shared<Activation>(s, kind), std::move(inputs));
}

}  // namespace

void register_activation(nb::module_& m) {
  m.def("activation", &activation, nb::arg("x"), nb::arg("kind"), nb::arg("up") = nb::none(),
        "SiLU (kind 0) or tanh-form GELU (kind 1) of float32 x, elementwise, times up if given, on the CPU stream.");
}
