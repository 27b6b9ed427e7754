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
//
// An int8 or fp8 cache (kv_quant.h: per row, head_size codes and float16 scales) is
// read in place as well: a block's key rows are widened into the tile as
// decode(code) * scale (int8: a conversion; fp8: kv_quant.h's e4m3fn_decode), then
// scored as float32 rows; its value rows likewise, once per block, and each query head
// of the group accumulates them from the tile. The tile holds exactly the float32
// values of kv_cache_format.dequantize, and every sum runs in the float32 cache's
// order, so the result is the float32 kernel's on the dequantized cache, bit for bit.
// A row moves kv_row_bytes(head_size) bytes (68 at 64) instead of 4 * head_size; the
// next block's rows are prefetched while one is widened.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels.h"
#include "kv_quant.h"
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

// scores[g * count + t - first] for the rows [j, n) of one block (token t0 + j at row
// kb + j * ks, float32): scale * <q_g, k> for the AVX2 build and the portable one,
// <q_g, k> for the AVX-512 build (scores_to_probabilities applies the scale there).
inline void score_block(const float* q, int64_t group, int64_t D, const float* kb, int64_t ks, int64_t j, int64_t n,
                        float* row, int64_t count, float scale) {
  if (kHaveDotMr4) {
    // The group's query heads against four keys at a time, 512 bits wide, any D:
    // each key row is loaded once for all of them (scaled below).
    for (; j + 4 <= n; j += 4) dot_rows4(q, group, D, kb + j * ks, ks, D, row + j, count);
  } else if (kHaveDot4 && D % 8 == 0) {
    for (; j + 4 <= n; j += 4) {
      for (int64_t g = 0; g < group; ++g) dot4(q + g * D, kb + j * ks, ks, D, scale, row + g * count + j);
    }
  }
  for (; j < n; ++j) {
    const float* k = kb + j * ks;
    for (int64_t g = 0; g < group; ++g) row[g * count + j] = dot(q + g * D, k, D) * (kHaveDotMr4 ? 1.0f : scale);
  }
}

// Steps 1 (the AVX-512 build's scale), 1b and 2 over the item's scores [group, count]:
// softmax probabilities per query head, in place.
inline void scores_to_probabilities(const DecodeArgs& a, float* __restrict scores, int64_t group, int64_t count) {
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
    const int64_t j = std::max<int64_t>(0, first - t0);
    int64_t ks;  // the key rows' stride
    const float* kb = block_rows(key_cache + table[b] * block_stride + kvh * D, j, n, token_stride, D, tile, ks);
    score_block(q, group, D, kb, ks, j, n, scores + (t0 - first), count, a.scale);
  }
  scores_to_probabilities(a, scores, group, count);
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

// kFp8Lanes codes at src widened to dst as decode(code) * scale, given scale256 =
// scale * 256 (exact: a power of two): an e4m3fn code's bits, shifted into a float16's
// (exponent and mantissa fields lined up, subnormals included), are the float16 of its
// value * 2^-8, which the F16C conversion widens exactly; times scale256 that is the
// exact product decode(code) * scale rounded once, as e4m3fn_decode(code) * scale. The
// NaN codes (0x7f, 0xff) come out NaN. The portable build has none (kFp8Lanes 0).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr int64_t kFp8Lanes = 16;
inline void widen_fp8_lanes(const uint8_t* src, float* dst, float scale256) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  const __m256i mag = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)), 7);
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8);
  const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(mag, sign)), _mm512_set1_ps(scale256));
  const __mmask16 nan = _mm256_cmpeq_epi16_mask(mag, _mm256_set1_epi16(0x7f << 7));
  _mm512_storeu_ps(dst, _mm512_mask_mov_ps(v, nan, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN())));
}
#elif defined(__AVX2__) && defined(__F16C__)
constexpr int64_t kFp8Lanes = 8;
inline void widen_fp8_lanes(const uint8_t* src, float* dst, float scale256) {
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
  const __m128i mag = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f)), 7);
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
  const __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(mag, sign)), _mm256_set1_ps(scale256));
  const __m256 nan = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f << 7))));
  _mm256_storeu_ps(dst, _mm256_blendv_ps(v, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()), nan));
}
#else
constexpr int64_t kFp8Lanes = 0;
inline void widen_fp8_lanes(const uint8_t*, float*, float) {}
#endif

// Rows [j, n) of one block of an int8 or fp8 cache (already offset to the item's head;
// row j at block + j * token_stride: D codes, then a float16 scale per group of
// kv_group_size(D)) widened into tile (row j at tile + j * D) as decode(code) * scale,
// kv_cache_format.dequantize's float32 values.
template <int64_t kD, KVCodes kCodes>
inline void widen_code_rows(const uint8_t* block, int64_t j, int64_t n, int64_t token_stride, int64_t D,
                            float* __restrict tile) {
  if (kD > 0) D = kD;
  const int64_t G = kv_group_size(D);
  for (; j < n; ++j) {
    const uint8_t* __restrict src = block + j * token_stride;
    float* __restrict dst = tile + j * D;
    for (int64_t g0 = 0; g0 < D; g0 += G) {
      uint16_t bits;
      std::memcpy(&bits, src + D + g0 / G * kKVScaleBytes, sizeof bits);
      const float scale = half_to_float(bits);
      if (kCodes == KVCodes::Int8) {
#pragma omp simd
        for (int64_t d = g0; d < g0 + G; ++d) dst[d] = static_cast<float>(static_cast<int8_t>(src[d])) * scale;
      } else {
        int64_t d = g0;
        if (kFp8Lanes > 0) {
          for (; d + kFp8Lanes <= g0 + G; d += kFp8Lanes) widen_fp8_lanes(src + d, dst + d, scale * 256.0f);
        }
#pragma omp simd
        for (int64_t e = d; e < g0 + G; ++e) dst[e] = e4m3fn_decode(src[e]) * scale;
      }
    }
  }
}

