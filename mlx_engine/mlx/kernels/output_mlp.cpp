// output_mlp: the rest of a decoder layer after attention as one graph node: the output projection (and the norm
// after it, Gemma 3's), the residual add and the MLP's input norm, the gate and up projections, the gated activation
// and the down projection (and the norm after it). Three product stages (qmatmul.h's Stage) run one after the other
// in the node, each by the code of the qmatmul node it stands for, so the bits are those of the three nodes apart; a
// decode step then has three nodes a layer (this, the input norm with q, k and v, and attention) instead of six, and
// each node costs MLX's scheduling time on the calling thread and more on its own. A fourth stage may follow: the
// next layer's residual add,
// input norm and projections (q, k and v), as that layer's qmatmul node would run them, so that a decode step has two
// nodes a layer.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "qmatmul.h"
#include "strided.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

using mlx_engine::Stage;

// Inputs: o [..., K_o] (the attention output, its rows those of h), h [..., D], the MLP's input norm weight [D], then
// the weights of the three stages (Stage::weight_inputs each): the output projection [D, K_o] (with its norm), the
// gate and up projections [F, D], the down projection [D, F] (with its norm). Outputs: h + o' and the MLP's output m,
// both of h's shape (the caller adds them: a decode step defers the add to the next layer's input norm). With a
// fourth stage (the next layer's input norm and projections: its norm weight [D], then its weights): the sum
// h + o' + m and the next layer's products (q, k, v) instead, each in its own shape.
class OutputMLP : public mx::Primitive {
 public:
  OutputMLP(mx::Stream stream, std::vector<Stage> stages, std::vector<mx::Shape> shapes, mlx_engine::HeldInputs held)
      : mx::Primitive(stream),
        stages_(std::make_shared<const std::vector<Stage>>(std::move(stages))),
        shapes_(std::move(shapes)),
        held_(std::move(held)) {}

