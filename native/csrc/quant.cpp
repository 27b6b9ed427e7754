// Quantized linear weights for CPU decode: exact dequantizers, and a matmul that reads
// the packed weight directly.
//
// Row layouts (little-endian; f16 is IEEE half; lo/hi are a byte's low/high nibble;
// the numpy dequantizers of the gguf package are the reference for every GGUF one):
//   Q8_0   blocks of 32:  [f16 d][int8 q x32]            w[i] = d * q[i]
//   Q4_0   blocks of 32:  [f16 d][u8 qs x16]             w[j] = d * (lo(qs[j]) - 8), w[j+16] = d * (hi(qs[j]) - 8)
//   Q4_1   blocks of 32:  [f16 d][f16 m][u8 qs x16]      w[j] = d * lo(qs[j]) + m,   w[j+16] = d * hi(qs[j]) + m
//   Q5_0   blocks of 32:  [f16 d][u32 qh][u8 qs x16]     code c[j] = lo(qs[j]) | bit j of qh << 4,
//                         c[j+16] = hi(qs[j]) | bit j+16 of qh << 4; w[i] = d * (c[i] - 16)
//   Q5_1   blocks of 32:  [f16 d][f16 m][u32 qh][u8 qs x16]  codes as Q5_0; w[i] = d * c[i] + m
//   IQ4_NL blocks of 32:  [f16 d][u8 qs x16]             w[j] = d * kv[lo(qs[j])], w[j+16] = d * kv[hi(qs[j])],
//                         kv the 16 values of kIQ4NLValues
//   I4/g   blocks of g:   Q4_1 with g/2 code bytes (w[j], w[j+g/2]); the last block is
//                         stored whole and its elements from K on are padding
//   Q2_K   blocks of 256: [u8 sc x16][u8 qs x64][f16 d][f16 dmin]; element
//                         e = 128h + 32s + l (h < 2, s < 4, l < 32) has the code
//                         c = (qs[32h + l] >> 2s) & 3 in sub-block j = e / 16, and
//                         w[e] = (d * lo(sc[j])) * c - dmin * hi(sc[j])
//   Q3_K   blocks of 256: [u8 hmask x32][u8 qs x64][u8 scales x12][f16 d]; element e as
//                         Q2_K's, its code the 2-bit one less 4 unless bit 4h + s of
//                         hmask[l] is set; w[e] = (d * (scale[e / 16] - 32)) * code, the
//                         sixteen 6-bit scales packed as q3_scales_raw reads them
//   Q4_K   blocks of 256: [f16 d][f16 dmin][u8 scales x12][u8 qs x128]; sub-block
//                         j = 2c + t (c < 4, t < 2) is elements 32j + l (l < 32) with the code
//                         (qs[32c + l] >> 4t) & 15, and w = (d * sc[j]) * code - dmin * mn[j],
//                         eight 6-bit scales sc and mins mn packed as k_scale_min reads them
//   Q5_K   blocks of 256: [f16 d][f16 dmin][u8 scales x12][u8 qh x32][u8 qs x128]; as Q4_K,
//                         with bit j of qh[l] as the code's bit 4
//   Q6_K   blocks of 256: [u8 ql x128][u8 qh x64][int8 sc x16][f16 d]; element
//                         e = 32 * (4h + j) + l (h < 2, j < 4, l < 32) has the 6-bit code
//                         c = (ql[64h + 32(j&1) + l] >> 4(j>>1)) & 15 | ((qh[32h + l] >> 2j) & 3) << 4
//                         and w[e] = (d * sc[e / 16]) * (c - 32)
//   I8     one per row:   [f32 scale][int8 q xK]         w[k] = scale * q[k]
//
// Dequantizing reproduces the gguf package's numpy code bit for bit: the same float32
// operations in the same order (d * q then + m; (d * sc) * q; (d * sc) * q - dmin * m).
// CMake compiles this file with -ffp-contract=off so the AVX2+FMA build cannot fuse a
// multiply and an add (the products here are exact, at most an 11-bit half times a
// 6-bit scale times a code of at most 8 bits, so a fused result would agree anyway; the
// flag keeps that from being a coincidence).
//
// The matmul of one row of x (decode) never forms the float weights. Per block (or
// sub-block: 16 or 32 elements of a K-quant) it sums code * x in vector lanes and folds
// the scale in with one FMA; the offsets (m of Q4_1/Q5_1/I4, Q4_0's -8, the K-quants'
// dmin * mn) multiply the (sub-)block's sum of x, computed once per call and shared by
// every output row. Codes are built either 8 at a time in int32 lanes from bytes or 32
// at a time in byte lanes and then widened (the cheaper per encoding; see fused_32 and
// q45_chunk). Four output rows go together: Q4_0/Q4_1/Q8_0/I4/I8 load each block of x
// once for the four rows and run four accumulator chains side by side; the others go
// row by row with x in L1. The next four rows are prefetched meanwhile. With more rows
// of x, each four-row tile is dequantized exactly into an L1 scratch once and the rows
// of x are applied to it two at a time (dot4x2). Everything is float32: x is never
// quantized.
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

inline uint32_t load_u32(const uint8_t* p) {
  return p[0] | (p[1] << 8) | (p[2] << 16) | (static_cast<uint32_t>(p[3]) << 24);
}

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

// IQ4_NL's 16 code values (gguf's IQ4_NL.kvalues).
alignas(16) constexpr int8_t kIQ4NLValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                 1,    13,   25,  38,  53,  69,  89,  113};

// The 8 six-bit scales and 8 six-bit mins of a Q4_K / Q5_K block from its 12 packed
// bytes s (gguf's Q4_K.get_scale_min): bytes 0-3 hold scales 0-3 in their low six
// bits, 4-7 mins 0-3; scales and mins 4-7 take their low four bits from bytes 8-11
// (scale: low nibble, min: high nibble) and their top two from the top two bits of
// bytes 0-3 (scales) and 4-7 (mins). Done on 32-bit words, four bytes at a time
// (shifting a word lets bits cross from the next byte; the masks drop them).
inline void k_scale_min(const uint8_t* s, uint64_t& sc, uint64_t& mn) {
  const uint32_t w0 = load_u32(s), w1 = load_u32(s + 4), w2 = load_u32(s + 8);
  const uint32_t sc_lo = w0 & 0x3f3f3f3fu, mn_lo = w1 & 0x3f3f3f3fu;
  const uint32_t sc_hi = (w2 & 0x0f0f0f0fu) | ((w0 >> 2) & 0x30303030u);
  const uint32_t mn_hi = ((w2 >> 4) & 0x0f0f0f0fu) | ((w1 >> 2) & 0x30303030u);
  sc = sc_lo | static_cast<uint64_t>(sc_hi) << 32;  // byte j: scale j (little-endian)
  mn = mn_lo | static_cast<uint64_t>(mn_hi) << 32;
}

// The 16 six-bit scales of a Q3_K block (before gguf's "- 32") from its 12 packed
// bytes: scale i has low nibble i < 8 ? lo(s[i]) : hi(s[i - 8]) and top two bits
// (s[8 + i % 4] >> 2 (i / 4)) & 3. lo/hi: bytes 0-7 and 8-15 of the result.
inline void q3_scales_raw(const uint8_t* s, uint64_t& lo, uint64_t& hi) {
  const uint32_t w0 = load_u32(s), w1 = load_u32(s + 4), w2 = load_u32(s + 8);
  const uint32_t a = (w0 & 0x0f0f0f0fu) | ((w2 & 0x03030303u) << 4);
  const uint32_t b = (w1 & 0x0f0f0f0fu) | (((w2 >> 2) & 0x03030303u) << 4);
  const uint32_t c = ((w0 >> 4) & 0x0f0f0f0fu) | (((w2 >> 4) & 0x03030303u) << 4);
  const uint32_t d = ((w1 >> 4) & 0x0f0f0f0fu) | (((w2 >> 6) & 0x03030303u) << 4);
  lo = a | static_cast<uint64_t>(b) << 32;
  hi = c | static_cast<uint64_t>(d) << 32;
}

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

// The 32 nibbles of 16 bytes as bytes in element order: the low nibbles (elements
// 0-15) in the lower 128-bit lane, the high ones (16-31) in the upper. (A broadcast
// load and a per-lane shift: no cross-lane shuffle.)
inline __m256i nibbles32(const uint8_t* p) {
  const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_srlv_epi64(q, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0f));
}

