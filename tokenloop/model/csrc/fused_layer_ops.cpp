// The elementwise stages of a decoder layer, fused, for the CPU.
//
// At one decode token a layer's GEMMs take ~130 us, but the PyTorch ops between them (RMSNorm alone is
// six ops for float32 on the CPU, rotary embedding eight, plus the dtype casts around packed weights)
// were ~150 dispatches a layer, ~5 ms of a ~12 ms step. Each function here is one of those chains:
//   add_rms_norm   residual += delta; out = RMSNorm(residual), written straight in the next GEMM's dtype
//   silu_mul       out = silu(gate) * up from the fused gate/up projection's output
//   rope_write_kv  rotate Q and K, store K and V at their cache slots (fp32 or bf16), hand back Q, K, V in fp32
// Inputs may be float32 or bfloat16 (the packed int4 and bf16 GEMMs' output); sums are float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>

namespace {

using c10::BFloat16;

// Rows per parallel task: below ~16k elements a thread hand-off costs more than the work.
inline int64_t grain_rows(int64_t row_elements) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elements)); }

template <typename Out>
void norm_rows(float* residual, const void* delta, bool delta_bf16, const float* weight, float eps, Out* out,
               int64_t rows, int64_t hidden) {
  at::parallel_for(0, rows, grain_rows(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* x = residual + r * hidden;
      if (delta != nullptr && delta_bf16) {
        const BFloat16* d = static_cast<const BFloat16*>(delta) + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) x[i] += static_cast<float>(d[i]);
      } else if (delta != nullptr) {
        const float* d = static_cast<const float*>(delta) + r * hidden;
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) x[i] += d[i];
      }
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < hidden; ++i) squares += x[i] * x[i];
      const float inv_rms = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
      Out* o = out + r * hidden;
      for (int64_t i = 0; i < hidden; ++i) o[i] = static_cast<Out>(x[i] * inv_rms * weight[i]);
    }
  });
}

template <typename In, typename Out>
void silu_mul_rows(const In* gate_up, Out* out, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, grain_rows(2 * width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const In* gate = gate_up + r * 2 * width;
      const In* up = gate + width;
      Out* o = out + r * width;
      for (int64_t i = 0; i < width; ++i) {
        const float g = static_cast<float>(gate[i]);
        o[i] = static_cast<Out>(g / (1.f + std::exp(-g)) * static_cast<float>(up[i]));
      }
    }
  });
}

// One token's heads, half-split rotation (HF's rotate_half): out[:D/2] = x1 cos - x2 sin, out[D/2:] = x2 cos + x1 sin.
template <typename In>
inline void rotate(const In* x, const float* cos, const float* sin, int64_t half, float* out) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
    out[i] = x1 * cos[i] - x2 * sin[i];
    out[i + half] = x2 * cos[i] + x1 * sin[i];
  }
}

// One token's K or V row into the cache. A bf16 cache rounds (to nearest even, as torch's .to does) and the
// float32 row handed back is rounded alike, so that attention over this step's own K/V sees the cached values.
inline void store_row(float* row, int64_t n, float* cache) { std::copy(row, row + n, cache); }
inline void store_row(float* row, int64_t n, BFloat16* cache) {
  for (int64_t i = 0; i < n; ++i) {
    cache[i] = static_cast<BFloat16>(row[i]);
    row[i] = static_cast<float>(cache[i]);
  }
}

template <typename In, typename KV>
void rope_write_rows(const In* qkv, const int64_t* positions, const float* cos, const float* sin, const int64_t* slots,
                     KV* key_cache, KV* value_cache, int64_t num_slots, float* q_out, float* k_out,
                     float* v_out, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2, width = (heads + 2 * kv_heads) * head_dim, kv_width = kv_heads * head_dim;
  at::parallel_for(0, tokens, grain_rows(width), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const In* row = qkv + t * width;
      const float* c = cos + positions[t] * half;
      const float* s = sin + positions[t] * half;
      const int64_t slot = slots[t];
      TORCH_CHECK(slot >= 0 && slot < num_slots, "rope_write_kv: slot ", slot, " outside the cache");
      for (int64_t h = 0; h < heads; ++h) rotate(row + h * head_dim, c, s, half, q_out + (t * heads + h) * head_dim);
      float* k = k_out + t * kv_width;
      float* v = v_out + t * kv_width;
      for (int64_t h = 0; h < kv_heads; ++h) rotate(row + (heads + h) * head_dim, c, s, half, k + h * head_dim);
      const In* v_in = row + (heads + kv_heads) * head_dim;
      for (int64_t i = 0; i < kv_width; ++i) v[i] = static_cast<float>(v_in[i]);
      store_row(k, kv_width, key_cache + slot * kv_width);
      store_row(v, kv_width, value_cache + slot * kv_width);
    }
  });
}

void check_float_or_bf16(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_contiguous() && (t.dtype() == torch::kFloat32 || t.dtype() == torch::kBFloat16), name,
              ": a contiguous float32 or bfloat16 tensor expected");
}

}  // namespace