// Asks for the cache lines of rows [0, n) of a block (each row_bytes long, token_stride
// apart) ahead of their use: blocks lie anywhere in the pool, so the hardware
// prefetcher cannot follow from one block to the next, and a block of small
// quantized rows is read faster than the miss latency allows otherwise.
inline void prefetch_rows(const uint8_t* block, int64_t n, int64_t token_stride, int64_t row_bytes) {
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* row = block + j * token_stride;
    __builtin_prefetch(row);
    __builtin_prefetch(row + row_bytes - 1);
  }
}

// One work item over an int8 or fp8 cache (see the top of the file); `tile` holds one
// block of one head (block_size * D floats), keys and then values.
template <int64_t kD, KVCodes kCodes>
void decode_item_codes(const DecodeArgs& a, int64_t seq, int64_t kvh, const int32_t* table, int64_t len,
                       float* __restrict scores, float* __restrict tile) {
  const int64_t D = kD > 0 ? kD : a.head_size;
  const int64_t group = a.num_heads / a.num_kv_heads;
  const int64_t row_bytes = kv_row_bytes(D);
  const int64_t token_stride = a.num_kv_heads * row_bytes;
  const int64_t block_stride = a.block_size * token_stride;
  const int64_t num_used = (len + a.block_size - 1) / a.block_size;
  const int64_t first = first_visible_token(len, a.sliding_window);
  const int64_t count = len - first;
  const float* q = a.query + (seq * a.num_heads + kvh * group) * D;
  float* __restrict out = a.out + (seq * a.num_heads + kvh * group) * D;

  // 1. scores, a block of widened keys at a time
  for (int64_t b = first / a.block_size; b < num_used; ++b) {
    const int64_t t0 = b * a.block_size;
    const int64_t n = std::min(a.block_size, len - t0);
    const int64_t j = std::max<int64_t>(0, first - t0);
    if (b + 1 < num_used) {
      prefetch_rows(a.key_cache_codes + table[b + 1] * block_stride + kvh * row_bytes,
                    std::min(a.block_size, len - t0 - a.block_size), token_stride, row_bytes);
    }
    widen_code_rows<kD, kCodes>(a.key_cache_codes + table[b] * block_stride + kvh * row_bytes, j, n, token_stride,
                                D, tile);
    score_block(q, group, D, tile, D, j, n, scores + (t0 - first), count, a.scale);
  }
  scores_to_probabilities(a, scores, group, count);
  // 3. out_g = sum_t p[g][t] * v_t: a block of value rows widened once, then each
  //    query head's accumulator (out's row, in registers while it adds the block's
  //    rows) takes them in token order, as the float32 path does.
  std::fill(out, out + group * D, 0.0f);
  for (int64_t b = first / a.block_size; b < num_used; ++b) {
    const int64_t t0 = b * a.block_size;
    const int64_t n = std::min(a.block_size, len - t0);
    const int64_t j0 = std::max<int64_t>(0, first - t0);
    if (b + 1 < num_used) {
      prefetch_rows(a.value_cache_codes + table[b + 1] * block_stride + kvh * row_bytes,
                    std::min(a.block_size, len - t0 - a.block_size), token_stride, row_bytes);
    }
    widen_code_rows<kD, kCodes>(a.value_cache_codes + table[b] * block_stride + kvh * row_bytes, j0, n,
                                token_stride, D, tile);
    for (int64_t g = 0; g < group; ++g) {
      const float* p = scores + g * count + (t0 - first);  // p[j] for token t0 + j
      float acc[kD > 0 ? kD : 1024];
      std::memcpy(acc, out + g * D, sizeof(float) * D);
      for (int64_t j = j0; j < n; ++j) {
        const float* __restrict v = tile + j * D;
        const float w = p[j];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[d] += w * v[d];
      }
      std::memcpy(out + g * D, acc, sizeof(float) * D);
    }
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

template <KVCodes kCodes>
void run_codes_item(const DecodeArgs& a, int64_t seq, int64_t kvh, const int32_t* table, int64_t len, float* scores,
                    float* tile) {
  switch (a.head_size) {
    case 64: decode_item_codes<64, kCodes>(a, seq, kvh, table, len, scores, tile); break;
    case 128: decode_item_codes<128, kCodes>(a, seq, kvh, table, len, scores, tile); break;
    default: decode_item_codes<0, kCodes>(a, seq, kvh, table, len, scores, tile); break;
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
    if (a.codes_kind != KVCodes::None) {
      scratch.resize(static_cast<size_t>(num_scores + a.block_size * a.head_size));
      float* tile = scratch.data() + num_scores;
      if (a.codes_kind == KVCodes::Int8) {
        run_codes_item<KVCodes::Int8>(a, seq, kvh, table, len, scratch.data(), tile);
      } else {
        run_codes_item<KVCodes::Fp8>(a, seq, kvh, table, len, scratch.data(), tile);
      }
    } else if (a.key_cache_bf16 != nullptr) {
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
