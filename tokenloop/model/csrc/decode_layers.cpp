// Every decoder layer of a pure decode step in one call, for the CPU.
//
// At one decode token a layer is four GEMMs of ~30-130 us and seven small kernels, and the Python between
// them (the layer loop, dtype choices, allocations, ~40 dispatches a layer) cost as much as the kernels
// themselves. This runs the same sequence as `fused_cpu.forward_fused`'s layer loop (the same kernels, in the
// same order, so the results are bit for bit the same) without returning to Python between layers.
// Only pure decode steps come here: one query token per sequence, attended by `paged_decode_attention`.
// The layer shape is data: which norms a layer has (Llama's two, Qwen3's QK-norm, Gemma 3's four and QK-norm),
// the MLP's gate activation, per layer its KV group (Gemma's sliding layers: their own rotary table, block
// table and window), and whether routed experts replace its MLP (OLMoE, Qwen3-MoE: csrc/moe_experts.cpp).
#include "cpu_kernels.h"

#include <torch/extension.h>

#include <vector>

namespace {

constexpr int64_t kProjectionsPerLayer = 4;  // qkv, o_proj, gate_up, down
constexpr int64_t kNormsPerLayer = 6;  // input, attention output, MLP input, MLP output, Q heads, K heads
constexpr int64_t kInt4GroupSize = 32;

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

// How one part of a projection is held (fused_cpu.ProjectionForm: the same numbers). A part's output width may
// be below its pack's padded rows (tiles of 16, torch's int4 N multiple); its K is the layer's width, except
// torch's int4 pack, whose padded K the activations are zero-padded to, as `Int4Weight.matmul` does.
enum class Form : int64_t {
  kDense = 0, kTorchInt4 = 1, kQ8Float = 2, kInt4Dot = 3, kQ8Dot = 4, kQ5K = 5, kQ6K = 6, kQ4K = 7
};

struct Part {
  const torch::Tensor& matrix;  // a pack's codes, or a dense matrix (bf16 or float32; plain or oneDNN-prepacked)
  const torch::Tensor& scales;  // the pack's scales; empty for a dense matrix
  Form form;
  int64_t width;  // output columns

  c10::ScalarType input_dtype() const {
    if (form == Form::kDense) return matrix.scalar_type();
    return form == Form::kTorchInt4 ? torch::kBFloat16 : torch::kFloat32;
  }
  // x @ W.T [T, width], in the form's own output dtype (bf16 for torch's int4 and bf16 matrices).
  torch::Tensor operator()(const torch::Tensor& x) const {
    switch (form) {
      case Form::kDense: return matrix.is_mkldnn() ? prepacked_linear(x, matrix) : at::linear(x, matrix);
      case Form::kTorchInt4: {
        const int64_t padded_k = matrix.size(1) * 2;
        const torch::Tensor input = x.size(1) == padded_k ? x : at::constant_pad_nd(x, {0, padded_k - x.size(1)});
        torch::Tensor out = at::_weight_int4pack_mm_for_cpu(input, matrix, kInt4GroupSize, scales);
        return out.size(1) == width ? out : out.narrow(1, 0, width);
      }
      default: break;
    }
    torch::Tensor out = torch::empty({x.size(0), width}, x.options().dtype(torch::kFloat32));
    switch (form) {
      case Form::kQ8Float: q8_0_tiled_matmul(x, matrix, scales, out); break;
      case Form::kInt4Dot: int4_dot_matmul(x, matrix, scales, out); break;
      case Form::kQ8Dot: q8_0_dot_matmul(x, matrix, scales, out); break;
      default: kquant_dot_matmul(x, matrix, scales, out, static_cast<int64_t>(form)); break;  // Q5_K, Q6_K, Q4_K
    }
    return out;
  }
};

// One projection as the caller chose it for this step's row count: one part, or a row stack of int8-dot packs
// (`RowStack`: a Q4_K_M file's Q4_K Q and K beside a Q6_K V), run as one kernel call that quantizes x once and
// writes every part's columns side by side.
struct Projection {
  std::vector<Part> parts;
  std::vector<torch::Tensor> codes, scales;  // a row stack's packs, as int8_dot_stack takes them
  std::vector<int64_t> forms, widths;
  int64_t width = 0;

