// RMSNorm as one MLX primitive on the CPU.
//
// rms_norm(x [..., D], weight [D] or None, eps): each row times 1 / sqrt(mean(x ** 2) + eps), then times the weight
// (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"). The arithmetic is MLX's CPU fallback of
// mx.fast.rms_norm, step for step in float32 and in its order: the mean of the squares, n = 1 / sqrt(mean + eps),
// (x * n) * w, each product rounded (no fused multiply-add), so on x86-64 the result is MLX's bit for bit. Why: MLX
// runs mx.fast.rms_norm on the CPU as that fallback, four graph nodes (square, sum, a fused rsqrt-multiply and the
// broadcasts), and a decode step of a 30-layer model has 61 of them; the nodes cost more than the arithmetic.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/fast.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "pool.h"
#include "rows.h"
#include "strided.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

// One row, in MLX's order: the squares summed left to right (MLX's CPU reduction on this kind of machine), the mean
// as the sum times 1 / D, then 1 / sqrt in double rounded to float (MLX's rsqrt).
__attribute__((optimize("fp-contract=off"))) void norm_row(const float* x, const float* w, float* out, int64_t D,
                                                           float eps, float inv_d) {
  float sum = 0.f;
  for (int64_t i = 0; i < D; ++i) sum += x[i] * x[i];
  const float n = float(1.0 / double(std::sqrt(sum * inv_d + eps)));
  if (w) {
    for (int64_t k = 0; k < D; ++k) out[k] = (x[k] * n) * w[k];
  } else {
    for (int64_t k = 0; k < D; ++k) out[k] = x[k] * n;
  }
}

}  // namespace

namespace mlx_engine {

// Rows of x [rows, D] (plus residual, into sum, when given) normed into out. Rows over the threads only where there
// is enough of them (a prefill); a single chunk (a decode step's) runs on this thread.
void norm_rows(const float* x, const float* residual, const float* w, float* sum, float* out, int64_t rows,
               int64_t D, float eps) {
  const float inv_d = float(1.0 / double(D));
  const int64_t per_chunk = std::max<int64_t>(1, (1 << 15) / D);
  const int chunks = int((rows + per_chunk - 1) / per_chunk);
  mlx_engine::parallel_for(chunks, [&](int c) {
    for (int64_t r = c * per_chunk, e = std::min(rows, r + per_chunk); r < e; ++r) {
      const float* row = x + r * D;
      if (residual) {
        for (int64_t k = 0; k < D; ++k) sum[r * D + k] = row[k] + residual[r * D + k];
        row = sum + r * D;
      }
      norm_row(row, w, out + r * D, D, eps, inv_d);
    }
  });
}

}  // namespace mlx_engine

namespace {

// The gradients asked for (argnums) of fn, a composition of MLX operations equal to the primitive.
template <typename Fn>
std::vector<mx::array> composed_vjp(Fn fn, const std::vector<mx::array>& primals,
                                    const std::vector<mx::array>& cotangents, const std::vector<int>& argnums) {
  auto grads = mx::vjp(fn, primals, cotangents).second;
  std::vector<mx::array> out;
  for (int i : argnums) out.push_back(grads[i]);
  return out;
}

class RMSNorm : public mx::UnaryPrimitive {
 public:
  RMSNorm(mx::Stream stream, float eps) : mx::UnaryPrimitive(stream), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    encoder.dispatch([inputs, out, eps = eps_]() mutable {
      static thread_local std::vector<uint8_t> bufs[2];
      const float* x = static_cast<const float*>(mlx_engine::row_major(inputs[0], bufs[0]));
      const float* w = inputs.size() > 1 ? static_cast<const float*>(mlx_engine::row_major(inputs[1], bufs[1]))
                                         : nullptr;
      const int64_t D = inputs[0].shape(-1);
      mlx_engine::norm_rows(x, nullptr, w, nullptr, out.data<float>(), int64_t(inputs[0].size()) / D, D, eps);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlx_engine rms_norm runs on the CPU only; use mx.fast.rms_norm on a GPU");
  }

  // Training differentiates through the inference code (training/train_image.py): the gradient is that of
  // mx.fast.rms_norm, whose result this primitive equals.
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    const float eps = eps_;
    auto fn = [eps](const std::vector<mx::array>& in) {
      return std::vector<mx::array>{
          mx::fast::rms_norm(in[0], in.size() > 1 ? std::optional<mx::array>(in[1]) : std::nullopt, eps)};
    };
    return composed_vjp(fn, primals, cotangents, argnums);
  }

