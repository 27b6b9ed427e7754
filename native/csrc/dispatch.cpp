#include "dispatch.h"

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <vector>

#include "thread_pool.h"

namespace pyagent {
namespace {

using DecodeFn = bool (*)(const DecodeArgs&, int64_t, int64_t, std::vector<float>&);
using LinearFn = void (*)(const LinearArgs&, int64_t, int64_t);
using DequantizeFn = void (*)(const QuantWeight&, float*, int64_t, int64_t);
using QuantLinearFn = void (*)(const QuantLinearArgs&, int64_t, int64_t);

struct Kernels {
  DecodeFn decode;
  LinearFn linear;
  DequantizeFn dequantize;
  QuantLinearFn quantized_linear;
};

bool cpu_has_avx2() {
#if defined(PYAGENT_HAVE_AVX2) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  // F16C (half conversions, in the quantized kernels) came before AVX2 on every CPU
  // with both; asked anyway since the AVX2 build may use it.
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

Kernels kernels(const std::string& isa) {
  static const bool has_avx2 = cpu_has_avx2();
  const Kernels generic_kernels{generic::paged_decode_items, generic::linear_rows, generic::dequantize_rows,
                                generic::quantized_linear_rows};
  if (isa == "generic") return generic_kernels;
  if (isa == "avx2" || isa == "auto") {
#if defined(PYAGENT_HAVE_AVX2)
    if (has_avx2) {
      return Kernels{avx2::paged_decode_items, avx2::linear_rows, avx2::dequantize_rows, avx2::quantized_linear_rows};
    }
#endif
    if (isa == "auto") return generic_kernels;
    throw std::invalid_argument("isa 'avx2' is not available on this CPU or in this build");
  }
  throw std::invalid_argument("unknown isa '" + isa + "' (expected 'auto', 'generic' or 'avx2')");
}

// fn(begin, end) over contiguous slices of [0, N) on up to num_threads threads, in
// multiples of four rows (the kernels' step); a thread gets at least 64 rows so a
// small layer is not split into crumbs.
template <typename Fn>
void split_rows(int64_t N, int num_threads, const Fn& fn) {
  const int64_t quads = (N + 3) / 4;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(num_threads, quads / 16));
  ThreadPool::instance().run(static_cast<int>(threads), [&](int t) {
    const int64_t begin = std::min(N, quads * t / threads * 4);
    const int64_t end = std::min(N, quads * (t + 1) / threads * 4);
    if (begin < end) fn(begin, end);
  });
}

}  // namespace

std::string best_isa() {
  return cpu_has_avx2() ? "avx2" : "generic";
}

void paged_decode_attention(const DecodeArgs& args, int num_threads, const std::string& isa) {
  const DecodeFn fn = kernels(isa).decode;
  const int64_t num_items = args.num_seqs * args.num_kv_heads;
  if (num_items == 0) return;
  // Items are claimed one at a time from a shared counter: sequences differ in length,
  // so a static split would leave a thread idle.
  std::atomic<int64_t> next{0};
  std::atomic<bool> ok{true};
  auto worker = [&]() {
    std::vector<float> scratch;
    for (int64_t item; (item = next.fetch_add(1, std::memory_order_relaxed)) < num_items;) {
      if (!fn(args, item, item + 1, scratch)) ok.store(false, std::memory_order_relaxed);
    }
  };
  // A thread per ~4K key rows at least: a single short sequence is done sooner on the
  // calling thread than a worker wakes up.
  int64_t rows = 0;
  for (int64_t s = 0; s < args.num_seqs; ++s) rows += args.seq_lens[s];
  rows *= args.num_kv_heads;
  const int64_t useful = std::max<int64_t>(1, std::min(num_items, rows / 4096));
  const int threads = static_cast<int>(std::min<int64_t>(num_threads, useful));
  ThreadPool::instance().run(threads, [&](int) { worker(); });
  if (!ok.load()) {
    // Find the first offending entry for the message (cheap: only on error).
    for (int64_t s = 0; s < args.num_seqs; ++s) {
      const int64_t len = args.seq_lens[s];
      const int64_t used = (len + args.block_size - 1) / args.block_size;
      const int64_t first = first_visible_token(len, args.sliding_window);
      for (int64_t b = first / args.block_size; b < used; ++b) {
        const int32_t id = args.block_tables[s * args.table_stride + b];
        if (id < 0 || id >= args.num_blocks) {
          throw std::out_of_range("block_tables[" + std::to_string(s) + ", " + std::to_string(b) + "] = " +
                                  std::to_string(id) + " is outside the cache's " +
                                  std::to_string(args.num_blocks) + " blocks");
        }
      }
    }
    throw std::out_of_range("block_tables points outside the cache");
  }
}

void linear(const LinearArgs& args, int num_threads, const std::string& isa) {
  const LinearFn fn = kernels(isa).linear;
  split_rows(args.N, num_threads, [&](int64_t begin, int64_t end) { fn(args, begin, end); });
}

void dequantize(const QuantWeight& w, float* out, int num_threads, const std::string& isa) {
  const DequantizeFn fn = kernels(isa).dequantize;
  split_rows(w.N, num_threads, [&](int64_t begin, int64_t end) { fn(w, out, begin, end); });
}

void quantized_linear(const QuantLinearArgs& args, int num_threads, const std::string& isa) {
  const QuantLinearFn fn = kernels(isa).quantized_linear;
  split_rows(args.w.N, num_threads, [&](int64_t begin, int64_t end) { fn(args, begin, end); });
}

}  // namespace pyagent
