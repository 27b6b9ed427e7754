// Python bindings of the native core. Arrays arrive as numpy views of torch tensors
// (zero-copy); every shape, dtype and layout is checked here, so a wrong argument is a
// ValueError naming it, never a read out of bounds.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "array_checks.h"
#include "dispatch.h"
#include "kv_quant.h"
#include "policies.h"
#include "prefix.h"
#include "quant_names.h"

namespace py = pybind11;

void bind_decoder(py::module_& m);  // decoder_bindings.cpp
void bind_moe(py::module_& m);      // moe.cpp

namespace {

using pyagent::bindings::checked;
using pyagent::bindings::expect_dim;

// A quantized cache's bytes: uint8 (or int8, the int8 codes as they are) [blocks,
// block_size, kv_heads, kv_row_bytes(head_size)], C-contiguous.
const uint8_t* checked_codes(const py::array& arr, const std::string& name) {
  if (py::isinstance<py::array_t<int8_t>>(arr) && arr.dtype().is(py::dtype::of<int8_t>())) {
    return reinterpret_cast<const uint8_t*>(checked<int8_t>(arr, name, 4));
  }
  return checked<uint8_t>(arr, name, 4);
}

void paged_decode_attention(py::array out, py::array query, py::array key_cache, py::array value_cache,
                            py::array block_tables, py::array seq_lens, float scale, int num_threads,
                            const std::string& isa, int64_t sliding_window, float logit_softcap,
                            const std::string& kv_dtype) {
  pyagent::DecodeArgs a{};
  a.out = const_cast<float*>(checked<float>(out, "out", 3, true));
  a.query = checked<float>(query, "query", 3);
  a.codes_kind = pyagent::parse_kv_dtype(kv_dtype);
  int64_t row_width = query.shape(2);  // the caches' last dimension
  // float32 caches, or bfloat16 ones passed as their bits in int16 arrays (numpy has no
  // bfloat16), both the same; int8/fp8 ones as their bytes.
  if (a.codes_kind != pyagent::KVCodes::None) {
    a.key_cache_codes = checked_codes(key_cache, "key_cache");
    a.value_cache_codes = checked_codes(value_cache, "value_cache");
    row_width = pyagent::kv_row_bytes(row_width);
  } else if (py::isinstance<py::array_t<int16_t>>(key_cache) && key_cache.dtype().is(py::dtype::of<int16_t>())) {
    a.key_cache_bf16 = reinterpret_cast<const uint16_t*>(checked<int16_t>(key_cache, "key_cache", 4));
    a.value_cache_bf16 = reinterpret_cast<const uint16_t*>(checked<int16_t>(value_cache, "value_cache", 4));
  } else {
    a.key_cache = checked<float>(key_cache, "key_cache", 4);
    a.value_cache = checked<float>(value_cache, "value_cache", 4);
  }
  a.block_tables = checked<int32_t>(block_tables, "block_tables", 2);
  a.seq_lens = checked<int32_t>(seq_lens, "seq_lens", 1);
  a.num_seqs = query.shape(0);
  a.num_heads = query.shape(1);
  a.head_size = query.shape(2);
  a.num_blocks = key_cache.shape(0);
  a.block_size = key_cache.shape(1);
  a.num_kv_heads = key_cache.shape(2);
  a.table_stride = block_tables.shape(1);
  a.scale = scale;
  if (sliding_window < 0) throw py::value_error("sliding_window must be >= 0 (0: none)");
  a.sliding_window = sliding_window;
  if (!(logit_softcap >= 0.0f)) throw py::value_error("logit_softcap must be >= 0 (0: none)");
  a.logit_softcap = logit_softcap;
  if (a.num_kv_heads <= 0 || a.num_heads % a.num_kv_heads != 0) {
    throw py::value_error("query has " + std::to_string(a.num_heads) + " heads, not a multiple of key_cache's " +
                          std::to_string(a.num_kv_heads) + " key/value heads");
  }
  for (int i = 0; i < 3; ++i) expect_dim(out, "out", i, query.shape(i), "as query");
  for (int i = 0; i < 4; ++i) expect_dim(value_cache, "value_cache", i, key_cache.shape(i), "as key_cache");
  expect_dim(key_cache, "key_cache", 3, row_width,
             a.codes_kind == pyagent::KVCodes::None ? "query's head size" : "query's head size and its scales' bytes");
  if (a.head_size < 1 || a.head_size > 1024) {
    throw py::value_error("head size " + std::to_string(a.head_size) + " is outside 1..1024");
  }
  expect_dim(block_tables, "block_tables", 0, a.num_seqs, "one row per sequence");
  expect_dim(seq_lens, "seq_lens", 0, a.num_seqs, "one per sequence");
  for (int64_t s = 0; s < a.num_seqs; ++s) {
    if (a.seq_lens[s] < 0 || a.seq_lens[s] > a.table_stride * a.block_size) {
      throw py::value_error("seq_lens[" + std::to_string(s) + "] = " + std::to_string(a.seq_lens[s]) +
                            " does not fit its block table (" + std::to_string(a.table_stride) + " blocks of " +
                            std::to_string(a.block_size) + ")");
    }
  }
  if (num_threads < 1) throw py::value_error("num_threads must be >= 1");
  py::gil_scoped_release release;
  pyagent::paged_decode_attention(a, num_threads, isa);
}

void linear(py::array out, py::array x, py::array weight, py::object bias, int num_threads, const std::string& isa) {
  pyagent::LinearArgs a{};
  a.out = const_cast<float*>(checked<float>(out, "out", 2, true));
  a.x = checked<float>(x, "x", 2);
  a.weight = checked<float>(weight, "weight", 2);
  a.M = x.shape(0);
  a.K = x.shape(1);
  a.N = weight.shape(0);
  expect_dim(weight, "weight", 1, a.K, "x's features");
  expect_dim(out, "out", 0, a.M, "x's rows");
  expect_dim(out, "out", 1, a.N, "weight's output features");
  py::array bias_array;
  if (!bias.is_none()) {
    bias_array = bias.cast<py::array>();
    a.bias = checked<float>(bias_array, "bias", 1);
    expect_dim(bias_array, "bias", 0, a.N, "weight's output features");
  }
  if (num_threads < 1) throw py::value_error("num_threads must be >= 1");
  py::gil_scoped_release release;
  pyagent::linear(a, num_threads, isa);
}

// out[N, kv_row_bytes(D)] = the float32 rows x[N, D] as a quantized cache's rows (kv_quant.h).
void quantize_kv_rows(py::array out, py::array x, const std::string& kv_dtype) {
  const pyagent::KVCodes kind = pyagent::parse_kv_dtype(kv_dtype);
  if (kind == pyagent::KVCodes::None) throw py::value_error("kv_dtype: expected 'int8' or 'fp8', got 'auto'");
  const float* src = checked<float>(x, "x", 2);
  uint8_t* dst = const_cast<uint8_t*>(checked<uint8_t>(out, "out", 2, true));
  const int64_t N = x.shape(0), D = x.shape(1);
  expect_dim(out, "out", 0, N, "x's rows");
  expect_dim(out, "out", 1, pyagent::kv_row_bytes(D), "x's columns and their scales' bytes");
  py::gil_scoped_release release;
  for (int64_t i = 0; i < N; ++i) pyagent::quantize_kv_row(src + i * D, D, kind, dst + i * pyagent::kv_row_bytes(D));
}

// out[M, n] = silu(gate_up[:, :n]) * gate_up[:, n:], the fused gate/up layout.
void silu_and_mul(py::array out, py::array gate_up, int num_threads, const std::string& isa) {
  const float* gu = checked<float>(gate_up, "gate_up", 2);
  pyagent::SiluMulArgs a{};
  a.out = const_cast<float*>(checked<float>(out, "out", 2, true));
  const int64_t M = gate_up.shape(0);
  if (gate_up.shape(1) % 2 != 0) throw py::value_error("gate_up.shape[1] must be even (gate then up)");
  a.n = gate_up.shape(1) / 2;
  expect_dim(out, "out", 0, M, "gate_up's rows");
  expect_dim(out, "out", 1, a.n, "half of gate_up's columns");
  a.gate = gu;
  a.up = gu + a.n;
  a.in_stride = 2 * a.n;
  a.out_stride = a.n;
  if (num_threads < 1) throw py::value_error("num_threads must be >= 1");
  py::gil_scoped_release release;
  pyagent::silu_and_mul(a, M, num_threads, isa);
}

// ------------------------------------------------------------------ quantized weights

int64_t quant_row_bytes(const std::string& encoding, int64_t K, int64_t group) {
  return pyagent::checked_row_bytes(encoding, K, group);
}

// data: uint8 [N, row bytes of encoding for K]; `what` says where N comes from.
pyagent::QuantWeight checked_weight(const py::array& data, const std::string& encoding, int64_t group, int64_t N,
                                    int64_t K, const char* what) {
  pyagent::QuantWeight w{};
  w.data = checked<uint8_t>(data, "data", 2);
  w.row_bytes = quant_row_bytes(encoding, K, group);
  w.encoding = pyagent::parse_quant_encoding(encoding);
  w.group = group;
  w.N = N;
  w.K = K;
  expect_dim(data, "data", 0, N, what);
  std::string layout = "bytes per row of " + encoding;
  if (w.encoding == pyagent::QuantEncoding::I4) layout += " group " + std::to_string(group);
  layout += " with K = " + std::to_string(K);
  expect_dim(data, "data", 1, w.row_bytes, layout.c_str());
  return w;
}

void dequantize(py::array out, py::array data, const std::string& encoding, int64_t group, int num_threads,
                const std::string& isa) {
  float* dst = const_cast<float*>(checked<float>(out, "out", 2, true));
  const pyagent::QuantWeight w = checked_weight(data, encoding, group, out.shape(0), out.shape(1), "out's rows");
  if (num_threads < 1) throw py::value_error("num_threads must be >= 1");
  py::gil_scoped_release release;
  pyagent::dequantize(w, dst, num_threads, isa);
}

void quantized_linear(py::array out, py::array x, py::array data, const std::string& encoding, int64_t group,
                      py::object bias, int num_threads, const std::string& isa, const std::string& activations) {
  pyagent::QuantLinearArgs a{};
  a.activations = pyagent::parse_activations(activations);
  a.out = const_cast<float*>(checked<float>(out, "out", 2, true));
  a.x = checked<float>(x, "x", 2);
  a.M = x.shape(0);
  a.w = checked_weight(data, encoding, group, out.shape(1), x.shape(1), "out's columns: output features");
  expect_dim(out, "out", 0, a.M, "x's rows");
  py::array bias_array;
  if (!bias.is_none()) {
    bias_array = bias.cast<py::array>();
    a.bias = checked<float>(bias_array, "bias", 1);
    expect_dim(bias_array, "bias", 0, a.w.N, "output features");
  }
  if (num_threads < 1) throw py::value_error("num_threads must be >= 1");
  py::gil_scoped_release release;
  pyagent::quantized_linear(a, num_threads, isa);
}

py::list hash_blocks(py::bytes parent, py::array tokens, int64_t block_size) {
  const std::string parent_bytes = parent;
  if (parent_bytes.size() != 32) throw py::value_error("parent must be a 32-byte sha256 digest");
  if (block_size <= 0) throw py::value_error("block_size must be positive");
  const int64_t* ids = checked<int64_t>(tokens, "tokens", 1);
  pyagent::Digest root;
  std::copy(parent_bytes.begin(), parent_bytes.end(), root.begin());
  std::vector<pyagent::Digest> digests;
  {
    py::gil_scoped_release release;
    digests = pyagent::hash_blocks(root, ids, tokens.shape(0), block_size);
  }
  py::list out;
  for (const auto& d : digests) out.append(py::bytes(reinterpret_cast<const char*>(d.data()), d.size()));
  return out;
}

// The EvictionPolicy interface of a native policy: ctor(capacity), the five events,
// __len__ and capacity; evict() raises KeyError (a LookupError) when nothing is evictable.
template <typename Policy>
py::class_<Policy> bind_policy(py::module_& m, const char* name, const char* doc) {
  py::class_<Policy> cls(m, name, doc);
  cls.def(py::init<int64_t>(), py::arg("capacity") = 0)
      .def("insert", &Policy::insert, py::arg("block"))
      .def("touch", &Policy::touch, py::arg("block"))
      .def("release", &Policy::release, py::arg("block"))
      .def("remove", &Policy::remove, py::arg("block"))
      .def("evict",
           [](Policy& self) {
             try {
               return self.evict();
             } catch (const std::out_of_range& exc) {
               throw py::key_error(exc.what());  // LookupError, as the interface asks
             }
           })
      .def("__len__", &Policy::size)
      .def_property_readonly("capacity", &Policy::capacity);
  return cls;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "pyagent-framework native core (C++17)";
  m.def("best_isa", &pyagent::best_isa,
        "The build of the kernels isa='auto' runs here: 'avx512', 'avx2' or 'generic' (the best this CPU runs, "
        "or the one the environment variable PYAGENT_NATIVE_ISA names).");
  m.def("available_isas", &pyagent::available_isas, "The builds of the kernels this CPU runs, portable first.");
  m.def("paged_decode_attention", &paged_decode_attention, py::arg("out"), py::arg("query"), py::arg("key_cache"),
        py::arg("value_cache"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("num_threads") = 1, py::arg("isa") = "auto", py::arg("sliding_window") = 0, py::arg("logit_softcap") = 0.0f,
        py::arg("kv_dtype") = "auto",
        "Decode attention over a paged KV cache, in place (see csrc/kernels.h for the layout); the caches are "
        "float32, or bfloat16 given as their bits in int16 arrays (kv_dtype 'auto'), or int8 / fp8 (e4m3fn) "
        "rows of head_size codes and a float16 scale per group of 32 (else 16, else the row) given as their "
        "bytes, uint8 [blocks, block_size, kv_heads, head_size + 2 * groups] (kv_dtype 'int8' or 'fp8'; an int8 "
        "array is taken too), as pyagent_framework.kv_cache_format defines them.");
  m.def("quantize_kv_rows", &quantize_kv_rows, py::arg("out"), py::arg("x"), py::arg("kv_dtype"),
        "out[N, D + 2 * groups] (uint8) = the rows x[N, D] (float32) as a quantized KV cache stores them ('int8' "
        "or 'fp8'): D codes and each group's float16 scale, bit for bit kv_cache_format.quantize.");
  m.def("linear", &linear, py::arg("out"), py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(),
        py::arg("num_threads") = 1, py::arg("isa") = "auto",
        "out = x @ weight.T (+ bias) for a few rows of x, streaming the weight once.");
  m.def("silu_and_mul", &silu_and_mul, py::arg("out"), py::arg("gate_up"), py::arg("num_threads") = 1,
        py::arg("isa") = "auto",
        "out[M, n] = silu(gate_up[:, :n]) * gate_up[:, n:] (float32), the fused decoder's MLP activation.");
  m.def(
      "int8_gemm",
      [](const std::string& encoding, const std::string& isa) {
        return pyagent::kernels_for(isa).int8_gemm(pyagent::parse_quant_encoding(encoding));
      },
      py::arg("encoding"), py::arg("isa") = "auto",
      "Whether quantized_linear with activations 'int8' or 'int16' multiplies several rows of x in integers for this "
      "encoding in this build (then it beats dequantizing for any number of rows).");
  m.def("quant_row_bytes", &quant_row_bytes, py::arg("encoding"), py::arg("K"), py::arg("group") = 0,
        "Bytes per row of a weight of K input features in `encoding` (GGUF's 'Q8_0', 'Q4_0', 'Q4_1', 'Q5_0', "
        "'Q5_1', 'IQ4_NL', 'Q2_K', 'Q3_K', 'Q4_K', 'Q5_K', 'Q6_K'; 'I8' or 'I4'; group: I4's 32, 64 or 128).");
  m.def("dequantize", &dequantize, py::arg("out"), py::arg("data"), py::arg("encoding"), py::arg("group") = 0,
        py::arg("num_threads") = 1, py::arg("isa") = "auto",
        "out[N, K] (float32) = the uint8 [N, row bytes] weight in `encoding`, dequantized exactly (GGUF encodings: "
        "bit for bit the gguf package's values).");
  m.def("quantized_linear", &quantized_linear, py::arg("out"), py::arg("x"), py::arg("data"), py::arg("encoding"),
        py::arg("group") = 0, py::arg("bias") = py::none(), py::arg("num_threads") = 1, py::arg("isa") = "auto",
        py::arg("activations") = "float32",
        "out[M, N] = x[M, K] @ dequantize(data)^T (+ bias) for a few rows of x, reading the packed weight once. "
        "activations: 'float32' (exact up to float rounding), 'int8' (x rounded to int8 per block of 32 and "
        "multiplied in integers where a build has the kernel: one-row Q4_0/Q4_1 in AVX2 and AVX-512, several "
        "rows in AVX-512 VNNI, see int8_gemm; faster, approximate) or 'int16' (x rounded to 16 bits per block "
        "and multiplied as two int8 rows in the AVX-512 VNNI GEMM, any number of rows; see kernels.h).");
  bind_decoder(m);
  bind_moe(m);
  m.def("hash_blocks", &hash_blocks, py::arg("parent"), py::arg("tokens"), py::arg("block_size"),
        "Chained sha256 digests of every full block of int64 token ids (the Python path's digests).");
  bind_policy<pyagent::LRUPolicy>(m, "LRUPolicy",
                                  "Eviction policy 'native-lru': least recently released first (twin of 'lru').");
  bind_policy<pyagent::ARCPolicy>(
      m, "ARCPolicy",
      "Eviction policy 'native-arc': adaptive replacement, T1/T2 with count-only ghosts and p adapted on "
      "rescues (twin of pyagent-eviction's 'arc').")
      .def_property_readonly("p", &pyagent::ARCPolicy::p)
      .def_property_readonly("t1_size", &pyagent::ARCPolicy::t1_size)
      .def_property_readonly("t2_size", &pyagent::ARCPolicy::t2_size)
      .def_property_readonly("ghost_sizes", [](const pyagent::ARCPolicy& self) {
        const auto g = self.ghost_sizes();
        return py::make_tuple(g.first, g.second);
      })
      .def(
          "list_of",
          [](const pyagent::ARCPolicy& self, int64_t block) -> py::object {
            const int where = self.list_of(block);
            if (where < 0) return py::none();
            return py::str(where == pyagent::ARCPolicy::T1 ? "T1" : "T2");
          },
          py::arg("block"), "'T1', 'T2' or None (not resident).");
  bind_policy<pyagent::S3FIFOPolicy>(
      m, "S3FIFOPolicy",
      "Eviction policy 'native-s3fifo': small probation FIFO, main FIFO with second chances, no ghost queue "
      "(twin of pyagent-eviction's 's3fifo').")
      .def_property_readonly("small_target", &pyagent::S3FIFOPolicy::small_target)
      .def(
          "queue_of",
          [](const pyagent::S3FIFOPolicy& self, int64_t block) -> py::object {
            const int q = self.queue_of(block);
            if (q < 0) return py::none();
            return py::str(q == pyagent::S3FIFOPolicy::SMALL ? "small" : "main");
          },
          py::arg("block"), "'small', 'main' or None (not tracked).")
      .def(
          "freq",
          [](const pyagent::S3FIFOPolicy& self, int64_t block) -> py::object {
            const int f = self.freq(block);
            if (f < 0) return py::none();
            return py::int_(f);
          },
          py::arg("block"), "The block's use counter (0..3), or None (not tracked).");
}