  void add(const Part& part) {
    parts.push_back(part);
    codes.push_back(part.matrix);
    scales.push_back(part.scales);
    forms.push_back(static_cast<int64_t>(part.form));
    widths.push_back(part.width);
    width += part.width;
  }
  // An MoE layer's MLP has no parts: its experts read float32 (moe_experts).
  c10::ScalarType input_dtype() const { return parts.empty() ? torch::kFloat32 : parts.front().input_dtype(); }
  torch::Tensor operator()(const torch::Tensor& x) const {
    if (parts.size() == 1) return parts.front()(x);
    torch::Tensor out = torch::empty({x.size(0), width}, x.options().dtype(torch::kFloat32));
    int8_dot_stack(x, codes, scales, forms, widths, out);
    return out;
  }
};

// The projections `layout` describes over the flat `matrices` / `scales`: per projection its part count, then
// each part's form and output width.
std::vector<Projection> read_projections(const std::vector<torch::Tensor>& matrices,
                                         const std::vector<torch::Tensor>& scales,
                                         const std::vector<int64_t>& layout, int64_t count) {
  TORCH_CHECK(scales.size() == matrices.size(), "decode_layers: one scales tensor per matrix expected");
  std::vector<Projection> projections(count);
  size_t at = 0, part = 0;
  for (Projection& projection : projections) {
    TORCH_CHECK(at < layout.size() && layout[at] >= 0, "decode_layers: layout ends before projection ",
                &projection - projections.data());
    const int64_t parts = layout[at++];
    TORCH_CHECK(at + 2 * parts <= layout.size() && part + parts <= matrices.size(),
                "decode_layers: layout names more parts than it or the matrices hold");
    for (int64_t i = 0; i < parts; ++i, ++part, at += 2) {
      const int64_t form = layout[at];
      TORCH_CHECK(form >= 0 && form <= static_cast<int64_t>(Form::kQ4K), "decode_layers: unknown form ", form);
      projection.add(Part{matrices[part], scales[part], static_cast<Form>(form), layout[at + 1]});
    }
    for (const Part& p : projection.parts)
      TORCH_CHECK(parts == 1 || p.form >= Form::kInt4Dot,
                  "decode_layers: a row stack's parts must all be int8-dot packs");
  }
  TORCH_CHECK(at == layout.size() && part == matrices.size(), "decode_layers: layout and matrices do not match");
  return projections;
}

// ---- the step's LoRA products (model/lora_slots.py), added right after each projection ----
// Per projection (as `matrices`' 4L projections) every slot's stacked A [S*width, in] and folded B^T [S*rank, out]
// (int8 ones with their row scales [S*width], else no scales); per kind (qkv, o_proj, gate_up, down) its width and
// its parts' column bounds. Empty: no adapter row.
struct StepAdapters {
  const std::vector<torch::Tensor>& a;
  const std::vector<torch::Tensor>& bt;
  const std::vector<torch::Tensor>& scales;
  const torch::Tensor& no_scales;  // what lora_sgmv takes for float A and B^T: an empty tensor
  const torch::Tensor& token_slots;  // [T] int64, each row's slot or -1
  const std::vector<int64_t>& widths;
  const std::vector<std::vector<int64_t>>& parts;

  void check(int64_t layers) const {
    if (a.empty()) return;
    TORCH_CHECK(static_cast<int64_t>(a.size()) == kProjectionsPerLayer * layers && bt.size() == a.size() &&
                    static_cast<int64_t>(widths.size()) == kProjectionsPerLayer &&
                    static_cast<int64_t>(parts.size()) == kProjectionsPerLayer &&
                    (scales.empty() || scales.size() == a.size()),
                "decode_layers: expected an adapter A and B^T (and int8 scales) per projection, a width and parts "
                "per kind");
  }
  // out += each adapted row's (x A^T) B^T for projection `projection` (csrc/lora_sgmv.cpp).
  void add(torch::Tensor& out, const torch::Tensor& x, int64_t projection) const {
    if (a.empty()) return;
    const int64_t kind = projection % kProjectionsPerLayer;
    lora_sgmv(out, x, a[projection], bt[projection], scales.empty() ? no_scales : scales[projection], token_slots,
              widths[kind], parts[kind]);
  }
};

// ---- routed experts in place of a layer's MLP (layers/moe.py), one moe_experts call (csrc/moe_experts.cpp) ----
constexpr int64_t kExpertTensors = 5;  // router [E, H] float32; gate/up codes, scales; down codes, scales
constexpr int64_t kExpertInts = 4;  // top k (0: the layer has its gated MLP), renormalize, gate/up form, down form

struct LayerExperts {
  const torch::Tensor* tensors = nullptr;  // kExpertTensors of them; null: a gated MLP
  const int64_t* layout = nullptr;

