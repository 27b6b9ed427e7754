// Python binding of the fused decode step (decoder.h): `_core.DecoderStack`, built
// once per model from its layers' arrays (kept alive by the object), then called once
// per decode step. Every array is checked here, so a wrong one is a ValueError naming
// it, never a read out of bounds.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "array_checks.h"
#include "decoder.h"
#include "kv_quant.h"
#include "quant_names.h"

namespace py = pybind11;

namespace {

// `obj` as a T array of `shape` (-1: any size) through the shared checks.
template <typename T>
T* array_data(const py::handle& obj, const std::string& name, std::vector<py::ssize_t> shape, bool writable = false,
              const std::string& what = "from the stack's shape and the batch") {
  if (!py::isinstance<py::array>(obj)) throw py::value_error(name + ": expected a numpy array");
  const py::array arr = py::reinterpret_borrow<py::array>(obj);
  T* data = const_cast<T*>(pyagent::bindings::checked<T>(arr, name, static_cast<py::ssize_t>(shape.size()), writable));
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] >= 0) pyagent::bindings::expect_dim(arr, name, static_cast<int>(i), shape[i], what);
  }
  return data;
}

class DecoderStack {
 public:
  DecoderStack(int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate,
               float eps, float scale, const py::list& layers) {
    if (hidden < 1 || num_heads < 1 || num_kv_heads < 1 || head_dim < 2 || head_dim % 2 || intermediate < 1 ||
        num_heads % num_kv_heads) {
      throw py::value_error("DecoderStack: inconsistent shape (hidden " + std::to_string(hidden) + ", heads " +
                            std::to_string(num_heads) + "/" + std::to_string(num_kv_heads) + ", head_dim " +
                            std::to_string(head_dim) + ", intermediate " + std::to_string(intermediate) + ")");
    }
    shape_ = {hidden, num_heads, num_kv_heads, head_dim, intermediate, eps, scale};
    const int64_t qkv = (num_heads + 2 * num_kv_heads) * head_dim;
    for (size_t i = 0; i < layers.size(); ++i) {
      const py::dict layer = layers[i].cast<py::dict>();
      const std::string at = "layers[" + std::to_string(i) + "]";
      pyagent::DecoderLayerWeights w{};
      w.input_norm = vector(layer, "input_norm", at, hidden, false);
      w.post_norm = vector(layer, "post_norm", at, hidden, false);
      w.q_norm = vector(layer, "q_norm", at, head_dim, true);
      w.k_norm = vector(layer, "k_norm", at, head_dim, true);
      w.qkv = linear_weight(layer, "qkv", at, qkv, hidden);
      w.o = linear_weight(layer, "o", at, hidden, num_heads * head_dim);
      w.gate_up = linear_weight(layer, "gate_up", at, 2 * intermediate, hidden);
      w.down = linear_weight(layer, "down", at, hidden, intermediate);
      w.sliding_window = layer["sliding_window"].cast<int64_t>();
      if (w.sliding_window < 0) throw py::value_error(at + ".sliding_window must be >= 0");
      layers_.push_back(w);
    }
  }

