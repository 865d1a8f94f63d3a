// Blocked attention for the CPU in one call per layer: the same law as attention.py's blocked_attention
// (keys in KEY_BLOCK-slot blocks aligned to position 0, each block's softmax terms against its own max,
// blocks combined in block order after rescaling to the overall max, weights below e^-60 of a block's
// max exactly 0, fully masked blocks skipped), each query row by its own loop (attend_rows), or on
// AVX2 and AVX-512 by tiles of rows that share each key and value load (attend_rows' step sets).
//
// Why: in PyTorch ops the law takes ~30 small ops per layer (batched matmuls, a cumsum for the
// ordered sum, fp32 copies of the cache); at 800 cached tokens that was ~12 of a 52 ms decode step
// on a 2-core EPYC, mostly dispatch and copies, for ~1 ms of arithmetic.
//
// Batch invariance by construction: every query row runs the same loop over its own keys, its dot
// products summed in 16 fixed lanes then a fixed tree, its weighted values summed key by key; nothing
// depends on how many rows, tokens or requests share the call. Compiled without FMA contraction
// (-ffp-contract=off), so the vector clones GCC makes for AVX2 and AVX-512 round like the scalar one,
// and the hand-written AVX2 and AVX-512 steps below repeat the scalar operations lane by lane.
//
// Where the time went on AVX2 (a 2-core Zen 3 EPYC, benchmarks/attention_ab.py): GCC left the block
// weights' exp scalar, with a branch per key, the weighted values' accumulators in memory and dot4's
// tree in scalar adds, and every tile copied the fp32 cache's blocks before reading them. Those steps
// are now written in AVX2 and AVX-512 (the same operations per lane) and an fp32 cache is read in
// place. Then, with k + 1 tokens x the grouped heads as rows (54 rows a KV head for 9 tokens of the
// 1.5B target), each row loading every key and value on its own made the loads from L2 the bound:
// tiles of rows share them (benchmarks/RESULTS.md, "Attention: tiles of query rows").

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_paths.h"
#include "exp_poly.h"
#include "layer_kernels.h"

#include <cmath>
#include <algorithm>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>
#include <string>
#include <limits>
#include <vector>

namespace {

constexpr int kLanes = 16;
constexpr float kNegligibleExponent = -60.f;  // attention.py's NEGLIGIBLE_EXPONENT

// q . k over dim, in 16 fixed lanes and a fixed pairwise tree (k already fp32).
inline float dot(const float* q, const float* k, int64_t dim) {
  float lanes[kLanes] = {0};
  int64_t d = 0;
  for (; d + kLanes <= dim; d += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] = lanes[l] + q[d + l] * k[d + l];
  for (int l = 0; d + l < dim; ++l) lanes[l] = lanes[l] + q[d + l] * k[d + l];
  for (int width = kLanes / 2; width >= 1; width /= 2)
    for (int l = 0; l < width; ++l) lanes[l] = lanes[l] + lanes[l + width];
  return lanes[0];
}

// dot() of one query with 4 consecutive keys (stride dim), each with exactly dot()'s operations: the
// same bits. Four keys give four independent chains of vector adds, where one dot is a single chain
// bound by the add latency.
template <int kDim>
inline void dot4(const float* q, const float* k, float* out) {
  static_assert(kDim % kLanes == 0 && kLanes == 16, "dot4 needs whole 16-lane chunks");
  float lanes[4][kLanes];
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < kLanes; ++l) lanes[j][l] = 0.f;  // a loop, not `= {}`: GCC made that a rep stos
  for (int64_t d = 0; d < kDim; d += kLanes)
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < kLanes; ++l) lanes[j][l] = lanes[j][l] + q[d + l] * k[j * kDim + d + l];
  // dot()'s tree, written out level by level: GCC leaves a halving loop scalar and in memory.
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < 8; ++l) lanes[j][l] = lanes[j][l] + lanes[j][l + 8];
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < 4; ++l) lanes[j][l] = lanes[j][l] + lanes[j][l + 4];
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < 2; ++l) lanes[j][l] = lanes[j][l] + lanes[j][l + 2];
  for (int j = 0; j < 4; ++j) out[j] = lanes[j][0] + lanes[j][1];
}

#if defined(__x86_64__) && defined(__GNUC__)
// dot()'s tree (lane l meets lane l + 8, then l + 4, l + 2, l + 1) for 16 dot products at once:
// acc[i] holds dot i's 16 lane sums, lane i of the result its total. The tree runs on all 16 side by side by
// shuffling their halves together, so it costs 15 vector adds per 16 dots where a dot alone costs 4
// horizontal steps. The same adds of the same pairs as dot() (IEEE addition commutes), so the same bits.
__attribute__((target("avx512f"), always_inline)) inline __m512 tree16_avx512(const __m512* acc) {
  // Lanes l and l + 8 of dots 2i and 2i + 1: [dot 2i's 8 sums, dot 2i + 1's 8 sums].
  __m512 s8[8];
  for (int i = 0; i < 8; ++i)
    s8[i] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0x44),
                          _mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0xEE));
  // l and l + 4: 128-bit lane c of s4[m] holds dot 4m + c's four sums.
  __m512 s4[4];
  for (int m = 0; m < 4; ++m)
    s4[m] = _mm512_add_ps(_mm512_shuffle_f32x4(s8[2 * m], s8[2 * m + 1], 0x88),
                          _mm512_shuffle_f32x4(s8[2 * m], s8[2 * m + 1], 0xDD));
  // l and l + 2: per 128-bit lane c, [dot 8p + c: two sums, dot 8p + 4 + c: two sums].
  __m512 s2[2];
  for (int p = 0; p < 2; ++p)
    s2[p] = _mm512_add_ps(_mm512_shuffle_ps(s4[2 * p], s4[2 * p + 1], 0x44),
                          _mm512_shuffle_ps(s4[2 * p], s4[2 * p + 1], 0xEE));
  // l and l + 1: per 128-bit lane c, dots c, 4 + c, 8 + c, 12 + c; back to dot order.
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(s2[0], s2[1], 0x88), _mm512_shuffle_ps(s2[0], s2[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, sums);
}

