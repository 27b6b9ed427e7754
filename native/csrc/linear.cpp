// Small-batch linear layer for CPU decode: out = x @ w^T + b for a few rows of x.
// The weight streams from memory once per call, four output rows at a time; each
// four-row slice (a few KiB) stays in L1 while every row of x is applied to it.
#include "kernels.h"
#include "simd.h"

#ifndef PYAGENT_ISA
#error "PYAGENT_ISA must name the instruction-set namespace"
#endif

namespace pyagent {
namespace PYAGENT_ISA {

void linear_rows(const LinearArgs& a, int64_t n_begin, int64_t n_end) {
  const int64_t K = a.K;
  int64_t n = n_begin;
  if (kHaveDotMr4) {  // the AVX-512 build: rows of x four at a time, any K
    for (; n + 4 <= n_end; n += 4) dot_rows4(a.x, a.M, K, a.weight + n * K, K, K, a.out + n, a.N);
  } else if (kHaveDot4 && K % 8 == 0) {
    for (; n + 4 <= n_end; n += 4) {
      const float* w = a.weight + n * K;
      for (int64_t m = 0; m < a.M; ++m) dot4(a.x + m * K, w, K, K, 1.0f, a.out + m * a.N + n);
    }
  }
  for (; n < n_end; ++n) {
    const float* w = a.weight + n * K;
    for (int64_t m = 0; m < a.M; ++m) a.out[m * a.N + n] = dot(a.x + m * K, w, K);
  }
  if (a.bias != nullptr) {
    for (int64_t m = 0; m < a.M; ++m) {
      float* row = a.out + m * a.N;
      for (int64_t j = n_begin; j < n_end; ++j) row[j] += a.bias[j];
    }
  }
}

}  // namespace PYAGENT_ISA
}  // namespace pyagent