  void decode(py::array x, py::array cos, py::array sin, const py::list& kv_caches, py::array slots,
              py::array block_tables, py::array seq_lens, int num_threads, const py::object& lora_slots,
              const std::string& kv_dtype) {
    pyagent::KVCodes codes;
    try {
      codes = pyagent::parse_kv_dtype(kv_dtype);
    } catch (const std::invalid_argument& exc) {
      throw py::value_error(exc.what());
    }
    pyagent::DecoderBatch b{};
    b.x = array_data<float>(x, "x", {-1, shape_.hidden}, true);
    b.T = x.shape(0);
    const int64_t half = shape_.head_dim / 2;
    b.cos = array_data<float>(cos, "cos", {b.T, half});
    b.sin = array_data<float>(sin, "sin", {b.T, half});
    b.slots = array_data<int64_t>(slots, "slots", {b.T});
    b.block_tables = array_data<int32_t>(block_tables, "block_tables", {b.T, -1});
    b.table_stride = block_tables.shape(1);
    b.seq_lens = array_data<int32_t>(seq_lens, "seq_lens", {b.T});
    for (int64_t t = 0; t < b.T; ++t) {
      if (b.seq_lens[t] < 1) {
        throw py::value_error("seq_lens[" + std::to_string(t) + "] = " + std::to_string(b.seq_lens[t]) +
                              ": a decoding sequence holds at least its new token");
      }
    }
    if (kv_caches.size() != layers_.size()) {
      throw py::value_error("kv_caches: " + std::to_string(kv_caches.size()) + " caches for " +
                            std::to_string(layers_.size()) + " layers");
    }
    std::vector<pyagent::LayerCache> caches;
    for (size_t l = 0; l < layers_.size(); ++l) {
      const std::string name = "kv_caches[" + std::to_string(l) + "]";
      py::array cache = kv_caches[l].cast<py::array>();
      float* data = nullptr;
      uint8_t* bytes = nullptr;
      if (codes == pyagent::KVCodes::None) {
        data = array_data<float>(cache, name, {2, -1, -1, shape_.num_kv_heads, shape_.head_dim}, true);
      } else {
        const int64_t row = pyagent::kv_row_bytes(shape_.head_dim);
        bytes = array_data<uint8_t>(cache, name, {2, -1, -1, shape_.num_kv_heads, row}, true,
                                    "the stack's shape: head_dim codes and their scales' bytes");
      }
      const int64_t num_blocks = cache.shape(1), block_size = cache.shape(2);
      for (int64_t t = 0; t < b.T; ++t) {
        if (b.seq_lens[t] > b.table_stride * block_size) {
          throw py::value_error("seq_lens[" + std::to_string(t) + "] = " + std::to_string(b.seq_lens[t]) +
                                " does not fit its block table (" + std::to_string(b.table_stride) + " blocks of " +
                                std::to_string(block_size) + ")");
        }
      }
      if (codes == pyagent::KVCodes::None) {
        const int64_t half_cache = num_blocks * block_size * shape_.num_kv_heads * shape_.head_dim;
        caches.push_back({data, data + half_cache, num_blocks, block_size});
      } else {
        const int64_t half_cache =
            num_blocks * block_size * shape_.num_kv_heads * pyagent::kv_row_bytes(shape_.head_dim);
        caches.push_back({nullptr, nullptr, num_blocks, block_size, bytes, bytes + half_cache, codes});
      }
    }
    if (!lora_slots.is_none()) {
      if (lora_slots_ < 0) throw py::value_error("lora_slots: no layer of this stack has LoRA adapters");
      b.lora_slots = array_data<int32_t>(lora_slots, "lora_slots", {b.T});
      for (int64_t t = 0; t < b.T; ++t) {
        if (b.lora_slots[t] < -1 || b.lora_slots[t] >= lora_slots_) {
          throw py::value_error("lora_slots[" + std::to_string(t) + "] = " + std::to_string(b.lora_slots[t]) +
                                ": expected -1 (none) or a slot below " + std::to_string(lora_slots_));
        }
      }
    }
    if (num_threads < 1) throw py::value_error("num_threads must be >= 1");
    py::gil_scoped_release release;
    pyagent::decode_layers(shape_, layers_, caches, b, ws_, num_threads);
  }

  size_t num_layers() const { return layers_.size(); }
  bool has_lora() const { return lora_slots_ >= 0; }

 private:
  const float* vector(const py::dict& layer, const char* key, const std::string& at, int64_t n, bool optional) {
    const py::object obj = layer.contains(key) ? py::object(layer[key]) : py::object(py::none());
    if (obj.is_none()) {
      if (optional) return nullptr;
      throw py::value_error(at + "." + key + " is required");
    }
    keep_.push_back(obj);
    return array_data<float>(obj, at + "." + key, {n});
  }

