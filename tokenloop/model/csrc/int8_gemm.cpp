// x @ W.T for MANY rows (a prefill chunk, a batched LM head) over the int8-dot packs' own layouts (Q4, Q8_0,
// Q5_K, Q6_K: int8_dot_matmul.cpp and kquant_dot_blocks.inc describe them), with AVX512-VNNI `vpdpbusd`.
//
// The decode kernels are tuned for a few rows: each 16-column tile walks every row. Here the rows are cut into
// panels whose quantized activations stay in L2 while a thread's tiles pass over them, and the register block
// is wider (R rows x T tiles, R up to 6): each unpacked weight vector feeds R rows and each broadcast
// activation word T tiles, so the nibble unpacking and the per-block float work are spread over more
// `vpdpbusd`. The activations are quantized once per call, per row and block of 32, to `passes` int8 code sets:
//   1: x ~= dx q (llama.cpp's Q8 activations): half the integer work; the blocks' sums are those of the codes;
//   2: x ~= dx q + dx / 254 r, the decode kernels' two code sets (the same sums as theirs).
// The block's integer sums are exact; d (and m) are the file's fp16 values, applied per block as the decode
// kernels do. Without AVX512-VNNI this file's kernel refuses (`int8_gemm_native` is false, and the callers
// keep the decode kernels).
#include "cpu_kernels.h"
#include "int8_pack_simd.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TOKENLOOP_GEMM_VNNI 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGroup = 32;   // ggml's block, and the activations' quantization block
constexpr int64_t kLanes = 16;   // output columns per tile
constexpr int64_t kSuperGroups = 8;  // blocks of 32 per K-quant super-block of 256
constexpr float kRemainderSteps = 254.f;

// The pack formats, numbered as the Python side names them (the bit width, Q8_0 as 8).
enum class Format : int { kQ4 = 4, kQ5K = 5, kQ6K = 6, kQ4K = 7, kQ8 = 8 };

template <Format F>
struct Layout {
  static constexpr bool q8 = F == Format::kQ8;
  static constexpr bool kquant = F == Format::kQ5K || F == Format::kQ6K || F == Format::kQ4K;
  static constexpr int planes = F == Format::kQ6K ? 2 : (F == Format::kQ5K ? 1 : 0);  // bits above the nibble
  static constexpr int halves = F == Format::kQ6K ? 2 : 1;  // integer sums per block (Q6_K: a scale per 16)
  static constexpr int64_t nibble_bytes = kGroup * kLanes / 2;
  static constexpr int64_t scale_offset = nibble_bytes + planes * 64;  // K-quants' sub-block scales
  static constexpr int64_t bytes = q8 ? kGroup * kLanes : (kquant ? scale_offset + 2 * kLanes : nibble_bytes);
  static constexpr int super_scales = F == Format::kQ6K ? 1 : 2;  // d, and dmin for Q4_K / Q5_K
  static constexpr bool minimum = F == Format::kQ4 || F == Format::kQ5K || F == Format::kQ4K;  // an m term
};

// One call's activations: per row and block, `passes` code sets of 32, their scales, the block's float sum
// (Q4's m and Q5_K's dmin terms), -128 x each code set's sum (Q8_0's stored + 128) and each set's sums over
// values 0-15 and 16-31 (Q6_K's -32 per half).
struct Activations {
  int64_t rows = 0, groups = 0, passes = 1;
  std::vector<int8_t> codes;      // [rows][groups][passes][32]
  std::vector<float> scales;      // [rows][groups][passes]
  std::vector<float> sums;        // [rows][groups]
  std::vector<int32_t> offsets;   // [rows][groups][passes]
  std::vector<int32_t> halves;    // [rows][groups][passes][2]

  const int8_t* code(int64_t row, int64_t g, int p) const { return codes.data() + ((row * groups + g) * passes + p) * kGroup; }
  float scale(int64_t row, int64_t g, int p) const { return scales[(row * groups + g) * passes + p]; }
};

