// w4a8: 4-bit weights x int8 activations with exact int32 group sums, for the native decoder's projections.
//
// Why hand-written (measured on a 2-core AVX512-BF16 EPYC, benchmarks/native_kernels.py): PyTorch's
// own 4-bit CPU kernels dequantize per row of activations (_weight_int4pack_mm_for_cpu: verifying
// 5 tokens costs 3x one token), _dyn_quant_matmul_4bit stores fp32 weights on x86, and torchao's
// PyPI wheels carry no CPU low-bit kernels. Verification needs the opposite: a cost that stays flat
// from 1 to 16 rows, so every weight is unpacked once per call and used by every row.
// Measured against the maintained kernels on a 2-core Sapphire Rapids-class Xeon (VNNI path, 2
// threads, benchmarks/kernel_peers.py; docs/history.md, "specdec's w4a8 next to torch's int4
// kernel and llama.cpp's repacked Q4_K"): fewer milliseconds than torch's int4 kernel and than
// llama.cpp's repacked Q4_K GEMM at every row count, the gap widening with the rows.
//
// Format (written by w4a8.py): per group of 32 inputs and per output, w ~= q * scale + min with
// q in 0..15 (asymmetric round-to-nearest), where scale = d * sc and min = dmin * mn: sc (1..255)
// and mn (-128..127) are 8-bit codes per group, d and dmin fp16 per super-block of 8 groups (256
// inputs), as GGUF's Q4_K (which has 6-bit codes). 4.625 bits per weight, against 5 for fp16 scale
// and min per group (GGUF's Q4_1, this kernel's earlier format): 7.5% fewer bytes for a step that
// reads every weight once. Both products are exact in fp32 (11-bit x 8-bit significands), so every
// path computes the same scale and min.
// Activations: per row, xq = round(x / s) in -127..127 with s = max|x| / 127 (per-token dynamic
// quantization, SmoothQuant arXiv 2211.10438 without smoothing). Then, exactly:
//   sum_k x[k] w[k] ~= s * sum_g (scale_g * sum_{k in g} q[k] xq[k] + min_g * sum_{k in g} xq[k]).
// The inner sums are integers (u4 x s8 products, at most 32 * 15 * 127 per group), exact on every
// instruction set: VNNI's vpdpbusd, and AVX2/AVX-512's vpmaddubsw, whose saturating int16 pair sums
// cannot saturate here (2 * 15 * 127 < 32767; int8 x int8 would). The float part runs in a fixed
// order per output: group by group, t = fma(sum, scale, min * xsum), y += t. Nothing depends on how
// many rows share a call, so the result is batch-invariant by construction, and every path (scalar,
// AVX2, AVX-512, VNNI) gives the same bits.
//
// Packed weights, uint8 [N/16, K/32, 4, 64]: output block b (16 outputs), group g, chunk c; byte
// lane * 4 + i holds q[16b + lane, 32g + 8c + i] in its low nibble and q[.., 32g + 8c + 4 + i] in
// its high nibble: one 64-byte load gives two vpdpbusd operands (16 lanes x 4 inputs each).
// codes, uint8 [N/16, K/32, 32]: the block's 16 scale codes sc, then its 16 min codes mn (int8 bits).
// supers, fp16 [N/16, ceil(K/256), 32]: the block's 16 d, then its 16 dmin, per super-block (the last
// one may hold fewer than 8 groups).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "bf16_lanes.h"
#include "layer_kernels.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SPECDEC_X86 1
#endif

namespace {

typedef int32_t unaligned_int32 __attribute__((aligned(1), may_alias));

constexpr int64_t kLanes = 16;
constexpr int64_t kGroup = 32;
constexpr int64_t kChunks = kGroup / 8;  // 64-byte chunks per group and block
constexpr int64_t kSuperGroups = 8;      // groups per super-block (256 inputs, as GGUF's Q4_K)

inline int64_t super_blocks(int64_t groups) { return (groups + kSuperGroups - 1) / kSuperGroups; }

enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Vnni = 3 };

struct Problem {
  const int8_t* xq;       // [K/8, M, 8] quantized activations: a chunk's rows side by side (one pointer per tile)
  const float* xsum;      // [M, K/32] group sums of xq (exact integers as floats)
  const float* xscale;    // [M] per-row scales
  const uint8_t* packed;  // [N/16, K/32, 4, 64]
  const uint8_t* codes;   // [N/16, K/32, 32]: 16 scale codes, 16 min codes (int8)
  const uint16_t* supers; // [N/16, ceil(K/256), 32] fp16 bits: 16 d, 16 dmin
  const float* bias;      // [N] or null
  void* out;              // [M, columns] fp32 or bf16 (out_bf16): the projection's own outputs, not the padding
  bool out_bf16;
  int64_t columns;        // N - 16 < columns <= N
  int64_t M, N, K;
};

// Group g of output block b: its 32 code bytes, and its super-block's 32 fp16 steps.
inline const uint8_t* group_codes(const Problem& p, int64_t b, int64_t g) {
  return p.codes + (b * (p.K / kGroup) + g) * 2 * kLanes;
}
inline const uint16_t* group_supers(const Problem& p, int64_t b, int64_t g) {
  return p.supers + (b * super_blocks(p.K / kGroup) + g / kSuperGroups) * 2 * kLanes;
}

inline float half_to_float(uint16_t h) {
  // IEEE half -> float, exact (subnormals included); the vector paths use F16C's vcvtph2ps.
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      int shift = 0;
      while (!(mantissa & 0x400)) { mantissa <<= 1; ++shift; }
      mantissa &= 0x3ff;
      bits = sign | ((uint32_t)(127 - 15 + 1 - shift) << 23) | (mantissa << 13);
    }
  } else if (exponent == 31) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// bf16 through c10::BFloat16, the type behind Tensor.to(bfloat16): its float constructor rounds to
// nearest even (NaN -> 0x7fc0), which the vector stores below repeat 16 or 8 lanes at a time; its
// widening to float is exact.
inline uint16_t bf16_bits(float value) { return c10::BFloat16(value).x; }
inline float bf16_to_float(uint16_t bits) { return static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits())); }

