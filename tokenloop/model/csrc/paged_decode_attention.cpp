// Decode attention straight from the paged KV cache: one query token per sequence.
//
// The torch fallback must first gather every sequence's blocks into a padded tensor and then read it
// again in SDPA, roughly tripling the K/V memory traffic that dominates long-context decode on CPU.
// This kernel reads each cached K/V row once, in place, through the block table. A bfloat16 cache halves
// those bytes; its rows are widened to float32 as they are loaded (a 16-bit shift), so the sums stay fp32.
// A sliding-window layer attends only the `window` latest keys: the walk starts at the block holding the first
// of them (a sliding KV group's table holds released entries, id -1, before it; docs/kv-groups.md).
#include "cpu_kernels.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define TOKENLOOP_REGISTER_ATTENTION 1
#endif

namespace {

using c10::BFloat16;

// K/V rows are float32 or bfloat16 (the KV cache's dtype); queries, scores and sums are always float32.
inline float widen(float x) { return x; }
inline float widen(BFloat16 x) { return static_cast<float>(x); }

template <typename KV>
inline float dot(const float* __restrict a, const KV* __restrict b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * widen(b[i]);
  return acc;
}

template <typename KV>
inline void axpy(float alpha, const KV* __restrict x, float* __restrict y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * widen(x[i]);
}

// Calls fn(index, slot) for positions [first, len) of one sequence (index = position - first), block by block
// (no division per position).
template <typename Fn>
inline void for_each_slot(const int64_t* table_row, int64_t first, int64_t len, int64_t block_size, Fn&& fn) {
  for (int64_t block = first / block_size, start = block * block_size; start < len; start += block_size, ++block) {
    TORCH_CHECK(table_row[block] >= 0, "paged_decode_attention: a released block inside the attended span");
    const int64_t base = table_row[block] * block_size;
    for (int64_t pos = std::max(start, first), stop = std::min(start + block_size, len); pos < stop; ++pos) {
      fn(pos - first, base + pos - start);
    }
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
// 16 K/V values as float32: a plain load, or bf16 widened by a 16-bit shift (exact).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// One (sequence, KV head) item for G query heads of D16 x 16 dims: the queries and the G output rows stay in
// registers while each K and V row is read once (the generic loop reloads them and its output per row).
template <typename KV, int G, int D16>
void attend_in_registers(const float* qb, const KV* k, const KV* v, const int64_t* table_row, int64_t first,
                         int64_t end, int64_t block_size, int64_t row_stride, float scale, float* scores, float* ob) {
  const int64_t len = end - first;  // keys attended: the stride of the score rows
  __m512 q[G][D16];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int j = 0; j < D16; ++j) q[g][j] = _mm512_loadu_ps(qb + g * D16 * 16 + j * 16);
  for_each_slot(table_row, first, end, block_size, [&](int64_t pos, int64_t slot) {
    const KV* krow = k + slot * row_stride;
    __m512 kv[D16];
#pragma GCC unroll 8
    for (int j = 0; j < D16; ++j) kv[j] = load16(krow + j * 16);
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
  for_each_slot(table_row, first, end, block_size, [&](int64_t pos, int64_t slot) {
    const KV* vrow = v + slot * row_stride;
#pragma GCC unroll 8
    for (int j = 0; j < D16; ++j) {
      const __m512 value = load16(vrow + j * 16);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) acc[g][j] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * len + pos]), value, acc[g][j]);
    }
  });
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int j = 0; j < D16; ++j) _mm512_storeu_ps(ob + g * D16 * 16 + j * 16, acc[g][j]);
}

