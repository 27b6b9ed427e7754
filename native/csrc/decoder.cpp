// The decode step of decoder.h. The heavy parts (the four matmuls and attention) go
// through the dispatched kernels, which pick the ISA and split work over the thread
// pool; the rest (norms, rope, cache writes, SwiGLU, residuals) is O(hidden) per
// token and runs on the calling thread.
#include "decoder.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "dispatch.h"
#include "kv_quant.h"

namespace pyagent {
namespace {

const std::string kAuto = "auto";

void apply_part(const LinearPart& w, float* out, const float* x, int64_t M, int threads) {
  if (w.is_packed) {
    quantized_linear(packed_args(w, out, x, M), threads, kAuto);
  } else {
    linear(float_args(w, out, x, M), threads, kAuto);
  }
}

void grow(std::vector<float>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
}

// out[M, N] = the layer of x. One part: its kernel writes out directly. Several: part p
// owns columns [offset, offset + N_p) of each row; with one row of x those are
// contiguous and the kernel writes them in place, with more the part's [M, N_p] goes
// to a scratch and is copied into each row's slice (M * N floats, next to the
// M * N * K multiply-adds).
// out[m, N] = x[m, K] @ weight[N, K]^T through the dispatched float kernel.
void expand_rows(float* out, const float* x, const float* weight, int64_t m, int64_t N, int64_t K, int threads) {
  LinearArgs a{};
  a.out = out;
  a.x = x;
  a.weight = weight;
  a.M = m;
  a.N = N;
  a.K = K;
  linear(a, threads, kAuto);
}

// dst[rows[i], first : first + n] += src[i, :n] (dst rows of `stride` values).
void add_rows(float* dst, int64_t stride, int64_t first, const float* src, int64_t n, const std::vector<int64_t>& rows) {
  for (size_t i = 0; i < rows.size(); ++i) {
    float* d = dst + rows[i] * stride + first;
    const float* s = src + static_cast<int64_t>(i) * n;
    for (int64_t j = 0; j < n; ++j) d[j] += s[j];
  }
}

// out[t] += b[s] @ (a[s] @ x[t]) for the rows of each slot s: the rows gathered, two
// float GEMMs through the dispatched kernel ([m, K] x [R, K]^T, then [m, R] x [N, R]^T),
// the result added back to each row.
void add_lora(const LinearWeight& w, float* out, const float* x, int64_t M, const int32_t* slots, int threads,
              DecoderWorkspace& ws) {
  const int64_t K = w.K, N = w.N, R = w.lora.rank;
  for (int64_t s = 0; s < w.lora.slots; ++s) {
    ws.lora_rows.clear();
    for (int64_t m = 0; m < M; ++m) {
      if (slots[m] == s) ws.lora_rows.push_back(m);
    }
    const int64_t rows = static_cast<int64_t>(ws.lora_rows.size());
    if (rows == 0) continue;
    grow(ws.lora_x, rows * K);
    grow(ws.lora_mid, rows * R);
    grow(ws.lora_out, rows * N);
    for (int64_t i = 0; i < rows; ++i) {
      std::copy(x + ws.lora_rows[i] * K, x + (ws.lora_rows[i] + 1) * K, ws.lora_x.data() + i * K);
    }
    LinearArgs shrink{};
    shrink.out = ws.lora_mid.data();
    shrink.x = ws.lora_x.data();
    shrink.weight = w.lora.a + s * R * K;
    shrink.M = rows;
    shrink.N = R;
    shrink.K = K;
    linear(shrink, threads, kAuto);
    if (w.lora.parts.empty()) {
      expand_rows(ws.lora_out.data(), ws.lora_mid.data(), w.lora.b + s * N * R, rows, N, R, threads);
      add_rows(out, N, 0, ws.lora_out.data(), N, ws.lora_rows);
      continue;
    }
    // Part by part: its r columns of the shrink, its rows of b, its columns of out.
    const int64_t r = R / static_cast<int64_t>(w.lora.parts.size());
    grow(ws.lora_part, rows * r);
    for (size_t p = 0; p < w.lora.parts.size(); ++p) {
      const int64_t first = w.lora.parts[p].first, count = w.lora.parts[p].second;
      for (int64_t i = 0; i < rows; ++i) {
        const float* mid = ws.lora_mid.data() + i * R + static_cast<int64_t>(p) * r;
        std::copy(mid, mid + r, ws.lora_part.data() + i * r);
      }
      expand_rows(ws.lora_out.data(), ws.lora_part.data(), w.lora.b + s * N * r + first * r, rows, count, r, threads);
      add_rows(out, N, first, ws.lora_out.data(), count, ws.lora_rows);
    }
  }
}

void apply_base(const LinearWeight& w, float* out, const float* x, int64_t M, int threads,
                std::vector<float>& scratch) {
  if (w.parts.size() == 1) {
    apply_part(w.parts[0], out, x, M, threads);
    return;
  }
  int64_t offset = 0;
  for (const LinearPart& p : w.parts) {
    if (M == 1) {
      apply_part(p, out + offset, x, M, threads);
    } else {
      grow(scratch, M * p.N);
      apply_part(p, scratch.data(), x, M, threads);
      for (int64_t m = 0; m < M; ++m) {
        std::copy(scratch.data() + m * p.N, scratch.data() + (m + 1) * p.N, out + m * w.N + offset);
      }
    }
    offset += p.N;
  }
}

// The layer (its base weight, then the rows' LoRA adapters when the batch has any).
void apply_linear(const LinearWeight& w, float* out, const float* x, int64_t M, int threads, DecoderWorkspace& ws,
                  const int32_t* lora_slots) {
  apply_base(w, out, x, M, threads, ws.part);
  if (lora_slots != nullptr && w.lora.a != nullptr) add_lora(w, out, x, M, lora_slots, threads, ws);
}

// out = x / sqrt(mean(x^2) + eps) * weight, over n values.
void rms_norm(float* out, const float* x, const float* weight, int64_t n, float eps) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * weight[i];
}

// Rotate-half rope on one head of d values: (a, b) -> (a cos - b sin, b cos + a sin).
void rope(float* head, const float* cos, const float* sin, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = head[i], b = head[i + half];
    head[i] = a * cos[i] - b * sin[i];
    head[i + half] = b * cos[i] + a * sin[i];
  }
}

}  // namespace

