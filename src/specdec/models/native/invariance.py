"""The invariance probe: are a position's logits independent of who shares its forward?

Speculative greedy output is token for token plain greedy output only if they
are (docs/architecture.md, "Batch invariance"). attention.py fixes the reduction order by
construction; what it cannot fix is a BLAS library that rounds a GEMM row
differently depending on how many rows share the call. So this module checks,
on the machine it runs on and at the model's real shapes:

- projections: every linear of the first block and the output head, fed M rows,
  gives each row bit-identically to that row alone (M = 1 .. 64); on a runner
  that runs fixed steps of S tokens (CUDA, NativeRunner.step_tokens), M = S x b
  rows against each block of S alone (b = 1 .. 8: the rows of a batched step);
- chunkings: a window of 9 new tokens after a context of c tokens, fed as
  [1]*9, [9], [3,3,3], [5,4], [2,2,2,2,1], gives bit-identical hidden states
  and logits;
- batched rows: three rows of different lengths decoded together equal each
  row decoded alone;
- trees: a 7-node draft tree verified in one forward equals each of its paths
  decoded one token at a time.

`cheap_probe` (projections plus attention on random tensors at the model's head
dimensions; well under a second) runs once per loaded native runner;
`specdec doctor` runs everything on the user's model.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from specdec.models.native.attention import AttentionPlan
from specdec.models.native.config import DecoderConfig
from specdec.models.native.model import NativeDecoder

CHUNKINGS: tuple[tuple[int, ...], ...] = ((1,) * 9, (9,), (3, 3, 3), (5, 4), (2, 2, 2, 2, 1))
PROJECTION_ROWS = (1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64)
CHEAP_ROWS = (1, 2, 3, 5, 9, 17, 33)  # 33: oneDNN's bf16 matmul changes kernels there under AMX


def contexts_around_powers_of_two(largest: int = 4096, smallest: int = 16) -> list[int]:
    """c - 1, c, c + 1 for every power of two c in [smallest, largest]: where blockings change."""
    lengths, power = [], smallest
    while power <= largest:
        lengths += [power - 1, power, power + 1]
        power *= 2
    return lengths


@dataclass(frozen=True)
class ProbeCase:
    name: str
    identical: bool
    max_abs_diff: float


@dataclass
class InvarianceReport:
    cases: list[ProbeCase] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(case.identical for case in self.cases)

    @property
    def failures(self) -> list[ProbeCase]:
        return [case for case in self.cases if not case.identical]

    def add(self, name: str, got: torch.Tensor, expected: torch.Tensor) -> None:
        identical = got.shape == expected.shape and torch.equal(got, expected)
        diff = 0.0 if identical else float((got.float() - expected.float()).abs().nan_to_num(float("inf")).max())
        self.cases.append(ProbeCase(name, identical, diff))

    def extend(self, other: InvarianceReport) -> InvarianceReport:
        self.cases += other.cases
        return self


def decoder_projections(decoder: NativeDecoder) -> dict[str, torch.nn.Module]:
    """The distinct projection shapes of the model: the first block's four and the output head."""
    block = decoder.blocks[0]
    return {"qkv": block.attention.qkv, "o": block.attention.out, "gate_up": block.mlp.gate_up,
            "down": block.mlp.down, "head": decoder.head}


STEP_BLOCKS = (1, 2, 3, 4, 8)  # rows of a batched step, in blocks of step_tokens


