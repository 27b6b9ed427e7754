// Paged decode attention for CPU, reading keys and values in place from the block
// pool (no gather). Plain loops written for the auto-vectorizer: the same source is
// the portable build and, compiled with -mavx2 -mfma, the AVX2 build.
//
// Per work item (one sequence, one key/value head) with G query heads in its group:
//   1. scores[g][t] = scale * <q_g, k_t>       for t < seq_len, block by block
//      (then cap * tanh(scores / cap) where a logit soft-cap is set)
//   2. softmax over t per query head (max-subtracted, exact division at the end)
//   3. out_g = sum_t p[g][t] * v_t / sum_t p[g][t]
//
// A bfloat16 cache is widened to float32 as it is read (exactly: a bfloat16 is the
// high half of a float32), keys a block at a time into a tile that the group's query
// heads share, so the arithmetic is the float32 cache's.
#include <algorithm>
#include <cmath>
#include <cstring>


#include "kernels.h"
#include "simd.h"

#ifndef PYAGENT_ISA
#error "PYAGENT_ISA must name the instruction-set namespace"
#endif

namespace pyagent {
namespace PYAGENT_ISA {
namespace {

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The largest of s[0..n), n >= 1: sixteen running maxima, then a fixed tree. Spelled
// out so it vectorizes (GCC leaves a plain max loop scalar, each step waiting on the
// last: it was the kernel's hottest loop).
inline float max_of(const float* __restrict s, int64_t n) {
  float acc[16];
  for (int l = 0; l < 16; ++l) acc[l] = s[0];
  const int64_t whole = n - n % 16;
  for (int64_t i = 0; i < whole; i += 16) {
    for (int l = 0; l < 16; ++l) acc[l] = acc[l] < s[i + l] ? s[i + l] : acc[l];
  }
  for (int64_t i = whole; i < n; ++i) acc[i - whole] = acc[i - whole] < s[i] ? s[i] : acc[i - whole];
  for (int l = 0; l < 8; ++l) acc[l] = acc[l] < acc[l + 8] ? acc[l + 8] : acc[l];
  for (int l = 0; l < 4; ++l) acc[l] = acc[l] < acc[l + 4] ? acc[l + 4] : acc[l];
  const float a = acc[0] < acc[2] ? acc[2] : acc[0];
  const float b = acc[1] < acc[3] ? acc[3] : acc[1];
  return a < b ? b : a;
}

inline float widen(float x) { return x; }
inline float widen(uint16_t h) { return bf16_to_float(h); }

// Rows [j, n) of one cache block (already offset to the item's key/value head) as
// float32 rows, and their stride: the cache itself for a float32 cache, the rows
// widened into `tile` (stride D, row j at tile + j * D) for a bfloat16 one.
inline const float* block_rows(const float* block, int64_t, int64_t, int64_t token_stride, int64_t, float*,
                               int64_t& stride) {
  stride = token_stride;
  return block;
}

inline const float* block_rows(const uint16_t* block, int64_t j, int64_t n, int64_t token_stride, int64_t D,
                               float* __restrict tile, int64_t& stride) {
  for (; j < n; ++j) {
    const uint16_t* src = block + j * token_stride;
    float* dst = tile + j * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) dst[d] = bf16_to_float(src[d]);
  }
  stride = D;
  return tile;
}

// One work item with the head size D known at compile time (kD > 0: the dot products
// and the value accumulator unroll into registers) or at run time (kD == 0), over a
// float32 (T = float) or bfloat16 (T = uint16_t) cache; `tile` holds one block of one
// head (block_size * D floats) for the latter.
template <int64_t kD, typename T>
void decode_item(const DecodeArgs& a, const T* key_cache, const T* value_cache, int64_t seq, int64_t kvh,
                 const int32_t* table, int64_t len, float* __restrict scores, float* __restrict tile) {
  const int64_t D = kD > 0 ? kD : a.head_size;
  const int64_t group = a.num_heads / a.num_kv_heads;
  const int64_t token_stride = a.num_kv_heads * D;
  const int64_t block_stride = a.block_size * token_stride;
  const int64_t num_used = (len + a.block_size - 1) / a.block_size;
  // Keys first..len-1 are visible (all of them without a sliding window).
  const int64_t first = first_visible_token(len, a.sliding_window);
  const int64_t count = len - first;
  const float* q = a.query + (seq * a.num_heads + kvh * group) * D;
  float* out = a.out + (seq * a.num_heads + kvh * group) * D;

  // 1. scores[g][t - first] = scale * <q_g, k_t>
  for (int64_t b = first / a.block_size; b < num_used; ++b) {
    const int64_t t0 = b * a.block_size;
    const int64_t n = std::min(a.block_size, len - t0);
    int64_t j = std::max<int64_t>(0, first - t0);
    int64_t ks;  // the key rows' stride
    const float* kb = block_rows(key_cache + table[b] * block_stride + kvh * D, j, n, token_stride, D, tile, ks);
    float* row = scores + (t0 - first);  // row[j] is token t0 + j
    if (kHaveDotMr4) {
      // The group's query heads against four keys at a time, 512 bits wide, any D:
      // each key row is loaded once for all of them (scaled below).
      for (; j + 4 <= n; j += 4) dot_rows4(q, group, D, kb + j * ks, ks, D, row + j, count);
    } else if (kHaveDot4 && D % 8 == 0) {
      for (; j + 4 <= n; j += 4) {
        for (int64_t g = 0; g < group; ++g) {
          dot4(q + g * D, kb + j * ks, ks, D, a.scale, row + g * count + j);
        }
      }
    }
    for (; j < n; ++j) {
      const float* k = kb + j * ks;
      for (int64_t g = 0; g < group; ++g) row[g * count + j] = dot(q + g * D, k, D) * (kHaveDotMr4 ? 1.0f : a.scale);
    }
  }
  if (kHaveDotMr4) {
#pragma omp simd
    for (int64_t i = 0; i < group * count; ++i) scores[i] *= a.scale;
  }
  // 1b. soft-capping, in transformers' order: (score / cap), tanh, times cap
  if (a.logit_softcap > 0.0f) {
    const float cap = a.logit_softcap;
    for (int64_t i = 0; i < group * count; ++i) scores[i] = std::tanh(scores[i] / cap) * cap;
  }
  // 2. softmax per query head, normalized in place
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * count;
    const float m = max_of(s, count);
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < count; ++t) {
      const float e = exp_nonpositive(s[t] - m);
      s[t] = e;
      total += e;
    }
    const float inv = 1.0f / total;
#pragma omp simd
    for (int64_t t = 0; t < count; ++t) s[t] *= inv;
  }
  // 3. out_g = sum_t p[g][t] * v_t, one query head at a time so its accumulator
  //    stays in registers (the value rows are re-read from L1/L2 per head).
  for (int64_t g = 0; g < group; ++g) {
    const float* p = scores + g * count - first;  // p[t] for first <= t < len
    float acc[kD > 0 ? kD : 1024];
    std::fill(acc, acc + D, 0.0f);
    for (int64_t b = first / a.block_size; b < num_used; ++b) {
      const int64_t t0 = b * a.block_size;
      const int64_t n = std::min(a.block_size, len - t0);
      const T* vb = value_cache + table[b] * block_stride + kvh * D;
      for (int64_t j = std::max<int64_t>(0, first - t0); j < n; ++j) {
        const T* v = vb + j * token_stride;
        const float w = p[t0 + j];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[d] += w * widen(v[d]);
      }
    }
    std::memcpy(out + g * D, acc, sizeof(float) * D);
  }
}

