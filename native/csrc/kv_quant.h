// The quantized KV cache's rows (the layout pyagent_framework/kv_cache_format.py
// defines, and its torch functions are the twin of): one key or value row of D numbers
// is D one-byte codes, int8 or fp8 (e4m3fn), then one scale per group of G consecutive
// numbers (G = kv_group_size(D): 32, else 16, else D), each a little-endian float16;
// a number reads back as decode(code) * scale of its group.
//
// Writing a group x (float32 arithmetic throughout, in the twin's order of operations):
//   amax = max |x|
//   s    = amax > float(1e-30) ? float16(min(amax / QMAX, 65504)) : 0   (to nearest even)
//   inv  = s > 0 ? 1 / float(s) : 0
//   code = encode(x * inv)
// int8: QMAX 127, encode = round half to even, then clamp to [-127, 127];
// fp8:  QMAX 448, encode = clamp to [-448, 448], then the nearest e4m3fn (ties to even).
//
// The writer is scalar code (a decode step writes a few rows per layer), called from
// the bindings (module.cpp) and the fused decoder (decoder.cpp), both compiled without
// FMA, so no multiply-add is ever contracted in it (x * inv must round before encode
// reads it). The readers (half_to_float, e4m3fn_decode) serve the per-ISA attention
// kernels too.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "kernels.h"