// 32 int8 lanes as four vectors of 8 floats, in order, through a 32-byte buffer: the
// sign-extending loads cost one shuffle-port operation each where widening in
// registers (widen_i8x32) takes seven for the four; the loads are forwarded from the
// store.
inline void widen_i8x32_via(__m256i q, int8_t* buf, __m256 f[4]) {
  _mm256_store_si256(reinterpret_cast<__m256i*>(buf), q);
  // Opaque to the compiler, which would otherwise forward the store in registers.
  asm("" : "+m"(*reinterpret_cast<int8_t(*)[32]>(buf)));
  for (int c = 0; c < 4; ++c) f[c] = to_float(load_i8x8(reinterpret_cast<const uint8_t*>(buf) + 8 * c));
}

// Byte e = 0xff where bit e of `bits` is set, else 0.
inline __m256i bits_to_bytes(uint32_t bits) {
  const __m256i spread = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(bits)), spread);
  return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

// The 32 codes of a Q5_0 block minus 16, as int8 lanes: a clear high bit makes the
// nibble n into n - 16, which is n | 0xf0 in two's complement.
inline __m256i q5_0_codes(const uint8_t* blk) {
  const __m256i high = bits_to_bytes(load_u32(blk + 2));
  return _mm256_or_si256(nibbles32(blk + 6), _mm256_andnot_si256(high, _mm256_set1_epi8(static_cast<char>(0xf0))));
}

// The 32 codes (0-31) of a Q5_1 block as int8 lanes.
inline __m256i q5_1_codes(const uint8_t* blk) {
  const __m256i high = bits_to_bytes(load_u32(blk + 4));
  return _mm256_or_si256(nibbles32(blk + 8), _mm256_and_si256(high, _mm256_set1_epi8(0x10)));
}

// The 32 values kvalues[nibble] of an IQ4_NL block as int8 lanes.
inline __m256i iq4_nl_values(const uint8_t* blk) {
  const __m256i table =
      _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4NLValues)));
  return _mm256_shuffle_epi8(table, nibbles32(blk + 2));
}

void decode_q5_0(const uint8_t* blk, float* dst) {
  const __m256 d = _mm256_set1_ps(load_f16(blk));
  __m256 f[4];
  widen_i8x32(q5_0_codes(blk), f);
  for (int c = 0; c < 4; ++c) _mm256_storeu_ps(dst + 8 * c, _mm256_mul_ps(d, f[c]));
}

void decode_q5_1(const uint8_t* blk, float* dst) {
  const __m256 d = _mm256_set1_ps(load_f16(blk)), m = _mm256_set1_ps(load_f16(blk + 2));
  __m256 f[4];
  widen_i8x32(q5_1_codes(blk), f);
  for (int c = 0; c < 4; ++c) _mm256_storeu_ps(dst + 8 * c, _mm256_add_ps(_mm256_mul_ps(d, f[c]), m));
}

void decode_iq4_nl(const uint8_t* blk, float* dst) {
  const __m256 d = _mm256_set1_ps(load_f16(blk));
  __m256 f[4];
  widen_i8x32(iq4_nl_values(blk), f);
  for (int c = 0; c < 4; ++c) _mm256_storeu_ps(dst + 8 * c, _mm256_mul_ps(d, f[c]));
}

// Q4_K / Q5_K: ds = d * sc[j], dm = dmin * m[j] for the block's 8 sub-blocks.
inline void k_scales(const uint8_t* blk, __m256& ds, __m256& dm) {
  uint64_t sc, mn;
  k_scale_min(blk + 4, sc, mn);
  const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int32_t>(load_u32(blk))));  // [d, dmin, 0, 0]
  ds = _mm256_mul_ps(_mm256_broadcastss_ps(dd), to_float(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(sc)))));
  dm = _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dd)),
                     to_float(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(mn)))));
}

// Bit J of each int32 lane moved to bit Pos, the rest cleared.
template <int J, int Pos>
inline __m256i bit_to(__m256i v) {
  const __m256i moved = J < Pos ? _mm256_slli_epi32(v, Pos - J) : J > Pos ? _mm256_srli_epi32(v, J - Pos) : v;
  return _mm256_and_si256(moved, _mm256_set1_epi32(1 << Pos));
}

// Q4_K (kQ5 false) / Q5_K: sub-block j = 2c + t is the low (t = 0) or high nibbles of
// qs[32c .. 32c + 32), with Q5_K's bit j of qh[0 .. 32) as bit 4.
template <bool kQ5>
void decode_q45_k(const uint8_t* blk, float* dst) {
  alignas(32) float ds[8], dm[8];
  __m256 dsv, dmv;
  k_scales(blk, dsv, dmv);
  _mm256_store_ps(ds, dsv);
  _mm256_store_ps(dm, dmv);
  const uint8_t* qs = blk + (kQ5 ? 48 : 16);
  const __m256i low = _mm256_set1_epi32(15);
  for (int c = 0; c < 4; ++c) {
    const __m256 s0 = _mm256_broadcast_ss(ds + 2 * c), m0 = _mm256_broadcast_ss(dm + 2 * c);
    const __m256 s1 = _mm256_broadcast_ss(ds + 2 * c + 1), m1 = _mm256_broadcast_ss(dm + 2 * c + 1);
    for (int i = 0; i < 4; ++i) {
      const __m256i v = load_u8x8(qs + 32 * c + 8 * i);
      __m256i lo = _mm256_and_si256(v, low), hi = _mm256_srli_epi32(v, 4);
      if (kQ5) {
        const __m256i h = _mm256_srlv_epi32(load_u8x8(blk + 16 + 8 * i), _mm256_set1_epi32(2 * c));
        lo = _mm256_or_si256(lo, bit_to<0, 4>(h));
        hi = _mm256_or_si256(hi, bit_to<1, 4>(h));
      }
      _mm256_storeu_ps(dst + 64 * c + 8 * i, _mm256_sub_ps(_mm256_mul_ps(s0, to_float(lo)), m0));
      _mm256_storeu_ps(dst + 64 * c + 32 + 8 * i, _mm256_sub_ps(_mm256_mul_ps(s1, to_float(hi)), m1));
    }
  }
}

// Q2_K: dl = d * (scales[j] & 15) into dl[16], ml = dmin * (scales[j] >> 4) for its 16
// sub-blocks (ml0: 0-7, ml1: 8-15).
inline void q2_scales(const uint8_t* blk, float* dl, __m256& ml0, __m256& ml1) {
  const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk));
  const __m128i low = _mm_and_si128(sc, _mm_set1_epi8(0x0f));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(sc, 4), _mm_set1_epi8(0x0f));
  const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int32_t>(load_u32(blk + 80))));
  const __m256 d = _mm256_broadcastss_ps(dd), dmin = _mm256_broadcastss_ps(_mm_movehdup_ps(dd));
  _mm256_store_ps(dl, _mm256_mul_ps(d, to_float(_mm256_cvtepu8_epi32(low))));
  _mm256_store_ps(dl + 8, _mm256_mul_ps(d, to_float(_mm256_cvtepu8_epi32(_mm_srli_si128(low, 8)))));
  ml0 = _mm256_mul_ps(dmin, to_float(_mm256_cvtepu8_epi32(high)));
  ml1 = _mm256_mul_ps(dmin, to_float(_mm256_cvtepu8_epi32(_mm_srli_si128(high, 8))));
}

// Q2_K element 128h + 32s + l is (qs[32h + l] >> 2s) & 3, in sub-block 8h + 2s + l / 16.
void decode_q2_k(const uint8_t* blk, float* dst) {
  alignas(32) float dl[16], ml[16];
  __m256 ml0, ml1;
  q2_scales(blk, dl, ml0, ml1);
  _mm256_store_ps(ml, ml0);
  _mm256_store_ps(ml + 8, ml1);
  const __m256i three = _mm256_set1_epi32(3);
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 4; ++i) {
      const __m256i v = load_u8x8(blk + 16 + 32 * h + 8 * i);
      for (int s = 0; s < 4; ++s) {
        const int j = 8 * h + 2 * s + i / 2;
        const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_set1_epi32(2 * s)), three);
        const __m256 w = _mm256_sub_ps(_mm256_mul_ps(_mm256_broadcast_ss(dl + j), to_float(q)), _mm256_broadcast_ss(ml + j));
        _mm256_storeu_ps(dst + 128 * h + 32 * s + 8 * i, w);
      }
    }
  }
}

