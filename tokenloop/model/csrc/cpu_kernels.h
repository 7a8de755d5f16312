// The kernels of this extension, declared once for the files that call each other's and the module
// definition (paged_decode_attention.cpp).
#pragma once
#include <torch/extension.h>

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
               const torch::Tensor& token_slots, int64_t width, const std::vector<int64_t>& parts);
// decode_layers.cpp
void decode_layers(torch::Tensor& hidden, const std::vector<torch::Tensor>& norms,
                   const std::vector<torch::Tensor>& matrices, const std::vector<torch::Tensor>& scales,
                   const std::vector<int64_t>& layout,
                   std::vector<torch::Tensor>& kv_caches, const std::vector<int64_t>& layer_groups,
                   const torch::Tensor& positions, const std::vector<torch::Tensor>& cos,
                   const std::vector<torch::Tensor>& sin, const std::vector<torch::Tensor>& slots,
                   const std::vector<torch::Tensor>& block_tables, const std::vector<int64_t>& windows,
                   const torch::Tensor& seq_lens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   double scale, double eps, bool gelu, const torch::Tensor& final_norm, torch::Tensor& final_out,
                   const std::vector<torch::Tensor>& adapter_a, const std::vector<torch::Tensor>& adapter_bt,
                   const torch::Tensor& adapter_slots, const std::vector<int64_t>& adapter_widths,
                   const std::vector<std::vector<int64_t>>& adapter_parts, torch::Tensor& layer_ticks);