// dot() of R queries with J = 16 / R consecutive keys (stride kDim) in AVX-512, query r's J dots
// stored at out[r][0..J), each
// with exactly dot()'s operations (the same 16-lane products and sums, mul then add, no FMA, then
// tree16's tree). Each key register loaded feeds R queries and each query register J keys, so a
// tile of 4 queries x 4 keys loads a quarter of the key bytes that 4 single queries (R = 1, 16 keys)
// load: with many query rows (k + 1 tokens x the grouped heads), those loads from L2 were the bound.
template <int kDim, int R>
__attribute__((target("avx512f"))) void dots_tile_avx512(const float* const* q, const float* k, float* const* out) {
  static_assert(kDim % kLanes == 0 && kLanes == 16 && (R == 1 || R == 2 || R == 4), "dots_tile: 16-lane chunks");
  constexpr int J = 16 / R;
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int d = 0; d < kDim; d += kLanes) {
    __m512 qv[R];
    for (int r = 0; r < R; ++r) qv[r] = _mm512_loadu_ps(q[r] + d);
    for (int j = 0; j < J; ++j) {
      const __m512 kv = _mm512_loadu_ps(k + j * kDim + d);
      for (int r = 0; r < R; ++r) acc[r * J + j] = _mm512_add_ps(acc[r * J + j], _mm512_mul_ps(qv[r], kv));
    }
  }
  const __m512 dots = tree16_avx512(acc);
  if constexpr (R == 1) {
    _mm512_storeu_ps(out[0], dots);
  } else if constexpr (R == 2) {
    _mm256_storeu_ps(out[0], _mm512_castps512_ps256(dots));
    _mm256_storeu_ps(out[1], _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(dots), 1)));
  } else {
    _mm_storeu_ps(out[0], _mm512_castps512_ps128(dots));
    _mm_storeu_ps(out[1], _mm512_extractf32x4_ps(dots, 1));
    _mm_storeu_ps(out[2], _mm512_extractf32x4_ps(dots, 2));
    _mm_storeu_ps(out[3], _mm512_extractf32x4_ps(dots, 3));
  }
}

// Block steps 16 keys at a time (block % 16 == 0), each lane as the scalar loops do it:
// the scores of one row's block, scaled, masked keys -inf (bias != 0; none when bias is null), and their max;
// the block's weights; bf16 rows widened to fp32 scratch.
__attribute__((target("avx512f"))) inline float scale_mask_max_avx512(float* scores, int64_t block, float scale,
                                                                     const float* bias) {
  const __m512 vscale = _mm512_set1_ps(scale), minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 top = minus_inf;
  for (int64_t t = 0; t < block; t += 16) {
    __m512 s = _mm512_mul_ps(_mm512_loadu_ps(scores + t), vscale);
    if (bias) s = _mm512_mask_mov_ps(minus_inf, _mm512_cmp_ps_mask(_mm512_loadu_ps(bias + t), _mm512_setzero_ps(), _CMP_EQ_OQ), s);
    _mm512_storeu_ps(scores + t, s);
    top = _mm512_mask_mov_ps(top, _mm512_cmp_ps_mask(s, top, _CMP_GT_OQ), s);  // s > m ? s : m, as the scalar loop
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, top);
  float m = lanes[0];
  for (int l = 1; l < 16; ++l) m = lanes[l] > m ? lanes[l] : m;
  return m;
}

// A block's weights w[t] = x >= -60 ? e^x : 0, x = score - max, 16 lanes at a time (e^x: exp_poly.h).
__attribute__((target("avx512f"))) inline void block_weights_avx512(const float* scores, float max, int64_t block,
                                                                   float* w) {
  const __m512 vmax = _mm512_set1_ps(max), floor = _mm512_set1_ps(kNegligibleExponent);
  for (int64_t t = 0; t < block; t += 16) {
    const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(scores + t), vmax);
    const __mmask16 kept = _mm512_cmp_ps_mask(x, floor, _CMP_GE_OQ);  // false for -inf and NaN, as x >= -60
    _mm512_storeu_ps(w + t, _mm512_maskz_mov_ps(kept, specdec::exp_poly16(_mm512_maskz_mov_ps(kept, x))));
  }
}

__attribute__((target("avx512f"))) inline void widen_avx512(const c10::BFloat16* rows, int64_t count, int64_t stride,
                                                           int64_t dim, float* out) {
  for (int64_t t = 0; t < count; ++t) {  // bf16 -> fp32 is exact: the bits moved up 16 places
    const uint16_t* row = reinterpret_cast<const uint16_t*>(rows + t * stride);
    for (int64_t d = 0; d < dim; d += 16) {
      const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + d)));
      _mm512_storeu_ps(out + t * dim + d, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
    }
  }
}

// out[r] += rescale[r] * sum_t w[r][t] v[t] for R rows and kDim outputs, 64 outputs at a time in
// 4 registers per row: each output's terms in key order (mul then add), as the scalar loop sums
// them, and each value register loaded once for all R rows. Rows whose rescale is 0 are not touched.
// The first 64 outputs' pass also sums each row's weights in key order (sums[r], every lane the
// scalar loop's chain), where the weight is already in a register.
template <int kDim, int R>
__attribute__((target("avx512f"))) void weighted_values_tile_avx512(const float* const* w, const float* values,
                                                                    int64_t block, const float* rescale,
                                                                    float* const* outs, float* sums) {
  static_assert(kDim % 64 == 0, "64 outputs at a time");
  for (int d0 = 0; d0 < kDim; d0 += 64) {
    __m512 acc[R][4], sum[R];
    for (int r = 0; r < R; ++r) {
      sum[r] = _mm512_setzero_ps();
      for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_setzero_ps();
    }
    for (int64_t t = 0; t < block; ++t) {
      const float* v = values + t * kDim + d0;
      const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16), v2 = _mm512_loadu_ps(v + 32),
                   v3 = _mm512_loadu_ps(v + 48);
      for (int r = 0; r < R; ++r) {
        const __m512 wt = _mm512_set1_ps(w[r][t]);
        if (d0 == 0) sum[r] = _mm512_add_ps(sum[r], wt);
        acc[r][0] = _mm512_add_ps(acc[r][0], _mm512_mul_ps(wt, v0));
        acc[r][1] = _mm512_add_ps(acc[r][1], _mm512_mul_ps(wt, v1));
        acc[r][2] = _mm512_add_ps(acc[r][2], _mm512_mul_ps(wt, v2));
        acc[r][3] = _mm512_add_ps(acc[r][3], _mm512_mul_ps(wt, v3));
      }
    }
    if (d0 == 0)
      for (int r = 0; r < R; ++r) sums[r] = _mm512_cvtss_f32(sum[r]);
    for (int r = 0; r < R; ++r) {
      if (rescale[r] == 0.f) continue;
      const __m512 scale = _mm512_set1_ps(rescale[r]);
      for (int i = 0; i < 4; ++i) {
        float* o = outs[r] + d0 + 16 * i;
        _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), _mm512_mul_ps(acc[r][i], scale)));
      }
    }
  }
}

