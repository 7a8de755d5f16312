// Every decoder layer of a pure decode step in one call, for the CPU.
//
// At one decode token a layer is four GEMMs of ~30-130 us and seven small kernels, and the Python between
// them (the layer loop, dtype choices, allocations, ~40 dispatches a layer) cost as much as the kernels
// themselves. This runs the same sequence as `fused_cpu.forward_fused`'s layer loop (the same kernels, in the
// same order, so the results are bit for bit the same) without returning to Python between layers.
// Only pure decode steps come here: one query token per sequence, attended by `paged_decode_attention`.
// The layer shape is data: which norms a layer has (Llama's two, Qwen3's QK-norm, Gemma 3's four and QK-norm),
// the MLP's gate activation, and per layer its KV group (Gemma's sliding layers: their own rotary table, block
// table and window).
#include "cpu_kernels.h"

#include <torch/extension.h>

#include <vector>

namespace {

constexpr int64_t kProjectionsPerLayer = 4;  // qkv, o_proj, gate_up, down
constexpr int64_t kNormsPerLayer = 6;  // input, attention output, MLP input, MLP output, Q heads, K heads
constexpr int64_t kInt4GroupSize = 32;
constexpr int64_t kTileColumns = 16;  // the int8-dot packs' output columns per tile

// x @ W.T for W prepacked in oneDNN's blocked layout (quantized.prepack_dense): the registered op
// `mkldnn::_linear_pointwise`, called boxed so that no C++ signature of it is compiled in here.
torch::Tensor prepacked_linear(const torch::Tensor& x, const torch::Tensor& weight) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, weight, c10::IValue(), c10::IValue("none"),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// One projection as the caller chose it for this step's row count: torch's int4 pack with its bf16 scales and
// zeros, our int8-dot packs (4-bit or Q8_0 codes with fp16 scales, float32 in and out), or a dense matrix
// (bf16 or float32; plain or oneDNN-prepacked).
struct Projection {
  enum class Kind { kDense, kTorchInt4, kInt4Dot, kQ8Dot };
  const torch::Tensor& matrix;
  const torch::Tensor& scales;  // empty for a dense matrix
  Kind kind() const {
    if (scales.numel() == 0) return Kind::kDense;
    if (scales.scalar_type() == torch::kBFloat16) return Kind::kTorchInt4;
    return scales.dim() == 4 ? Kind::kInt4Dot : Kind::kQ8Dot;
  }
  c10::ScalarType input_dtype() const {
    switch (kind()) {
      case Kind::kDense: return matrix.scalar_type();
      case Kind::kTorchInt4: return torch::kBFloat16;
      default: return torch::kFloat32;
    }
  }
  torch::Tensor operator()(const torch::Tensor& x) const {
    switch (kind()) {
      case Kind::kTorchInt4: return at::_weight_int4pack_mm_for_cpu(x, matrix, kInt4GroupSize, scales);
      case Kind::kInt4Dot:
      case Kind::kQ8Dot: {  // unpadded packs only (llama.decode_projection): N is the tiles' 16 columns each
        torch::Tensor out = torch::empty({x.size(0), matrix.size(0) * kTileColumns}, x.options());
        if (kind() == Kind::kInt4Dot) int4_dot_matmul(x, matrix, scales, out);
        else q8_0_dot_matmul(x, matrix, scales, out);
        return out;
      }
      default: return matrix.is_mkldnn() ? prepacked_linear(x, matrix) : at::linear(x, matrix);
    }
  }
};

}  // namespace

