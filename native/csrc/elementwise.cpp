// Element-wise kernels of the decode step, per ISA: SiLU-and-mul, the MLP's activation.
// Written for the auto-vectorizer: a branch-free exp (simd.h's exp_nonpositive) lets
// each build compile the loop to its widest vectors, where std::exp stays a scalar
// call per element (a 64-sequence SmolLM2 step spent ~7% of its time there).
#include <algorithm>

#include "kernels.h"
#include "simd.h"

#ifndef PYAGENT_ISA
#error "PYAGENT_ISA must name the instruction-set namespace"
#endif

namespace pyagent {
namespace PYAGENT_ISA {

void silu_mul_rows(const SiluMulArgs& a, int64_t begin, int64_t end) {
  for (int64_t m = begin; m < end; ++m) {
    const float* __restrict gate = a.gate + m * a.in_stride;
    const float* __restrict up = a.up + m * a.in_stride;
    float* __restrict out = a.out + m * a.out_stride;
#pragma omp simd
    for (int64_t i = 0; i < a.n; ++i) out[i] = silu(gate[i]) * up[i];
  }
}

}  // namespace PYAGENT_ISA
}  // namespace pyagent