  // The layer's linear `key`, N output features of K inputs: one operand ({"weight",
  // "bias"} or {"data", "encoding", "group", "bias", "activations"}), or
  // {"parts": [operand, ...]} whose rows, in order, add up to N.
  pyagent::LinearWeight linear_weight(const py::dict& layer, const char* key, const std::string& at, int64_t N,
                                      int64_t K) {
    const std::string name = at + "." + key;
    if (!layer.contains(key)) throw py::value_error(name + " is required");
    const py::dict op = operand_dict(layer[key], name);
    pyagent::LinearWeight w{};
    w.N = N;
    w.K = K;
    w.lora = lora_weight(op, name, N, K);
    if (!op.contains("parts")) {
      w.parts.push_back(linear_part(op, name, N, K));
      return w;
    }
    const py::object parts = op["parts"];
    if (!py::isinstance<py::list>(parts) && !py::isinstance<py::tuple>(parts)) {
      throw py::value_error(name + ".parts: expected a list of operands");
    }
    int64_t rows = 0;
    std::string sizes;
    const py::sequence seq = py::reinterpret_borrow<py::sequence>(parts);
    for (size_t i = 0; i < seq.size(); ++i) {
      const std::string part_name = name + ".parts[" + std::to_string(i) + "]";
      w.parts.push_back(linear_part(operand_dict(seq[i], part_name), part_name, -1, K));
      rows += w.parts.back().N;
      sizes += (sizes.empty() ? "" : " + ") + std::to_string(w.parts.back().N);
    }
    if (w.parts.empty()) throw py::value_error(name + ".parts: expected at least one operand");
    if (rows != N) {
      throw py::value_error(name + ".parts: " + sizes + " = " + std::to_string(rows) + " rows, expected " +
                            std::to_string(N) + " (the layer's output features, from the stack's shape)");
    }
    return w;
  }

  // An operand's optional LoRA adapters: "lora_a" [slots, R, K] and "lora_b" [slots, N, R],
  // float32, both or neither; every layer with adapters has the same number of slots.
  pyagent::LoRAWeight lora_weight(const py::dict& op, const std::string& name, int64_t N, int64_t K) {
    pyagent::LoRAWeight l{};
    const bool has_a = op.contains("lora_a"), has_b = op.contains("lora_b");
    if (!has_a && !has_b) return l;
    if (!has_a || !has_b) throw py::value_error(name + ": lora_a and lora_b come together");
    const py::array a = py::reinterpret_borrow<py::array>(op["lora_a"]);
    array_data<float>(op["lora_a"], name + ".lora_a", {-1, -1, K});
    l.slots = a.shape(0);
    l.rank = a.shape(1);
    l.a = array_data<float>(op["lora_a"], name + ".lora_a", {l.slots, l.rank, K});
    int64_t b_rank = l.rank;
    if (op.contains("lora_parts")) {
      int64_t next = 0;
      for (const py::handle& span : op["lora_parts"].cast<py::list>()) {
        const auto pair = span.cast<std::pair<int64_t, int64_t>>();
        if (pair.first != next || pair.second < 1) {
          throw py::value_error(name + ".lora_parts: parts must follow each other from row 0, each of 1 row or more");
        }
        next = pair.first + pair.second;
        l.parts.push_back(pair);
      }
      if (next != N || l.parts.empty() || l.rank % static_cast<int64_t>(l.parts.size())) {
        throw py::value_error(name + ".lora_parts: the parts must cover the layer's " + std::to_string(N) +
                              " rows and divide lora_a's " + std::to_string(l.rank) + " rows evenly");
      }
      b_rank = l.rank / static_cast<int64_t>(l.parts.size());
    }
    l.b = array_data<float>(op["lora_b"], name + ".lora_b", {l.slots, N, b_rank});
    if (lora_slots_ >= 0 && l.slots != lora_slots_) {
      throw py::value_error(name + ".lora_a: " + std::to_string(l.slots) + " slots, other layers have " +
                            std::to_string(lora_slots_));
    }
    lora_slots_ = l.slots;
    keep_.push_back(op["lora_a"]);
    keep_.push_back(op["lora_b"]);
    return l;
  }