// dot() of one query with 4 consecutive keys (stride kDim) in AVX2, each with exactly dot()'s
// operations: lanes 0-7 and 8-15 of a key in two registers (mul then add, no FMA), then dot()'s tree
// level by level for the 4 keys at once: l + 8 is the two registers' sum, l + 4 the 128-bit halves
// of two keys side by side, l + 2 and l + 1 shuffles within them. Why: dot4's tree, as GCC
// compiles it for AVX2, is mostly scalar adds. The same bits on every CPU (tests compare the paths).
template <int kDim>
__attribute__((target("avx2"))) void dots4_avx2(const float* q, const float* k, float* out) {
  static_assert(kDim % kLanes == 0 && kLanes == 16, "dots4 needs whole 16-lane chunks");
  __m256 lo[4], hi[4];
  for (int j = 0; j < 4; ++j) lo[j] = hi[j] = _mm256_setzero_ps();
  for (int d = 0; d < kDim; d += kLanes) {
    const __m256 q0 = _mm256_loadu_ps(q + d), q1 = _mm256_loadu_ps(q + d + 8);
    for (int j = 0; j < 4; ++j) {
      lo[j] = _mm256_add_ps(lo[j], _mm256_mul_ps(q0, _mm256_loadu_ps(k + j * kDim + d)));
      hi[j] = _mm256_add_ps(hi[j], _mm256_mul_ps(q1, _mm256_loadu_ps(k + j * kDim + d + 8)));
    }
  }
  __m256 s[4];  // l + 8: lanes 0-7 of each key
  for (int j = 0; j < 4; ++j) s[j] = _mm256_add_ps(lo[j], hi[j]);
  // l + 4: [key 0's four sums | key 1's], [key 2's | key 3's]
  const __m256 t01 = _mm256_add_ps(_mm256_permute2f128_ps(s[0], s[1], 0x20), _mm256_permute2f128_ps(s[0], s[1], 0x31));
  const __m256 t23 = _mm256_add_ps(_mm256_permute2f128_ps(s[2], s[3], 0x20), _mm256_permute2f128_ps(s[2], s[3], 0x31));
  // l + 2: [key 0: two sums, key 2: two sums | key 1: two, key 3: two]
  const __m256 u = _mm256_add_ps(_mm256_shuffle_ps(t01, t23, 0x44), _mm256_shuffle_ps(t01, t23, 0xEE));
  // l + 1: [key 0, key 2, key 0, key 2 | key 1, key 3, key 1, key 3]
  const __m256 w = _mm256_add_ps(_mm256_shuffle_ps(u, u, 0x88), _mm256_shuffle_ps(u, u, 0xDD));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, w);
  out[0] = lanes[0];
  out[1] = lanes[4];
  out[2] = lanes[1];
  out[3] = lanes[5];
}

using specdec::has_avx2;  // cpu_paths.h: the CPU's paths, lowered by ONEDNN_MAX_CPU_ISA
using specdec::has_avx512;
#define SPECDEC_X86_VECTOR 1
#endif

#ifdef SPECDEC_X86_VECTOR
// The weights of a block, w[t] = x >= -60 ? e^x : 0 for x = score - max, 8 lanes at a time.
__attribute__((target("avx2"))) void block_weights_avx2(const float* scores, float max, int64_t block, float* w) {
  const __m256 vmax = _mm256_set1_ps(max), floor = _mm256_set1_ps(kNegligibleExponent);
  for (int64_t t = 0; t < block; t += 8) {
    const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(scores + t), vmax);
    const __m256 kept = _mm256_cmp_ps(x, floor, _CMP_GE_OQ);  // false for -inf and NaN, as x >= -60
    const __m256 e = specdec::exp_poly8(_mm256_and_ps(kept, x));  // 0 where not kept, as the scalar form
    _mm256_storeu_ps(w + t, _mm256_and_ps(kept, e));
  }
}

// The scores of one row's block scaled, masked keys -inf (bias != 0; none when bias is null), and
// their max (s > m ? s : m per lane, then across lanes: the scalar loop's max, NaN never taken).
__attribute__((target("avx2"))) float scale_mask_max_avx2(float* scores, int64_t block, float scale,
                                                          const float* bias) {
  const __m256 vscale = _mm256_set1_ps(scale), minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 top = minus_inf;
  for (int64_t t = 0; t < block; t += 8) {
    __m256 s = _mm256_mul_ps(_mm256_loadu_ps(scores + t), vscale);
    if (bias) s = _mm256_blendv_ps(minus_inf, s, _mm256_cmp_ps(_mm256_loadu_ps(bias + t), _mm256_setzero_ps(), _CMP_EQ_OQ));
    _mm256_storeu_ps(scores + t, s);
    top = _mm256_blendv_ps(top, s, _mm256_cmp_ps(s, top, _CMP_GT_OQ));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  float m = lanes[0];
  for (int l = 1; l < 8; ++l) m = lanes[l] > m ? lanes[l] : m;
  return m;
}

__attribute__((target("avx2"))) void widen_avx2(const c10::BFloat16* rows, int64_t count, int64_t stride,
                                               int64_t dim, float* out) {
  for (int64_t t = 0; t < count; ++t) {  // bf16 -> fp32 is exact: the bits moved up 16 places
    const uint16_t* row = reinterpret_cast<const uint16_t*>(rows + t * stride);
    for (int64_t d = 0; d < dim; d += 8) {
      const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d)));
      _mm256_storeu_ps(out + t * dim + d, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
    }
  }
}

// weighted_values_tile_avx512's steps in AVX2: R rows x 32 outputs in 4 registers per row (16 ymm
// registers hold 2 rows' 8 sums, their weights and sums, and a value), each value loaded once for
// both rows; each output's terms in key order, mul then add; the first pass sums the weights too.
template <int kDim, int R>
__attribute__((target("avx2"))) void weighted_values_tile_avx2(const float* const* w, const float* values,
                                                              int64_t block, const float* rescale,
                                                              float* const* outs, float* sums) {
  static_assert(kDim % 32 == 0 && R <= 2, "32 outputs at a time, at most 2 rows");
  for (int d0 = 0; d0 < kDim; d0 += 32) {
    __m256 acc[R][4], sum[R];
    for (int r = 0; r < R; ++r) {
      sum[r] = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_setzero_ps();
    }
    for (int64_t t = 0; t < block; ++t) {
      const float* v = values + t * kDim + d0;
      __m256 wt[R];
      for (int r = 0; r < R; ++r) {
        wt[r] = _mm256_set1_ps(w[r][t]);
        if (d0 == 0) sum[r] = _mm256_add_ps(sum[r], wt[r]);
      }
      for (int i = 0; i < 4; ++i) {
        const __m256 vi = _mm256_loadu_ps(v + 8 * i);
        for (int r = 0; r < R; ++r) acc[r][i] = _mm256_add_ps(acc[r][i], _mm256_mul_ps(wt[r], vi));
      }
    }
    if (d0 == 0)
      for (int r = 0; r < R; ++r) sums[r] = _mm256_cvtss_f32(sum[r]);
    for (int r = 0; r < R; ++r) {
      if (rescale[r] == 0.f) continue;
      const __m256 scale = _mm256_set1_ps(rescale[r]);
      for (int i = 0; i < 4; ++i) {
        float* o = outs[r] + d0 + 8 * i;
        _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), _mm256_mul_ps(acc[r][i], scale)));
      }
    }
  }
}
#endif

