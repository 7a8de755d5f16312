// x @ W.T with int8 dot products for ggml's 4-bit and Q8_0 weights: AVX512-VNNI (`vpdpbusd`) or AVX2
// (`vpmaddubsw` + `vpmaddwd`), the same layouts and the same exact int32 code sums on both.
//
// The float kernels spend more instructions turning codes into floats than multiplying: torch's int4 kernel
// converts every nibble to a float and scales it before its FMA, and our fp32 Q8_0 kernel converts and scales
// every code. Here the activations are quantized instead, once per call: each row in blocks of 32 values, to
// two int8 codes per value and one float scale per block (x ~= dx q + dx/254 r, dx = max |x| / 127; see
// Activations). Then one `vpdpbusd` multiplies 64 code pairs and sums them in exact int32, and a block's
// float work is a few operations per 16 columns (xq standing for either code set, with its scale):
//   Q4 (w = d q + m, q in 0..15):   sum_k x_k w_k ~= d dx sum_k xq_k q_k + m sum_k x_k
//   Q8_0 (w = d q, q in -128..127): sum_k x_k w_k ~= d dx (sum_k xq_k (q_k + 128) - 128 sum_k xq_k)
// (`vpdpbusd` takes one operand unsigned: the 4-bit codes are, the Q8_0 codes are stored + 128). d and m
// are the file's fp16 values. The only rounding beyond float32 sums is the activations' codes.
//
// Layout (packed once at load, `model/int8_dot.py`): N output columns in tiles of 16 (one zmm of int32
// lanes, two ymm), K in blocks of 32. Per tile and block, Q4: 256 bytes, 4 chunks of [16 lanes][4 k] bytes
// whose low nibbles hold k = 4c..4c+3 and high nibbles k = 16+4c..16+4c+3; scales [2][16] fp16 (d, then m).
// Q8_0: 512 bytes, 8 chunks of [16 lanes][4 k]; scales [16] fp16. Each row's 4 codes of a chunk are
// broadcast from memory. The AVX2 path's arithmetic, and why its int16 steps cannot saturate, is at its
// blocks (q4_block / q8_block below).
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
#define TOKENLOOP_VNNI 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TOKENLOOP_DOT_AVX2 1  // AVX2 CPUs (Zen 3, and AVX-512 ones without VNNI)
#include <immintrin.h>
#endif
#if defined(TOKENLOOP_VNNI) || defined(TOKENLOOP_DOT_AVX2)
#define TOKENLOOP_DOT_SIMD 1
#endif