  static py::dict operand_dict(const py::handle& obj, const std::string& name) {
    if (!py::isinstance<py::dict>(obj)) {
      throw py::value_error(name + ": expected a dict ({'weight', 'bias'}, {'data', 'encoding', 'group', 'bias'} "
                            "or {'parts'}), got " + std::string(py::str(py::type::of(obj).attr("__name__"))));
    }
    return py::reinterpret_borrow<py::dict>(obj);
  }

  // One operand of K input features; N output features (-1: as many as it holds).
  pyagent::LinearPart linear_part(const py::dict& op, const std::string& name, int64_t N, int64_t K) {
    pyagent::LinearPart w{};
    w.K = K;
    if (op.contains("weight")) {
      keep_.push_back(op["weight"]);
      w.weight = array_data<float>(op["weight"], name + ".weight", {N, K});
      w.N = py::reinterpret_borrow<py::array>(op["weight"]).shape(0);
    } else if (op.contains("data")) {
      for (const char* required : {"encoding", "group"}) {
        if (!op.contains(required)) throw py::value_error(name + "." + required + " is required with 'data'");
      }
      const std::string encoding = op["encoding"].cast<std::string>();
      w.is_packed = true;
      w.packed.group = op["group"].cast<int64_t>();
      w.packed.K = K;
      try {
        w.packed.encoding = pyagent::parse_quant_encoding(encoding);
        if (op.contains("activations")) w.activations = pyagent::parse_activations(op["activations"].cast<std::string>());
        w.packed.row_bytes = pyagent::checked_row_bytes(encoding, K, w.packed.group);
      } catch (const std::invalid_argument& exc) {
        throw py::value_error(name + ": " + exc.what());
      }
      keep_.push_back(op["data"]);
      const std::string what = encoding + " rows of " + std::to_string(K) + " input features";
      array_data<uint8_t>(op["data"], name + ".data", {-1, w.packed.row_bytes}, false, what);
      w.packed.data = array_data<uint8_t>(op["data"], name + ".data", {N, w.packed.row_bytes});
      w.N = w.packed.N = py::reinterpret_borrow<py::array>(op["data"]).shape(0);
    } else {
      throw py::value_error(name + ": expected 'weight' (float32) or 'data' (packed)");
    }
    if (op.contains("bias") && !op["bias"].is_none()) {
      keep_.push_back(op["bias"]);
      w.bias = array_data<float>(op["bias"], name + ".bias", {w.N});
    }
    return w;
  }

  pyagent::DecoderShape shape_{};
  std::vector<pyagent::DecoderLayerWeights> layers_;
  std::vector<py::object> keep_;  // the arrays the weights point into
  int64_t lora_slots_ = -1;  // the adapters' slots (-1: no layer has any)
  pyagent::DecoderWorkspace ws_;
};

}  // namespace

void bind_decoder(py::module_& m) {
  py::class_<DecoderStack>(m, "DecoderStack",
                           "A Llama-family decoder stack's decode step in one call (see csrc/decoder.h).")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, float, float, const py::list&>(),
           py::arg("hidden"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
           py::arg("intermediate"), py::arg("eps"), py::arg("scale"), py::arg("layers"))
      .def("decode", &DecoderStack::decode, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("kv_caches"),
           py::arg("slots"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("num_threads") = 1,
           py::arg("lora_slots") = py::none(), py::arg("kv_dtype") = "auto",
           "Advance x [T, hidden] in place through every layer: T sequences, one new token each; "
           "lora_slots (int32 [T], -1: none) picks each row's LoRA adapter in the layers that have them. "
           "kv_dtype: 'auto' (float32 caches [2, blocks, block_size, kv_heads, head_dim]) or 'int8' / 'fp8' "
           "(uint8 caches [2, blocks, block_size, kv_heads, head_dim + 2 * groups]: each row's codes and float16 "
           "scales, "
           "the new rows written as kv_cache_format.quantize writes them).")
      .def_property_readonly("has_lora", &DecoderStack::has_lora)
      .def("__len__", &DecoderStack::num_layers);
}
