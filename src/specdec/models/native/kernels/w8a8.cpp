// w8a8: int8 weights (one scale per output) x int8 activations (one scale per row), exact int32 sums.
//
// The law of linear.py's W8A8Linear, which ran it on oneDNN's qlinear: xq = round(x / s) in
// -127..127 with s = max|x| / 127 per row, wq = round(w / scale) per output, and
//   y[m, n] = (float(sum_k xq[m, k] wq[n, k]) * scale[n]) * s[m]   (+ bias[n]),
// the same two roundings in the same order, so the bits are those of oneDNN's VNNI path (tests compare
// them; its AMX path, not measured here, is only checked to within a rounding).
//
// Why hand-written (measured on a 2-core Zen 4 EPYC, AVX512-BF16, benchmarks/native_kernels.py):
// the output head of the w4a8 target (151936 x 1536, 233 MB in int8) is the largest matrix a step
// reads, and oneDNN's int8 path read it at ~20 GB/s for one row, where memory gives ~29. This
// kernel streams it at the rate of the 4-bit projections (see native_kernels.py --head).
//
// VNNI's vpdpbusd multiplies unsigned by signed bytes, so the activations go in as u8 = xq + 128
// and the kernel subtracts 128 * sum_k wq[n, k] (kept per output at packing): the integer sums are
// exact whatever their order, so the result is batch-invariant and the scalar reference gives the
// same bits. Needs AVX512-VNNI: without it u8 x s8 products go through vpmaddubsw's saturating
// int16 pairs (255 * 127 * 2 > 32767), which is why W8A8Linear only exists on VNNI/AMX CPUs.
//
// Packed weights, int8 [N/16, K/4, 16, 4]: output block b, input step s, lane l, byte i holds
// wq[16b + l, 4s + i]; one 64-byte load is one vpdpbusd operand. wsum: int32 [N/16 * 16].

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SPECDEC_X86 1
#endif

namespace {

constexpr int64_t kLanes = 16;

enum Isa : int64_t { kScalar = 0, kAvx512Vnni = 3 };  // the numbers of w4a8.py's ISA_PATHS

struct Problem {
  const uint8_t* xu;      // [K/4, M, 4] activations + 128: a step's rows side by side
  const float* xscale;    // [M]
  const int8_t* packed;   // [N/16, K/4, 16, 4]
  const int32_t* wsum;    // [N/16 * 16] 128 * sum_k wq[n, k]
  const float* scales;    // [N/16 * 16]
  const float* bias;      // [N/16 * 16] or null
  float* out;             // [M, N/16 * 16]
  int64_t M, N, K;
};

inline void store(const Problem& p, int64_t m, int64_t n, int32_t acc) {
  const float y = (static_cast<float>(acc - p.wsum[n]) * p.scales[n]) * p.xscale[m];
  p.out[m * p.N + n] = p.bias ? y + p.bias[n] : y;
}

void block_scalar(const Problem& p, int64_t b) {
  const int64_t steps = p.K / 4;
  for (int64_t m = 0; m < p.M; ++m) {
    for (int64_t l = 0; l < kLanes; ++l) {
      int32_t acc = 0;
      for (int64_t s = 0; s < steps; ++s) {
        const int8_t* w = p.packed + ((b * steps + s) * kLanes + l) * 4;
        const uint8_t* x = p.xu + (s * p.M + m) * 4;
        for (int i = 0; i < 4; ++i) acc += static_cast<int32_t>(x[i]) * static_cast<int32_t>(w[i]);
      }
      store(p, m, b * kLanes + l, acc);
    }
  }
}

#ifdef SPECDEC_X86

// vpdpbusd in place, as w4a8.cpp's dpbusd_in_place: GCC 12 compiles _mm512_dpbusd_epi32 with the
// accumulator copied to another register around each instruction (one zmm move per vpdpbusd on the
// same two ports), which held the 9-row head at half its speed (benchmarks/RESULTS.md, "Attention:
// tiles of query rows"). The instruction and its integer sums are the same.
__attribute__((target("avx512f,avx512vnni"))) inline __m512i dpbusd_in_place(__m512i acc, __m512i u8, __m512i s8) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
  return acc;
}