// Output n of row m; columns past p.columns (a last block's padding) are not written.
inline void store_one(const Problem& p, int64_t m, int64_t n, float value) {
  if (n >= p.columns) return;
  if (p.out_bf16) {
    static_cast<uint16_t*>(p.out)[m * p.columns + n] = bf16_bits(value);
  } else {
    static_cast<float*>(p.out)[m * p.columns + n] = value;
  }
}

inline void store_row(const Problem& p, int64_t m, int64_t n0, const float* y) {
  const float s = p.xscale[m];
  for (int64_t l = 0; l < kLanes; ++l) {
    store_one(p, m, n0 + l, p.bias ? y[l] * s + p.bias[n0 + l] : y[l] * s);
  }
}

// The reference: the same integer sums and the same float operations, one lane at a time.
void block_scalar(const Problem& p, int64_t b, int64_t m0, int64_t rows) {
  const int64_t groups = p.K / kGroup;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t m = m0 + r;
    float y[kLanes] = {0};
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* chunk = p.packed + (b * groups + g) * kChunks * 64;
      const float xs = p.xsum[m * groups + g];
      for (int64_t l = 0; l < kLanes; ++l) {
        int32_t acc = 0;
        for (int64_t c = 0; c < kChunks; ++c) {
          for (int64_t i = 0; i < 4; ++i) {
            const uint8_t byte = chunk[c * 64 + l * 4 + i];
            const int8_t* x = p.xq + ((g * kChunks + c) * p.M + m) * 8;
            acc += (int32_t)(byte & 0x0f) * x[i] + (int32_t)(byte >> 4) * x[4 + i];
          }
        }
        const uint8_t* codes = group_codes(p, b, g);
        const uint16_t* supers = group_supers(p, b, g);
        const float scale = half_to_float(supers[l]) * static_cast<float>(codes[l]);
        const float min = half_to_float(supers[kLanes + l]) * static_cast<float>(static_cast<int8_t>(codes[kLanes + l]));
        const float t = std::fma((float)acc, scale, min * xs);
        y[l] = y[l] + t;
      }
    }
    store_row(p, m, b * kLanes, y);
  }
}

#ifdef SPECDEC_X86

// AVX2 (+FMA, F16C): 8 outputs per register, so a block's 16 outputs are two registers per row;
// up to 5 rows per pass. A group's eight vpmaddubsw results per register are added in int16 before
// one vpmaddwd widens them: each holds pair sums of at most 2 * 15 * 127 = 3810 in magnitude, and
// 8 * 3810 = 30480 < 32767, so the int16 sums are exact (the same integers as VNNI's) with 9
// multiplies per 256 products, not 16.
// Eight outputs of row m from n: fp32 as they are, or bf16 by bf16_bits' integer steps.
__attribute__((target("avx2,fma,f16c"))) inline void store8_avx2(const Problem& p, int64_t m, int64_t n, __m256 v) {
  if (n + 8 > p.columns) {  // the last block's real outputs only
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    for (int64_t l = 0; l < 8; ++l) store_one(p, m, n + l, lanes[l]);
    return;
  }
  if (!p.out_bf16) {
    _mm256_storeu_ps(static_cast<float*>(p.out) + m * p.columns + n, v);
    return;
  }
  const __m256i rounded = specdec::bf16x8_bits(v);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p.out) + m * p.columns + n), packed);
}

// One pass over a block's weights for up to 5 rows: each 64-byte line is loaded whole, both halves
// unpacked, and each row's activation broadcasts feed both halves. The earlier tiles (8 outputs x up
// to 8 rows) walked each block twice, once per half. Measured on a 2-core Zen 3 EPYC (AVX2 only),
// both versions in one process (benchmarks/kernel_ab.py; benchmarks/RESULTS.md, "AVX2: one pass
// per block"): the 1.5B target's 112 projections took 0.75x the time at 1 row, 0.71x at 2, 0.86x
// at 5, 0.93x at 9, 0.89x at 17; whole forwards 0.83x at 1 token, 0.95x at 5, 0.91x at 9.
// The prefetch: a 1-row step read only about half of this CPU's bandwidth (13 of ~25 GB/s); asking
// for the weights 2 KB ahead (8 groups; at a block's end, the next block's, which is this thread's
// next) gained a few percent more there, and 1 to 4 KB measured alike.
constexpr int64_t kAvx2Prefetch = 2048;

template <int R>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2(const Problem& p, int64_t b, int64_t m0) {
  const int64_t groups = p.K / kGroup;
  const __m256i low_nibbles = _mm256_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 y0[R], y1[R];  // outputs 0-7 and 8-15 of the block, per row
  for (int r = 0; r < R; ++r) y0[r] = y1[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* chunk = p.packed + (b * groups + g) * kChunks * 64;
    for (int64_t c = 0; c < kChunks; ++c) _mm_prefetch((const char*)(chunk + kAvx2Prefetch + 64 * c), _MM_HINT_T0);
    __m256i acc0[R], acc1[R];
    for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_si256();
    for (int64_t c = 0; c < kChunks; ++c) {
      const __m256i w0 = _mm256_loadu_si256((const __m256i*)(chunk + c * 64));
      const __m256i w1 = _mm256_loadu_si256((const __m256i*)(chunk + c * 64 + 32));
      const __m256i lo0 = _mm256_and_si256(w0, low_nibbles), hi0 = _mm256_and_si256(_mm256_srli_epi16(w0, 4), low_nibbles);
      const __m256i lo1 = _mm256_and_si256(w1, low_nibbles), hi1 = _mm256_and_si256(_mm256_srli_epi16(w1, 4), low_nibbles);
      const int8_t* x = p.xq + ((g * kChunks + c) * p.M + m0) * 8;
      for (int r = 0; r < R; ++r) {
        const __m256i xa = _mm256_set1_epi32(*(const unaligned_int32*)(x + 8 * r));
        const __m256i xb = _mm256_set1_epi32(*(const unaligned_int32*)(x + 8 * r + 4));
        acc0[r] = _mm256_add_epi16(acc0[r], _mm256_maddubs_epi16(lo0, xa));
        acc1[r] = _mm256_add_epi16(acc1[r], _mm256_maddubs_epi16(lo1, xa));
        acc0[r] = _mm256_add_epi16(acc0[r], _mm256_maddubs_epi16(hi0, xb));
        acc1[r] = _mm256_add_epi16(acc1[r], _mm256_maddubs_epi16(hi1, xb));
        // Keeps GCC from reassociating the group's int16 adds (legal for integers) into all
        // products first and their sum after, which spills most of them to the stack.
        __asm__("" : "+x"(acc0[r]), "+x"(acc1[r]));
      }
    }
    const uint8_t* codes = group_codes(p, b, g);
    const uint16_t* supers = group_supers(p, b, g);
    const __m128i sc = _mm_loadu_si128((const __m128i*)codes), mn = _mm_loadu_si128((const __m128i*)(codes + kLanes));
    const __m256 scale0 = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)supers)),
                                        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc)));
    const __m256 scale1 = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(supers + 8))),
                                        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sc, 8))));
    const __m256 min0 = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(supers + kLanes))),
                                      _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(mn)));
    const __m256 min1 = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(supers + kLanes + 8))),
                                      _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(mn, 8))));
    for (int r = 0; r < R; ++r) {
      const __m256 xs = _mm256_set1_ps(p.xsum[(m0 + r) * groups + g]);
      const __m256 sums0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc0[r], ones));
      const __m256 sums1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc1[r], ones));
      y0[r] = _mm256_add_ps(y0[r], _mm256_fmadd_ps(sums0, scale0, _mm256_mul_ps(min0, xs)));
      y1[r] = _mm256_add_ps(y1[r], _mm256_fmadd_ps(sums1, scale1, _mm256_mul_ps(min1, xs)));
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t m = m0 + r, n = b * kLanes;
    const __m256 s = _mm256_set1_ps(p.xscale[m]);
    __m256 v0 = _mm256_mul_ps(y0[r], s), v1 = _mm256_mul_ps(y1[r], s);
    if (p.bias) {
      v0 = _mm256_add_ps(v0, _mm256_loadu_ps(p.bias + n));
      v1 = _mm256_add_ps(v1, _mm256_loadu_ps(p.bias + n + 8));
    }
    store8_avx2(p, m, n, v0);
    store8_avx2(p, m, n + 8, v1);
  }
}

