// Attention of a few queries per head (decode steps) over the KV cache, as one MLX primitive on the CPU.
//
// attend(q [1, H, N, D], k [1, H_kv, S, D], v [1, H_kv, S, Dv], scale, mask [N, S] or none) -> [1, H, N, Dv]:
//     softmax(q k^T * scale + mask) v     (Vaswani et al. 2017), head h reading key/value head h / (H / H_kv)
// in float32, the softmax with the row's maximum subtracted. Why our own: MLX runs attention on the CPU as about a
// dozen operations per layer (the grouped heads' keys copied out, two OpenBLAS products that pack their operands,
// a softmax), a third of a decode step at a 600-token context; this reads each key and value once for all the query
// heads that share it, where the cache keeps them (a strided view), and writes nothing but the output. The keys are
// split in chunks over the kernels' threads, each chunk's softmax combined with the others' at the end (the online
// softmax of Milakov and Gimelshein 2018, split over keys as flash-decoding does).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "half.h"
#include "pool.h"
#include "qmatmul.h"
#include "rope.h"
#include "strided.h"
#include "vecmath.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

// What the cached keys and values are kept as: float32, or float16 / bfloat16 (half the bytes a decode step reads),
// rounded to nearest even as they are written (as MLX's astype rounds) and widened exactly, a chunk of keys at a time,
// into float32 for the kernel below.
enum KvType { kKvF32 = 0, kKvF16 = 1, kKvBF16 = 2 };

// `rows` rows of `cols` stored values (row stride `stride` elements) from src into dst [rows, cols], as float32.
void widen_rows(int type, const void* src, int64_t stride, int rows, int cols, float* dst) {
  const uint16_t* h = static_cast<const uint16_t*>(src);
  if (stride == cols) {  // one run (a cache's cells follow one another)
    cols *= rows;
    rows = 1;
  }
  for (int r = 0; r < rows; ++r, h += stride, dst += cols) {
    if (type == kKvF16) {
      mlx_engine::halves_to_floats(h, dst, cols);
    } else {
      for (int i = 0; i < cols; ++i) {
        const uint32_t w = uint32_t(h[i]) << 16;
        std::memcpy(dst + i, &w, 4);
      }
    }
  }
}

// n float32 values into a row stored as `type`, rounded to nearest even (NaN kept a NaN).
void narrow_row(int type, const float* x, void* dst, int n) {
  if (type == kKvF32) {
    std::memcpy(dst, x, sizeof(float) * n);
    return;
  }
  uint16_t* h = static_cast<uint16_t*>(dst);
  for (int i = 0; i < n; ++i) {
    uint32_t w;
    std::memcpy(&w, x + i, 4);
    if (type == kKvBF16) {
      const bool nan = (w & 0x7fffffff) > 0x7f800000;
      h[i] = nan ? uint16_t((w >> 16) | 0x40) : uint16_t((w + 0x7fff + ((w >> 16) & 1)) >> 16);
      continue;
    }
    // float16: the exponent rebased from 127 to 15; below 2**-14 a subnormal (the float's value in units of 2**-24,
    // rounded to nearest even by the float addition), above 65504 (after rounding) infinity
    const uint32_t sign = (w >> 16) & 0x8000, a = w & 0x7fffffff;
    uint16_t out;
    if (a > 0x7f800000) {
      out = uint16_t(0x7e00);
    } else if (a >= 0x477ff000) {  // rounds to 65536 or more
      out = 0x7c00;
    } else if (a < 0x38800000) {  // below 2**-14
      float f;
      std::memcpy(&f, &a, 4);
      const float units = f * 0x1p24f + 0x1p23f;  // the subnormal's count of 2**-24, rounded to nearest even
      uint32_t u;
      std::memcpy(&u, &units, 4);
      out = uint16_t(u - 0x4b000000);
    } else {
      const uint32_t r = a + 0xfff + ((a >> 13) & 1);  // round the 13 dropped bits to nearest even
      out = uint16_t((r - (uint32_t(127 - 15) << 23)) >> 13);
    }
    h[i] = uint16_t(sign | out);
  }
}

