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

#ifdef __AVX512F__
#include <immintrin.h>
#endif

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

// Calls fn(position, slot) for positions [0, len) of one sequence, block by block (no division per position).
template <typename Fn>
inline void for_each_slot(const int64_t* table_row, int64_t len, int64_t block_size, Fn&& fn) {
  for (int64_t start = 0, block = 0; start < len; start += block_size, ++block) {
    const int64_t base = table_row[block] * block_size, count = std::min(block_size, len - start);
    for (int64_t offset = 0; offset < count; ++offset) fn(start + offset, base + offset);
  }
}

// Softmax of each of `group` rows of `len` scores, in place.
inline void softmax_rows(float* scores, int64_t group, int64_t len) {
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * len;
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
}

#ifdef __AVX512F__
// One (sequence, KV head) item for G query heads of D16 x 16 dims: the queries and the G output rows stay in
// registers while each K and V row is read once (the generic loop reloads them and its output per row).
template <int G, int D16>
void attend_in_registers(const float* qb, const float* k, const float* v, const int64_t* table_row, int64_t len,
                         int64_t block_size, int64_t row_stride, float scale, float* scores, float* ob) {
  __m512 q[G][D16];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int j = 0; j < D16; ++j) q[g][j] = _mm512_loadu_ps(qb + g * D16 * 16 + j * 16);
  for_each_slot(table_row, len, block_size, [&](int64_t pos, int64_t slot) {
    const float* krow = k + slot * row_stride;
    __m512 kv[D16];
#pragma GCC unroll 8
    for (int j = 0; j < D16; ++j) kv[j] = _mm512_loadu_ps(krow + j * 16);
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      __m512 sum = _mm512_mul_ps(q[g][0], kv[0]);
#pragma GCC unroll 8
      for (int j = 1; j < D16; ++j) sum = _mm512_fmadd_ps(q[g][j], kv[j], sum);
      scores[g * len + pos] = _mm512_reduce_add_ps(sum) * scale;
    }
  });
  softmax_rows(scores, G, len);
  __m512 acc[G][D16];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int j = 0; j < D16; ++j) acc[g][j] = _mm512_setzero_ps();
  for_each_slot(table_row, len, block_size, [&](int64_t pos, int64_t slot) {
    const float* vrow = v + slot * row_stride;
#pragma GCC unroll 8
    for (int j = 0; j < D16; ++j) {
      const __m512 value = _mm512_loadu_ps(vrow + j * 16);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) acc[g][j] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * len + pos]), value, acc[g][j]);
    }
  });
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int j = 0; j < D16; ++j) _mm512_storeu_ps(ob + g * D16 * 16 + j * 16, acc[g][j]);
}

using AttendFn = void (*)(const float*, const float*, const float*, const int64_t*, int64_t, int64_t, int64_t, float,
                          float*, float*);

// The register kernel for this shape: head_dim 64 or 128, 1-4 query heads per KV head; nullptr otherwise.
AttendFn register_kernel(int64_t group, int64_t head_dim) {
  static constexpr AttendFn kD64[] = {&attend_in_registers<1, 4>, &attend_in_registers<2, 4>,
                                      &attend_in_registers<3, 4>, &attend_in_registers<4, 4>};
  static constexpr AttendFn kD128[] = {&attend_in_registers<1, 8>, &attend_in_registers<2, 8>,
                                       &attend_in_registers<3, 8>, &attend_in_registers<4, 8>};
  if (group < 1 || group > 4) return nullptr;
  if (head_dim == 64) return kD64[group - 1];
  if (head_dim == 128) return kD128[group - 1];
  return nullptr;
}
#endif

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

#ifdef __AVX512F__
  const AttendFn in_registers = register_kernel(group, head_dim);
#endif
  // One work item per (sequence, KV head): its query heads share every K/V row read.
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, kvh = item % num_kv_heads;
      const int64_t len = lens[b];
      TORCH_CHECK(len > 0 && len <= max_blocks * block_size, "sequence length out of range");
      scores.assign(group * len, 0.f);
      const float* qb = q + (b * num_heads + kvh * group) * head_dim;
      float* ob = o + (b * num_heads + kvh * group) * head_dim;
      const int64_t* table_row = table + b * max_blocks;
      const float* k_head = k + kvh * head_dim;
      const float* v_head = v + kvh * head_dim;
#ifdef __AVX512F__
      if (in_registers != nullptr) {
        in_registers(qb, k_head, v_head, table_row, len, block_size, row_stride, fscale, scores.data(), ob);
        continue;
      }
#endif
      for_each_slot(table_row, len, block_size, [&](int64_t pos, int64_t slot) {
        const float* krow = k_head + slot * row_stride;
        for (int64_t g = 0; g < group; ++g) scores[g * len + pos] = dot(qb + g * head_dim, krow, head_dim) * fscale;
      });
      softmax_rows(scores.data(), group, len);
      std::fill(ob, ob + group * head_dim, 0.f);
      for_each_slot(table_row, len, block_size, [&](int64_t pos, int64_t slot) {
        const float* vrow = v_head + slot * row_stride;
        for (int64_t g = 0; g < group; ++g) axpy(scores[g * len + pos], vrow, ob + g * head_dim, head_dim);
      });
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache");
  m.def("q8_0_tiled_matmul", &q8_0_tiled_matmul, "x @ W.T for Q8_0 weights in 16-column tiles, float32 in and out");
  m.def("int4_dot_matmul", &int4_dot_matmul, "x @ W.T for 4-bit codes with per-32 d and m, int8 dot products");
  m.def("q8_0_dot_matmul", &q8_0_dot_matmul, "x @ W.T for Q8_0 codes, int8 dot products, float32 in and out");
  m.def("int8_dot_native", &int8_dot_native, "whether the int8 dot kernels run AVX512-VNNI (else plain loops)");
  m.def("add_rms_norm", &add_rms_norm, "residual += delta; out = RMSNorm(residual)");
  m.def("silu_mul", &silu_mul, "out = silu(gate) * up");
  m.def("rope_write_kv", &rope_write_kv, "rotate Q/K, store K/V at their slots");
  // Runs for the whole step's forward: other Python threads (the engine core's I/O) must not wait on it.
  m.def("decode_layers", &decode_layers, "all decoder layers of a pure decode step",
        py::call_guard<py::gil_scoped_release>());
}
