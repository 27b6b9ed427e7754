#include "prefix.h"

#include "sha256.h"

namespace pyagent {

std::vector<Digest> hash_blocks(const Digest& parent, const int64_t* tokens, int64_t num_tokens, int64_t block_size) {
  std::vector<Digest> out;
  if (block_size <= 0) return out;
  const int64_t full = num_tokens / block_size;
  out.reserve(static_cast<size_t>(full));
  std::vector<uint8_t> bytes(static_cast<size_t>(block_size) * 8);
  Digest previous = parent;
  for (int64_t b = 0; b < full; ++b) {
    for (int64_t j = 0; j < block_size; ++j) {
      const uint64_t v = static_cast<uint64_t>(tokens[b * block_size + j]);
      for (int k = 0; k < 8; ++k) bytes[static_cast<size_t>(j * 8 + k)] = uint8_t(v >> (8 * k));  // little-endian
    }
    Sha256 h;
    h.update(previous.data(), previous.size());
    h.update(bytes.data(), bytes.size());
    previous = h.digest();
    out.push_back(previous);
  }
  return out;
}

}  // namespace pyagent
