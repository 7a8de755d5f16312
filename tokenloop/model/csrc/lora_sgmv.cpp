// One step's LoRA products for one fused projection, every adapter at once (Punica's SGMV idea, for the CPU).
//
// A decode step of 8 streams on 8 adapters ran two oneDNN GEMMs per projection, 240 calls a step, each an
// [8, 576] x [576, 48] matrix far too small for the library's blocking (~150 us where the bytes take ~10 us).
// Here the rows are grouped by the slot they use, and each group reads only its own slot's A and B once:
//   out[t] += (x[t] A_s^T) B_s^T    for every row t of slot s (B's scaling folded in at load)
// A fused projection (Q/K/V, gate/up) stacks its parts' A rows; its B is block-diagonal, and only the diagonal
// blocks are kept, folded onto the same rank rows: B^T's row j holds, in part p's output columns, part p's row
// j. A slot's B^T is one contiguous [rank, O] block, read in one stream (the block-diagonal [P*rank, O] form
// read only the diagonal's short row pieces: one decode step 18% slower, one thread, 8 x 8 bf16). The next
// slot's A follows this one's, so a step's tasks of one projection read A and B^T in order. Sums are float32
// whatever the dtypes. A and B^T may be int8 with one float32 scale per rank row of the slot (the product of A's
// row scale and B^T's row scale in that part): half the bytes of bf16, and a decode step's products stream
// every slot's A and B^T from memory (8 adapters x 30 layers: 78 MB in bf16, more than the L3).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#endif

