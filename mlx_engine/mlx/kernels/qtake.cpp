// Rows of a quantized weight, dequantized (an embedding lookup), as one MLX primitive on the CPU.
//
// qtake(w, scales, biases, ids, group_size, bits) -> float32 [*ids.shape, K]: row ids[i] of a weight in MLX's affine
// layout (see qmatmul.cpp) as
//     scales[r, j / group_size] * q[r, j] + biases[r, j / group_size]   (the product and the sum each rounded)
// which is mx.dequantize's arithmetic, so the rows are bit for bit mx.dequantize(w[ids], ...)'s; biases None: a
// symmetric weight, -2**(bits - 1) * scales (exact); super: two-level scales (qmatmul's kU8 and kI8), integer scales
// (and biases) times super's float16 per 256 elements (exact float32 products; a symmetric weight's values then
// (q - 2**(bits - 1)) * scale, exact, as qmatmul's); codebook: 4-bit integers indexing kvalues_iq4nl (GGUF's IQ4_NL
// and IQ4_XS) or kvalues_mxfp4 (MXFP4, its scales float or its E8M0 exponents), values scale * kvalues[q] rounded
// once, as qmatmul's and gguf's. Why: MLX dequantizes on the CPU as about 20 graph nodes of shifts and masks, and a
// decode step looks up one row.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "half.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "qmatmul.h"
#include "strided.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