// AVX-512: 16 outputs per register; a tile is up to 10 rows of one block of 16 outputs, so each
// unpacked weight register feeds every row of the tile. VNNI fuses vpmaddubsw + vpmaddwd + add into
// vpdpbusd; both give the same exact int32 sums.
// One block at a time, in memory order: a thread then reads its share of a call (weights, codes and
// steps) as three streams of consecutive blocks, which the prefetchers follow. The tiles before walked
// 4 blocks at once (2 over 5 rows): 12 streams, restarted every 4 blocks, each 12 KB long where K =
// 1536. Measured on a 2-core Zen 4 EPYC, weights on 2 MB pages, both versions reading one copy,
// interleaved (benchmarks/kernel_ab.py; benchmarks/RESULTS.md, "w4a8: one block at a time"), the
// 1.5B target's 112 projections took 0.92-0.94x the time at 1 row, 0.79-0.91x at 2-5 rows, 0.91x at
// 9, 0.95-0.97x at 17 (whole forwards 0.89-0.97x at 5 and 9 tokens); the 0.5B draft's 0.84-0.92x at
// 1-9 rows; one thread at 1 row 0.79x. The down projection (K = 8960: 70 KB a block) gains least.
// In cache the 4-block tiles ran more multiply-adds per second at 1 row (~49% of the vpdpbusd peak
// against ~37%: one activation broadcast per vpdpbusd instead of one per four; alike, ~73%, from 5
// rows; benchmarks/w4a8_tile_cycles.py), but from memory the streams decide. Tiles of up to 10 rows
// keep each block's unpacking and widened codes for as many rows as the 10-row x 2-block tiles did
// (docs/history.md, "w4a8: tiles of 10 rows"); taller calls run balanced tiles (11 rows as 6 +
// 5, not 10 + 1). Tried and slower from memory: the same tiles over 2 blocks (1.13-1.16x the time at
// 1-9 rows), and over 1 block in the w8a8 head (1.03x at 1 row, 1.11x at 9).
constexpr int kTileRows = 10;
// The first row tile of a call asks for its block's weights 4 KB ahead (16 groups; past a block's end,
// the next block's: this thread's next) with prefetcht0; the later tiles find the block in cache.
// Against the same tiles without it (as above): 9 rows 0.83x the time, 1 row alike at ~34 GB/s and
// 0.97x when the memory gave ~60; 2 KB and 8 KB ahead, or prefetcht1, measured 2-5% slower.
constexpr int64_t kAvx512Prefetch = 4096;

// Sixteen outputs of row m from n, masked to the real columns: fp32, or bf16 by bf16_bits' steps.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void store16_avx512(const Problem& p, int64_t m,
                                                                               int64_t n, __m512 v) {
  const int64_t valid = std::min<int64_t>(kLanes, p.columns - n);
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
  if (!p.out_bf16) {
    _mm512_mask_storeu_ps(static_cast<float*>(p.out) + m * p.columns + n, mask, v);
    return;
  }
  const __m512i rounded = specdec::bf16x16_bits(v);
  _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p.out) + m * p.columns + n, mask, _mm512_cvtepi32_epi16(rounded));
}

// vpdpbusd in place. GCC 12 compiles _mm512_dpbusd_epi32 with the accumulator copied to another
// register before and back after each instruction (two zmm moves per vpdpbusd, which this loop's
// ports must run too): a loop of 12 independent vpdpbusd ran at 1.7 TSC cycles each through the
// intrinsic and 0.59 through this asm on a Cascade Lake Xeon, where two ports issue vpdpbusd.
// The instruction and its integer sums are the same.
__attribute__((target("avx512f,avx512vnni"))) inline __m512i dpbusd_in_place(__m512i acc, __m512i u8, __m512i s8) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
  return acc;
}