@torch.inference_mode()
def probe_projections(decoder: NativeDecoder, row_counts=PROJECTION_ROWS, seed: int = 0,
                      step: int | None = None) -> InvarianceReport:
    """Each projection fed M rows must give each row exactly as it gives that row alone; with
    step (a runner's fixed step_tokens), each block of step rows as that block alone, for
    M = step x STEP_BLOCKS: the only row counts such a runner calls its projections with."""
    report = InvarianceReport()
    generator = torch.Generator().manual_seed(seed)
    unit = step or 1
    counts = [unit * blocks for blocks in STEP_BLOCKS] if step else list(row_counts)
    for name, linear in decoder_projections(decoder).items():
        width = linear.in_features if hasattr(linear, "in_features") else linear.weight.shape[1]
        rows = torch.randn(max(counts), width, generator=generator).to(decoder.device, decoder.dtype)
        alone = torch.cat([linear(rows[i:i + unit]) for i in range(0, max(counts), unit)])
        for count in counts:
            together = linear(rows[:count])
            label = f"{count} rows" if step is None else f"{count} rows vs blocks of {step}"
            report.add(f"projection {name} {together.shape[-1]}x{width}, {label}", together, alone[:count])
    return report


@torch.inference_mode()
def probe_attention(config: DecoderConfig, device: torch.device, dtype: torch.dtype,
                    contexts=(7, 60, 200, 500), seed: int = 0, step: int | None = None) -> InvarianceReport:
    """The attention alone on random tensors at the model's head dimensions: each chunking of a
    9-token window after c cached tokens against one token at a time (no weights needed).
    step: each chunk's queries padded to step (a fixed-step runner's calls)."""
    report = InvarianceReport()
    generator = torch.Generator().manual_seed(seed)
    groups = config.num_heads // config.num_kv_heads
    for context in contexts:
        window = 9
        length = context + window
        query = torch.randn(1, config.num_heads, window, config.head_dim, generator=generator).to(device, dtype)
        padding = step or 0
        keys = torch.randn(1, config.num_kv_heads, length + 64 + padding, config.head_dim,
                           generator=generator).to(device, dtype)
        values = torch.randn(keys.shape, generator=generator).to(device, dtype)
        extra = torch.randn(1, config.num_heads, padding, config.head_dim, generator=generator).to(device, dtype)
        outputs = []
        for chunks in CHUNKINGS:
            parts, start = [], context
            for size in chunks:
                width = max(size, step or size)
                plan = AttentionPlan.build([start], width, groups, None, device)
                offset = start - context
                queries = torch.cat([query[:, :, offset:offset + size], extra[:, :, :width - size]], dim=2)
                parts.append(plan.attend(queries, keys[:, :, :plan.key_length],
                                         values[:, :, :plan.key_length])[:, :, :size])
                start += size
            outputs.append(torch.cat(parts, dim=2))
        for chunks, output in zip(CHUNKINGS[1:], outputs[1:]):
            report.add(f"attention, context {context}, chunks {list(chunks)}", output, outputs[0])
    return report


def cheap_probe(decoder: NativeDecoder, step: int | None = None) -> InvarianceReport:
    """What a loaded runner checks once: projections (up to 33 rows, or the blocks of a fixed-step
    runner's calls) and attention on random tensors."""
    report = probe_projections(decoder, CHEAP_ROWS, step=step)
    return report.extend(probe_attention(decoder.config, decoder.device, decoder.dtype, step=step))


def _window(runner, context_ids: torch.Tensor, window_ids: torch.Tensor, chunks, row: slice | None = None):
    """Feed window_ids after the already-cached context in chunks -> (logits [1, n, V], hidden [1, n, H])."""
    context = context_ids.shape[1]
    logits, hidden, start = [], [], 0
    for size in chunks:
        positions = torch.arange(context + start, context + start + size)[None]
        out = runner.forward(window_ids[:, start:start + size], positions, rows=row)
        logits.append(out.logits)
        hidden.append(out.hidden)
        start += size
    return torch.cat(logits, dim=1), torch.cat(hidden, dim=1)


