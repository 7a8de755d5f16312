// Decode attention straight from the paged KV cache: one query token per sequence.
//
// The torch fallback must first gather every sequence's blocks into a padded tensor and then read it
// again in SDPA, roughly tripling the K/V memory traffic that dominates long-context decode on CPU.
// This kernel reads each cached K/V row once, in place, through the block table.
#include "cpu_kernels.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

inline void axpy(float alpha, const float* __restrict x, float* __restrict y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

}  // namespace

// query [B, H, D]; key_cache/value_cache [num_blocks, block_size, KVH, D]; block_table [B, max_blocks];
// seq_lens [B]; out [B, H, D]. All float32 contiguous, indices int64.
void paged_decode_attention(const torch::Tensor& query, const torch::Tensor& key_cache,
                            const torch::Tensor& value_cache, const torch::Tensor& block_table,
                            const torch::Tensor& seq_lens, double scale, torch::Tensor& out) {
  TORCH_CHECK(query.dtype() == torch::kFloat32 && key_cache.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  block_table.is_contiguous() && seq_lens.is_contiguous() && out.is_contiguous(),
              "contiguous tensors expected");
  const int64_t batch = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_table.size(1);
  const float* q = query.data_ptr<float>();
  const float* k = key_cache.data_ptr<float>();
  const float* v = value_cache.data_ptr<float>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const int64_t row_stride = num_kv_heads * head_dim;  // between consecutive slots

  // One work item per (sequence, KV head): its query heads share every K/V row read.
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, kvh = item % num_kv_heads;
      const int64_t len = lens[b];
      TORCH_CHECK(len > 0 && len <= max_blocks * block_size, "sequence length out of range");
      scores.assign(group * len, 0.f);
      const float* qb = q + (b * num_heads + kvh * group) * head_dim;
      for (int64_t pos = 0; pos < len; ++pos) {
        const int64_t slot = table[b * max_blocks + pos / block_size] * block_size + pos % block_size;
        const float* krow = k + slot * row_stride + kvh * head_dim;
        for (int64_t g = 0; g < group; ++g) scores[g * len + pos] = dot(qb + g * head_dim, krow, head_dim) * fscale;
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        const float peak = *std::max_element(s, s + len);
        float total = 0.f;
        // With -ffast-math GCC turns this into libmvec's vector expf: scalar exp was the bottleneck.
#pragma omp simd reduction(+ : total)
        for (int64_t pos = 0; pos < len; ++pos) {
          s[pos] = std::exp(s[pos] - peak);
          total += s[pos];
        }
        const float inv = 1.f / total;
        for (int64_t pos = 0; pos < len; ++pos) s[pos] *= inv;
      }
      float* ob = o + (b * num_heads + kvh * group) * head_dim;
      std::fill(ob, ob + group * head_dim, 0.f);
      for (int64_t pos = 0; pos < len; ++pos) {
        const int64_t slot = table[b * max_blocks + pos / block_size] * block_size + pos % block_size;
        const float* vrow = v + slot * row_stride + kvh * head_dim;
        for (int64_t g = 0; g < group; ++g) axpy(scores[g * len + pos], vrow, ob + g * head_dim, head_dim);
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache");
  m.def("q8_0_tiled_matmul", &q8_0_tiled_matmul, "x @ W.T for Q8_0 weights in 16-column tiles, float32 in and out");
  m.def("add_rms_norm", &add_rms_norm, "residual += delta; out = RMSNorm(residual)");
  m.def("silu_mul", &silu_mul, "out = silu(gate) * up");
  m.def("rope_write_kv", &rope_write_kv, "rotate Q/K, store K/V at their slots");
  // Runs for the whole step's forward: other Python threads (the engine core's I/O) must not wait on it.
  m.def("decode_layers", &decode_layers, "all decoder layers of a pure decode step",
        py::call_guard<py::gil_scoped_release>());
}
