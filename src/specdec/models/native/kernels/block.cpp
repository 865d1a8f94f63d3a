// The w4a8 target's decoder blocks in one call: model.py's Block.forward for a chain of new tokens,
// block after block.
//
// Why: a one-token step of the 28-layer 1.5B target ran ~40 PyTorch ops and 9 module calls per
// layer from Python. With the weights' work taken out (the same 28 layers at hidden size 128), that
// glue alone cost ~4.9 ms of a ~43 ms step on a 2-core Zen 4 EPYC. Here the same ops run from C++
// (python benchmarks/native_kernels.py --blocks measures both forms in one process).
//
// The same arithmetic in the same order as the Python form, so the same bits (tests compare them):
//   h = rms_norm(x); q, k, v = split_rope(qkv(h)); cache[row, :, start:start+T] = k, v;
//   a = blocked attention of q over the cache's first key_length slots (one ChainChunk's bias);
//   x = x + o(a); x = x + down(silu(gate) * up) with gate, up = gate_up(rms_norm(x)).
// rms_norm, split_rope, blocked attention, silu_mul and the w4a8 projections are specdec's own
// kernels, called directly (layer_kernels.h): the keys and values go from the RoPE pass straight into
// the cache, the attention reads its queries and writes its output in the layouts around it, and the
// residual adds happen in the o and down projections' passes. Those were ~25 ATen views, copies,
// conversions and adds a layer, and after the projections stream megabytes of weights each ran from
// cold caches: taking them out made the 0.5B draft's step 4-5% faster and the 1.5B target's 2.5-3%
// (2-core AMX Xeon; benchmarks/RESULTS.md, "The block's glue fused: 4-5% off the draft's step (issue
// 38, item 3)").
// silu(gate) * up is layer_ops.cpp's kernel, which model.py's MLP calls too.
//
// chain_layers runs every block of the model in one call (or one block, where benchmarks compare the
// two forms): the Python loop over blocks, with its module calls and argument lists, cost 41-70 us a
// layer (1.0-1.7 ms of a forward of the 24-layer 0.5B draft, whose step takes ~30 ms, on the 2-core
// AMX Xeon; docs/history.md, "Every block in one call: the layer loop in C++ (issue 38, item 3)").

#include <ATen/ATen.h>
#include <torch/library.h>

#include "layer_kernels.h"

#include <cstdint>
#include <vector>

