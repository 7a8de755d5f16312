// Dense copies of 4-bit GGUF weights, built at load: one pass from ggml's Q4_0 / Q4_1 bytes to float32 or
// bf16, where torch takes five (unpack, widen, scale, offset, narrow; ~0.2 s of a start for SmolLM2).
// w = d * q + m: d * q is exact in float32 (q < 16, d an fp16 value), so fused or not it rounds once, as
// torch's `codes.float() * d + m` does; bf16 is rounded to nearest even, as `Tensor.to(torch.bfloat16)`.
#include "cpu_kernels.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

namespace {

constexpr int64_t kGroup = 32, kPairs = kGroup / 2;

template <typename Out>
void unpack_rows(const uint8_t* nibbles, const float* d, const float* m, Out* out, int64_t rows, int64_t blocks) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / (blocks * kGroup)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* bytes = nibbles + (r * blocks + b) * kPairs;
        const float scale = d[r * blocks + b], offset = m[r * blocks + b];
        Out* values = out + (r * blocks + b) * kGroup;
        for (int64_t j = 0; j < kPairs; ++j) {  // value j in the low nibble of byte j, j + 16 in the high one
          values[j] = static_cast<Out>(scale * static_cast<float>(bytes[j] & 0x0F) + offset);
          values[j + kPairs] = static_cast<Out>(scale * static_cast<float>(bytes[j] >> 4) + offset);
        }
      }
    }
  });
}

}  // namespace

void q4_unpack(const torch::Tensor& nibbles, const torch::Tensor& d, const torch::Tensor& m, torch::Tensor& out) {
  TORCH_CHECK(nibbles.dtype() == torch::kUInt8 && nibbles.dim() == 3 && nibbles.size(2) == kPairs &&
                  nibbles.is_contiguous(),
              "q4_unpack: contiguous uint8 nibbles [N, B, 16] expected, got ", nibbles.dtype(), " ", nibbles.sizes());
  const int64_t rows = nibbles.size(0), blocks = nibbles.size(1);
  for (const torch::Tensor* t : {&d, &m}) {
    TORCH_CHECK(t->dtype() == torch::kFloat32 && t->is_contiguous() && t->dim() == 2 && t->size(0) == rows &&
                    t->size(1) == blocks,
                "q4_unpack: contiguous float32 d and m [", rows, ", ", blocks, "] expected, got ", t->sizes());
  }
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == rows && out.size(1) == blocks * kGroup &&
                  (out.dtype() == torch::kFloat32 || out.dtype() == torch::kBFloat16),
              "q4_unpack: contiguous float32 or bfloat16 out [", rows, ", ", blocks * kGroup, "] expected, got ",
              out.dtype(), " ", out.sizes());
  const uint8_t* bytes = nibbles.data_ptr<uint8_t>();
  if (out.dtype() == torch::kFloat32) {
    unpack_rows(bytes, d.data_ptr<float>(), m.data_ptr<float>(), out.data_ptr<float>(), rows, blocks);
  } else {
    unpack_rows(bytes, d.data_ptr<float>(), m.data_ptr<float>(), out.data_ptr<c10::BFloat16>(), rows, blocks);
  }
}