void quantize_block(const float* x, int64_t valid, int passes, int8_t* codes, float* scales, float& sum,
                    int32_t* offsets, int32_t* halves) {
  float values[kGroup] = {};
  std::memcpy(values, x, sizeof(float) * valid);
  float amax = 0.f, total = 0.f;
  for (int64_t i = 0; i < kGroup; ++i) {
    amax = std::max(amax, std::fabs(values[i]));
    total += values[i];
  }
  const float scale = amax / 127.f, inverse = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t i = 0; i < kGroup; ++i) {
    const float q = std::min(127.f, std::max(-127.f, std::nearbyint(values[i] * inverse)));
    codes[i] = static_cast<int8_t>(q);
    if (passes == 2) {
      const float rest = std::fma(-q, scale, values[i]);
      codes[kGroup + i] = static_cast<int8_t>(
          std::min(127.f, std::max(-127.f, std::nearbyint(rest * (inverse * kRemainderSteps)))));
    }
  }
  for (int p = 0; p < passes; ++p) {
    int32_t first = 0, second = 0;
    for (int64_t i = 0; i < kGroup / 2; ++i) {
      first += codes[p * kGroup + i];
      second += codes[p * kGroup + kGroup / 2 + i];
    }
    scales[p] = p == 0 ? scale : scale / kRemainderSteps;
    offsets[p] = -128 * (first + second);
    halves[2 * p] = first;
    halves[2 * p + 1] = second;
  }
  // One set: the m / dmin term takes the coded values' sum, as the codes' term takes the coded values. Codes are
  // 0..15 (never centred), so with the exact sum each value's rounding error e would enter as e d q, not as
  // e (d q + m) ~ e w: a bias, not noise (top-1 agreement of the default model 93.8% against 97.7%).
  sum = passes == 1 ? scale * static_cast<float>(halves[0] + halves[1]) : total;
}

Activations quantize_activations(const float* x, int64_t rows, int64_t k, int64_t groups, int passes) {
  Activations a;
  a.rows = rows;
  a.groups = groups;
  a.passes = passes;
  a.codes.resize(rows * groups * passes * kGroup);
  a.scales.resize(rows * groups * passes);
  a.sums.resize(rows * groups);
  a.offsets.resize(rows * groups * passes);
  a.halves.resize(rows * groups * passes * 2);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t at = r * groups + g, first = g * kGroup;
        quantize_block(x + r * k + first, std::max<int64_t>(0, std::min(kGroup, k - first)), passes,
                       a.codes.data() + at * passes * kGroup, a.scales.data() + at * passes, a.sums[at],
                       a.offsets.data() + at * passes, a.halves.data() + at * passes * 2);
      }
  });
  return a;
}

using int8_pack::Weights;  // [tiles][groups][Layout::bytes] codes and their fp16 scales

#ifdef TOKENLOOP_GEMM_VNNI

using int8_pack::broadcast4;
using int8_pack::half16;
using int8_pack::store_block;

// The weights' codes of chunk c of a block for one tile: Q4 / K-quants give the values 4c..4c+3 (`low`) and
// 16+4c..16+4c+3 (`high`) of each lane, their higher bits added from the planes; Q8_0 chunks 2c and 2c + 1.
template <Format F>
inline void load_chunk(const uint8_t* base, int c, __m512i& low, __m512i& high) {
  using L = Layout<F>;
  if constexpr (L::q8) {
    low = _mm512_loadu_si512(base + 2 * c * 64);
    high = _mm512_loadu_si512(base + (2 * c + 1) * 64);
  } else {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const __m512i packed = _mm512_loadu_si512(base + c * 64);
    low = _mm512_and_si512(packed, nibble);
    high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
#pragma GCC unroll 2
    for (int plane = 0; plane < L::planes; ++plane) {
      const uint8_t* bits = base + L::nibble_bytes + plane * 64 + c * 16;
      uint64_t low_bits, high_bits;
      std::memcpy(&low_bits, bits, sizeof(low_bits));
      std::memcpy(&high_bits, bits + 8, sizeof(high_bits));
      const __m512i value = _mm512_set1_epi8(static_cast<char>(16 << plane));
      low = _mm512_mask_add_epi8(low, _cvtu64_mask64(low_bits), low, value);
      high = _mm512_mask_add_epi8(high, _cvtu64_mask64(high_bits), high, value);
    }
  }
}

