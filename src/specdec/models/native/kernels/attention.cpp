// Blocked attention for the CPU in one call per layer: the same law as attention.py's blocked_attention
// (keys in KEY_BLOCK-slot blocks aligned to position 0, each block's softmax terms against its own max,
// blocks combined in block order after rescaling to the overall max, weights below e^-60 of a block's
// max exactly 0, fully masked blocks skipped), computed query row by query row.
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
// are now written in AVX2 (the same operations per lane) and an fp32 cache is read in place.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <algorithm>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <vector>

namespace {

constexpr int kLanes = 16;
constexpr float kNegligibleExponent = -60.f;  // attention.py's NEGLIGIBLE_EXPONENT

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SPECDEC_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define SPECDEC_CLONES
#endif

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

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
// dot() of one query with 16 consecutive keys (stride kDim) in AVX-512, each with exactly dot()'s
// operations: the same 16-lane products and sums (mul then add, no FMA), then dot()'s tree, level
// by level, computed for all 16 keys at once by shuffling keys' halves side by side (lane l meets
// lane l + 8, then l + 4, l + 2, l + 1, as in dot()). Why: GCC's code for dot4 spent as much on
// the per-key tree as on the products, mostly in scalar adds; here the tree costs 15 vector adds
// per 16 keys. The same bits on every CPU (tests compare this path with the generic one).
template <int kDim>
__attribute__((target("avx512f"))) void dots16_avx512(const float* q, const float* k, float* out) {
  static_assert(kDim % kLanes == 0 && kLanes == 16, "dots16 needs whole 16-lane chunks");
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  for (int d = 0; d < kDim; d += kLanes) {
    const __m512 qv = _mm512_loadu_ps(q + d);
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_add_ps(acc[j], _mm512_mul_ps(qv, _mm512_loadu_ps(k + j * kDim + d)));
  }
  // Lanes l and l + 8 of keys 2i and 2i + 1: [key 2i's 8 sums, key 2i + 1's 8 sums].
  __m512 s8[8];
  for (int i = 0; i < 8; ++i)
    s8[i] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0x44),
                          _mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0xEE));
  // l and l + 4: 128-bit lane c of s4[m] holds key 4m + c's four sums.
  __m512 s4[4];
  for (int m = 0; m < 4; ++m)
    s4[m] = _mm512_add_ps(_mm512_shuffle_f32x4(s8[2 * m], s8[2 * m + 1], 0x88),
                          _mm512_shuffle_f32x4(s8[2 * m], s8[2 * m + 1], 0xDD));
  // l and l + 2: per 128-bit lane c, [key 8p + c: two sums, key 8p + 4 + c: two sums].
  __m512 s2[2];
  for (int p = 0; p < 2; ++p)
    s2[p] = _mm512_add_ps(_mm512_shuffle_ps(s4[2 * p], s4[2 * p + 1], 0x44),
                          _mm512_shuffle_ps(s4[2 * p], s4[2 * p + 1], 0xEE));
  // l and l + 1: per 128-bit lane c, keys c, 4 + c, 8 + c, 12 + c; back to key order.
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(s2[0], s2[1], 0x88), _mm512_shuffle_ps(s2[0], s2[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, sums));
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

// Whether ONEDNN_MAX_CPU_ISA lets this process take a path: unset, ALL, DEFAULT, or a cap that starts
// with one of `names` (that ISA or a newer one). The cap that lowers PyTorch's and w4a8's paths lowers
// these, so one machine runs (and the tests compare) every path it has.
inline bool cap_allows(std::initializer_list<const char*> names) {
  const char* cap = std::getenv("ONEDNN_MAX_CPU_ISA");
  if (cap == nullptr || std::strcmp(cap, "ALL") == 0 || std::strcmp(cap, "DEFAULT") == 0) return true;
  for (const char* name : names)
    if (std::strncmp(cap, name, std::strlen(name)) == 0) return true;
  return false;
}

inline bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && cap_allows({"AVX2", "AVX512", "AMX"});
  return yes;
}

inline bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && cap_allows({"AVX512"});
  return yes;
}
#define SPECDEC_X86_VECTOR 1
#endif