// hidden [T, H] float32: the residual stream after the embedding, updated in place; final_out [T, H] float32
// receives RMSNorm(hidden + last MLP output) * final_norm. norms: per layer (6L, float32) the input norm, the
// attention output's norm, the MLP input norm, the MLP output's norm, and Q's and K's per-head norms; an empty
// tensor where the layer has none (a Llama layer has only the input and MLP input norms; Gemma's has all six).
// matrices / scales: per layer qkv, o_proj, gate_up, down (4L): a pack's codes and scales (torch's int4: bf16
// scales and zeros; int8-dot: fp16), or a dense matrix and an empty tensor. kv_caches: per layer K then V (2L).
// layer_groups [L]: each layer's KV group, which picks from the per-group lists: cos, sin [P, D/2] (the group's
// rotary table), slots [T] and block_tables [T, max_blocks] int64, windows (0: full attention). positions,
// seq_lens [T] int64. gelu: the MLP gate is tanh-GELU (GeGLU), else SiLU.
void decode_layers(torch::Tensor& hidden, const std::vector<torch::Tensor>& norms,
                   const std::vector<torch::Tensor>& matrices, const std::vector<torch::Tensor>& scales,
                   std::vector<torch::Tensor>& kv_caches, const std::vector<int64_t>& layer_groups,
                   const torch::Tensor& positions, const std::vector<torch::Tensor>& cos,
                   const std::vector<torch::Tensor>& sin, const std::vector<torch::Tensor>& slots,
                   const std::vector<torch::Tensor>& block_tables, const std::vector<int64_t>& windows,
                   const torch::Tensor& seq_lens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   double scale, double eps, bool gelu, const torch::Tensor& final_norm, torch::Tensor& final_out) {
  const int64_t layers = static_cast<int64_t>(layer_groups.size());
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == kNormsPerLayer * layers &&
                  static_cast<int64_t>(matrices.size()) == kProjectionsPerLayer * layers &&
                  scales.size() == matrices.size() && static_cast<int64_t>(kv_caches.size()) == 2 * layers,
              "decode_layers: expected 6 norms, 4 projections and a K/V pair per layer");
  const size_t groups = windows.size();
  TORCH_CHECK(cos.size() == groups && sin.size() == groups && slots.size() == groups &&
                  block_tables.size() == groups,
              "decode_layers: expected a rotary table, slots, a block table and a window per KV group");
  for (int64_t group : layer_groups) {
    TORCH_CHECK(group >= 0 && group < static_cast<int64_t>(groups), "decode_layers: a layer's KV group is out of range");
  }
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == torch::kFloat32,
              "decode_layers: hidden must be float32 [T, H]");
  const int64_t tokens = hidden.size(0), hidden_size = hidden.size(1);
  for (const torch::Tensor& table : block_tables) {
    TORCH_CHECK(table.size(0) == tokens && seq_lens.numel() == tokens,
                "decode_layers: one sequence per token expected (a pure decode step)");
  }
  const auto f32 = hidden.options();
  torch::Tensor q = torch::empty({tokens, num_heads, head_dim}, f32);
  torch::Tensor k = torch::empty({tokens, num_kv_heads, head_dim}, f32);
  torch::Tensor v = torch::empty_like(k);
  torch::Tensor attended = torch::empty({tokens, num_heads, head_dim}, f32);
  const torch::Tensor no_norm = torch::empty({0}, f32);
  torch::Tensor delta = torch::empty({0}, f32);  // the previous layer's MLP output, added inside the next norm
  const torch::Tensor* delta_norm = &no_norm;  // and the norm it gets first (Gemma's post-feedforward norm)
  for (int64_t layer = 0; layer < layers; ++layer) {
    const int64_t w = layer * kProjectionsPerLayer;
    const Projection qkv{matrices[w], scales[w]}, o_proj{matrices[w + 1], scales[w + 1]};
    const Projection gate_up{matrices[w + 2], scales[w + 2]}, down{matrices[w + 3], scales[w + 3]};
    const torch::Tensor* norm = &norms[kNormsPerLayer * layer];  // input, attn out, mlp in, mlp out, q, k
    const int64_t g = layer_groups[layer];
    torch::Tensor& key_cache = kv_caches[2 * layer];
    torch::Tensor& value_cache = kv_caches[2 * layer + 1];

    torch::Tensor normed = torch::empty({tokens, hidden_size}, f32.dtype(qkv.input_dtype()));
    add_rms_norm(hidden, delta, *delta_norm, norm[0], eps, normed);
    torch::Tensor qkv_out = qkv(normed).contiguous();
    rope_write_kv(qkv_out, positions, cos[g], sin[g], slots[g], norm[4], norm[5], eps, key_cache, value_cache, q, k,
                  v);
    paged_decode_attention(q, key_cache, value_cache, block_tables[g], seq_lens, scale, attended, windows[g]);
    torch::Tensor o_out = o_proj(attended.view({tokens, num_heads * head_dim}).to(o_proj.input_dtype())).contiguous();
    normed = torch::empty({tokens, hidden_size}, f32.dtype(gate_up.input_dtype()));
    add_rms_norm(hidden, o_out, norm[1], norm[2], eps, normed);
    torch::Tensor gate_up_out = gate_up(normed).contiguous();
    torch::Tensor activated = torch::empty({tokens, gate_up_out.size(1) / 2}, f32.dtype(down.input_dtype()));
    if (gelu) gelu_tanh_mul(gate_up_out, activated);
    else silu_mul(gate_up_out, activated);
    delta = down(activated).contiguous();
    delta_norm = &norm[3];
  }
  add_rms_norm(hidden, delta, *delta_norm, final_norm, eps, final_out);
}