namespace pyagent {
// Internal linkage, as simd.h: the per-ISA kernel sources include this too, and each
// build must keep its own copy (no cross-ISA merge of inline functions by the linker).
namespace {

// Bytes of one group's scale (a float16).
constexpr int64_t kKVScaleBytes = 2;

// Numbers per scale in a row of head_dim numbers: 32, else 16, else the whole row.
constexpr int64_t kv_group_size(int64_t head_dim) {
  return head_dim % 32 == 0 ? 32 : head_dim % 16 == 0 ? 16 : head_dim;
}

// Bytes of one cached row of head_dim numbers (codes, then the groups' scales).
constexpr int64_t kv_row_bytes(int64_t head_dim) {
  return head_dim + kKVScaleBytes * (head_dim / kv_group_size(head_dim));
}

// "int8" or "fp8" (and "auto": a float cache) as a KVCodes; std::invalid_argument otherwise.
inline KVCodes parse_kv_dtype(const std::string& name) {
  if (name == "auto") return KVCodes::None;
  if (name == "int8") return KVCodes::Int8;
  if (name == "fp8") return KVCodes::Fp8;
  throw std::invalid_argument("kv_dtype: unknown '" + name + "' (expected 'auto', 'int8' or 'fp8')");
}

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// float16 bits of f, rounded to nearest even (as torch's .to(torch.float16)).
inline uint16_t float_to_half(float f) {
  const uint32_t x = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // 65520 and up round to infinity
  if (a >= 0x38800000u) {
    // A normal half (2^-14 and up): rebias the exponent (127 -> 15) and round the
    // 23-bit mantissa to 10 bits, half to even (add 0xfff, plus one when the kept part is odd).
    const uint32_t odd = (a >> 13) & 1u;
    return static_cast<uint16_t>(sign | ((a - (112u << 23) + 0xfffu + odd) >> 13));
  }
  // A subnormal half (multiples of 2^-24): adding 0.5, whose float32 ulp is 2^-24,
  // leaves f rounded by the FPU (to even) as a count of 2^-24 in the low bits.
  const float shifted = bits_float(a) + 0.5f;
  return static_cast<uint16_t>(sign | (float_bits(shifted) - float_bits(0.5f)));
}

// The value of float16 bits h (exact; the F16C instruction where the build has it).
inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  if (em >= 0x7c00u) return bits_float(sign | 0x7f800000u | ((em & 0x3ffu) << 13));  // inf, NaN
  if (em >= 0x0400u) return bits_float(sign | ((em + (112u << 10)) << 13));           // normal
  const float magnitude = static_cast<float>(em) * 0x1p-24f;                           // subnormal
  return sign ? -magnitude : magnitude;
#endif
}

// The nearest e4m3fn code of f (ties to even), for |f| <= 448 (the caller clamps);
// NaN is 0x7f with f's sign, as torch's conversion gives.
inline uint8_t float_to_e4m3fn(float f) {
  uint32_t bits = float_bits(f);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  bits &= 0x7fffffffu;
  uint8_t code;
  if (bits > 0x7f800000u) {
    code = 0x7f;  // NaN
  } else if (bits < (121u << 23)) {
    // Below 2^-6, the smallest normal: subnormal codes m * 2^-9. Adding 2^14 leaves
    // f's multiple of 2^-9 in the low mantissa bits, rounded by the FPU (to even).
    const float shifted = bits_float(bits) + bits_float(141u << 23);
    code = static_cast<uint8_t>(float_bits(shifted) - (141u << 23));
  } else {
    // Normal: rebias the exponent (127 -> 7) and round the 23-bit mantissa to 3 bits,
    // half to even (add 0x7ffff, plus one when the kept part is odd).
    const uint32_t odd = (bits >> 20) & 1u;
    bits += (static_cast<uint32_t>(7 - 127) << 23) + 0x7ffffu + odd;
    code = static_cast<uint8_t>(bits >> 20);
  }
  return static_cast<uint8_t>(code | sign);
}

// The value of e4m3fn code c, exact: sign, 4 exponent bits (bias 7), 3 mantissa bits;
// exponent 0 is subnormal (m * 2^-9), 0x7f/0xff are NaN, there are no infinities.
// Integer and float steps the vectorizer takes (a 256-entry table lookup becomes a
// gather, which made the fp8 cache slower to read than the float32 one): the code's
// exponent and mantissa bits moved into a float32's, the exponent rebiased (7 -> 127);
// a subnormal as 2^-6 (1 + m / 8) - 2^-6, exact, and with no float32 subnormal on the
// way (a flush-to-zero mode cannot touch it); the sign bit last (0x80 is -0).
inline float e4m3fn_decode(uint32_t c) {
  const uint32_t em = c & 0x7fu;
  const uint32_t subnormal = em < 8u ? 8u : 0u;
  const float v = bits_float(((em | subnormal) << 20) + (120u << 23)) - (subnormal ? 0x1p-6f : 0.0f);
  const float nan_or_v = em == 0x7fu ? std::numeric_limits<float>::quiet_NaN() : v;
  return bits_float(float_bits(nan_or_v) | ((c & 0x80u) << 24));
}

// Row x[0..D) as D codes and its groups' scales at out[D..) (see the top of this file).
inline void quantize_kv_row(const float* x, int64_t D, KVCodes kind, uint8_t* out) {
  const float qmax = kind == KVCodes::Int8 ? 127.0f : 448.0f;
  const int64_t G = kv_group_size(D);
  for (int64_t g0 = 0; g0 < D; g0 += G) {
    float amax = 0.0f;
    for (int64_t d = g0; d < g0 + G; ++d) {
      const float m = std::fabs(x[d]);
      if (!(m <= amax)) amax = m;  // NaN stays (as torch's amax)
    }
    float ratio = amax / qmax;
    ratio = ratio > 65504.0f ? 65504.0f : ratio;
    const uint16_t scale = amax > static_cast<float>(1e-30) ? float_to_half(ratio) : 0;
    const float wide = half_to_float(scale);
    const float inv = wide > 0.0f ? 1.0f / wide : 0.0f;
    for (int64_t d = g0; d < g0 + G; ++d) {
      float y = x[d] * inv;
      if (kind == KVCodes::Int8) {
        y = std::nearbyint(y);  // half to even in the default rounding mode
        y = y > 127.0f ? 127.0f : (y < -127.0f ? -127.0f : y);
        out[d] = static_cast<uint8_t>(static_cast<int8_t>(y == y ? static_cast<int>(y) : 0));
      } else {
        y = y > 448.0f ? 448.0f : (y < -448.0f ? -448.0f : y);
        out[d] = float_to_e4m3fn(y);
      }
    }
    // little-endian hosts only (x86-64, aarch64)
    std::memcpy(out + D + g0 / G * kKVScaleBytes, &scale, sizeof scale);
  }
}

}  // namespace
}  // namespace pyagent