// e^x for x in [-60, 0] (all attention needs: scores minus their block's max), branch-free so the
// compiler vectorizes it: x = n ln2 + r, |r| <= ln2/2, e^r by its degree-6 Taylor polynomial
// (relative error < 2e-7, about one float ulp), times 2^n built in the exponent bits.
__attribute__((always_inline)) inline float exp_nonpositive(float x) {  // inlined: its loops vectorize
  // Round to nearest by adding and removing 1.5 * 2^23 (|x log2 e| < 2^22 here): no libm call, so
  // loops over it vectorize.
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // Cody-Waite: ln2 split in two parts
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

#ifdef SPECDEC_X86_VECTOR
// exp_nonpositive() of 8 lanes, each lane with exactly its operations in its order (mul, add, sub;
// no FMA): the same bits. And the weights of a block, w[t] = x >= -60 ? e^x : 0 for x = score - max.
// Why: GCC leaves the `omp simd` loop over exp_nonpositive scalar, with a branch per key.
__attribute__((target("avx2"))) inline __m256 exp_nonpositive8(__m256 x) {
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

__attribute__((target("avx2"))) void block_weights_avx2(const float* scores, float max, int64_t block, float* w) {
  const __m256 vmax = _mm256_set1_ps(max), floor = _mm256_set1_ps(kNegligibleExponent);
  int64_t t = 0;
  for (; t + 8 <= block; t += 8) {
    const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(scores + t), vmax);
    const __m256 kept = _mm256_cmp_ps(x, floor, _CMP_GE_OQ);  // false for -inf and NaN, as x >= -60
    const __m256 e = exp_nonpositive8(_mm256_and_ps(kept, x));  // 0 where not kept, as the scalar form
    _mm256_storeu_ps(w + t, _mm256_and_ps(kept, e));
  }
  for (; t < block; ++t) {
    const float x = scores[t] - max;
    w[t] = x >= kNegligibleExponent ? exp_nonpositive(x) : 0.f;
  }
}

// out[d] += rescale * sum_t w[t] v[t][d] for kDim outputs, 64 at a time in 8 registers, each output's
// terms in key order (mul then add): the same bits as the scalar loop, without its accumulators in memory.
template <int kDim>
__attribute__((target("avx2"))) void add_weighted_values_avx2(const float* w, const float* values, int64_t block,
                                                              float rescale, float* out) {
  static_assert(kDim % 64 == 0, "64 outputs at a time");
  const __m256 scale = _mm256_set1_ps(rescale);
  for (int d0 = 0; d0 < kDim; d0 += 64) {
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t t = 0; t < block; ++t) {
      const __m256 wt = _mm256_set1_ps(w[t]);
      const float* v = values + t * kDim + d0;
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(wt, _mm256_loadu_ps(v + 8 * i)));
    }
    for (int i = 0; i < 8; ++i) {
      float* o = out + d0 + 8 * i;
      _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), _mm256_mul_ps(acc[i], scale)));
    }
  }
}
#endif

constexpr int kTileRows = 32;  // query rows attended together

// A block of an fp32 cache whose key (or value) rows are contiguous is read where it lies; other
// blocks (bf16, or strided) are converted into scratch: the same floats either way. Why: copying
// every block once per tile moved ~10 MB per layer at 800 cached tokens, as much time as the
// arithmetic of a 1-token step (benchmarks/RESULTS.md, "Attention in registers").
inline const float* in_place(const float* rows, int64_t stride, int64_t dim) { return stride == dim ? rows : nullptr; }
inline const float* in_place(const c10::BFloat16*, int64_t, int64_t) { return nullptr; }

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