// Q3_K: dl = d * (scale - 32) for its 16 sub-blocks.
inline void q3_scales(const uint8_t* blk, float* dl) {
  uint64_t lo, hi;
  q3_scales_raw(blk + 96, lo, hi);
  const __m128i sc = _mm_sub_epi8(_mm_set_epi64x(static_cast<int64_t>(hi), static_cast<int64_t>(lo)), _mm_set1_epi8(32));
  const __m256 d = _mm256_set1_ps(load_f16(blk + 108));
  _mm256_store_ps(dl, _mm256_mul_ps(d, to_float(_mm256_cvtepi8_epi32(sc))));
  _mm256_store_ps(dl + 8, _mm256_mul_ps(d, to_float(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
}

// Q3_K element 128h + 32s + l has the code (qs[32h + l] >> 2s) & 3, less 4 unless bit
// 4h + s of hmask[l] is set; it is in sub-block 8h + 2s + l / 16.
void decode_q3_k(const uint8_t* blk, float* dst) {
  alignas(32) float dl[16];
  q3_scales(blk, dl);
  const __m256i three = _mm256_set1_epi32(3), four = _mm256_set1_epi32(4);
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 4; ++i) {
      const __m256i v = load_u8x8(blk + 32 + 32 * h + 8 * i);
      const __m256i hm = load_u8x8(blk + 8 * i);
      for (int s = 0; s < 4; ++s) {
        const int j = 8 * h + 2 * s + i / 2;
        const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_set1_epi32(2 * s)), three);
        const __m256i hb = _mm256_and_si256(_mm256_srlv_epi32(hm, _mm256_set1_epi32(4 * h + s)), _mm256_set1_epi32(1));
        const __m256i q = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hb, 2)), four);
        _mm256_storeu_ps(dst + 128 * h + 32 * s + 8 * i, _mm256_mul_ps(_mm256_broadcast_ss(dl + j), to_float(q)));
      }
    }
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

void decode_q5_0(const uint8_t* blk, float* dst) {
  const float d = load_f16(blk);
  const uint32_t qh = load_u32(blk + 2);
  const uint8_t* qs = blk + 6;
  for (int j = 0; j < 16; ++j) {
    const int lo = (qs[j] & 15) | ((qh >> j) & 1) << 4, hi = (qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4;
    dst[j] = d * static_cast<float>(lo - 16);
    dst[j + 16] = d * static_cast<float>(hi - 16);
  }
}

void decode_q5_1(const uint8_t* blk, float* dst) {
  const float d = load_f16(blk), m = load_f16(blk + 2);
  const uint32_t qh = load_u32(blk + 4);
  const uint8_t* qs = blk + 8;
  for (int j = 0; j < 16; ++j) {
    const int lo = (qs[j] & 15) | ((qh >> j) & 1) << 4, hi = (qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4;
    dst[j] = d * static_cast<float>(lo) + m;
    dst[j + 16] = d * static_cast<float>(hi) + m;
  }
}

void decode_iq4_nl(const uint8_t* blk, float* dst) {
  const float d = load_f16(blk);
  const uint8_t* qs = blk + 2;
  for (int j = 0; j < 16; ++j) {
    dst[j] = d * static_cast<float>(kIQ4NLValues[qs[j] & 15]);
    dst[j + 16] = d * static_cast<float>(kIQ4NLValues[qs[j] >> 4]);
  }
}

// Q4_K / Q5_K (layouts at the top).
template <bool kQ5>
void decode_q45_k(const uint8_t* blk, float* dst) {
  const float d = load_f16(blk), dmin = load_f16(blk + 2);
  uint64_t sc, mn;
  k_scale_min(blk + 4, sc, mn);
  const uint8_t* qh = blk + 16;
  const uint8_t* qs = blk + (kQ5 ? 48 : 16);
  for (int j = 0; j < 8; ++j) {
    const float dl = d * static_cast<float>((sc >> (8 * j)) & 0xff);
    const float ml = dmin * static_cast<float>((mn >> (8 * j)) & 0xff);
    for (int l = 0; l < 32; ++l) {
      int q = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 15;
      if (kQ5) q |= ((qh[l] >> j) & 1) << 4;
      dst[32 * j + l] = dl * static_cast<float>(q) - ml;
    }
  }
}

void decode_q2_k(const uint8_t* blk, float* dst) {
  const uint8_t* scales = blk;
  const uint8_t* qs = blk + 16;
  const float d = load_f16(blk + 80), dmin = load_f16(blk + 82);
  for (int j = 0; j < 16; ++j) {  // sub-block j = 8h + 2s + t: elements 128h + 32s + 16t + l
    const int h = j / 8, s = (j / 2) % 4, t = j % 2;
    const float dl = d * static_cast<float>(scales[j] & 15), ml = dmin * static_cast<float>(scales[j] >> 4);
    for (int l = 0; l < 16; ++l) {
      const int q = (qs[32 * h + 16 * t + l] >> (2 * s)) & 3;
      dst[16 * j + l] = dl * static_cast<float>(q) - ml;
    }
  }
}

void decode_q3_k(const uint8_t* blk, float* dst) {
  const uint8_t* hmask = blk;
  const uint8_t* qs = blk + 32;
  const float d = load_f16(blk + 108);
  uint64_t lo, hi;
  q3_scales_raw(blk + 96, lo, hi);
  for (int j = 0; j < 16; ++j) {  // as Q2_K's; the high bit is bit 4h + s of hmask[16t + l]
    const int h = j / 8, s = (j / 2) % 4, t = j % 2;
    const int raw = static_cast<int>(((j < 8 ? lo : hi) >> (8 * (j % 8))) & 0xff);
    const float dl = d * static_cast<float>(raw - 32);
    for (int l = 0; l < 16; ++l) {
      const int ll = 16 * t + l;
      const int q = ((qs[32 * h + ll] >> (2 * s)) & 3) - (((hmask[ll] >> (4 * h + s)) & 1) ? 0 : 4);
      dst[16 * j + l] = dl * static_cast<float>(q);
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
    case QuantEncoding::Q5_0: decode_blocks<32, 22, decode_q5_0>(row, w.K, dst); break;
    case QuantEncoding::Q5_1: decode_blocks<32, 24, decode_q5_1>(row, w.K, dst); break;
    case QuantEncoding::IQ4_NL: decode_blocks<32, 18, decode_iq4_nl>(row, w.K, dst); break;
    case QuantEncoding::Q2_K: decode_blocks<256, 84, decode_q2_k>(row, w.K, dst); break;
    case QuantEncoding::Q3_K: decode_blocks<256, 110, decode_q3_k>(row, w.K, dst); break;
    case QuantEncoding::Q4_K: decode_blocks<256, 144, decode_q45_k<false>>(row, w.K, dst); break;
    case QuantEncoding::Q5_K: decode_blocks<256, 176, decode_q45_k<true>>(row, w.K, dst); break;
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
    if (kHaveDotMr4 && rows == 4) {  // the AVX-512 build: rows of x four at a time, any K
      dot_rows4(a.x, a.M, K, t, K, K, a.out + n, N);
      m = a.M;
    } else if (kHaveDot4 && rows == 4 && K8 > 0) {
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

// Q4_0 / Q4_1 against x rounded to int8 per block (QuantLinearArgs::activations Int8):
// the 32 codes (u8) times the 32 int8 x values in two instructions (pairs summed to
// int16, then to int32), the block's d * dx folded in with one FMA. The offset term
// (m, or Q4_0's -8 d) takes the sums of the rounded x (see fused_rows).
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

// Sums of x over each `width` elements (the sub-blocks of Q4_K, Q5_K and Q2_K).
void sub_sums(const float* x, int64_t count, int64_t width, float* sums) {
  for (int64_t j = 0; j < count; ++j) {
    __m256 s = _mm256_loadu_ps(x + j * width);
    for (int64_t i = 8; i < width; i += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(x + j * width + i));
    sums[j] = hsum(s);
  }
}

// Q5_0, Q5_1 and IQ4_NL: blocks of 32 whose codes are built as 32 bytes at once, then
// widened to floats. Q5_0's codes less 16 and IQ4_NL's values are signed, so their
// blocks contribute d * sum(value * x); Q5_1's d * sum(code * x) + m * S_b, as Q4_1.
enum class Kind32 { Q5_0, Q5_1, IQ4_NL };

template <int R, Kind32 kKind>
void fused_32(const uint8_t* rows, int64_t row_bytes, int64_t nb, const float* x, const float* sums, float* dst) {
  constexpr bool kMin = kKind == Kind32::Q5_1;
  constexpr int64_t kBytes = kKind == Kind32::Q5_0 ? 22 : kKind == Kind32::Q5_1 ? 24 : 18;
  alignas(32) int8_t buf[32];
  // Row by row, as fused_q6_k (x block-outer, the compiler keeps x in registers for the
  // R rows and spills the accumulators instead).
  for (int r = 0; r < R; ++r) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    __m128 off = _mm_setzero_ps();  // Q5_1, lane 1: sum of m * S_b
    const uint8_t* row = rows + r * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + 32 * b;
      const uint8_t* blk = row + b * kBytes;
      int32_t scales = 0;
      std::memcpy(&scales, blk, kMin ? 4 : 2);
      const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(scales));  // [d, m or 0, 0, 0]
      if (kMin) off = _mm_fmadd_ps(dm, _mm_loadu_ps(sums + 4 * b), off);
      const __m256i codes = kKind == Kind32::Q5_0 ? q5_0_codes(blk) : kKind == Kind32::Q5_1 ? q5_1_codes(blk)
                                                                                           : iq4_nl_values(blk);
      __m256 f[4];
      widen_i8x32_via(codes, buf, f);
      const __m256 s0 = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xb + 8), _mm256_mul_ps(f[0], _mm256_loadu_ps(xb)));
      const __m256 s1 = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xb + 24), _mm256_mul_ps(f[2], _mm256_loadu_ps(xb + 16)));
      const __m256 d = _mm256_broadcastss_ps(dm);
      acc0 = _mm256_fmadd_ps(s0, d, acc0);
      acc1 = _mm256_fmadd_ps(s1, d, acc1);
    }
    const float sum = hsum(_mm256_add_ps(acc0, acc1));
    dst[r] = kMin ? sum + lane1(off) : sum;
  }
}