@contextmanager
def hidden_only(decoder: NativeDecoder):
    """The decoder's output head swapped for a one-output one while inside: its logits are
    meaningless, its hidden states (the head's input) unchanged. For probes that compare hidden
    states where the head's own row-invariance is probe_projections' to show: hidden identical and
    the head row-invariant give identical logits. The head was 80-90% of a chunking probe's time
    (one read of a 151,936-row matrix per call, compute-bound in emulated bf16)."""
    head = decoder.head
    decoder.head = torch.nn.Linear(decoder.config.hidden_size, 1, bias=False, device=decoder.device,
                                   dtype=decoder.dtype)
    try:
        yield
    finally:
        decoder.head = head


@torch.inference_mode()
def probe_chunkings(runner, contexts, seed: int = 0, progress=None, keep_last_context: bool = False
                    ) -> InvarianceReport:
    """The full model: every chunking of a 9-token window after c context tokens, for each c.

    Every c reads the same random token stream: its context is prefilled by extending the previous
    c's (growing contexts cost one prefill of the longest, not one per c), and each chunking then
    rolls the cache back to it. keep_last_context: the cache is left holding the last c's context
    (probe_tree can go on from it) instead of emptied. The logits are compared at the last c; at
    the others the hidden states alone (hidden_only: the head is a projection, probed by row count
    in probe_projections)."""
    report = InvarianceReport()
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, runner.vocab_size, (1, max(contexts, default=0) + 9), generator=generator)
    runner.reset()
    cached = 0
    for context in contexts:
        if context < cached:  # contexts out of order: start again from an empty cache
            runner.reset()
            cached = 0
        runner.truncate([cached])  # drop the last window
        if context > cached:
            runner.forward(ids[:, cached:context], torch.arange(cached, context)[None], last_n_logits=1)
        cached = context
        results, with_logits = [], context == contexts[-1] or runner.head_rows is not None
        with nullcontext() if with_logits else hidden_only(runner.decoder):
            for chunks in CHUNKINGS:
                runner.truncate([context])
                results.append(_window(runner, ids[:, :context], ids[:, context:], chunks))
        for chunks, (logits, hidden) in zip(CHUNKINGS[1:], results[1:]):
            report.add(f"model, context {context}, chunks {list(chunks)}: hidden", hidden, results[0][1])
            if with_logits:
                report.add(f"model, context {context}, chunks {list(chunks)}: logits", logits, results[0][0])
        if progress is not None:
            progress(context)
    if keep_last_context and contexts:
        runner.truncate([contexts[-1]])
    else:
        runner.reset()
    return report


@torch.inference_mode()
def probe_batched_rows(runner, context: int, seed: int = 0) -> InvarianceReport:
    """Three rows of lengths context - 5, context, context + 3 decoded side by side (chunks [4, 5])
    against each row alone (one token at a time, in a one-row runner)."""
    report = InvarianceReport()
    generator = torch.Generator().manual_seed(seed)
    lengths = [max(1, context - 5), context, context + 3]
    rows = [torch.randint(0, runner.vocab_size, (1, n + 9), generator=generator) for n in lengths]
    batched = runner.with_batch_size(len(rows), initial_cache_len=max(lengths) + 16)
    alone = runner.with_batch_size(1, initial_cache_len=max(lengths) + 16)
    for index, (length, ids) in enumerate(zip(lengths, rows)):
        batched.forward(ids[:, :length], torch.arange(length)[None], rows=slice(index, index + 1), last_n_logits=1)
    logits, start = [], 0
    for size in (4, 5):
        tokens = torch.cat([ids[:, n + start:n + start + size] for n, ids in zip(lengths, rows)])
        positions = torch.stack([torch.arange(n + start, n + start + size) for n in lengths])
        logits.append(batched.forward(tokens, positions).logits)
        start += size
    together = torch.cat(logits, dim=1)
    for index, (length, ids) in enumerate(zip(lengths, rows)):
        alone.reset()
        alone.forward(ids[:, :length], torch.arange(length)[None], last_n_logits=1)
        expected, _ = _window(alone, ids[:, :length], ids[:, length:], CHUNKINGS[0])
        report.add(f"batched rows {lengths}, chunks [4, 5]: row {index} vs alone", together[index:index + 1],
                   expected)
    return report


