// Quantized linear weights for CPU decode: exact dequantizers, and a matmul that reads
// the packed weight directly.
//
// Row layouts (little-endian; f16 is IEEE half; lo/hi are a byte's low/high nibble):
//   Q8_0  blocks of 32:  [f16 d][int8 q x32]            w[i] = d * q[i]
//   Q4_0  blocks of 32:  [f16 d][u8 qs x16]             w[j] = d * (lo(qs[j]) - 8), w[j+16] = d * (hi(qs[j]) - 8)
//   Q4_1  blocks of 32:  [f16 d][f16 m][u8 qs x16]      w[j] = d * lo(qs[j]) + m,   w[j+16] = d * hi(qs[j]) + m
//   I4/g  blocks of g:   Q4_1 with g/2 code bytes (w[j], w[j+g/2]); the last block is
//                        stored whole and its elements from K on are padding
//   Q6_K  blocks of 256: [u8 ql x128][u8 qh x64][int8 sc x16][f16 d]; element
//                        e = 32 * (4h + j) + l (h < 2, j < 4, l < 32) has the 6-bit code
//                        c = (ql[64h + 32(j&1) + l] >> 4(j>>1)) & 15 | ((qh[32h + l] >> 2j) & 3) << 4
//                        and w[e] = (d * sc[e / 16]) * (c - 32)
//   I8    one per row:   [f32 scale][int8 q xK]         w[k] = scale * q[k]
//
// Dequantizing reproduces the gguf package's numpy code bit for bit: the same float32
// operations in the same order (d * q then + m; (d * sc) * q). CMake compiles this file
// with -ffp-contract=off so the AVX2+FMA build cannot fuse a multiply and an add (the
// products here are exact, an 11-bit half times a code of at most 8 bits, so a fused
// result would agree anyway; the flag keeps that from being a coincidence).
//
// The matmul of one row of x (decode) never forms the float weights. Per block it sums
// code * x in vector lanes and folds the scale in with one FMA; the offset m of Q4_1/I4
// (and Q4_0's -8) multiplies the block's sum of x, computed once per call and shared by
// every output row. Four output rows go together, so each block of x is loaded once for
// four rows and four accumulator chains run side by side; the next four rows are
// prefetched meanwhile. With more rows of x, each four-row tile is dequantized exactly
// into an L1 scratch once and the rows of x are applied to it two at a time (dot4x2).
// Everything is float32: x is never quantized.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "simd.h"

#ifndef PYAGENT_ISA
#error "PYAGENT_ISA must name the instruction-set namespace"
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PYAGENT_QUANT_SIMD 1
#else
#define PYAGENT_QUANT_SIMD 0
#endif

