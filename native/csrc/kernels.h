// Kernel entry points shared by the portable, AVX2+FMA and AVX-512 builds of each kernel.
// Every kernel source is compiled once per instruction set with PYAGENT_ISA set to
// the namespace it defines (pyagent::generic, pyagent::avx2, pyagent::avx512); dispatch.cpp chooses.
#pragma once

#include <cstdint>
#include <vector>

namespace pyagent {

// What a quantized KV cache's codes are (kv_quant.h): None for a float cache.
enum class KVCodes : int { None, Int8, Fp8 };

// One decode step of paged attention: every sequence brings one query token.
//   out, query:  [num_seqs, num_heads, head_size]                (C-contiguous)
//   key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size]
//     (a quantized cache: [num_blocks, block_size, num_kv_heads, kv_row_bytes(head_size)]
//     bytes, each row its codes and its groups' float16 scales, see kv_quant.h)
//   block_tables: [num_seqs, table_stride] int32, seq_lens: [num_seqs] int32
// Query head h reads key/value head h / (num_heads / num_kv_heads).
struct DecodeArgs {
  float* out;
  const float* query;
  const float* key_cache;    // float32 caches; null when the bfloat16 or quantized pair is set
  const float* value_cache;
  const uint16_t* key_cache_bf16 = nullptr;  // bfloat16 caches (the bits), read widened to float32
  const uint16_t* value_cache_bf16 = nullptr;
  const uint8_t* key_cache_codes = nullptr;  // int8 or fp8 caches (codes_kind), read as decode(code) * scale
  const uint8_t* value_cache_codes = nullptr;
  KVCodes codes_kind = KVCodes::None;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  int64_t num_seqs;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_size;
  int64_t block_size;
  int64_t num_blocks;
  int64_t table_stride;
  int64_t sliding_window;  // > 0: a query at position p sees keys p - window < k <= p
  float scale;
  float logit_softcap;  // > 0: the scaled scores become cap * tanh(score / cap) (Gemma 2)
};

// out[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]), all C-contiguous float32; for the few
// rows of a decode step, where the weight is read once from memory per call.
struct LinearArgs {
  float* out;
  const float* x;
  const float* weight;
  const float* bias;  // may be null
  int64_t M;
  int64_t N;
  int64_t K;
};

// A quantized weight: N rows (output features) of K inputs, row n at
// data + n * row_bytes, each row encoded on its own as consecutive blocks (layouts in
// quant.cpp). Q8_0 ... IQ4_NL are GGUF's (K a multiple of their block: 32, or 256 for
// the K-quants Q2_K ... Q6_K); I8 is one f32 scale per row, I4 is Q4_1 with `group`
// elements per block and a padded last block (any K).
enum class QuantEncoding : int { Q8_0, Q4_0, Q4_1, Q6_K, I8, I4, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K };

struct QuantWeight {
  const uint8_t* data;
  int64_t N;
  int64_t K;
  int64_t row_bytes;
  QuantEncoding encoding;
  int64_t group;  // I4: 32, 64 or 128 elements per block; unused otherwise
};

// Elements per block (I8: a row is one block of K); bytes per block; bytes per row.
static inline int64_t quant_block_size(QuantEncoding e, int64_t group, int64_t K) {
  switch (e) {
    case QuantEncoding::Q2_K:
    case QuantEncoding::Q3_K:
    case QuantEncoding::Q4_K:
    case QuantEncoding::Q5_K:
    case QuantEncoding::Q6_K: return 256;
    case QuantEncoding::I8: return K;
    case QuantEncoding::I4: return group;
    default: return 32;
  }
}
static inline int64_t quant_block_bytes(QuantEncoding e, int64_t group, int64_t K) {
  switch (e) {
    case QuantEncoding::Q8_0: return 2 + 32;
    case QuantEncoding::Q4_0: return 2 + 16;
    case QuantEncoding::Q4_1: return 4 + 16;
    case QuantEncoding::Q5_0: return 2 + 4 + 16;
    case QuantEncoding::Q5_1: return 4 + 4 + 16;
    case QuantEncoding::IQ4_NL: return 2 + 16;
    case QuantEncoding::Q2_K: return 16 + 64 + 4;
    case QuantEncoding::Q3_K: return 32 + 64 + 12 + 2;
    case QuantEncoding::Q4_K: return 4 + 12 + 128;
    case QuantEncoding::Q5_K: return 4 + 12 + 32 + 128;
    case QuantEncoding::Q6_K: return 128 + 64 + 16 + 2;
    case QuantEncoding::I8: return 4 + K;
    case QuantEncoding::I4: return 4 + group / 2;
  }
  return 0;
}
static inline int64_t quant_row_bytes(QuantEncoding e, int64_t group, int64_t K) {
  if (e == QuantEncoding::I8) return 4 + K;
  const int64_t b = quant_block_size(e, group, K);
  return (K + b - 1) / b * quant_block_bytes(e, group, K);
}

enum class Activations : uint8_t { Float32, Int8, Int16 };

// out[M, N] = x[M, K] @ dequantize(w)^T (+ bias[N]), out, x, bias C-contiguous float32.
struct QuantLinearArgs {
  float* out;
  const float* x;
  const float* bias;  // may be null
  int64_t M;
  QuantWeight w;
  // How x enters the products (opt-in; ignored where a build has no integer kernel
  // for the case, which then computes in float32):
  // - Int8: x is rounded to int8 per block of 32 (scale max|x| / 127) and the codes
  //   are multiplied in integers, as llama.cpp does, with an error of up to
  //   max|x_block| / 254 per element of x. Kernels: one row of x with Q4_0/Q4_1 (AVX2
  //   and AVX-512 builds; ~1.4x), several rows with the encodings int8_gemm names
  //   (AVX-512 build, vpdpbusd; 2-3.5x the float tile at 32-64 rows).
  // - Int16: x is rounded to 16 bits per block of 32 (scale max|x| / 32512, an error
  //   of up to max|x_block| / 65024 per element) and each rounded value q is split
  //   exactly into 255 * hi + lo with hi, lo in [-127, 127]: two int8 rows of x that
  //   the same integer GEMM multiplies and sums as 255 hi + lo before the scale d.
  //   The encodings int8_gemm names (AVX-512 build), from one row of x on (Q4_0,
  //   Q4_1), two (Q8_0) or four (the encodings decoded into tiles first).
  Activations activations = Activations::Float32;
};

// out[m, i] = silu(gate[m, i]) * up[m, i] for i < n: row m of gate at gate + m * in_stride,
// of up at up + m * in_stride, of out at out + m * out_stride.
struct SiluMulArgs {
  float* out;
  const float* gate;
  const float* up;
  int64_t n;
  int64_t in_stride;
  int64_t out_stride;
};

// The first key a decode query of a sequence of `len` tokens sees: 0 without a sliding
// window, else the oldest of the window's last `window` tokens.
// static: each per-ISA object keeps its own copy (no cross-ISA ODR merge).
static inline int64_t first_visible_token(int64_t len, int64_t window) {
  return window > 0 && len > window ? len - window : 0;
}

// Work item i is (sequence i / num_kv_heads, key/value head i % num_kv_heads).
// Returns false (and leaves the item's output unspecified) when a block id the item
// must read is outside [0, num_blocks); the caller reports the error.
// The *_rows kernels compute output features (weight rows) [n_begin, n_end);
// dequantize_rows writes rows of out[N, K]; silu_mul_rows computes rows [begin, end).
// int8_gemm: whether quantized_linear_rows multiplies several rows of x in integers for
// this encoding when activations are Int8 or Int16 (so any number of rows is worth
// sending).
#define PYAGENT_DECLARE_KERNELS(isa)                                                    \
  namespace isa {                                                                     \
  bool paged_decode_items(const DecodeArgs& args, int64_t begin, int64_t end,         \
                          std::vector<float>& scratch);                               \
  void linear_rows(const LinearArgs& args, int64_t n_begin, int64_t n_end);           \
  void dequantize_rows(const QuantWeight& w, float* out, int64_t n_begin,             \
                       int64_t n_end);                                                \
  void quantized_linear_rows(const QuantLinearArgs& args, int64_t n_begin,            \
                             int64_t n_end);                                          \
  void silu_mul_rows(const SiluMulArgs& args, int64_t begin, int64_t end);            \
  bool int8_gemm(QuantEncoding encoding);                                             \
  }

PYAGENT_DECLARE_KERNELS(generic)
PYAGENT_DECLARE_KERNELS(avx2)
PYAGENT_DECLARE_KERNELS(avx512)

}  // namespace pyagent