  bool present() const { return tensors != nullptr; }
  // The routed experts' weighted sum [T, H] float32 of normed [T, H] float32.
  torch::Tensor operator()(const torch::Tensor& normed) const {
    const int64_t top_k = layout[0];
    torch::Tensor out = torch::empty_like(normed);
    torch::Tensor chosen = torch::empty({normed.size(0), top_k}, normed.options().dtype(torch::kInt64));
    torch::Tensor weights = torch::empty({normed.size(0), top_k}, normed.options());
    moe_experts(normed, tensors[0], top_k, layout[1] != 0, tensors[1], tensors[2], layout[2], tensors[3], tensors[4],
                layout[3], out, chosen, weights);
    return out;
  }
};

// Each layer's experts from `experts` (kExpertTensors a layer) and `layout` (kExpertInts a layer); both empty
// where no layer has any. A layer with experts runs no MLP projection (its gate_up and down have no parts), and
// a layer without them runs both.
std::vector<LayerExperts> read_experts(const std::vector<torch::Tensor>& experts, const std::vector<int64_t>& layout,
                                       const std::vector<Projection>& projections, int64_t layers) {
  std::vector<LayerExperts> found(layers);
  const bool none = experts.empty() && layout.empty();
  TORCH_CHECK(none || (static_cast<int64_t>(experts.size()) == kExpertTensors * layers &&
                       static_cast<int64_t>(layout.size()) == kExpertInts * layers),
              "decode_layers: expected ", kExpertTensors, " expert tensors and ", kExpertInts, " numbers a layer");
  for (int64_t layer = 0; layer < layers; ++layer) {
    if (!layout.empty() && layout[kExpertInts * layer] > 0)
      found[layer] = {&experts[kExpertTensors * layer], &layout[kExpertInts * layer]};
    const Projection* own = &projections[kProjectionsPerLayer * layer];  // qkv, o_proj, gate_up, down
    TORCH_CHECK(!own[0].parts.empty() && !own[1].parts.empty() &&
                    own[2].parts.empty() == found[layer].present() && own[3].parts.empty() == found[layer].present(),
                "decode_layers: layer ", layer, " needs its attention's projections, and its MLP's or experts");
  }
  return found;
}

}  // namespace