// R query rows against their keys. Rows that read the same block (a run of equal pointers: all of a
// chain's rows, every tree node's rows in the shared blocks, one node's rows in its own) convert its
// keys and values to fp32 once (into `keys32`, `values32`); every row's arithmetic is the same as
// alone (batch invariance). kDim > 0 fixes the head size at compile time (64, 128: the loops unroll
// into registers); 0 takes it at run time.
template <typename T, int kDim>
SPECDEC_CLONES void attend_rows(const float* const* queries, int rows, const KeyBlocks<T>& source,
                                int64_t blocks, int64_t block, int64_t runtime_dim, float scale, float* scratch,
                                float* const* outs) {
  const int64_t dim = kDim > 0 ? kDim : runtime_dim;
  const float floor = std::numeric_limits<float>::lowest();
  const float minus_inf = -std::numeric_limits<float>::infinity();
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
      const float* block_keys32 = in_place(block_keys, source.key_row_stride(j), dim);
      if (block_keys32 == nullptr) {
        bool any = false;
        for (int r = first; r < last; ++r)
          for (int64_t t = 0; t < block; ++t) any |= source.visible(r, j, t);
        if (any) {
          const int64_t stride = source.key_row_stride(j);
          for (int64_t t = 0; t < block; ++t) {
            const T* k = block_keys + t * stride;
            for (int64_t d = 0; d < dim; ++d) keys32[t * dim + d] = to_float(k[d]);
          }
        }
        block_keys32 = keys32;
      }
      for (int r = first; r < last; ++r) {
        float* row_scores = scores + r * S + j * block;
        float m = minus_inf;
        int64_t t = 0;
        // Scores of keys t.. from `count` dot products, masked keys -inf.
        auto keep = [&](const float* dots, int count) {
          for (int i = 0; i < count; ++i) row_scores[t + i] = source.visible(r, j, t + i) ? dots[i] * scale : minus_inf;
        };
        if constexpr (kDim > 0 && kDim % kLanes == 0) {  // several keys at a time, each with dot()'s bits
          float dots[16];
#ifdef SPECDEC_X86_VECTOR
          if (has_avx512()) {
            for (; t + 16 <= block; t += 16) {
              dots16_avx512<kDim>(queries[r], block_keys32 + t * dim, dots);
              keep(dots, 16);
            }
          } else if (has_avx2()) {
            for (; t + 4 <= block; t += 4) {
              dots4_avx2<kDim>(queries[r], block_keys32 + t * dim, dots);
              keep(dots, 4);
            }
          }
#endif
          for (; t + 4 <= block; t += 4) {  // independent chains
            dot4<kDim>(queries[r], block_keys32 + t * dim, dots);
            keep(dots, 4);
          }
        }
        for (; t < block; ++t)
          row_scores[t] = source.visible(r, j, t) ? dot(queries[r], block_keys32 + t * dim, dim) * scale : minus_inf;
        for (t = 0; t < block; ++t) m = row_scores[t] > m ? row_scores[t] : m;
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
      rescale[r] = x >= kNegligibleExponent ? exp_nonpositive(x) : 0.f;  // all-masked blocks among the 0s
    }
    for (int first = 0, last; first < rows; first = last) {
      const T* block_values = source.values(first, j, block);
      for (last = first + 1; last < rows && source.values(last, j, block) == block_values; ++last) {}
      bool any = false;
      for (int r = first; r < last; ++r) any |= rescale[r] != 0.f;
      if (!any) continue;  // a block of weight exactly 0 for every row is skipped, as in the PyTorch form
      const float* block_values32 = in_place(block_values, source.value_row_stride(j), dim);
      if (block_values32 == nullptr) {
        const int64_t stride = source.value_row_stride(j);
        for (int64_t t = 0; t < block; ++t) {
          const T* v = block_values + t * stride;
          for (int64_t d = 0; d < dim; ++d) values32[t * dim + d] = to_float(v[d]);
        }
        block_values32 = values32;
      }
      for (int r = first; r < last; ++r) {
        if (rescale[r] == 0.f) continue;
        // Weights below e^-60 of the block's max, masked keys (-inf) among them, are exactly 0.
        const float* row_scores = scores + r * S + j * block;
        float* w = weights + r * block;
        float sum = 0.f;
        const float max = block_max[r * blocks + j];
#ifdef SPECDEC_X86_VECTOR
        if (has_avx2()) {
          block_weights_avx2(row_scores, max, block, w);
        } else
#endif
        {
#pragma omp simd
          for (int64_t t = 0; t < block; ++t) {  // elementwise: vector lanes round like scalar code
            const float x = row_scores[t] - max;
            w[t] = x >= kNegligibleExponent ? exp_nonpositive(x >= kNegligibleExponent ? x : 0.f) : 0.f;
          }
        }
        for (int64_t t = 0; t < block; ++t) sum = sum + w[t];
        total[r] = total[r] + sum * rescale[r];
        // out += rescale * sum_t w[t] v[t], each output's keys in order (zero weights add 0). Every
        // output has its own chain, so 64 outputs at a time (kDim known) run 4 chains of 16 lanes
        // side by side; the order of each output's sum is the same either way.
        int64_t d0 = 0;
#ifdef SPECDEC_X86_VECTOR
        if constexpr (kDim > 0 && kDim % (4 * kLanes) == 0) {
          if (has_avx2()) {
            add_weighted_values_avx2<kDim>(w, block_values32, block, rescale[r], outs[r]);
            d0 = dim;
          }
        }
#endif
        if constexpr (kDim > 0 && kDim % (4 * kLanes) == 0) {
          for (; d0 < dim; d0 += 4 * kLanes) {
            float acc[4 * kLanes];
            for (int l = 0; l < 4 * kLanes; ++l) acc[l] = 0.f;
            for (int64_t t = 0; t < block; ++t)
              for (int l = 0; l < 4 * kLanes; ++l) acc[l] = acc[l] + w[t] * block_values32[t * dim + d0 + l];
            for (int l = 0; l < 4 * kLanes; ++l) outs[r][d0 + l] = outs[r][d0 + l] + acc[l] * rescale[r];
          }
        }
        for (; d0 < dim; d0 += kLanes) {
          const int64_t n = dim - d0 < kLanes ? dim - d0 : kLanes;
          float acc[kLanes] = {0};
          for (int64_t t = 0; t < block; ++t)
            for (int64_t l = 0; l < n; ++l) acc[l] = acc[l] + w[t] * block_values32[t * dim + d0 + l];
          for (int64_t l = 0; l < n; ++l) outs[r][d0 + l] = outs[r][d0 + l] + acc[l] * rescale[r];
        }
      }
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int64_t d = 0; d < dim; ++d) outs[r][d] = outs[r][d] / total[r];
}