// out[R rows from row0][T tiles from tile0], P code sets. Per block: exact int32 sums (S per block: Q6_K's
// halves), then one float multiply-add per sum with the block's scales.
template <Format F, int P, int R, int T>
void gemm_block(const Activations& a, const Weights& w, int64_t row0, int64_t tile0, float* out, int64_t ldo) {
  using L = Layout<F>;
  constexpr int S = L::halves;
  const int64_t groups = w.groups;
  __m512 acc[R][T];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[P][R][T][S];
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
        for (int s = 0; s < S; ++s) {
          const int64_t at = ((row0 + r) * groups + g) * P + p;
          const int32_t start = L::q8 ? a.offsets[at] : (F == Format::kQ6K ? -32 * a.halves[at * 2 + s] : 0);
#pragma GCC unroll 4
          for (int t = 0; t < T; ++t) dot[p][r][t][s] = _mm512_set1_epi32(start);
        }
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      __m512i low[T], high[T];
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) load_chunk<F>(w.codes + ((tile0 + t) * groups + g) * L::bytes, c, low[t], high[t]);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
        for (int p = 0; p < P; ++p) {
          const int8_t* xq = a.code(row0 + r, g, p);
          // Q8_0: chunk 2c holds values 8c..8c+3, chunk 2c + 1 values 8c+4..8c+7
          const __m512i x_low = broadcast4(xq + (L::q8 ? 8 * c : 4 * c));
          const __m512i x_high = broadcast4(xq + (L::q8 ? 8 * c + 4 : 16 + 4 * c));
#pragma GCC unroll 4
          for (int t = 0; t < T; ++t) {
            dot[p][r][t][0] = _mm512_dpbusd_epi32(dot[p][r][t][0], low[t], x_low);
            dot[p][r][t][S - 1] = _mm512_dpbusd_epi32(dot[p][r][t][S - 1], high[t], x_high);
          }
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) {
      __m512 scale[S], minimum = _mm512_setzero_ps();
      if constexpr (L::kquant) {
        const uint8_t* sub = w.codes + ((tile0 + t) * groups + g) * L::bytes + L::scale_offset;
        const uint16_t* supers = w.scales + ((tile0 + t) * (groups / kSuperGroups) + g / kSuperGroups) *
                                                L::super_scales * kLanes;
        const __m512 d = half16(supers);
        if constexpr (F == Format::kQ6K) {
#pragma GCC unroll 2
          for (int s = 0; s < S; ++s) {
            const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sub + s * kLanes));
            scale[s] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
          }
        } else {
          const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sub));
          const __m128i mn = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sub + kLanes));
          scale[0] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)));
          // w = d sc q - dmin mn: the minimum enters negated
          minimum = _mm512_sub_ps(_mm512_setzero_ps(),
                                  _mm512_mul_ps(half16(supers + kLanes), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn))));
        }
      } else if constexpr (L::q8) {
        scale[0] = half16(w.scales + ((tile0 + t) * groups + g) * kLanes);
      } else {
        const uint16_t* s = w.scales + ((tile0 + t) * groups + g) * 2 * kLanes;
        scale[0] = half16(s);
        minimum = half16(s + kLanes);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t at = (row0 + r) * groups + g;
#pragma GCC unroll 2
        for (int p = 0; p < P; ++p) {
          const __m512 dx = _mm512_set1_ps(a.scales[at * P + p]);
#pragma GCC unroll 2
          for (int s = 0; s < S; ++s)
            acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[p][r][t][s]), _mm512_mul_ps(scale[s], dx), acc[r][t]);
        }
        if constexpr (L::minimum)
          acc[r][t] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(a.sums[at]), acc[r][t]);
      }
    }
  }
  store_block<R, T>(acc, w.n, row0, tile0, out, ldo);
}

using BlockFn = void (*)(const Activations&, const Weights&, int64_t, int64_t, float*, int64_t);

// Register blocks: R x T x P x S int32 sums, R x T float sums and 2T weight vectors within 32 zmm. Measured
// (one thread, 192 rows, one code set): Q6_K 4 x 2 ~200 GFLOP/s against 6 x 1 ~175 and 8 x 1 ~185.
template <Format F, int P>
struct Blocking {
  static constexpr int tiles = 2;
  static constexpr int rows = (Layout<F>::halves * P == 1) ? 6 : 4;
};

template <Format F, int P, int T, int... R>
constexpr std::array<BlockFn, sizeof...(R)> rows_table(std::integer_sequence<int, R...>) {
  return {&gemm_block<F, P, R + 1, T>...};
}

// [tiles - 1][rows - 1]
template <Format F, int P, int... T>
constexpr std::array<std::array<BlockFn, Blocking<F, P>::rows>, sizeof...(T)> block_table(
    std::integer_sequence<int, T...>) {
  return {rows_table<F, P, T + 1>(std::make_integer_sequence<int, Blocking<F, P>::rows>{})...};
}

constexpr int64_t kPanelRows = 48;  // a panel's codes (48 x K x passes bytes) stay in L2 across a thread's tiles

template <Format F, int P>
void gemm(const Activations& a, const Weights& w, float* out, int64_t ldo) {
  static constexpr auto table = block_table<F, P>(std::make_integer_sequence<int, Blocking<F, P>::tiles>{});
  constexpr int64_t T = Blocking<F, P>::tiles, R = Blocking<F, P>::rows;
  const int64_t blocks = (w.tiles + T - 1) / T;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = 0; panel < a.rows; panel += kPanelRows) {
      const int64_t panel_end = std::min(a.rows, panel + kPanelRows);
      for (int64_t b = begin; b < end; ++b) {
        const int64_t tile0 = b * T, tiles = std::min(T, w.tiles - tile0);
        for (int64_t row0 = panel; row0 < panel_end; row0 += R)
          table[tiles - 1][std::min(R, panel_end - row0) - 1](a, w, row0, tile0, out, ldo);
      }
    }
  });
}

