"""Fixed-shape steps, recorded once as CUDA graphs and replayed (docs/architecture.md, "Captured steps").

Launched op by op from Python, a CUDA forward of the native decoder is some 1,700 small
kernels. On an H100 or H200 it costs the same whatever it computes, many times what reading the
1.5B target's weights takes (docs/history.md, "Exact on a GPU: one step shape on CUDA
(exactness, first GPU lease)"): the launches, not the GPU, set the step. A fixed-step runner
(NativeRunner.step_tokens) already gives every forward the same shapes. So each step can be
recorded once (torch.cuda.CUDAGraph) and then replayed with new inputs written into static
buffers. gpt-fast's `reduce-overhead` mode does the same over a static cache.

Recording needs every shape fixed and nothing read from the host mid-step:
- the new tokens per row: the runner's step (a tree of more nodes runs at its padded width);
- the key slots attended: key_bucket() rounds each forward's longest row up to a power of two.
  The blocks past a row's keys are all masked, and an all-masked trailing block adds exactly
  nothing (attention.blocked_attention, "the same terms in the same order"), so the bucket
  changes no value. Chunked prefills and fixed steps already rely on the same property;
- where keys are written: the slot indices come from a device buffer (kv_cache.SlotRows), not
  from Python slices;
- the mask: a chain's is built inside the step from the rows' starts (ChainChunk.bias_of);
  a tree's is built on the host, as eagerly, and copied in.

There is one step per (cache rows, width, bucket, chain or tree, feature layers, head). A replay runs
the very kernels of the eager step on the very shapes, so its logits are the eager step's bits
(benchmarks/cuda_check.py compares them). Where no graph is recorded (capture off, a CPU, or a
capture that failed), the same function runs eagerly: one law either way.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import OrderedDict

import torch

from specdec.models.kv_cache import CacheRows, SlotRows, StaticKVCache
from specdec.models.native.attention import KEY_BLOCK, AttentionPlan, ChainChunk, TreeKeys, round_up
from specdec.models.native.model import NativeDecoder

MIN_KEY_BUCKET = 256  # the smallest key range a step attends over (slots)
MAX_STEPS = 16  # recorded steps kept per runner; the least recently used goes first


def key_bucket(length: int, max_capacity: int) -> int:
    """The key slots a step needing `length` attends over: the next power of two (at least
    MIN_KEY_BUCKET), and never past the cache's largest capacity (whole key blocks)."""
    return min(max(MIN_KEY_BUCKET, 1 << (length - 1).bit_length()), round_up(max_capacity, KEY_BLOCK))


class StaticStep:
    """One fixed-shape forward: its input buffers, the function that reads only them, and its
    recorded graph and output buffers once captured."""

    def __init__(self, decoder: NativeDecoder, cache: StaticKVCache, first_row: int, rows: int, width: int,
                 key_length: int, tree: bool) -> None:
        device = decoder.device
        self.decoder, self.cache = decoder, cache
        self.first_row, self.rows, self.width, self.key_length = first_row, rows, width, key_length
        self.token_ids = torch.zeros(rows, width, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, width, dtype=torch.int64, device=device)
        self.starts = torch.zeros(rows, dtype=torch.int64, device=device)  # each row's cached length
        self.tree = tree
        # A tree's keys (TreeKeys.build at width key_length): once a graph is recorded it reads these
        # tensors, and later steps copy theirs in (the in-place and near parts keep their shapes).
        self.tree_keys: TreeKeys | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, torch.Tensor] | None = None  # the graph's (logits, hidden)

    def compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward over the buffers: logits [rows, width, V], hidden [rows, width, H]."""
        slots = self.starts[:, None] + torch.arange(self.width, device=self.starts.device)  # [rows, width]
        cache = SlotRows(self.cache, self.first_row, self.first_row + self.rows, slots)
        if self.tree:
            plan = AttentionPlan(self.key_length, tree=self.tree_keys)
        else:
            bias = ChainChunk.bias_of(self.starts, 0, self.width, self.key_length, self.decoder.query_groups)
            plan = AttentionPlan(self.key_length, chain=[ChainChunk(0, self.width, self.key_length, bias)])
        return self.decoder.run(self.token_ids, self.positions, cache, plan)

    def record(self, pool) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the step once eagerly (its result is returned: this step's answer), then record it.

        The eager run is on the recording stream, the warm-up torch.cuda.graphs asks for (lazy
        library set-up must not happen inside a capture). Recording executes nothing."""
        device = self.starts.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            outputs = self.compute()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            self.outputs = self.compute()
        self.graph = graph
        return outputs


