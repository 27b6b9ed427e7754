// Dot products and element-wise math shared by the kernels. Included by every per-ISA source: everything
// here has internal linkage, so each build gets its own copy compiled for its ISA.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if (defined(__AVX2__) && defined(__FMA__)) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pyagent {
namespace {

// exp(x) for x <= 0 (scores minus their maximum): Cephes' single-precision
// polynomial after range reduction, ~1 ulp. Branch-free so loops over it vectorize;
// the truncating conversion is a floor because x <= 0.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float fx = x * 1.44269504088896341f;
  const int32_t n = -static_cast<int32_t>(0.5f - fx);  // round(fx) for fx <= 0
  const float nf = static_cast<float>(n);
  float r = x - nf * 0.693359375f;
  r = r + nf * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const int32_t bits = (n + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

// silu(x) = x * sigmoid(x), from exp(-|x|) so the exponent never overflows:
// sigmoid(x) = 1 / (1 + e) for x >= 0 and e / (1 + e) below, e = exp(-|x|). Within a
// few ulp of x / (1 + exp(-x)), branch-free. Below -87, where exp_nonpositive clamps,
// the result is a zero of x's sign (the exact value is under 1e-35).
inline float silu(float x) {
  const float e = exp_nonpositive(std::min(x, -x));
  const float num = x < 0.0f ? e : 1.0f;
  const float y = x * (num / (1.0f + e));
  const float keep = x < -87.0f ? 0.0f : 1.0f;
  return y * keep;
}

// <a, b> over n floats. Sixteen partial sums (two AVX registers, four SSE ones) in
// independent chains, then a fixed tree: the order is spelled out, so the compiler
// vectorizes it without fast-math.
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc[16] = {};
  const int64_t whole = n - n % 16;
  for (int64_t i = 0; i < whole; i += 16) {
    for (int l = 0; l < 16; ++l) acc[l] += a[i + l] * b[i + l];
  }
  for (int64_t i = whole; i < n; ++i) acc[i - whole] += a[i] * b[i];
  for (int l = 0; l < 8; ++l) acc[l] += acc[l + 8];
  for (int l = 0; l < 4; ++l) acc[l] += acc[l + 4];
  return (acc[0] + acc[2]) + (acc[1] + acc[3]);
}

#if defined(__AVX2__) && defined(__FMA__)
// Scores of four consecutive tokens (rows k, k + stride, ...) against one query row,
// D a multiple of 8: four independent FMA chains, then one transposing horizontal add.
inline void dot4(const float* __restrict q, const float* __restrict k, int64_t stride, int64_t D, float scale,
                 float* __restrict dst) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + d), a0);
    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + stride + d), a1);
    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 2 * stride + d), a2);
    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 3 * stride + d), a3);
  }
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  _mm_storeu_ps(dst, scale == 1.0f ? sum : _mm_mul_ps(sum, _mm_set1_ps(scale)));
}
constexpr bool kHaveDot4 = true;
#else
inline void dot4(const float*, const float*, int64_t, int64_t, float, float*) {}
constexpr bool kHaveDot4 = false;
#endif

#if defined(__AVX512F__)
constexpr bool kHaveDotMr4 = true;

// The four sums of a0..a3's lanes, in order (a sum of halves, then a transposing
// horizontal add, as dot4's).
inline __m128 hsum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const auto half = [](__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  };
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(half(a0), half(a1)), _mm256_hadd_ps(half(a2), half(a3)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// out[m * ldo + r] = <x_m, w_r> for the MR rows of x (stride ldx) and four rows of w
// (stride ldw) over K columns, any K (the last partial 16 come in masked loads).
// MR x 4 accumulators of 16 lanes: per 16 columns 4 + MR loads feed 4 * MR FMAs in
// independent chains, so from MR = 2 on the FMA units bound it, not the loads or the
// FMA latency (AVX2's dot4 runs four chains of eight lanes, one load per FMA).
template <int MR>
inline void dot_mr4(const float* __restrict x, int64_t ldx, const float* __restrict w, int64_t ldw, int64_t K,
                    float* __restrict out, int64_t ldo) {
  __m512 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[4];
    for (int r = 0; r < 4; ++r) wv[r] = _mm512_loadu_ps(w + r * ldw + k);
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * ldx + k);
      for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  if (k < K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1u);
    __m512 wv[4];
    for (int r = 0; r < 4; ++r) wv[r] = _mm512_maskz_loadu_ps(mask, w + r * ldw + k);
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * ldx + k);
      for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm_storeu_ps(out + m * ldo, hsum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
}

// Every row of x (M rows, stride ldx) against four rows of w: dot_mr4 four rows of x
// at a time, then the rest.
inline void dot_rows4(const float* x, int64_t M, int64_t ldx, const float* w, int64_t ldw, int64_t K, float* out,
                      int64_t ldo) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) dot_mr4<4>(x + m * ldx, ldx, w, ldw, K, out + m * ldo, ldo);
  switch (M - m) {
    case 3: dot_mr4<3>(x + m * ldx, ldx, w, ldw, K, out + m * ldo, ldo); break;
    case 2: dot_mr4<2>(x + m * ldx, ldx, w, ldw, K, out + m * ldo, ldo); break;
    case 1: dot_mr4<1>(x + m * ldx, ldx, w, ldw, K, out + m * ldo, ldo); break;
    default: break;
  }
}
#else
constexpr bool kHaveDotMr4 = false;
inline void dot_rows4(const float*, int64_t, int64_t, const float*, int64_t, int64_t, float*, int64_t) {}
#endif

}  // namespace
}  // namespace pyagent