template <int R, bool kVnni>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))
void tile_avx512(const Problem& p, int64_t b, int64_t m0) {
  const int64_t groups = p.K / kGroup;
  const __m512i low_nibbles = _mm512_set1_epi8(0x0f);
  const __m512i ones = _mm512_set1_epi16(1);
  // With a single row, two accumulators (low and high nibbles) break the one chain of dependent
  // vpdpbusd; their integer sum is exact, so the split changes nothing.
  constexpr bool kSplit = R == 1;
  const uint8_t* weights = p.packed + b * groups * kChunks * 64;
  __m512 y[R];
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  // The current super-block's d and dmin, widened once for its 8 groups: per group only the codes are
  // widened (6-9% of a call in cache on the Zen 4 when each group widened its steps too).
  __m512 d = _mm512_setzero_ps(), dmin = _mm512_setzero_ps();
  const int64_t chunk_stride = p.M * 8;  // xq's bytes from one chunk of every row to the next chunk
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* chunks = weights + g * kChunks * 64;
    const int8_t* xg = p.xq + (g * kChunks * p.M + m0) * 8;
    __m512i acc[R], acc_hi[kSplit ? 1 : R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
    if constexpr (kSplit) acc_hi[0] = _mm512_setzero_si512();
    if (m0 == 0) {
      for (int c = 0; c < kChunks; ++c) _mm_prefetch((const char*)chunks + kAvx512Prefetch + 64 * c, _MM_HINT_T0);
    }
    // Unrolled, so each accumulator keeps one register across the group's 4 chunks: rolled, GCC
    // rotated the accumulators through other registers and the stack every chunk (~20 moves and 7
    // spills per 32 vpdpbusd). Measured on a 2-core Cascade Lake Xeon (AVX512-VNNI), interleaved
    // (benchmarks/kernel_ab.py; docs/history.md, "The cost of a forward next to its floors"): the
    // 1.5B target's 112 projections 0.94x the time at 17 rows, 0.87x at 33, alike at 1-9 rows.
#pragma GCC unroll 4
    for (int64_t c = 0; c < kChunks; ++c) {
      const __m512i w = _mm512_loadu_si512((const void*)(chunks + c * 64));
      const __m512i lo = _mm512_and_si512(w, low_nibbles);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low_nibbles);
      for (int r = 0; r < R; ++r) {
        const int8_t* x = xg + c * chunk_stride + r * 8;
        const __m512i xa = _mm512_set1_epi32(*(const unaligned_int32*)x);
        const __m512i xb = _mm512_set1_epi32(*(const unaligned_int32*)(x + 4));
        __m512i& high = kSplit ? acc_hi[0] : acc[r];
        if constexpr (kVnni) {
          acc[r] = dpbusd_in_place(acc[r], lo, xa);
          high = dpbusd_in_place(high, hi, xb);
        } else {
          acc[r] = _mm512_add_epi32(acc[r], _mm512_madd_epi16(_mm512_maddubs_epi16(lo, xa), ones));
          high = _mm512_add_epi32(high, _mm512_madd_epi16(_mm512_maddubs_epi16(hi, xb), ones));
        }
      }
    }
    if constexpr (kSplit) acc[0] = _mm512_add_epi32(acc[0], acc_hi[0]);
    if (g % kSuperGroups == 0) {
      const uint16_t* supers = group_supers(p, b, g);
      d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)supers));
      dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(supers + kLanes)));
    }
    const uint8_t* codes = group_codes(p, b, g);
    const __m512 scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)codes))));
    const __m512 min = _mm512_mul_ps(dmin,
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(codes + kLanes)))));
    for (int r = 0; r < R; ++r) {
      const __m512 xs = _mm512_set1_ps(p.xsum[(m0 + r) * groups + g]);
      const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), scale, _mm512_mul_ps(min, xs));
      y[r] = _mm512_add_ps(y[r], t);
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t m = m0 + r, n = b * kLanes;
    __m512 v = _mm512_mul_ps(y[r], _mm512_set1_ps(p.xscale[m]));
    if (p.bias) v = _mm512_add_ps(v, _mm512_loadu_ps(p.bias + n));
    store16_avx512(p, m, n, v);
  }
}

// tile_avx512<tile, kVnni> for a tile of 1..R rows.
template <int R, bool kVnni>
inline void tile_dispatch(const Problem& p, int64_t b, int64_t m0, int64_t tile) {
  if constexpr (R >= 1) {
    if (tile == R) { tile_avx512<R, kVnni>(p, b, m0); return; }
    if constexpr (R > 1) tile_dispatch<R - 1, kVnni>(p, b, m0, tile);
  }
}

// Blocks [b0, b0 + count) one after another, each block's rows in balanced tiles of at most kTileRows
// (each tile unpacks the block's weights once more, and a 1-row tile leaves the integer units idle).
template <bool kVnni>
void blocks_avx512(const Problem& p, int64_t b0, int64_t count) {
  for (int64_t b = b0; b < b0 + count; ++b) {
    for (int64_t m0 = 0, rows = p.M; rows > 0;) {
      const int64_t tiles = (rows + kTileRows - 1) / kTileRows, tile = (rows + tiles - 1) / tiles;
      tile_dispatch<kTileRows, kVnni>(p, b, m0, tile);
      rows -= tile;
      m0 += tile;
    }
  }
}

// Rows in tiles of at most 5, balanced (6 rows -> 3 + 3, not 5 + 1): a 1-row tile leaves the
// integer units idle while it waits for the block's weights. Tiles of 5 (10 int16 accumulators,
// 4 unpacked weight registers, 2 broadcasts: all 16 ymm registers) measured faster at 5 and 9 rows
// than tiles of at most 4 (0.85x and 0.91x), and tiles of 6 no better.
void block_avx2(const Problem& p, int64_t b, int64_t m0, int64_t rows) {
  constexpr int64_t kMaxRows = 5;
  while (rows > 0) {
    const int64_t tiles = (rows + kMaxRows - 1) / kMaxRows, tile = (rows + tiles - 1) / tiles;
    switch (tile) {
      case 5: tile_avx2<5>(p, b, m0); break;
      case 4: tile_avx2<4>(p, b, m0); break;
      case 3: tile_avx2<3>(p, b, m0); break;
      case 2: tile_avx2<2>(p, b, m0); break;
      default: tile_avx2<1>(p, b, m0); break;
    }
    rows -= tile;
    m0 += tile;
  }
}

#endif  // SPECDEC_X86

// Per row: xq = round(x / s), s = max|x| / 127 (the same formula as W8A8Linear), and group sums.
// xq is stored [K/8, M, 8], so a tile reads every row's 8 inputs of a chunk from one pointer.
// Rows come as fp32 or as bf16 (T = uint16_t bits), widened exactly on load: the same floats, so
// the same bytes as quantizing x.float() (no fp32 copy of the activations per call).
inline float input_at(const float* row, int64_t k) { return row[k]; }
inline float input_at(const uint16_t* row, int64_t k) { return bf16_to_float(row[k]); }