namespace {

constexpr int64_t kGroup = 32;                       // ggml's block, and the activations' quantization block
constexpr int64_t kLanes = 16;                       // output columns per tile
constexpr int64_t kQ4Bytes = kGroup * kLanes / 2;    // codes per tile and block
constexpr int64_t kQ8Bytes = kGroup * kLanes;

// The activations of one call, per block of 32 values (a ragged last block padded with zeros), as two int8
// codes each: x ~= dx q + (dx / 254) r, with q = round(x / dx) and r the rounded remainder. One code alone
// (8 bits per block) cost 6% of greedy top-1 agreement on the default model (the normed residual stream has
// outlier channels); the pair is ~15 bits per block, about bf16's precision per value.
constexpr int kPasses = 2;
constexpr float kRemainderSteps = 254.f;  // a remainder of up to dx / 2 in steps of dx / 254: -127..127

struct Activations {
  int64_t rows = 0, groups = 0;
  std::vector<int8_t> codes;      // [rows][groups][2][32]: q, then r
  std::vector<float> scales;      // [rows][groups][2]: dx, dx / 254
  std::vector<float> sums;        // [rows][groups]: the block's float sum of x (Q4's m term)
  std::vector<int32_t> offsets;   // [rows][groups][2]: -128 * each code row's sum (Q8_0's correction)
  std::vector<int32_t> half_sums; // [rows][groups][2][2]: each code row's sums over values 0-15 and 16-31
                                  // (Q6_K's -32 offset per 16 values); empty unless asked for
};

struct Block {  // one block's slots in Activations
  int8_t* codes;
  float* scales;
  float& sum;
  int32_t* offsets;
  int32_t* half_sums;  // nullptr: not wanted
};

void quantize_block(const float* x, int64_t valid, Block out) {
  float values[kGroup] = {};
  std::memcpy(values, x, sizeof(float) * valid);
  float amax = 0.f, total = 0.f;
  for (int64_t i = 0; i < kGroup; ++i) {
    amax = std::max(amax, std::fabs(values[i]));
    total += values[i];
  }
  const float scale = amax / 127.f, inverse = amax > 0.f ? 127.f / amax : 0.f;
  const float remainder_inverse = inverse * kRemainderSteps;
  int32_t sums[kPasses] = {};
  for (int64_t i = 0; i < kGroup; ++i) {
    const float q = std::min(127.f, std::max(-127.f, std::nearbyint(values[i] * inverse)));
    const float r = std::min(127.f, std::max(-127.f, std::nearbyint((values[i] - q * scale) * remainder_inverse)));
    out.codes[i] = static_cast<int8_t>(q);
    out.codes[kGroup + i] = static_cast<int8_t>(r);
    sums[0] += out.codes[i];
    sums[1] += out.codes[kGroup + i];
  }
  out.scales[0] = scale;
  out.scales[1] = scale / kRemainderSteps;
  out.sum = total;
  out.offsets[0] = -128 * sums[0];
  out.offsets[1] = -128 * sums[1];
  if (out.half_sums != nullptr) {
    for (int p = 0; p < kPasses; ++p) {
      int32_t first = 0;
      for (int64_t i = 0; i < kGroup / 2; ++i) first += out.codes[p * kGroup + i];
      out.half_sums[2 * p] = first;
      out.half_sums[2 * p + 1] = sums[p] - first;
    }
  }
}

#ifdef TOKENLOOP_VNNI
// A full block in registers (the same codes as quantize_block; the float sum in another order).
void quantize_full_block(const float* x, Block out) {
  const __m512 half[2] = {_mm512_loadu_ps(x), _mm512_loadu_ps(x + 16)};
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(half[0]), _mm512_abs_ps(half[1])));
  const float scale = amax / 127.f, inverse = amax > 0.f ? 127.f / amax : 0.f;
  const __m512 scale_v = _mm512_set1_ps(scale), inverse_v = _mm512_set1_ps(inverse);
  const __m512 remainder_inverse = _mm512_set1_ps(inverse * kRemainderSteps);
  const __m512i low = _mm512_set1_epi32(-127), high = _mm512_set1_epi32(127);
  __m512i sums[kPasses] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
  for (int h = 0; h < 2; ++h) {
    // cvtps_epi32 rounds to nearest even, as nearbyint does
    const __m512i q = _mm512_min_epi32(high, _mm512_max_epi32(low, _mm512_cvtps_epi32(_mm512_mul_ps(half[h], inverse_v))));
    const __m512 rest = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(q), scale_v, half[h]);
    const __m512i r = _mm512_min_epi32(high, _mm512_max_epi32(low, _mm512_cvtps_epi32(_mm512_mul_ps(rest, remainder_inverse))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.codes + 16 * h), _mm512_cvtsepi32_epi8(q));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.codes + kGroup + 16 * h), _mm512_cvtsepi32_epi8(r));
    sums[0] = _mm512_add_epi32(sums[0], q);
    sums[1] = _mm512_add_epi32(sums[1], r);
    if (out.half_sums != nullptr) {  // h is the block's half: values 16h..16h+15
      out.half_sums[h] = _mm512_reduce_add_epi32(q);
      out.half_sums[2 + h] = _mm512_reduce_add_epi32(r);
    }
  }
  out.scales[0] = scale;
  out.scales[1] = scale / kRemainderSteps;
  out.sum = _mm512_reduce_add_ps(_mm512_add_ps(half[0], half[1]));
  out.offsets[0] = -128 * _mm512_reduce_add_epi32(sums[0]);
  out.offsets[1] = -128 * _mm512_reduce_add_epi32(sums[1]);
}
#elif defined(TOKENLOOP_DOT_AVX2)
inline float horizontal_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

inline int32_t horizontal_sum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// 32 int32 values in -127..127 (4 ymm, in order) -> 32 int8 codes. The packs work within 128-bit lanes, which
// leaves the 4-byte groups in the order 0 4 1 5 2 6 3 7; the permute puts them back.
inline void store_codes(const __m256i (&v)[4], int8_t* out) {
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permutevar8x32_epi32(bytes, order));
}

// A full block in registers (the same codes as quantize_block; the float sum in another order).
void quantize_full_block(const float* x, Block out) {
  __m256 v[4];
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 amax_v = _mm256_setzero_ps(), total = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax_v = _mm256_max_ps(amax_v, _mm256_and_ps(v[i], magnitude));
    total = _mm256_add_ps(total, v[i]);
  }
  const float amax = horizontal_max(amax_v);
  const float scale = amax / 127.f, inverse = amax > 0.f ? 127.f / amax : 0.f;
  const __m256 scale_v = _mm256_set1_ps(scale), inverse_v = _mm256_set1_ps(inverse);
  const __m256 remainder_inverse = _mm256_set1_ps(inverse * kRemainderSteps);
  const __m256i low = _mm256_set1_epi32(-127), high = _mm256_set1_epi32(127);
  __m256i q[4], r[4];
  __m256i sums[kPasses] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int i = 0; i < 4; ++i) {
    // cvtps_epi32 rounds to nearest even, as nearbyint does
    q[i] = _mm256_min_epi32(high, _mm256_max_epi32(low, _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse_v))));
    const __m256 rest = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(q[i]), scale_v, v[i]);
    r[i] = _mm256_min_epi32(high,
                            _mm256_max_epi32(low, _mm256_cvtps_epi32(_mm256_mul_ps(rest, remainder_inverse))));
    sums[0] = _mm256_add_epi32(sums[0], q[i]);
    sums[1] = _mm256_add_epi32(sums[1], r[i]);
  }
  store_codes(q, out.codes);
  store_codes(r, out.codes + kGroup);
  if (out.half_sums != nullptr) {  // q[0], q[1] hold values 0-15, q[2], q[3] values 16-31
    out.half_sums[0] = horizontal_sum(_mm256_add_epi32(q[0], q[1]));
    out.half_sums[1] = horizontal_sum(_mm256_add_epi32(q[2], q[3]));
    out.half_sums[2] = horizontal_sum(_mm256_add_epi32(r[0], r[1]));
    out.half_sums[3] = horizontal_sum(_mm256_add_epi32(r[2], r[3]));
  }
  out.scales[0] = scale;
  out.scales[1] = scale / kRemainderSteps;
  out.sum = horizontal_sum(total);
  out.offsets[0] = -128 * horizontal_sum(sums[0]);
  out.offsets[1] = -128 * horizontal_sum(sums[1]);
}
#endif