// Bit J of each byte moved to bit Pos, the rest cleared (shifts of 16-bit lanes: bits
// crossing from the neighbouring byte are masked off).
template <int J, int Pos>
inline __m256i byte_bit_to(__m256i v) {
  const __m256i moved = J < Pos ? _mm256_slli_epi16(v, Pos - J) : J > Pos ? _mm256_srli_epi16(v, J - Pos) : v;
  return _mm256_and_si256(moved, _mm256_set1_epi8(static_cast<char>(1 << Pos)));
}

// Q4_K / Q5_K: sub-block j (32 elements) contributes (d sc_j) * sum(code * x) -
// (dmin m_j) * S_j; the 8 mins of a block meet the 8 sums S_j of x in one FMA.
// Q4_K takes its codes 8 at a time from bytes into int32 lanes (a byte gives two: its
// nibbles are in sub-blocks 2c and 2c + 1). Q5_K builds the 64 codes of a 32-byte chunk
// of qs as bytes (nibble | bit j of qh[0 .. 32) as bit 4), then widens them through a
// buffer: the fifth bit costs a few byte operations per 32 codes where int32 lanes
// would take three per 8. One chunk C: sub-blocks 2C and 2C + 1.
template <int C, bool kQ5>
inline void q45_chunk(const uint8_t* qs, __m256i qh, uint8_t* buf, const float* xb, const float* ds, __m256& acc0,
                      __m256& acc1) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  if (kQ5) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * C));
    const __m256i nib = _mm256_set1_epi8(0x0f);
    const __m256i lo = _mm256_or_si256(_mm256_and_si256(q, nib), byte_bit_to<2 * C, 4>(qh));
    const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), nib), byte_bit_to<2 * C + 1, 4>(qh));
    _mm256_store_si256(reinterpret_cast<__m256i*>(buf), lo);
    _mm256_store_si256(reinterpret_cast<__m256i*>(buf + 32), hi);
    asm("" : "+m"(*reinterpret_cast<uint8_t(*)[64]>(buf)));  // keep the loads below (see widen_i8x32_via)
    for (int i = 0; i < 4; ++i) {
      s0 = _mm256_fmadd_ps(to_float(load_u8x8(buf + 8 * i)), _mm256_loadu_ps(xb + 64 * C + 8 * i), s0);
      s1 = _mm256_fmadd_ps(to_float(load_u8x8(buf + 32 + 8 * i)), _mm256_loadu_ps(xb + 64 * C + 32 + 8 * i), s1);
    }
  } else {
    const __m256i low = _mm256_set1_epi32(15);
    for (int i = 0; i < 4; ++i) {
      const __m256i v = load_u8x8(qs + 32 * C + 8 * i);
      s0 = _mm256_fmadd_ps(to_float(_mm256_and_si256(v, low)), _mm256_loadu_ps(xb + 64 * C + 8 * i), s0);
      s1 = _mm256_fmadd_ps(to_float(_mm256_srli_epi32(v, 4)), _mm256_loadu_ps(xb + 64 * C + 32 + 8 * i), s1);
    }
  }
  acc0 = _mm256_fmadd_ps(s0, _mm256_broadcast_ss(ds + 2 * C), acc0);
  acc1 = _mm256_fmadd_ps(s1, _mm256_broadcast_ss(ds + 2 * C + 1), acc1);
}

template <int R, bool kQ5>
void fused_q45_k(const uint8_t* rows, int64_t row_bytes, int64_t nb, const float* x, const float* sums, float* dst) {
  constexpr int64_t kBytes = kQ5 ? 176 : 144;
  alignas(32) float ds[8];
  alignas(32) uint8_t buf[64];
  // Row by row, as fused_q6_k: a block's x stays in L1 for the next rows.
  for (int r = 0; r < R; ++r) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), off = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = rows + r * row_bytes + kBytes * b;
      __m256 dsv, dmv;
      k_scales(blk, dsv, dmv);
      _mm256_store_ps(ds, dsv);
      off = _mm256_fmadd_ps(dmv, _mm256_loadu_ps(sums + 8 * b), off);
      const __m256i qh = kQ5 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)) : _mm256_setzero_si256();
      const uint8_t* qs = blk + (kQ5 ? 48 : 16);
      const float* xb = x + 256 * b;
      q45_chunk<0, kQ5>(qs, qh, buf, xb, ds, acc0, acc1);
      q45_chunk<1, kQ5>(qs, qh, buf, xb, ds, acc0, acc1);
      q45_chunk<2, kQ5>(qs, qh, buf, xb, ds, acc0, acc1);
      q45_chunk<3, kQ5>(qs, qh, buf, xb, ds, acc0, acc1);
    }
    dst[r] = hsum(_mm256_add_ps(acc0, acc1)) - hsum(off);
  }
}

// Q2_K / Q3_K: the 32 elements 128H + 32S + [0, 32) are sub-blocks 8H + 2S and
// 8H + 2S + 1 (16 each). Q2_K: v[i] holds qs[32H + 8i ..] as int32 lanes, the code
// (v >> 2S) & 3. Q3_K builds its 32 signed codes as bytes from qs[32H ..] (q) and
// hmask (hm): the 2-bit code less 4 unless bit 4H + S of hmask is set; then widens them
// through buf.
template <int H, int S, bool kQ3>
inline void k23_group(const __m256i* v, __m256i q, __m256i hm, uint8_t* buf, const float* x, const float* dl,
                      __m256& acc0, __m256& acc1) {
  __m256 f[4];
  if (kQ3) {
    const __m256i lo = _mm256_and_si256(S == 0 ? q : _mm256_srli_epi16(q, 2 * S), _mm256_set1_epi8(3));
    const __m256i codes = _mm256_sub_epi8(_mm256_or_si256(lo, byte_bit_to<4 * H + S, 2>(hm)), _mm256_set1_epi8(4));
    widen_i8x32_via(codes, reinterpret_cast<int8_t*>(buf), f);
  } else {
    const __m256i three = _mm256_set1_epi32(3);
    for (int i = 0; i < 4; ++i) f[i] = to_float(_mm256_and_si256(S == 0 ? v[i] : _mm256_srli_epi32(v[i], 2 * S), three));
  }
  const __m256 s0 = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(x + 8), _mm256_mul_ps(f[0], _mm256_loadu_ps(x)));
  const __m256 s1 = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(x + 24), _mm256_mul_ps(f[2], _mm256_loadu_ps(x + 16)));
  acc0 = _mm256_fmadd_ps(s0, _mm256_broadcast_ss(dl), acc0);
  acc1 = _mm256_fmadd_ps(s1, _mm256_broadcast_ss(dl + 1), acc1);
}

