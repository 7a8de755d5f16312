// x @ W.T for a ggml Q8_0 weight (int8 codes, one scale per 32 values), float32 in and out, any row count.
//
// torch's int8 weight-only kernel takes one scale per row and returns bf16; the vocabulary projection
// needs neither: per-row requantization and bf16 logits (steps of 1/8 at |logit| ~ 20) each flip greedy
// choices measurably. Every weight is the file's value, an int8 code times its block's scale (exact in
// float32: 8 bits times an fp16's 11), multiplied with float32 activations and summed in float32.
//
// Layout (packed once at load, `Q8Weight.from_q8`): the N output columns in tiles of 16, codes
// [N/16][K][16] int8 and scales [N/16][K/32][16] float32, so one zmm holds the 16 columns of a tile at one
// k. A register block is 2 tiles x up to 12 activation rows (24 accumulators; 4 tiles x up to 4 rows for
// small batches); each x value is broadcast from memory. Up to 12 rows, codes are converted in registers as they stream in (the weights are read
// once, from DRAM: bandwidth-bound); above, each tile pair is dequantized once into a small float buffer
// that every row block then reads (compute-bound: the conversion is paid once per weight, not per block).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <array>
#include <utility>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGroup = 32;  // ggml's Q8_0 block
constexpr int64_t kLanes = 16;  // output columns per tile: one zmm of float32
constexpr int kRowBlock = 12;   // activation rows per register block (at most)

struct Operands {
  const float* x;       // [rows, k]
  const int8_t* codes;  // [tiles, k, 16]
  const float* scales;  // [tiles, k / 32, 16]
  float* out;           // [rows, n]
  int64_t rows, k, n, tiles;
};

#ifdef __AVX512F__

inline __m512 dequantize16(const int8_t* q, __m512 scale) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), scale);
}

inline __mmask16 lane_mask(int64_t valid) {
  return valid >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1u);
}

// out[R rows][T tiles] = x[R rows] @ W[T tiles].T. Weights come from `buffer` ([k][T * 16] float32, already
// dequantized) when given, else straight from the codes. `valid` is the last tile's count of real columns.
template <int R, int T>
void register_block(const float* x, int64_t ldx, const int8_t* codes, const float* scales, const float* buffer,
                    int64_t k, float* out, int64_t ldo, int64_t valid) {
  __m512 acc[R][T];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  }
  const int64_t tile_codes = k * kLanes, tile_scales = k / kGroup * kLanes;
  for (int64_t g = 0; g < k / kGroup; ++g) {
    __m512 scale[T];
    if (buffer == nullptr) {
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) scale[t] = _mm512_loadu_ps(scales + t * tile_scales + g * kLanes);
    }
    for (int64_t i = g * kGroup; i < (g + 1) * kGroup; ++i) {
      __m512 w[T];
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) {
        w[t] = buffer != nullptr ? _mm512_loadu_ps(buffer + (i * T + t) * kLanes)
                                 : dequantize16(codes + t * tile_codes + i * kLanes, scale[t]);
      }
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r * ldx + i]);
#pragma GCC unroll 4
        for (int t = 0; t < T; ++t) acc[r][t] = _mm512_fmadd_ps(xv, w[t], acc[r][t]);
      }
    }
  }
  const __mmask16 last = lane_mask(valid);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) {
      _mm512_mask_storeu_ps(out + r * ldo + t * kLanes, t == T - 1 ? last : static_cast<__mmask16>(0xFFFF),
                            acc[r][t]);
    }
  }
}

using BlockFn = void (*)(const float*, int64_t, const int8_t*, const float*, const float*, int64_t, float*,
                         int64_t, int64_t);

// One instantiation per row count 1..kRowBlock and tile count 1..kMaxTiles, so a ragged block keeps its
// accumulators in registers.
template <int T, int... R>
constexpr std::array<BlockFn, sizeof...(R)> rows_table(std::integer_sequence<int, R...>) {
  return {&register_block<R + 1, T>...};
}
template <int... T>
constexpr std::array<std::array<BlockFn, kRowBlock>, sizeof...(T)> block_table(std::integer_sequence<int, T...>) {
  return {rows_table<T + 1>(std::make_integer_sequence<int, kRowBlock>{})...};
}
constexpr int kMaxTiles = 4;
constexpr auto kBlocks = block_table(std::make_integer_sequence<int, kMaxTiles>{});

