// The experts of one mixture-of-experts layer, grouped by expert, in one call:
// `_core.MoeExperts`, built once per layer from its experts' weights (float32 or
// packed, kept alive by the object), then called once per forward.
//
// For T tokens routed to k experts each, out[t] = sum_j w[t, j] * expert_{e[t, j]}(x[t])
// with expert(x) = down(silu(gate(x)) * up(x)). The (token, slot) pairs are sorted by
// expert (a stable counting sort), each expert's rows gathered into one block, and
// the block multiplied by the expert's weights, which are thus read once per call
// however many tokens chose the expert. The products of every expert run in one
// thread-pool region per projection: the work is cut into tiles of output features
// (expert, rows [a, b)) that threads claim from a shared counter, so a busy expert
// and an idle one share the threads. A gate/up tile takes rows [a, b) of gate and the
// same rows of up, so it applies SiLU-and-mul to its own outputs (no pass between).
// The per-row kernels are the ones quantized_linear / linear use (quant.cpp,
// linear.cpp), for the instruction set dispatch picks.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "array_checks.h"
#include "decoder.h"
#include "dispatch.h"
#include "quant_names.h"
#include "thread_pool.h"

namespace py = pybind11;

namespace {

using pyagent::LinearPart;
using pyagent::bindings::checked;
using pyagent::bindings::expect_dim;

// Output features per tile: a multiple of the kernels' four-row step, small enough
// that a layer of a few experts still gives every thread several tiles.
constexpr int64_t kTile = 32;

// Rows [n_begin, n_end) of out[M, part.N] = x[M, K] @ part^T (+ bias).
void part_rows(const pyagent::Kernels& k, const LinearPart& p, float* out, const float* x, int64_t M, int64_t n_begin,
               int64_t n_end) {
  if (p.is_packed) {
    k.quantized_linear(pyagent::packed_args(p, out, x, M), n_begin, n_end);
  } else {
    k.linear(pyagent::float_args(p, out, x, M), n_begin, n_end);
  }
}

// One expert: gate_up as one part of 2I rows (gate then up) or two of I rows each;
// down one part of H rows.
struct Expert {
  std::vector<LinearPart> gate_up;
  LinearPart down;
};

class MoeExperts {
 public:
  MoeExperts(int64_t hidden, int64_t intermediate, const py::list& experts) : H_(hidden), I_(intermediate) {
    if (hidden < 1 || intermediate < 1) {
      throw py::value_error("MoeExperts: hidden (" + std::to_string(hidden) + ") and intermediate (" +
                            std::to_string(intermediate) + ") must be >= 1");
    }
    if (experts.size() == 0) throw py::value_error("MoeExperts: no experts");
    for (size_t e = 0; e < experts.size(); ++e) {
      const std::string at = "experts[" + std::to_string(e) + "]";
      if (!py::isinstance<py::dict>(experts[e])) throw py::value_error(at + ": expected a dict {'gate_up', 'down'}");
      const py::dict d = experts[e].cast<py::dict>();
      for (const char* key : {"gate_up", "down"}) {
        if (!d.contains(key)) throw py::value_error(at + "." + key + " is required");
      }
      Expert x{};
      const py::dict gate_up = operand(d["gate_up"], at + ".gate_up");
      if (gate_up.contains("parts")) {
        const py::sequence parts = gate_up["parts"].cast<py::sequence>();
        if (parts.size() != 2) {
          throw py::value_error(at + ".gate_up.parts: expected two operands (gate, up), got " +
                                std::to_string(parts.size()));
        }
        for (size_t i = 0; i < 2; ++i) {
          const std::string name = at + ".gate_up.parts[" + std::to_string(i) + "]";
          x.gate_up.push_back(part(operand(parts[i], name), name, I_, H_));
        }
      } else {
        x.gate_up.push_back(part(gate_up, at + ".gate_up", 2 * I_, H_));
      }
      x.down = part(operand(d["down"], at + ".down"), at + ".down", H_, I_);
      experts_.push_back(std::move(x));
    }
  }

  int64_t num_experts() const { return static_cast<int64_t>(experts_.size()); }