// The chunk kernel over float32 keys and values (a float32 cache, or 16-bit rows widened first), compiled for
// AVX-512, AVX2 and the baseline, picked at load time.
namespace f32 {
using Elem = float;
INLINE f32x16 load16(const float* p) {
  f32x16 b;
  std::memcpy(&b, p, 64);
  return b;
}
INLINE f32x8 load8(const float* p) {
  f32x8 b;
  std::memcpy(&b, p, 32);
  return b;
}
INLINE float load1(const float* p) { return *p; }
#define ATTEND_CLONES PER_ISA
#include "attend_chunk.inc"
#undef ATTEND_CLONES
}  // namespace f32

// The same kernel over a float16 cache as it lies, each row converted as it is loaded (F16C's vcvtph2ps, exact, as
// the widening is): widened a chunk at a time first, a float16 cache had read its bytes in one pass and computed in
// another, and decoded no faster than a float32 one of twice the bytes. The same operations on the same values as
// the float32 kernel, so the same bits, for head sizes
// that are multiples of 16; past them a scalar tail, which each copy's compilation may fuse or vectorize its own way,
// came out 1e-7 apart at a head size of 72, so such sizes are widened first, as are bfloat16 caches and every 16-bit
// cache off x86-64 or without AVX-512. (Figures: docs/internals/caches.md.)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MLX_ENGINE_HALF_KV 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
namespace f16_avx512 {
using Elem = uint16_t;
INLINE f32x16 load16(const uint16_t* p) {
  return f32x16(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}
INLINE f32x8 load8(const uint16_t* p) {
  return f32x8(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
INLINE float load1(const uint16_t* p) { return mlx_engine::half_to_float(*p); }
#define ATTEND_CLONES
#include "attend_chunk.inc"
#undef ATTEND_CLONES
}  // namespace f16_avx512
#pragma GCC pop_options

// Whether this CPU runs the float16 kernel: where the kernels run their AVX-512 copies (not where
// $MLX_ENGINE_CPU_ISA=avx2 asks for the AVX2 ones). On AVX2 alone a float16 cache is widened first: there a float x 16
// is two registers, and the kernel's conversions, once per query head for the keys, would add to a loop that already
// spills.
bool half_kernel() {
  static const bool on = mlx_engine::isa() == "avx512";
  return on;
}
#endif

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

// One attention: queries q [H, N, D] over keys [H_kv, S, D] and values [H_kv, S, Dv] (kept as kv_type, each with its
// own head and row strides in elements, unit stride along the features), an optional mask [N, S] (row stride
// mask_row), into o [H, N, Dv]. With k2 and v2 (no mask then), the keys lie in two runs: keys [0, S1) from k and v,
// keys [S1, S) from k2 and v2 (a sliding window whose ring wrapped), attended as if the two were one array (the
// same chunks, so the same bits, as attention over their concatenation).
struct AttendJob {
  const float* q;
  int64_t q_head, q_row;
  const void* k;
  int64_t k_head, k_row;
  const void* v;
  int64_t v_head, v_row;
  const float* mask;
  int64_t mask_row;
  int H, N, D, Hkv, S, Dv;
  float scale;
  float* o;
  int kv_type = kKvF32;
  const void* k2 = nullptr;
  const void* v2 = nullptr;
  int S1 = -1;  // keys in the first run (-1: all S)
};

// Rows [s0, s0 + len) of one head's keys or values over the two runs of `a` into float32 dst [len, cols]: copied, or
// widened from 16 bits.
void gather_rows(const AttendJob& a, bool values, int g, int s0, int len, int cols, float* dst) {
  const size_t item = a.kv_type == kKvF32 ? 4 : 2;
  const int64_t head = values ? a.v_head : a.k_head, row = values ? a.v_row : a.k_row;
  for (int part = 0; part < 2 && len > 0; ++part) {
    const int first = part == 0 ? 0 : a.S1, end = part == 0 ? a.S1 : a.S;
    const int from = std::max(s0, first), to = std::min(s0 + len, end);
    if (from >= to) continue;
    const uint8_t* base = static_cast<const uint8_t*>(part == 0 ? (values ? a.v : a.k) : (values ? a.v2 : a.k2));
    const uint8_t* src = base + (g * head + int64_t(from - first) * row) * item;
    float* out = dst + int64_t(from - s0) * cols;
    if (a.kv_type == kKvF32) {
      for (int r = 0; r < to - from; ++r) std::memcpy(out + int64_t(r) * cols, src + r * row * 4, cols * 4);
    } else {
      widen_rows(a.kv_type, src, row, to - from, cols, out);
    }
  }
}

void run_attention(const AttendJob& a) {
  const int H = a.H, N = a.N, D = a.D, Hkv = a.Hkv, S = a.S, Dv = a.Dv;
  const int rep = H / Hkv, Q = rep * N;  // Q: the queries of one key/value head
  // Tasks: (key/value head, chunk of keys), each chunk read once for all the head's queries. With enough work, at
  // least 16 tasks (the threads share them evenly; one task per query head had left a core idle for a ninth of the
  // work and read each key/value head once per query head) and chunks whose keys and values stay in L2 (about
  // 128 KiB); never chunks under 32 keys.
  int C = 1;
  if (int64_t(H) * N * S * (D + Dv) >= (int64_t(1) << 16) && mlx_engine::pool_threads() > 1) {
    const int max_len = std::max(32, 32768 / (D + Dv));  // keys of 128 KiB of float32 keys and values
    C = std::max((16 + Hkv - 1) / Hkv, (S + max_len - 1) / max_len);
    C = std::max(1, std::min(C, S / 32));
  }
  const int L = (S + C - 1) / std::max(C, 1);
  if (S > 0) C = (S + L - 1) / L;
  const int64_t slot = Dv + 2;  // one query's partial result: Dv outputs, the maximum, the sum
  static thread_local std::vector<float> partials;
  partials.resize(size_t(Hkv) * C * Q * slot);
  float* parts = partials.data();
  auto task = [&](int t) {
    static thread_local std::vector<float> scores;
    scores.resize(4 * size_t((L + 15) / 16 * 16));
    const int g = t / C, c = t % C, len = std::min(L, S - c * L);
    int s0 = c * L;
    f32::View kv, vv;
#ifdef MLX_ENGINE_HALF_KV
    f16_avx512::View kh{}, vh{};  // a float16 chunk read as it lies (kh.p set)
#endif
    if (a.S1 >= 0 && s0 < a.S1 && s0 + len > a.S1) {  // a chunk across the two runs: its rows gathered here
      static thread_local std::vector<float> both;
      both.resize(size_t(len) * (D + Dv));
      gather_rows(a, false, g, s0, len, D, both.data());
      gather_rows(a, true, g, s0, len, Dv, both.data() + size_t(len) * D);
      kv = {both.data(), D};
      vv = {both.data() + size_t(len) * D, Dv};
      s0 = 0;
    } else {
      const bool second = a.S1 >= 0 && s0 >= a.S1;  // a chunk of the second run: its keys from k2 and v2
      const void* kb = second ? a.k2 : a.k;
      const void* vb = second ? a.v2 : a.v;
      if (second) s0 -= a.S1;
      if (a.kv_type == kKvF32) {
        kv = {static_cast<const float*>(kb) + g * a.k_head, a.k_row};
        vv = {static_cast<const float*>(vb) + g * a.v_head, a.v_row};
#ifdef MLX_ENGINE_HALF_KV
      } else if (a.kv_type == kKvF16 && D % 16 == 0 && Dv % 16 == 0 && half_kernel()) {
        kh = {static_cast<const uint16_t*>(kb) + g * a.k_head, a.k_row};
        vh = {static_cast<const uint16_t*>(vb) + g * a.v_head, a.v_row};
#endif
      } else {  // the chunk's keys and values widened into float32 rows here (in L2: chunks are sized for it)
        static thread_local std::vector<float> wide;
        wide.resize(size_t(len) * (D + Dv));
        const uint16_t* k16 = static_cast<const uint16_t*>(kb) + g * a.k_head + int64_t(s0) * a.k_row;
        const uint16_t* v16 = static_cast<const uint16_t*>(vb) + g * a.v_head + int64_t(s0) * a.v_row;
        widen_rows(a.kv_type, k16, a.k_row, len, D, wide.data());
        widen_rows(a.kv_type, v16, a.v_row, len, Dv, wide.data() + size_t(len) * D);
        kv = {wide.data(), D};
        vv = {wide.data() + size_t(len) * D, Dv};
        s0 = 0;
      }
    }
    for (int j0 = 0; j0 < Q; j0 += 4) {
      const int G = std::min(4, Q - j0);
      const float* qs[4];
      const float* ms[4];
      float* ps[4];
      for (int j = 0; j < G; ++j) {
        const int h = g * rep + (j0 + j) / N, n = (j0 + j) % N;
        qs[j] = a.q + h * a.q_head + n * a.q_row;
        // the mask's columns follow the keys of the view: a widened chunk's start at 0, the cache's at c * L
        ms[j] = a.mask ? a.mask + n * a.mask_row + (int64_t(c) * L - s0) : nullptr;
        ps[j] = parts + ((int64_t(g) * C + c) * Q + j0 + j) * slot;
      }
#ifdef MLX_ENGINE_HALF_KV
      if (kh.p) {
        f16_avx512::attend_chunk(qs, ms, G, kh, vh, s0, len, D, Dv, a.scale, scores.data(), ps);
        continue;
      }
#endif
      f32::attend_chunk(qs, ms, G, kv, vv, s0, len, D, Dv, a.scale, scores.data(), ps);
    }
  };
  if (C * Hkv > 1) {
    mlx_engine::parallel_for(Hkv * C, task);
  } else if (S > 0) {
    task(0);
  }
  // Each query's chunks combined: out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c, M the largest m_c (one
  // chunk: its weight is exactly 1, so out = o / l).
  for (int g = 0; g < Hkv; ++g)
    for (int j = 0; j < Q; ++j) {
      const int h = g * rep + j / N, n = j % N;
      float* dst = a.o + (int64_t(h) * N + n) * Dv;
      auto part = [&](int c) { return parts + ((int64_t(g) * C + c) * Q + j) * slot; };
      float top = -std::numeric_limits<float>::infinity();
      for (int c = 0; c < C && S > 0; ++c) top = std::max(top, part(c)[Dv]);
      if (top == -std::numeric_limits<float>::infinity()) {  // no key seen
        std::memset(dst, 0, sizeof(float) * Dv);
        continue;
      }
      float den = 0.f;
      std::memset(dst, 0, sizeof(float) * Dv);
      for (int c = 0; c < C; ++c) {
        const float* pc = part(c);
        if (pc[Dv] == -std::numeric_limits<float>::infinity()) continue;
        const float w = std::exp(pc[Dv] - top);
        den += w * pc[Dv + 1];
        for (int i = 0; i < Dv; ++i) dst[i] += w * pc[i];
      }
      const float inv = 1.f / den;
      for (int i = 0; i < Dv; ++i) dst[i] *= inv;
    }
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
      run_attention({data[0], st[0][1], st[0][2], data[1], st[1][1], st[1][2], data[2], st[2][1], st[2][2],
                     masked ? data[3] : nullptr, masked ? st[3][0] : 0, q.shape(1), q.shape(2), q.shape(3),
                     k.shape(1), k.shape(2), inputs[2].shape(3), scale, out.data<float>()});
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

// A decode step's attention with its KV cache write, one node for what were seven (RoPE of the queries and of the
// new keys, the writes of the keys and values into the cache, the views of its used cells, the attention):
//   attend_cached(q [1, H, N, D], k [1, H_kv, N, D], v [1, H_kv, N, Dv], keys [1, H_kv, C, D], values [1, H_kv, C, Dv],
//                 cos, sin [N, dims / 2], cells, scale, dims, traditional, mask [N, hi - lo] or none)
//     -> (o [1, H, N, Dv], keys', values')
// q and k rotated as rope_apply rotates them, k and v written to cells [start, start + N) of keys' and values', and
// q attending to their cells [lo, hi), then [lo2, hi2) (a wrapped sliding window's two runs; none where lo2 = hi2;
// unmasked), as attend does over those cells' concatenation: bit for bit rope_apply, two slice updates and attend in
// turn. cells is an int32 array [5] = (start, lo, hi, lo2, hi2), an input rather than a parameter so that one
// compiled decode step serves every position. Cells out of range (or a mask whose columns are not hi - lo) write
// nothing and give NaN: they are known only when the step runs, and the caller checks them before.
// All float32 but keys and values, which may be float16 or bfloat16 (both the same): k and v are rounded to their type
// as they are written (as astype rounds), and widened exactly as they are read.
// keys' and values' take over the buffers of keys and values (copied only when those are not plain row-major
// arrays): the caller must hold no other reference to them and use keys' and values' from then on, as MLX's own
// slice update does in place when its input is donated.
class AttendCached : public mx::Primitive {
 public:
  AttendCached(mx::Stream stream, float scale, int dims, bool traditional, bool masked)
      : mx::Primitive(stream), scale_(scale), dims_(dims), traditional_(traditional), masked_(masked) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    outputs[0].set_data(mx::allocator::malloc(outputs[0].nbytes()));
    bool copy[2];
    for (int i = 0; i < 2; ++i) {
      const mx::array& store = inputs[3 + i];
      copy[i] = !store.flags().row_contiguous || store.data_size() != store.size();
      if (copy[i]) {
        outputs[1 + i].set_data(mx::allocator::malloc(outputs[1 + i].nbytes()));
      } else {
        outputs[1 + i].copy_shared_buffer(store);
      }
    }
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    for (auto& a : outputs) encoder.set_output_array(a);
    encoder.dispatch([inputs, outputs, copy, scale = scale_, dims = dims_, traditional = traditional_,
                      masked = masked_]() mutable {
      static thread_local std::vector<uint8_t> bufs[9];
      for (int i = 0; i < 2; ++i)
        if (copy[i]) {
          const void* store = mlx_engine::row_major(inputs[3 + i], bufs[3 + i]);
          std::memcpy(outputs[1 + i].data<uint8_t>(), store, outputs[1 + i].nbytes());
        }
      const int H = inputs[0].shape(1), N = inputs[0].shape(2), D = inputs[0].shape(3);
      const int Hkv = inputs[1].shape(1), Dv = inputs[2].shape(3), C = inputs[3].shape(2), half = dims / 2;
      const int32_t* at = static_cast<const int32_t*>(mlx_engine::row_major(inputs[7], bufs[7]));
      const int start = at[0], lo = at[1], hi = at[2], lo2 = at[3], hi2 = at[4];
      if (start < 0 || start > C - N || lo < 0 || lo >= hi || hi > C || lo2 < 0 || lo2 > hi2 || hi2 > C ||
          (masked && (inputs[8].shape(1) != hi - lo || lo2 < hi2))) {
        float* o = outputs[0].data<float>();
        std::fill(o, o + outputs[0].size(), std::numeric_limits<float>::quiet_NaN());
        return;
      }
      auto f32 = [&](int i) { return static_cast<const float*>(mlx_engine::row_major(inputs[i], bufs[i])); };
      const float *q = f32(0), *k = f32(1), *v = f32(2), *cs = f32(5), *sn = f32(6);
      static thread_local std::vector<float> rotated;
      rotated.resize(size_t(H) * N * D);
      mlx_engine::rotate(q, cs, sn, rotated.data(), 1, H, N, D, N, dims, traditional);
      const mx::Dtype kv = outputs[1].dtype();
      const int type = kv == mx::float16 ? kKvF16 : kv == mx::bfloat16 ? kKvBF16 : kKvF32;
      const size_t item = outputs[1].itemsize();
      uint8_t* keys = outputs[1].data<uint8_t>();
      uint8_t* values = outputs[2].data<uint8_t>();
      static thread_local std::vector<float> key_row;
      key_row.resize(D);
      for (int h = 0; h < Hkv; ++h)
        for (int n = 0; n < N; ++n) {
          const int64_t cell = int64_t(h) * C + start + n;
          mlx_engine::rotate(k + (int64_t(h) * N + n) * D, cs + n * half, sn + n * half, key_row.data(), 1, 1, 1, D, 1,
                             dims, traditional);
          narrow_row(type, key_row.data(), keys + cell * D * item, D);
          narrow_row(type, v + (int64_t(h) * N + n) * Dv, values + cell * Dv * item, Dv);
        }
      std::vector<int64_t> mask_strides;
      const float* mask = masked ? unit_last(inputs[8], bufs[8], mask_strides) : nullptr;
      run_attention({rotated.data(), int64_t(N) * D, D, keys + int64_t(lo) * D * item, int64_t(C) * D, D,
                     values + int64_t(lo) * Dv * item, int64_t(C) * Dv, Dv, mask, masked ? mask_strides[0] : 0, H, N,
                     D, Hkv, hi - lo + hi2 - lo2, Dv, scale, outputs[0].data<float>(), type,
                     keys + int64_t(lo2) * D * item, values + int64_t(lo2) * Dv * item, lo2 < hi2 ? hi - lo : -1});
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlx_engine attend_cached runs on the CPU only");
  }

  const char* name() const override { return "MLXEngineAttendCached"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const AttendCached&>(other);
    return scale_ == o.scale_ && dims_ == o.dims_ && traditional_ == o.traditional_ && masked_ == o.masked_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape o = inputs[0].shape();
    o.back() = inputs[2].shape(3);
    return {o, inputs[3].shape(), inputs[4].shape()};
  }

 private:
  float scale_;
  int dims_;
  bool traditional_, masked_;
};

std::vector<mx::array> attend_cached(const mx::array& q, const mx::array& k, const mx::array& v,
                                     const mx::array& keys, const mx::array& values, const mx::array& cos,
                                     const mx::array& sin, const mx::array& cells, float scale, int dims,
                                     bool traditional, const std::optional<mx::array>& mask) {
  for (const mx::array* a : {&q, &k, &v, &cos, &sin})
    if (a->dtype() != mx::float32) throw std::invalid_argument("attend_cached: q, k, v, cos and sin must be float32");
  const mx::Dtype kv = keys.dtype();
  if ((kv != mx::float32 && kv != mx::float16 && kv != mx::bfloat16) || values.dtype() != kv)
    throw std::invalid_argument("attend_cached: keys and values must both be float32, float16 or bfloat16");
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4 || keys.ndim() != 4 || values.ndim() != 4 || q.shape(0) != 1 ||
      k.shape(0) != 1 || v.shape(0) != 1 || keys.shape(0) != 1 || values.shape(0) != 1)
    throw std::invalid_argument("attend_cached: q, k, v, keys and values must be [1, heads, rows, dim]");
  const int H = q.shape(1), N = q.shape(2), D = q.shape(3), Hkv = k.shape(1), C = keys.shape(2);
  if (Hkv == 0 || H % Hkv || k.shape(2) != N || k.shape(3) != D || v.shape(1) != Hkv || v.shape(2) != N ||
      keys.shape(1) != Hkv || keys.shape(3) != D || values.shape(1) != Hkv || values.shape(2) != C ||
      values.shape(3) != v.shape(3))
    throw std::invalid_argument("attend_cached: k [1, H_kv, N, D], v [1, H_kv, N, Dv], keys [1, H_kv, C, D] and values "
                                "[1, H_kv, C, Dv] must match q [1, H, N, D], H a multiple of H_kv");
  if (cells.dtype() != mx::int32 || cells.ndim() != 1 || cells.shape(0) != 5)
    throw std::invalid_argument("attend_cached: cells must be int32 [5]: start, lo, hi, lo2, hi2");
  if (N > C) throw std::invalid_argument("attend_cached: more new rows than cells");
  if (dims <= 0 || dims % 2 || dims > D || cos.ndim() != 2 || cos.shape(0) != N || cos.shape(1) != dims / 2 ||
      sin.shape() != cos.shape())
    throw std::invalid_argument("attend_cached: cos and sin must be [N, dims / 2], dims even and at most D");
  std::vector<mx::array> inputs{q, k, v, keys, values, cos, sin, cells};
  if (mask) {
    if (mask->ndim() != 2 || mask->shape(0) != N || mask->shape(1) > C || mask->dtype() != mx::float32)
      throw std::invalid_argument("attend_cached: the mask must be float32 [N, hi - lo]");
    inputs.push_back(*mask);
  }
  mx::Shape o = q.shape();
  o.back() = v.shape(3);
  mx::Stream s = mx::default_stream(mx::Device::cpu);
  return mx::array::make_arrays({o, keys.shape(), values.shape()}, {mx::float32, kv, kv},
                                std::make_shared<AttendCached>(s, scale, dims, traditional, bool(mask)),
                                std::move(inputs));
}

}  // namespace

void register_attention(nb::module_& m) {
  m.def("attend", &attend, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("scale"), nb::arg("mask").none(),
        "softmax(q k^T * scale + mask) v for q [1, H, N, D] over k, v [1, H_kv, S, D], on the CPU stream.");
  m.def("attend_cached", &attend_cached, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("keys"), nb::arg("values"),
        nb::arg("cos"), nb::arg("sin"), nb::arg("cells"), nb::arg("scale"), nb::arg("dims"), nb::arg("traditional"),
        nb::arg("mask").none(),
        "RoPE on q and k, k and v written to cells [start, start + N) of keys and values, and q attending to their "
        "cells [lo, hi) and [lo2, hi2), cells = int32 [start, lo, hi, lo2, hi2]: (o, keys', values'), keys' and "
        "values' taking over the buffers of keys and values (cells out of range: NaN, nothing written).");
}
