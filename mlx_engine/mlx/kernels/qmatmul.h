// The quantized product's problem and its parallel runner (qmatmul.cpp), for the primitives built on it
// (gather_qmatmul.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mlx/array.h"

namespace mlx_engine {

// Two-level scales (GGUF's K-quants as their files hold them), Problem::super holding float16s per super-block of
// 256 elements (8 groups of 32, or 16 of 16):
// kU8: scales and biases are unsigned integers sc and m (uint8), super two float16 d and -dmin per super-block;
//   scale = d * sc, bias = -dmin * m (each an exact float32 product). Q4_K, Q5_K (groups of 32), Q2_K (of 16). Held
//   so, a Q4_K weight takes 4.625 bits per element (the file's 4.5), where float32 scales and biases took 6.
// kI8: a symmetric weight (no biases) whose scales are signed integers sc (int8), super one float16 d per
//   super-block; scale = d * sc, bias = -2**(bits - 1) * scale. Q6_K (6 bits), Q3_K (3 bits), groups of 16.
// And a power of two per group, for the MXFP4 codebook only:
// kE8M0: scales the E8M0 exponents e (uint8) of GGUF's MXFP4 blocks, scale = 2**(e - 128) (the halved E8M0 scale of
//   llama.cpp's ggml_e8m0_to_fp32_half, its levels doubled), no super; held so, an MXFP4 weight takes its file's
//   4.25 bits per element, where float16 scales took 4.5.
enum ScaleType { kF32 = 0, kF16 = 1, kBF16 = 2, kU8 = 3, kI8 = 4, kE8M0 = 5 };

// y [M, N] = x [M, K] @ dequantize(w, scales, biases).T, the weight in MLX's affine layout (see qmatmul.cpp).
struct Problem {
  const float* x;  // [M, K], for 4-bit weights reordered (see prepare_x and x_blocks)
  const uint8_t* w;  // [N, K * bits / 8]
  const void* scales;  // [N, K / group_size]
  const void* biases;  // [N, K / group_size], or null: the zero point 2**(bits - 1), bias = -2**(bits - 1) * scale
  float* out;  // [M, N]
  int M, N, K, group_size, bits, scale_type;
  const void* qx = nullptr;  // x quantized to int8 or int16 (int8::QX), for the integer kernels
  const void* super = nullptr;  // kU8: float16 [N, K / 256, 2], (d, -dmin); kI8: float16 [N, K / 256, 1], d
  int ldo = 0;  // the row stride of out (N, but for a block of a weight's rows)
  const uint8_t* codebook = nullptr;  // 4 bits only: a codebook weight's levels plus 128 (see Codebook), else null
  // 4 bits, fewer than 4 rows of x, AVX-512 (qmatmul_decode.inc): x in blocks of 128 elements, element 8 i + j of a
  // block at 16 j + i (the nibble j of the block's 32-bit word i), its rows K rounded up to 128 apart and zero past K;
  // xsums [M, K / group_size] x's sums over each group (for the biases' term)
  bool x_blocks = false;
  const float* xsums = nullptr;
};

// A 4-bit weight whose integers index a codebook, value scale * kvalues[q], by the id the Python functions take
// (`codebook`): kCodebookIQ4NL, kvalues_iq4nl of llama.cpp's ggml-common.h (GGUF's IQ4_NL and IQ4_XS);
// kCodebookMXFP4, kvalues_mxfp4 (the E2M1 values doubled, under scales 2**(e - 128): GGUF's MXFP4). The kernels read
// q as the byte levels[q] = kvalues[q] + 128, a symmetric weight of zero point 128: (byte - 128) * scale, one
// rounding of the exact product, as gguf's dequantize.
enum Codebook { kNoCodebook = 0, kCodebookIQ4NL = 1, kCodebookMXFP4 = 2 };

// Codebook `id`'s levels (null for kNoCodebook).
const uint8_t* codebook_levels(int id);

// The checks of a codebook id: one of Codebook, and (but kNoCodebook) a weight of 4 bits without biases; scales of
// `dtype` without super scales (`factored` false) uint8 (kE8M0) for kCodebookMXFP4 only; throws
// std::invalid_argument naming `who`.
void check_codebook(int id, int bits, bool biases, mlx::core::Dtype dtype, bool factored, const std::string& who);

// The ScaleType of scales of `dtype`, with super scales (`factored`: kU8 or kI8) or without (kF32, kF16, kBF16 or
// uint8's kE8M0).
int scale_type_of(mlx::core::Dtype dtype, bool factored);

// The zero point a symmetric weight's biases are made from: bias = zero_point_of(p) * scale (exact).
inline float zero_point_of(const Problem& p) { return p.codebook ? -128.f : -float(1 << (p.bits - 1)); }

// What the products do with x (qmatmul's `activations`): kActFloat32 take it as it is; kActInt8 quantize it to int8
// as llama.cpp does for the weight's type (per 32 elements as its Q8_0 blocks, per 256 as its Q8_K for the K-quants
// and IQ4_XS), kActInt16 to 16 bits per 32 (two int8 parts), for the integer kernels (qmatmul_int8.h).
enum Activations { kActFloat32 = 0, kActInt8 = 1, kActInt16 = 2 };

// int16 activations apply to products of fewer rows of x than this (decode steps, small batches); a prompt's take
// the float32 kernel, which is the faster there (int16's integer sums cost twice int8's: see qmatmul_run) and exact.
constexpr int kInt16MaxRows = 64;

// `name` ("float32", "int8" or "int16") as Activations; std::invalid_argument naming `who` for any other.
Activations parse_activations(const std::string& name, const std::string& who);

// Products of one x (every problem's x, M and K the same) with one or more weights as one parallel job; act int8 or
// int16: x quantized so (int8: once per way its weights take it) and the integer kernel, where the CPU has it (groups
// of 16 only symmetric, else the float32 kernel; int16 needs AVX-512 VNNI or AVX2: std::invalid_argument elsewhere).
// Problems of two-level scales run per block of rows, their scales and biases made float32 first.
void qmatmul_run(std::vector<Problem>& ps, Activations act);

// What a product node does to x first (the operation before a decoder layer's products), in the same node: each graph
// node of a decode step costs MLX's scheduling time, more than a norm of one row. Computed by the code of
// the operation's own primitive (rows.h), so the bits are those of the operations apart.
enum Prologue {
  kNone = 0,
  kNorm = 1,  // x = rms_norm(x, weight): inputs weight
  kAddNorm = 2,  // s = x + residual, x = rms_norm(s, weight): inputs residual, weight; s an output
  kSiLU = 3,  // x = silu(x) * up (a gated MLP's down projection): inputs up
  kGeluTanh = 4,  // x = gelu_tanh(x) * up
};

// The inputs a prologue takes besides x.
inline int prologue_inputs(int prologue) { return prologue == kNone ? 0 : prologue == kAddNorm ? 2 : 1; }

// One product node's work (the qmatmul primitive's, or one stage of output_mlp's): the prologue on x, then the
// products of x with one or more weights as one parallel job, then the norms of the outputs that have one. Weight i
// takes 3 inputs (w, scales, biases: the scales again for a symmetric weight), after them come the weights of the
// outputs' norms, then the super scales of the factored weights.
struct Stage {
  std::vector<int> group_sizes, bits;
  std::vector<bool> symmetric;  // no biases (see Problem::biases)
  std::vector<bool> out_norms;  // output i RMSNorm-ed over its last axis after the product
  std::vector<bool> factored;  // two-level scales (kU8 or kI8), the super scales among the inputs
  std::vector<int> codebook;  // a codebook weight's Codebook, or kNoCodebook
  int prologue = kNone;
  float eps = 0.f;  // the norms' epsilon (prologue and outputs)
  Activations act = kActFloat32;  // x quantized (int8, int16) where the CPU has the kernel
  // How many inputs the weights take (3 each, the norms' weights, the super scales).
  size_t weight_inputs() const;
  bool operator==(const Stage& o) const;
};

// A node's inputs that are evaluated constants (a model's weights and norms, in a compiled decode step), kept by its
// primitive instead of as graph inputs: MLX spends time of the calling thread on each graph input of a node at
// every call of a compiled step (its replay and eval build hash maps over them), and a layer's products have about 25.
// Input 0 (x) always stays a graph input. A copy shares the kept arrays (a node's task takes one per dispatch).
class HeldInputs {
 public:
  // The graph inputs of `all`; the others are kept here.
  std::vector<mlx::core::array> split(std::vector<mlx::core::array> all);
  // A node's graph inputs with the kept ones back in their places.
  std::vector<mlx::core::array> join(const std::vector<mlx::core::array>& inputs) const;
  bool operator==(const HeldInputs& o) const;

