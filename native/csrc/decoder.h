// One decode step of a Llama-family decoder stack, every layer in C++: the Python
// model's per-op dispatch (about a dozen torch calls and module calls per layer) costs
// more than the layer's arithmetic once weights are quantized, so a decode step of
// one-token sequences runs here, from the same weights and the same paged KV cache.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels.h"

namespace pyagent {

// One stored piece of a linear layer: float32 [N, K], or packed (see QuantWeight);
// bias optional.
struct LinearPart {
  const float* weight = nullptr;  // set when not packed
  QuantWeight packed{};
  bool is_packed = false;
  const float* bias = nullptr;
  Activations activations = Activations::Float32;  // see QuantLinearArgs
  int64_t N = 0;
  int64_t K = 0;
};

// The kernel arguments of out[M, p.N] = x[M, K] @ p^T (+ bias): float_args for a float
// part, packed_args for a packed one (is_packed says which).
inline LinearArgs float_args(const LinearPart& p, float* out, const float* x, int64_t M) {
  LinearArgs a{};
  a.out = out;
  a.x = x;
  a.weight = p.weight;
  a.bias = p.bias;
  a.M = M;
  a.N = p.N;
  a.K = p.K;
  return a;
}

inline QuantLinearArgs packed_args(const LinearPart& p, float* out, const float* x, int64_t M) {
  QuantLinearArgs a{};
  a.out = out;
  a.x = x;
  a.bias = p.bias;
  a.M = M;
  a.w = p.packed;
  a.activations = p.activations;
  return a;
}

// A linear layer, out[M, N] = x[M, K] @ W^T (+ bias): usually one part; a weight whose
// row ranges are stored in different encodings (llama.cpp's _M mixes keep a fused
// q/k/v's v in more bits) is several, each computing its own output features, part p
// the N_p after those of the parts before it. Every part has the layer's K.
// A layer's LoRA adapters, one per slot: out[t] += b[s] @ (a[s] @ x[t]) for a row t whose
// slot s (DecoderBatch::lora_slots) is not -1; a [slots, rank, K], b [slots, N, rank], the
// adapter's scale folded into b. Absent (a == nullptr): the layer has no adapters.
// A fused layer's parts (q/k/v, gate/up) each have their own adapter: with `parts`
// (first output row, rows) in order, part p's rows take columns [p r, (p + 1) r) of
// a[s] @ x[t] (r = rank / parts) and b is [slots, N, r], each row holding its part's.
struct LoRAWeight {
  const float* a = nullptr;
  const float* b = nullptr;
  int64_t slots = 0;
  int64_t rank = 0;
  std::vector<std::pair<int64_t, int64_t>> parts;
};

struct LinearWeight {
  std::vector<LinearPart> parts;
  int64_t N = 0;
  int64_t K = 0;
  LoRAWeight lora{};
};

// The layer: x += o(attn(rope(qkv(norm1(x))))); x += down(silu(gate) * up)(norm2(x)),
// gate/up one fused [2I, H] weight, q/k/v one fused [(Hq + 2 Hkv) D, H] weight.
struct DecoderLayerWeights {
  const float* input_norm;
  const float* post_norm;
  const float* q_norm = nullptr;  // Qwen3: RMSNorm over each head, before rope
  const float* k_norm = nullptr;
  LinearWeight qkv, o, gate_up, down;
  int64_t sliding_window = 0;  // 0: none
};

struct DecoderShape {
  int64_t hidden;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_dim;
  int64_t intermediate;
  float eps;
  float scale;
};

// One step's batch: T sequences, one new token each.
struct DecoderBatch {
  float* x;            // [T, hidden], the residual stream, updated in place
  const float* cos;    // [T, head_dim / 2]
  const float* sin;    // [T, head_dim / 2]
  const int64_t* slots;  // [T] cache slot of each new token (-1: not written)
  const int32_t* block_tables;  // [T, table_stride]
  const int32_t* seq_lens;      // [T], the new token included
  int64_t T;
  int64_t table_stride;
  const int32_t* lora_slots = nullptr;  // [T] each row's LoRA slot (-1: none), or nullptr: no adapters
};

// A layer's cache: float32, or int8/fp8 rows of head_dim codes and their float16 scales
// (kv_quant.h; the new rows are quantized as kv_cache_format.quantize does).
struct LayerCache {
  float* keys;    // [num_blocks, block_size, num_kv_heads, head_dim]; null for a quantized cache
  float* values;  // same
  int64_t num_blocks;
  int64_t block_size;
  uint8_t* key_codes = nullptr;  // [num_blocks, block_size, num_kv_heads, kv_row_bytes(head_dim)] bytes
  uint8_t* value_codes = nullptr;
  KVCodes codes = KVCodes::None;
};

// Scratch reused across calls (grown on demand).
struct DecoderWorkspace {
  std::vector<float> h, qkv, q, attn, tmp, gate_up, act;
  std::vector<float> part;  // one part's [M, N_p] output, for a layer of several parts
  std::vector<float> lora_x, lora_mid, lora_out;  // one adapter's rows: gathered x, x @ a^T, that @ b^T
  std::vector<float> lora_part;  // one part's columns of lora_mid
  std::vector<int64_t> lora_rows;
};

// Runs every layer in order; throws std::out_of_range for a slot or block id outside
// the cache.
void decode_layers(const DecoderShape& shape, const std::vector<DecoderLayerWeights>& layers,
                   const std::vector<LayerCache>& caches, const DecoderBatch& batch, DecoderWorkspace& ws,
                   int num_threads);

}  // namespace pyagent