template <int H, bool kQ3>
inline void k23_half(const uint8_t* qs, __m256i hm, uint8_t* buf, const float* xb, const float* dl, __m256& acc0,
                     __m256& acc1) {
  __m256i v[4], q = _mm256_setzero_si256();
  if (kQ3) {
    q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * H));
  } else {
    for (int i = 0; i < 4; ++i) v[i] = load_u8x8(qs + 32 * H + 8 * i);
  }
  const float* xh = xb + 128 * H;
  const float* dh = dl + 8 * H;
  k23_group<H, 0, kQ3>(v, q, hm, buf, xh, dh, acc0, acc1);
  k23_group<H, 1, kQ3>(v, q, hm, buf, xh + 32, dh + 2, acc0, acc1);
  k23_group<H, 2, kQ3>(v, q, hm, buf, xh + 64, dh + 4, acc0, acc1);
  k23_group<H, 3, kQ3>(v, q, hm, buf, xh + 96, dh + 6, acc0, acc1);
}

// Q2_K: sub-block j (16 elements) contributes dl_j * sum(code * x) - ml_j * S_j.
template <int R>
void fused_q2_k(const uint8_t* rows, int64_t row_bytes, int64_t nb, const float* x, const float* sums, float* dst) {
  alignas(32) float dl[16];
  for (int r = 0; r < R; ++r) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), off = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = rows + r * row_bytes + 84 * b;
      __m256 ml0, ml1;
      q2_scales(blk, dl, ml0, ml1);
      off = _mm256_fmadd_ps(ml0, _mm256_loadu_ps(sums + 16 * b), off);
      off = _mm256_fmadd_ps(ml1, _mm256_loadu_ps(sums + 16 * b + 8), off);
      const float* xb = x + 256 * b;
      k23_half<0, false>(blk + 16, _mm256_setzero_si256(), nullptr, xb, dl, acc0, acc1);
      k23_half<1, false>(blk + 16, _mm256_setzero_si256(), nullptr, xb, dl, acc0, acc1);
    }
    dst[r] = hsum(_mm256_add_ps(acc0, acc1)) - hsum(off);
  }
}

// Q3_K: sub-block j contributes (d (scale_j - 32)) * sum(code * x), codes signed.
template <int R>
void fused_q3_k(const uint8_t* rows, int64_t row_bytes, int64_t nb, const float* x, float* dst) {
  alignas(32) float dl[16];
  alignas(32) uint8_t buf[32];
  for (int r = 0; r < R; ++r) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = rows + r * row_bytes + 110 * b;
      q3_scales(blk, dl);
      const __m256i hm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk));
      const float* xb = x + 256 * b;
      k23_half<0, true>(blk + 32, hm, buf, xb, dl, acc0, acc1);
      k23_half<1, true>(blk + 32, hm, buf, xb, dl, acc0, acc1);
    }
    dst[r] = hsum(_mm256_add_ps(acc0, acc1));
  }
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
    case QuantEncoding::Q5_0: fused_32<R, Kind32::Q5_0>(rows, w.row_bytes, full, x, sums, dst); break;
    case QuantEncoding::Q5_1: fused_32<R, Kind32::Q5_1>(rows, w.row_bytes, full, x, sums, dst); break;
    case QuantEncoding::IQ4_NL: fused_32<R, Kind32::IQ4_NL>(rows, w.row_bytes, full, x, sums, dst); break;
    case QuantEncoding::Q2_K: fused_q2_k<R>(rows, w.row_bytes, full, x, sums, dst); break;
    case QuantEncoding::Q3_K: fused_q3_k<R>(rows, w.row_bytes, full, x, dst); break;
    case QuantEncoding::Q4_K: fused_q45_k<R, false>(rows, w.row_bytes, full, x, sums, dst); break;
    case QuantEncoding::Q5_K: fused_q45_k<R, true>(rows, w.row_bytes, full, x, sums, dst); break;
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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// ---------------------------------------------------------------------------------
// Integer GEMM against x rounded to int8 per block of 32 (QuantLinearArgs::activations
// Int8, several rows of x; Int16, any rows, as two int8 rows each; AVX-512 VNNI build),
// for Q4_0, Q4_1, Q8_0,
// Q5_0, Q5_1, IQ4_NL, Q4_K, Q5_K and Q6_K.
//
// Every encoding is read as units of 32 elements (one block of x) with unsigned codes
// u (0..255) and, per half (H = 2: Q6_K's sub-blocks of 16) or whole unit (H = 1), a
// scale s and an offset o, so that w = s * u + o exactly (Q8_0, IQ4_NL: u = value + 128,
// o = -128 s, taken in integers). Sixteen weight rows at a time are laid out in a
// scratch in VNNI order: for unit b, eight 64-byte vectors, vector j holding in lane r
// the codes 4j..4j+3 of row r. One vpdpbusd then adds, in each lane, four codes times
// four int8 values of x broadcast to every lane, so after eight of them lane r holds
// row r's integer dot product over the unit (four per half), and no horizontal sum is
// needed: per unit (half), row of x m and weight row r,
//     out[m, r] += (s_r * dx_m) * sum(u * xq) + o_r * dx_m * sum(xq)
// which is exactly the dequantized weight times the dequantized x (as fused_q4_q8's).
// Up to eight rows of x share each unit's code vectors in registers.

constexpr int kVnniRows = 16;      // weight rows per tile (one 16-lane vector)
constexpr int64_t kVnniMinRows = 2;  // fewer rows of x take the one-row path
// Encodings whose tiles are decoded into units first pay more per tile: below this
// many rows of x the float tile is as fast (Q6_K: 0.8x at 4 rows, 1.6x at 16).
constexpr int64_t kVnniMinRowsDecoded = 8;

inline bool gathered_directly(QuantEncoding e) {
  return e == QuantEncoding::Q4_0 || e == QuantEncoding::Q4_1 || e == QuantEncoding::Q8_0;
}

struct VnniTile {
  std::vector<uint8_t> codes;  // [units][8][16][4]
  std::vector<float> s, o;     // [units][H][16]
};

// How an encoding reads as units: halves per unit with their own scale (H), units per
// stored block, and whether its codes are offset by 128 (o = -128 s, in integers).
struct UnitForm {
  int H;
  int per_block;
  bool q128;
};

inline bool unit_form(QuantEncoding e, UnitForm& f) {
  switch (e) {
    case QuantEncoding::Q4_0:
    case QuantEncoding::Q4_1:
    case QuantEncoding::Q5_0:
    case QuantEncoding::Q5_1: f = {1, 1, false}; return true;
    case QuantEncoding::Q8_0:
    case QuantEncoding::IQ4_NL: f = {1, 1, true}; return true;
    case QuantEncoding::Q4_K:
    case QuantEncoding::Q5_K: f = {1, 8, false}; return true;
    case QuantEncoding::Q6_K: f = {2, 8, false}; return true;
    default: return false;
  }
}