namespace pyagent {
namespace PYAGENT_ISA {
namespace {

inline uint16_t load_u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

inline float load_f32(const uint8_t* p) {
  const uint32_t bits = p[0] | (p[1] << 8) | (p[2] << 16) | (static_cast<uint32_t>(p[3]) << 24);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// IEEE half to float, exact (every half is a float).
inline float half_to_float(uint16_t h) {
#if PYAGENT_QUANT_SIMD
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float f = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  const uint32_t bits = exponent == 0x1f ? sign | 0x7f800000u | (mantissa << 13)  // inf, nan
                                         : sign | ((exponent + 112) << 23) | (mantissa << 13);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

inline float load_f16(const uint8_t* p) { return half_to_float(load_u16(p)); }

// Asks for [begin, end) to come into L2. The kernels go through the weight four rows
// at a time, and rows of a few hundred bytes are streams too short for the hardware
// prefetchers to pick up in time: asking for the next four rows while working on these
// doubled the one-row speed of Q8_0 and I8 on weights coming from memory (Zen 3).
// Rows [first, last) of w, clipped to the rows before `stop`.
inline void prefetch_rows(const QuantWeight& w, int64_t first, int64_t last, int64_t stop) {
  const int64_t end = std::min(last, stop) * w.row_bytes;
  for (int64_t at = first * w.row_bytes; at < end; at += 64) __builtin_prefetch(w.data + at, 0, 2);
}

// ---------------------------------------------------------------------------------
// Exact dequantization of one block into dst (the reference's float32 operations).

#if PYAGENT_QUANT_SIMD

inline __m256i load_u8x8(const uint8_t* p) {  // 8 bytes, zero-extended to int32 lanes
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i load_i8x8(const uint8_t* p) {  // 8 bytes, sign-extended to int32 lanes
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 to_float(__m256i v) { return _mm256_cvtepi32_ps(v); }

// The 32 codes of Q6_K group (h, J) minus 32, as int8 lanes (layout at the top); ql0,
// ql1 and qh are the half's 64 + 32 code bytes. Shifting 16-bit lanes lets bits cross
// from the neighbouring byte; the masks drop them.
template <int J>
inline __m256i q6_codes(__m256i ql0, __m256i ql1, __m256i qh) {
  __m256i lo = (J & 1) ? ql1 : ql0;
  if (J >= 2) lo = _mm256_srli_epi16(lo, 4);
  lo = _mm256_and_si256(lo, _mm256_set1_epi8(0x0f));
  // bits 2J, 2J + 1 of qh moved to bits 4, 5
  __m256i hi = J == 0 ? _mm256_slli_epi16(qh, 4) : J == 1 ? _mm256_slli_epi16(qh, 2) : J == 2 ? qh : _mm256_srli_epi16(qh, 2);
  hi = _mm256_and_si256(hi, _mm256_set1_epi8(0x30));
  return _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
}

// 32 int8 lanes as four vectors of 8 floats, in order.
inline void widen_i8x32(__m256i q, __m256 f[4]) {
  const __m128i a = _mm256_castsi256_si128(q), b = _mm256_extracti128_si256(q, 1);
  f[0] = to_float(_mm256_cvtepi8_epi32(a));
  f[1] = to_float(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
  f[2] = to_float(_mm256_cvtepi8_epi32(b));
  f[3] = to_float(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
}

void decode_q8_0(const uint8_t* blk, float* dst) {
  const __m256 d = _mm256_set1_ps(load_f16(blk));
  for (int c = 0; c < 4; ++c) _mm256_storeu_ps(dst + 8 * c, _mm256_mul_ps(to_float(load_i8x8(blk + 2 + 8 * c)), d));
}

void decode_q4_0(const uint8_t* blk, float* dst) {
  const __m256 d = _mm256_set1_ps(load_f16(blk));
  const __m256i mask = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
  for (int c = 0; c < 2; ++c) {
    const __m256i v = load_u8x8(blk + 2 + 8 * c);
    const __m256i lo = _mm256_sub_epi32(_mm256_and_si256(v, mask), eight);
    const __m256i hi = _mm256_sub_epi32(_mm256_srli_epi32(v, 4), eight);
    _mm256_storeu_ps(dst + 8 * c, _mm256_mul_ps(d, to_float(lo)));
    _mm256_storeu_ps(dst + 16 + 8 * c, _mm256_mul_ps(d, to_float(hi)));
  }
}

template <int G>
void decode_q4_1(const uint8_t* blk, float* dst) {
  const __m256 d = _mm256_set1_ps(load_f16(blk)), m = _mm256_set1_ps(load_f16(blk + 2));
  const __m256i mask = _mm256_set1_epi32(15);
  constexpr int half = G / 2;
  for (int c = 0; c < half; c += 8) {
    const __m256i v = load_u8x8(blk + 4 + c);
    _mm256_storeu_ps(dst + c, _mm256_add_ps(_mm256_mul_ps(d, to_float(_mm256_and_si256(v, mask))), m));
    _mm256_storeu_ps(dst + half + c, _mm256_add_ps(_mm256_mul_ps(d, to_float(_mm256_srli_epi32(v, 4))), m));
  }
}

// (d * sc) * code: one scale per 16 codes, the 16 scales of a block made together.
inline void q6_scales(const uint8_t* blk, float* ds) {
  const __m256 d = _mm256_set1_ps(load_f16(blk + 208));
  _mm256_store_ps(ds, _mm256_mul_ps(d, to_float(load_i8x8(blk + 192))));
  _mm256_store_ps(ds + 8, _mm256_mul_ps(d, to_float(load_i8x8(blk + 200))));
}

template <int J>
inline void q6_store(__m256i codes, const float* ds, float* dst) {
  __m256 f[4];
  widen_i8x32(codes, f);
  const __m256 s0 = _mm256_broadcast_ss(ds + 2 * J), s1 = _mm256_broadcast_ss(ds + 2 * J + 1);
  _mm256_storeu_ps(dst + 32 * J, _mm256_mul_ps(s0, f[0]));
  _mm256_storeu_ps(dst + 32 * J + 8, _mm256_mul_ps(s0, f[1]));
  _mm256_storeu_ps(dst + 32 * J + 16, _mm256_mul_ps(s1, f[2]));
  _mm256_storeu_ps(dst + 32 * J + 24, _mm256_mul_ps(s1, f[3]));
}

void decode_q6_k(const uint8_t* blk, float* dst) {
  alignas(32) float ds[16];
  q6_scales(blk, ds);
  for (int h = 0; h < 2; ++h) {
    const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
    const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
    q6_store<0>(q6_codes<0>(ql0, ql1, qh), ds + 8 * h, dst + 128 * h);
    q6_store<1>(q6_codes<1>(ql0, ql1, qh), ds + 8 * h, dst + 128 * h);
    q6_store<2>(q6_codes<2>(ql0, ql1, qh), ds + 8 * h, dst + 128 * h);
    q6_store<3>(q6_codes<3>(ql0, ql1, qh), ds + 8 * h, dst + 128 * h);
  }
}

void decode_i8(const uint8_t* row, int64_t K, float* dst) {
  const float scale = load_f32(row);
  const __m256 s = _mm256_set1_ps(scale);
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) _mm256_storeu_ps(dst + k, _mm256_mul_ps(s, to_float(load_i8x8(row + 4 + k))));
  for (; k < K; ++k) dst[k] = scale * static_cast<float>(static_cast<int8_t>(row[4 + k]));
}

#else  // portable: plain loops

void decode_q8_0(const uint8_t* blk, float* dst) {
  const float d = load_f16(blk);
  for (int i = 0; i < 32; ++i) dst[i] = static_cast<float>(static_cast<int8_t>(blk[2 + i])) * d;
}

void decode_q4_0(const uint8_t* blk, float* dst) {
  const float d = load_f16(blk);
  const uint8_t* qs = blk + 2;
  for (int j = 0; j < 16; ++j) {
    dst[j] = d * static_cast<float>((qs[j] & 15) - 8);
    dst[j + 16] = d * static_cast<float>((qs[j] >> 4) - 8);
  }
}

template <int G>
void decode_q4_1(const uint8_t* blk, float* dst) {
  const float d = load_f16(blk), m = load_f16(blk + 2);
  const uint8_t* qs = blk + 4;
  constexpr int half = G / 2;
  for (int j = 0; j < half; ++j) {
    dst[j] = d * static_cast<float>(qs[j] & 15) + m;
    dst[j + half] = d * static_cast<float>(qs[j] >> 4) + m;
  }
}

void decode_q6_k(const uint8_t* blk, float* dst) {
  const uint8_t* ql = blk;
  const uint8_t* qh = blk + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
  const float d = load_f16(blk + 208);
  for (int h = 0; h < 2; ++h) {
    for (int j = 0; j < 4; ++j) {
      const int group = 4 * h + j;
      const float s0 = d * static_cast<float>(sc[2 * group]), s1 = d * static_cast<float>(sc[2 * group + 1]);
      for (int l = 0; l < 32; ++l) {
        const int lo = (ql[64 * h + 32 * (j & 1) + l] >> (4 * (j >> 1))) & 15;
        const int hi = (qh[32 * h + l] >> (2 * j)) & 3;
        dst[32 * group + l] = (l < 16 ? s0 : s1) * static_cast<float>((lo | (hi << 4)) - 32);
      }
    }
  }
}

void decode_i8(const uint8_t* row, int64_t K, float* dst) {
  const float scale = load_f32(row);
  for (int64_t k = 0; k < K; ++k) dst[k] = scale * static_cast<float>(static_cast<int8_t>(row[4 + k]));
}

#endif

// The K floats of a row of B-element blocks of Bytes bytes. Only I4's last block can
// be partial: it is decoded whole into a buffer and its first K % B elements kept.
template <int B, int Bytes, void (*Decode)(const uint8_t*, float*)>
void decode_blocks(const uint8_t* row, int64_t K, float* dst) {
  const int64_t full = K / B;
  for (int64_t b = 0; b < full; ++b) Decode(row + b * Bytes, dst + b * B);
  if (K % B != 0) {
    float last[B];
    Decode(row + full * Bytes, last);
    std::copy(last, last + K % B, dst + full * B);
  }
}

void decode_row(const QuantWeight& w, const uint8_t* row, float* dst) {
  switch (w.encoding) {
    case QuantEncoding::Q8_0: decode_blocks<32, 34, decode_q8_0>(row, w.K, dst); break;
    case QuantEncoding::Q4_0: decode_blocks<32, 18, decode_q4_0>(row, w.K, dst); break;
    case QuantEncoding::Q4_1: decode_blocks<32, 20, decode_q4_1<32>>(row, w.K, dst); break;
    case QuantEncoding::Q6_K: decode_blocks<256, 210, decode_q6_k>(row, w.K, dst); break;
    case QuantEncoding::I8: decode_i8(row, w.K, dst); break;
    case QuantEncoding::I4:
      if (w.group == 32) decode_blocks<32, 20, decode_q4_1<32>>(row, w.K, dst);
      else if (w.group == 64) decode_blocks<64, 36, decode_q4_1<64>>(row, w.K, dst);
      else decode_blocks<128, 68, decode_q4_1<128>>(row, w.K, dst);
      break;
  }
}

// ---------------------------------------------------------------------------------
// Tiled matmul (any M, both builds): dequantize four rows into a scratch that stays
// in L1, then every row of x against it, as linear_rows does with float weights.

#if PYAGENT_QUANT_SIMD
// Four weight rows (w, stride K) against two rows of x over the first K8 (a multiple
// of 8) columns: eight independent FMA chains and six loads per eight FMAs, where dot4
// has four chains (bound by the FMA latency) and five loads per four FMAs. About 1.3x
// dot4's rate on a Zen 3.
inline void dot4x2(const float* __restrict x0, const float* __restrict x1, const float* __restrict w, int64_t K,
                   int64_t K8, float* __restrict out0, float* __restrict out1) {
  __m256 a[2][4];
  for (int i = 0; i < 2; ++i)
    for (int r = 0; r < 4; ++r) a[i][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K8; k += 8) {
    const __m256 v0 = _mm256_loadu_ps(x0 + k), v1 = _mm256_loadu_ps(x1 + k);
    for (int r = 0; r < 4; ++r) {
      const __m256 wv = _mm256_loadu_ps(w + r * K + k);
      a[0][r] = _mm256_fmadd_ps(v0, wv, a[0][r]);
      a[1][r] = _mm256_fmadd_ps(v1, wv, a[1][r]);
    }
  }
  float* outs[2] = {out0, out1};
  for (int i = 0; i < 2; ++i) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[i][0], a[i][1]), _mm256_hadd_ps(a[i][2], a[i][3]));
    _mm_storeu_ps(outs[i], _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }
}
#endif

// out[0, 4) += x . the tile's rows over columns [K8, K) (what the vector loops leave).
inline void add_tail(const float* x, const float* tile, int64_t K, int64_t K8, float* out) {
  for (int64_t r = 0; r < 4; ++r) {
    float tail = 0.0f;
    for (int64_t k = K8; k < K; ++k) tail += x[k] * tile[r * K + k];
    out[r] += tail;
  }
}

void tiled_rows(const QuantLinearArgs& a, int64_t n_begin, int64_t n_end) {
  const int64_t K = a.w.K, N = a.w.N;
  static thread_local std::vector<float> tile;
  tile.resize(4 * K);
  const float* t = tile.data();
  const int64_t K8 = K - K % 8;
  for (int64_t n = n_begin; n < n_end; n += 4) {
    const int64_t rows = std::min<int64_t>(4, n_end - n);
    prefetch_rows(a.w, n + 4, n + 8, n_end);
    for (int64_t r = 0; r < rows; ++r) decode_row(a.w, a.w.data + (n + r) * a.w.row_bytes, tile.data() + r * K);
    int64_t m = 0;
    if (kHaveDot4 && rows == 4 && K8 > 0) {
#if PYAGENT_QUANT_SIMD
      for (; m + 2 <= a.M; m += 2) {
        const float* x = a.x + m * K;
        float* out = a.out + m * N + n;
        dot4x2(x, x + K, t, K, K8, out, out + N);
        add_tail(x, t, K, K8, out);
        add_tail(x + K, t, K, K8, out + N);
      }
#endif
      for (; m < a.M; ++m) {
        const float* x = a.x + m * K;
        float* out = a.out + m * N + n;
        dot4(x, t, K, K8, 1.0f, out);
        add_tail(x, t, K, K8, out);
      }
    }
    for (; m < a.M; ++m) {
      for (int64_t r = 0; r < rows; ++r) a.out[m * N + n + r] = dot(a.x + m * K, t + r * K, K);
    }
  }
}

#if PYAGENT_QUANT_SIMD
// ---------------------------------------------------------------------------------
// Fused matmul of one row of x with R consecutive weight rows (AVX2 build).

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float lane1(__m128 v) { return _mm_cvtss_f32(_mm_movehdup_ps(v)); }

// sums[4b .. 4b+3] = {0, sum of x over block b, 0, 0}: in lane 1, where a block's
// [d, m] pair has m, so the offset term is one 128-bit FMA with no shuffle.
void block_sums(const float* x, int64_t nb, int64_t B, float* sums) {
  for (int64_t b = 0; b < nb; ++b) {
    __m256 s = _mm256_loadu_ps(x + b * B);
    for (int64_t i = 8; i < B; i += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(x + b * B + i));
    sums[4 * b] = 0.0f;
    sums[4 * b + 1] = hsum(s);
    sums[4 * b + 2] = 0.0f;
    sums[4 * b + 3] = 0.0f;
  }
}

// Q4_1 / I4 (kMin, any G) and Q4_0 (G = 32). Block b of a row contributes
// d * sum(code * x) + m * S_b, or d * sum(code * x) - 8 * d * S_b for Q4_0.
template <int R, int G, bool kMin>
void fused_q4(const uint8_t* rows, int64_t row_bytes, int64_t nb, const float* x, const float* sums, float* dst) {
  constexpr int64_t kBytes = (kMin ? 4 : 2) + G / 2;
  const __m256i mask = _mm256_set1_epi32(15);
  __m256 acc[R];
  __m128 off[R];  // lane 1: sum of m * S_b (Q4_1, I4) or d * S_b (Q4_0)
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    off[r] = _mm_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * G;
    const __m128 sb = _mm_loadu_ps(sums + 4 * b);
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = rows + r * row_bytes + b * kBytes;
      int32_t scales = 0;  // d and, for Q4_1/I4, m: two halves
      std::memcpy(&scales, blk, kMin ? 4 : 2);
      const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(scales));  // [d, m or 0, 0, 0]
      const __m256 d = _mm256_broadcastss_ps(dm);
      off[r] = _mm_fmadd_ps(kMin ? dm : _mm256_castps256_ps128(d), sb, off[r]);
      const uint8_t* qs = blk + (kMin ? 4 : 2);
      const __m256i v0 = load_u8x8(qs);
      __m256 s0 = _mm256_mul_ps(to_float(_mm256_and_si256(v0, mask)), _mm256_loadu_ps(xb));
      __m256 s1 = _mm256_mul_ps(to_float(_mm256_srli_epi32(v0, 4)), _mm256_loadu_ps(xb + G / 2));
      for (int c = 8; c < G / 2; c += 8) {
        const __m256i v = load_u8x8(qs + c);
        s0 = _mm256_fmadd_ps(to_float(_mm256_and_si256(v, mask)), _mm256_loadu_ps(xb + c), s0);
        s1 = _mm256_fmadd_ps(to_float(_mm256_srli_epi32(v, 4)), _mm256_loadu_ps(xb + G / 2 + c), s1);
      }
      acc[r] = _mm256_fmadd_ps(_mm256_add_ps(s0, s1), d, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) dst[r] = hsum(acc[r]) + (kMin ? 1.0f : -8.0f) * lane1(off[r]);
}

template <int R>
void fused_q8_0(const uint8_t* rows, int64_t row_bytes, int64_t nb, const float* x, float* dst) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + 32 * b;
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = rows + r * row_bytes + 34 * b;
      const __m256 d = _mm256_set1_ps(load_f16(blk));
      __m256 s = _mm256_mul_ps(to_float(load_i8x8(blk + 2)), _mm256_loadu_ps(xb));
      for (int c = 8; c < 32; c += 8) s = _mm256_fmadd_ps(to_float(load_i8x8(blk + 2 + c)), _mm256_loadu_ps(xb + c), s);
      acc[r] = _mm256_fmadd_ps(s, d, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) dst[r] = hsum(acc[r]);
}

// Q6_K: the sum of code * x over each 16 elements takes its scale d * sc with one FMA.
// A block's 16 scales are converted together into a small array whose entries are
// broadcast straight from L1; the codes are built 32 at a time with byte operations.
// One group of 32 codes against x[0, 32) into two accumulators (two shorter chains).
inline void q6_group(__m256i codes, const float* x, const float* ds, __m256& acc0, __m256& acc1) {
  __m256 f[4];
  widen_i8x32(codes, f);
  const __m256 s0 = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(x + 8), _mm256_mul_ps(f[0], _mm256_loadu_ps(x)));
  const __m256 s1 = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(x + 24), _mm256_mul_ps(f[2], _mm256_loadu_ps(x + 16)));
  acc0 = _mm256_fmadd_ps(s0, _mm256_broadcast_ss(ds), acc0);
  acc1 = _mm256_fmadd_ps(s1, _mm256_broadcast_ss(ds + 1), acc1);
}

template <int R>
void fused_q6_k(const uint8_t* rows, int64_t row_bytes, int64_t nb, const float* x, float* dst) {
  alignas(32) float ds[16];
  // Row by row: the block's 256 floats of x stay in L1 for the next rows (written the
  // other way round, the compiler hoists them out of the row loop and spills them).
  for (int r = 0; r < R; ++r) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = rows + r * row_bytes + 210 * b;
      q6_scales(blk, ds);
      for (int h = 0; h < 2; ++h) {
        const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
        const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
        const float* xh = x + 256 * b + 128 * h;
        q6_group(q6_codes<0>(ql0, ql1, qh), xh, ds + 8 * h, acc0, acc1);
        q6_group(q6_codes<1>(ql0, ql1, qh), xh + 32, ds + 8 * h + 2, acc0, acc1);
        q6_group(q6_codes<2>(ql0, ql1, qh), xh + 64, ds + 8 * h + 4, acc0, acc1);
        q6_group(q6_codes<3>(ql0, ql1, qh), xh + 96, ds + 8 * h + 6, acc0, acc1);
      }
    }
    dst[r] = hsum(_mm256_add_ps(acc0, acc1));
  }
}

