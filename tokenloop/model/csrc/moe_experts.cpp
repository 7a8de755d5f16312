// A mixture-of-experts block (layers/moe.py's `moe_block`) in one call and one parallel region, for packed
// experts on the CPU.
//
// The op path makes, at one decode token, 8 experts x 2 projections = 16 kernel calls a layer, each quantizing
// its activations again and opening its own parallel region, besides ~20 small torch ops for the routing and
// the weighted sum. Here one region runs, with a barrier between them:
//   1. the router's logits (experts split over threads) and each token's activations quantized, once;
//   2. one thread: softmax, top k (renormalized or not), the (token, expert) pairs sorted by expert;
//   3. every active expert's gate/up tiles, split over the threads by cost (bytes, and rows where they are many);
//   4. SiLU(gate) x up for each pair, quantized for down;
//   5. every active expert's down tiles, split the same way;
//   6. each token's output: its pairs' down outputs weighted by the router, summed in top-k order.
// The products are int8_dot_matmul.cpp's own blocks (int8_dot_tiles.inc), so each expert's output is bit for bit
// what its pack's matmul gives; the PyTorch path stays the reference twin (tests/model/test_moe_native.py).
#include "cpu_kernels.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace {

// A tile's cost in the split, in units of one activation row's work on it: a tile of 16 columns streams its
// codes once (~16 KB at K = 2048, Q4) and then costs each row a block of dot products (measured here about a
// quarter of the read). Memory-bound decode splits by bytes; prefill's hundreds of rows by rows.
constexpr int64_t kTileReadCost = 4;

// One projection of every expert: [E][tiles][K / 32][bytes] codes, fp16 scales alike.
struct ExpertPack {
  const uint8_t* codes;
  const uint16_t* scales;
  int64_t code_stride, scale_stride;  // per expert
  int64_t tiles, n, form;

  ExpertPack(const torch::Tensor& c, const torch::Tensor& s, int64_t width, int64_t f)
      : codes(c.data_ptr<uint8_t>()), scales(reinterpret_cast<const uint16_t*>(s.data_ptr<at::Half>())),
        code_stride(c.stride(0)), scale_stride(s.stride(0)), tiles(c.size(1)), n(width), form(f) {}
};

// A step's (token, expert) pairs, sorted by expert (stable: tokens in order within an expert).
struct Pairs {
  std::vector<int64_t> token;         // [P]: each pair's token
  std::vector<int64_t> of_slot;       // [T * k]: the pair of token t's j-th choice, at t * k + j
  std::vector<int64_t> expert_begin;  // [E + 1]: expert e's pairs are [expert_begin[e], expert_begin[e + 1])
};

// Softmax over the logits of each token, its top k (descending; a tie goes to the lower expert id), the chosen
// weights renormalized if asked; then the pairs sorted by expert.
void route(const float* logits, int64_t tokens, int64_t experts, int64_t top_k, bool normalize,
           int64_t* chosen, float* weights, Pairs& pairs) {
  std::vector<float> probs(experts);
  std::vector<int64_t> order(experts);
  std::vector<int64_t> counts(experts, 0);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* row = logits + t * experts;
    const float top = *std::max_element(row, row + experts);
    float total = 0.f;
    for (int64_t e = 0; e < experts; ++e) total += probs[e] = std::exp(row[e] - top);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [&](int64_t a, int64_t b) { return probs[a] > probs[b] || (probs[a] == probs[b] && a < b); });
    float kept = 0.f;
    for (int64_t j = 0; j < top_k; ++j) kept += probs[order[j]] / total;
    for (int64_t j = 0; j < top_k; ++j) {
      chosen[t * top_k + j] = order[j];
      weights[t * top_k + j] = normalize ? (probs[order[j]] / total) / kept : probs[order[j]] / total;
      ++counts[order[j]];
    }
  }
  pairs.expert_begin.assign(experts + 1, 0);
  std::partial_sum(counts.begin(), counts.end(), pairs.expert_begin.begin() + 1);
  std::vector<int64_t> next(pairs.expert_begin.begin(), pairs.expert_begin.end() - 1);
  for (int64_t slot = 0; slot < tokens * top_k; ++slot) {
    const int64_t pair = next[chosen[slot]]++;
    pairs.token[pair] = slot / top_k;
    pairs.of_slot[slot] = pair;
  }
}