template <typename T>
void quantize_row_scalar(const T* row, int64_t m, int64_t M, int64_t K, int8_t* q, float* sums, float* scales) {
  const int64_t groups = K / kGroup;
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::fmax(amax, std::fabs(input_at(row, k)));
  const float s = std::fmax(amax, 1e-12f) / 127.f;
  scales[m] = s;
  for (int64_t g = 0; g < groups; ++g) {
    int32_t sum = 0;
    for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) {
      const int32_t v = (int32_t)std::nearbyint(input_at(row, k) / s);  // round half to even, as torch.round
      q[((k / 8) * M + m) * 8 + k % 8] = (int8_t)v;
      sum += v;
    }
    sums[m * groups + g] = (float)sum;
  }
}

#ifdef SPECDEC_X86
// The same operations 16 lanes at a time (8 on AVX2, below): the division is IEEE's (vdivps rounds as divss does),
// the rounding to nearest even is nearbyint's, the maximum and the integer sums are exact in any
// order, so the bytes are the scalar loop's. The scalar loop cost ~30 us for the down
// projection's 8960 inputs, against ~0.3 ms for the whole projection of one row.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load16(const float* row) {
  return _mm512_loadu_ps(row);
}
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load16(const uint16_t* row) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl")))
void quantize_row_avx512(const T* row, int64_t m, int64_t M, int64_t K, int8_t* q, float* sums, float* scales) {
  const int64_t groups = K / kGroup;
  __m512 top = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) top = _mm512_max_ps(top, _mm512_abs_ps(load16(row + k)));
  const float s = std::fmax(std::fmax(_mm512_reduce_max_ps(top), 0.f), 1e-12f) / 127.f;
  scales[m] = s;
  const __m512 divisor = _mm512_set1_ps(s);
  for (int64_t g = 0; g < groups; ++g) {
    __m512i sum = _mm512_setzero_si512();
    for (int64_t k = g * kGroup; k < (g + 1) * kGroup; k += 16) {
      const __m512 rounded = _mm512_roundscale_ps(_mm512_div_ps(load16(row + k), divisor),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512i v = _mm512_cvtps_epi32(rounded);
      sum = _mm512_add_epi32(sum, v);
      const __m128i bytes = _mm512_cvtepi32_epi8(v);  // -127..127: the narrowing is exact
      _mm_storel_epi64((__m128i*)(q + ((k / 8) * M + m) * 8), bytes);
      _mm_storel_epi64((__m128i*)(q + ((k / 8 + 1) * M + m) * 8), _mm_unpackhi_epi64(bytes, bytes));
    }
    sums[m * groups + g] = (float)_mm512_reduce_add_epi32(sum);
  }
}

// AVX2: 8 lanes, one chunk of xq per vector; the narrowing packs saturate, which values in
// -127..127 never reach.
__attribute__((target("avx2,fma"))) inline __m256 load8(const float* row) { return _mm256_loadu_ps(row); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const uint16_t* row) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

template <typename T>
__attribute__((target("avx2,fma")))
void quantize_row_avx2(const T* row, int64_t m, int64_t M, int64_t K, int8_t* q, float* sums, float* scales) {
  const int64_t groups = K / kGroup;
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 top = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) top = _mm256_max_ps(top, _mm256_andnot_ps(sign, load8(row + k)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  float amax = 0.f;
  for (float lane : lanes) amax = std::fmax(amax, lane);
  const float s = std::fmax(amax, 1e-12f) / 127.f;
  scales[m] = s;
  const __m256 divisor = _mm256_set1_ps(s);
  for (int64_t g = 0; g < groups; ++g) {
    __m256i sum = _mm256_setzero_si256();
    for (int64_t k = g * kGroup; k < (g + 1) * kGroup; k += 8) {
      const __m256 rounded = _mm256_round_ps(_mm256_div_ps(load8(row + k), divisor),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256i v = _mm256_cvtps_epi32(rounded);
      sum = _mm256_add_epi32(sum, v);
      const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
      _mm_storel_epi64((__m128i*)(q + ((k / 8) * M + m) * 8), _mm_packs_epi16(words, words));
    }
    alignas(32) int32_t parts[8];
    _mm256_store_si256((__m256i*)parts, sum);
    int32_t total = 0;
    for (int32_t part : parts) total += part;
    sums[m * groups + g] = (float)total;
  }
}
#endif

template <typename T>
void quantize_rows(const T* xs, int64_t M, int64_t K, at::Tensor& xq, at::Tensor& xsum, at::Tensor& xscale,
                   int64_t isa) {
  int8_t* q = xq.data_ptr<int8_t>();
  float* sums = xsum.data_ptr<float>();
  float* scales = xscale.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
#ifdef SPECDEC_X86
      if (isa >= kAvx512) {
        quantize_row_avx512(xs + m * K, m, M, K, q, sums, scales);
        continue;
      }
      if (isa == kAvx2) {
        quantize_row_avx2(xs + m * K, m, M, K, q, sums, scales);
        continue;
      }
#endif
      quantize_row_scalar(xs + m * K, m, M, K, q, sums, scales);
    }
  });
}

