// The decoder layer's small ops in one call each: RMSNorm, and q/k/v split + RoPE + head layout.
//
// Why: in PyTorch ops RMSNorm is 7 dispatches and RoPE on q and k with its rotate-half another ~16, so
// a one-token step of the 28-layer 1.5B target spent ~7 of ~55 ms in ~1,100 small ops (profile on a
// 2-core AMD EPYC, AVX2), mostly dispatch, not arithmetic.
//
// The same law as model.py's PyTorch forms, rounded at the same points:
// - rms_norm: y = dtype(w * dtype(x * r)), r = 1 / sqrt(sum(x^2) / H + eps), with the sum of squares
//   in fp32 over 16 fixed lanes and a fixed tree (PyTorch's mean sums in an order of its own, so
//   the last bit may differ from the fallback; the order here is the same on every row count and
//   instruction set);
// - rope: q' = dtype(dtype(q * cos) + dtype(rotate_half(q) * sin)), exactly PyTorch's three
//   rounded ops.
// Batch invariance by construction: every row's arithmetic is its own. Compiled without FMA
// contraction (-ffp-contract=off), so GCC's AVX2/AVX-512 clones round like the scalar code.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "layer_kernels.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int kLanes = 16;

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SPECDEC_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define SPECDEC_CLONES
#endif

template <typename T>
inline T round_to(float x) { return static_cast<T>(x); }

template <typename T>
SPECDEC_CLONES void rms_norm_row(const T* x, const T* weight, T* out, int64_t hidden, float eps) {
  float lanes[kLanes] = {0};
  int64_t k = 0;
  for (; k + kLanes <= hidden; k += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const float v = static_cast<float>(x[k + l]);
      lanes[l] = lanes[l] + v * v;
    }
  for (int l = 0; k + l < hidden; ++l) {
    const float v = static_cast<float>(x[k + l]);
    lanes[l] = lanes[l] + v * v;
  }
  for (int width = kLanes / 2; width >= 1; width /= 2)
    for (int l = 0; l < width; ++l) lanes[l] = lanes[l] + lanes[l + width];
  const float r = 1.f / std::sqrt(lanes[0] / static_cast<float>(hidden) + eps);
  for (int64_t i = 0; i < hidden; ++i) {
    const T normed = round_to<T>(static_cast<float>(x[i]) * r);
    out[i] = round_to<T>(static_cast<float>(weight[i]) * static_cast<float>(normed));
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.size(-1) == weight.numel() && x.scalar_type() == weight.scalar_type(),
              "rms_norm: weight must be [H] in x's dtype");
  const at::Tensor input = x.contiguous(), w = weight.contiguous();
  at::Tensor out = at::empty_like(input);
  const int64_t hidden = input.size(-1), rows = input.numel() / hidden;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, input.scalar_type(), "rms_norm", [&] {
    const scalar_t* xs = input.data_ptr<scalar_t>();
    const scalar_t* ws = w.data_ptr<scalar_t>();
    scalar_t* os = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m)
        rms_norm_row<scalar_t>(xs + m * hidden, ws, os + m * hidden, hidden, static_cast<float>(eps));
    });
  });
  return out;
}

// One head of one token: dst = dtype(dtype(src * cos) + dtype(rotate_half(src) * sin)).
template <typename T>
SPECDEC_CLONES void rope_head(const T* src, const T* cos, const T* sin, T* dst, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t d = 0; d < dim; ++d) {
    const float rotated = d < half ? -static_cast<float>(src[d + half]) : static_cast<float>(src[d - half]);
    const T a = round_to<T>(static_cast<float>(src[d]) * static_cast<float>(cos[d]));
    const T b = round_to<T>(static_cast<float>(round_to<T>(rotated)) * static_cast<float>(sin[d]));
    dst[d] = round_to<T>(static_cast<float>(a) + static_cast<float>(b));
  }
}

