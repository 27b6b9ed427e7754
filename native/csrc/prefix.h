// Prefix-cache helpers: chained block hashing and the native eviction policies.
#pragma once

#include <array>
#include <cstdint>
#include <list>
#include <stdexcept>
#include <unordered_map>
#include <vector>

namespace pyagent {

using Digest = std::array<uint8_t, 32>;

// The digests of every full block of `tokens`: block i hashes sha256(previous digest,
// its token ids as little-endian int64), starting from `parent` (the Python path's
// pyagent_framework.engine.kv_cache.block_hash, chained).
std::vector<Digest> hash_blocks(const Digest& parent, const int64_t* tokens, int64_t num_tokens, int64_t block_size);

// Least recently released first; O(1) per operation (the twin of the built-in "lru").
class LRUPolicy {
 public:
  explicit LRUPolicy(int64_t capacity = 0) : capacity_(capacity) {}
  void insert(int64_t block) { forget(block); }
  void touch(int64_t block) { forget(block); }
  void remove(int64_t block) { forget(block); }
  void release(int64_t block) {
    forget(block);
    order_.push_back(block);
    where_[block] = std::prev(order_.end());
  }
  int64_t evict() {
    if (order_.empty()) throw std::out_of_range("no evictable block");
    const int64_t block = order_.front();
    order_.pop_front();
    where_.erase(block);
    return block;
  }
  size_t size() const { return order_.size(); }
  int64_t capacity() const { return capacity_; }

 private:
  void forget(int64_t block) {
    auto it = where_.find(block);
    if (it == where_.end()) return;
    order_.erase(it->second);
    where_.erase(it);
  }
  int64_t capacity_;
  std::list<int64_t> order_;
  std::unordered_map<int64_t, std::list<int64_t>::iterator> where_;
};

}  // namespace pyagent
