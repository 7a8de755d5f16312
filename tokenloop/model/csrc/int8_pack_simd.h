// What the int8-dot decode kernels (int8_dot_matmul.cpp) and the many-row GEMM (int8_gemm.cpp) share: a pack as
// both read it, and the AVX-512 pieces that feed `vpdpbusd` and write a register block of sums.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace int8_pack {

constexpr int64_t kLanes = 16;  // output columns per tile

// One pack's codes and scales as the kernels read them.
struct Weights {
  const uint8_t* codes;    // [tiles][groups][the form's bytes a block]
  const uint16_t* scales;  // fp16 bits: per tile and block (Q4: [2][16], Q8_0: [16]) or super-block (K-quants)
  int64_t tiles, groups, n;
};

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)

// Four int8 activation codes (one `vpdpbusd` word) in every lane.
inline __m512i broadcast4(const int8_t* p) {
  int32_t word;
  std::memcpy(&word, p, sizeof(word));
  return _mm512_set1_epi32(word);
}

inline __m512 half16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Writes a register block's sums (R rows x T tiles) at out[row0..][tile0 * 16..]: the last tile's columns past n
// are padding.
template <int R, int T>
inline void store_block(const __m512 (&acc)[R][T], int64_t n, int64_t row0, int64_t tile0, float* out, int64_t ldo) {
  const int64_t valid = std::min<int64_t>(kLanes, n - (tile0 + T - 1) * kLanes);
  const __mmask16 last = valid >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1u);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t)
      _mm512_mask_storeu_ps(out + (row0 + r) * ldo + (tile0 + t) * kLanes, t == T - 1 ? last : 0xFFFF, acc[r][t]);
}

#endif

}  // namespace int8_pack