Activations quantize_activations(const float* x, int64_t rows, int64_t k, int64_t groups, bool half_sums = false) {
  Activations a;
  a.rows = rows;
  a.groups = groups;
  a.codes.resize(rows * groups * kPasses * kGroup);
  a.scales.resize(rows * groups * kPasses);
  a.sums.resize(rows * groups);
  a.offsets.resize(rows * groups * kPasses);
  if (half_sums) a.half_sums.resize(rows * groups * kPasses * 2);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t begin = g * kGroup, valid = std::max<int64_t>(0, std::min(kGroup, k - begin));
      const int64_t at = r * groups + g;
      const Block block{a.codes.data() + at * kPasses * kGroup, a.scales.data() + at * kPasses, a.sums[at],
                        a.offsets.data() + at * kPasses,
                        half_sums ? a.half_sums.data() + at * kPasses * 2 : nullptr};
#ifdef TOKENLOOP_DOT_SIMD
      if (valid == kGroup) {
        quantize_full_block(x + r * k + begin, block);
        continue;
      }
#endif
      quantize_block(x + r * k + begin, valid, block);
    }
  }
  return a;
}

using int8_pack::Weights;  // [tiles][groups][kQ4Bytes or kQ8Bytes, or a K-quant's] codes and their fp16 scales

#ifdef TOKENLOOP_VNNI

using int8_pack::broadcast4;
using int8_pack::half16;
using int8_pack::store_block;

// out[R rows from row0][T tiles from tile0] for 4-bit codes.
template <int R, int T>
void q4_block(const Activations& a, const Weights& w, int64_t row0, int64_t tile0, float* out, int64_t ldo) {
  const int64_t groups = a.groups;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[R][T];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[kPasses][R][T];
#pragma GCC unroll 2
    for (int p = 0; p < kPasses; ++p)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int t = 0; t < T; ++t) dot[p][r][t] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      __m512i low[T], high[T];
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) {
        const __m512i packed = _mm512_loadu_si512(w.codes + ((tile0 + t) * groups + g) * kQ4Bytes + c * 64);
        low[t] = _mm512_and_si512(packed, nibble);
        high[t] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
        for (int p = 0; p < kPasses; ++p) {
          const int8_t* xq = a.codes.data() + (((row0 + r) * groups + g) * kPasses + p) * kGroup;
          const __m512i x_low = broadcast4(xq + 4 * c), x_high = broadcast4(xq + 16 + 4 * c);
#pragma GCC unroll 4
          for (int t = 0; t < T; ++t) {
            dot[p][r][t] = _mm512_dpbusd_epi32(dot[p][r][t], low[t], x_low);
            dot[p][r][t] = _mm512_dpbusd_epi32(dot[p][r][t], high[t], x_high);
          }
        }
      }
    }
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) {
      const uint16_t* s = w.scales + ((tile0 + t) * groups + g) * 2 * kLanes;
      const __m512 d = half16(s), m = half16(s + kLanes);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int64_t at = (row0 + r) * groups + g;
#pragma GCC unroll 2
        for (int p = 0; p < kPasses; ++p) {
          const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(a.scales[at * kPasses + p]));
          acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[p][r][t]), scale, acc[r][t]);
        }
        acc[r][t] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.sums[at]), acc[r][t]);
      }
    }
  }
  store_block<R, T>(acc, w.n, row0, tile0, out, ldo);
}