template <typename T>
void run_item(const DecodeArgs& a, const T* key_cache, const T* value_cache, int64_t seq, int64_t kvh,
              const int32_t* table, int64_t len, float* scores, float* tile) {
  switch (a.head_size) {
    case 64: decode_item<64>(a, key_cache, value_cache, seq, kvh, table, len, scores, tile); break;
    case 128: decode_item<128>(a, key_cache, value_cache, seq, kvh, table, len, scores, tile); break;
    default: decode_item<0>(a, key_cache, value_cache, seq, kvh, table, len, scores, tile); break;
  }
}

}  // namespace

bool paged_decode_items(const DecodeArgs& a, int64_t begin, int64_t end, std::vector<float>& scratch) {
  const int64_t group = a.num_heads / a.num_kv_heads;
  bool ok = true;
  for (int64_t item = begin; item < end; ++item) {
    const int64_t seq = item / a.num_kv_heads;
    const int64_t kvh = item % a.num_kv_heads;
    const int64_t len = a.seq_lens[seq];
    const int32_t* table = a.block_tables + seq * a.table_stride;
    if (len <= 0) {
      float* out = a.out + (seq * a.num_heads + kvh * group) * a.head_size;
      std::fill(out, out + group * a.head_size, 0.0f);
      continue;
    }
    const int64_t num_used = (len + a.block_size - 1) / a.block_size;
    const int64_t first = first_visible_token(len, a.sliding_window);
    bool item_ok = true;  // every block the item reads lies in the pool
    for (int64_t b = first / a.block_size; b < num_used; ++b) {
      if (table[b] < 0 || table[b] >= a.num_blocks) item_ok = false;
    }
    if (!item_ok) {
      ok = false;
      continue;
    }
    const int64_t num_scores = group * (len - first);
    if (a.key_cache_bf16 != nullptr) {
      scratch.resize(static_cast<size_t>(num_scores + a.block_size * a.head_size));
      run_item(a, a.key_cache_bf16, a.value_cache_bf16, seq, kvh, table, len, scratch.data(),
               scratch.data() + num_scores);
    } else {
      scratch.resize(static_cast<size_t>(num_scores));
      run_item(a, a.key_cache, a.value_cache, seq, kvh, table, len, scratch.data(), nullptr);
    }
  }
  return ok;
}

}  // namespace PYAGENT_ISA
}  // namespace pyagent