constexpr int kTileRows = 32;  // query rows attended together

// A block of an fp32 cache whose key (or value) rows are contiguous is read where it lies; other
// blocks (bf16, or strided) are converted into scratch: the same floats either way. Why: copying
// every block once per tile moved ~10 MB per layer at 800 cached tokens, as much time as the
// arithmetic of a 1-token step (docs/history.md, "Attention in registers").
inline const float* in_place(const float* rows, int64_t stride, int64_t dim) { return stride == dim ? rows : nullptr; }
inline const float* in_place(const c10::BFloat16*, int64_t, int64_t) { return nullptr; }

// A block that cannot be read in place, into fp32 scratch: strided fp32 rows copied as they are (the
// same for every step set), bf16 rows widened by the step set's own loop.
template <typename Steps>
void to_scratch(const float* rows, int64_t count, int64_t stride, int64_t dim, float* out) {
  for (int64_t t = 0; t < count; ++t) std::memcpy(out + t * dim, rows + t * stride, dim * sizeof(float));
}
template <typename Steps>
void to_scratch(const c10::BFloat16* rows, int64_t count, int64_t stride, int64_t dim, float* out) {
  Steps::widen(rows, count, stride, dim, out);
}

// Where the rows of a tile find their keys. Block j < shared_blocks is the same for every row (a
// chain's keys, or the cached prefix every node of a tree sees whole: read in place, all visible);
// block j >= shared_blocks comes from the row's own keys (a tree node's tail: the prefix's last
// partial block and its path), masked by the row's bias. A chain has no shared blocks: every row
// points at the same keys, and its bias masks the future.
template <typename T>
struct KeyBlocks {
  const T* shared_keys;
  const T* shared_values;
  int64_t shared_key_stride, shared_value_stride, shared_blocks;
  const T* const* row_keys;    // [rows] the row's own blocks
  const T* const* row_values;  // [rows]
  int64_t key_stride, value_stride;
  const float* const* biases;  // [rows] the row's own blocks: [nb, blk] with a stride per block
  int64_t bias_block_stride;

  const T* keys(int r, int64_t j, int64_t block) const {
    return j < shared_blocks ? shared_keys + j * block * shared_key_stride
                             : row_keys[r] + (j - shared_blocks) * block * key_stride;
  }
  const T* values(int r, int64_t j, int64_t block) const {
    return j < shared_blocks ? shared_values + j * block * shared_value_stride
                             : row_values[r] + (j - shared_blocks) * block * value_stride;
  }
  int64_t key_row_stride(int64_t j) const { return j < shared_blocks ? shared_key_stride : key_stride; }
  int64_t value_row_stride(int64_t j) const { return j < shared_blocks ? shared_value_stride : value_stride; }
  // Key t of block j is visible to row r: the bias is 0 (a shared block is visible whole).
  bool visible(int r, int64_t j, int64_t t) const {
    return j < shared_blocks || biases[r][(j - shared_blocks) * bias_block_stride + t] == 0.f;
  }
};

// The steps of attend_rows one lane at a time: the reference that the vector steps below repeat
// bit for bit, and the path of CPUs without AVX2 (and of head sizes other than 64 and 128).
struct ScalarSteps {
  static constexpr int kScoreRows = 1, kValueRows = 1;
  // Row q[0]'s dots with the block's keys, 4 keys at a time where kDim allows (independent chains).
  template <int kDim>
  static void scores(const float* const* q, int, const float* keys, int64_t block, int64_t dim, float* const* rows_out) {
    int64_t t = 0;
    if constexpr (kDim > 0 && kDim % kLanes == 0)
      for (; t + 4 <= block; t += 4) dot4<kDim>(q[0], keys + t * kDim, rows_out[0] + t);
    for (; t < block; ++t) rows_out[0][t] = dot(q[0], keys + t * dim, dim);
  }
  // The block's scores scaled, masked keys (bias != 0; none when bias is null) -inf, and their max.
  static float scale_mask_max(float* scores, int64_t block, float scale, const float* bias) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < block; ++t) {
      scores[t] = bias == nullptr || bias[t] == 0.f ? scores[t] * scale : -std::numeric_limits<float>::infinity();
      m = scores[t] > m ? scores[t] : m;
    }
    return m;
  }
  // w[t] = e^(score - max), exactly 0 below e^-60 of the block's max (masked keys, -inf, among them).
  static void weights(const float* scores, float max, int64_t block, float* w) {
#pragma omp simd
    for (int64_t t = 0; t < block; ++t) {  // elementwise: vector lanes round like scalar code
      const float x = scores[t] - max;
      w[t] = x >= kNegligibleExponent ? specdec::exp_poly(x >= kNegligibleExponent ? x : 0.f) : 0.f;
    }
  }
  static void widen(const c10::BFloat16* rows, int64_t count, int64_t stride, int64_t dim, float* out) {
    for (int64_t t = 0; t < count; ++t)
      for (int64_t d = 0; d < dim; ++d) out[t * dim + d] = static_cast<float>(rows[t * stride + d]);
  }
  // outs[0] += rescale * sum_t w[t] v[t], each output's terms in key order (mul then add; zero weights
  // add 0), and sums[0] = the weights' sum in key order. Every output has its own chain, so 64 at a
  // time (kDim known) run 4 chains of 16 lanes side by side; each output's order is the same either way.
  template <int kDim>
  static void weighted_values(const float* const* weights, int, const float* values, int64_t block, int64_t dim,
                              const float* rescale, float* const* outs, float* sums) {
    const float* w = weights[0];
    float* out = outs[0];
    float sum = 0.f;
    for (int64_t t = 0; t < block; ++t) sum = sum + w[t];
    sums[0] = sum;
    if (rescale[0] == 0.f) return;
    int64_t d0 = 0;
    if constexpr (kDim > 0 && kDim % (4 * kLanes) == 0) {
      for (; d0 < dim; d0 += 4 * kLanes) {
        float acc[4 * kLanes];
        for (int l = 0; l < 4 * kLanes; ++l) acc[l] = 0.f;
        for (int64_t t = 0; t < block; ++t)
          for (int l = 0; l < 4 * kLanes; ++l) acc[l] = acc[l] + w[t] * values[t * dim + d0 + l];
        for (int l = 0; l < 4 * kLanes; ++l) out[d0 + l] = out[d0 + l] + acc[l] * rescale[0];
      }
    }
    for (; d0 < dim; d0 += kLanes) {
      const int64_t n = dim - d0 < kLanes ? dim - d0 : kLanes;
      float acc[kLanes] = {0};
      for (int64_t t = 0; t < block; ++t)
        for (int64_t l = 0; l < n; ++l) acc[l] = acc[l] + w[t] * values[t * dim + d0 + l];
      for (int64_t l = 0; l < n; ++l) out[d0 + l] = out[d0 + l] + acc[l] * rescale[0];
    }
  }
};