// The same for Q8_0 codes stored + 128.
template <int R, int T>
void q8_block(const Activations& a, const Weights& w, int64_t row0, int64_t tile0, float* out, int64_t ldo) {
  const int64_t groups = a.groups;
  __m512 acc[R][T];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[kPasses][R][T];
#pragma GCC unroll 2
    for (int p = 0; p < kPasses; ++p)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512i offset = _mm512_set1_epi32(a.offsets[((row0 + r) * groups + g) * kPasses + p]);
#pragma GCC unroll 4
        for (int t = 0; t < T; ++t) dot[p][r][t] = offset;
      }
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      __m512i codes[T];
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t)
        codes[t] = _mm512_loadu_si512(w.codes + ((tile0 + t) * groups + g) * kQ8Bytes + c * 64);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
        for (int p = 0; p < kPasses; ++p) {
          const __m512i x = broadcast4(a.codes.data() + (((row0 + r) * groups + g) * kPasses + p) * kGroup + 4 * c);
#pragma GCC unroll 4
          for (int t = 0; t < T; ++t) dot[p][r][t] = _mm512_dpbusd_epi32(dot[p][r][t], codes[t], x);
        }
      }
    }
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) {
      const __m512 d = half16(w.scales + ((tile0 + t) * groups + g) * kLanes);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
        for (int p = 0; p < kPasses; ++p) {
          const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(a.scales[((row0 + r) * groups + g) * kPasses + p]));
          acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[p][r][t]), scale, acc[r][t]);
        }
      }
    }
  }
  store_block<R, T>(acc, w.n, row0, tile0, out, ldo);
}

#elif defined(TOKENLOOP_DOT_AVX2)
// AVX2 has no `vpdpbusd`: `vpmaddubsw` multiplies unsigned by signed bytes and adds each adjacent pair into
// int16 with signed saturation; `vpmaddwd` then adds adjacent int16 pairs into int32 (each multiplied by an
// int16 factor). A tile is two ymm of 8 lanes; a ymm of codes holds [8 lanes][4 k], so a lane's 4 products
// of a chunk land in 2 int16 and then one int32, as `vpdpbusd` sums them. The int16 steps are exact:
//   Q4: codes 0..15 x activation codes -127..127: a pair is at most 2 * 15 * 127 = 3810 in magnitude, and
//       the 8 pairs per int16 of a block (4 chunks x low/high nibbles) sum to at most 30480 < 32767, so a
//       block's products are summed in int16 before any widening.
//   Q8_0: the stored code + 128 (0..255) x -127..127 could saturate (2 * 255 * 127 > 32767), so the signed
//       code q = stored ^ 0x80 (-128..127) is split instead: |q| (0..128, unsigned) x sign(q) x (-127..127,
//       negating a code of at most 127 never overflows): a pair is at most 2 * 128 * 127 = 32512 < 32767,
//       and q = -128 is exact (|q| = 128 fits the unsigned byte). No -128 x sum(xq) correction is needed.
// The two activation code sets are folded in int32 as 254 sum(q x) + sum(r x) by `vpmaddwd` with factors
// 254 and 1 (the remainder's scale is dx / 254): one accumulator and one float FMA per lane and block. Its
// magnitude stays below 2^31: Q4 255 * 32 * 15 * 127 < 2^24 (exact in float32 too), Q8_0 255 * 32 * 128 * 127
// < 2^28.

inline __m256i broadcast4(const int8_t* p) {
  int32_t word;
  std::memcpy(&word, p, sizeof(word));
  return _mm256_set1_epi32(word);
}

inline __m256 half8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline const __m256i* code_vector(const Weights& w, int64_t tile, int64_t group, int64_t bytes, int chunk,
                                  int half) {
  return reinterpret_cast<const __m256i*>(w.codes + (tile * w.groups + group) * bytes + chunk * 64 + half * 32);
}

// Writes a register block's sums (H ymm halves of 8 columns): the last tile's columns past n are padding.
template <int R, int H>
inline void store_block(const __m256 (&acc)[R][H], int64_t n, int64_t row0, int64_t tile0, float* out,
                        int64_t ldo) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
#pragma GCC unroll 8
  for (int h = 0; h < H; ++h) {
    const int64_t column = tile0 * kLanes + h * 8, valid = std::min<int64_t>(8, n - column);
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(valid)), lane);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      float* at = out + (row0 + r) * ldo + column;
      if (valid >= 8) _mm256_storeu_ps(at, acc[r][h]);
      else _mm256_maskstore_ps(at, mask, acc[r][h]);
    }
  }
}

// acc += (254 dot_q + dot_r) x d dx / 254 for each row and half, from the int16 pair sums (Q4) or the folded
// int32 sums (Q8_0) of one block.
template <int R, int H>
inline void apply_scales(const Activations& a, const __m256 (&d)[H], int64_t row0, int64_t g,
                         const __m256i (&dot)[R][H], __m256 (&acc)[R][H]) {
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m256 dx = _mm256_set1_ps(a.scales[((row0 + r) * a.groups + g) * kPasses + 1]);  // dx / 254
#pragma GCC unroll 8
    for (int h = 0; h < H; ++h)
      acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), _mm256_mul_ps(d[h], dx), acc[r][h]);
  }
}