  void eval_cpu(const std::vector<mx::array>& graph_inputs, std::vector<mx::array>& outputs) override {
    for (auto& out : outputs) out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : graph_inputs) encoder.set_input_array(a);
    for (auto& out : outputs) encoder.set_output_array(out);
    encoder.dispatch([graph_inputs, outputs, shared = stages_, held = held_]() mutable {
      const std::vector<Stage>& stages = *shared;
      const std::vector<mx::array> inputs = held.join(graph_inputs);
      const std::vector<const void*> data = mlx_engine::row_major_all(inputs);
      auto f32 = [&](size_t i) { return static_cast<const float*>(data[i]); };
      const size_t w1 = 3, w2 = w1 + stages[0].weight_inputs(), w3 = w2 + stages[1].weight_inputs();
      const size_t w4 = w3 + stages[2].weight_inputs() + 1;  // (the next layer's: after its norm weight)
      const bool next = stages.size() == 4;
      const int D = inputs[1].shape(-1), M = int(inputs[1].size() / D);
      if (M == 0) return;  // no rows: nothing to compute
      const int K = int(inputs[0].size() / M), F = inputs[w2].shape(0);
      // the products' results between the stages (and with a next stage, h + o' and m): a decode step's in buffers
      // kept per thread
      static thread_local std::vector<float> row_buf;
      std::vector<float> rows_buf;
      std::vector<float>& buf = M <= 16 ? row_buf : rows_buf;
      buf.resize(size_t(M) * (D + 2 * F + (next ? 2 * D : 0)));
      float *y = buf.data(), *g = y + size_t(M) * D, *u = g + size_t(M) * F;
      float* h2 = next ? u + size_t(M) * F : outputs[0].data<float>();
      float* m = next ? h2 + size_t(M) * D : outputs[1].data<float>();
      const int dims_o[1] = {D}, dims_gu[2] = {F, F}, dims_d[1] = {D};
      mlx_engine::run_stage(stages[0], inputs, data, w1, f32(0), M, K, nullptr, nullptr, &y, dims_o);
      const float* pro_gu[2] = {y, f32(2)};
      float* outs_gu[2] = {g, u};
      mlx_engine::run_stage(stages[1], inputs, data, w2, f32(1), M, D, pro_gu, h2, outs_gu, dims_gu);
      const float* pro_d[1] = {u};
      mlx_engine::run_stage(stages[2], inputs, data, w3, g, M, F, pro_d, nullptr, &m, dims_d);
      if (!next) return;
      // the next layer's input norm of h2 + m (the sum out as outputs[0]) and its products, as its node would
      const float* pro_in[2] = {m, f32(w4 - 1)};
      const size_t n = stages[3].bits.size();
      std::vector<float*> outs(n);
      std::vector<int> dims(n);
      for (size_t i = 0; i < n; ++i) outs[i] = outputs[1 + i].data<float>(), dims[i] = outputs[1 + i].shape(-1);
      mlx_engine::run_stage(stages[3], inputs, data, w4, h2, M, D, pro_in, outputs[0].data<float>(), outs.data(),
                            dims.data());
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlx_engine output_mlp runs on the CPU only");
  }

  const char* name() const override { return "MLXEngineOutputMLP"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const OutputMLP&>(other);
    return *stages_ == *o.stages_ && shapes_ == o.shapes_ && held_ == o.held_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& graph_inputs) override {
    if (!shapes_.empty()) return shapes_;
    const mx::Shape h = held_.join(graph_inputs)[1].shape();
    return {h, h};
  }

 private:
  // the output projection; add, norm, gate and up; the activation and down; the next layer's norm and products
  // (shared with the tasks)
  std::shared_ptr<const std::vector<Stage>> stages_;
  std::vector<mx::Shape> shapes_;  // with a next stage, the outputs' shapes (else h's, twice)
  mlx_engine::HeldInputs held_;  // (see there)
};

// A weight as Python gives it: (w, scales, biases or None, group_size, bits, super or None, codebook).
using WeightArg = std::tuple<mx::array, mx::array, std::optional<mx::array>, int, int, std::optional<mx::array>, int>;

int add(Stage& st, std::vector<mx::array>& inputs, std::vector<mx::array>& supers, int K, const WeightArg& a) {
  return mlx_engine::add_weight(st, inputs, supers, K, std::get<0>(a), std::get<1>(a), std::get<2>(a), std::get<3>(a),
                                std::get<4>(a), std::get<5>(a), std::get<6>(a), "output_mlp");
}

// The norm weight `w` of an output of N elements appended to the stage, or nothing.
void add_norm(Stage& st, std::vector<mx::array>& inputs, const std::optional<mx::array>& w, int N, size_t i,
              const char* what) {
  if (!w) return;
  if (w->dtype() != mx::float32 || w->shape() != mx::Shape{N})
    throw std::invalid_argument(std::string("output_mlp: ") + what + " must be float32 [" + std::to_string(N) + "]");
  st.out_norms[i] = true;
  inputs.push_back(*w);
}

std::vector<mx::array> output_mlp(const mx::array& o, const mx::array& h, const WeightArg& wo, const mx::array& norm,
                                  const WeightArg& gate, const WeightArg& up, const WeightArg& down,
                                  const std::string& activation, float eps, const std::optional<mx::array>& o_norm,
                                  const std::optional<mx::array>& down_norm, const std::string& activations,
                                  const std::optional<mx::array>& next_norm, const std::vector<WeightArg>& next,
                                  const std::optional<std::vector<std::vector<int>>>& next_shapes,
                                  const std::optional<std::vector<std::optional<mx::array>>>& next_norms) {
  const mlx_engine::Activations act = mlx_engine::parse_activations(activations, "output_mlp");
  if (activation != "silu" && activation != "gelu_tanh")
    throw std::invalid_argument("output_mlp: activation must be silu or gelu_tanh, not " + activation);
  if (o.dtype() != mx::float32 || h.dtype() != mx::float32 || h.ndim() < 1 || h.shape(-1) == 0)
    throw std::invalid_argument("output_mlp: o and h must be float32, h [..., D]");
  const int D = h.shape(-1);
  const int64_t M = h.size() / D;
  const int bits_o = std::get<4>(wo);
  if (bits_o != 2 && bits_o != 3 && bits_o != 4 && bits_o != 5 && bits_o != 6 && bits_o != 8)
    throw std::invalid_argument("output_mlp: bits must be 2, 3, 4, 5, 6 or 8, not " + std::to_string(bits_o));
  const int K = std::get<0>(wo).ndim() == 2 ? int(int64_t(std::get<0>(wo).shape(1)) * 32 / bits_o) : 0;
  if (K <= 0 || int64_t(o.size()) != M * K)
    throw std::invalid_argument("output_mlp: o must hold h's rows of the output projection's " + std::to_string(K) +
                                " inputs each");
  if (norm.dtype() != mx::float32 || norm.shape() != mx::Shape{D})
    throw std::invalid_argument("output_mlp: the MLP's norm weight must be float32 [" + std::to_string(D) + "]");
  std::vector<mx::array> inputs{o, h, norm}, supers;
  std::vector<Stage> st(3);
  for (auto& s : st) s.eps = eps, s.act = act;
  st[1].prologue = mlx_engine::kAddNorm;
  st[2].prologue = activation == "silu" ? mlx_engine::kSiLU : mlx_engine::kGeluTanh;
  if (add(st[0], inputs, supers, K, wo) != D)
    throw std::invalid_argument("output_mlp: the output projection must give h's " + std::to_string(D) + " features");
  add_norm(st[0], inputs, o_norm, D, 0, "o_norm");
  inputs.insert(inputs.end(), supers.begin(), supers.end());
  supers.clear();
  const int F = add(st[1], inputs, supers, D, gate);
  if (add(st[1], inputs, supers, D, up) != F)
    throw std::invalid_argument("output_mlp: the gate and up projections must have as many outputs");
  inputs.insert(inputs.end(), supers.begin(), supers.end());
  supers.clear();
  if (add(st[2], inputs, supers, F, down) != D)
    throw std::invalid_argument("output_mlp: the down projection must give h's " + std::to_string(D) + " features");
  add_norm(st[2], inputs, down_norm, D, 0, "down_norm");
  inputs.insert(inputs.end(), supers.begin(), supers.end());
  std::vector<mx::Shape> shapes;  // (empty: h's, twice)
  if (next_norm || !next.empty()) {  // the next layer's input norm and products as a fourth stage
    if (!next_norm || next.empty() || (next_shapes && next_shapes->size() != next.size()) ||
        (next_norms && next_norms->size() != next.size()))
      throw std::invalid_argument("output_mlp: the next layer takes its norm weight and one or more weights (and a "
                                  "shape and a norm per weight, where given)");
    if (next_norm->dtype() != mx::float32 || next_norm->shape() != mx::Shape{D})
      throw std::invalid_argument("output_mlp: the next layer's norm weight must be float32 [" + std::to_string(D) +
                                  "]");
    supers.clear();
    Stage& in = st.emplace_back();
    in.eps = eps, in.act = act, in.prologue = mlx_engine::kAddNorm;
    inputs.push_back(*next_norm);
    shapes.push_back(h.shape());
    for (size_t i = 0; i < next.size(); ++i) {
      mx::Shape shape = h.shape();
      shape.back() = add(in, inputs, supers, D, next[i]);
      shapes.push_back(mlx_engine::out_shape(shape, next_shapes ? std::optional((*next_shapes)[i]) : std::nullopt,
                                             "output_mlp", i));
    }
    for (size_t i = 0; next_norms && i < next.size(); ++i)
      add_norm(in, inputs, (*next_norms)[i], shapes[1 + i].back(), i, "a next layer's output norm");
    inputs.insert(inputs.end(), supers.begin(), supers.end());
  }
  mx::Stream s = mx::default_stream(mx::Device::cpu);
  mlx_engine::HeldInputs held;
  inputs = held.split(std::move(inputs));
  const std::vector<mx::Shape> out_shapes = shapes.empty() ? std::vector<mx::Shape>{h.shape(), h.shape()} : shapes;
  return mx::array::make_arrays(out_shapes, std::vector<mx::Dtype>(out_shapes.size(), mx::float32),
                                std::make_shared<OutputMLP>(s, std::move(st), std::move(shapes), std::move(held)),
                                std::move(inputs));
}

}  // namespace