#ifdef SPECDEC_X86_VECTOR
// The vector steps of attend_rows, per instruction set. kScoreRows and kValueRows: how many
// rows share each key (value) load at most; a run of rows goes in tiles of that many, then halves.
struct Avx512Steps {
  static constexpr int kScoreRows = 4, kValueRows = 4;
  template <int kDim>
  __attribute__((target("avx512f"))) static void scores(const float* const* q, int R, const float* keys,
                                                       int64_t block, int64_t, float* const* rows_out) {
    const int J = 16 / R;
    for (int64_t t = 0; t < block; t += J) {
      float* out[4];
      for (int r = 0; r < R; ++r) out[r] = rows_out[r] + t;
      const float* k = keys + t * kDim;
      if (R == 4) dots_tile_avx512<kDim, 4>(q, k, out);
      else if (R == 2) dots_tile_avx512<kDim, 2>(q, k, out);
      else dots_tile_avx512<kDim, 1>(q, k, out);
    }
  }
  template <int kDim>
  static void weighted_values(const float* const* w, int R, const float* values, int64_t block, int64_t,
                              const float* rescale, float* const* outs, float* sums) {
    if (R == 4) weighted_values_tile_avx512<kDim, 4>(w, values, block, rescale, outs, sums);
    else if (R == 2) weighted_values_tile_avx512<kDim, 2>(w, values, block, rescale, outs, sums);
    else weighted_values_tile_avx512<kDim, 1>(w, values, block, rescale, outs, sums);
  }
  static float scale_mask_max(float* scores, int64_t block, float scale, const float* bias) {
    return scale_mask_max_avx512(scores, block, scale, bias);
  }
  static void weights(const float* scores, float max, int64_t block, float* w) { block_weights_avx512(scores, max, block, w); }
  static void widen(const c10::BFloat16* rows, int64_t count, int64_t stride, int64_t dim, float* out) {
    widen_avx512(rows, count, stride, dim, out);
  }
};

// AVX2 has 16 registers: one row's dots of 4 keys at a time (dots4_avx2), 2 rows' weighted values.
struct Avx2Steps {
  static constexpr int kScoreRows = 1, kValueRows = 2;
  template <int kDim>
  static void scores(const float* const* q, int, const float* keys, int64_t block, int64_t, float* const* rows_out) {
    for (int64_t t = 0; t < block; t += 4) dots4_avx2<kDim>(q[0], keys + t * kDim, rows_out[0] + t);
  }
  template <int kDim>
  static void weighted_values(const float* const* w, int R, const float* values, int64_t block, int64_t,
                              const float* rescale, float* const* outs, float* sums) {
    if (R == 2) weighted_values_tile_avx2<kDim, 2>(w, values, block, rescale, outs, sums);
    else weighted_values_tile_avx2<kDim, 1>(w, values, block, rescale, outs, sums);
  }
  static float scale_mask_max(float* scores, int64_t block, float scale, const float* bias) {
    return scale_mask_max_avx2(scores, block, scale, bias);
  }
  static void weights(const float* scores, float max, int64_t block, float* w) { block_weights_avx2(scores, max, block, w); }
  static void widen(const c10::BFloat16* rows, int64_t count, int64_t stride, int64_t dim, float* out) {
    widen_avx2(rows, count, stride, dim, out);
  }
};

#endif

// The largest tile of at most `most` rows (4, 2 or 1) that fits in `left` rows.
inline int tile_rows(int left, int most) { return left >= 4 && most >= 4 ? 4 : left >= 2 && most >= 2 ? 2 : 1; }