// out[R rows from row0][T tiles from tile0] for 4-bit codes.
template <int R, int T>
void q4_block(const Activations& a, const Weights& w, int64_t row0, int64_t tile0, float* out, int64_t ldo) {
  constexpr int H = 2 * T;
  const int64_t groups = a.groups;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i fold[kPasses] = {_mm256_set1_epi16(static_cast<int16_t>(kRemainderSteps)), _mm256_set1_epi16(1)};
  __m256 acc[R][H];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int h = 0; h < H; ++h) acc[r][h] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i pairs[kPasses][R][H];  // int16 sums of products, per pass (code set)
#pragma GCC unroll 2
    for (int p = 0; p < kPasses; ++p)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int h = 0; h < H; ++h) pairs[p][r][h] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
#pragma GCC unroll 8
      for (int h = 0; h < H; ++h) {
        const __m256i packed = _mm256_loadu_si256(code_vector(w, tile0 + h / 2, g, kQ4Bytes, c, h % 2));
        const __m256i low = _mm256_and_si256(packed, nibble);
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
          for (int p = 0; p < kPasses; ++p) {
            const int8_t* xq = a.codes.data() + (((row0 + r) * groups + g) * kPasses + p) * kGroup;
            const __m256i products = _mm256_add_epi16(_mm256_maddubs_epi16(low, broadcast4(xq + 4 * c)),
                                                      _mm256_maddubs_epi16(high, broadcast4(xq + 16 + 4 * c)));
            pairs[p][r][h] = _mm256_add_epi16(pairs[p][r][h], products);
          }
        }
      }
    }
    __m256i dot[R][H];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int h = 0; h < H; ++h)
        dot[r][h] = _mm256_add_epi32(_mm256_madd_epi16(pairs[0][r][h], fold[0]),
                                     _mm256_madd_epi16(pairs[1][r][h], fold[1]));
    __m256 d[H], m[H];
#pragma GCC unroll 8
    for (int h = 0; h < H; ++h) {
      const uint16_t* s = w.scales + ((tile0 + h / 2) * groups + g) * 2 * kLanes + (h % 2) * 8;
      d[h] = half8(s);
      m[h] = half8(s + kLanes);
    }
    apply_scales<R, H>(a, d, row0, g, dot, acc);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 sum = _mm256_set1_ps(a.sums[(row0 + r) * groups + g]);
#pragma GCC unroll 8
      for (int h = 0; h < H; ++h) acc[r][h] = _mm256_fmadd_ps(m[h], sum, acc[r][h]);
    }
  }
  store_block<R, H>(acc, w.n, row0, tile0, out, ldo);
}

// The same for Q8_0 codes stored + 128.
template <int R, int T>
void q8_block(const Activations& a, const Weights& w, int64_t row0, int64_t tile0, float* out, int64_t ldo) {
  constexpr int H = 2 * T;
  const int64_t groups = a.groups;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i fold[kPasses] = {_mm256_set1_epi16(static_cast<int16_t>(kRemainderSteps)), _mm256_set1_epi16(1)};
  __m256 acc[R][H];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int h = 0; h < H; ++h) acc[r][h] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i dot[R][H];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int h = 0; h < H; ++h) dot[r][h] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
#pragma GCC unroll 8
      for (int h = 0; h < H; ++h) {
        const __m256i stored = _mm256_loadu_si256(code_vector(w, tile0 + h / 2, g, kQ8Bytes, c, h % 2));
        const __m256i q = _mm256_xor_si256(stored, flip);  // the file's signed code
        const __m256i magnitude = _mm256_abs_epi8(q);  // -128 -> 0x80, read as the unsigned 128
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
          for (int p = 0; p < kPasses; ++p) {
            const int8_t* xq = a.codes.data() + (((row0 + r) * groups + g) * kPasses + p) * kGroup;
            const __m256i signed_x = _mm256_sign_epi8(broadcast4(xq + 4 * c), q);  // x sign(q); 0 where q = 0
            const __m256i products = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), fold[p]);
            dot[r][h] = _mm256_add_epi32(dot[r][h], products);
          }
        }
      }
    }
    __m256 d[H];
#pragma GCC unroll 8
    for (int h = 0; h < H; ++h) d[h] = half8(w.scales + ((tile0 + h / 2) * groups + g) * kLanes + (h % 2) * 8);
    apply_scales<R, H>(a, d, row0, g, dot, acc);
  }
  store_block<R, H>(acc, w.n, row0, tile0, out, ldo);
}

#else  // no VNNI: the same arithmetic in plain loops (exact int sums, then the same float steps)