// hidden [T, H] float32: the residual stream after the embedding, updated in place; final_out [T, H] float32
// receives RMSNorm(hidden + last MLP output) * final_norm. norms: per layer (6L, float32) the input norm, the
// attention output's norm, the MLP input norm, the MLP output's norm, and Q's and K's per-head norms; an empty
// tensor where the layer has none (a Llama layer has only the input and MLP input norms; Gemma's has all six).
// matrices / scales: the parts of per layer qkv, o_proj, gate_up, down (4L projections, one part each or a row
// stack's several): a pack's codes and scales (torch's int4: bf16 scales and zeros; the float32 Q8_0 kernel's:
// float32; int8-dot and K-quant: fp16), or a dense matrix and an empty tensor. layout: per projection its part
// count, then each part's form (`Form`) and output width. experts / expert_layout: per layer (`read_experts`) the
// routed experts that replace its MLP (its gate_up and down then have 0 parts), or empty lists for a model
// without them. kv_caches: per layer K then V (2L).
// layer_groups [L]: each layer's KV group, which picks from the per-group lists: cos, sin [P, D/2] (the group's
// rotary table), slots [T] and block_tables [T, max_blocks] int64, windows (0: full attention). positions,
// seq_lens [T] int64. gelu: the MLP gate is tanh-GELU (GeGLU), else SiLU. adapter_*: the step's LoRA products
// (`StepAdapters`; empty lists for a step without adapter rows; no scales for float adapters). layer_ticks: one
// int64, advanced after each layer: the engine core's heartbeat reads it while this call (which releases the
// GIL) runs (core/heartbeat.py).
void decode_layers(torch::Tensor& hidden, const std::vector<torch::Tensor>& norms,
                   const std::vector<torch::Tensor>& matrices, const std::vector<torch::Tensor>& scales,
                   const std::vector<int64_t>& layout, const std::vector<torch::Tensor>& experts,
                   const std::vector<int64_t>& expert_layout,
                   std::vector<torch::Tensor>& kv_caches, const std::vector<int64_t>& layer_groups,
                   const torch::Tensor& positions, const std::vector<torch::Tensor>& cos,
                   const std::vector<torch::Tensor>& sin, const std::vector<torch::Tensor>& slots,
                   const std::vector<torch::Tensor>& block_tables, const std::vector<int64_t>& windows,
                   const torch::Tensor& seq_lens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   double scale, double eps, bool gelu, const torch::Tensor& final_norm, torch::Tensor& final_out,
                   const std::vector<torch::Tensor>& adapter_a, const std::vector<torch::Tensor>& adapter_bt,
                   const std::vector<torch::Tensor>& adapter_scales, const torch::Tensor& adapter_slots,
                   const std::vector<int64_t>& adapter_widths,
                   const std::vector<std::vector<int64_t>>& adapter_parts, torch::Tensor& layer_ticks) {
  const int64_t layers = static_cast<int64_t>(layer_groups.size());
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == kNormsPerLayer * layers &&
                  static_cast<int64_t>(kv_caches.size()) == 2 * layers,
              "decode_layers: expected 6 norms and a K/V pair per layer");
  TORCH_CHECK(layer_ticks.scalar_type() == torch::kInt64 && layer_ticks.numel() == 1,
              "decode_layers: layer_ticks must be one int64");
  int64_t* ticks = layer_ticks.data_ptr<int64_t>();
  const std::vector<Projection> projections = read_projections(matrices, scales, layout, kProjectionsPerLayer * layers);
  const std::vector<LayerExperts> layer_experts = read_experts(experts, expert_layout, projections, layers);
  const torch::Tensor no_scales = torch::empty({0});
  const StepAdapters adapters{adapter_a,     adapter_bt,     adapter_scales, no_scales,
                              adapter_slots, adapter_widths, adapter_parts};
  adapters.check(layers);
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
    const Projection &qkv = projections[w], &o_proj = projections[w + 1];
    const Projection &gate_up = projections[w + 2], &down = projections[w + 3];
    const torch::Tensor* norm = &norms[kNormsPerLayer * layer];  // input, attn out, mlp in, mlp out, q, k
    const int64_t g = layer_groups[layer];
    torch::Tensor& key_cache = kv_caches[2 * layer];
    torch::Tensor& value_cache = kv_caches[2 * layer + 1];

    torch::Tensor normed = torch::empty({tokens, hidden_size}, f32.dtype(qkv.input_dtype()));
    add_rms_norm(hidden, delta, *delta_norm, norm[0], eps, normed);
    torch::Tensor qkv_out = qkv(normed).contiguous();
    adapters.add(qkv_out, normed, w);
    rope_write_kv(qkv_out, positions, cos[g], sin[g], slots[g], norm[4], norm[5], eps, key_cache, value_cache, q, k,
                  v);
    paged_decode_attention(q, key_cache, value_cache, block_tables[g], seq_lens, scale, attended, windows[g]);
    const torch::Tensor attended_rows = attended.view({tokens, num_heads * head_dim});
    torch::Tensor o_out = o_proj(attended_rows.to(o_proj.input_dtype())).contiguous();
    adapters.add(o_out, attended_rows, w + 1);  // float32 rows, as the per-layer path gives its adapter
    normed = torch::empty({tokens, hidden_size}, f32.dtype(gate_up.input_dtype()));
    add_rms_norm(hidden, o_out, norm[1], norm[2], eps, normed);
    if (layer_experts[layer].present()) {  // routed experts in place of the MLP (no adapters on experts)
      delta = layer_experts[layer](normed);
      delta_norm = &norm[3];
      __atomic_fetch_add(ticks, 1, __ATOMIC_RELAXED);
      continue;
    }
    torch::Tensor gate_up_out = gate_up(normed).contiguous();
    adapters.add(gate_up_out, normed, w + 2);
    torch::Tensor activated = torch::empty({tokens, gate_up_out.size(1) / 2}, f32.dtype(down.input_dtype()));
    if (gelu) gelu_tanh_mul(gate_up_out, activated);
    else silu_mul(gate_up_out, activated);
    delta = down(activated).contiguous();
    adapters.add(delta, activated, w + 3);
    delta_norm = &norm[3];
    __atomic_fetch_add(ticks, 1, __ATOMIC_RELAXED);  // read by the heartbeat thread
  }
  add_rms_norm(hidden, delta, *delta_norm, final_norm, eps, final_out);
}
