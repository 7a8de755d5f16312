// x @ W.T for a ggml Q8_0 weight (int8 codes, one scale per 32 values), float32 in and out.
//
// torch's int8 weight-only kernel takes one scale per row and returns bf16; the vocabulary projection
// needs neither: per-row requantization and bf16 logits (steps of 1/8 at |logit| ~ 20) each flip greedy
// choices measurably. Here every weight row is dequantized exactly (an int8 code times an fp16 scale fits
// float32) into a small buffer once, then dotted with each activation row: the file's values, fp32 sums.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

namespace {
constexpr int64_t kGroup = 32;
}

// x [M, K] float32; codes [N, K] int8; scales [N, K / 32] float32; out [M, N] float32. All contiguous.
void q8_0_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                 torch::Tensor& out) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && codes.dtype() == torch::kInt8 &&
                  scales.dtype() == torch::kFloat32 && out.dtype() == torch::kFloat32,
              "q8_0_matmul: float32 x, int8 codes, float32 scales, float32 out");
  TORCH_CHECK(x.is_contiguous() && codes.is_contiguous() && scales.is_contiguous() && out.is_contiguous(),
              "q8_0_matmul: contiguous tensors expected");
  const int64_t rows = x.size(0), k = x.size(1), n = codes.size(0);
  TORCH_CHECK(codes.size(1) == k && k % kGroup == 0 && scales.size(0) == n && scales.size(1) == k / kGroup &&
                  out.size(0) == rows && out.size(1) == n,
              "q8_0_matmul: shape mismatch");
  const float* xp = x.data_ptr<float>();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(k);
    float* __restrict w = row.data();
    for (int64_t j = begin; j < end; ++j) {
      const int8_t* __restrict q = cp + j * k;
      const float* __restrict d = sp + j * (k / kGroup);
      for (int64_t g = 0; g < k / kGroup; ++g) {
        const float scale = d[g];
#pragma omp simd
        for (int64_t i = 0; i < kGroup; ++i) {
          w[g * kGroup + i] = scale * static_cast<float>(q[g * kGroup + i]);
        }
      }
      int64_t r = 0;
      for (; r + 4 <= rows; r += 4) {  // four activation rows per pass over the row buffer
        const float* __restrict x0 = xp + r * k;
        const float* __restrict x1 = x0 + k;
        const float* __restrict x2 = x1 + k;
        const float* __restrict x3 = x2 + k;
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
        for (int64_t i = 0; i < k; ++i) {
          a0 += w[i] * x0[i];
          a1 += w[i] * x1[i];
          a2 += w[i] * x2[i];
          a3 += w[i] * x3[i];
        }
        op[r * n + j] = a0;
        op[(r + 1) * n + j] = a1;
        op[(r + 2) * n + j] = a2;
        op[(r + 3) * n + j] = a3;
      }
      for (; r < rows; ++r) {
        const float* __restrict xr = xp + r * k;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < k; ++i) acc += w[i] * xr[i];
        op[r * n + j] = acc;
      }
    }
  });
}
