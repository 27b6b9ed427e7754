// Kernel entry points shared by the portable and the AVX2+FMA builds of each kernel.
// Every kernel source is compiled once per instruction set with PYAGENT_ISA set to
// the namespace it defines (pyagent::generic, pyagent::avx2); dispatch.cpp chooses.
#pragma once

#include <cstdint>
#include <vector>

namespace pyagent {

// One decode step of paged attention: every sequence brings one query token.
//   out, query:  [num_seqs, num_heads, head_size]                (C-contiguous)
//   key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size]
//   block_tables: [num_seqs, table_stride] int32, seq_lens: [num_seqs] int32
// Query head h reads key/value head h / (num_heads / num_kv_heads).
struct DecodeArgs {
  float* out;
  const float* query;
  const float* key_cache;
  const float* value_cache;
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

// The first key a decode query of a sequence of `len` tokens sees: 0 without a sliding
// window, else the oldest of the window's last `window` tokens.
// static: each per-ISA object keeps its own copy (no cross-ISA ODR merge).
static inline int64_t first_visible_token(int64_t len, int64_t window) {
  return window > 0 && len > window ? len - window : 0;
}

// Work item i is (sequence i / num_kv_heads, key/value head i % num_kv_heads).
// Returns false (and leaves the item's output unspecified) when a block id the item
// must read is outside [0, num_blocks); the caller reports the error.
#define PYAGENT_DECLARE_KERNELS(isa)                                                    \
  namespace isa {                                                                     \
  bool paged_decode_items(const DecodeArgs& args, int64_t begin, int64_t end,         \
                          std::vector<float>& scratch);                               \
  void linear_rows(const LinearArgs& args, int64_t n_begin, int64_t n_end);           \
  }

PYAGENT_DECLARE_KERNELS(generic)
PYAGENT_DECLARE_KERNELS(avx2)

}  // namespace pyagent