constexpr int kLanes = 16;  // floats per vector register
#elif defined(TOKENLOOP_REGISTER_ATTENTION)
// 8 K/V values as float32: a plain load, or bf16 widened by a 16-bit shift (exact).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// The AVX2 form of the item above for G query heads of D8 x 8 dims. 16 vector registers cannot hold G queries
// and G output rows, so: each K row is loaded once and multiplied by the G queries (read from L1), and the G
// dot products are reduced together by horizontal adds (the generic loop reduced each one alone); then the
// output is built in slices of C x 8 dims, the slice's G rows in registers while every V row's slice streams by.
template <typename KV, int G, int D8>
void attend_in_registers(const float* qb, const KV* k, const KV* v, const int64_t* table_row, int64_t first,
                         int64_t end, int64_t block_size, int64_t row_stride, float scale, float* scores, float* ob) {
  const int64_t len = end - first;  // keys attended: the stride of the score rows
  static_assert(G >= 1 && G <= 4, "1-4 query heads per KV head");
  for_each_slot(table_row, first, end, block_size, [&](int64_t pos, int64_t slot) {
    const KV* krow = k + slot * row_stride;
    __m256 sum[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
#pragma GCC unroll 16
    for (int j = 0; j < D8; ++j) {
      const __m256 key = load8(krow + j * 8);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) sum[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qb + g * D8 * 8 + j * 8), key, sum[g]);
    }
    // Lane-wise: [s0 s1 s2 s3] partial sums in each 128-bit half; the halves' sum is the four dot products.
    const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(sum[0], sum[1]), _mm256_hadd_ps(sum[2], sum[3]));
    alignas(16) float dots[4];
    _mm_store_ps(dots, _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1)));
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) scores[g * len + pos] = dots[g] * scale;
  });
  softmax_rows(scores, G, len);
  constexpr int C = G <= 2 ? 4 : 2;  // G x C accumulators + G weights + 1 value fit in 16 registers
  static_assert(D8 % C == 0, "head_dim must be a multiple of the slice");
  for (int base = 0; base < D8; base += C) {
    __m256 acc[G][C];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[g][c] = _mm256_setzero_ps();
    for_each_slot(table_row, first, end, block_size, [&](int64_t pos, int64_t slot) {
      const KV* vrow = v + slot * row_stride + base * 8;
      __m256 weight[G];
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) weight[g] = _mm256_broadcast_ss(scores + g * len + pos);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const __m256 value = load8(vrow + c * 8);
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) acc[g][c] = _mm256_fmadd_ps(weight[g], value, acc[g][c]);
      }
    });
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) _mm256_storeu_ps(ob + g * D8 * 8 + (base + c) * 8, acc[g][c]);
  }
}

constexpr int kLanes = 8;
#endif

#ifdef TOKENLOOP_REGISTER_ATTENTION
template <typename KV>
using AttendFn = void (*)(const float*, const KV*, const KV*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                          float, float*, float*);

// The register kernel for this shape: head_dim 64 or 128, 1-4 query heads per KV head; nullptr otherwise.
template <typename KV>
AttendFn<KV> register_kernel(int64_t group, int64_t head_dim) {
  constexpr int k64 = 64 / kLanes, k128 = 128 / kLanes;
  static constexpr AttendFn<KV> kD64[] = {&attend_in_registers<KV, 1, k64>, &attend_in_registers<KV, 2, k64>,
                                          &attend_in_registers<KV, 3, k64>, &attend_in_registers<KV, 4, k64>};
  static constexpr AttendFn<KV> kD128[] = {&attend_in_registers<KV, 1, k128>, &attend_in_registers<KV, 2, k128>,
                                           &attend_in_registers<KV, 3, k128>, &attend_in_registers<KV, 4, k128>};
  if (group < 1 || group > 4) return nullptr;
  if (head_dim == 64) return kD64[group - 1];
  if (head_dim == 128) return kD128[group - 1];
  return nullptr;
}
#endif

template <typename KV>
void attend_all(const float* q, const KV* k, const KV* v, const int64_t* table, const int64_t* lens, float* o,
                int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                int64_t max_blocks, float fscale, int64_t window) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row_stride = num_kv_heads * head_dim;  // between consecutive slots
#ifdef TOKENLOOP_REGISTER_ATTENTION
  const AttendFn<KV> in_registers = register_kernel<KV>(group, head_dim);
#endif
  // One work item per (sequence, KV head): its query heads share every K/V row read.
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, kvh = item % num_kv_heads;
      const int64_t len = lens[b];
      TORCH_CHECK(len > 0 && len <= max_blocks * block_size, "sequence length out of range");
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;  // the first key attended
      const int64_t count = len - first;
      scores.assign(group * count, 0.f);
      const float* qb = q + (b * num_heads + kvh * group) * head_dim;
      float* ob = o + (b * num_heads + kvh * group) * head_dim;
      const int64_t* table_row = table + b * max_blocks;
      const KV* k_head = k + kvh * head_dim;
      const KV* v_head = v + kvh * head_dim;
#ifdef TOKENLOOP_REGISTER_ATTENTION
      if (in_registers != nullptr) {
        in_registers(qb, k_head, v_head, table_row, first, len, block_size, row_stride, fscale, scores.data(), ob);
        continue;
      }
#endif
      for_each_slot(table_row, first, len, block_size, [&](int64_t index, int64_t slot) {
        const KV* krow = k_head + slot * row_stride;
        for (int64_t g = 0; g < group; ++g) scores[g * count + index] = dot(qb + g * head_dim, krow, head_dim) * fscale;
      });
      softmax_rows(scores.data(), group, count);
      std::fill(ob, ob + group * head_dim, 0.f);
      for_each_slot(table_row, first, len, block_size, [&](int64_t index, int64_t slot) {
        const KV* vrow = v_head + slot * row_stride;
        for (int64_t g = 0; g < group; ++g) axpy(scores[g * count + index], vrow, ob + g * head_dim, head_dim);
      });
    }
  });
}

}  // namespace