template <Format F>
void gemm_passes(const Activations& a, const Weights& w, float* out, int64_t ldo) {
  if (a.passes == 2) gemm<F, 2>(a, w, out, ldo);
  else gemm<F, 1>(a, w, out, ldo);
}

#endif  // TOKENLOOP_GEMM_VNNI

int64_t block_bytes(Format f) {
  switch (f) {
    case Format::kQ4: return Layout<Format::kQ4>::bytes;
    case Format::kQ5K: return Layout<Format::kQ5K>::bytes;
    case Format::kQ4K: return Layout<Format::kQ4K>::bytes;
    case Format::kQ6K: return Layout<Format::kQ6K>::bytes;
    default: return Layout<Format::kQ8>::bytes;
  }
}

}  // namespace

// x [M, K] float32; codes [ceil(N/16), ceil(K/32), bytes] uint8 and scales float16 in the layout of `kind`
// (4: Q4, 8: Q8_0 (code + 128), 5: Q5_K, 6: Q6_K, 7: Q4_K; the K-quants need K a multiple of 256); out [M, N] float32;
// `passes` 1 or 2 activation code sets. All contiguous.
void int8_gemm(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales, torch::Tensor& out,
               int64_t kind, int64_t passes) {
  TORCH_CHECK(kind >= 4 && kind <= 8, "int8_gemm: kind 4, 5, 6, 7 or 8 expected, got ", kind);
  TORCH_CHECK(passes == 1 || passes == 2, "int8_gemm: passes 1 or 2 expected, got ", passes);
  TORCH_CHECK(x.dtype() == torch::kFloat32 && codes.dtype() == torch::kUInt8 && scales.dtype() == torch::kFloat16 &&
                  out.dtype() == torch::kFloat32,
              "int8_gemm: float32 x, uint8 codes, float16 scales and float32 out expected");
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 3 && out.dim() == 2, "int8_gemm: x [M, K], codes [N/16, K/32, bytes] "
              "and out [M, N] expected");
  TORCH_CHECK(x.is_contiguous() && codes.is_contiguous() && scales.is_contiguous() && out.is_contiguous(),
              "int8_gemm: contiguous tensors expected");
  const Format format = static_cast<Format>(kind);
  const bool kquant = format == Format::kQ5K || format == Format::kQ6K || format == Format::kQ4K;
  const int64_t tiles = codes.size(0), groups = codes.size(1), k = x.size(1), n = out.size(1);
  TORCH_CHECK(codes.size(2) == block_bytes(format), "int8_gemm: codes ", codes.sizes(), " are not in tiles of ",
              block_bytes(format), " bytes a block");
  TORCH_CHECK(k > (groups - 1) * kGroup && k <= groups * kGroup && (!kquant || (k == groups * kGroup &&
              groups % kSuperGroups == 0)), "int8_gemm: x has K = ", k, ", the codes ", groups, " blocks of 32");
  const int64_t scale_blocks = kquant ? groups / kSuperGroups : groups;
  const int64_t per_block = format == Format::kQ4 || format == Format::kQ5K || format == Format::kQ4K ? 2 : 1;
  TORCH_CHECK(scales.numel() == tiles * scale_blocks * per_block * kLanes && scales.size(0) == tiles,
              "int8_gemm: scales ", scales.sizes(), " do not match codes ", codes.sizes());
  TORCH_CHECK(out.size(0) == x.size(0) && n > (tiles - 1) * kLanes && n <= tiles * kLanes, "int8_gemm: out ",
              out.sizes(), " does not match ", x.size(0), " rows and ", tiles, " tiles");
  if (x.size(0) == 0) return;
#ifdef TOKENLOOP_GEMM_VNNI
  const Activations a = quantize_activations(x.data_ptr<float>(), x.size(0), k, groups, static_cast<int>(passes));
  const Weights w{codes.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()), tiles,
                  groups, n};
  float* o = out.data_ptr<float>();
  switch (format) {
    case Format::kQ4: gemm_passes<Format::kQ4>(a, w, o, n); break;
    case Format::kQ5K: gemm_passes<Format::kQ5K>(a, w, o, n); break;
    case Format::kQ4K: gemm_passes<Format::kQ4K>(a, w, o, n); break;
    case Format::kQ6K: gemm_passes<Format::kQ6K>(a, w, o, n); break;
    default: gemm_passes<Format::kQ8>(a, w, o, n); break;
  }
#else
  TORCH_CHECK(false, "int8_gemm: this build has no AVX512-VNNI (int8_gemm_native() is false)");
#endif
}

bool int8_gemm_native() {
#ifdef TOKENLOOP_GEMM_VNNI
  return true;
#else
  return false;
#endif
}

#ifdef TOKENLOOP_GEMM_STANDALONE  // a build of this file alone, for iterating on it
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_gemm", &int8_gemm);
  m.def("int8_gemm_native", &int8_gemm_native);
}
#endif
