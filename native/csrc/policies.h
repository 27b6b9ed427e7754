// Native eviction policies beyond LRU: C++ twins of pyagent-eviction's "arc" and "s3fifo"
// (plugins/pyagent-eviction/pyagent_eviction/{arc,s3fifo}.py). Each reproduces its Python
// twin exactly: the same victims and the same len() on any sequence of operations,
// including the lenient handling of unknown blocks. Read the Python docstrings for the
// rules; the comments here only say how each step maps onto them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <list>
#include <set>
#include <stdexcept>
#include <unordered_map>
#include <utility>

namespace pyagent {

// ARC adapted to block ids (twin of "arc"): T1 (used once) and T2 (reused), each with
// its evictable blocks in release order; ghosts kept as counts; p adapts on rescues
// (a touch of an evictable block). O(1) per operation.
class ARCPolicy {
 public:
  static constexpr int T1 = 0;
  static constexpr int T2 = 1;

  explicit ARCPolicy(int64_t capacity = 0) : capacity_(capacity) {}

  void insert(int64_t block) {
    forget(block);
    Entry& e = where_[block];
    e.list = T1;
    e.evictable = false;
    ++size_[T1];
    trim_ghosts();
  }

  void touch(int64_t block) {
    auto found = where_.find(block);
    if (found == where_.end()) {
      insert(block);
      return;
    }
    Entry& e = found->second;
    if (e.evictable) {  // it could have been evicted: a rescue
      evictable_[e.list].erase(e.it);
      e.evictable = false;
      adapt(e.list);
    }
    if (e.list == T1) {
      e.list = T2;
      --size_[T1];
      ++size_[T2];
    }
  }

  void release(int64_t block) {
    auto found = where_.find(block);
    if (found == where_.end()) {
      insert(block);
      found = where_.find(block);
    }
    Entry& e = found->second;
    auto& order = evictable_[e.list];
    if (e.evictable) order.erase(e.it);
    order.push_back(block);  // most recently released
    e.it = std::prev(order.end());
    e.evictable = true;
  }

  void remove(int64_t block) {
    forget(block);  // invalidated, not evicted: no ghost
    trim_ghosts();
  }

  int64_t evict() {
    auto& t1 = evictable_[T1];
    auto& t2 = evictable_[T2];
    if (t1.empty() && t2.empty()) throw std::out_of_range("no evictable block");
    const int q = (!t1.empty() && (t2.empty() || static_cast<double>(size_[T1]) > p_)) ? T1 : T2;
    const int64_t block = evictable_[q].front();
    evictable_[q].pop_front();
    where_.erase(block);
    --size_[q];
    ++ghost_[q];
    trim_ghosts();
    return block;
  }

  size_t size() const { return evictable_[T1].size() + evictable_[T2].size(); }
  int64_t capacity() const { return capacity_; }

  // Introspection, as the Python twin's (for tests and tools).
  double p() const { return p_; }
  int64_t t1_size() const { return size_[T1]; }
  int64_t t2_size() const { return size_[T2]; }
  std::pair<int64_t, int64_t> ghost_sizes() const { return {ghost_[T1], ghost_[T2]}; }
  // T1, T2, or -1 when the block is not resident.
  int list_of(int64_t block) const {
    auto found = where_.find(block);
    return found == where_.end() ? -1 : found->second.list;
  }

 private:
  struct Entry {
    int list = T1;
    bool evictable = false;
    std::list<int64_t>::iterator it;  // valid while evictable
  };

  int64_t c() const { return std::max<int64_t>({capacity_, size_[T1] + size_[T2], 1}); }

  void forget(int64_t block) {
    auto found = where_.find(block);
    if (found == where_.end()) return;
    Entry& e = found->second;
    if (e.evictable) evictable_[e.list].erase(e.it);
    --size_[e.list];
    where_.erase(found);
  }

  void trim_ghosts() {
    const int64_t c = this->c();
    ghost_[T1] = std::min(ghost_[T1], std::max<int64_t>(0, c - size_[T1]));
    // excess = |T1| + |T2| + |B1| + |B2| - 2c, computed without overflowing 2c.
    const int64_t over = size_[T1] + size_[T2] + ghost_[T1] + ghost_[T2] - c;
    if (over <= c) return;
    int64_t excess = over - c;
    for (int q : {T2, T1}) {
      if (excess <= 0) break;
      const int64_t cut = std::min(ghost_[q], excess);
      ghost_[q] -= cut;
      excess -= cut;
    }
  }

  void adapt(int rescued_from) {
    const double b1 = static_cast<double>(ghost_[T1]);
    const double b2 = static_cast<double>(ghost_[T2]);
    if (rescued_from == T1) {
      p_ = std::min(static_cast<double>(c()), p_ + std::max(1.0, b2 / std::max(b1, 1.0)));
    } else {
      p_ = std::max(0.0, p_ - std::max(1.0, b1 / std::max(b2, 1.0)));
    }
  }