  // out[T, H] = the layer's experts applied to x[T, H] as routed by expert_ids[T, k]
  // (int64) with routing_weights[T, k] (float32).
  void forward(py::array out, py::array x, py::array expert_ids, py::array routing_weights, int num_threads,
               const std::string& isa) {
    float* dst = const_cast<float*>(checked<float>(out, "out", 2, true));
    const float* src = checked<float>(x, "x", 2);
    const int64_t* ids = checked<int64_t>(expert_ids, "expert_ids", 2);
    const float* weights = checked<float>(routing_weights, "routing_weights", 2);
    const int64_t T = x.shape(0), k = expert_ids.shape(1);
    expect_dim(x, "x", 1, H_, "hidden size");
    expect_dim(out, "out", 0, T, "x's rows");
    expect_dim(out, "out", 1, H_, "hidden size");
    expect_dim(expert_ids, "expert_ids", 0, T, "x's rows");
    expect_dim(routing_weights, "routing_weights", 0, T, "x's rows");
    expect_dim(routing_weights, "routing_weights", 1, k, "expert_ids' columns");
    if (num_threads < 1) throw py::value_error("num_threads must be >= 1");
    const int64_t E = num_experts();
    for (int64_t i = 0; i < T * k; ++i) {
      if (ids[i] < 0 || ids[i] >= E) {
        throw py::value_error("expert_ids[" + std::to_string(i / k) + ", " + std::to_string(i % k) + "] = " +
                              std::to_string(ids[i]) + " is not one of the " + std::to_string(E) + " experts");
      }
    }
    const pyagent::Kernels kernels = pyagent::kernels_for(isa);
    py::gil_scoped_release release;
    const std::lock_guard<std::mutex> lock(mutex_);  // the scratch is the object's
    run(kernels, dst, src, ids, weights, T, k, num_threads);
  }

 private:
  static py::dict operand(const py::handle& obj, const std::string& name) {
    if (!py::isinstance<py::dict>(obj)) {
      throw py::value_error(name + ": expected a dict ({'weight', 'bias'}, {'data', 'encoding', 'group', 'bias'} "
                            "or {'parts'})");
    }
    return py::reinterpret_borrow<py::dict>(obj);
  }

  // One operand of N output features of K inputs, float32 or packed.
  LinearPart part(const py::dict& op, const std::string& name, int64_t N, int64_t K) {
    LinearPart p{};
    p.N = N;
    p.K = K;
    if (op.contains("parts")) throw py::value_error(name + ": expected one operand, not parts");
    if (op.contains("weight")) {
      const py::array w = array(op["weight"], name + ".weight");
      p.weight = checked<float>(w, name + ".weight", 2);
      expect_dim(w, name + ".weight", 0, N, "output features");
      expect_dim(w, name + ".weight", 1, K, "input features");
    } else if (op.contains("data")) {
      for (const char* required : {"encoding", "group"}) {
        if (!op.contains(required)) throw py::value_error(name + "." + required + " is required with 'data'");
      }
      const std::string encoding = op["encoding"].cast<std::string>();
      p.is_packed = true;
      p.packed.group = op["group"].cast<int64_t>();
      p.packed.K = K;
      p.packed.N = N;
      try {
        p.packed.encoding = pyagent::parse_quant_encoding(encoding);
        if (op.contains("activations")) p.activations = pyagent::parse_activations(op["activations"].cast<std::string>());
        p.packed.row_bytes = pyagent::checked_row_bytes(encoding, K, p.packed.group);
      } catch (const std::invalid_argument& exc) {
        throw py::value_error(name + ": " + exc.what());
      }
      const py::array data = array(op["data"], name + ".data");
      p.packed.data = checked<uint8_t>(data, name + ".data", 2);
      expect_dim(data, name + ".data", 0, N, "output features");
      expect_dim(data, name + ".data", 1, p.packed.row_bytes, encoding + " bytes per row of " + std::to_string(K));
    } else {
      throw py::value_error(name + ": expected 'weight' (float32) or 'data' (packed)");
    }
    if (op.contains("bias") && !op["bias"].is_none()) {
      const py::array b = array(op["bias"], name + ".bias");
      p.bias = checked<float>(b, name + ".bias", 1);
      expect_dim(b, name + ".bias", 0, N, "output features");
    }
    return p;
  }

  py::array array(const py::handle& obj, const std::string& name) {
    if (!py::isinstance<py::array>(obj)) throw py::value_error(name + ": expected a numpy array");
    keep_.push_back(py::reinterpret_borrow<py::object>(obj));
    return py::reinterpret_borrow<py::array>(obj);
  }

