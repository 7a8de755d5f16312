// The elementwise stages of a decoder layer, fused, for the CPU.
//
// At one decode token a layer's GEMMs take ~130 us, but the PyTorch ops between them (RMSNorm alone is
// six ops for float32 on the CPU, rotary embedding eight, plus the dtype casts around packed weights)
// were ~150 dispatches a layer, ~5 ms of a ~12 ms step. Each function here is one of those chains:
//   add_rms_norm   residual += delta (or RMSNorm(delta): a sublayer's output norm, Gemma's post-attention and
//                  post-feedforward norms); out = RMSNorm(residual), written straight in the next GEMM's dtype
//   silu_mul       out = silu(gate) * up from the fused gate/up projection's output (gelu_tanh_mul: GeGLU's)
//   rope_write_kv  RMS-normalize each Q and K head, or all of Q and of K (QK-norm, where given), rotate them,
//                  store K and V at their cache slots (fp32 or bf16), hand back Q, K, V in fp32
// Inputs may be float32 or bfloat16 (the packed int4 and bf16 GEMMs' output); sums are float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>

namespace {

using c10::BFloat16;

// Rows per parallel task: below ~16k elements a thread hand-off costs more than the work.
inline int64_t grain_rows(int64_t row_elements) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elements)); }

// 1 / RMS of n values (float32 or bf16), as torch's rms_norm computes it: mean of squares in float32.
template <typename T>
inline float inverse_rms(const T* x, int64_t n, float eps) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < n; ++i) squares += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  return 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
}

// x += d, or x += RMSNorm(d) * delta_weight where a delta weight is given.
template <typename D>
inline void add_delta(float* x, const D* d, const float* delta_weight, float eps, int64_t hidden) {
  if (delta_weight == nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) x[i] += static_cast<float>(d[i]);
    return;
  }
  const float inv_rms = inverse_rms(d, hidden, eps);
  for (int64_t i = 0; i < hidden; ++i) x[i] += static_cast<float>(d[i]) * inv_rms * delta_weight[i];
}

template <typename Out>
void norm_rows(float* residual, const void* delta, bool delta_bf16, const float* delta_weight, const float* weight,
               float eps, Out* out, int64_t rows, int64_t hidden) {
  at::parallel_for(0, rows, grain_rows(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* x = residual + r * hidden;
      if (delta != nullptr && delta_bf16) {
        add_delta(x, static_cast<const BFloat16*>(delta) + r * hidden, delta_weight, eps, hidden);
      } else if (delta != nullptr) {
        add_delta(x, static_cast<const float*>(delta) + r * hidden, delta_weight, eps, hidden);
      }
      const float inv_rms = inverse_rms(x, hidden, eps);
      Out* o = out + r * hidden;
      for (int64_t i = 0; i < hidden; ++i) o[i] = static_cast<Out>(x[i] * inv_rms * weight[i]);
    }
  });
}

inline float silu(float g) { return g / (1.f + std::exp(-g)); }
// GELU's tanh approximation (torch's approximate="tanh"): 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))).
inline float gelu_tanh(float g) { return 0.5f * g * (1.f + std::tanh(0.7978845608028654f * (g + 0.044715f * g * g * g))); }

template <float (*Act)(float), typename In, typename Out>
void gated_rows(const In* gate_up, Out* out, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, grain_rows(2 * width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const In* gate = gate_up + r * 2 * width;
      const In* up = gate + width;
      Out* o = out + r * width;
      for (int64_t i = 0; i < width; ++i) o[i] = static_cast<Out>(Act(static_cast<float>(gate[i])) * static_cast<float>(up[i]));
    }
  });
}

