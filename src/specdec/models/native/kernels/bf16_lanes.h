// bf16 in vector lanes, the same bits as c10::BFloat16's conversions: fp32 -> bf16 rounds to nearest
// even (NaN to 0x7fc0), bf16 -> fp32 shifts the bits up. w4a8's bf16 outputs and silu_mul's bf16
// inputs and outputs take them from here (8 lanes on AVX2, 16 on AVX-512F; the rounded bits stay in
// 32-bit lanes for the caller to pack).
#pragma once

#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>

namespace specdec {

__attribute__((target("avx512f"), always_inline)) inline __m512 bf16x16_load(const uint16_t* x) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

__attribute__((target("avx512f"), always_inline)) inline __m512i bf16x16_bits(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), rounded, _mm512_set1_epi32(0x7fc0));
}

__attribute__((target("avx2"), always_inline)) inline __m256 bf16x8_load(const uint16_t* x) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

__attribute__((target("avx2"), always_inline)) inline __m256i bf16x8_bits(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
}

}  // namespace specdec
#endif