float half_to_float(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

template <bool Q4>
void scalar_block(const Activations& a, const Weights& w, int64_t row0, int64_t rows, int64_t tile0, int64_t tiles,
                  float* out, int64_t ldo) {
  const int64_t groups = a.groups;
  for (int64_t r = row0; r < row0 + rows; ++r) {
    for (int64_t tile = tile0; tile < tile0 + tiles; ++tile) {
      for (int64_t lane = 0; lane < kLanes && tile * kLanes + lane < w.n; ++lane) {
        float acc = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t at = r * groups + g;
          const uint16_t* s = w.scales + (tile * groups + g) * (Q4 ? 2 : 1) * kLanes;
          for (int p = 0; p < kPasses; ++p) {
            const int8_t* xq = a.codes.data() + (at * kPasses + p) * kGroup;
            int32_t dot = Q4 ? 0 : a.offsets[at * kPasses + p];
            for (int64_t i = 0; i < kGroup; ++i) {
              int32_t code;
              if (Q4) {
                const int64_t chunk = (i % 16) / 4, byte = i % 4;
                const uint8_t packed = w.codes[(tile * groups + g) * kQ4Bytes + chunk * 64 + lane * 4 + byte];
                code = i < 16 ? (packed & 0x0F) : (packed >> 4);
              } else {
                code = w.codes[(tile * groups + g) * kQ8Bytes + (i / 4) * 64 + lane * 4 + i % 4];
              }
              dot += code * xq[i];
            }
            acc += static_cast<float>(dot) * (half_to_float(s[lane]) * a.scales[at * kPasses + p]);
          }
          if (Q4) acc += half_to_float(s[kLanes + lane]) * a.sums[at];
        }
        out[r * ldo + tile * kLanes + lane] = acc;
      }
    }
  }
}

template <int R, int T>
void q4_block(const Activations& a, const Weights& w, int64_t row0, int64_t tile0, float* out, int64_t ldo) {
  scalar_block<true>(a, w, row0, R, tile0, T, out, ldo);
}

template <int R, int T>
void q8_block(const Activations& a, const Weights& w, int64_t row0, int64_t tile0, float* out, int64_t ldo) {
  scalar_block<false>(a, w, row0, R, tile0, T, out, ldo);
}

#endif

using BlockFn = void (*)(const Activations&, const Weights&, int64_t, int64_t, float*, int64_t);

// Register blocking: rows per block, and tiles per block for one or two rows and for more. The tile block's
// codes stay in L1 while every row block reads them.
struct Blocking {
  int rows, q4_tiles_few, q4_tiles_many, q8_tiles_few, q8_tiles_many;
  int64_t tiles(bool q4, int64_t total_rows) const {
    return total_rows <= 2 ? (q4 ? q4_tiles_few : q8_tiles_few) : (q4 ? q4_tiles_many : q8_tiles_many);
  }
};
#if defined(TOKENLOOP_VNNI)
// 32 zmm: R x T x 2 int32 dot accumulators (a code and a remainder code per value), R x T float sums, T (Q8_0)
// or 2T (Q4) code vectors. One or two rows: 2 tiles (Q4) or 3 (Q8_0) keep more loads in flight; more rows
// reuse each loaded chunk across 4 rows of 1 tile (Q4) or 2 (Q8_0).
constexpr int kMaxRows = 4, kMaxTiles = 3;
constexpr Blocking kBlocking{4, 2, 1, 3, 2};
#elif defined(TOKENLOOP_DOT_AVX2)
// 16 ymm: per row and 8-column half, 2 int16 pair sums (Q4) or one folded int32 sum (Q8_0) and a float sum,
// besides two code vectors, the broadcast activations and constants: 2 rows x 1 tile fit (12-15 registers).
// Measured with the x86-64-v3 build (one thread, an AVX-512 machine): 2 x 1 was the fastest, or within 3%,
// at 1, 2, 8 and 32 rows on the layers and the head; 2 tiles a block lost 45-80% at 1-2 rows, 4 x 1 up to 28%.
constexpr int kMaxRows = 2, kMaxTiles = 1;
constexpr Blocking kBlocking{2, 1, 1, 1, 1};
#else
constexpr int kMaxRows = 4, kMaxTiles = 3;
constexpr Blocking kBlocking{4, 2, 1, 3, 2};
#endif

// One instantiation per row count 1..kMaxRows and tile count 1..kMaxTiles, so ragged blocks keep their
// accumulators in registers.
template <bool Q4, int T, int... R>
constexpr std::array<BlockFn, sizeof...(R)> rows_table(std::integer_sequence<int, R...>) {
  return {(Q4 ? &q4_block<R + 1, T> : &q8_block<R + 1, T>)...};
}
template <bool Q4, int... T>
constexpr std::array<std::array<BlockFn, kMaxRows>, sizeof...(T)> block_table(std::integer_sequence<int, T...>) {
  return {rows_table<Q4, T + 1>(std::make_integer_sequence<int, kMaxRows>{})...};
}
constexpr auto kQ4Blocks = block_table<true>(std::make_integer_sequence<int, kMaxTiles>{});
constexpr auto kQ8Blocks = block_table<false>(std::make_integer_sequence<int, kMaxTiles>{});

#include "kquant_dot_blocks.inc"  // Q5_K and Q6_K: the same activations, tiles and stores

// The int8-dot formats, numbered as decode_layers' Form (fused_cpu.ProjectionForm).
enum class DotFormat : int64_t { kQ4 = 3, kQ8 = 4, kQ5K = 5, kQ6K = 6, kQ4K = 7 };

