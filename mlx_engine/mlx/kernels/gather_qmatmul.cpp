// A mixture of experts' products with quantized expert weights, as one MLX primitive on the CPU.
//
// gather_qmatmul(x, w, scales, biases, indices, group_size, bits, activations) -> float32 [N, k, I]:
//     out[n, j] = x[n] @ dequantize(w[e], scales[e], biases[e]).T,   e = indices[n, j]
// for x [N, K], expert weights w [E, I, K * bits / 32] (uint32, MLX's affine layout, see qmatmul.cpp) with scales and
// biases [E, I, K / group_size] (or two-level ones with super scales [E, I, K / 256, 2 or 1], as qmatmul's), and
// indices [N, k] (int32 or uint32) in [0, E). The products are those of qmatmul
// (the same kernel, so the same bits as qmatmul(x[n], w[e], ...)). A decode step (N = 1) runs its k experts as one
// parallel job; a prompt's tokens are grouped by expert first, so that each expert's weights are read once for all
// the tokens routed to it (llama.cpp's mul_mat_id does the same). Why our own: MLX's CPU gather_qmm dequantizes as
// its quantized_matmul does (slower than a float32 product); a GGUF's experts are most of its bytes.
// An index outside [0, E) gives NaN outputs (never a read outside w).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "qmatmul.h"
#include "strided.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

using mlx_engine::Problem;

class GatherQMatmul : public mx::Primitive {
 public:
  GatherQMatmul(mx::Stream stream, int group_size, int bits, bool symmetric, mlx_engine::Activations act,
                bool factored, int codebook)
      : mx::Primitive(stream),
        group_size_(group_size),
        bits_(bits),
        symmetric_(symmetric),
        act_(act),
        factored_(factored),
        codebook_(codebook) {}

  // inputs: x [N, K] float32, w [E, I, Kw], scales, biases (the scales again when symmetric), indices [N, k], and
  // the super scales when factored
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    encoder.dispatch([inputs, out, gs = group_size_, bits = bits_, symmetric = symmetric_, act = act_,
                      factored = factored_, codebook = codebook_]() mutable {
      const std::vector<const void*> data = mlx_engine::row_major_all(inputs);
      const mx::array &w = inputs[1], &scales = inputs[2], &idx = inputs[4];
      const int K = inputs[0].shape(-1), N = int(inputs[0].size() / K), k = idx.shape(-1);
      const int E = w.shape(0), I = w.shape(1), groups = K / gs;
      const size_t row_bytes = size_t(K) * bits / 8, scale_bytes = scales.itemsize();
      const float* x = static_cast<const float*>(data[0]);
      float* y = out.data<float>();
      std::vector<int> expert(size_t(N) * k);
      for (size_t t = 0; t < expert.size(); ++t)
        expert[t] = idx.dtype() == mx::uint32 ? int(std::min<uint32_t>(static_cast<const uint32_t*>(data[4])[t],
                                                                       uint32_t(std::numeric_limits<int>::max())))
                                              : static_cast<const int32_t*>(data[4])[t];
      // expert e's weight as a problem of M rows of x at xs, its outputs at ys
      auto problem = [&](int e, const float* xs, int M, float* ys) {
        Problem p;
        p.x = xs;
        p.w = static_cast<const uint8_t*>(data[1]) + size_t(e) * I * row_bytes;
        p.scales = static_cast<const uint8_t*>(data[2]) + size_t(e) * I * groups * scale_bytes;
        p.biases = symmetric ? nullptr : static_cast<const uint8_t*>(data[3]) + size_t(e) * I * groups * scale_bytes;
        p.out = ys;
        p.M = M, p.N = p.ldo = I, p.K = K, p.group_size = gs, p.bits = bits;
        p.codebook = mlx_engine::codebook_levels(codebook);
        p.scale_type = mlx_engine::scale_type_of(scales.dtype(), factored);
        if (factored) {
          const bool is_signed = scales.dtype() == mx::int8;
          p.super = static_cast<const uint16_t*>(data[5]) + size_t(e) * I * (K / 256) * (is_signed ? 1 : 2);
        }
        return p;
      };
      auto poison = [&](size_t t) {
        std::fill(y + t * I, y + (t + 1) * I, std::numeric_limits<float>::quiet_NaN());
      };
      if (N == 1) {  // one x: its k products as one job
        std::vector<Problem> ps;
        for (int j = 0; j < k; ++j) {
          if (expert[j] < 0 || expert[j] >= E) {
            poison(j);
            continue;
          }
          ps.push_back(problem(expert[j], x, 1, y + size_t(j) * I));
        }
        if (!ps.empty()) mlx_engine::qmatmul_run(ps, act);
        return;
      }
      // tokens grouped by expert: each expert's rows of x gathered, its products made, the outputs put back
      std::vector<std::vector<int>> routed(E);
      for (size_t t = 0; t < expert.size(); ++t) {
        if (expert[t] < 0 || expert[t] >= E)
          poison(t);
        else
          routed[expert[t]].push_back(int(t));
      }
      std::vector<float> xs, ys;
      for (int e = 0; e < E; ++e) {
        const std::vector<int>& ts = routed[e];
        if (ts.empty()) continue;
        const int M = int(ts.size());
        xs.resize(size_t(M) * K), ys.resize(size_t(M) * I);
        for (int i = 0; i < M; ++i) std::memcpy(xs.data() + size_t(i) * K, x + size_t(ts[i] / k) * K, size_t(K) * 4);
        std::vector<Problem> ps{problem(e, xs.data(), M, ys.data())};
        mlx_engine::qmatmul_run(ps, act);
        for (int i = 0; i < M; ++i) std::memcpy(y + size_t(ts[i]) * I, ys.data() + size_t(i) * I, size_t(I) * 4);
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlx_engine gather_qmatmul runs on the CPU only; use mx.gather_qmm on a GPU");
  }

  const char* name() const override { return "MLXEngineGatherQMatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const GatherQMatmul&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_ && symmetric_ == o.symmetric_ && act_ == o.act_ &&
           factored_ == o.factored_ && codebook_ == o.codebook_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[4].shape(0), inputs[4].shape(1), inputs[1].shape(1)}};
  }