TREE_PARENTS = (-1, -1, 0, 0, 2, 1, 4)  # root -> 0 -> {2 -> 4 -> 6, 3}; root -> 1 -> 5 (sampling/tree.py)


@torch.inference_mode()
def probe_tree(runner, context: int, seed: int = 0, prefilled: bool = False) -> InvarianceReport:
    """A tree of 7 drafts after the root token, verified in one forward (tree verification):
    each node's logits must be bit-identical to its path decoded one token at a time. prefilled:
    the runner's cache already holds `context` tokens (probe_chunkings(keep_last_context=True)),
    so they are not read again."""
    from specdec.sampling.tree import tree_attention_mask, tree_depths, tree_paths

    report = InvarianceReport()
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, runner.vocab_size, (1, context + 1 + len(TREE_PARENTS)), generator=generator)
    prefix, root, nodes = ids[:, :context], ids[:, context:context + 1], ids[:, context + 1:]
    if not prefilled:
        runner.reset()
        runner.forward(prefix, torch.arange(context)[None], last_n_logits=1)
    positions = context + torch.tensor([[0, *tree_depths(TREE_PARENTS)]])
    tree = runner.forward(torch.cat([root, nodes], dim=1), positions,
                          among_new=tree_attention_mask(TREE_PARENTS)[None]).logits
    for path in tree_paths(TREE_PARENTS):
        runner.truncate([context])
        path_ids = torch.cat([root, nodes[:, path]], dim=1)
        expected, _ = _window(runner, prefix, path_ids, (1,) * path_ids.shape[1])
        report.add(f"tree after context {context}: path {list(path)} vs one token at a time",
                   tree[:, [0] + [node + 1 for node in path]], expected)
    runner.reset()
    return report


def random_decoder(config: DecoderConfig, *, dtype: torch.dtype, device: torch.device | str = "cpu",
                   quantize: str = "none", seed: int = 0) -> NativeDecoder:
    """A decoder of the given shapes with random weights (std 0.02, RMSNorm weights 1): real
    shapes without the real weights, for probes and tests of kernels."""
    generator = torch.Generator().manual_seed(seed)
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim

    def weight(*shape):
        return torch.randn(*shape, generator=generator).mul_(0.02)

    weights = {"model.embed_tokens.weight": weight(config.vocab_size, hidden), "model.norm.weight": torch.ones(hidden)}
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}."
        for name, rows in (("q", q_size), ("k", kv_size), ("v", kv_size)):
            weights[f"{prefix}self_attn.{name}_proj.weight"] = weight(rows, hidden)
            if config.qkv_bias:
                weights[f"{prefix}self_attn.{name}_proj.bias"] = weight(rows)
        weights[f"{prefix}self_attn.o_proj.weight"] = weight(hidden, q_size)
        weights[f"{prefix}mlp.gate_proj.weight"] = weight(inter, hidden)
        weights[f"{prefix}mlp.up_proj.weight"] = weight(inter, hidden)
        weights[f"{prefix}mlp.down_proj.weight"] = weight(hidden, inter)
        weights[f"{prefix}input_layernorm.weight"] = torch.ones(hidden)
        weights[f"{prefix}post_attention_layernorm.weight"] = torch.ones(hidden)
    if not config.tie_word_embeddings:
        weights["lm_head.weight"] = weight(config.vocab_size, hidden)
    return NativeDecoder.from_state_dict(config, weights, dtype=dtype, device=torch.device(device), quantize=quantize)


# One block of Qwen2.5-1.5B (the embedded target) at its real shapes: what `doctor --synthetic` and the tests probe.
QWEN2_5_1_5B_LAYER = DecoderConfig(
    model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=1, num_heads=12,
    num_kv_heads=2, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768,
    tie_word_embeddings=True, qkv_bias=True)
