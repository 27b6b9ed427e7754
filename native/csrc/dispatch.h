#pragma once

#include <string>

#include "kernels.h"

namespace pyagent {

// "avx2" when this build has the AVX2+FMA kernels and the CPU runs them, else "generic".
std::string best_isa();

// Runs decode attention over all (sequence, kv head) items on up to num_threads
// threads (the caller's thread included). isa: "auto", "generic" or "avx2".
// Throws std::out_of_range naming the block id when a table points outside the pool,
// std::invalid_argument for an unknown or unavailable isa.
void paged_decode_attention(const DecodeArgs& args, int num_threads, const std::string& isa);

// out = x @ weight^T (+ bias) on up to num_threads threads (see LinearArgs).
void linear(const LinearArgs& args, int num_threads, const std::string& isa);

// out[N, K] = the weight, dequantized exactly, on up to num_threads threads.
void dequantize(const QuantWeight& w, float* out, int num_threads, const std::string& isa);

// out = x @ dequantize(w)^T (+ bias) on up to num_threads threads (see QuantLinearArgs).
void quantized_linear(const QuantLinearArgs& args, int num_threads, const std::string& isa);

}  // namespace pyagent