template <typename T>
void attend_tile(const float* const* queries, int rows, const KeyBlocks<T>& source, int64_t blocks, int64_t block,
                 int64_t dim, float scale, float* scratch, float* const* outs) {
  auto attend = dim == 128 ? attend_rows<T, 128> : dim == 64 ? attend_rows<T, 64> : attend_rows<T, 0>;
  attend(queries, rows, source, blocks, block, dim, scale, scratch, outs);
}

template <typename T>
void run(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& bias,
         at::Tensor& out, int64_t block) {
  const int64_t B = query.size(0), H = query.size(1), Q = query.size(2), M = query.size(3), D = query.size(4);
  const int64_t Qk = keys.size(2), S = keys.size(3), blocks = S / block;
  const int64_t bias_rows = bias.size(4);  // M (padded) or 1 (broadcast)
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const float* q_all = query.data_ptr<float>();
  const T* k_all = keys.data_ptr<T>();
  const T* v_all = values.data_ptr<T>();
  const float* bias_all = bias.data_ptr<float>();
  float* out_all = out.data_ptr<float>();
  // keys and values are read in place (a view of the cache): any strides but a contiguous last dim.
  const auto ks = keys.strides(), vs = values.strides();
  const int64_t bias_block_stride = bias_rows * block;  // bias [B, 1, Q, nb, rows, blk], contiguous
  // Tasks: the rows of one key sequence (b, h, q), in tiles of kTileRows.
  const int64_t tiles = (M + kTileRows - 1) / kTileRows;
  at::parallel_for(0, B * H * Q * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(2 * block * D + kTileRows * (S + blocks + block));
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
      attend_tile(queries, rows, source, blocks, block, D, scale, scratch.data(), outs);
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
  if (k.scalar_type() == at::kBFloat16) {
    run<c10::BFloat16>(q, k, v, bias32, out, block);
  } else {
    TORCH_CHECK(k.scalar_type() == at::kFloat, "blocked_attention: keys must be fp32 or bf16");
    run<float>(q, k, v, bias32, out, block);
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
    std::vector<float> scratch(2 * block * D + kTileRows * (S + blocks + block));
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
      attend_tile(queries, rows, source, blocks, block, D, scale, scratch.data(), outs);
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

}  // namespace

TORCH_LIBRARY(specdec_attention, m) {
  m.def("blocked(Tensor query, Tensor keys, Tensor values, Tensor bias, int block) -> Tensor");
  m.def("tree(Tensor query, Tensor keys, Tensor values, Tensor tail_keys, Tensor tail_values, Tensor tail_bias, "
        "int shared_blocks, int block) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec_attention, CPU, m) {
  m.impl("blocked", &blocked_attention);
  m.impl("tree", &tree_attention);
}