namespace {

using c10::BFloat16;

// Rows a task shrinks and expands together: each weight element loaded feeds this many rows.
constexpr int64_t kRowsPerTask = 4;
// Tasks a thread takes at least: 1, so that a decode step's 8 adapters split over both cores (8 streams x 8
// adapters: 0.70-0.75x of base against 0.61-0.63x on one thread, quiet machine, BENCHMARKS.md); on a machine
// busy with other work the hand-off to a descheduled second thread costs more than that.
constexpr int64_t kTaskGrain = 1;

inline float to_float(float v) { return v; }
inline float to_float(int8_t v) { return static_cast<float>(v); }
// bf16 -> float is a shift; written out so that the compiler vectorizes it.
inline float to_float(BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

struct Task {
  int64_t slot;
  int64_t first;  // index into the rows sorted by slot
  int64_t count;  // <= kRowsPerTask
};

// One task: rows `rows[0..n)` of x (already float32, [n, in]) through slot `slot`'s A and B, added to out.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// 16 weights (or fewer, masked) as float32.
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const int8_t* p, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}
inline __m512 load16(const BFloat16* p, __mmask16 m) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
// Round to nearest even, as torch's float -> bf16 does for finite values.
inline void store16(BFloat16* p, __m512 v, __mmask16 m) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
inline __mmask16 mask_upto(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
}

// One task of N rows: x (float32, [N, in]) through one slot's A ([width, in]) and folded B^T ([rank, O]),
// added to out's rows. Every weight vector loaded feeds the N rows.
template <int N, typename W, typename Out>
void run_task(const float* xs, const int64_t* rows, const W* a, const W* bt, const float* row_scales, Out* out,
              int64_t in, int64_t out_cols, int64_t width, const std::vector<int64_t>& parts, float* shrunk) {
  const int64_t rank = width / (static_cast<int64_t>(parts.size()) - 1);
  // Few rows: each sum over k in several chains, or a row's 36 dependent FMAs wait on the FMA latency.
  constexpr int kChains = N >= 4 ? 1 : (N >= 2 ? 2 : 4);
  // The slot's B^T is fetched into L2 while the shrink reads A, a few lines per A row (one decode step 8%
  // faster than letting the expand wait for it).
  const char* fetch = reinterpret_cast<const char*>(bt);
  const char* const fetch_end = fetch + rank * out_cols * static_cast<int64_t>(sizeof(W));
  const int64_t lines_per_row = ((fetch_end - fetch) / 64 + width - 1) / width;
  for (int64_t j = 0; j < width; ++j) {
    const W* arow = a + j * in;
    for (int64_t l = 0; l < lines_per_row && fetch < fetch_end; ++l, fetch += 64) _mm_prefetch(fetch, _MM_HINT_T1);
    __m512 acc[N][kChains];
    for (int r = 0; r < N; ++r)
      for (int c = 0; c < kChains; ++c) acc[r][c] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 * kChains <= in; k += 16 * kChains) {
      for (int c = 0; c < kChains; ++c) {
        const __m512 w = load16(arow + k + 16 * c, static_cast<__mmask16>(0xFFFF));
        for (int r = 0; r < N; ++r)
          acc[r][c] = _mm512_fmadd_ps(_mm512_loadu_ps(xs + r * in + k + 16 * c), w, acc[r][c]);
      }
    }
    for (; k < in; k += 16) {
      const __mmask16 m = mask_upto(in - k);
      const __m512 w = load16(arow + k, m);
      for (int r = 0; r < N; ++r)
        acc[r][0] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, xs + r * in + k), w, acc[r][0]);
    }
    const float row_scale = std::is_same_v<W, int8_t> ? row_scales[j] : 1.f;  // int8: A's and B^T's scales
    for (int r = 0; r < N; ++r) {
      __m512 sum = acc[r][0];
      for (int c = 1; c < kChains; ++c) sum = _mm512_add_ps(sum, acc[r][c]);
      shrunk[r * width + j] = _mm512_reduce_add_ps(sum) * row_scale;
    }
  }
  constexpr int64_t kVectors = 4;  // 64 output columns per pass: N x 4 accumulators
  for (size_t p = 0; p + 1 < parts.size(); ++p) {
    const int64_t j0 = static_cast<int64_t>(p) * rank;
    for (int64_t c = parts[p]; c < parts[p + 1]; c += 16 * kVectors) {
      __mmask16 m[kVectors];
      for (int64_t v = 0; v < kVectors; ++v) m[v] = mask_upto(std::max<int64_t>(0, parts[p + 1] - c - 16 * v));
      __m512 acc[N][kVectors];
      for (int r = 0; r < N; ++r)
        for (int64_t v = 0; v < kVectors; ++v) acc[r][v] = _mm512_setzero_ps();
      for (int64_t j = j0; j < j0 + rank; ++j) {
        const W* brow = bt + (j - j0) * out_cols + c;  // folded: part p's row j is B^T's row j
        __m512 b[kVectors];
        for (int64_t v = 0; v < kVectors; ++v) b[v] = load16(brow + 16 * v, m[v]);
        for (int r = 0; r < N; ++r) {
          const __m512 s = _mm512_set1_ps(shrunk[r * width + j]);
          for (int64_t v = 0; v < kVectors; ++v) acc[r][v] = _mm512_fmadd_ps(s, b[v], acc[r][v]);
        }
      }
      for (int r = 0; r < N; ++r) {
        Out* dst = out + rows[r] * out_cols + c;
        for (int64_t v = 0; v < kVectors; ++v) {
          if (m[v] == 0) break;
          store16(dst + 16 * v, _mm512_add_ps(load16(dst + 16 * v, m[v]), acc[r][v]), m[v]);
        }
      }
    }
  }
}
#else
// Without AVX-512: the same sums in plain loops (the compiler vectorizes what it can).
template <int N, typename W, typename Out>
void run_task(const float* xs, const int64_t* rows, const W* a, const W* bt, const float* row_scales, Out* out,
              int64_t in, int64_t out_cols, int64_t width, const std::vector<int64_t>& parts, float* shrunk) {
  const int64_t rank = width / (static_cast<int64_t>(parts.size()) - 1);
  for (int r = 0; r < N; ++r) {
    for (int64_t j = 0; j < width; ++j) {
      float sum = 0.f;
      for (int64_t k = 0; k < in; ++k) sum += xs[r * in + k] * to_float(a[j * in + k]);
      shrunk[r * width + j] = std::is_same_v<W, int8_t> ? sum * row_scales[j] : sum;
    }
    Out* dst = out + rows[r] * out_cols;
    for (size_t p = 0; p + 1 < parts.size(); ++p) {
      for (int64_t c = parts[p]; c < parts[p + 1]; ++c) {
        float sum = 0.f;
        for (int64_t j = 0; j < rank; ++j)
          sum += shrunk[r * width + static_cast<int64_t>(p) * rank + j] * to_float(bt[j * out_cols + c]);
        dst[c] = static_cast<Out>(to_float(dst[c]) + sum);
      }
    }
  }
}
#endif