// R rows x B blocks: one weight load feeds R rows, one activation broadcast feeds B blocks.
template <int R, int B>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void tile_vnni(const Problem& p, int64_t b0,
                                                                                int64_t m0) {
  const int64_t steps = p.K / 4;
  __m512i acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < B; ++j) acc[r][j] = _mm512_setzero_si512();
  // Unrolled, so each accumulator keeps its register (rolled, GCC rotated them through others).
#pragma GCC unroll 4
  for (int64_t s = 0; s < steps; ++s) {
    __m512i w[B];
    for (int j = 0; j < B; ++j) w[j] = _mm512_loadu_si512((const void*)(p.packed + ((b0 + j) * steps + s) * 64));
    for (int r = 0; r < R; ++r) {
      int32_t x4;
      std::memcpy(&x4, p.xu + (s * p.M + m0 + r) * 4, 4);
      const __m512i x = _mm512_set1_epi32(x4);
      for (int j = 0; j < B; ++j) acc[r][j] = dpbusd_in_place(acc[r][j], x, w[j]);
    }
  }
  // store()'s operations 16 lanes at a time: (float(acc - wsum) * scale) * s (+ bias), each lane rounded
  // as the scalar steps round it. One lane at a time, the 9-row head's 1.4M outputs took ~2 ms.
  for (int j = 0; j < B; ++j) {
    const int64_t n = (b0 + j) * kLanes;
    const __m512i wsum = _mm512_loadu_si512((const void*)(p.wsum + n));
    const __m512 scale = _mm512_loadu_ps(p.scales + n);
    for (int r = 0; r < R; ++r) {
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][j], wsum));
      __m512 y = _mm512_mul_ps(_mm512_mul_ps(sum, scale), _mm512_set1_ps(p.xscale[m0 + r]));
      if (p.bias) y = _mm512_add_ps(y, _mm512_loadu_ps(p.bias + n));
      _mm512_storeu_ps(p.out + (m0 + r) * p.N + n, y);
    }
  }
}

// All rows of blocks [b0, b0 + B) in balanced tiles of at most 4 rows (as w4a8.cpp).
template <int B>
void rows_vnni(const Problem& p, int64_t b0) {
  for (int64_t m0 = 0, rows = p.M; rows > 0;) {
    const int64_t tiles = (rows + 3) / 4, tile = (rows + tiles - 1) / tiles;
    switch (tile) {
      case 4: tile_vnni<4, B>(p, b0, m0); break;
      case 3: tile_vnni<3, B>(p, b0, m0); break;
      case 2: tile_vnni<2, B>(p, b0, m0); break;
      default: tile_vnni<1, B>(p, b0, m0); break;
    }
    rows -= tile;
    m0 += tile;
  }
}

void blocks_vnni(const Problem& p, int64_t b0, int64_t count) {
  for (; count >= 4; count -= 4, b0 += 4) rows_vnni<4>(p, b0);
  for (; count > 0; --count, ++b0) rows_vnni<1>(p, b0);
}