// One pack of a projection's rows: its kernel, its tiles, and the first output column it writes.
struct DotPart {
  DotFormat format;
  Weights w;
  int64_t column;
  int64_t tile_bytes;  // the codes and scales one tile reads: what the threads' shares are measured in
};

int64_t tiles_per_block(DotFormat format, int64_t rows) {
  switch (format) {
    case DotFormat::kQ4: return kBlocking.tiles(true, rows);
    case DotFormat::kQ8: return kBlocking.tiles(false, rows);
    default: return std::min<int64_t>(kKQuantMaxTiles, kBlocking.tiles(true, rows));
  }
}

BlockFn block_fn(DotFormat format, int64_t tiles, int64_t rows) {
  switch (format) {
    case DotFormat::kQ4: return kQ4Blocks[tiles - 1][rows - 1];
    case DotFormat::kQ8: return kQ8Blocks[tiles - 1][rows - 1];
    case DotFormat::kQ5K: return kQ5KBlocks[tiles - 1][rows - 1];
    case DotFormat::kQ4K: return kQ4KBlocks[tiles - 1][rows - 1];
    default: return kQ6KBlocks[tiles - 1][rows - 1];
  }
}

// Below this many tiles in all, one thread: waking the other costs more than it saves.
constexpr int64_t kSerialTiles = 8;

// Every part's tiles, in blocks, in one parallel region: each thread takes the blocks that start in its equal
// share of the bytes (a Q6_K tile reads 1.3x a Q4 one), rows in blocks within each, and writes its columns
// straight into `out` (a row stack's parts side by side: no concatenation). A column's sums do not depend on
// the split, so a row stack gives bit for bit what its parts give one by one.
void dot_parts(const Activations& a, const std::vector<DotPart>& parts, float* out, int64_t ldo) {
  struct Unit {
    const DotPart* part;
    int64_t tile0, tiles, start;  // start: the bytes of the units before it
  };
  std::vector<Unit> units;
  int64_t total = 0, all_tiles = 0;
  for (const DotPart& part : parts) {
    const int64_t step = tiles_per_block(part.format, a.rows);
    for (int64_t tile0 = 0; tile0 < part.w.tiles; tile0 += step) {
      const int64_t tiles = std::min(step, part.w.tiles - tile0);
      units.push_back(Unit{&part, tile0, tiles, total});
      total += tiles * part.tile_bytes;
    }
    all_tiles += part.w.tiles;
  }
  const auto run_units = [&](size_t begin, size_t end) {
    for (size_t u = begin; u < end; ++u) {
      const Unit& unit = units[u];
      for (int64_t row0 = 0; row0 < a.rows; row0 += kBlocking.rows) {
        const int64_t rows = std::min<int64_t>(kBlocking.rows, a.rows - row0);
        block_fn(unit.part->format, unit.tiles, rows)(a, unit.part->w, row0, unit.tile0, out + unit.part->column,
                                                     ldo);
      }
    }
  };
  const int64_t threads = all_tiles < kSerialTiles ? 1 : at::get_num_threads();
  if (threads <= 1 || at::in_parallel_region()) {
    run_units(0, units.size());
    return;
  }
  const auto first_at = [&](int64_t share) {  // the first unit starting at or after share / threads of the bytes
    const int64_t bytes = total * share / threads;
    return static_cast<size_t>(std::lower_bound(units.begin(), units.end(), bytes,
                                                [](const Unit& unit, int64_t b) { return unit.start < b; }) -
                               units.begin());
  };
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) { run_units(first_at(begin), first_at(end)); });
}

