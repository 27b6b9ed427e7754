// A small persistent pool for the kernels: a parallel region costs a wake-up, not a
// thread start (a decode step runs hundreds of them). Workers spin briefly after each
// region, when the next one usually comes within microseconds, then sleep.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace pyagent {

class ThreadPool {
 public:
  // The process-wide pool (grown on demand, never shrunk; one per process after fork).
  static ThreadPool& instance();

  // Calls fn(t) for t in [0, num_threads) concurrently, t = 0 on the calling thread;
  // returns when all calls have returned. Regions do not nest and are serialized.
  void run(int num_threads, const std::function<void(int)>& fn);

 private:
  ThreadPool() = default;
  void grow(int workers);
  void worker_loop(int index);

  std::mutex run_mutex_;  // one region at a time
  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<std::thread> workers_;
  const std::function<void(int)>* task_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> active_{0};     // workers taking part in the current region
  std::atomic<int> remaining_{0};  // of those, not yet finished
};

}  // namespace pyagent