#endif  // SPECDEC_X86

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& wsum,
                       const at::Tensor& scales, const c10::optional<at::Tensor>& bias, int64_t isa) {
  TORCH_CHECK(x.dim() == 2, "w8a8_linear: x must be [M, K]");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kLanes && packed.size(3) == 4 &&
                  packed.scalar_type() == at::kChar && packed.is_contiguous(),
              "w8a8_linear: packed must be contiguous int8 [N/16, K/4, 16, 4]");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * kLanes;
  TORCH_CHECK(packed.size(1) * 4 == K, "w8a8_linear: x has ", K, " inputs, the weights ", packed.size(1) * 4);
  TORCH_CHECK(wsum.scalar_type() == at::kInt && wsum.numel() == N && wsum.is_contiguous() &&
                  scales.scalar_type() == at::kFloat && scales.numel() == N && scales.is_contiguous(),
              "w8a8_linear: wsum (int32) and scales (fp32) must have one entry per padded output");
  at::Tensor bias32;
  if (bias.has_value() && bias->defined()) {
    bias32 = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bias32.numel() == N, "w8a8_linear: bias must have ", N, " entries");
  }
  const at::Tensor x32 = x.to(at::kFloat).contiguous();
  at::Tensor xu = at::empty({K / 4, M, 4}, x.options().dtype(at::kByte));
  at::Tensor xscale = at::empty({M}, x.options().dtype(at::kFloat));
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  const float* xs = x32.data_ptr<float>();
  uint8_t* xq = xu.data_ptr<uint8_t>();
  float* row_scales = xscale.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = xs + m * K;
      float amax = 0.f;
      for (int64_t k = 0; k < K; ++k) amax = std::fmax(amax, std::fabs(row[k]));
      const float s = std::fmax(amax, 1e-12f) / 127.f;  // W8A8Linear: amax.clamp_min(1e-12) / 127
      row_scales[m] = s;
      for (int64_t k = 0; k < K; ++k)  // round half to even, as torch.round; in -127..127
        xq[((k / 4) * M + m) * 4 + k % 4] = static_cast<uint8_t>(static_cast<int32_t>(std::nearbyint(row[k] / s)) + 128);
    }
  });
  const Problem p{xq, row_scales, packed.data_ptr<int8_t>(), wsum.data_ptr<int32_t>(), scales.data_ptr<float>(),
                  bias32.defined() ? bias32.data_ptr<float>() : nullptr, out.data_ptr<float>(), M, N, K};
  at::parallel_for(0, packed.size(0), 16, [&](int64_t begin, int64_t end) {
#ifdef SPECDEC_X86
    if (isa == kAvx512Vnni) {
      blocks_vnni(p, begin, end - begin);
      return;
    }
#endif
    for (int64_t b = begin; b < end; ++b) block_scalar(p, b);
  });
  return out;
}

// int8 [N, K] -> (packed [N/16, K/4, 16, 4], wsum int32 [N/16 * 16]); outputs past N are zero weights.
std::vector<at::Tensor> w8a8_pack(const at::Tensor& weight, int64_t padded_outputs) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.size(1) % 4 == 0 &&
                  padded_outputs % kLanes == 0 && padded_outputs >= weight.size(0),
              "w8a8_pack: weight must be int8 [N, K] with K divisible by 4, padded to whole 16-output blocks");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), steps = K / 4;
  at::Tensor packed = at::zeros({padded_outputs / kLanes, steps, kLanes, 4}, w.options());
  at::Tensor wsum = at::zeros({padded_outputs}, w.options().dtype(at::kInt));
  const int8_t* source = w.data_ptr<int8_t>();
  int8_t* out = packed.data_ptr<int8_t>();
  int32_t* sums = wsum.data_ptr<int32_t>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t b = n / kLanes, l = n % kLanes;
      int32_t sum = 0;
      for (int64_t k = 0; k < K; ++k) {
        out[((b * steps + k / 4) * kLanes + l) * 4 + k % 4] = source[n * K + k];
        sum += source[n * K + k];
      }
      sums[n] = 128 * sum;
    }
  });
  return {packed, wsum};
}

}  // namespace

TORCH_LIBRARY(specdec_w8a8, m) {
  m.def("linear(Tensor x, Tensor packed, Tensor wsum, Tensor scales, Tensor? bias, int isa) -> Tensor");
  m.def("pack(Tensor weight, int padded_outputs) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(specdec_w8a8, CPU, m) {
  m.impl("linear", &w8a8_linear);
  m.impl("pack", &w8a8_pack);
}