class FixedSteps:
    """The fixed-width forwards of one NativeRunner, recorded on CUDA where `capture` is set.

    forward() takes a padded step (every row exactly `width` new tokens) and returns fresh
    tensors: a replay's outputs live in the graph's buffers, which the next replay overwrites,
    so they are cloned ([rows, 64, V] fp32, 39 MB a row of the 1.5B target: at the H200's bandwidth
    a small fraction of a replayed step; benchmarks/RESULTS.md, "CUDA graphs: the fixed step recorded
    once and replayed (issue 40, H200)")."""

    def __init__(self, decoder: NativeDecoder, cache: StaticKVCache, capture: bool) -> None:
        self.decoder, self.cache, self.capture = decoder, cache, capture
        self.steps: OrderedDict[tuple, StaticStep] = OrderedDict()
        self.storage: torch.Tensor | None = None  # the cache tensor the steps were built over
        # One memory pool for every graph: they replay one at a time on one stream, so they may
        # share their temporaries (what torch.cuda.make_graphed_callables does).
        self.pool = torch.cuda.graph_pool_handle() if capture and decoder.device.type == "cuda" else None
        self.recorded = 0  # graphs recorded so far (tests, benchmarks)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache | CacheRows,
                first_row: int, among_new: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """token_ids, positions [b, W]; among_new [b, W, W] or None (a chain) -> (logits, hidden)
        over all W tokens. Writes their keys and values and advances the rows' lengths by W."""
        rows, width = token_ids.shape
        starts = list(cache.seq_lens)
        key_length = key_bucket(max(starts) + width, self.cache.max_capacity)
        self.cache.reserve(min(key_length, self.cache.max_capacity))
        if self.storage is not self.cache.keys:  # the cache grew into new tensors: every graph read the old ones
            self.steps.clear()
            self.storage = self.cache.keys
        tree = among_new is not None
        # The head is in the key: a recorded graph holds its weights, and a probe may swap it
        # (invariance.hidden_only), as capture_layers changes what the step returns.
        key = (first_row, rows, width, key_length, tree, self.decoder.feature_layers, self.decoder.head)
        step = self.steps.pop(key, None)
        if step is None:
            step = StaticStep(self.decoder, self.cache, first_row, rows, width, key_length, tree)
        self.steps[key] = step  # the most recently used last
        while len(self.steps) > MAX_STEPS:
            self.steps.popitem(last=False)
        step.token_ids.copy_(token_ids)
        step.positions.copy_(positions)
        step.starts.copy_(torch.tensor(starts))
        if tree:
            keys = TreeKeys.build(starts, among_new, self.decoder.device, width=key_length)
            if step.graph is not None:  # it reads the recorded step's tensors: this step's go into them
                recorded = {name: getattr(step.tree_keys, name) for name in ("far_bias", "near_index", "near_bias")
                            if getattr(keys, name) is not None}  # (a CPU with its kernels builds the tail form)
                for name, tensor in recorded.items():
                    tensor.copy_(getattr(keys, name))
                keys = dataclasses.replace(keys, **recorded)
            step.tree_keys = keys
        if step.graph is not None:
            step.graph.replay()
            logits, hidden = (tensor.clone() for tensor in step.outputs)
        elif self.capture:
            logits, hidden = self._record(step)
        else:
            logits, hidden = step.compute()
        cache.advance(width)
        return logits, hidden

    def _record(self, step: StaticStep) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            outputs = step.record(self.pool)
        except RuntimeError as error:  # say so once, and go on eagerly: the same function, so the same bits
            print(f"specdec: recording a CUDA graph failed ({error}); running steps eagerly", file=sys.stderr)
            self.capture = False
            step.graph = step.outputs = None
            return step.compute()
        self.recorded += 1
        return outputs
