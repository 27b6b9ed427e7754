// Encoding names as Python spells them, and the checked bytes-per-row of a weight:
// shared by the bindings (module.cpp, decoder_bindings.cpp). Errors are
// std::invalid_argument, which pybind11 raises as ValueError.
#pragma once

#include <stdexcept>
#include <string>

#include "kernels.h"

namespace pyagent {

inline QuantEncoding parse_quant_encoding(const std::string& name) {
  if (name == "Q8_0") return QuantEncoding::Q8_0;
  if (name == "Q4_0") return QuantEncoding::Q4_0;
  if (name == "Q4_1") return QuantEncoding::Q4_1;
  if (name == "Q6_K") return QuantEncoding::Q6_K;
  if (name == "I8") return QuantEncoding::I8;
  if (name == "I4") return QuantEncoding::I4;
  throw std::invalid_argument("encoding: unknown '" + name +
                              "' (expected 'Q8_0', 'Q4_0', 'Q4_1', 'Q6_K', 'I8' or 'I4')");
}

// Bytes per row of `encoding` for K input features; checks K and group.
inline int64_t checked_row_bytes(const std::string& encoding, int64_t K, int64_t group) {
  const QuantEncoding e = parse_quant_encoding(encoding);
  if (e == QuantEncoding::I4) {
    if (group != 32 && group != 64 && group != 128) {
      throw std::invalid_argument("group: I4 takes 32, 64 or 128, got " + std::to_string(group));
    }
  } else if (group != 0) {
    throw std::invalid_argument("group: only I4 takes a group, got " + std::to_string(group) + " for " + encoding);
  }
  if (K < 1) throw std::invalid_argument("K (input features) must be >= 1, got " + std::to_string(K));
  const int64_t block = quant_block_size(e, group, K);
  if (e != QuantEncoding::I8 && e != QuantEncoding::I4 && K % block != 0) {
    throw std::invalid_argument(encoding + " needs K (input features) to be a multiple of " + std::to_string(block) +
                                ", got " + std::to_string(K));
  }
  return quant_row_bytes(e, group, K);
}

}  // namespace pyagent