 private:
  struct Kept {
    std::vector<bool> places;  // per place of the full input list: kept here
    std::vector<mlx::core::array> arrays;  // those, in order
  };
  std::shared_ptr<const Kept> kept_ = std::make_shared<const Kept>();
};

// Runs `st` on float32 x [M, K] (row-major): `pro` the prologue's inputs (kNorm: the norm's weight; kAddNorm: the
// residual and the weight; the activations: up), `sum` kAddNorm's x + residual; the weights' inputs from `w0` on
// (`inputs` and their row-major `data`); output i into outs[i] [M, N_i], normed (out_norms[i]) per norm_dims[i]
// elements.
void run_stage(const Stage& st, const std::vector<mlx::core::array>& inputs, const std::vector<const void*>& data,
               size_t w0, const float* x, int M, int K, const float* const* pro, float* sum, float* const* outs,
               const int* norm_dims);

// One weight of a product node: checks it for inputs of `K` elements a row (x [..., K]; biases null: a symmetric
// weight; super: two-level scales; codebook: a Codebook), throwing std::invalid_argument naming `who`, and appends it
// to `st`, its w, scales and biases (the scales again where it has none) to `inputs` and its super scales to `supers`
// (the caller appends these after the outputs' norms); returns N.
int add_weight(Stage& st, std::vector<mlx::core::array>& inputs, std::vector<mlx::core::array>& supers, int K,
               const mlx::core::array& w, const mlx::core::array& scales,
               const std::optional<mlx::core::array>& biases, int group_size, int bits,
               const std::optional<mlx::core::array>& super, int codebook, const std::string& who);

// An output's shape: the product's own (`product`), or `given` where given, whose element count must be the
// product's; throws std::invalid_argument naming `who` and output `i` where it is not (or a size is negative).
mlx::core::Shape out_shape(const mlx::core::Shape& product, const std::optional<std::vector<int>>& given,
                           const std::string& who, size_t i);

// Rows [n0, n0 + count) of a problem with two-level scales (kU8, kI8) or E8M0 ones (kE8M0): their scales and biases
// as float32 into `s` and `b` ([count, K / group_size] each; a symmetric weight's biases -2**(bits - 1) * scale, a
// codebook's -128 * scale), exact, with the vector code of this CPU's row kernel.
void factored_scales(const Problem& p, int n0, int count, float* s, float* b);

// The checks of two-level scales of weights with `group_size` (16 or 32) elements per group: scales of shape
// gshape ([..., groups]), uint8 with biases the same (kU8) or int8 without biases (kI8), super float16
// [..., groups * group_size / 256, 2 or 1]; returns the ScaleType, throws std::invalid_argument naming `who`.
int check_factored(const mlx::core::Shape& gshape, int group_size, const mlx::core::array& scales,
                   const mlx::core::array* biases, const mlx::core::array& super, const std::string& who);

// The copy of the kernels this CPU runs: "avx512" (with VBMI), "avx2", "x86-64 without AVX2", "neon" or "generic";
// $MLX_ENGINE_CPU_ISA=avx2 takes the AVX2 copies on a CPU with AVX-512 too (the tests run them so on such machines).
std::string isa();

// Whether a weight of `bits` bits may have groups of `group_size`: 32, 64 or 128, or 16 but for 4 bits (the kernels
// read 4-bit elements per 32 as even and odd ones); throws std::invalid_argument naming `who` where not.
void check_group(int group_size, int bits, const std::string& who);

}  // namespace mlx_engine