// Checks one pack's operands against x and the output columns it fills, and describes it for dot_parts.
DotPart make_part(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales, int64_t form,
                  int64_t width, int64_t column) {
  TORCH_CHECK(form >= static_cast<int64_t>(DotFormat::kQ4) && form <= static_cast<int64_t>(DotFormat::kQ4K),
              "int8_dot: form 3 (Q4), 4 (Q8_0), 5 (Q5_K), 6 (Q6_K) or 7 (Q4_K) expected, got ", form);
  const DotFormat format = static_cast<DotFormat>(form);
  const bool kquant = format >= DotFormat::kQ5K;
  const int64_t bytes = format == DotFormat::kQ4 ? kQ4Bytes
                        : format == DotFormat::kQ8 ? kQ8Bytes
                        : format == DotFormat::kQ6K ? KLayout<KQuant::kQ6K>::bytes
                        : format == DotFormat::kQ5K ? KLayout<KQuant::kQ5K>::bytes : KLayout<KQuant::kQ4K>::bytes;
  // scales per tile: Q4 [K/32][2][16], Q8_0 [K/32][16], K-quants [K/256][S][16] (S: Q6_K's d, or d and dmin)
  const int64_t scale_dims = format == DotFormat::kQ8 ? 3 : 4;
  const int64_t supers = format == DotFormat::kQ6K ? 1 : 2;
  TORCH_CHECK(codes.dtype() == torch::kUInt8 && scales.dtype() == torch::kFloat16,
              "int8_dot: uint8 codes and float16 scales expected, got ", codes.dtype(), ", ", scales.dtype());
  TORCH_CHECK(codes.dim() == 3 && scales.dim() == scale_dims && codes.is_contiguous() && scales.is_contiguous(),
              "int8_dot: contiguous codes [N/16, K/32, ", bytes, "] and scales of ", scale_dims, " dims expected");
  const int64_t tiles = codes.size(0), groups = codes.size(1), k = x.size(1);
  TORCH_CHECK(codes.size(2) == bytes, "int8_dot: codes ", codes.sizes(), " are not in tiles of ", bytes,
              " bytes a block");
  if (kquant) {
    TORCH_CHECK(groups % kSuperGroups == 0 && k == groups * kGroup, "int8_dot: x has K = ", k, ", the codes ",
                groups, " blocks of 32 (whole super-blocks of 256)");
  } else {
    TORCH_CHECK(k > (groups - 1) * kGroup && k <= groups * kGroup, "int8_dot: x has K = ", k, ", the codes ",
                groups, " blocks of 32");
  }
  TORCH_CHECK(scales.size(0) == tiles && scales.size(1) == (kquant ? groups / kSuperGroups : groups) &&
                  scales.size(-1) == kLanes && (scale_dims == 3 || scales.size(2) == supers),
              "int8_dot: scales ", scales.sizes(), " do not match codes ", codes.sizes());
  TORCH_CHECK(width > (tiles - 1) * kLanes && width <= tiles * kLanes, "int8_dot: a width of ", width,
              " columns does not match ", tiles, " tiles");
  const Weights w{codes.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()), tiles,
                  groups, width};
  return DotPart{format, w, column, (codes.numel() + 2 * scales.numel()) / tiles};
}

}  // namespace

// x [M, K] float32; per part codes and scales in its form's layout (`make_part`; Q4: codes [ceil(N/16),
// ceil(K/32), 256], scales [ceil(N/16), ceil(K/32), 2, 16] (d, m); Q8_0: codes [.., K/32, 512] (code + 128),
// scales [.., K/32, 16]; Q5_K / Q6_K: kquant_dot_blocks.inc), its form (3 Q4, 4 Q8_0, 5 Q5_K, 6 Q6_K) and
// output width; out [M, sum of widths] float32, the parts' columns side by side. All contiguous. The
// activations are quantized once for every part.
void int8_dot_stack(const torch::Tensor& x, const std::vector<torch::Tensor>& codes,
                    const std::vector<torch::Tensor>& scales, const std::vector<int64_t>& forms,
                    const std::vector<int64_t>& widths, torch::Tensor& out) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && out.dtype() == torch::kFloat32 && x.dim() == 2 && out.dim() == 2 &&
                  x.is_contiguous() && out.is_contiguous(),
              "int8_dot: contiguous float32 x [M, K] and out [M, N] expected");
  TORCH_CHECK(!codes.empty() && scales.size() == codes.size() && forms.size() == codes.size() &&
                  widths.size() == codes.size(),
              "int8_dot: codes, scales, a form and a width per part expected");
  std::vector<DotPart> parts;
  int64_t column = 0;
  bool half_sums = false;
  for (size_t i = 0; i < codes.size(); ++i) {
    parts.push_back(make_part(x, codes[i], scales[i], forms[i], widths[i], column));
    column += widths[i];
    half_sums = half_sums || parts.back().format == DotFormat::kQ6K;
  }
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == column, "int8_dot: out ", out.sizes(), " does not match ",
              x.size(0), " rows and the parts' ", column, " columns");
  if (x.size(0) == 0) return;
  const Activations a = quantize_activations(x.data_ptr<float>(), x.size(0), x.size(1), codes[0].size(1), half_sums);
  dot_parts(a, parts, out.data_ptr<float>(), column);
}

#include "int8_dot_tiles.inc"  // the same kernels in pieces, for moe_experts.cpp
void int4_dot_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                     torch::Tensor& out) {
  int8_dot_stack(x, {codes}, {scales}, {static_cast<int64_t>(DotFormat::kQ4)}, {out.size(-1)}, out);
}

void q8_0_dot_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                     torch::Tensor& out) {
  int8_dot_stack(x, {codes}, {scales}, {static_cast<int64_t>(DotFormat::kQ8)}, {out.size(-1)}, out);
}

void kquant_dot_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                       torch::Tensor& out, int64_t kind) {
  TORCH_CHECK(kind >= 5 && kind <= 7, "kquant_dot_matmul: kind 5 (Q5_K), 6 (Q6_K) or 7 (Q4_K) expected, got ", kind);
  int8_dot_stack(x, {codes}, {scales}, {kind}, {out.size(-1)}, out);
}

bool int8_dot_native() {
#ifdef TOKENLOOP_DOT_SIMD
  return true;
#else
  return false;
#endif
}