// I8: scale * sum(q * x), two accumulator chains per row.
template <int R>
void fused_i8(const uint8_t* rows, int64_t row_bytes, int64_t K, const float* x, float* dst) {
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
    for (int r = 0; r < R; ++r) {
      const uint8_t* q = rows + r * row_bytes + 4 + k;
      acc0[r] = _mm256_fmadd_ps(to_float(load_i8x8(q)), x0, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(to_float(load_i8x8(q + 8)), x1, acc1[r]);
    }
  }
  if (k + 8 <= K) {
    const __m256 x0 = _mm256_loadu_ps(x + k);
    for (int r = 0; r < R; ++r) acc0[r] = _mm256_fmadd_ps(to_float(load_i8x8(rows + r * row_bytes + 4 + k)), x0, acc0[r]);
    k += 8;
  }
  for (int r = 0; r < R; ++r) {
    const uint8_t* row = rows + r * row_bytes;
    float s = hsum(_mm256_add_ps(acc0[r], acc1[r]));
    for (int64_t t = k; t < K; ++t) s += static_cast<float>(static_cast<int8_t>(row[4 + t])) * x[t];
    dst[r] = load_f32(row) * s;
  }
}

// Q4_0 / Q4_1 against x rounded to int8 per block (QuantLinearArgs::int8_activations):
// the 32 codes (u8) times the 32 int8 x values in two instructions (pairs summed to
// int16, then to int32), the block's d * dx folded in with one FMA. The offset term
// (m, or Q4_0's -8 d) still takes the exact float sums of x.
template <int R, bool kMin>
void fused_q4_q8(const uint8_t* rows, int64_t row_bytes, int64_t nb, const int8_t* xq, const float* xd,
                 const float* sums, float* dst) {
  constexpr int64_t kBytes = (kMin ? 4 : 2) + 16;
  const __m256i low = _mm256_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  __m128 off[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    off[r] = _mm_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * b));
    const __m128 sb = _mm_loadu_ps(sums + 4 * b);
    const __m256 dx = _mm256_set1_ps(xd[b]);
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = rows + r * row_bytes + b * kBytes;
      int32_t scales = 0;
      std::memcpy(&scales, blk, kMin ? 4 : 2);
      const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(scales));
      const __m256 d = _mm256_broadcastss_ps(dm);
      off[r] = _mm_fmadd_ps(kMin ? dm : _mm256_castps256_ps128(d), sb, off[r]);
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (kMin ? 4 : 2)));
      // low nibbles are elements 0..15, high nibbles 16..31: the lanes of x's block
      const __m256i codes = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), low);
      const __m256i pairs = _mm256_maddubs_epi16(codes, xv);  // |c0 x0 + c1 x1| <= 3810: no saturation
      const __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
      acc[r] = _mm256_fmadd_ps(sum, _mm256_mul_ps(d, dx), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) dst[r] = hsum(acc[r]) + (kMin ? 1.0f : -8.0f) * lane1(off[r]);
}