  int64_t capacity_;
  double p_ = 0.0;
  std::unordered_map<int64_t, Entry> where_;  // resident block -> its list
  std::list<int64_t> evictable_[2];           // per list, oldest release first
  int64_t size_[2] = {0, 0};                  // resident blocks per list, in use included
  int64_t ghost_[2] = {0, 0};                 // |B1|, |B2|
};

// S3-FIFO adapted to block ids (twin of "s3fifo"): a small probation FIFO and a main
// FIFO with CLOCK-like reinsertion; use counters capped at 3; no ghost queue. Each queue
// keeps its evictable blocks ordered by queue position (std::set), so an operation is
// O(log n) and evict() amortized O(log n) over the touches.
class S3FIFOPolicy {
 public:
  static constexpr int SMALL = 0;
  static constexpr int MAIN = 1;
  static constexpr int MAX_FREQ = 3;

  explicit S3FIFOPolicy(int64_t capacity = 0)
      : capacity_(capacity),
        // max(1, int(capacity * 0.1)), in the same double arithmetic as the Python twin.
        small_target_(std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(capacity) * 0.1))) {}

  void insert(int64_t block) {
    forget(block);
    Entry& e = blocks_[block];
    e.freq = 0;
    e.evictable = false;
    e.queue = SMALL;
    e.pos = ++clock_;
    ++size_[SMALL];
  }

  void touch(int64_t block) {
    auto found = blocks_.find(block);
    if (found == blocks_.end()) {
      insert(block);
      return;
    }
    Entry& e = found->second;
    if (e.evictable) {
      evictable_[e.queue].erase({e.pos, block});
      e.evictable = false;
    }
    e.freq = std::min(e.freq + 1, MAX_FREQ);
  }

  void release(int64_t block) {
    auto found = blocks_.find(block);
    if (found == blocks_.end()) {
      insert(block);
      found = blocks_.find(block);
    } else if (found->second.evictable) {
      return;  // already evictable: its position is unchanged
    }
    Entry& e = found->second;
    evictable_[e.queue].insert({e.pos, block});
    e.evictable = true;
  }

  void remove(int64_t block) { forget(block); }

  int64_t evict() {
    if (evictable_[SMALL].empty() && evictable_[MAIN].empty()) throw std::out_of_range("no evictable block");
    while (true) {
      const auto& small = evictable_[SMALL];
      const auto& main = evictable_[MAIN];
      int64_t block;
      if (!small.empty() && (size_[SMALL] >= small_target_ || main.empty())) {
        block = small.begin()->second;
        Entry& e = blocks_.find(block)->second;
        if (e.freq > 0) {
          e.freq = 0;
          enter(block, e, MAIN);  // promoted: reused while on probation
          continue;
        }
      } else {
        block = main.begin()->second;
        Entry& e = blocks_.find(block)->second;
        if (e.freq > 0) {
          --e.freq;
          enter(block, e, MAIN);  // second chance at the head of M
          continue;
        }
      }
      forget(block);
      return block;
    }
  }

  size_t size() const { return evictable_[SMALL].size() + evictable_[MAIN].size(); }
  int64_t capacity() const { return capacity_; }

  // Introspection, as the Python twin's (for tests and tools).
  int64_t small_target() const { return small_target_; }
  // SMALL, MAIN, or -1 when the block is not tracked.
  int queue_of(int64_t block) const {
    auto found = blocks_.find(block);
    return found == blocks_.end() ? -1 : found->second.queue;
  }
  // The block's use counter, or -1 when it is not tracked.
  int freq(int64_t block) const {
    auto found = blocks_.find(block);
    return found == blocks_.end() ? -1 : found->second.freq;
  }

 private:
  struct Entry {
    int queue = SMALL;
    int freq = 0;
    bool evictable = false;
    int64_t pos = 0;  // queue position, larger = newer
  };

  // Put a tracked block at the head of queue q, keeping its evictability.
  void enter(int64_t block, Entry& e, int q) {
    if (e.evictable) evictable_[e.queue].erase({e.pos, block});
    --size_[e.queue];
    e.queue = q;
    e.pos = ++clock_;
    ++size_[q];
    if (e.evictable) evictable_[q].insert({e.pos, block});
  }

  void forget(int64_t block) {
    auto found = blocks_.find(block);
    if (found == blocks_.end()) return;
    Entry& e = found->second;
    if (e.evictable) evictable_[e.queue].erase({e.pos, block});
    --size_[e.queue];
    blocks_.erase(found);
  }

  int64_t capacity_;
  int64_t small_target_;
  std::unordered_map<int64_t, Entry> blocks_;               // tracked block -> its state
  std::set<std::pair<int64_t, int64_t>> evictable_[2];      // per queue: (position, block), oldest first
  int64_t size_[2] = {0, 0};                                // tracked blocks per queue, in use included
  int64_t clock_ = 0;
};

}  // namespace pyagent