namespace {

// The chain's attention: which cache rows and slots it writes and reads (the same for every layer).
struct ChainCache {
  const at::Tensor& keys;    // [L, rows, Hkv, S, D]
  const at::Tensor& values;  // [L, rows, Hkv, S, D]
  int64_t first_row;
  at::IntArrayRef starts;
  int64_t key_length;
  const at::Tensor& bias;
  int64_t block;
};

// One layer. weights: for qkv, o, gate_up, down in turn, (packed, codes, supers); biases: one per
// projection or none; outputs: each projection's real output count. x [B, T, H]; cos, sin [B, 1, T, D];
// the block's rows are first_row .. first_row + B, and row b's new tokens go to slots starts[b] ..;
// bias: the forward's one ChainChunk bias.
at::Tensor layer_forward(const at::Tensor& x, const at::Tensor& attention_norm, const at::Tensor& mlp_norm, double eps,
                         const at::Tensor* weights, const c10::optional<at::Tensor>* biases, at::IntArrayRef outputs,
                         int64_t isa, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t kv_heads,
                         int64_t dim, const ChainCache& cache, int64_t layer) {
  TORCH_CHECK(static_cast<int64_t>(cache.starts.size()) == x.size(0), "chain_layers: one start per row");
  // [B, T, K] -> [B, T, N] (+ residual), as W4A8Linear.forward (and the add after it)
  auto project = [&](int index, const at::Tensor& input, const at::Tensor* residual = nullptr) {
    return specdec::w4a8_project(input, weights[3 * index], weights[3 * index + 1], weights[3 * index + 2],
                                 biases[index], isa, outputs[index], residual);
  };

  // Attention (model.py's Attention.forward and attention.py's chain_attention, one chunk): the new
  // keys and values go straight into the cache, the output comes back as [B, T, Hq * D].
  const at::Tensor qkv = project(0, specdec::rms_norm(x, attention_norm, eps));
  const at::Tensor q = specdec::split_rope_into_cache(qkv, cos, sin, heads, kv_heads, dim, cache.keys, cache.values,
                                                      layer, cache.first_row, cache.starts);
  const at::Tensor attended = specdec::chain_attention(q, cache.keys, cache.values, layer, cache.first_row,
                                                       cache.key_length, cache.bias, cache.block);
  const at::Tensor mid = project(1, attended, &x);  // x + o(a)

  // MLP (model.py's MLP.forward): x + down(silu(gate) * up).
  const at::Tensor hidden = specdec::silu_mul(project(2, specdec::rms_norm(mid, mlp_norm, eps)));
  return project(3, hidden, &mid);
}

// Blocks first_layer, first_layer + 1, ... in turn (model.py's ChainCall): norms, weights and biases
// are the blocks' in order (2, 12 and 4 a block); outputs are shared (every block has the same
// shapes). Returns the last block's output, then the stream entering each layer in `capture`
// (EAGLE-3's features), in capture's order.
std::vector<at::Tensor> chain_layers(const at::Tensor& x, at::TensorList norms, double eps, at::TensorList weights,
                                     const c10::List<c10::optional<at::Tensor>>& biases, at::IntArrayRef outputs,
                                     int64_t isa, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                                     int64_t kv_heads, int64_t dim, const at::Tensor& cache_keys,
                                     const at::Tensor& cache_values, int64_t first_row, at::IntArrayRef starts,
                                     int64_t key_length, const at::Tensor& bias, int64_t block,
                                     at::IntArrayRef capture, int64_t first_layer) {
  const int64_t layers = static_cast<int64_t>(norms.size()) / 2;
  TORCH_CHECK(x.dim() == 3 && static_cast<int64_t>(norms.size()) == 2 * layers &&
                  static_cast<int64_t>(weights.size()) == 12 * layers &&
                  static_cast<int64_t>(biases.size()) == 4 * layers && outputs.size() == 4,
              "chain_layers: x [B, T, H], per block 2 norms, 4 projections of (packed, codes, supers) and 4 biases; "
              "4 output counts");
  const ChainCache cache{cache_keys, cache_values, first_row, starts, key_length, bias, block};
  std::vector<at::Tensor> out(1 + capture.size());
  at::Tensor h = x;
  for (int64_t i = 0; i < layers; ++i) {
    const int64_t layer = first_layer + i;
    for (size_t c = 0; c < capture.size(); ++c)
      if (capture[c] == layer) out[1 + c] = h;
    const c10::optional<at::Tensor> layer_biases[4] = {biases.get(4 * i), biases.get(4 * i + 1), biases.get(4 * i + 2),
                                                       biases.get(4 * i + 3)};
    h = layer_forward(h, norms[2 * i], norms[2 * i + 1], eps, weights.data() + 12 * i, layer_biases, outputs, isa,
                      cos, sin, heads, kv_heads, dim, cache, layer);
  }
  out[0] = h;
  for (size_t i = 0; i < capture.size(); ++i)
    TORCH_CHECK(out[1 + i].defined(), "chain_layers: capture layer ", capture[i], " is not among blocks ",
                first_layer, "..", first_layer + layers - 1);
  return out;
}

}  // namespace

TORCH_LIBRARY(specdec_block, m) {
  m.def("chain_layers(Tensor x, Tensor[] norms, float eps, Tensor[] weights, Tensor?[] biases, int[] outputs, int isa, "
        "Tensor cos, Tensor sin, int heads, int kv_heads, int dim, Tensor cache_keys, Tensor cache_values, "
        "int first_row, int[] starts, int key_length, Tensor bias, int block, int[] capture, int first_layer) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(specdec_block, CPU, m) {
  m.impl("chain_layers", &chain_layers);
}