// x [M, K] fp32 or bf16 (other dtypes go through fp32) -> out [M, columns], fp32 or bf16 (out_bf16):
// the projection's real outputs (columns: all N but the padding), rounded to bf16 in the kernel's
// store when asked, which is the same rounding as Tensor.to(bfloat16) of the fp32 result, without its
// copies. residual [M, columns] in out's dtype, or null: added to each output after its rounding,
// rounded again (ATen's `residual + y`: the sum of the two in fp32, then its rounding to out's dtype).
void w4a8_into(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& codes, const at::Tensor& supers,
               const c10::optional<at::Tensor>& bias, int64_t isa, int64_t columns, at::Tensor& out,
               const at::Tensor* residual) {
  const int64_t K = x.size(-1), M = x.numel() / std::max<int64_t>(K, 1), blocks = packed.size(0), N = blocks * kLanes;
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kChunks && packed.size(3) == 64 &&
                  packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "w4a8_linear: packed must be contiguous uint8 [N/16, K/32, 4, 64]");
  TORCH_CHECK(packed.size(1) * kGroup == K, "w4a8_linear: x has ", K, " inputs, the weights ",
              packed.size(1) * kGroup);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.numel() == blocks * packed.size(1) * 2 * kLanes,
              "w4a8_linear: codes must be contiguous uint8 [N/16, K/32, 32]");
  TORCH_CHECK(supers.scalar_type() == at::kHalf && supers.is_contiguous() &&
                  supers.numel() == blocks * super_blocks(packed.size(1)) * 2 * kLanes,
              "w4a8_linear: supers must be contiguous fp16 [N/16, ceil(K/256), 32]");
  TORCH_CHECK(columns <= N && columns > N - kLanes, "w4a8_linear: ", columns, " outputs do not fit ", blocks,
              " blocks of 16");
  const bool out_bf16 = out.scalar_type() == at::kBFloat16;
  TORCH_CHECK((out_bf16 || out.scalar_type() == at::kFloat) && out.is_contiguous() && out.numel() == M * columns,
              "w4a8_linear: out must be contiguous fp32 or bf16 [M, columns]");
  TORCH_CHECK(residual == nullptr || (residual->scalar_type() == out.scalar_type() && residual->is_contiguous() &&
                                      residual->numel() == M * columns),
              "w4a8_linear: the residual must be contiguous [M, columns] in the output's dtype");
  const at::Tensor rows = x.scalar_type() == at::kBFloat16 ? x.contiguous() : x.to(at::kFloat).contiguous();
  at::Tensor bias32;
  if (bias.has_value() && bias->defined()) {
    bias32 = bias->scalar_type() == at::kFloat && bias->is_contiguous() ? *bias : bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bias32.numel() == N, "w4a8_linear: bias must have ", N, " entries");
  }
  at::Tensor xq = at::empty({K / 8, M, 8}, x.options().dtype(at::kChar));
  at::Tensor xsum = at::empty({M, K / kGroup}, x.options().dtype(at::kFloat));
  at::Tensor xscale = at::empty({M}, x.options().dtype(at::kFloat));
  if (rows.scalar_type() == at::kBFloat16) {
    quantize_rows(reinterpret_cast<const uint16_t*>(rows.data_ptr<at::BFloat16>()), M, K, xq, xsum, xscale, isa);
  } else {
    quantize_rows(rows.data_ptr<float>(), M, K, xq, xsum, xscale, isa);
  }
  const Problem p{xq.data_ptr<int8_t>(), xsum.data_ptr<float>(), xscale.data_ptr<float>(),
                  packed.data_ptr<uint8_t>(), codes.data_ptr<uint8_t>(),
                  reinterpret_cast<const uint16_t*>(supers.data_ptr<at::Half>()),
                  bias32.defined() ? bias32.data_ptr<float>() : nullptr, out.data_ptr(), out_bf16, columns,
                  M, N, K};
  // Threads split the output blocks; each thread walks its blocks' weights once, all rows per block
  // (a block's weights, K * 8 bytes, stay in cache while its row tiles pass), then adds the residual
  // to its own outputs while they are in cache.
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    switch (isa) {
#ifdef SPECDEC_X86
      case kAvx512Vnni: blocks_avx512<true>(p, begin, end - begin); break;
      case kAvx512: blocks_avx512<false>(p, begin, end - begin); break;
      case kAvx2:
        for (int64_t b = begin; b < end; ++b) block_avx2(p, b, 0, M);
        break;
#endif
      default:
        for (int64_t b = begin; b < end; ++b) block_scalar(p, b, 0, M);
        break;
    }
    if (residual == nullptr) return;
    const int64_t first = begin * kLanes, last = std::min(end * kLanes, columns);
    for (int64_t m = 0; m < M; ++m) {
      if (out_bf16) {
        at::BFloat16* y = out.data_ptr<at::BFloat16>() + m * columns;
        const at::BFloat16* r = residual->data_ptr<at::BFloat16>() + m * columns;
        for (int64_t n = first; n < last; ++n) y[n] = static_cast<float>(r[n]) + static_cast<float>(y[n]);
      } else {
        float* y = out.data_ptr<float>() + m * columns;
        const float* r = residual->data_ptr<float>() + m * columns;
        for (int64_t n = first; n < last; ++n) y[n] = r[n] + y[n];
      }
    }
  });
}

at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& codes,
                       const at::Tensor& supers, const c10::optional<at::Tensor>& bias, int64_t isa,
                       int64_t columns, c10::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(x.dim() == 2, "w4a8_linear: x must be [M, K]");
  if (columns < 0) columns = packed.size(0) * kLanes;
  const at::ScalarType want = out_dtype.value_or(at::kFloat);
  const at::ScalarType stored = want == at::kBFloat16 ? at::kBFloat16 : at::kFloat;
  at::Tensor out = at::empty({x.size(0), columns}, x.options().dtype(stored));
  w4a8_into(x, packed, codes, supers, bias, isa, columns, out, nullptr);
  return out.scalar_type() == want ? out : out.to(want);
}

// quantize_weight + pack of w4a8.py in one pass over the weights (the reference stays in Python):
// a load quantizes 1.5B weights, which took ~27 s of a 33 s load in whole-tensor PyTorch ops (fp32
// copies, padding, six passes over memory). Same float operations in the same order, so the same
// bytes (round() is round half to even, as torch.round; fp16() is the fp32 -> fp16 rounding):
//   per group:        low, high = min, max of its 32 weights
//   per super-block:  dmin = fp16(max(max |low| / 127, 2^-24))
//   per group:        mn = clamp(round(low / dmin), -128, 127); min = dmin * mn
//                     need = max((high - min) / 15, 0)
//   per super-block:  d = fp16(max(max need / 255, 2^-24))
//   per group:        sc = clamp(round(need / d), 1, 255)
//   then, per group, the codes (sc + i, mn + j), i, j in 0, -1, 1 (clamped), in that order, with
//                     scale = d * sc, min = dmin * mn, q = clamp(round((w - min) / scale), 0, 15)
//   whose squared error sum (w - (q * scale + min))^2 is smallest (the first of equals; the sum's order
//   is group_error's). The search is what a requantization of GGUF weights needs: their codes put the
//   levels where min/max rounding does not, and on the 1.5B target's projections it leaves 0.83x the
//   squared error of fp16 scale and min per group (0.71-0.90x by projection; benchmarks/RESULTS.md).
// Outputs past the weight's rows (padding to whole 16-output blocks) are zero weights.
inline float round_half_even(float v) {
  // Adding and removing 1.5 * 2^23 leaves the float's integer part, rounded by the FPU's default
  // mode (to nearest even), exactly for |v| < 2^22. Codes stay far below; a weight's v can pass it
  // only far below zero (a constant group in a super-block of constant groups), where both this and
  // torch.round give a negative number that clamps to q = 0.
  return (v + 12582912.0f) - 12582912.0f;
}
inline float clamp(float v, float low, float high) { return v < low ? low : (v > high ? high : v); }

