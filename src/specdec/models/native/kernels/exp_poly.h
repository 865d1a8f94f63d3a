// e^x for x in [-87, 88] (its result a normal float), the same bits in every form: attention's block
// weights (x = score - max <= 0) and the MLP's silu (e^-g, clamped) take it from here.
//
// x = n ln2 + r, |r| <= ln2/2: n by adding and removing 1.5 * 2^23 (round to nearest, no libm call),
// r by Cody-Waite's two-part ln2; e^r by its degree-6 Taylor polynomial (relative error < 2e-7,
// about one float ulp), times 2^n built in the exponent bits. The 8- and 16-lane forms repeat the
// scalar form's operations lane by lane (mul, add, sub; no FMA: the kernels build with
// -ffp-contract=off), so every path gives its bits. Why by hand: GCC leaves loops over the scalar
// form scalar where a branch sits beside it (attention's `omp simd` loop; silu's clamps on AVX2).
#pragma once

#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#endif

namespace specdec {

__attribute__((always_inline)) inline float exp_poly(float x) {  // inlined: loops over it vectorize
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * __builtin_bit_cast(float, bits);  // not memcpy: the vectorizer takes a bit cast
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target("avx512f"), always_inline)) inline __m512 exp_poly16(__m512 x) {
  const __m512 shifter = _mm512_set1_ps(12582912.f);
  const __m512 n =
      _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), shifter), shifter);
  const __m512 r = _mm512_add_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.f / 120.f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.f / 24.f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.f / 6.f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(0.5f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

__attribute__((target("avx2"), always_inline)) inline __m256 exp_poly8(__m256 x) {
  const __m256 shifter = _mm256_set1_ps(12582912.f);
  const __m256 n =
      _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), shifter), shifter);
  const __m256 r = _mm256_add_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.f / 720.f);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.f / 120.f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.f / 24.f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.f / 6.f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(0.5f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

}  // namespace specdec
