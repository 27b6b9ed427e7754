#include "thread_pool.h"

#include <unistd.h>

#include <chrono>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PYAGENT_PAUSE() _mm_pause()
#else
#define PYAGENT_PAUSE() std::this_thread::yield()
#endif

namespace pyagent {
namespace {
// After a region a worker spins (pause instructions) for a few tens of microseconds,
// then keeps polling with sched_yield, which hands the core to any other runnable
// thread (torch's own, for one), for up to kPollTime, then sleeps. The next region of
// a decode step usually comes within that time, and waking a sleeping thread costs
// more than a small kernel takes.
constexpr int kSpinIterations = 1 << 11;
constexpr std::chrono::microseconds kPollTime{2000};
}

ThreadPool& ThreadPool::instance() {
  // Never destroyed: sleeping workers end with the process. A forked child has none of
  // its parent's threads, so it gets a pool of its own (the parent's is left behind).
  static std::mutex guard;
  static ThreadPool* pool = nullptr;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lock(guard);
  if (pool == nullptr || owner != getpid()) {
    pool = new ThreadPool();
    owner = getpid();
  }
  return *pool;
}

void ThreadPool::grow(int workers) {
  while (static_cast<int>(workers_.size()) < workers) {
    const int index = static_cast<int>(workers_.size()) + 1;
    workers_.emplace_back([this, index] { worker_loop(index); });
  }
}

void ThreadPool::run(int num_threads, const std::function<void(int)>& fn) {
  if (num_threads <= 1) {
    fn(0);
    return;
  }
  std::lock_guard<std::mutex> region(run_mutex_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    grow(num_threads - 1);
    task_ = &fn;
    active_.store(num_threads - 1);
    remaining_.store(num_threads - 1);
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  fn(0);
  // A worker that was descheduled needs this core back: stop spinning after a while.
  for (int spins = 0; remaining_.load(std::memory_order_acquire) > 0; ++spins) {
    if (spins < kSpinIterations) {
      PYAGENT_PAUSE();
    } else {
      std::this_thread::yield();
    }
  }
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  for (;;) {
    // Wait for a new region: spin first, then sleep.
    int spins = 0;
    while (generation_.load(std::memory_order_acquire) == seen && spins < kSpinIterations) {
      PYAGENT_PAUSE();
      ++spins;
    }
    const auto poll_until = std::chrono::steady_clock::now() + kPollTime;
    while (generation_.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < poll_until) {
      std::this_thread::yield();
    }
    const std::function<void(int)>* task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return generation_.load() != seen; });
      seen = generation_.load();
      task = task_;
      if (index > active_.load()) continue;  // not needed in this region
    }
    (*task)(index);
    remaining_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

}  // namespace pyagent