// The squared error of a group's weights on their nearest levels under (scale, min): err_i in order,
// then 16 partial sums err_l + err_{16+l}, then the partials in order (a fixed order that vectorizes).
inline float group_error(const float* w, float scale, float min) {
  float err[kGroup];
  for (int64_t i = 0; i < kGroup; ++i) {
    const float level = clamp(round_half_even((w[i] - min) / scale), 0.f, 15.f);
    const float diff = w[i] - (level * scale + min);
    err[i] = diff * diff;
  }
  float partial[kGroup / 2];
  for (int64_t l = 0; l < kGroup / 2; ++l) partial[l] = err[l] + err[kGroup / 2 + l];
  float total = partial[0];
  for (int64_t l = 1; l < kGroup / 2; ++l) total = total + partial[l];
  return total;
}

// One output row's codes, steps and 4-bit values (the bytes' law above): row [K] in, q [K] out,
// sc/mn [groups], d/dmin [super-blocks] as fp16.
#ifdef SPECDEC_X86
// Compiled for AVX-512, AVX2 and plain x86-64 (the same IEEE operations, so the same bytes; contraction
// into FMAs is off for the whole file): the search costs 9 error sums per group, ~5x the packing's
// other work, and wider vectors keep the 1.5B target's load at a few seconds.
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void quantize_row_codes(const float* row, int64_t K, uint8_t* q, uint8_t* sc, int8_t* mn, at::Half* d,
                        at::Half* dmin) {
  const int64_t groups = K / kGroup;
  std::vector<float> low(groups), high(groups), need(groups);
  for (int64_t g = 0; g < groups; ++g) {
    const float* group = row + g * kGroup;
    float lo = group[0], hi = group[0];
    for (int64_t i = 1; i < kGroup; ++i) {  // comparisons, not fmin/fmax: they vectorize
      lo = group[i] < lo ? group[i] : lo;
      hi = group[i] > hi ? group[i] : hi;
    }
    low[g] = lo;
    high[g] = hi;
  }
  for (int64_t s = 0; s < super_blocks(groups); ++s) {
    const int64_t first = s * kSuperGroups, last = std::min(groups, first + kSuperGroups);
    float largest_low = 0.f;
    for (int64_t g = first; g < last; ++g) largest_low = std::fmax(largest_low, std::fabs(low[g]));
    dmin[s] = at::Half(std::fmax(largest_low / 127.0f, 0x1p-24f));
    const float min_step = static_cast<float>(dmin[s]);
    float largest_need = 0.f;
    for (int64_t g = first; g < last; ++g) {
      mn[g] = static_cast<int8_t>(clamp(round_half_even(low[g] / min_step), -128.f, 127.f));
      need[g] = std::fmax((high[g] - min_step * static_cast<float>(mn[g])) / 15.0f, 0.f);
      largest_need = std::fmax(largest_need, need[g]);
    }
    d[s] = at::Half(std::fmax(largest_need / 255.0f, 0x1p-24f));
    const float step = static_cast<float>(d[s]);
    for (int64_t g = first; g < last; ++g) {
      const float nearest_sc = clamp(round_half_even(need[g] / step), 1.f, 255.f);
      const float nearest_mn = static_cast<float>(mn[g]);
      float best = 0.f;
      int candidate = 0;
      for (const float scale_shift : {0.f, -1.f, 1.f}) {
        for (const float min_shift : {0.f, -1.f, 1.f}) {
          const float code = clamp(nearest_sc + scale_shift, 1.f, 255.f);
          const float min_code = clamp(nearest_mn + min_shift, -128.f, 127.f);
          const float error = group_error(row + g * kGroup, step * code, min_step * min_code);
          if (candidate++ == 0 || error < best) {
            best = error;
            sc[g] = static_cast<uint8_t>(code);
            mn[g] = static_cast<int8_t>(min_code);
          }
        }
      }
      const float scale = step * static_cast<float>(sc[g]), min = min_step * static_cast<float>(mn[g]);
      for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) {
        q[k] = static_cast<uint8_t>(clamp(round_half_even((row[k] - min) / scale), 0.f, 15.f));
      }
    }
  }
}

std::vector<at::Tensor> quantize_pack(const at::Tensor& weight, int64_t padded_outputs) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) % kGroup == 0 && padded_outputs % kLanes == 0 &&
                  padded_outputs >= weight.size(0),
              "quantize_pack: weight must be [N, K] with K divisible by 32, padded to whole 16-output blocks");
  // One fp32 row at a time, converted exactly from bf16/fp16/fp32: no fp32 copy of a whole matrix.
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), groups = K / kGroup, supers = super_blocks(groups);
  const int64_t blocks = padded_outputs / kLanes;
  at::Tensor packed = at::empty({blocks, groups, kChunks, 64}, weight.options().dtype(at::kByte));
  at::Tensor codes = at::empty({blocks, groups, 2 * kLanes}, weight.options().dtype(at::kByte));
  at::Tensor steps = at::empty({blocks, supers, 2 * kLanes}, weight.options().dtype(at::kHalf));
  uint8_t* out = packed.data_ptr<uint8_t>();
  uint8_t* code_out = codes.data_ptr<uint8_t>();
  at::Half* step_out = steps.data_ptr<at::Half>();
  at::parallel_for(0, padded_outputs, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> row(K);
    std::vector<uint8_t> q(K), sc(groups);
    std::vector<int8_t> mn(groups);
    std::vector<at::Half> d(supers), dmin(supers);
    for (int64_t n = begin; n < end; ++n) {
      const int64_t b = n / kLanes, lane = n % kLanes;
      if (n < N) {
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, w.scalar_type(), "quantize_pack", [&] {
          const scalar_t* source = w.data_ptr<scalar_t>() + n * K;
          for (int64_t k = 0; k < K; ++k) row[k] = static_cast<float>(source[k]);
        });
      } else {
        std::fill(row.begin(), row.end(), 0.f);
      }
      quantize_row_codes(row.data(), K, q.data(), sc.data(), mn.data(), d.data(), dmin.data());
      for (int64_t g = 0; g < groups; ++g) {
        code_out[(b * groups + g) * 2 * kLanes + lane] = sc[g];
        code_out[(b * groups + g) * 2 * kLanes + kLanes + lane] = static_cast<uint8_t>(mn[g]);
        uint8_t* chunk = out + (b * groups + g) * kChunks * 64;
        const uint8_t* group = q.data() + g * kGroup;
        for (int64_t c = 0; c < kChunks; ++c) {  // input 8c + j and 8c + 4 + j -> byte lane * 4 + j of chunk c
          for (int64_t j = 0; j < 4; ++j) chunk[c * 64 + lane * 4 + j] = group[8 * c + j] | (group[8 * c + 4 + j] << 4);
        }
      }
      for (int64_t s = 0; s < supers; ++s) {
        step_out[(b * supers + s) * 2 * kLanes + lane] = d[s];
        step_out[(b * supers + s) * 2 * kLanes + kLanes + lane] = dmin[s];
      }
    }
  });
  return {packed, codes, steps};
}