  // fn(tile) for every tile in [0, tiles) on up to num_threads threads.
  template <typename Fn>
  static void for_tiles(int64_t tiles, int num_threads, const Fn& fn) {
    std::atomic<int64_t> next{0};
    const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, tiles)));
    pyagent::ThreadPool::instance().run(threads, [&](int) {
      for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < tiles;) fn(t);
    });
  }

  void run(const pyagent::Kernels& kernels, float* out, const float* x, const int64_t* ids, const float* weights,
           int64_t T, int64_t k, int num_threads) {
    const int64_t E = num_experts(), pairs = T * k, H = H_, I = I_;
    // Counting sort of the (token, slot) pairs by expert; stable, so each expert's
    // rows keep the batch's order. Row r of the grouped blocks is pair order[r].
    std::vector<int64_t> start(E + 1, 0), order(pairs), row_of(pairs);
    for (int64_t i = 0; i < pairs; ++i) ++start[ids[i] + 1];
    for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < pairs; ++i) {
      const int64_t r = fill[ids[i]]++;
      order[r] = i;
      row_of[i] = r;
    }
    grow(xg_, pairs * H);
    grow(gate_up_, pairs * 2 * I);
    grow(act_, pairs * I);
    grow(yg_, pairs * H);
    for (int64_t r = 0; r < pairs; ++r) std::copy(x + order[r] / k * H, x + (order[r] / k + 1) * H, &xg_[r * H]);

    // Tiles: (expert, first output feature) for every expert with rows.
    std::vector<std::pair<int64_t, int64_t>> tiles;
    auto make_tiles = [&](int64_t n) {
      tiles.clear();
      for (int64_t e = 0; e < E; ++e) {
        if (start[e + 1] > start[e]) {
          for (int64_t a = 0; a < n; a += kTile) tiles.emplace_back(e, a);
        }
      }
    };

    // gate/up and SiLU-and-mul: a tile computes gate rows [a, b) and up rows [a, b)
    // of its expert for all the expert's rows, then act[:, a:b].
    make_tiles(I);
    for_tiles(static_cast<int64_t>(tiles.size()), num_threads, [&](int64_t t) {
      const auto [e, a] = tiles[t];
      const int64_t b = std::min(a + kTile, I), r0 = start[e], M = start[e + 1] - r0;
      const Expert& w = experts_[e];
      const float* xe = &xg_[r0 * H];
      float* block = &gate_up_[r0 * 2 * I];  // [M, 2I] (one part) or [M, I] gate then [M, I] up
      const float *gate, *up;
      int64_t stride;
      if (w.gate_up.size() == 1) {
        part_rows(kernels, w.gate_up[0], block, xe, M, a, b);
        part_rows(kernels, w.gate_up[0], block, xe, M, I + a, I + b);
        gate = block, up = block + I, stride = 2 * I;
      } else {
        part_rows(kernels, w.gate_up[0], block, xe, M, a, b);
        part_rows(kernels, w.gate_up[1], block + M * I, xe, M, a, b);
        gate = block, up = block + M * I, stride = I;
      }
      kernels.silu_mul(pyagent::SiluMulArgs{&act_[r0 * I] + a, gate + a, up + a, b - a, stride, I}, 0, M);
    });

    // down: rows [a, b) of the expert's output for all its rows.
    make_tiles(H);
    for_tiles(static_cast<int64_t>(tiles.size()), num_threads, [&](int64_t t) {
      const auto [e, a] = tiles[t];
      const int64_t r0 = start[e], M = start[e + 1] - r0;
      part_rows(kernels, experts_[e].down, &yg_[r0 * H], &act_[r0 * I], M, a, std::min(a + kTile, H));
    });

    // Each token's k results, weighted, summed in expert order (transformers' order).
    std::vector<int64_t> slots(k);
    for (int64_t tok = 0; tok < T; ++tok) {
      for (int64_t j = 0; j < k; ++j) slots[j] = tok * k + j;
      std::sort(slots.begin(), slots.end(), [&](int64_t p, int64_t q) { return row_of[p] < row_of[q]; });
      float* o = out + tok * H;
      std::fill(o, o + H, 0.0f);
      for (int64_t p : slots) {
        const float w = weights[p];
        const float* y = &yg_[row_of[p] * H];
        for (int64_t h = 0; h < H; ++h) o[h] += y[h] * w;
      }
    }
  }

  static void grow(std::vector<float>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  }

  int64_t H_, I_;
  std::vector<Expert> experts_;
  std::vector<py::object> keep_;  // the arrays the weights point into
  std::vector<float> xg_, gate_up_, act_, yg_;  // scratch, grown on demand
  std::mutex mutex_;
};

}  // namespace

void bind_moe(py::module_& m) {
  py::class_<MoeExperts>(m, "MoeExperts",
                         "The experts of one mixture-of-experts layer, computed grouped by expert in one call "
                         "(see csrc/moe.cpp).")
      .def(py::init<int64_t, int64_t, const py::list&>(), py::arg("hidden"), py::arg("intermediate"),
           py::arg("experts"))
      .def("forward", &MoeExperts::forward, py::arg("out"), py::arg("x"), py::arg("expert_ids"),
           py::arg("routing_weights"), py::arg("num_threads") = 1, py::arg("isa") = "auto",
           "out[T, hidden] = sum over each token's k experts of routing_weights * expert(x).")
      .def("__len__", &MoeExperts::num_experts);
}
