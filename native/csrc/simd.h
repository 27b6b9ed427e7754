// Dot products shared by the kernels. Included by every per-ISA source: everything
// here has internal linkage, so each build gets its own copy compiled for its ISA.
#pragma once

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace pyagent {
namespace {

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

}  // namespace
}  // namespace pyagent