// R query rows against their keys, by one set of steps (ScalarSteps, Avx2Steps, Avx512Steps). Rows
// that read the same block (a run of equal pointers: all of a chain's rows, every tree node's rows in
// the shared blocks, one node's rows in its own) convert its keys and values to fp32 once (into
// `keys32`, `values32`), and the vector steps score and weigh them in tiles of rows (AVX-512: 4 rows
// x 4 keys, then 2 x 8, 1 x 16; values 4 rows at a time), so each key and value is loaded once per
// tile instead of once per row. Every row's operations are ScalarSteps' own, in its order (the tests
// compare the step sets): only which rows share a load changes, so every row's result is the same
// as alone (batch invariance). kDim > 0 fixes the head size at compile time (64, 128: the loops
// unroll into registers); 0 takes it at run time. The vector steps need block % 16 == 0, kDim 64 or 128.
template <typename Steps, typename T, int kDim>
void attend_rows(const float* const* queries, int rows, const KeyBlocks<T>& source, int64_t blocks, int64_t block,
                 int64_t runtime_dim, float scale, float* scratch, float* const* outs) {
  const int64_t dim = kDim > 0 ? kDim : runtime_dim;
  const float floor = std::numeric_limits<float>::lowest();
  const int64_t S = blocks * block;
  float* keys32 = scratch;                         // [blk, dim]
  float* values32 = keys32 + block * dim;          // [blk, dim]
  float* scores = values32 + block * dim;          // [rows, S]
  float* block_max = scores + rows * S;            // [rows, nb]
  float* weights = block_max + rows * blocks;      // [rows, blk]
  float overall[kTileRows];
  for (int r = 0; r < rows; ++r) overall[r] = floor;
  for (int64_t j = 0; j < blocks; ++j) {
    for (int first = 0, last; first < rows; first = last) {  // a run of rows reading the same block
      const T* block_keys = source.keys(first, j, block);
      for (last = first + 1; last < rows && source.keys(last, j, block) == block_keys; ++last) {}
      const bool shared = j < source.shared_blocks;
      bool any = shared;
      for (int r = first; r < last && !any; ++r)
        for (int64_t t = 0; t < block && !any; ++t) any |= source.visible(r, j, t);
      if (!any) {  // no row of the run sees a key here: every score -inf
        for (int r = first; r < last; ++r) {
          std::fill_n(scores + r * S + j * block, block, -std::numeric_limits<float>::infinity());
          block_max[r * blocks + j] = floor;  // so its weights are 0
        }
        continue;
      }
      const float* block_keys32 = in_place(block_keys, source.key_row_stride(j), dim);
      if (block_keys32 == nullptr) {
        to_scratch<Steps>(block_keys, block, source.key_row_stride(j), dim, keys32);
        block_keys32 = keys32;
      }
      for (int r0 = first; r0 < last;) {
        const int R = tile_rows(last - r0, Steps::kScoreRows);
        float* rows_out[4];
        for (int r = 0; r < R; ++r) rows_out[r] = scores + (r0 + r) * S + j * block;
        Steps::template scores<kDim>(queries + r0, R, block_keys32, block, dim, rows_out);
        r0 += R;
      }
      for (int r = first; r < last; ++r) {
        const float* bias = shared ? nullptr : source.biases[r] + (j - source.shared_blocks) * source.bias_block_stride;
        const float m = Steps::scale_mask_max(scores + r * S + j * block, block, scale, bias);
        block_max[r * blocks + j] = m > floor ? m : floor;  // all masked: floor, so its weights are 0
        overall[r] = block_max[r * blocks + j] > overall[r] ? block_max[r * blocks + j] : overall[r];
      }
    }
  }
  float total[kTileRows];
  for (int r = 0; r < rows; ++r) {
    total[r] = 0.f;
    for (int64_t d = 0; d < dim; ++d) outs[r][d] = 0.f;
  }
  for (int64_t j = 0; j < blocks; ++j) {
    float rescale[kTileRows];
    for (int r = 0; r < rows; ++r) {
      const float x = block_max[r * blocks + j] - overall[r];
      rescale[r] = x >= kNegligibleExponent ? specdec::exp_poly(x) : 0.f;  // all-masked blocks among the 0s
    }
    for (int first = 0, last; first < rows; first = last) {
      const T* block_values = source.values(first, j, block);
      for (last = first + 1; last < rows && source.values(last, j, block) == block_values; ++last) {}
      bool any = false;
      for (int r = first; r < last; ++r) any |= rescale[r] != 0.f;
      if (!any) continue;  // a block of weight exactly 0 for every row is skipped, as in the PyTorch form
      const float* block_values32 = in_place(block_values, source.value_row_stride(j), dim);
      if (block_values32 == nullptr) {
        to_scratch<Steps>(block_values, block, source.value_row_stride(j), dim, values32);
        block_values32 = values32;
      }
      const float* row_weights[kTileRows];
      for (int r = first; r < last; ++r) {
        float* w = weights + r * block;
        row_weights[r] = w;
        if (rescale[r] == 0.f) {  // left out of the sums; its weighted values are not added
          std::fill_n(w, block, 0.f);
          continue;
        }
        Steps::weights(scores + r * S + j * block, block_max[r * blocks + j], block, w);
      }
      float sums[kTileRows];  // each row's weights summed in key order, by the value tiles' first pass
      for (int r0 = first; r0 < last;) {
        const int R = tile_rows(last - r0, Steps::kValueRows);
        Steps::template weighted_values<kDim>(row_weights + r0, R, block_values32, block, dim, rescale + r0,
                                              outs + r0, sums + r0);
        r0 += R;
      }
      for (int r = first; r < last; ++r)
        if (rescale[r] != 0.f) total[r] = total[r] + sums[r] * rescale[r];
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int64_t d = 0; d < dim; ++d) outs[r][d] = outs[r][d] / total[r];
}

template <typename T>
void attend_tile(const float* const* queries, int rows, const KeyBlocks<T>& source, int64_t blocks, int64_t block,
                 int64_t dim, float scale, float* scratch, float* const* outs) {
  auto attend = dim == 128 ? attend_rows<ScalarSteps, T, 128> : dim == 64 ? attend_rows<ScalarSteps, T, 64>
                                                                          : attend_rows<ScalarSteps, T, 0>;
#ifdef SPECDEC_X86_VECTOR
  if (block % 16 == 0 && (dim == 128 || dim == 64)) {
    if (has_avx512()) attend = dim == 128 ? attend_rows<Avx512Steps, T, 128> : attend_rows<Avx512Steps, T, 64>;
    else if (has_avx2()) attend = dim == 128 ? attend_rows<Avx2Steps, T, 128> : attend_rows<Avx2Steps, T, 64>;
  }
#endif
  attend(queries, rows, source, blocks, block, dim, scale, scratch, outs);
}

// This thread's scratch of at least `floats` floats, kept between calls and not cleared: attend_rows
// writes every score, maximum and weight before it reads them. Why: a std::vector per task zeroed
// 116-148 KB (a memset, and past glibc's mmap threshold fresh pages from the kernel) on every call,
// a cost of the order of a one-token step's attention arithmetic.
float* thread_scratch(int64_t floats) {
  thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < floats) scratch.resize(floats);
  return scratch.data();
}

// query [B, H, Q, M, D] fp32 contiguous; keys and values [B, H, Qk, S, D] read in place (a view of the
// cache) with strides ks and vs (any, but a contiguous last dim); bias [B, 1, Q, nb, bias_rows, blk]
// fp32 contiguous, bias_rows M (padded) or 1 (broadcast); out [B, H, Q, M, D] fp32.
template <typename T>
void run(const float* q_all, int64_t B, int64_t H, int64_t Q, int64_t M, int64_t D, const T* k_all, const T* v_all,
         const int64_t* ks, const int64_t* vs, int64_t Qk, int64_t S, const float* bias_all, int64_t bias_rows,
         float* out_all, int64_t block) {
  const int64_t blocks = S / block;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const int64_t bias_block_stride = bias_rows * block;
  // Tasks: the rows of one key sequence (b, h, q), in tiles of kTileRows.
  const int64_t tiles = (M + kTileRows - 1) / kTileRows;
  at::parallel_for(0, B * H * Q * tiles, 1, [&](int64_t begin, int64_t end) {
    float* scratch = thread_scratch(2 * block * D + kTileRows * (S + blocks + block));
    for (int64_t i = begin; i < end; ++i) {
      const int64_t tile = i % tiles, q = (i / tiles) % Q, h = (i / (tiles * Q)) % H, b = i / (tiles * Q * H);
      const int64_t kq = Qk == 1 ? 0 : q;
      const T* k = k_all + b * ks[0] + h * ks[1] + kq * ks[2];
      const T* v = v_all + b * vs[0] + h * vs[1] + kq * vs[2];
      const int rows = static_cast<int>(std::min<int64_t>(kTileRows, M - tile * kTileRows));
      const float* queries[kTileRows];
      const float* biases[kTileRows];
      const T* row_keys[kTileRows];
      const T* row_values[kTileRows];
      float* outs[kTileRows];
      for (int r = 0; r < rows; ++r) {
        const int64_t m = tile * kTileRows + r, row = ((b * H + h) * Q + q) * M + m;
        queries[r] = q_all + row * D;
        outs[r] = out_all + row * D;
        biases[r] = bias_all + ((b * Q + q) * blocks * bias_rows + (bias_rows == 1 ? 0 : m)) * block;
        row_keys[r] = k;
        row_values[r] = v;
      }
      const KeyBlocks<T> source{k, v, ks[3], vs[3], 0, row_keys, row_values, ks[3], vs[3], biases, bias_block_stride};
      attend_tile(queries, rows, source, blocks, block, D, scale, scratch, outs);
    }
  });
}