 private:
  int group_size_, bits_;
  bool symmetric_;
  mlx_engine::Activations act_;
  bool factored_;
  int codebook_;
};

mx::array gather_qmatmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                         const std::optional<mx::array>& biases, const mx::array& indices, int group_size, int bits,
                         const std::string& activations, const std::optional<mx::array>& super, int codebook) {
  const mlx_engine::Activations act = mlx_engine::parse_activations(activations, "gather_qmatmul");
  if (bits != 2 && bits != 3 && bits != 4 && bits != 5 && bits != 6 && bits != 8)
    throw std::invalid_argument("gather_qmatmul: bits must be 2, 3, 4, 5, 6 or 8, not " + std::to_string(bits));
  mlx_engine::check_group(group_size, bits, "gather_qmatmul");
  mlx_engine::check_codebook(codebook, bits, biases.has_value(), scales.dtype(), super.has_value(), "gather_qmatmul");
  if (w.ndim() != 3 || w.dtype() != mx::uint32) throw std::invalid_argument("gather_qmatmul: w must be 3-D uint32");
  const int E = w.shape(0), I = w.shape(1), K = int(int64_t(w.shape(2)) * 32 / bits);
  if (x.ndim() != 2 || x.shape(1) != K)
    throw std::invalid_argument("gather_qmatmul: x must be [N, " + std::to_string(K) + "]");
  if (K % group_size || K % 32)
    throw std::invalid_argument("gather_qmatmul: the row length is not a multiple of group_size and of 32");
  const mx::array& b = biases ? *biases : scales;
  const mx::Shape gshape{E, I, K / group_size};
  if (super) {
    mlx_engine::check_factored(gshape, group_size, scales, biases ? &*biases : nullptr, *super, "gather_qmatmul");
  } else if (scales.shape() != gshape || b.shape() != gshape || scales.dtype() != b.dtype()) {
    throw std::invalid_argument("gather_qmatmul: scales and biases must both be [E, I, K / group_size] of one dtype");
  } else if (scales.dtype() != mx::float32 && scales.dtype() != mx::float16 && scales.dtype() != mx::bfloat16 &&
             scales.dtype() != mx::uint8) {  // (uint8: E8M0, see check_codebook)
    throw std::invalid_argument("gather_qmatmul: scales must be float32, float16 or bfloat16");
  }
  if (indices.ndim() != 2 || indices.shape(0) != x.shape(0) ||
      (indices.dtype() != mx::int32 && indices.dtype() != mx::uint32))
    throw std::invalid_argument("gather_qmatmul: indices must be int32 or uint32 [N, k]");
  mx::Stream s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs{mx::astype(x, mx::float32, s), w, scales, b, indices};
  if (super) inputs.push_back(*super);
  auto y = mx::array(mx::Shape{indices.shape(0), indices.shape(1), I}, mx::float32,
                     std::make_shared<GatherQMatmul>(s, group_size, bits, !biases.has_value(), act,
                                                     super.has_value(), codebook),
                     std::move(inputs));
  return mx::astype(y, x.dtype(), s);
}

}  // namespace

void register_gather_qmatmul(nb::module_& m) {
  m.def("gather_qmatmul", &gather_qmatmul, nb::arg("x"), nb::arg("w"), nb::arg("scales"), nb::arg("biases").none(),
        nb::arg("indices"), nb::arg("group_size"), nb::arg("bits"), nb::arg("activations") = "float32",
        nb::arg("super").none() = nb::none(), nb::arg("codebook") = 0,
        "x [N, K] through the experts indices [N, k] of w [E, I, K * bits / 32] -> [N, k, I] in x's dtype "
        "(out[n, j] = x[n] @ dequantize(w[e], scales[e], biases[e]).T, e = indices[n, j]), on the CPU stream; "
        "biases None: -2**(bits - 1) * scales; activations, super (two-level scales) and codebook as qmatmul's.");
}