// One stored block of one row as units: codes[32 * u + i], s/o[H * u + h].
void block_units(QuantEncoding e, const uint8_t* blk, uint8_t* codes, float* s, float* o) {
  const __m256i flip = _mm256_set1_epi8(-128);
  switch (e) {
    case QuantEncoding::Q5_0: {  // q5_0_codes are code - 16 (signed)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes), _mm256_add_epi8(q5_0_codes(blk), _mm256_set1_epi8(16)));
      s[0] = load_f16(blk);
      o[0] = -16.0f * s[0];
      break;
    }
    case QuantEncoding::Q5_1:
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes), q5_1_codes(blk));
      s[0] = load_f16(blk);
      o[0] = load_f16(blk + 2);
      break;
    case QuantEncoding::IQ4_NL:
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes), _mm256_xor_si256(iq4_nl_values(blk), flip));
      s[0] = load_f16(blk);
      o[0] = 0.0f;
      break;
    case QuantEncoding::Q4_K:
    case QuantEncoding::Q5_K: {
      const bool q5 = e == QuantEncoding::Q5_K;
      uint64_t sc, mn;
      k_scale_min(blk + 4, sc, mn);
      const float d = load_f16(blk), dmin = load_f16(blk + 2);
      const uint8_t* qs = blk + (q5 ? 48 : 16);
      const __m256i low = _mm256_set1_epi8(0x0f);
      const __m256i qh = q5 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)) : _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
        __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        if (q5) {  // bit 2c of qh[l] is bit 4 of sub-block 2c's code l, bit 2c + 1 of 2c + 1's
          const __m256i b0 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), _mm256_set1_epi8(1));
          const __m256i b1 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), _mm256_set1_epi8(1));
          lo = _mm256_or_si256(lo, _mm256_slli_epi16(b0, 4));
          hi = _mm256_or_si256(hi, _mm256_slli_epi16(b1, 4));
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 64 * c), lo);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 64 * c + 32), hi);
        for (int t = 0; t < 2; ++t) {
          const int j = 2 * c + t;
          s[j] = d * static_cast<float>((sc >> (8 * j)) & 0xff);
          o[j] = -(dmin * static_cast<float>((mn >> (8 * j)) & 0xff));
        }
      }
      break;
    }
    case QuantEncoding::Q6_K: {  // unit 4h + J is q6_codes<J> of half h, scales 2u, 2u + 1
      const float d = load_f16(blk + 208);
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
      const __m256i bias = _mm256_set1_epi8(32);  // q6_codes are code - 32
      for (int h = 0; h < 2; ++h) {
        const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
        const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
        uint8_t* c = codes + 128 * h;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(c), _mm256_add_epi8(q6_codes<0>(ql0, ql1, qh), bias));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + 32), _mm256_add_epi8(q6_codes<1>(ql0, ql1, qh), bias));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + 64), _mm256_add_epi8(q6_codes<2>(ql0, ql1, qh), bias));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + 96), _mm256_add_epi8(q6_codes<3>(ql0, ql1, qh), bias));
      }
      for (int i = 0; i < 16; ++i) {
        s[i] = d * static_cast<float>(sc[i]);
        o[i] = -32.0f * s[i];
      }
      break;
    }
    default: break;
  }
}

// The scale and offset (w = s * u + o) of block `blk` of sixteen rows of a Q4_0 /
// Q4_1 / Q8_0 weight, lane r from row r (index: r * row bytes): the block's first four
// bytes are f16 d, then Q4_1's f16 m; Q4_0's offset is -8 d, Q8_0's (codes offset by
// 128) is taken in integers.
inline void gathered_scales(const uint8_t* blk, __m512i index, __mmask16 lanes, QuantEncoding e, __m512& s,
                            __m512& o) {
  const __m512i head = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lanes, index, blk, 1);
  s = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
  if (e == QuantEncoding::Q4_1) o = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)));
  else if (e == QuantEncoding::Q4_0) o = _mm512_mul_ps(s, _mm512_set1_ps(-8.0f));
  else o = _mm512_setzero_ps();
}

// Rows [n, n + rows) of w (rows <= 16; the missing lanes get zero codes and scales).
// Q4_0 / Q4_1 / Q8_0 gather straight from the weight, a dword per row at a time: lane
// r of gather j reads row r's code bytes 4j..4j+3 (Q8_0) or nibble bytes 4j..4j+3,
// whose low nibbles are codes 4j.. and high nibbles codes 16 + 4j.. (vector j + 4).
// The others decode each row's block into units first (block_units), then gather
// those (from L1).
void vnni_tile(const QuantWeight& w, const UnitForm& f, int64_t n, int64_t rows, VnniTile& t) {
  const int64_t units = w.K / 32, nblocks = units / f.per_block;
  t.codes.resize(units * 512);
  t.s.resize(units * f.H * 16);
  t.o.resize(units * f.H * 16);
  const int64_t bytes = quant_block_bytes(w.encoding, w.group, w.K);
  const __mmask16 lanes = static_cast<__mmask16>((1u << rows) - 1u);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i zero = _mm512_setzero_si512(), low = _mm512_set1_epi8(0x0f);
  const QuantEncoding e = w.encoding;
  if (gathered_directly(e)) {
    const __m512i index = _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(w.row_bytes)));
    const bool q8 = e == QuantEncoding::Q8_0, q4_1 = e == QuantEncoding::Q4_1;
    const int64_t codes_at = q4_1 ? 4 : 2;
    for (int64_t b = 0; b < units; ++b) {
      const uint8_t* blk = w.data + n * w.row_bytes + b * bytes;
      __m512i* dst = reinterpret_cast<__m512i*>(t.codes.data() + b * 512);
      if (q8) {
        for (int j = 0; j < 8; ++j) {
          const __m512i g = _mm512_mask_i32gather_epi32(zero, lanes, index, blk + codes_at + 4 * j, 1);
          _mm512_storeu_si512(dst + j, _mm512_maskz_xor_epi32(lanes, g, _mm512_set1_epi8(-128)));
        }
      } else {
        for (int j = 0; j < 4; ++j) {
          const __m512i g = _mm512_mask_i32gather_epi32(zero, lanes, index, blk + codes_at + 4 * j, 1);
          _mm512_storeu_si512(dst + j, _mm512_and_si512(g, low));
          _mm512_storeu_si512(dst + j + 4, _mm512_and_si512(_mm512_srli_epi16(g, 4), low));
        }
      }
      __m512 d, off;
      gathered_scales(blk, index, lanes, e, d, off);
      _mm512_storeu_ps(t.s.data() + b * 16, d);
      _mm512_storeu_ps(t.o.data() + b * 16, off);
    }
    return;
  }
  // [16 rows][per_block * 32] codes and [16][per_block * H] scales / offsets of a block
  const int64_t row_codes = 32 * f.per_block, row_scales = f.H * f.per_block;
  alignas(64) uint8_t codes[16 * 256];
  alignas(64) float s[16 * 16], o[16 * 16];
  const __m512i index = _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(row_codes)));
  const __m512i sindex = _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(row_scales)));
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    for (int64_t r = 0; r < rows; ++r) {
      block_units(e, w.data + (n + r) * w.row_bytes + blk * bytes, codes + r * row_codes, s + r * row_scales,
                  o + r * row_scales);
    }
    for (int64_t u = 0; u < f.per_block; ++u) {
      const int64_t unit = blk * f.per_block + u;
      __m512i* dst = reinterpret_cast<__m512i*>(t.codes.data() + unit * 512);
      for (int j = 0; j < 8; ++j) {
        _mm512_storeu_si512(dst + j, _mm512_mask_i32gather_epi32(zero, lanes, index, codes + 32 * u + 4 * j, 1));
      }
      for (int h = 0; h < f.H; ++h) {
        const int64_t at = (unit * f.H + h) * 16;
        _mm512_storeu_ps(t.s.data() + at, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), lanes, sindex, s + f.H * u + h, 4));
        _mm512_storeu_ps(t.o.data() + at, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), lanes, sindex, o + f.H * u + h, 4));
      }
    }
  }
}

// Largest |q| of the 16-bit rounding: 255 * 127 + 127, so that q = 255 hi + lo with
// hi = round(q / 255) and lo in [-127, 127].
constexpr float kInt16Levels = 32512.0f;

inline void put_i8(__m512i q, int8_t* out) { _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(q)); }