void register_output_mlp(nb::module_& m) {
  m.def("output_mlp", &output_mlp, nb::arg("o"), nb::arg("h"), nb::arg("wo"), nb::arg("norm"), nb::arg("gate"),
        nb::arg("up"), nb::arg("down"), nb::arg("activation"), nb::arg("eps"), nb::arg("o_norm").none(),
        nb::arg("down_norm").none(), nb::arg("activations") = "float32", nb::arg("next_norm").none() = nb::none(),
        nb::arg("next") = std::vector<WeightArg>{}, nb::arg("next_shapes").none() = nb::none(),
        nb::arg("next_norms").none() = nb::none(),
        "A decoder layer after attention as one node, for float32 o (the attention output, h's rows of K_o each) "
        "and h [..., D]: y = o @ wo (rms_norm-ed with o_norm where given), s = h + y, x = rms_norm(s, norm, eps), "
        "m = (act(x @ gate) * (x @ up)) @ down (rms_norm-ed with down_norm where given), act silu or gelu_tanh; "
        "returns (s, m). Each weight a tuple (w, scales, biases or None, group_size, bits, super or None, codebook) "
        "as qmatmul's arguments; the same bits as qmatmul_many's nodes apart. With next_norm and next (the next "
        "layer's input norm weight [D] and weights): returns (s + m, *ys) instead, ys the products of "
        "rms_norm(s + m, next_norm, eps) with the next weights (in next_shapes, rms_norm-ed with next_norms where "
        "given), as qmatmul_many's add_norm node would give them.");
}