// residual [T, H] float32, updated in place by delta [T, H] (float32 or bf16; empty: no add);
// weight [H] float32; out [T, H] float32 or bf16.
void add_rms_norm(torch::Tensor& residual, const torch::Tensor& delta, const torch::Tensor& weight, double eps,
                  torch::Tensor& out) {
  TORCH_CHECK(residual.dtype() == torch::kFloat32 && residual.is_contiguous() && residual.dim() == 2,
              "add_rms_norm: residual must be a contiguous float32 [T, H]");
  TORCH_CHECK(weight.dtype() == torch::kFloat32 && weight.is_contiguous() && weight.numel() == residual.size(1),
              "add_rms_norm: weight must be float32 [H]");
  check_float_or_bf16(out, "add_rms_norm: out");
  TORCH_CHECK(out.sizes() == residual.sizes(), "add_rms_norm: out shape mismatch");
  const bool has_delta = delta.numel() > 0;
  if (has_delta) {
    check_float_or_bf16(delta, "add_rms_norm: delta");
    TORCH_CHECK(delta.sizes() == residual.sizes(), "add_rms_norm: delta shape mismatch");
  }
  const int64_t rows = residual.size(0), hidden = residual.size(1);
  const void* d = has_delta ? delta.data_ptr() : nullptr;
  const bool d_bf16 = has_delta && delta.dtype() == torch::kBFloat16;
  const float e = static_cast<float>(eps);
  if (out.dtype() == torch::kBFloat16) {
    norm_rows(residual.data_ptr<float>(), d, d_bf16, weight.data_ptr<float>(), e, out.data_ptr<BFloat16>(), rows, hidden);
  } else {
    norm_rows(residual.data_ptr<float>(), d, d_bf16, weight.data_ptr<float>(), e, out.data_ptr<float>(), rows, hidden);
  }
}

// gate_up [T, 2I] (gate then up; float32 or bf16) -> out [T, I] (float32 or bf16).
void silu_mul(const torch::Tensor& gate_up, torch::Tensor& out) {
  check_float_or_bf16(gate_up, "silu_mul: gate_up");
  check_float_or_bf16(out, "silu_mul: out");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.dim() == 2 && out.dim() == 2 && out.size(0) == rows && out.size(1) == width,
              "silu_mul: shapes must be [T, 2I] -> [T, I]");
  const bool in_bf16 = gate_up.dtype() == torch::kBFloat16, out_bf16 = out.dtype() == torch::kBFloat16;
  if (in_bf16 && out_bf16) silu_mul_rows(gate_up.data_ptr<BFloat16>(), out.data_ptr<BFloat16>(), rows, width);
  else if (in_bf16) silu_mul_rows(gate_up.data_ptr<BFloat16>(), out.data_ptr<float>(), rows, width);
  else if (out_bf16) silu_mul_rows(gate_up.data_ptr<float>(), out.data_ptr<BFloat16>(), rows, width);
  else silu_mul_rows(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, width);
}

// qkv [T, (H + 2 KVH) * D] (float32 or bf16); positions, slots [T] int64; cos, sin [P, D/2] float32;
// key_cache, value_cache [num_blocks, block_size, KVH, D], both float32 or both bfloat16 (the KV cache's dtype);
// q_out [T, H, D], k_out/v_out [T, KVH, D] float32 (K and V as cached: rounded to bf16 for a bf16 cache).
void rope_write_kv(const torch::Tensor& qkv, const torch::Tensor& positions, const torch::Tensor& cos,
                   const torch::Tensor& sin, const torch::Tensor& slots, torch::Tensor& key_cache,
                   torch::Tensor& value_cache, torch::Tensor& q_out, torch::Tensor& k_out, torch::Tensor& v_out) {
  check_float_or_bf16(qkv, "rope_write_kv: qkv");
  for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{&cos, &sin, &q_out, &k_out, &v_out}) {
    TORCH_CHECK(t->dtype() == torch::kFloat32 && t->is_contiguous(), "rope_write_kv: contiguous float32 expected");
  }
  const bool bf16_cache = key_cache.dtype() == torch::kBFloat16;
  TORCH_CHECK((bf16_cache || key_cache.dtype() == torch::kFloat32) && value_cache.dtype() == key_cache.dtype() &&
                  key_cache.is_contiguous() && value_cache.is_contiguous(),
              "rope_write_kv: a contiguous float32 or bfloat16 KV cache expected");
  TORCH_CHECK(positions.dtype() == torch::kInt64 && slots.dtype() == torch::kInt64 && positions.is_contiguous() &&
                  slots.is_contiguous(), "rope_write_kv: int64 positions and slots expected");
  const int64_t tokens = qkv.size(0), heads = q_out.size(1), kv_heads = k_out.size(1), head_dim = q_out.size(2);
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * head_dim && positions.numel() == tokens &&
                  slots.numel() == tokens && q_out.size(0) == tokens && k_out.size(0) == tokens &&
                  v_out.sizes() == k_out.sizes() && key_cache.size(2) == kv_heads && key_cache.size(3) == head_dim &&
                  value_cache.sizes() == key_cache.sizes() && cos.size(1) * 2 == head_dim,
              "rope_write_kv: shape mismatch");
  const int64_t max_position = cos.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_position, "rope_write_kv: position ", pos[t], " outside the rope table");
  }
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  auto run = [&](auto* rows, auto* keys, auto* values) {
    rope_write_rows(rows, pos, cos.data_ptr<float>(), sin.data_ptr<float>(), slots.data_ptr<int64_t>(), keys,
                    values, num_slots, q_out.data_ptr<float>(), k_out.data_ptr<float>(), v_out.data_ptr<float>(),
                    tokens, heads, kv_heads, head_dim);
  };
  auto with_cache = [&](auto* rows) {
    if (bf16_cache) run(rows, key_cache.data_ptr<BFloat16>(), value_cache.data_ptr<BFloat16>());
    else run(rows, key_cache.data_ptr<float>(), value_cache.data_ptr<float>());
  };
  if (qkv.dtype() == torch::kBFloat16) with_cache(qkv.data_ptr<BFloat16>());
  else with_cache(qkv.data_ptr<float>());
}