  const char* name() const override { return "MLXEngineRMSNorm"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RMSNorm&>(other).eps_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  float eps_;
};

// A residual add and the RMSNorm after it (a decoder layer's h + attention output, then the norm before the MLP):
// outputs s = x + residual and rms_norm(s), one graph node where there were two; s is the float32 sum, and the norm
// is that of norm_row, so both equal the two operations bit for bit.
class AddRMSNorm : public mx::Primitive {
 public:
  AddRMSNorm(mx::Stream stream, float eps) : mx::Primitive(stream), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    for (auto& out : outputs) out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    for (auto& out : outputs) encoder.set_output_array(out);
    encoder.dispatch([inputs, outputs, eps = eps_]() mutable {
      static thread_local std::vector<uint8_t> bufs[3];
      const float* x = static_cast<const float*>(mlx_engine::row_major(inputs[0], bufs[0]));
      const float* r = static_cast<const float*>(mlx_engine::row_major(inputs[1], bufs[1]));
      const float* w = inputs.size() > 2 ? static_cast<const float*>(mlx_engine::row_major(inputs[2], bufs[2]))
                                         : nullptr;
      const int64_t D = inputs[0].shape(-1);
      mlx_engine::norm_rows(x, r, w, outputs[0].data<float>(), outputs[1].data<float>(),
                            int64_t(inputs[0].size()) / D, D, eps);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlx_engine add_rms_norm runs on the CPU only; use x + r and mx.fast.rms_norm on a GPU");
  }

  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    const float eps = eps_;
    auto fn = [eps](const std::vector<mx::array>& in) {
      mx::array s = mx::add(in[0], in[1]);
      return std::vector<mx::array>{
          s, mx::fast::rms_norm(s, in.size() > 2 ? std::optional<mx::array>(in[2]) : std::nullopt, eps)};
    };
    return composed_vjp(fn, primals, cotangents, argnums);
  }

  const char* name() const override { return "MLXEngineAddRMSNorm"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const AddRMSNorm&>(other).eps_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape(), inputs[0].shape()};
  }

 private:
  float eps_;
};

std::vector<mx::array> add_rms_norm(const mx::array& x, const mx::array& residual,
                                    const std::optional<mx::array>& weight, float eps) {
  if (x.ndim() < 1 || x.dtype() != mx::float32 || x.shape(-1) < 1)
    throw std::invalid_argument("add_rms_norm: x must be float32 [..., D] with D >= 1");
  if (residual.shape() != x.shape() || residual.dtype() != mx::float32)
    throw std::invalid_argument("add_rms_norm: residual must be float32 of x's shape");
  if (weight && (weight->ndim() != 1 || weight->shape(0) != x.shape(-1) || weight->dtype() != mx::float32))
    throw std::invalid_argument("add_rms_norm: weight must be float32 [" + std::to_string(x.shape(-1)) + "]");
  mx::Stream s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs{x, residual};
  if (weight) inputs.push_back(*weight);
  return mx::array::make_arrays({x.shape(), x.shape()}, {mx::float32, mx::float32},
                                std::make_shared<AddRMSNorm>(s, eps), inputs);
}

mx::array rms_norm(const mx::array& x, const std::optional<mx::array>& weight, float eps) {
  if (x.ndim() < 1 || x.dtype() != mx::float32 || x.shape(-1) < 1)
    throw std::invalid_argument("rms_norm: x must be float32 [..., D] with D >= 1");
  if (weight && (weight->ndim() != 1 || weight->shape(0) != x.shape(-1) || weight->dtype() != mx::float32))
    throw std::invalid_argument("rms_norm: weight must be float32 [" + std::to_string(x.shape(-1)) + "]");
  mx::Stream s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs{x};
  if (weight) inputs.push_back(*weight);
  return mx::array(x.shape(), mx::float32, std::make_shared<RMSNorm>(s, eps), std::move(inputs));
}

}  // namespace

void register_norm(nb::module_& m) {
  m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("weight").none(), nb::arg("eps"),
        "RMSNorm of x [..., D] float32 over its last axis, times weight [D] (or None), on the CPU stream.");
  m.def("add_rms_norm", &add_rms_norm, nb::arg("x"), nb::arg("residual"), nb::arg("weight").none(), nb::arg("eps"),
        "(x + residual, rms_norm(x + residual, weight, eps)) for float32 x and residual of one shape, one graph node.");
}
