// Attention of a few queries per head (decode steps) over the KV cache, as one MLX primitive on the CPU.
//
// attend(q [1, H, N, D], k [1, H_kv, S, D], v [1, H_kv, S, Dv], scale, mask [N, S] or none) -> [1, H, N, Dv]:
//     softmax(q k^T * scale + mask) v     (Vaswani et al. 2017), head h reading key/value head h / (H / H_kv)
// in float32, the softmax with the row's maximum subtracted. Why our own: MLX runs attention on the CPU as about a
// dozen operations per layer (the grouped heads' keys copied out, two OpenBLAS products that pack their operands,
// a softmax), a third of a decode step at a 600-token context; this reads each key and value once, where the cache
// keeps them (a strided view), and writes nothing but the output.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>

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
#include "pool.h"
#include "strided.h"
#include "vecmath.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

struct View {  // a float32 [rows, cols] matrix with unit stride along cols
  const float* p;
  int64_t row_stride;
  const float* row(int64_t r) const { return p + r * row_stride; }
};

// q_n . k_s: 16 lanes, summed across at the end, then the tail.
INLINE float dot_row(const float* q, const float* k, int D, int D16) {
  f32x16 acc{};
  int i = 0;
  for (; i < D16; i += 16) {
    f32x16 a, b;
    std::memcpy(&a, q + i, 64);
    std::memcpy(&b, k + i, 64);
    acc += a * b;
  }
  float dot = hsum(acc);
  for (; i < D; ++i) dot += q[i] * k[i];
  return dot;
}

// One query head over its key/value head: rows n of q and out, scores a buffer of S (rounded up to 16) floats.
// Four keys at a time (four independent sums: one key's chain of FMAs and its sum across lanes had bounded the loop
// by their latency), and the output's 64-float slices kept in registers over all keys (the loop had been bound by
// storing and reloading them for every key). Every score and output element is summed in the same order as one key
// and one value row at a time would. Compiled for AVX-512, AVX2 and the baseline, picked at load time.
PER_ISA void attend_head(
    View q, View k, View v, const float* mask, int64_t mask_stride, float* out, int64_t out_stride, int N, int S, int D,
    int Dv, float scale, float* scores) {
  const int D16 = D - D % 16, Dv16 = Dv - Dv % 16, S16 = (S + 15) / 16 * 16;
  for (int n = 0; n < N; ++n) {
    const float* qn = q.row(n);
    const float* mn = mask ? mask + n * mask_stride : nullptr;
    float top = -std::numeric_limits<float>::infinity();
    int s = 0;
    for (; s + 4 <= S; s += 4) {
      const float *k0 = k.row(s), *k1 = k.row(s + 1), *k2 = k.row(s + 2), *k3 = k.row(s + 3);
      f32x16 a0{}, a1{}, a2{}, a3{};
      int i = 0;
      for (; i < D16; i += 16) {
        f32x16 a, b0, b1, b2, b3;
        std::memcpy(&a, qn + i, 64);
        std::memcpy(&b0, k0 + i, 64);
        std::memcpy(&b1, k1 + i, 64);
        std::memcpy(&b2, k2 + i, 64);
        std::memcpy(&b3, k3 + i, 64);
        a0 += a * b0;
        a1 += a * b1;
        a2 += a * b2;
        a3 += a * b3;
      }
      float d[4] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3)};
      const float* ks[4] = {k0, k1, k2, k3};
      for (int j = 0; j < 4; ++j) {
        for (int t = i; t < D; ++t) d[j] += qn[t] * ks[j][t];
        const float sc = d[j] * scale + (mn ? mn[s + j] : 0.f);
        scores[s + j] = sc;
        top = sc > top ? sc : top;
      }
    }
    for (; s < S; ++s) {
      const float sc = dot_row(qn, k.row(s), D, D16) * scale + (mn ? mn[s] : 0.f);
      scores[s] = sc;
      top = sc > top ? sc : top;
    }
    for (int t = S; t < S16; ++t) scores[t] = -std::numeric_limits<float>::infinity();
    f32x16 sum{};
    for (int t = 0; t < S16; t += 16) {
      f32x16 e;
      std::memcpy(&e, scores + t, 64);
      e = exp_nonpositive(e - top);
      std::memcpy(scores + t, &e, 64);
      sum += e;
    }
    const float inv = 1.f / hsum(sum);
    float* o = out + n * out_stride;
    int i = 0;
    for (; i + 64 <= Dv; i += 64) {
      f32x16 o0{}, o1{}, o2{}, o3{};
      for (int t = 0; t < S; ++t) {
        const float p = scores[t];
        if (p == 0.f) continue;  // a hidden key (mask -inf)
        const float* vs = v.row(t) + i;
        const f32x16 pv = f32x16{} + p;
        f32x16 b0, b1, b2, b3;
        std::memcpy(&b0, vs, 64);
        std::memcpy(&b1, vs + 16, 64);
        std::memcpy(&b2, vs + 32, 64);
        std::memcpy(&b3, vs + 48, 64);
        o0 += pv * b0;
        o1 += pv * b1;
        o2 += pv * b2;
        o3 += pv * b3;
      }
      o0 *= inv;
      o1 *= inv;
      o2 *= inv;
      o3 *= inv;
      std::memcpy(o + i, &o0, 64);
      std::memcpy(o + i + 16, &o1, 64);
      std::memcpy(o + i + 32, &o2, 64);
      std::memcpy(o + i + 48, &o3, 64);
    }
    for (; i < Dv16; i += 16) {
      f32x16 acc{};
      for (int t = 0; t < S; ++t) {
        const float p = scores[t];
        if (p == 0.f) continue;
        f32x16 b;
        std::memcpy(&b, v.row(t) + i, 64);
        acc += (f32x16{} + p) * b;
      }
      acc *= inv;
      std::memcpy(o + i, &acc, 64);
    }
    for (; i < Dv; ++i) {
      float acc = 0.f;
      for (int t = 0; t < S; ++t)
        if (scores[t] != 0.f) acc += scores[t] * v.row(t)[i];
      o[i] = acc * inv;
    }
  }
}