// qkv [B, T, (Hq + 2 Hkv) D] (the fused projection's output), cos/sin [B, 1, T, D] ->
// q [B, Hq, T, D] rotated; the keys rotated and the values to (key_out, value_out) at token (b, t),
// KV head h: key_out + b * row_stride + h * head_stride + t * dim, contiguous over dim: model.py's
// split, view, transpose and RoPE in one pass.
template <typename T>
void split_rope_rows(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                     int64_t kv_heads, int64_t dim, at::Tensor& q, T* const* key_rows, T* const* value_rows,
                     int64_t head_stride) {
  const int64_t batch = qkv.size(0), steps = qkv.size(1);
  TORCH_CHECK(qkv.dim() == 3 && qkv.size(2) == (heads + 2 * kv_heads) * dim,
              "split_rope: qkv must be [B, T, (heads + 2 kv_heads) dim]");
  TORCH_CHECK(cos.numel() == batch * steps * dim && sin.numel() == cos.numel() &&
                  cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "split_rope: cos and sin must be [B, 1, T, D] in qkv's dtype");
  const at::Tensor source = qkv.contiguous(), c = cos.contiguous(), s = sin.contiguous();
  const int64_t width = (heads + 2 * kv_heads) * dim;
  const T* src = source.data_ptr<T>();
  const T* cs = c.data_ptr<T>();
  const T* sn = s.data_ptr<T>();
  T* qs = q.data_ptr<T>();
  at::parallel_for(0, batch * steps, 4, [&](int64_t begin, int64_t end) {
    for (int64_t bt = begin; bt < end; ++bt) {
      const int64_t b = bt / steps, t = bt % steps;
      const T* row = src + bt * width;
      const T* row_cos = cs + bt * dim;
      const T* row_sin = sn + bt * dim;
      for (int64_t h = 0; h < heads; ++h)
        rope_head<T>(row + h * dim, row_cos, row_sin, qs + ((b * heads + h) * steps + t) * dim, dim);
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t at = h * head_stride + t * dim;
        rope_head<T>(row + (heads + h) * dim, row_cos, row_sin, key_rows[b] + at, dim);
        const T* value = row + (heads + kv_heads + h) * dim;
        for (int64_t d = 0; d < dim; ++d) value_rows[b][at + d] = value[d];
      }
    }
  });
}

// -> q [B, Hq, T, D] and k [B, Hkv, T, D] rotated, v [B, Hkv, T, D].
std::vector<at::Tensor> split_rope(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                   int64_t heads, int64_t kv_heads, int64_t dim) {
  TORCH_CHECK(qkv.dim() == 3, "split_rope: qkv must be [B, T, (heads + 2 kv_heads) dim]");
  const int64_t batch = qkv.size(0), steps = qkv.size(1);
  at::Tensor q = at::empty({batch, heads, steps, dim}, qkv.options());
  at::Tensor k = at::empty({batch, kv_heads, steps, dim}, qkv.options());
  at::Tensor v = at::empty({batch, kv_heads, steps, dim}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "split_rope", [&] {
    std::vector<scalar_t*> key_rows(batch), value_rows(batch);
    for (int64_t b = 0; b < batch; ++b) {
      key_rows[b] = k.data_ptr<scalar_t>() + b * kv_heads * steps * dim;
      value_rows[b] = v.data_ptr<scalar_t>() + b * kv_heads * steps * dim;
    }
    split_rope_rows<scalar_t>(qkv, cos, sin, heads, kv_heads, dim, q, key_rows.data(), value_rows.data(),
                              steps * dim);
  });
  return {q, k, v};
}

}  // namespace

namespace specdec {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) { return ::rms_norm(x, weight, eps); }

at::Tensor split_rope_into_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                                 int64_t kv_heads, int64_t dim, const at::Tensor& cache_keys,
                                 const at::Tensor& cache_values, int64_t layer, int64_t first_row,
                                 at::IntArrayRef starts) {
  TORCH_CHECK(qkv.dim() == 3, "split_rope: qkv must be [B, T, (heads + 2 kv_heads) dim]");
  const int64_t batch = qkv.size(0), steps = qkv.size(1);
  TORCH_CHECK(cache_keys.dim() == 5 && cache_keys.sizes() == cache_values.sizes() &&
                  cache_keys.strides() == cache_values.strides() && cache_keys.stride(4) == 1 &&
                  cache_keys.stride(3) == dim && cache_keys.size(2) == kv_heads && cache_keys.size(4) == dim &&
                  cache_keys.scalar_type() == qkv.scalar_type() && cache_values.scalar_type() == qkv.scalar_type(),
              "split_rope_into_cache: the cache must be [L, rows, Hkv, S, D] in qkv's dtype, each head's slots "
              "contiguous");
  TORCH_CHECK(layer >= 0 && layer < cache_keys.size(0) && first_row >= 0 &&
                  static_cast<int64_t>(starts.size()) == batch && first_row + batch <= cache_keys.size(1),
              "split_rope_into_cache: a layer and rows of the cache, one start per row");
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(starts[b] >= 0 && starts[b] + steps <= cache_keys.size(3), "split_rope_into_cache: row ", b,
                "'s tokens do not fit the cache");
  at::Tensor q = at::empty({batch, heads, steps, dim}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "split_rope_into_cache", [&] {
    std::vector<scalar_t*> key_rows(batch), value_rows(batch);
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t at = layer * cache_keys.stride(0) + (first_row + b) * cache_keys.stride(1) + starts[b] * dim;
      key_rows[b] = cache_keys.data_ptr<scalar_t>() + at;
      value_rows[b] = cache_values.data_ptr<scalar_t>() + at;
    }
    split_rope_rows<scalar_t>(qkv, cos, sin, heads, kv_heads, dim, q, key_rows.data(), value_rows.data(),
                              cache_keys.stride(2));
  });
  return q;
}

}  // namespace specdec

TORCH_LIBRARY(specdec_layer, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("split_rope(Tensor qkv, Tensor cos, Tensor sin, int heads, int kv_heads, int dim) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(specdec_layer, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("split_rope", &split_rope);
}