// This thread's share of every active expert's tiles of `pack`: the tiles are laid end to end, each costing
// kTileReadCost + its expert's rows, and thread i takes those starting in [i C / n, (i + 1) C / n) of the total C.
void multiply_share(const ExpertPack& pack, const int8_dot::Rows& rows, const Pairs& pairs, int thread,
                    int threads, float* out) {
  const int64_t experts = static_cast<int64_t>(pairs.expert_begin.size()) - 1;
  int64_t total = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t count = pairs.expert_begin[e + 1] - pairs.expert_begin[e];
    if (count > 0) total += pack.tiles * (kTileReadCost + count);
  }
  const int64_t low = total * thread / threads, high = total * (thread + 1) / threads;
  int64_t start = 0;  // the cost before expert e's first tile
  for (int64_t e = 0; e < experts && start < high; ++e) {
    const int64_t row_begin = pairs.expert_begin[e], row_end = pairs.expert_begin[e + 1];
    if (row_end == row_begin) continue;
    const int64_t cost = kTileReadCost + (row_end - row_begin);
    const auto first_at_or_after = [&](int64_t bound) {  // the first tile whose start cost is >= bound
      return std::clamp<int64_t>((bound - start + cost - 1) / cost, 0, pack.tiles);
    };
    const int64_t first = low <= start ? 0 : first_at_or_after(low), last = first_at_or_after(high);
    if (first < last)
      int8_dot::multiply_tiles(pack.form, rows, row_begin, row_end, pack.codes + e * pack.code_stride,
                               pack.scales + e * pack.scale_stride, pack.tiles, pack.n, first, last, out, pack.n);
    start += pack.tiles * cost;
  }
}

// exp's argument capped: under -ffast-math an infinite exp(-g) (g < -88) may turn the quotient into NaN.
inline float silu(float g) { return g / (1.f + std::exp(std::min(-g, 80.f))); }

void check_pack(const char* name, const torch::Tensor& codes, const torch::Tensor& scales, int64_t form,
                int64_t experts, int64_t k, int64_t n) {
  TORCH_CHECK(form >= int8_dot::kFormInt4Dot && form <= int8_dot::kFormQ4K,
              "moe_experts: ", name, " form ", form, " is not an int8-dot pack (3 to 7)");
  TORCH_CHECK(codes.dtype() == torch::kUInt8 && scales.dtype() == torch::kFloat16 && codes.is_contiguous() &&
                  scales.is_contiguous() && codes.dim() == 4 && codes.size(0) == experts && scales.size(0) == experts,
              "moe_experts: ", name, ": contiguous uint8 codes [E, tiles, K / 32, bytes] and float16 scales [E, ...] "
              "for ", experts, " experts expected");
  TORCH_CHECK(codes.size(2) * 32 == k, "moe_experts: ", name, " takes K = ", codes.size(2) * 32, ", not ", k);
  TORCH_CHECK(codes.size(1) * 16 >= n && (codes.size(1) - 1) * 16 < n, "moe_experts: ", name, " has ",
              codes.size(1), " tiles of 16 columns, not ", n, " columns");
}

}  // namespace