// query [B, H, D] float32; key_cache/value_cache [num_blocks, block_size, KVH, D], both float32 or both
// bfloat16 (the KV cache's dtype); block_table [B, max_blocks]; seq_lens [B]; out [B, H, D] float32.
// All contiguous, indices int64. window > 0: each query attends only its `window` latest keys (itself included).
void paged_decode_attention(const torch::Tensor& query, const torch::Tensor& key_cache,
                            const torch::Tensor& value_cache, const torch::Tensor& block_table,
                            const torch::Tensor& seq_lens, double scale, torch::Tensor& out, int64_t window) {
  const bool bf16 = key_cache.dtype() == torch::kBFloat16;
  TORCH_CHECK(query.dtype() == torch::kFloat32 && out.dtype() == torch::kFloat32 &&
                  (bf16 || key_cache.dtype() == torch::kFloat32) && value_cache.dtype() == key_cache.dtype(),
              "paged_decode_attention: float32 queries and a float32 or bfloat16 KV cache expected");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  block_table.is_contiguous() && seq_lens.is_contiguous() && out.is_contiguous(),
              "contiguous tensors expected");
  const int64_t batch = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  if (bf16) {
    attend_all(query.data_ptr<float>(), key_cache.data_ptr<BFloat16>(), value_cache.data_ptr<BFloat16>(), table,
               lens, out.data_ptr<float>(), batch, num_heads, num_kv_heads, head_dim, block_size,
               block_table.size(1), fscale, window);
  } else {
    attend_all(query.data_ptr<float>(), key_cache.data_ptr<float>(), value_cache.data_ptr<float>(), table, lens,
               out.data_ptr<float>(), batch, num_heads, num_kv_heads, head_dim, block_size, block_table.size(1),
               fscale, window);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache", py::arg("query"),
        py::arg("key_cache"), py::arg("value_cache"), py::arg("block_table"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("out"), py::arg("window") = 0);
  // What attention.AttentionMetadata asks of a decode kernel before it hands it a sliding group's rows.
  m.attr("decode_attention_window") = true;
  m.def("q8_0_tiled_matmul", &q8_0_tiled_matmul, "x @ W.T for Q8_0 weights in 16-column tiles, float32 in and out");
  m.def("int4_dot_matmul", &int4_dot_matmul, "x @ W.T for 4-bit codes with per-32 d and m, int8 dot products");
  m.def("q8_0_dot_matmul", &q8_0_dot_matmul, "x @ W.T for Q8_0 codes, int8 dot products, float32 in and out");
  m.def("kquant_dot_matmul", &kquant_dot_matmul, "x @ W.T for Q5_K / Q6_K codes, int8 dot products");
  m.def("int8_dot_stack", &int8_dot_stack, "x @ W.T for a row stack of int8-dot packs, side by side in one out");
  m.def("int8_gemm", &int8_gemm, "x @ W.T for many rows of an int8-dot pack (kind 4-8), 1 or 2 code sets",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("out"), py::arg("kind"), py::arg("passes"));
  m.def("int8_gemm_native", &int8_gemm_native, "whether int8_gemm runs here (AVX512-VNNI)");
  m.def("int8_dot_native", &int8_dot_native, "whether the int8 dot kernels run AVX512-VNNI or AVX2 (else plain loops)");
  m.def("compiled_isa", &compiled_isa, "the instruction sets this build targets, space-separated");
  m.def("add_rms_norm", &add_rms_norm, "residual += delta (or RMSNorm(delta)); out = RMSNorm(residual)");
  m.def("silu_mul", &silu_mul, "out = silu(gate) * up");
  m.def("gelu_tanh_mul", &gelu_tanh_mul, "out = gelu_tanh(gate) * up");
  m.def("rope_write_kv", &rope_write_kv, "QK-norm and rotate Q/K, store K/V at their slots");
  m.def("lora_sgmv", &lora_sgmv, "out += each row's adapter (x A^T) B^T, rows grouped by adapter slot");
  m.def("moe_experts", &moe_experts, "a mixture-of-experts block of int8-dot packed experts in one parallel region");
  m.def("q4_unpack", &q4_unpack, "Q4_0 / Q4_1 bytes with d and m -> a dense float32 or bf16 matrix");
  // Runs for the whole step's forward: other Python threads (the engine core's I/O) must not wait on it.
  m.def("decode_layers", &decode_layers, "all decoder layers of a pure decode step",
        py::call_guard<py::gil_scoped_release>());
}