// ---- The machine's int8 peak, for `specdec doctor`'s arithmetic floor (analysis/roofline.py) ----
// Each thread runs a path's integer step on 12 independent accumulators (more than the instruction's
// latency times its issue rate, so nothing waits) and counts multiply-adds per second:
// VNNI vpdpbusd (64 per instruction), AVX-512 vpmaddubsw + vpmaddwd + vpaddd (64), AVX2 vpmaddubsw +
// vpaddw (32): the same steps the kernels above issue, so a kernel at this rate is at its roofline.
constexpr int kPeakChains = 12;
constexpr int64_t kPeakIterations = 4000000;

#ifdef SPECDEC_X86
template <bool kVnni>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) int64_t peak_avx512() {
  __m512i acc[kPeakChains];
  for (int j = 0; j < kPeakChains; ++j) acc[j] = _mm512_set1_epi32(j);
  __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(-5);
  const __m512i ones = _mm512_set1_epi16(1);
  for (int64_t i = 0; i < kPeakIterations; ++i) {
    __asm__("" : "+v"(w), "+v"(x));  // unknown operands each iteration: nothing folds
    for (int j = 0; j < kPeakChains; ++j) {
      if constexpr (kVnni) {
        acc[j] = dpbusd_in_place(acc[j], w, x);
      } else {
        acc[j] = _mm512_add_epi32(acc[j], _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), ones));
      }
    }
  }
  int64_t sum = 0;
  for (int j = 0; j < kPeakChains; ++j) sum += _mm512_reduce_add_epi32(acc[j]);
  return sum;
}

__attribute__((target("avx2"))) int64_t peak_avx2() {
  __m256i acc[kPeakChains];
  for (int j = 0; j < kPeakChains; ++j) acc[j] = _mm256_set1_epi16(j);
  __m256i w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(-5);
  for (int64_t i = 0; i < kPeakIterations; ++i) {
    __asm__("" : "+x"(w), "+x"(x));
    for (int j = 0; j < kPeakChains; ++j) acc[j] = _mm256_add_epi16(acc[j], _mm256_maddubs_epi16(w, x));
  }
  alignas(32) int16_t lanes[16];
  int64_t sum = 0;
  for (int j = 0; j < kPeakChains; ++j) {
    _mm256_store_si256((__m256i*)lanes, acc[j]);
    for (int16_t lane : lanes) sum += lane;
  }
  return sum;
}
#endif

// Multiply-adds per second of all this process's threads together on path `isa` (0 for scalar).
double int8_peak(int64_t isa) {
  const int64_t threads = at::get_num_threads();
  std::vector<double> rates(threads, 0.0);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int64_t per_instruction = 0, checksum = 0;
      const auto started = std::chrono::steady_clock::now();
      switch (isa) {
#ifdef SPECDEC_X86
        case kAvx512Vnni: checksum = peak_avx512<true>(); per_instruction = 64; break;
        case kAvx512: checksum = peak_avx512<false>(); per_instruction = 64; break;
        case kAvx2: checksum = peak_avx2(); per_instruction = 32; break;
#endif
        default: break;
      }
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      if (per_instruction && checksum != 0x7fffffffffffffff)  // the checksum keeps the loop's result live
        rates[t] = double(kPeakChains) * kPeakIterations * per_instruction / seconds;
    }
  });
  double total = 0;
  for (double rate : rates) total += rate;
  return total;
}

}  // namespace

namespace specdec {

at::Tensor w4a8_project(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& codes,
                        const at::Tensor& supers, const c10::optional<at::Tensor>& bias, int64_t isa,
                        int64_t columns, const at::Tensor* residual) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "w4a8_project: x must be bf16 or fp32");
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = columns;
  at::Tensor out = at::empty(shape, x.options());
  const at::Tensor rows = residual == nullptr ? at::Tensor() : residual->contiguous();  // itself if contiguous
  w4a8_into(x, packed, codes, supers, bias, isa, columns, out, residual == nullptr ? nullptr : &rows);
  return out;
}

}  // namespace specdec

TORCH_LIBRARY(specdec_w4a8, m) {
  m.def("linear(Tensor x, Tensor packed, Tensor codes, Tensor supers, Tensor? bias, int isa, int columns=-1, "
        "ScalarType? out_dtype=None) -> Tensor");
  m.def("quantize_pack(Tensor weight, int padded_outputs) -> Tensor[]");
  m.def("int8_peak(int isa) -> float");
}

TORCH_LIBRARY_IMPL(specdec_w4a8, CPU, m) {
  m.impl("linear", &w4a8_linear);
  m.impl("quantize_pack", &quantize_pack);
}

// No tensor arguments, so no dispatch key: registered for every backend at once.
TORCH_LIBRARY_IMPL(specdec_w4a8, CompositeExplicitAutograd, m) { m.impl("int8_peak", &int8_peak); }
