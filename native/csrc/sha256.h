// SHA-256 (FIPS 180-4), for hashing prefix-cache blocks with the same digests as the
// Python path (hashlib.sha256). Portable C++; no CPU-specific instructions.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace pyagent {

class Sha256 {
 public:
  Sha256();
  void update(const uint8_t* data, size_t size);
  std::array<uint8_t, 32> digest();  // finishes the hash; the object is spent

 private:
  void compress(const uint8_t* block);
  std::array<uint32_t, 8> state_;
  std::array<uint8_t, 64> buffer_;
  size_t buffered_ = 0;
  uint64_t length_ = 0;  // bytes
};

}  // namespace pyagent