// x rounded to int8 per block of 32: xd[b] = max|x_b| / 127, xq = round(x / xd[b]).
// Returns false (x left to the float32 path) when x holds a NaN or an infinity.
bool quantize_x_q8(const float* x, int64_t nb, int8_t* xq, float* xd) {
  for (int64_t b = 0; b < nb; ++b) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) {
      const float v = std::fabs(x[32 * b + i]);
      if (!(v <= 3.4e38f)) return false;  // NaN or inf: no int8 scale represents it
      amax = std::max(amax, v);
    }
    const float d = amax / 127.0f;
    const float inv = d > 0.0f ? 1.0f / d : 0.0f;
    xd[b] = d;
    for (int i = 0; i < 32; ++i) xq[32 * b + i] = static_cast<int8_t>(std::nearbyint(x[32 * b + i] * inv));
  }
  return true;
}

// R rows starting at `rows` against one row of x (with its block sums); dst[R].
template <int R>
void fused_tile(const QuantWeight& w, const uint8_t* rows, const float* x, const float* sums, float* dst) {
  const int64_t B = quant_block_size(w.encoding, w.group, w.K);
  const int64_t full = w.K / B;
  switch (w.encoding) {
    case QuantEncoding::Q8_0: fused_q8_0<R>(rows, w.row_bytes, full, x, dst); break;
    case QuantEncoding::Q4_0: fused_q4<R, 32, false>(rows, w.row_bytes, full, x, sums, dst); break;
    case QuantEncoding::Q4_1: fused_q4<R, 32, true>(rows, w.row_bytes, full, x, sums, dst); break;
    case QuantEncoding::Q6_K: fused_q6_k<R>(rows, w.row_bytes, full, x, dst); break;
    case QuantEncoding::I8: fused_i8<R>(rows, w.row_bytes, w.K, x, dst); break;
    case QuantEncoding::I4:
      if (w.group == 32) fused_q4<R, 32, true>(rows, w.row_bytes, full, x, sums, dst);
      else if (w.group == 64) fused_q4<R, 64, true>(rows, w.row_bytes, full, x, sums, dst);
      else fused_q4<R, 128, true>(rows, w.row_bytes, full, x, sums, dst);
      if (w.K % B != 0) {  // the padded last block: decoded exactly, then its K % g elements
        const int64_t bytes = quant_block_bytes(w.encoding, w.group, w.K), rest = w.K % B;
        float last[128];
        for (int r = 0; r < R; ++r) {
          const uint8_t* blk = rows + r * w.row_bytes + full * bytes;
          if (w.group == 32) decode_q4_1<32>(blk, last);
          else if (w.group == 64) decode_q4_1<64>(blk, last);
          else decode_q4_1<128>(blk, last);
          dst[r] += dot(x + full * B, last, rest);
        }
      }
      break;
  }
}