void tiled_matmul(const Operands& op) {
  // Up to 4 rows, 4 tiles a block: more independent accumulator chains and weight streams in flight for
  // the bandwidth-bound small batches; above, 2 tiles x 12 rows (24 accumulators, 2 weight registers).
  const int64_t tiles_per_block = op.rows <= 4 ? 4 : 2;
  const int64_t row_block = op.rows <= 4 ? 4 : kRowBlock;
  const int64_t blocks = (op.tiles + tiles_per_block - 1) / tiles_per_block;
  const bool buffered = op.rows > kRowBlock;
  const int64_t groups = op.k / kGroup;
  at::parallel_for(0, blocks, 16 / tiles_per_block, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(buffered ? op.k * tiles_per_block * kLanes : 0);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t tile = b * tiles_per_block;
      const int64_t tiles_here = std::min<int64_t>(tiles_per_block, op.tiles - tile);
      const int64_t col = tile * kLanes;
      const int64_t valid = std::min<int64_t>(kLanes, op.n - (tile + tiles_here - 1) * kLanes);
      const int8_t* codes = op.codes + tile * op.k * kLanes;
      const float* scales = op.scales + tile * groups * kLanes;
      const float* weights = nullptr;
      if (buffered) {  // dequantize the tiles once; every row block below reads them from cache
        for (int64_t i = 0; i < op.k; ++i) {
          for (int64_t t = 0; t < tiles_here; ++t) {
            const __m512 scale = _mm512_loadu_ps(scales + (t * groups + i / kGroup) * kLanes);
            _mm512_storeu_ps(buffer.data() + (i * tiles_here + t) * kLanes,
                             dequantize16(codes + (t * op.k + i) * kLanes, scale));
          }
        }
        weights = buffer.data();
      }
      const auto& table = kBlocks[tiles_here - 1];
      for (int64_t r = 0; r < op.rows; r += row_block) {
        const int64_t rows_here = std::min<int64_t>(row_block, op.rows - r);
        table[rows_here - 1](op.x + r * op.k, op.k, codes, scales, weights, op.k, op.out + r * op.n + col, op.n,
                             valid);
      }
    }
  });
}

#else  // no AVX-512: the same layout and arithmetic in plain loops (the compiler may still vectorize them)

void tiled_matmul(const Operands& op) {
  const int64_t groups = op.k / kGroup;
  at::parallel_for(0, op.tiles, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> w(op.k * kLanes);
    for (int64_t tile = begin; tile < end; ++tile) {
      const int8_t* codes = op.codes + tile * op.k * kLanes;
      const float* scales = op.scales + tile * groups * kLanes;
      for (int64_t i = 0; i < op.k; ++i) {
        for (int64_t l = 0; l < kLanes; ++l) {
          w[i * kLanes + l] = static_cast<float>(codes[i * kLanes + l]) * scales[i / kGroup * kLanes + l];
        }
      }
      const int64_t valid = std::min<int64_t>(kLanes, op.n - tile * kLanes);
      for (int64_t r = 0; r < op.rows; ++r) {
        float acc[kLanes] = {};
        const float* xr = op.x + r * op.k;
        for (int64_t i = 0; i < op.k; ++i) {
          for (int64_t l = 0; l < kLanes; ++l) acc[l] += xr[i] * w[i * kLanes + l];
        }
        for (int64_t l = 0; l < valid; ++l) op.out[r * op.n + tile * kLanes + l] = acc[l];
      }
    }
  });
}

#endif

}  // namespace

// x [M, K] float32; codes [ceil(N / 16), K, 16] int8; scales [ceil(N / 16), K / 32, 16] float32;
// out [M, N] float32 (N = out.size(1); the last tile's columns past N are padding). All contiguous.
void q8_0_tiled_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                       torch::Tensor& out) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && codes.dtype() == torch::kInt8 &&
                  scales.dtype() == torch::kFloat32 && out.dtype() == torch::kFloat32,
              "q8_0_tiled_matmul: float32 x, int8 codes, float32 scales and float32 out expected, got ",
              x.dtype(), ", ", codes.dtype(), ", ", scales.dtype(), ", ", out.dtype());
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 3 && scales.dim() == 3 && out.dim() == 2,
              "q8_0_tiled_matmul: x [M, K], codes [N/16, K, 16], scales [N/16, K/32, 16], out [M, N] expected");
  TORCH_CHECK(x.is_contiguous() && codes.is_contiguous() && scales.is_contiguous() && out.is_contiguous(),
              "q8_0_tiled_matmul: contiguous tensors expected");
  const int64_t rows = x.size(0), k = x.size(1), tiles = codes.size(0), n = out.size(1);
  TORCH_CHECK(k > 0 && k % kGroup == 0, "q8_0_tiled_matmul: K = ", k, " is not a positive multiple of 32");
  TORCH_CHECK(codes.size(1) == k && codes.size(2) == kLanes, "q8_0_tiled_matmul: codes ", codes.sizes(),
              " do not match K = ", k, " in tiles of 16 columns");
  TORCH_CHECK(scales.size(0) == tiles && scales.size(1) == k / kGroup && scales.size(2) == kLanes,
              "q8_0_tiled_matmul: scales ", scales.sizes(), " do not match codes ", codes.sizes());
  TORCH_CHECK(out.size(0) == rows && n > (tiles - 1) * kLanes && n <= tiles * kLanes,
              "q8_0_tiled_matmul: out ", out.sizes(), " does not match ", rows, " rows and ", tiles, " tiles");
  if (rows == 0) return;
  tiled_matmul(Operands{x.data_ptr<float>(), codes.data_ptr<int8_t>(), scales.data_ptr<float>(),
                        out.data_ptr<float>(), rows, k, n, tiles});
}
