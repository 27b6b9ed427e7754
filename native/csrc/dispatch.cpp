#include "dispatch.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <stdexcept>
#include <vector>

#include "thread_pool.h"

namespace pyagent {
namespace {

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

bool cpu_has_avx512() {
#if defined(PYAGENT_HAVE_AVX512) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  // The OS must save the 512-bit state too: __builtin_cpu_supports asks XGETBV.
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

const char* const kEnv = "PYAGENT_NATIVE_ISA";

// The build "auto" names: PYAGENT_NATIVE_ISA's (checked when it is used), else the best.
const std::string& auto_isa() {
  static const std::string chosen = [] {
    const char* env = std::getenv(kEnv);
    std::string name = env == nullptr ? "" : env;
    if (name.empty() || name == "auto") return std::string(cpu_has_avx512() ? "avx512" : cpu_has_avx2() ? "avx2" : "generic");
    return name;
  }();
  return chosen;
}

}  // namespace

Kernels kernels_for(const std::string& requested) {
  static const bool has_avx2 = cpu_has_avx2(), has_avx512 = cpu_has_avx512();
  const char* env = std::getenv(kEnv);
  const bool from_env = requested == "auto" && env != nullptr && *env != '\0' && std::string(env) != "auto";
  const std::string& isa = requested == "auto" ? auto_isa() : requested;
  const std::string source = from_env ? std::string(" (from ") + kEnv + ")" : "";
  if (isa == "generic" || isa == "portable") {
    return Kernels{generic::paged_decode_items, generic::linear_rows, generic::dequantize_rows,
                   generic::quantized_linear_rows, generic::silu_mul_rows, generic::int8_gemm};
  }
  if (isa == "avx2") {
#if defined(PYAGENT_HAVE_AVX2)
    if (has_avx2) {
      return Kernels{avx2::paged_decode_items, avx2::linear_rows, avx2::dequantize_rows, avx2::quantized_linear_rows,
                     avx2::silu_mul_rows, avx2::int8_gemm};
    }
#endif
    throw std::invalid_argument("isa 'avx2'" + source + " is not available on this CPU or in this build");
  }
  if (isa == "avx512") {
#if defined(PYAGENT_HAVE_AVX512)
    if (has_avx512) {
      return Kernels{avx512::paged_decode_items, avx512::linear_rows, avx512::dequantize_rows,
                     avx512::quantized_linear_rows, avx512::silu_mul_rows, avx512::int8_gemm};
    }
#endif
    throw std::invalid_argument("isa 'avx512'" + source + " is not available on this CPU or in this build");
  }
  throw std::invalid_argument("unknown isa '" + isa + "'" + source +
                              " (expected 'auto', 'generic' (or 'portable'), 'avx2' or 'avx512')");
}

namespace {

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
  kernels_for("auto");  // a PYAGENT_NATIVE_ISA this CPU cannot run throws here, naming it
  const std::string& isa = auto_isa();
  return isa == "portable" ? "generic" : isa;
}

std::vector<std::string> available_isas() {
  std::vector<std::string> isas{"generic"};
  if (cpu_has_avx2()) isas.push_back("avx2");
  if (cpu_has_avx512()) isas.push_back("avx512");
  return isas;
}

void paged_decode_attention(const DecodeArgs& args, int num_threads, const std::string& isa) {
  const DecodeFn fn = kernels_for(isa).decode;
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
  const LinearFn fn = kernels_for(isa).linear;
  split_rows(args.N, num_threads, [&](int64_t begin, int64_t end) { fn(args, begin, end); });
}

void dequantize(const QuantWeight& w, float* out, int num_threads, const std::string& isa) {
  const DequantizeFn fn = kernels_for(isa).dequantize;
  split_rows(w.N, num_threads, [&](int64_t begin, int64_t end) { fn(w, out, begin, end); });
}

void quantized_linear(const QuantLinearArgs& args, int num_threads, const std::string& isa) {
  const QuantLinearFn fn = kernels_for(isa).quantized_linear;
  split_rows(args.w.N, num_threads, [&](int64_t begin, int64_t end) { fn(args, begin, end); });
}

void silu_and_mul(const SiluMulArgs& args, int64_t rows, int num_threads, const std::string& isa) {
  const SiluMulFn fn = kernels_for(isa).silu_mul;
  // A thread per 16K elements at least: fewer are done before a worker wakes up.
  const int64_t useful = std::max<int64_t>(1, std::min<int64_t>(rows, rows * args.n / 16384));
  const int threads = static_cast<int>(std::min<int64_t>(num_threads, useful));
  if (threads <= 1) {
    fn(args, 0, rows);
    return;
  }
  ThreadPool::instance().run(threads, [&](int t) { fn(args, rows * t / threads, rows * (t + 1) / threads); });
}

}  // namespace pyagent