template <typename X>
void rows_to_float(const X* x, const int64_t* rows, int64_t n, int64_t in, float* xs) {
  for (int64_t r = 0; r < n; ++r) {
    const X* src = x + rows[r] * in;
    float* dst = xs + r * in;
#pragma omp simd
    for (int64_t k = 0; k < in; ++k) dst[k] = to_float(src[k]);
  }
}

template <typename W, typename Out>
void run_all(const torch::Tensor& x, const W* a, const W* bt, const float* scales, Out* out,
             const std::vector<Task>& tasks,
             const std::vector<int64_t>& order, int64_t in, int64_t out_cols, int64_t width,
             const std::vector<int64_t>& parts) {
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  const int64_t rank = width / (static_cast<int64_t>(parts.size()) - 1);
  const bool x_bf16 = x.dtype() == torch::kBFloat16;
  const void* xdata = x.data_ptr();
  // torch's thread pool (as the other kernels here): a second OpenMP runtime's threads would fight its own.
  at::parallel_for(0, num_tasks, kTaskGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> xs(kRowsPerTask * in), shrunk(kRowsPerTask * width);
    for (int64_t i = begin; i < end; ++i) {
      const Task& task = tasks[i];
      const int64_t* rows = order.data() + task.first;
      if (x_bf16) {
        rows_to_float(static_cast<const BFloat16*>(xdata), rows, task.count, in, xs.data());
      } else {
        rows_to_float(static_cast<const float*>(xdata), rows, task.count, in, xs.data());
      }
      const W* slot_a = a + task.slot * width * in;
      const W* slot_bt = bt + task.slot * rank * out_cols;
      const float* slot_scales = scales == nullptr ? nullptr : scales + task.slot * width;
      float* sh = shrunk.data();
      switch (task.count) {  // the row count as a constant: the accumulators stay in registers
        case 1: run_task<1>(xs.data(), rows, slot_a, slot_bt, slot_scales, out, in, out_cols, width, parts, sh); break;
        case 2: run_task<2>(xs.data(), rows, slot_a, slot_bt, slot_scales, out, in, out_cols, width, parts, sh); break;
        case 3: run_task<3>(xs.data(), rows, slot_a, slot_bt, slot_scales, out, in, out_cols, width, parts, sh); break;
        default: run_task<4>(xs.data(), rows, slot_a, slot_bt, slot_scales, out, in, out_cols, width, parts, sh);
      }
    }
  });
}

void check_float_or_bf16(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() &&
                  (t.dtype() == torch::kFloat32 || t.dtype() == torch::kBFloat16),
              name, " must be a contiguous float32 or bfloat16 CPU tensor");
}

template <typename Out>
void run_weights(const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& bt, const torch::Tensor& scales,
                 Out* out, const std::vector<Task>& tasks, const std::vector<int64_t>& order, int64_t in,
                 int64_t out_cols, int64_t width, const std::vector<int64_t>& parts) {
  if (a.dtype() == torch::kInt8) {
    run_all(x, a.data_ptr<int8_t>(), bt.data_ptr<int8_t>(), scales.data_ptr<float>(), out, tasks, order, in,
            out_cols, width, parts);
  } else if (a.dtype() == torch::kBFloat16) {
    run_all(x, a.data_ptr<BFloat16>(), bt.data_ptr<BFloat16>(), nullptr, out, tasks, order, in, out_cols, width,
            parts);
  } else {
    run_all(x, a.data_ptr<float>(), bt.data_ptr<float>(), nullptr, out, tasks, order, in, out_cols, width, parts);
  }
}

}  // namespace