float scale_at(const void* base, mx::Dtype t, size_t i) {
  if (t == mx::float32) return static_cast<const float*>(base)[i];
  const uint16_t h = static_cast<const uint16_t*>(base)[i];
  if (t == mx::float16) return mlx_engine::half_to_float(h);
  const uint32_t u = uint32_t(h) << 16;  // bfloat16
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// `exact`: a symmetric weight's (q - 2**(bits - 1)) * scale, exact in float32 for GGUF's two-level int8 scales
// (where q * scale alone may not be), as the fused multiply-add of qmatmul gives it. `codebook` (codebook_levels, or
// null): each q read as codebook[q], zero point 128 (then always so: scale * kvalues[q], one rounding)
__attribute__((optimize("fp-contract=off"))) void dequantize_row(const uint8_t* row, const void* scales,
                                                                  const void* biases, mx::Dtype st, size_t g0, int K,
                                                                  int group_size, int bits, float* out,
                                                                  bool exact = false,
                                                                  const uint8_t* codebook = nullptr) {
  const uint32_t mask = (1u << bits) - 1;
  const float zero_point = codebook ? -128.f : -float(1 << (bits - 1));
  exact = exact || codebook;
  for (int g = 0; g < K / group_size; ++g) {
    const float s = scale_at(scales, st, g0 + g);
    const float b = biases ? scale_at(biases, st, g0 + g) : s * zero_point;
    for (int j = g * group_size; j < (g + 1) * group_size; ++j) {
      const size_t bit = size_t(j) * bits, byte = bit >> 3;
      uint32_t v = row[byte];
      if ((bit & 7) + bits > 8) v |= uint32_t(row[byte + 1]) << 8;  // the element runs into the next byte
      const uint32_t qi = (v >> (bit & 7)) & mask;
      const float q = float(codebook ? codebook[qi] : qi);
      if (exact) {
        out[j] = (q + zero_point) * s;
        continue;
      }
      const float p = q * s;
      out[j] = p + b;
    }
  }
}

class QTake : public mx::UnaryPrimitive {
 public:
  QTake(mx::Stream stream, int group_size, int bits, bool symmetric, bool factored, int codebook)
      : mx::UnaryPrimitive(stream),
        group_size_(group_size),
        bits_(bits),
        symmetric_(symmetric),
        factored_(factored),
        codebook_(codebook) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    encoder.dispatch([inputs, out, gs = group_size_, bits = bits_, symmetric = symmetric_,
                      factored = factored_, codebook = mlx_engine::codebook_levels(codebook_)]() mutable {
      static thread_local std::vector<uint8_t> bufs[5];
      static thread_local std::vector<float> row_scales;  // a factored row's scales, then its biases
      const void* data[5] = {};
      for (size_t i = 0; i < inputs.size(); ++i) data[i] = mlx_engine::row_major(inputs[i], bufs[i]);
      const mx::array& w = inputs[0];
      const mx::array& ids = inputs.back();
      const int N = w.shape(0), K = int(int64_t(w.shape(1)) * 32 / bits), G = K / gs;
      const size_t row_bytes = size_t(w.shape(1)) * 4;
      const int32_t* id = static_cast<const int32_t*>(data[inputs.size() - 1]);
      for (size_t i = 0; i < ids.size(); ++i) {
        int64_t r = id[i] < 0 ? int64_t(id[i]) + N : id[i];  // negative ids count from the end, as mx.take's
        r = r < 0 ? 0 : r >= N ? N - 1 : r;
        const uint8_t* row = static_cast<const uint8_t*>(data[0]) + r * row_bytes;
        float* dst = out.data<float>() + i * size_t(K);
        const int scale_type = mlx_engine::scale_type_of(inputs[1].dtype(), factored);
        if (factored || scale_type == mlx_engine::kE8M0) {
          // the scales (and biases) as float32 first: exact products of the file's integers, or powers of two
          const bool is_signed = scale_type != mlx_engine::kU8;
          mlx_engine::Problem p{};
          p.scales = data[1], p.biases = is_signed ? nullptr : data[2];
          p.super = factored ? data[is_signed ? 2 : 3] : nullptr;
          p.K = K, p.group_size = gs, p.bits = bits, p.scale_type = scale_type, p.codebook = codebook;
          row_scales.resize(2 * size_t(G));
          mlx_engine::factored_scales(p, int(r), 1, row_scales.data(), row_scales.data() + G);
          dequantize_row(row, row_scales.data(), is_signed ? nullptr : row_scales.data() + G, mx::float32, 0, K, gs,
                         bits, dst, is_signed, codebook);
          continue;
        }
        dequantize_row(row, data[1], symmetric ? nullptr : data[2], inputs[1].dtype(), size_t(r) * G, K, gs, bits,
                       dst, false, codebook);
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlx_engine qtake runs on the CPU only; use mx.dequantize on a GPU");
  }

  const char* name() const override { return "MLXEngineQTake"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const QTake&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_ && symmetric_ == o.symmetric_ &&
           factored_ == o.factored_ && codebook_ == o.codebook_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs.back().shape();
    shape.push_back(int(int64_t(inputs[0].shape(1)) * 32 / bits_));
    return {shape};
  }

 private:
  int group_size_, bits_;
  bool symmetric_, factored_;
  int codebook_;
};

mx::array qtake(const mx::array& w, const mx::array& scales, const std::optional<mx::array>& biases,
                const mx::array& ids, int group_size, int bits, const std::optional<mx::array>& super,
                int codebook) {
  if (bits != 2 && bits != 3 && bits != 4 && bits != 5 && bits != 6 && bits != 8)
    throw std::invalid_argument("qtake: bits must be 2, 3, 4, 5, 6 or 8, not " + std::to_string(bits));
  mlx_engine::check_group(group_size, bits, "qtake");
  mlx_engine::check_codebook(codebook, bits, biases.has_value(), scales.dtype(), super.has_value(), "qtake");
  if (w.ndim() != 2 || w.dtype() != mx::uint32) throw std::invalid_argument("qtake: w must be 2-D uint32");
  const int K = int(int64_t(w.shape(1)) * 32 / bits);
  if (K % group_size) throw std::invalid_argument("qtake: the row length is not a multiple of group_size");
  mx::Shape gshape{w.shape(0), K / group_size};
  if (super) {
    mlx_engine::check_factored(gshape, group_size, scales, biases ? &*biases : nullptr, *super, "qtake");
  } else if (scales.shape() != gshape ||
             (biases && (biases->shape() != gshape || biases->dtype() != scales.dtype())) ||
             (scales.dtype() != mx::float32 && scales.dtype() != mx::float16 && scales.dtype() != mx::bfloat16 &&
              scales.dtype() != mx::uint8)) {  // (uint8: E8M0, see check_codebook)
    throw std::invalid_argument("qtake: scales (and biases) must be float32, float16 or bfloat16 [N, K / group_size]");
  }
  if (!mx::issubdtype(ids.dtype(), mx::integer)) throw std::invalid_argument("qtake: ids must be integers");
  mx::Stream s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs{w, scales};
  if (biases) inputs.push_back(*biases);
  if (super) inputs.push_back(*super);
  inputs.push_back(ids.dtype() == mx::int32 ? ids : mx::astype(ids, mx::int32, s));
  mx::Shape shape = ids.shape();
  shape.push_back(K);
  return mx::array(shape, mx::float32,
                   std::make_shared<QTake>(s, group_size, bits, !biases, super.has_value(), codebook),
                   std::move(inputs));
}

}  // namespace

void register_qtake(nb::module_& m) {
  m.def("qtake", &qtake, nb::arg("w"), nb::arg("scales"), nb::arg("biases").none(), nb::arg("ids"),
        nb::arg("group_size"), nb::arg("bits"), nb::arg("super").none() = nb::none(), nb::arg("codebook") = 0,
        "Rows ids of dequantize(w, scales, biases) -> float32 [*ids.shape, K] (biases None: -2**(bits - 1) * "
        "scales; super: two-level scales; codebook: as qmatmul's), on the CPU stream.");
}
