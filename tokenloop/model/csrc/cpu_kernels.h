// The kernels of this extension, declared once for the files that call each other's and the module
// definition (paged_decode_attention.cpp).
#pragma once
#include <torch/extension.h>

#include <memory>
#include <string>
#include <vector>

// The instruction sets this build targets (its -march), space-separated: which fast paths its kernels
// compiled in (the int8-dot kernels' VNNI or AVX2 blocks, the Q8_0 kernel's AVX-512 one). Python reads it
// instead of the CPU's flags, since a build for another target (TOKENLOOP_KERNEL_MARCH) differs.
inline std::string compiled_isa() {
  std::string isa;
#ifdef __AVX2__
  isa += " avx2";
#endif
#ifdef __FMA__
  isa += " fma";
#endif
#ifdef __F16C__
  isa += " f16c";
#endif
#ifdef __AVX512F__
  isa += " avx512f";
#endif
#ifdef __AVX512BW__
  isa += " avx512bw";
#endif
#ifdef __AVX512VNNI__
  isa += " avx512vnni";
#endif
#ifdef __AVX512BF16__
  isa += " avx512bf16";
#endif
  return isa.empty() ? isa : isa.substr(1);
}

// paged_decode_attention.cpp
void paged_decode_attention(const torch::Tensor& query, const torch::Tensor& key_cache,
                            const torch::Tensor& value_cache, const torch::Tensor& block_table,
                            const torch::Tensor& seq_lens, double scale, torch::Tensor& out, int64_t window = 0);
// q8_0_matmul.cpp
void q8_0_tiled_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                       torch::Tensor& out);
// int8_dot_matmul.cpp
void int4_dot_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                     torch::Tensor& out);
void q8_0_dot_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                     torch::Tensor& out);
void kquant_dot_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                       torch::Tensor& out, int64_t kind);
void int8_dot_stack(const torch::Tensor& x, const std::vector<torch::Tensor>& codes,
                    const std::vector<torch::Tensor>& scales, const std::vector<int64_t>& forms,
                    const std::vector<int64_t>& widths, torch::Tensor& out);
bool int8_dot_native();
// int8_gemm.cpp
void int8_gemm(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales, torch::Tensor& out,
               int64_t kind, int64_t passes);
bool int8_gemm_native();
// int8_dot_tiles.inc (in int8_dot_matmul.cpp): the same kernels in pieces, for a caller that multiplies one set of
// activations by many packs inside its own parallel region (moe_experts.cpp).
namespace int8_dot {
// decode_layers.cpp's Form numbers, as moe_experts.cpp names the packs' forms
constexpr int64_t kFormInt4Dot = 3, kFormQ8Dot = 4, kFormQ5K = 5, kFormQ6K = 6, kFormQ4K = 7;
struct Rows;  // quantized activation rows, with what every pack form reads of them
struct RowsDeleter {
  void operator()(Rows* rows) const;
};
using RowsPtr = std::unique_ptr<Rows, RowsDeleter>;
// `rows` rows of `k` values (a multiple of 32), to be filled by quantize_row or copy_row.
RowsPtr make_rows(int64_t rows, int64_t k);
// Quantizes `x` (k float32 values) into row `row`.
void quantize_row(Rows& rows, int64_t row, const float* x);
void copy_row(Rows& to, int64_t row, const Rows& from, int64_t source);
// out[r][c] = x row r . W column c for rows [row_begin, row_end) and W's columns in tiles [tile_begin, tile_end)
// (out's row r at out + r * ldo), in the calling thread. W: a pack of `form` (its codes and fp16 scales) with
// `tiles` tiles and `n` columns, K the rows' width.
void multiply_tiles(int64_t form, const Rows& x, int64_t row_begin, int64_t row_end, const uint8_t* codes,
                    const uint16_t* scales, int64_t tiles, int64_t n, int64_t tile_begin, int64_t tile_end,
                    float* out, int64_t ldo);
}  // namespace int8_dot
// fused_layer_ops.cpp
void add_rms_norm(torch::Tensor& residual, const torch::Tensor& delta, const torch::Tensor& delta_weight,
                  const torch::Tensor& weight, double eps, torch::Tensor& out);
void silu_mul(const torch::Tensor& gate_up, torch::Tensor& out);
void gelu_tanh_mul(const torch::Tensor& gate_up, torch::Tensor& out);
void rope_write_kv(const torch::Tensor& qkv, const torch::Tensor& positions, const torch::Tensor& cos,
                   const torch::Tensor& sin, const torch::Tensor& slots, const torch::Tensor& q_norm,
                   const torch::Tensor& k_norm, double eps, torch::Tensor& key_cache, torch::Tensor& value_cache,
                   torch::Tensor& q_out, torch::Tensor& k_out, torch::Tensor& v_out);
// weight_unpack.cpp
void q4_unpack(const torch::Tensor& nibbles, const torch::Tensor& d, const torch::Tensor& m, torch::Tensor& out);
// lora_sgmv.cpp
void lora_sgmv(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& bt,
               const torch::Tensor& scales, const torch::Tensor& token_slots, int64_t width,
               const std::vector<int64_t>& parts);
// moe_experts.cpp
void moe_experts(const torch::Tensor& x, const torch::Tensor& router, int64_t top_k, bool normalize,
                 const torch::Tensor& gate_up_codes, const torch::Tensor& gate_up_scales, int64_t gate_up_form,
                 const torch::Tensor& down_codes, const torch::Tensor& down_scales, int64_t down_form,
                 torch::Tensor& out, torch::Tensor& routed_experts, torch::Tensor& routed_weights);
// decode_layers.cpp
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
                   const std::vector<std::vector<int64_t>>& adapter_parts, torch::Tensor& layer_ticks);