// out [T, O] (float32 or bf16) += for each row t with token_slots[t] = s >= 0: (x[t] A_s^T) B_s^T, where
// A_s = a[s*width:(s+1)*width] ([width, I]); rows with slot -1 are left alone. `parts` (P+1 column bounds,
// 0 .. O) splits width into P equal rank blocks (rank = width / P), block p writing only columns
// [parts[p], parts[p+1]): B_s^T is block-diagonal, and bt [S*rank, O] keeps its diagonal folded, its rows
// s*rank + j holding in part p's columns row p*rank + j of B_s^T. x [T, I] float32 or bf16; a and bt of one
// dtype: float32, bf16, or int8 with `scales` [S*width] float32 (row s*width + j's shrunk value times
// scales[s*width + j]: A's row scale times B^T's in that part); scales is empty for float a and bt.
void lora_sgmv(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& bt,
               const torch::Tensor& scales, const torch::Tensor& token_slots, int64_t width,
               const std::vector<int64_t>& parts) {
  check_float_or_bf16(out, "lora_sgmv: out");
  check_float_or_bf16(x, "lora_sgmv: x");
  TORCH_CHECK(a.dtype() == bt.dtype(), "lora_sgmv: a and bt must share a dtype");
  if (a.dtype() == torch::kInt8) {
    TORCH_CHECK(a.device().is_cpu() && a.is_contiguous() && bt.device().is_cpu() && bt.is_contiguous(),
                "lora_sgmv: int8 a and bt must be contiguous CPU tensors");
    TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.is_contiguous() && scales.dim() == 1 &&
                    scales.size(0) == a.size(0),
                "lora_sgmv: int8 a and bt need scales, one float32 per row of a");
  } else {
    check_float_or_bf16(a, "lora_sgmv: a");
    check_float_or_bf16(bt, "lora_sgmv: bt");
    TORCH_CHECK(scales.numel() == 0, "lora_sgmv: scales are for int8 a and bt only");
  }
  TORCH_CHECK(token_slots.dtype() == torch::kInt64 && token_slots.is_contiguous() && token_slots.dim() == 1,
              "lora_sgmv: token_slots must be a contiguous int64 vector");
  const int64_t rows = x.size(0), in = x.size(1), out_cols = out.size(1);
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && out.size(0) == rows && token_slots.size(0) == rows,
              "lora_sgmv: x [T, I], out [T, O] and token_slots [T] must agree on T");
  TORCH_CHECK(width > 0 && parts.size() >= 2 && width % static_cast<int64_t>(parts.size() - 1) == 0,
              "lora_sgmv: width must split into one equal rank block per part");
  TORCH_CHECK(parts.front() == 0 && parts.back() == out_cols && std::is_sorted(parts.begin(), parts.end()),
              "lora_sgmv: parts must rise from 0 to out's columns");
  const int64_t rank = width / static_cast<int64_t>(parts.size() - 1);
  TORCH_CHECK(a.dim() == 2 && bt.dim() == 2 && a.size(1) == in && bt.size(1) == out_cols &&
                  a.size(0) % width == 0 && bt.size(0) == a.size(0) / width * rank,
              "lora_sgmv: a [S*width, I] and bt [S*rank, O] must fit x and out");
  const int64_t num_slots = a.size(0) / width;
  // Group the rows by slot (a counting sort), then cut each group into tasks of kRowsPerTask rows.
  const int64_t* slot_of = token_slots.data_ptr<int64_t>();
  std::vector<int64_t> counts(num_slots + 1, 0);
  for (int64_t t = 0; t < rows; ++t) {
    TORCH_CHECK(slot_of[t] >= -1 && slot_of[t] < num_slots, "lora_sgmv: token_slots[", t, "] = ", slot_of[t],
                " is not a slot (or -1)");
    if (slot_of[t] >= 0) ++counts[slot_of[t] + 1];
  }
  for (int64_t s = 0; s < num_slots; ++s) counts[s + 1] += counts[s];
  std::vector<int64_t> order(counts.back()), next(counts.begin(), counts.end() - 1);
  for (int64_t t = 0; t < rows; ++t) {
    if (slot_of[t] >= 0) order[next[slot_of[t]]++] = t;
  }
  std::vector<Task> tasks;
  for (int64_t s = 0; s < num_slots; ++s) {
    for (int64_t first = counts[s]; first < counts[s + 1]; first += kRowsPerTask) {
      tasks.push_back({s, first, std::min(kRowsPerTask, counts[s + 1] - first)});
    }
  }
  if (tasks.empty()) return;
  if (out.dtype() == torch::kBFloat16) {
    run_weights(x, a, bt, scales, out.data_ptr<BFloat16>(), tasks, order, in, out_cols, width, parts);
  } else {
    run_weights(x, a, bt, scales, out.data_ptr<float>(), tasks, order, in, out_cols, width, parts);
  }
}