// One head, scaled by `inv_rms` and `norm` where a norm is given (QK-norm), then rotated half-split (HF's
// rotate_half): out[:D/2] = x1 cos - x2 sin, out[D/2:] = x2 cos + x1 sin.
template <typename In>
inline void norm_rotate(const In* x, const float* norm, float inv_rms, const float* cos, const float* sin,
                        int64_t half, float* out) {
  for (int64_t i = 0; i < half; ++i) {
    float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
    if (norm != nullptr) {
      x1 *= inv_rms * norm[i];
      x2 *= inv_rms * norm[i + half];
    }
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

// `heads` heads of one token, QK-normalized per head (Qwen3: a [D] norm) or over all of them (OLMoE: a norm of
// [heads * D], `whole`), then rotated.
template <typename In>
inline void norm_rotate_heads(const In* x, const float* norm, bool whole, float eps, const float* cos,
                              const float* sin, int64_t heads, int64_t head_dim, float* out) {
  const float whole_inv_rms = norm != nullptr && whole ? inverse_rms(x, heads * head_dim, eps) : 1.f;
  for (int64_t h = 0; h < heads; ++h) {
    const In* head = x + h * head_dim;
    const float inv_rms = norm == nullptr ? 1.f : whole ? whole_inv_rms : inverse_rms(head, head_dim, eps);
    const float* weight = norm == nullptr ? nullptr : norm + (whole ? h * head_dim : 0);
    norm_rotate(head, weight, inv_rms, cos, sin, head_dim / 2, out + h * head_dim);
  }
}

template <typename In, typename KV>
void rope_write_rows(const In* qkv, const int64_t* positions, const float* cos, const float* sin, const int64_t* slots,
                     const float* q_norm, bool q_whole, const float* k_norm, bool k_whole, float eps, KV* key_cache,
                     KV* value_cache,
                     int64_t num_slots, float* q_out, float* k_out, float* v_out, int64_t tokens, int64_t heads,
                     int64_t kv_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2, width = (heads + 2 * kv_heads) * head_dim, kv_width = kv_heads * head_dim;
  at::parallel_for(0, tokens, grain_rows(width), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const In* row = qkv + t * width;
      const float* c = cos + positions[t] * half;
      const float* s = sin + positions[t] * half;
      const int64_t slot = slots[t];
      TORCH_CHECK(slot >= 0 && slot < num_slots, "rope_write_kv: slot ", slot, " outside the cache");
      norm_rotate_heads(row, q_norm, q_whole, eps, c, s, heads, head_dim, q_out + t * heads * head_dim);
      float* k = k_out + t * kv_width;
      float* v = v_out + t * kv_width;
      norm_rotate_heads(row + heads * head_dim, k_norm, k_whole, eps, c, s, kv_heads, head_dim, k);
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

// A norm weight argument: float32 [n] contiguous, or empty for "no norm here" (nullptr).
const float* optional_weight(const torch::Tensor& weight, int64_t n, const char* name) {
  if (weight.numel() == 0) return nullptr;
  TORCH_CHECK(weight.dtype() == torch::kFloat32 && weight.is_contiguous() && weight.numel() == n, name,
              ": a float32 weight of ", n, " elements (or an empty tensor) expected");
  return weight.data_ptr<float>();
}

template <float (*Act)(float)>
void gated_activation(const torch::Tensor& gate_up, torch::Tensor& out, const char* name) {
  check_float_or_bf16(gate_up, name);
  check_float_or_bf16(out, name);
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.dim() == 2 && out.dim() == 2 && out.size(0) == rows && out.size(1) == width, name,
              ": shapes must be [T, 2I] -> [T, I]");
  const bool in_bf16 = gate_up.dtype() == torch::kBFloat16, out_bf16 = out.dtype() == torch::kBFloat16;
  if (in_bf16 && out_bf16) gated_rows<Act>(gate_up.data_ptr<BFloat16>(), out.data_ptr<BFloat16>(), rows, width);
  else if (in_bf16) gated_rows<Act>(gate_up.data_ptr<BFloat16>(), out.data_ptr<float>(), rows, width);
  else if (out_bf16) gated_rows<Act>(gate_up.data_ptr<float>(), out.data_ptr<BFloat16>(), rows, width);
  else gated_rows<Act>(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, width);
}

}  // namespace

// residual [T, H] float32, updated in place by delta [T, H] (float32 or bf16; empty: no add), RMS-normalized
// by delta_weight [H] first where that is not empty; weight [H] float32; out [T, H] float32 or bf16.
void add_rms_norm(torch::Tensor& residual, const torch::Tensor& delta, const torch::Tensor& delta_weight,
                  const torch::Tensor& weight, double eps, torch::Tensor& out) {
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
  const float* dw = optional_weight(delta_weight, hidden, "add_rms_norm: delta_weight");
  const void* d = has_delta ? delta.data_ptr() : nullptr;
  const bool d_bf16 = has_delta && delta.dtype() == torch::kBFloat16;
  const float e = static_cast<float>(eps);
  if (out.dtype() == torch::kBFloat16) {
    norm_rows(residual.data_ptr<float>(), d, d_bf16, dw, weight.data_ptr<float>(), e, out.data_ptr<BFloat16>(), rows,
              hidden);
  } else {
    norm_rows(residual.data_ptr<float>(), d, d_bf16, dw, weight.data_ptr<float>(), e, out.data_ptr<float>(), rows,
              hidden);
  }
}

// gate_up [T, 2I] (gate then up; float32 or bf16) -> out [T, I] (float32 or bf16).
void silu_mul(const torch::Tensor& gate_up, torch::Tensor& out) { gated_activation<silu>(gate_up, out, "silu_mul"); }

// The same with GELU's tanh approximation as the gate (GeGLU).
void gelu_tanh_mul(const torch::Tensor& gate_up, torch::Tensor& out) {
  gated_activation<gelu_tanh>(gate_up, out, "gelu_tanh_mul");
}

// qkv [T, (H + 2 KVH) * D] (float32 or bf16); positions, slots [T] int64; cos, sin [P, D/2] float32;
// q_norm, k_norm [D] float32 (each head's norm), [H * D] / [KVH * D] (the whole projection's), or empty tensors
// (no QK-norm); key_cache, value_cache [num_blocks, block_size, KVH, D],
// both float32 or both bfloat16 (the KV cache's dtype); q_out [T, H, D], k_out/v_out [T, KVH, D] float32 (K and V
// as cached: rounded to bf16 for a bf16 cache).
void rope_write_kv(const torch::Tensor& qkv, const torch::Tensor& positions, const torch::Tensor& cos,
                   const torch::Tensor& sin, const torch::Tensor& slots, const torch::Tensor& q_norm,
                   const torch::Tensor& k_norm, double eps, torch::Tensor& key_cache, torch::Tensor& value_cache,
                   torch::Tensor& q_out, torch::Tensor& k_out, torch::Tensor& v_out) {
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
  // A norm of D values normalizes each head (Qwen3); one of all the heads' values, the whole projection (OLMoE).
  const bool q_whole = heads > 1 && q_norm.numel() == heads * head_dim;
  const bool k_whole = kv_heads > 1 && k_norm.numel() == kv_heads * head_dim;
  const float* qn = optional_weight(q_norm, q_whole ? heads * head_dim : head_dim, "rope_write_kv: q_norm");
  const float* kn = optional_weight(k_norm, k_whole ? kv_heads * head_dim : head_dim, "rope_write_kv: k_norm");
  const int64_t max_position = cos.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_position, "rope_write_kv: position ", pos[t], " outside the rope table");
  }
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  auto run = [&](auto* rows, auto* keys, auto* values) {
    rope_write_rows(rows, pos, cos.data_ptr<float>(), sin.data_ptr<float>(), slots.data_ptr<int64_t>(), qn, q_whole,
                    kn, k_whole, static_cast<float>(eps), keys, values, num_slots, q_out.data_ptr<float>(),
                    k_out.data_ptr<float>(), v_out.data_ptr<float>(), tokens, heads, kv_heads, head_dim);
  };
  auto with_cache = [&](auto* rows) {
    if (bf16_cache) run(rows, key_cache.data_ptr<BFloat16>(), value_cache.data_ptr<BFloat16>());
    else run(rows, key_cache.data_ptr<float>(), value_cache.data_ptr<float>());
  };
  if (qkv.dtype() == torch::kBFloat16) with_cache(qkv.data_ptr<BFloat16>());
  else with_cache(qkv.data_ptr<float>());
}