// Rows of x rounded per block of 32 and written as int8 rows (Q8Rows), with, per row
// of x and block, the scale d, d * sum(q) over each half (xs[2 * block + half]) and
// 128 * sum(q). Int8: row m rounded as quantize_x_q8 does (the same float operations,
// vectorized). Int16: d = max|x_b| / 32512, q = round(x / d), written as int8 rows 2m
// (hi = round(q / 255)) and 2m + 1 (lo = q - 255 hi), so that q = 255 hi + lo exactly.
// False when x holds a NaN or an infinity (the call then takes the float path).
bool quantize_rows_q8(const float* x, int64_t M, int64_t K, Activations act, int8_t* xq, float* xd, float* xs,
                      int32_t* x128) {
  const int64_t nb = K / 32;
  const bool wide = act == Activations::Int16;
  const __m512 sign = _mm512_set1_ps(-0.0f), inv255 = _mm512_set1_ps(1.0f / 255.0f);
  const __m512i k255 = _mm512_set1_epi32(255);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = x + m * K + 32 * b;
      const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
      // NaN or inf (max_ps would drop a NaN, so ask each lane's class)
      if (_mm512_fpclass_ps_mask(v0, 0x99) | _mm512_fpclass_ps_mask(v1, 0x99)) return false;
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
      const float d = amax / (wide ? kInt16Levels : 127.0f);
      const __m512 inv = _mm512_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));  // nearest-even, as nearbyint
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
      if (wide) {
        // |q / 255 - hi| <= 1/2 with q / 255 never within 1/510 of a half, so the float
        // quotient's rounding cannot move hi; |lo| <= 127.
        const __m512i hi0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_cvtepi32_ps(q0), inv255));
        const __m512i hi1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_cvtepi32_ps(q1), inv255));
        int8_t* out = xq + 2 * m * K + 32 * b;
        put_i8(hi0, out);
        put_i8(hi1, out + 16);
        put_i8(_mm512_sub_epi32(q0, _mm512_mullo_epi32(hi0, k255)), out + K);
        put_i8(_mm512_sub_epi32(q1, _mm512_mullo_epi32(hi1, k255)), out + K + 16);
      } else {
        int8_t* out = xq + m * K + 32 * b;
        put_i8(q0, out);
        put_i8(q1, out + 16);
      }
      const int32_t s0 = _mm512_reduce_add_epi32(q0), s1 = _mm512_reduce_add_epi32(q1);
      const int64_t at = m * nb + b;
      xd[at] = d;
      xs[2 * at] = d * static_cast<float>(s0);
      xs[2 * at + 1] = d * static_cast<float>(s1);
      x128[at] = 128 * (s0 + s1);
    }
  }
  return true;
}

// Activations of one call: P int8 rows per row of x (1: Int8; 2: Int16's hi and lo),
// q[(P * m + p) * K + k], and per row of x m and block b at m * nb + b: the scale d,
// half_sums[2 * (m * nb + b) + half] and sums128 (see quantize_rows_q8).
struct Q8Rows {
  const int8_t* q;
  const float* d;
  const float* half_sums;
  const int32_t* sums128;
  int64_t K;
  int64_t nb;
};

// out[m, 0..lanes) for MR rows of x (from row m0) against one tile: H halves per unit,
// kQ128 for codes offset by 128, P int8 rows per row of x (their integer sums combine
// as 255 hi + lo before the scale).
template <int MR, int H, bool kQ128, int P>
void vnni_block(const VnniTile& t, const Q8Rows& x, int64_t m0, float* out, int64_t ldo, __mmask16 lanes) {
  __m512 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.nb; ++b) {
    const __m512i* cv = reinterpret_cast<const __m512i*>(t.codes.data() + b * 512);
    __m512i isum[H][MR * P];
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < MR * P; ++i) isum[h][i] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      const __m512i w = _mm512_loadu_si512(cv + j);
      const int h = H == 2 ? j / 4 : 0;
      for (int i = 0; i < MR * P; ++i) {
        int32_t four;
        std::memcpy(&four, x.q + (P * m0 + i) * x.K + 32 * b + 4 * j, 4);
        isum[h][i] = _mm512_dpbusd_epi32(isum[h][i], w, _mm512_set1_epi32(four));
      }
    }
    for (int h = 0; h < H; ++h) {
      const __m512 s = _mm512_loadu_ps(t.s.data() + (b * H + h) * 16);
      const __m512 o = _mm512_loadu_ps(t.o.data() + (b * H + h) * 16);
      for (int i = 0; i < MR; ++i) {
        const int64_t at = (m0 + i) * x.nb + b;
        __m512i sum = isum[h][P * i];
        if (P == 2) {  // 255 hi + lo: |sum| < 2^29
          sum = _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(sum, 8), sum), isum[h][P * i + 1]);
        }
        if (kQ128) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(x.sums128[at]));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(s, _mm512_set1_ps(x.d[at])), acc[i]);
        if (!kQ128) {
          const float xs = H == 2 ? x.half_sums[2 * at + h] : x.half_sums[2 * at] + x.half_sums[2 * at + 1];
          acc[i] = _mm512_fmadd_ps(o, _mm512_set1_ps(xs), acc[i]);
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i) _mm512_mask_storeu_ps(out + (m0 + i) * ldo, lanes, acc[i]);
}

// The last `left` (< R + 1) rows of x from row m: one vnni_block of exactly that many.
template <int R, int H, bool kQ128, int P>
void vnni_tail(const VnniTile& t, const Q8Rows& x, int64_t m, int64_t left, float* out, int64_t ldo, __mmask16 lanes) {
  if constexpr (R > 0) {
    if (left == R) vnni_block<R, H, kQ128, P>(t, x, m, out, ldo, lanes);
    else vnni_tail<R - 1, H, kQ128, P>(t, x, m, left, out, ldo, lanes);
  }
}

// Every row of x against one tile, MR rows at a time (eight int8 rows with one scale
// per unit, four with two: the registers hold MR * P * H integer sums, the eight code
// vectors and MR accumulators).
template <int H, bool kQ128, int P>
void vnni_rows_of_x(const VnniTile& t, const Q8Rows& x, int64_t m_begin, int64_t m_end, float* out, int64_t ldo,
                    __mmask16 lanes) {
  constexpr int kMr = (H == 2 ? 4 : 8) / P;
  int64_t m = m_begin;
  for (; m + kMr <= m_end; m += kMr) vnni_block<kMr, H, kQ128, P>(t, x, m, out, ldo, lanes);
  if (m < m_end) vnni_tail<kMr - 1, H, kQ128, P>(t, x, m, m_end - m, out, ldo, lanes);
}

template <int P>
void vnni_rows_of_x(const UnitForm& f, const VnniTile& t, const Q8Rows& x, int64_t m_begin, int64_t m_end, float* out,
                    int64_t ldo, __mmask16 lanes) {
  if (f.q128) vnni_rows_of_x<1, true, P>(t, x, m_begin, m_end, out, ldo, lanes);
  else if (f.H == 2) vnni_rows_of_x<2, false, P>(t, x, m_begin, m_end, out, ldo, lanes);
  else vnni_rows_of_x<1, false, P>(t, x, m_begin, m_end, out, ldo, lanes);
}

// One row of x as Int16 (hi and lo int8 rows) against Q4_0 / Q4_1, sixteen weight rows
// at a time, straight from the gathers: vnni_tile's codes go to vpdpbusd in registers
// instead of through the tile (for one row of x each code is used once).
void q4_int16_row(const QuantLinearArgs& a, const Q8Rows& x, int64_t n_begin, int64_t n_end) {
  const QuantWeight& w = a.w;
  const bool q4_1 = w.encoding == QuantEncoding::Q4_1;
  const int64_t bytes = q4_1 ? 20 : 18, codes_at = q4_1 ? 4 : 2;
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i index = _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(w.row_bytes)));
  const __m512i zero = _mm512_setzero_si512(), low = _mm512_set1_epi8(0x0f);
  const int8_t* xh = x.q;
  const int8_t* xl = x.q + x.K;
  for (int64_t n = n_begin; n < n_end; n += kVnniRows) {
    const int64_t rows = std::min<int64_t>(kVnniRows, n_end - n);
    prefetch_rows(w, n + kVnniRows, n + 2 * kVnniRows, n_end);
    const __mmask16 lanes = static_cast<__mmask16>((1u << rows) - 1u);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < x.nb; ++b) {
      const uint8_t* blk = w.data + n * w.row_bytes + b * bytes;
      __m512i ih = zero, il = zero;
      for (int j = 0; j < 4; ++j) {
        // lane r: row r's nibble bytes 4j..4j+3: codes 4j.. (low) and 16 + 4j.. (high)
        const __m512i g = _mm512_mask_i32gather_epi32(zero, lanes, index, blk + codes_at + 4 * j, 1);
        const __m512i lo = _mm512_and_si512(g, low), hi = _mm512_and_si512(_mm512_srli_epi16(g, 4), low);
        int32_t h0, h1, l0, l1;
        std::memcpy(&h0, xh + 32 * b + 4 * j, 4);
        std::memcpy(&h1, xh + 32 * b + 16 + 4 * j, 4);
        std::memcpy(&l0, xl + 32 * b + 4 * j, 4);
        std::memcpy(&l1, xl + 32 * b + 16 + 4 * j, 4);
        ih = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(ih, lo, _mm512_set1_epi32(h0)), hi, _mm512_set1_epi32(h1));
        il = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(il, lo, _mm512_set1_epi32(l0)), hi, _mm512_set1_epi32(l1));
      }
      __m512 d, off;
      gathered_scales(blk, index, lanes, w.encoding, d, off);
      const __m512i sum = _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(ih, 8), ih), il);
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(x.d[b])), acc);
      acc = _mm512_fmadd_ps(off, _mm512_set1_ps(x.half_sums[2 * b] + x.half_sums[2 * b + 1]), acc);
    }
    _mm512_mask_storeu_ps(a.out + n, lanes, acc);
  }
}