// x [T, H] float32; router [E, H] float32; the experts' gate/up (gate's 2F... rows: gate's F above up's F) and
// down packs stacked by expert, with their forms (decode_layers' numbers: 3 int4-dot, 4 Q8_0-dot, 5 Q5_K, 6
// Q6_K, 7 Q4_K); out [T, H] float32 receives the block's output; routed_experts [T, k] int64 and routed_weights [T, k]
// float32 the routing. All contiguous; H and F multiples of 32 (of 256 for the K-quants).
void moe_experts(const torch::Tensor& x, const torch::Tensor& router, int64_t top_k, bool normalize,
                 const torch::Tensor& gate_up_codes, const torch::Tensor& gate_up_scales, int64_t gate_up_form,
                 const torch::Tensor& down_codes, const torch::Tensor& down_scales, int64_t down_form,
                 torch::Tensor& out, torch::Tensor& routed_experts, torch::Tensor& routed_weights) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && router.dtype() == torch::kFloat32 && out.dtype() == torch::kFloat32 &&
                  x.is_contiguous() && router.is_contiguous() && out.is_contiguous() && x.dim() == 2 &&
                  router.dim() == 2 && router.size(1) == x.size(1) && out.sizes() == x.sizes(),
              "moe_experts: contiguous float32 x [T, H], router [E, H] and out [T, H] expected");
  const int64_t tokens = x.size(0), hidden = x.size(1), experts = router.size(0);
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "moe_experts: top_k ", top_k, " of ", experts, " experts");
  TORCH_CHECK(routed_experts.dtype() == torch::kInt64 && routed_weights.dtype() == torch::kFloat32 &&
                  routed_experts.is_contiguous() && routed_weights.is_contiguous() &&
                  routed_experts.numel() == tokens * top_k && routed_weights.numel() == tokens * top_k,
              "moe_experts: routed_experts int64 and routed_weights float32 [T, k] expected");
  const int64_t width = down_codes.dim() == 4 ? down_codes.size(2) * 32 : 0;  // F, each expert's MLP width
  check_pack("gate_up", gate_up_codes, gate_up_scales, gate_up_form, experts, hidden, 2 * width);
  check_pack("down", down_codes, down_scales, down_form, experts, width, hidden);
  if (tokens == 0) return;
  const int64_t pair_count = tokens * top_k;
  const ExpertPack gate_up(gate_up_codes, gate_up_scales, 2 * width, gate_up_form);
  const ExpertPack down(down_codes, down_scales, hidden, down_form);
  const float* input = x.data_ptr<float>();
  const float* router_rows = router.data_ptr<float>();
  int64_t* chosen = routed_experts.data_ptr<int64_t>();
  float* chosen_weights = routed_weights.data_ptr<float>();
  float* output = out.data_ptr<float>();

  std::vector<float> logits(tokens * experts), gate_up_out(pair_count * 2 * width), activated(pair_count * width);
  std::vector<float> down_out(pair_count * hidden);
  Pairs pairs{std::vector<int64_t>(pair_count), std::vector<int64_t>(pair_count), {}};
  const int8_dot::RowsPtr token_rows = int8_dot::make_rows(tokens, hidden);
  const int8_dot::RowsPtr pair_rows = int8_dot::make_rows(pair_count, hidden);
  const int8_dot::RowsPtr activated_rows = int8_dot::make_rows(pair_count, width);

#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int thread = omp_get_thread_num(), threads = omp_get_num_threads();
#pragma omp for schedule(static) nowait
    for (int64_t e = 0; e < experts; ++e) {
      const float* weights = router_rows + e * hidden;
      for (int64_t t = 0; t < tokens; ++t) {
        const float* row = input + t * hidden;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < hidden; ++i) sum += row[i] * weights[i];
        logits[t * experts + e] = sum;
      }
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) int8_dot::quantize_row(*token_rows, t, input + t * hidden);
#pragma omp single
    route(logits.data(), tokens, experts, top_k, normalize, chosen, chosen_weights, pairs);
#pragma omp for schedule(static)
    for (int64_t p = 0; p < pair_count; ++p) int8_dot::copy_row(*pair_rows, p, *token_rows, pairs.token[p]);
    multiply_share(gate_up, *pair_rows, pairs, thread, threads, gate_up_out.data());
#pragma omp barrier
#pragma omp for schedule(static)
    for (int64_t p = 0; p < pair_count; ++p) {
      const float* gate = gate_up_out.data() + p * 2 * width;
      float* row = activated.data() + p * width;
      for (int64_t i = 0; i < width; ++i) row[i] = silu(gate[i]) * gate[width + i];
      int8_dot::quantize_row(*activated_rows, p, row);
    }
    multiply_share(down, *activated_rows, pairs, thread, threads, down_out.data());
#pragma omp barrier
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      float* row = output + t * hidden;
      std::fill(row, row + hidden, 0.f);
      for (int64_t j = 0; j < top_k; ++j) {
        const float weight = chosen_weights[t * top_k + j];
        const float* expert_out = down_out.data() + pairs.of_slot[t * top_k + j] * hidden;
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) row[i] += weight * expert_out[i];
      }
    }
  }
}
