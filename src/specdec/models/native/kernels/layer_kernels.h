// The kernels that kernels/block.cpp calls directly, without the dispatcher and the views, copies and
// temporaries of their op forms around them (benchmarks/RESULTS.md, "The block's glue fused: 4-5%
// off the draft's step").
// Each does the same arithmetic as its op form, so the same bits (tests/models/test_layer_ops.py
// compares a model's blocks in one call with its op-by-op form).
#pragma once

#include <ATen/ATen.h>

namespace specdec {

// w4a8.cpp: specdec_w4a8::linear of x [..., K] (contiguous) into [..., columns] in x's dtype, with
// residual [..., columns] (x's dtype) added where given: dtype(float(y) + float(residual)), the
// bits of `residual + y` in ATen.
at::Tensor w4a8_project(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& codes,
                        const at::Tensor& supers, const c10::optional<at::Tensor>& bias, int64_t isa,
                        int64_t columns, const at::Tensor* residual);

// layer_ops.cpp: specdec_layer::rms_norm.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// layer_ops.cpp: specdec_layer::silu_mul, the MLP's silu(gate) * up of gate_up [..., 2I] -> [..., I].
at::Tensor silu_mul(const at::Tensor& gate_up);

// layer_ops.cpp: specdec_layer::split_rope, with the rotated keys and the values written straight
// into the cache (keys and values [L, rows, Hkv, S, D] in qkv's dtype: layer `layer`, rows
// first_row .., row b's tokens at slots starts[b] ..). Returns the rotated queries [B, Hq, T, D].
at::Tensor split_rope_into_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                                 int64_t kv_heads, int64_t dim, const at::Tensor& cache_keys,
                                 const at::Tensor& cache_values, int64_t layer, int64_t first_row,
                                 at::IntArrayRef starts);

// attention.cpp: specdec_attention::blocked of a chain's queries q [B, Hq, T, D] (contiguous; heads
// grouped onto their KV head as attention.py's chain_attention groups them) over the first
// key_length slots of cache rows first_row .. of layer `layer`, with the chain's bias
// [B, 1, 1, nb, T' | 1, blk]. Returns [B, T, Hq * D] in the cache's dtype.
at::Tensor chain_attention(const at::Tensor& q, const at::Tensor& cache_keys, const at::Tensor& cache_values,
                           int64_t layer, int64_t first_row, int64_t key_length, const at::Tensor& bias,
                           int64_t block);

}  // namespace specdec