// A float32 array whose last axis has unit stride, with its strides: its own data, or a row-major copy in `buf`.
const float* unit_last(const mx::array& a, std::vector<uint8_t>& buf, std::vector<int64_t>& strides) {
  strides.assign(a.strides().begin(), a.strides().end());
  if (a.ndim() == 0 || a.strides().back() == 1 || a.shape().back() == 1) return a.data<float>();
  const float* data = static_cast<const float*>(mlx_engine::row_major(a, buf));
  int64_t st = 1;
  for (int d = int(a.ndim()) - 1; d >= 0; --d) {
    strides[d] = st;
    st *= a.shape(d);
  }
  return data;
}

class Attend : public mx::UnaryPrimitive {
 public:
  Attend(mx::Stream stream, float scale, bool masked) : mx::UnaryPrimitive(stream), scale_(scale), masked_(masked) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    encoder.dispatch([inputs, out, scale = scale_, masked = masked_]() mutable {
      static thread_local std::vector<uint8_t> bufs[4];
      std::vector<int64_t> st[4];
      const float* data[4] = {};
      for (size_t i = 0; i < inputs.size(); ++i) data[i] = unit_last(inputs[i], bufs[i], st[i]);
      const mx::array& q = inputs[0];
      const mx::array& k = inputs[1];
      const int H = q.shape(1), N = q.shape(2), D = q.shape(3), Hkv = k.shape(1), S = k.shape(2);
      const int Dv = inputs[2].shape(3), rep = H / Hkv;
      float* o = out.data<float>();
      auto head = [&](int h) {
        static thread_local std::vector<float> scores;
        scores.resize((S + 15) / 16 * 16);
        const int g = h / rep;
        View qv{data[0] + h * st[0][1], st[0][2]};
        View kv{data[1] + g * st[1][1], st[1][2]};
        View vv{data[2] + g * st[2][1], st[2][2]};
        attend_head(qv, kv, vv, masked ? data[3] : nullptr, masked ? st[3][0] : 0, o + int64_t(h) * N * Dv, Dv, N,
                    S, D, Dv, scale, scores.data());
      };
      // Heads over the kernels' threads once there is enough to share (a few microseconds a head).
      if (int64_t(H) * N * S * (D + Dv) >= (int64_t(1) << 16)) {
        mlx_engine::parallel_for(H, head);
      } else {
        for (int h = 0; h < H; ++h) head(h);
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlx_engine attend runs on the CPU only; use mx.fast.scaled_dot_product_attention");
  }

  const char* name() const override { return "MLXEngineAttend"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const Attend&>(other);
    return scale_ == o.scale_ && masked_ == o.masked_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.back() = inputs[2].shape(3);
    return {shape};
  }

 private:
  float scale_;
  bool masked_;
};

mx::array attend(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                 const std::optional<mx::array>& mask) {
  auto f32 = [](const mx::array& a) { return a.dtype() == mx::float32; };
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4 || q.shape(0) != 1 || k.shape(0) != 1 || v.shape(0) != 1 ||
      !f32(q) || !f32(k) || !f32(v))
    throw std::invalid_argument("attend: q, k, v must be float32 [1, heads, rows, dim]");
  if (k.shape(3) != q.shape(3) || v.shape(1) != k.shape(1) || v.shape(2) != k.shape(2) || k.shape(1) == 0 ||
      q.shape(1) % k.shape(1))
    throw std::invalid_argument("attend: k must be [1, H_kv, S, D] and v [1, H_kv, S, Dv], H a multiple of H_kv");
  std::vector<mx::array> inputs{q, k, v};
  if (mask) {
    if (mask->ndim() != 2 || mask->shape(0) != q.shape(2) || mask->shape(1) != k.shape(2) || !f32(*mask))
      throw std::invalid_argument("attend: the mask must be float32 [N, S]");
    inputs.push_back(*mask);
  }
  mx::Shape shape = q.shape();
  shape.back() = v.shape(3);
  mx::Stream s = mx::default_stream(mx::Device::cpu);
  return mx::array(shape, mx::float32, std::make_shared<Attend>(s, scale, bool(mask)), std::move(inputs));
}

}  // namespace

void register_attention(nb::module_& m) {
  m.def("attend", &attend, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("scale"), nb::arg("mask").none(),
        "softmax(q k^T * scale + mask) v for q [1, H, N, D] over k, v [1, H_kv, S, D], on the CPU stream.");
}
