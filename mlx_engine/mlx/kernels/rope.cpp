// RoPE from a table of cosines and sines, as one MLX primitive on the CPU.
//
// rope_apply(x [B, H, T, D], cos [R, dims / 2], sin [R, dims / 2], dims, traditional): the first `dims` features of
// each row rotated by its angles (Su et al. 2021, "RoFormer"), row t of the table for token t (R == T), or row b for
// batch b when each batch holds one token (R == B, T == 1: per-token positions). Pairs are (i, i + dims / 2), or
// (2i, 2i + 1) with `traditional`. The arithmetic is MLX's own fallback's, operation for operation:
//     out1 = x1 * cos - x2 * sin,   out2 = x1 * sin + x2 * cos   (float32, each product rounded, no fused multiply-add)
// so with the table from mx.fast.rope itself the result is bit for bit mx.fast.rope's on the CPU. Why: MLX runs RoPE
// on the CPU as that fallback, about 25 graph nodes per call (two per layer in a decode step); this is one.
#include <nanobind/nanobind.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "rope.h"
#include "strided.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

class RopeApply : public mx::UnaryPrimitive {
 public:
  RopeApply(mx::Stream stream, int dims, bool traditional)
      : mx::UnaryPrimitive(stream), dims_(dims), traditional_(traditional) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    encoder.dispatch([inputs, out, dims = dims_, traditional = traditional_]() mutable {
      static thread_local std::vector<uint8_t> bufs[3];
      const float* data[3];
      for (int i = 0; i < 3; ++i) data[i] = static_cast<const float*>(mlx_engine::row_major(inputs[i], bufs[i]));
      const mx::array& x = inputs[0];
      mlx_engine::rotate(data[0], data[1], data[2], out.data<float>(), x.shape(0), x.shape(1), x.shape(2),
                         x.shape(3), inputs[1].shape(0), dims, traditional);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlx_engine rope_apply runs on the CPU only; use mx.fast.rope on a GPU");
  }

  const char* name() const override { return "MLXEngineRopeApply"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const RopeApply&>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  int dims_;
  bool traditional_;
};

mx::array rope_apply(const mx::array& x, const mx::array& cos, const mx::array& sin, int dims, bool traditional) {
  if (x.ndim() != 4 || x.dtype() != mx::float32)
    throw std::invalid_argument("rope_apply: x must be float32 [B, H, T, D]");
  if (dims <= 0 || dims % 2 || dims > x.shape(3))
    throw std::invalid_argument("rope_apply: dims must be even, positive and at most D, not " + std::to_string(dims));
  const int rows = cos.ndim() == 2 ? cos.shape(0) : -1;
  const bool fits = rows == x.shape(2) || (x.shape(2) == 1 && rows == x.shape(0));
  if (!fits || cos.shape() != sin.shape() || cos.shape(1) != dims / 2 || cos.dtype() != mx::float32 ||
      sin.dtype() != mx::float32)
    throw std::invalid_argument("rope_apply: cos and sin must be float32 [T or B, dims / 2]");
  mx::Stream s = mx::default_stream(mx::Device::cpu);
  return mx::array(x.shape(), mx::float32, std::make_shared<RopeApply>(s, dims, traditional), {x, cos, sin});
}

}  // namespace

void register_rope(nb::module_& m) {
  m.def("rope_apply", &rope_apply, nb::arg("x"), nb::arg("cos"), nb::arg("sin"), nb::arg("dims"),
        nb::arg("traditional"),
        "RoPE on x [B, H, T, D] float32 from a table cos, sin [T or B, dims / 2], on the CPU stream.");
}