at::Tensor blocked_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                             const at::Tensor& bias, int64_t block) {
  TORCH_CHECK(query.dim() == 5 && keys.dim() == 5 && values.dim() == 5 && bias.dim() == 6,
              "blocked_attention: query/keys/values [B, Hkv, Q, M|S, D], bias [B, 1, Q, nb, M'|1, blk]");
  TORCH_CHECK(keys.size(3) % block == 0 && bias.size(5) == block && bias.size(3) == keys.size(3) / block,
              "blocked_attention: keys must come in whole blocks matching the bias");
  TORCH_CHECK(bias.size(4) == 1 || bias.size(4) >= query.size(3), "blocked_attention: bias rows");
  TORCH_CHECK(keys.scalar_type() == values.scalar_type(), "blocked_attention: keys and values differ in dtype");
  const at::Tensor q = query.to(at::kFloat).contiguous();
  const at::Tensor k = keys.stride(4) == 1 ? keys : keys.contiguous();
  const at::Tensor v = values.stride(4) == 1 ? values : values.contiguous();
  const at::Tensor bias32 = bias.to(at::kFloat).contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options());
  const int64_t B = q.size(0), H = q.size(1), Q = q.size(2), M = q.size(3), D = q.size(4);
  if (k.scalar_type() == at::kBFloat16) {
    run<c10::BFloat16>(q.data_ptr<float>(), B, H, Q, M, D, k.data_ptr<c10::BFloat16>(),
                       v.data_ptr<c10::BFloat16>(), k.strides().data(), v.strides().data(), k.size(2), k.size(3),
                       bias32.data_ptr<float>(), bias32.size(4), out.data_ptr<float>(), block);
  } else {
    TORCH_CHECK(k.scalar_type() == at::kFloat, "blocked_attention: keys must be fp32 or bf16");
    run<float>(q.data_ptr<float>(), B, H, Q, M, D, k.data_ptr<float>(), v.data_ptr<float>(), k.strides().data(),
               v.strides().data(), k.size(2), k.size(3), bias32.data_ptr<float>(), bias32.size(4),
               out.data_ptr<float>(), block);
  }
  return out.to(values.scalar_type());
}

// A tree's queries: every node sees the cached prefix whole, then its own tail (the prefix's last
// partial block, its ancestors and itself, gathered in plain decoding's order and padded to whole
// blocks). The prefix's whole blocks are read in place from the cache, once per tile of rows for
// all the nodes in it, instead of gathered into a copy per node: the same keys in the same blocks,
// so the same bits as blocked_attention over each node's gathered sequence (tested).
template <typename T>
void run_tree(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& tail_keys,
              const at::Tensor& tail_values, const at::Tensor& tail_bias, int64_t shared_blocks, at::Tensor& out,
              int64_t block) {
  // query [B, Hkv, N, G, D]; keys, values [B, Hkv, S, D] (the cache); tail_* [B, Hkv, N, St, D];
  // tail_bias [B, N, nbt, blk]. Rows: the N x G queries of a kv head, node by node.
  const int64_t B = query.size(0), H = query.size(1), N = query.size(2), G = query.size(3), D = query.size(4);
  const int64_t tail_blocks = tail_keys.size(3) / block, blocks = shared_blocks + tail_blocks, S = blocks * block;
  const int64_t M = N * G, tiles = (M + kTileRows - 1) / kTileRows;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const auto ks = keys.strides(), vs = values.strides(), tks = tail_keys.strides(), tvs = tail_values.strides();
  const float* q_all = query.data_ptr<float>();
  const float* bias_all = tail_bias.data_ptr<float>();
  float* out_all = out.data_ptr<float>();
  at::parallel_for(0, B * H * tiles, 1, [&](int64_t begin, int64_t end) {
    float* scratch = thread_scratch(2 * block * D + kTileRows * (S + blocks + block));
    for (int64_t i = begin; i < end; ++i) {
      const int64_t tile = i % tiles, h = (i / tiles) % H, b = i / (tiles * H);
      const int rows = static_cast<int>(std::min<int64_t>(kTileRows, M - tile * kTileRows));
      const float* queries[kTileRows];
      const float* biases[kTileRows];
      const T* row_keys[kTileRows];
      const T* row_values[kTileRows];
      float* outs[kTileRows];
      for (int r = 0; r < rows; ++r) {
        const int64_t m = tile * kTileRows + r, node = m / G, row = (b * H + h) * M + m;
        queries[r] = q_all + row * D;
        outs[r] = out_all + row * D;
        biases[r] = bias_all + (b * N + node) * tail_blocks * block;
        row_keys[r] = tail_keys.data_ptr<T>() + b * tks[0] + h * tks[1] + node * tks[2];
        row_values[r] = tail_values.data_ptr<T>() + b * tvs[0] + h * tvs[1] + node * tvs[2];
      }
      const KeyBlocks<T> source{keys.data_ptr<T>() + b * ks[0] + h * ks[1], values.data_ptr<T>() + b * vs[0] + h * vs[1],
                                ks[2], vs[2], shared_blocks, row_keys, row_values, tks[3], tvs[3], biases, block};
      attend_tile(queries, rows, source, blocks, block, D, scale, scratch, outs);
    }
  });
}