void decode_layers(const DecoderShape& s, const std::vector<DecoderLayerWeights>& layers,
                   const std::vector<LayerCache>& caches, const DecoderBatch& b, DecoderWorkspace& ws,
                   int num_threads) {
  const int64_t T = b.T, H = s.hidden, D = s.head_dim;
  const int64_t q_size = s.num_heads * D, kv_size = s.num_kv_heads * D;
  const int64_t qkv_size = q_size + 2 * kv_size, inter = s.intermediate;
  grow(ws.h, T * H);
  grow(ws.qkv, T * qkv_size);
  grow(ws.q, T * q_size);
  grow(ws.attn, T * q_size);
  grow(ws.tmp, T * H);
  grow(ws.gate_up, T * 2 * inter);
  grow(ws.act, T * inter);
  for (size_t l = 0; l < layers.size(); ++l) {
    const DecoderLayerWeights& w = layers[l];
    const LayerCache& c = caches[l];
    // attention block
    for (int64_t t = 0; t < T; ++t) rms_norm(&ws.h[t * H], b.x + t * H, w.input_norm, H, s.eps);
    apply_linear(w.qkv, ws.qkv.data(), ws.h.data(), T, num_threads, ws, b.lora_slots);
    for (int64_t t = 0; t < T; ++t) {
      float* row = &ws.qkv[t * qkv_size];
      const float* cos = b.cos + t * (D / 2);
      const float* sin = b.sin + t * (D / 2);
      float* q = &ws.q[t * q_size];
      for (int64_t h = 0; h < s.num_heads; ++h) {
        if (w.q_norm) rms_norm(q + h * D, row + h * D, w.q_norm, D, s.eps);
        else std::copy(row + h * D, row + (h + 1) * D, q + h * D);
        rope(q + h * D, cos, sin, D);
      }
      float* k = row + q_size;
      for (int64_t h = 0; h < s.num_kv_heads; ++h) {
        if (w.k_norm) rms_norm(k + h * D, k + h * D, w.k_norm, D, s.eps);
        rope(k + h * D, cos, sin, D);
      }
      const int64_t slot = b.slots[t];
      if (slot < 0) continue;
      if (slot >= c.num_blocks * c.block_size) {
        throw std::out_of_range("slot_mapping[" + std::to_string(t) + "] = " + std::to_string(slot) +
                                " is outside the cache's " + std::to_string(c.num_blocks * c.block_size) + " slots");
      }
      if (c.codes == KVCodes::None) {
        std::copy(k, k + kv_size, c.keys + slot * kv_size);
        std::copy(k + kv_size, k + 2 * kv_size, c.values + slot * kv_size);
      } else {
        const int64_t row = kv_row_bytes(D);
        for (int64_t h = 0; h < s.num_kv_heads; ++h) {
          quantize_kv_row(k + h * D, D, c.codes, c.key_codes + (slot * s.num_kv_heads + h) * row);
          quantize_kv_row(k + kv_size + h * D, D, c.codes, c.value_codes + (slot * s.num_kv_heads + h) * row);
        }
      }
    }
    DecodeArgs a{};
    a.out = ws.attn.data();
    a.query = ws.q.data();
    a.key_cache = c.keys;
    a.value_cache = c.values;
    a.key_cache_codes = c.key_codes;
    a.value_cache_codes = c.value_codes;
    a.codes_kind = c.codes;
    a.block_tables = b.block_tables;
    a.seq_lens = b.seq_lens;
    a.num_seqs = T;
    a.num_heads = s.num_heads;
    a.num_kv_heads = s.num_kv_heads;
    a.head_size = D;
    a.block_size = c.block_size;
    a.num_blocks = c.num_blocks;
    a.table_stride = b.table_stride;
    a.sliding_window = w.sliding_window;
    a.scale = s.scale;
    paged_decode_attention(a, num_threads, kAuto);
    apply_linear(w.o, ws.tmp.data(), ws.attn.data(), T, num_threads, ws, b.lora_slots);
    for (int64_t i = 0; i < T * H; ++i) b.x[i] += ws.tmp[i];
    // MLP block
    for (int64_t t = 0; t < T; ++t) rms_norm(&ws.h[t * H], b.x + t * H, w.post_norm, H, s.eps);
    apply_linear(w.gate_up, ws.gate_up.data(), ws.h.data(), T, num_threads, ws, b.lora_slots);
    SiluMulArgs act{ws.act.data(), ws.gate_up.data(), ws.gate_up.data() + inter, inter, 2 * inter, inter};
    silu_and_mul(act, T, num_threads, kAuto);
    apply_linear(w.down, ws.tmp.data(), ws.act.data(), T, num_threads, ws, b.lora_slots);
    for (int64_t i = 0; i < T * H; ++i) b.x[i] += ws.tmp[i];
  }
}

}  // namespace pyagent
