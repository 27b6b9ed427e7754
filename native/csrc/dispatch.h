#pragma once

#include <string>
#include <vector>

#include "kernels.h"

namespace pyagent {

// The builds of every kernel: "generic" (portable; "portable" is an alias), "avx2"
// (AVX2+FMA+F16C) and "avx512" (AVX-512 F/BW/VL/DQ/VNNI/BF16), each where this build has
// it. An `isa` argument below takes one of them or "auto": the build named by the
// environment variable PYAGENT_NATIVE_ISA when it is set (read once, at the first
// dispatch; "auto" there too means the best), else the best this CPU runs. A build the
// CPU cannot run, or an unknown name, is std::invalid_argument naming it.
using DecodeFn = bool (*)(const DecodeArgs&, int64_t, int64_t, std::vector<float>&);
using LinearFn = void (*)(const LinearArgs&, int64_t, int64_t);
using DequantizeFn = void (*)(const QuantWeight&, float*, int64_t, int64_t);
using QuantLinearFn = void (*)(const QuantLinearArgs&, int64_t, int64_t);
using SiluMulFn = void (*)(const SiluMulArgs&, int64_t, int64_t);
using Int8GemmFn = bool (*)(QuantEncoding);

struct Kernels {
  DecodeFn decode;
  LinearFn linear;
  DequantizeFn dequantize;
  QuantLinearFn quantized_linear;
  SiluMulFn silu_mul;
  Int8GemmFn int8_gemm;
};

Kernels kernels_for(const std::string& isa);

// The build "auto" runs here (PYAGENT_NATIVE_ISA honoured; one this CPU cannot run, or
// an unknown name, is std::invalid_argument naming the variable).
std::string best_isa();

// The builds this CPU runs, portable first.
std::vector<std::string> available_isas();

// Runs decode attention over all (sequence, kv head) items on up to num_threads
// threads (the caller's thread included). isa: see kernels_for.
// Throws std::out_of_range naming the block id when a table points outside the pool,
// std::invalid_argument for an unknown or unavailable isa.
void paged_decode_attention(const DecodeArgs& args, int num_threads, const std::string& isa);

// out = x @ weight^T (+ bias) on up to num_threads threads (see LinearArgs).
void linear(const LinearArgs& args, int num_threads, const std::string& isa);

// out[N, K] = the weight, dequantized exactly, on up to num_threads threads.
void dequantize(const QuantWeight& w, float* out, int num_threads, const std::string& isa);

// out = x @ dequantize(w)^T (+ bias) on up to num_threads threads (see QuantLinearArgs).
void quantized_linear(const QuantLinearArgs& args, int num_threads, const std::string& isa);

// SiLU-and-mul over `rows` rows (see SiluMulArgs) on up to num_threads threads.
void silu_and_mul(const SiluMulArgs& args, int64_t rows, int num_threads, const std::string& isa);

}  // namespace pyagent