at::Tensor tree_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                          const at::Tensor& tail_keys, const at::Tensor& tail_values, const at::Tensor& tail_bias,
                          int64_t shared_blocks, int64_t block) {
  TORCH_CHECK(query.dim() == 5 && keys.dim() == 4 && values.dim() == 4 && tail_keys.dim() == 5 &&
                  tail_values.dim() == 5 && tail_bias.dim() == 4,
              "tree_attention: query [B, Hkv, N, G, D], keys/values [B, Hkv, S, D], tail keys/values "
              "[B, Hkv, N, St, D], tail bias [B, N, nbt, blk]");
  TORCH_CHECK(shared_blocks >= 0 && keys.size(2) >= shared_blocks * block && tail_keys.size(3) % block == 0 &&
                  tail_bias.size(2) * block == tail_keys.size(3) && tail_bias.size(3) == block &&
                  tail_keys.size(2) == query.size(2) && tail_bias.size(1) == query.size(2),
              "tree_attention: the shared blocks, the tails and their bias must come in whole blocks");
  TORCH_CHECK(keys.scalar_type() == values.scalar_type() && tail_keys.scalar_type() == keys.scalar_type() &&
                  tail_values.scalar_type() == keys.scalar_type(),
              "tree_attention: keys and values differ in dtype");
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1, "tree_attention: the cache's last dim must be contiguous");
  const at::Tensor q = query.to(at::kFloat).contiguous();
  const at::Tensor tk = tail_keys.contiguous(), tv = tail_values.contiguous();
  const at::Tensor bias32 = tail_bias.to(at::kFloat).contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (keys.scalar_type() == at::kBFloat16) {
    run_tree<c10::BFloat16>(q, keys, values, tk, tv, bias32, shared_blocks, out, block);
  } else {
    TORCH_CHECK(keys.scalar_type() == at::kFloat, "tree_attention: keys must be fp32 or bf16");
    run_tree<float>(q, keys, values, tk, tv, bias32, shared_blocks, out, block);
  }
  return out.to(values.scalar_type());
}

// The instruction-set path attend_tile takes for head sizes 64 and 128 (`specdec doctor` prints it;
// the ISA tests compare the kernels each oneDNN cap runs).
std::string isa_path() {
#ifdef SPECDEC_X86_VECTOR
  if (has_avx512()) return "avx512";
  if (has_avx2()) return "avx2";
#endif
  return "scalar";
}

}  // namespace

namespace specdec {

at::Tensor chain_attention(const at::Tensor& q, const at::Tensor& cache_keys, const at::Tensor& cache_values,
                           int64_t layer, int64_t first_row, int64_t key_length, const at::Tensor& bias,
                           int64_t block) {
  TORCH_CHECK(q.dim() == 4 && q.is_contiguous() && cache_keys.dim() == 5 &&
                  cache_keys.sizes() == cache_values.sizes() &&
                  cache_keys.scalar_type() == cache_values.scalar_type() && cache_keys.stride(4) == 1 &&
                  cache_values.stride(4) == 1 && cache_keys.size(4) == q.size(3) &&
                  q.size(1) % cache_keys.size(2) == 0,
              "chain_attention: q [B, Hq, T, D] contiguous, the cache [L, rows, Hkv, S, D]");
  const int64_t B = q.size(0), heads = q.size(1), steps = q.size(2), D = q.size(3), H = cache_keys.size(2);
  const int64_t M = heads / H * steps;  // a KV head's rows: its grouped heads' tokens, head by head
  TORCH_CHECK(layer >= 0 && layer < cache_keys.size(0) && first_row >= 0 && first_row + B <= cache_keys.size(1) &&
                  key_length % block == 0 && key_length <= cache_keys.size(3),
              "chain_attention: a layer, rows and whole key blocks of the cache");
  TORCH_CHECK(bias.dim() == 6 && bias.size(0) == B && bias.size(2) == 1 && bias.size(5) == block &&
                  bias.size(3) == key_length / block && (bias.size(4) == 1 || bias.size(4) >= M),
              "chain_attention: bias [B, 1, 1, nb, rows | 1, blk]");
  // q's memory order [B, Hq, T, D] is blocked_attention's [B, Hkv, 1, M, D] (head h = kv * G + g, row
  // m = g * T + t), and so is out's: the same floats as the op on those views.
  std::vector<float> widened;
  const float* q32 = nullptr;
  if (q.scalar_type() == at::kFloat) {
    q32 = q.data_ptr<float>();
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "chain_attention: q must be fp32 or bf16");
    const c10::BFloat16* source = q.data_ptr<c10::BFloat16>();
    widened.resize(q.numel());
    for (int64_t i = 0; i < q.numel(); ++i) widened[i] = static_cast<float>(source[i]);
    q32 = widened.data();
  }
  const bool ready = bias.scalar_type() == at::kFloat && bias.is_contiguous();
  const at::Tensor bias32 = ready ? bias : bias.to(at::kFloat).contiguous();
  std::vector<float> out32(q.numel());
  const int64_t ks[4] = {cache_keys.stride(1), cache_keys.stride(2), 0, cache_keys.stride(3)};
  const int64_t vs[4] = {cache_values.stride(1), cache_values.stride(2), 0, cache_values.stride(3)};
  const int64_t at_keys = layer * cache_keys.stride(0) + first_row * cache_keys.stride(1);
  const int64_t at_values = layer * cache_values.stride(0) + first_row * cache_values.stride(1);
  at::Tensor out = at::empty({B, steps, heads * D}, q.options().dtype(cache_values.scalar_type()));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, cache_keys.scalar_type(), "chain_attention", [&] {
    if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
      run<scalar_t>(q32, B, H, 1, M, D, cache_keys.data_ptr<scalar_t>() + at_keys,
                    cache_values.data_ptr<scalar_t>() + at_values, ks, vs, 1, key_length, bias32.data_ptr<float>(),
                    bias32.size(4), out32.data(), block);
      // [B, Hq, T, D] -> [B, T, Hq * D], rounded to the cache's dtype as Tensor.to rounds.
      scalar_t* o = out.data_ptr<scalar_t>();
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t t = 0; t < steps; ++t) {
            const float* from = out32.data() + ((b * heads + h) * steps + t) * D;
            scalar_t* to = o + (b * steps + t) * heads * D + h * D;
            for (int64_t d = 0; d < D; ++d) to[d] = static_cast<scalar_t>(from[d]);
          }
    } else {
      TORCH_CHECK(false, "chain_attention: the cache must be fp32 or bf16");
    }
  });
  return out;
}

}  // namespace specdec

TORCH_LIBRARY(specdec_attention, m) {
  m.def("blocked(Tensor query, Tensor keys, Tensor values, Tensor bias, int block) -> Tensor");
  m.def("tree(Tensor query, Tensor keys, Tensor values, Tensor tail_keys, Tensor tail_values, Tensor tail_bias, "
        "int shared_blocks, int block) -> Tensor");
  m.def("isa_path() -> str");
}

TORCH_LIBRARY_IMPL(specdec_attention, CPU, m) {
  m.impl("blocked", &blocked_attention);
  m.impl("tree", &tree_attention);
}

TORCH_LIBRARY_IMPL(specdec_attention, CompositeExplicitAutograd, m) { m.impl("isa_path", &isa_path); }
