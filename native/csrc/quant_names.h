// Encoding names as Python spells them, and the checked bytes-per-row of a weight:
// shared by the bindings (module.cpp, decoder_bindings.cpp). Errors are
// std::invalid_argument, which pybind11 raises as ValueError.
#pragma once

#include <iterator>
#include <stdexcept>
#include <string>

#include "kernels.h"

namespace pyagent {

inline QuantEncoding parse_quant_encoding(const std::string& name) {
  static const struct {
    const char* name;
    QuantEncoding encoding;
  } kNames[] = {{"Q8_0", QuantEncoding::Q8_0}, {"Q4_0", QuantEncoding::Q4_0}, {"Q4_1", QuantEncoding::Q4_1},
                {"Q5_0", QuantEncoding::Q5_0}, {"Q5_1", QuantEncoding::Q5_1}, {"IQ4_NL", QuantEncoding::IQ4_NL},
                {"Q2_K", QuantEncoding::Q2_K}, {"Q3_K", QuantEncoding::Q3_K}, {"Q4_K", QuantEncoding::Q4_K},
                {"Q5_K", QuantEncoding::Q5_K}, {"Q6_K", QuantEncoding::Q6_K}, {"I8", QuantEncoding::I8},
                {"I4", QuantEncoding::I4}};
  std::string expected;
  for (const auto& entry : kNames) {
    if (name == entry.name) return entry.encoding;
    expected += expected.empty() ? "'" : (&entry == &kNames[std::size(kNames) - 1] ? " or '" : ", '");
    expected += std::string(entry.name) + "'";
  }
  throw std::invalid_argument("encoding: unknown '" + name + "' (expected " + expected + ")");
}

// An operand's or call's `activations`: "float32", "int8" or "int16" (QuantLinearArgs).
inline Activations parse_activations(const std::string& name) {
  if (name == "float32") return Activations::Float32;
  if (name == "int8") return Activations::Int8;
  if (name == "int16") return Activations::Int16;
  throw std::invalid_argument("activations: unknown '" + name + "' (expected 'float32', 'int8' or 'int16')");
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