// Up to this many rows of x take the fused path, more the dequantized tile: decoding
// once and applying each further row from the tile is as cheap as decoding again for
// two rows and cheaper from three on (measured on a Zen 3; a variant decoding each
// block once into registers for up to four rows of x won only ~1.3x at 2-4 rows).
constexpr int64_t kFusedMaxRows = 1;

void fused_rows(const QuantLinearArgs& a, int64_t n_begin, int64_t n_end) {
  const QuantWeight& w = a.w;
  const int64_t B = quant_block_size(w.encoding, w.group, w.K);
  const int64_t full = w.K / B;
  const bool offsets = w.encoding == QuantEncoding::Q4_0 || w.encoding == QuantEncoding::Q4_1 ||
                       w.encoding == QuantEncoding::I4;
  static thread_local std::vector<float> sums;
  if (offsets) {
    sums.resize(4 * full * a.M);
    for (int64_t m = 0; m < a.M; ++m) block_sums(a.x + m * w.K, full, B, sums.data() + 4 * full * m);
  }
  bool q8 = a.int8_activations && a.M == 1 &&
            (w.encoding == QuantEncoding::Q4_0 || w.encoding == QuantEncoding::Q4_1);
  static thread_local std::vector<int8_t> xq;
  static thread_local std::vector<float> xd;
  if (q8) {
    xq.resize(w.K);
    xd.resize(full);
    q8 = quantize_x_q8(a.x, full, xq.data(), xd.data());
  }
  if (q8) {
    const bool q4_1 = w.encoding == QuantEncoding::Q4_1;
    for (int64_t n = n_begin; n < n_end;) {
      const uint8_t* rows = w.data + n * w.row_bytes;
      const int64_t step = n_end - n >= 4 ? 4 : 1;
      prefetch_rows(w, n + 4, n + 8, n_end);
      float* out = a.out + n;
      if (step == 4 && q4_1) fused_q4_q8<4, true>(rows, w.row_bytes, full, xq.data(), xd.data(), sums.data(), out);
      else if (step == 4) fused_q4_q8<4, false>(rows, w.row_bytes, full, xq.data(), xd.data(), sums.data(), out);
      else if (q4_1) fused_q4_q8<1, true>(rows, w.row_bytes, full, xq.data(), xd.data(), sums.data(), out);
      else fused_q4_q8<1, false>(rows, w.row_bytes, full, xq.data(), xd.data(), sums.data(), out);
      n += step;
    }
    return;
  }
  for (int64_t n = n_begin; n < n_end;) {
    const uint8_t* rows = w.data + n * w.row_bytes;
    const int64_t step = n_end - n >= 4 ? 4 : 1;
    prefetch_rows(w, n + 4, n + 8, n_end);
    for (int64_t m = 0; m < a.M; ++m) {
      const float* x = a.x + m * w.K;
      const float* s = offsets ? sums.data() + 4 * full * m : nullptr;
      float* out = a.out + m * w.N + n;
      if (step == 4) fused_tile<4>(w, rows, x, s, out);
      else fused_tile<1>(w, rows, x, s, out);
    }
    n += step;
  }
}
#endif

}  // namespace

void dequantize_rows(const QuantWeight& w, float* out, int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    if ((n - n_begin) % 4 == 0) prefetch_rows(w, n + 4, n + 8, n_end);
    decode_row(w, w.data + n * w.row_bytes, out + n * w.K);
  }
}

void quantized_linear_rows(const QuantLinearArgs& a, int64_t n_begin, int64_t n_end) {
#if PYAGENT_QUANT_SIMD
  if (a.M <= kFusedMaxRows) {
    fused_rows(a, n_begin, n_end);
  } else {
    tiled_rows(a, n_begin, n_end);
  }
#else
  tiled_rows(a, n_begin, n_end);
#endif
  if (a.bias != nullptr) {
    for (int64_t m = 0; m < a.M; ++m) {
      float* row = a.out + m * a.w.N;
      for (int64_t j = n_begin; j < n_end; ++j) row[j] += a.bias[j];
    }
  }
}

}  // namespace PYAGENT_ISA
}  // namespace pyagent