// Tiles of 16 output features are built from the weight, a group of them at a time,
// and the rows of x go past each group. Few rows of x: one tile per group, all of x
// past it. Many rows (prefill) outgrow the L2 cache, and streaming all of them past each
// tile in turn reads them from L3 once per 16 output features; then the group holds up
// to kTileGroupBytes of tiles and x goes past it in chunks of kXChunkBytes, so that
// both stay in L2 (2 MB per core here): 1.2x on a 2048 x 576 x 1536 int16 GEMM.
constexpr int64_t kTileGroupBytes = 1 << 20;
constexpr int64_t kXChunkBytes = 1 << 18;

template <int P>
void vnni_tiles(const QuantLinearArgs& a, const UnitForm& f, const Q8Rows& x, int64_t n_begin, int64_t n_end) {
  const QuantWeight& w = a.w;
  const int64_t x_row_bytes = P * w.K;
  int64_t per_group = 1, chunk = a.M;
  if (a.M * x_row_bytes > kXChunkBytes) {
    const int64_t tile_bytes = w.K / 32 * (512 + 2 * f.H * 16 * static_cast<int64_t>(sizeof(float)));
    per_group = std::max<int64_t>(1, kTileGroupBytes / tile_bytes);
    chunk = std::max<int64_t>(8, kXChunkBytes / x_row_bytes / 8 * 8);
  }
  static thread_local std::vector<VnniTile> group;
  if (static_cast<int64_t>(group.size()) < per_group) group.resize(per_group);
  for (int64_t g = n_begin; g < n_end; g += per_group * kVnniRows) {
    const int64_t g_end = std::min(n_end, g + per_group * kVnniRows);
    for (int64_t n = g; n < g_end; n += kVnniRows) {
      prefetch_rows(w, n + kVnniRows, n + 2 * kVnniRows, n_end);
      vnni_tile(w, f, n, std::min<int64_t>(kVnniRows, g_end - n), group[(n - g) / kVnniRows]);
    }
    for (int64_t m = 0; m < a.M; m += chunk) {
      const int64_t m_end = std::min(a.M, m + chunk);
      for (int64_t n = g; n < g_end; n += kVnniRows) {
        const int64_t rows = std::min<int64_t>(kVnniRows, g_end - n);
        vnni_rows_of_x<P>(f, group[(n - g) / kVnniRows], x, m, m_end, a.out + n, w.N,
                          static_cast<__mmask16>((1u << rows) - 1u));
      }
    }
  }
}

// The integer GEMM over output features [n_begin, n_end), or false (nothing written)
// when this call is not one for it: float32 activations, another encoding, too few
// rows for a decoded encoding, or x not finite.
bool vnni_rows(const QuantLinearArgs& a, int64_t n_begin, int64_t n_end) {
  const QuantWeight& w = a.w;
  UnitForm f;
  if (a.activations == Activations::Float32 || !unit_form(w.encoding, f)) return false;
  const int64_t P = a.activations == Activations::Int16 ? 2 : 1, Mq = P * a.M;
  if (Mq < (gathered_directly(w.encoding) ? kVnniMinRows : kVnniMinRowsDecoded)) return false;
  // One row of x against Q8_0 stays on the one-row float kernel: as two int8 rows the
  // GEMM's gathers cost more than the weight's read (1.22 vs 1.08 ms, 49152 x 576).
  if (w.encoding == QuantEncoding::Q8_0 && a.M == 1) return false;
  const int64_t nb = w.K / 32;
  static thread_local std::vector<int8_t> xq;
  static thread_local std::vector<float> xd, xs;
  static thread_local std::vector<int32_t> x128;
  xq.resize(Mq * w.K);
  xd.resize(a.M * nb);
  xs.resize(2 * a.M * nb);
  x128.resize(a.M * nb);
  if (!quantize_rows_q8(a.x, a.M, w.K, a.activations, xq.data(), xd.data(), xs.data(), x128.data())) return false;
  const Q8Rows x{xq.data(), xd.data(), xs.data(), x128.data(), w.K, nb};
  if (P == 2 && a.M == 1 && w.encoding != QuantEncoding::Q8_0) q4_int16_row(a, x, n_begin, n_end);
  else if (P == 2) vnni_tiles<2>(a, f, x, n_begin, n_end);
  else vnni_tiles<1>(a, f, x, n_begin, n_end);
  return true;
}
constexpr bool kHaveVnniGemm = true;
#else
bool vnni_rows(const QuantLinearArgs&, int64_t, int64_t) { return false; }
constexpr bool kHaveVnniGemm = false;
#endif

// Up to this many rows of x take the fused path, more the dequantized tile: decoding
// once and applying each further row from the tile is as cheap as decoding again for
// two rows and cheaper from three on (measured on a Zen 3; a variant decoding each
// block once into registers for up to four rows of x won only ~1.3x at 2-4 rows).
constexpr int64_t kFusedMaxRows = 1;

void fused_rows(const QuantLinearArgs& a, int64_t n_begin, int64_t n_end) {
  const QuantWeight& w = a.w;
  const int64_t B = quant_block_size(w.encoding, w.group, w.K);
  const int64_t full = w.K / B;
  // The sums of x the offset terms take, per row of x: block_sums' four floats per
  // block (Q4_0, Q4_1, Q5_1, I4), or plain sums over each sub-block of 32 (Q4_K, Q5_K)
  // or 16 (Q2_K) elements; none for the other encodings.
  int64_t per_row = 0;
  switch (w.encoding) {
    case QuantEncoding::Q4_0:
    case QuantEncoding::Q4_1:
    case QuantEncoding::Q5_1:
    case QuantEncoding::I4: per_row = 4 * full; break;
    case QuantEncoding::Q4_K:
    case QuantEncoding::Q5_K: per_row = w.K / 32; break;
    case QuantEncoding::Q2_K: per_row = w.K / 16; break;
    default: break;
  }
  const bool offsets = per_row > 0;
  static thread_local std::vector<float> sums;
  if (offsets) {
    sums.resize(per_row * a.M);
    for (int64_t m = 0; m < a.M; ++m) {
      const float* x = a.x + m * w.K;
      float* out = sums.data() + per_row * m;
      if (w.encoding == QuantEncoding::Q4_K || w.encoding == QuantEncoding::Q5_K) sub_sums(x, per_row, 32, out);
      else if (w.encoding == QuantEncoding::Q2_K) sub_sums(x, per_row, 16, out);
      else block_sums(x, full, B, out);
    }
  }
  bool q8 = a.activations == Activations::Int8 && a.M == 1 &&
            (w.encoding == QuantEncoding::Q4_0 || w.encoding == QuantEncoding::Q4_1);
  static thread_local std::vector<int8_t> xq;
  static thread_local std::vector<float> xd;
  if (q8) {
    xq.resize(w.K);
    xd.resize(full);
    q8 = quantize_x_q8(a.x, full, xq.data(), xd.data());
    // The offset terms take the sums of the rounded x (d_x * sum q), so the product is
    // exactly dequantized w times dequantized x: its error is sum w * (x8 - x), weighted
    // by |w|, where exact sums of x would weight it by |d * code| (up to 15 d for a w of
    // about 7 d).
    for (int64_t b = 0; q8 && b < full; ++b) {
      int32_t total = 0;
      for (int i = 0; i < 32; ++i) total += xq[32 * b + i];
      sums[4 * b + 1] = xd[b] * static_cast<float>(total);
    }
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
      const float* s = offsets ? sums.data() + per_row * m : nullptr;
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

bool int8_gemm(QuantEncoding e) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  UnitForm f;
  return unit_form(e, f);
#elif PYAGENT_QUANT_SIMD
  (void)e;
  return false;
#else
  (void)e;
  return false;
#endif
}

void quantized_linear_rows(const QuantLinearArgs& a, int64_t n_begin, int64_t n_end) {
#if PYAGENT_QUANT_SIMD
  if (kHaveVnniGemm && vnni_rows(a, n_begin, n_end)) {
    // the integer GEMM took it (see vnni_rows for the cases it leaves)
  } else if (a.M <= kFusedMaxRows) {
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
