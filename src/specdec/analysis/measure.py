"""Measure the two inputs of the theory on the user's own models and hardware.

alpha (Leviathan et al. 2022, Definition 3.1): E[sum_x min(p(x), q(x))] over the
positions of a text, p and q the target's and the draft's next-token
distributions warped with the same sampling parameters. One forward of each
model over the whole text gives every position at once: no generation needed.

c (section 3.4): the time of one draft step over the time of one target step,
both single-token decode steps at the same context length on this machine. The
verification pass of k + 1 tokens is timed too, because on real hardware it is
not free, which is where measurement and the closed form part ways.

forward_costs is the one timing of forwards every cost table here is built from
(`specdec analyze`, `specdec doctor`'s roofline, `specdec costs` and
benchmarks/verify_cost.py through analysis/machine_costs.py).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.planning.theory import acceptance_rate
from specdec.models.runner import ModelRunner
from specdec.sampling.params import SamplingParams
from specdec.sampling.tree import tree_attention_mask
from specdec.sampling.warp import warp_logits


@dataclass(frozen=True)
class ScoredText:
    category: str
    token_ids: list[int]  # the whole text, prompt included
    first_scored: int  # positions before this one are context only (the prompt)


def _next_token_logits(runner: ModelRunner, token_ids: list[int]) -> torch.Tensor:
    runner.reset()
    ids = torch.tensor([token_ids], dtype=torch.int64, device=runner.device)
    positions = torch.arange(len(token_ids), device=runner.device)[None]
    logits = runner.forward(ids, positions).logits[0]  # [T, V]
    runner.reset()
    return logits


@torch.inference_mode()
def acceptance_per_position(target: ModelRunner, draft: ModelRunner, text: ScoredText,
                            params: SamplingParams, chunk: int = 256) -> torch.Tensor:
    """beta at every scored position of one text: [T - first_scored] float32.

    Position t scores the distributions of token t given tokens < t, so logits
    t - 1 are compared. Warping runs in chunks to bound memory (V is ~150k).
    """
    if not 1 <= text.first_scored < len(text.token_ids):
        raise ValueError(f"first_scored must lie in [1, {len(text.token_ids) - 1}], got {text.first_scored}")
    limit = min(target.max_context, draft.max_context)
    if len(text.token_ids) > limit:
        raise ValueError(f"a text of {len(text.token_ids)} tokens exceeds the models' context ({limit})")
    target_logits = _next_token_logits(target, text.token_ids)[text.first_scored - 1: -1]
    draft_logits = _next_token_logits(draft, text.token_ids)[text.first_scored - 1: -1]
    width = min(target_logits.shape[-1], draft_logits.shape[-1])  # padded embedding rows never win
    betas = []
    for start in range(0, target_logits.shape[0], chunk):
        p = warp_logits(target_logits[start: start + chunk, :width].float(), params)
        q = warp_logits(draft_logits[start: start + chunk, :width].float(), params)
        betas.append(acceptance_rate(p, q))
    return torch.cat(betas)


def measure_alpha(target: ModelRunner, draft: ModelRunner, texts: list[ScoredText],
                  params: SamplingParams, progress: bool = False) -> dict[str, dict]:
    """Per category (and 'overall'): alpha = mean beta over all scored positions, its spread, positions."""
    from tqdm.auto import tqdm

    betas: dict[str, list[torch.Tensor]] = {}
    for text in tqdm(texts, desc=f"alpha T={params.temperature:g}", unit="text", disable=not progress):
        betas.setdefault(text.category, []).append(acceptance_per_position(target, draft, text, params))
    out = {}
    for category, parts in [*betas.items(), ("overall", [b for parts in betas.values() for b in parts])]:
        values = torch.cat(parts)
        per_text = [float(b.mean()) for b in parts]
        out[category] = dict(alpha=float(values.mean()), positions=int(values.numel()), texts=len(parts),
                             alpha_text_min=min(per_text), alpha_text_max=max(per_text))
    return out


@dataclass(frozen=True)
class ForwardTimes:
    """A target's and a draft's measured forwards at one context (`specdec analyze`'s prediction
    inputs); proposers/step_costs.StepCosts is the engine's running cost curve, a different thing."""

    context: int
    target_step_s: float  # one-token target decode step (median)
    draft_step_s: float  # one-token draft decode step (median)
    target_verify_s: dict[int, float]  # tokens scored -> seconds of one target pass over them

    @property
    def c(self) -> float:
        return self.draft_step_s / self.target_step_s

    def verify_s(self, k: int) -> float:
        """Seconds of a (k + 1)-token verification pass; interpolated between measured widths."""
        widths = sorted(self.target_verify_s)
        width = k + 1
        if width in self.target_verify_s:
            return self.target_verify_s[width]
        below = max((w for w in widths if w < width), default=widths[0])
        above = min((w for w in widths if w > width), default=widths[-1])
        if below == above:
            return self.target_verify_s[below]
        share = (width - below) / (above - below)
        return self.target_verify_s[below] * (1 - share) + self.target_verify_s[above] * share


@dataclass(frozen=True)
class ForwardCosts:
    prefill_s: float  # one forward over the whole context, after a warm-up forward
    seconds: dict[int, float]  # new tokens -> median seconds of one forward of them after the context


def random_tree(nodes: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random draft tree of `nodes` inputs, input 0 its root and each node's parent before it
    (topological order, as EAGLE-2 lays trees out): ([nodes, nodes] bool, input j sees input i iff
    i is j or an ancestor of j, the engine's tree mask; [nodes] int64 depths)."""
    parents = [int(torch.randint(-1, node, (1,), generator=generator)) for node in range(nodes - 1)]
    mask = tree_attention_mask(parents)
    return mask, mask.sum(-1) - 1


def _timed(device: torch.device, work: Callable[[], object]) -> float:
    """Wall seconds of work(), the device synchronized around it (on CUDA a call only queues kernels)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    work()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


@torch.inference_mode()
def forward_costs(runner: ModelRunner, context: int, widths, repeats: int = 15, warmups: int = 2, seed: int = 0,
                  tree: bool = False, on_forward: Callable[[], None] | None = None) -> ForwardCosts:
    """Median seconds of one forward of each width's new tokens after one prefill of `context`
    tokens, the widths interleaved pass by pass (a slow minute of a shared machine hits them all),
    and the seconds of that prefill (after a warm-up forward of at most 64 tokens: the first
    forward of a process also pays for page faults and kernel setup).

    tree: each forward verifies a random draft tree of `width` nodes (a fresh one every pass,
    through the engine's tree mask; native runners) instead of a chain: on CPUs a forward's cost
    grows with its rows, whatever their shape. on_forward: called after every forward (a progress
    bar). Leaves the runner's cache empty."""
    generator = torch.Generator().manual_seed(seed)
    device = runner.device
    longest = context + max(widths)
    tokens = torch.randint(0, runner.vocab_size, (1, longest), generator=generator).to(device)
    positions = torch.arange(longest, device=device)[None]
    tick = on_forward or (lambda: None)
    warm_up = min(context, 64)
    runner.reset()
    runner.forward(tokens[:, :warm_up], positions[:, :warm_up], last_n_logits=1)
    runner.reset()
    tick()
    prefill_s = _timed(device, lambda: runner.forward(tokens[:, :context], positions[:, :context], last_n_logits=1))
    tick()
    times = {width: [] for width in widths}
    for attempt in range(warmups + repeats):
        for width in widths:
            new = tokens[:, context:context + width]
            if tree:
                mask, depths = random_tree(width, generator)
                among, where = mask[None].to(device), (context + depths[None]).to(device)
                seconds = _timed(device, lambda: runner.forward(new, where, among_new=among))
            else:
                seconds = _timed(device, lambda: runner.forward(new, positions[:, context:context + width]))
            if attempt >= warmups:
                times[width].append(seconds)
            runner.truncate(torch.tensor([context]))
            tick()
    runner.reset()
    return ForwardCosts(prefill_s, {width: statistics.median(values) for width, values in times.items()})


def forward_times(runner: ModelRunner, context: int, widths, repeats: int = 15, warmups: int = 2,
                  seed: int = 0) -> dict[int, float]:
    """forward_costs()'s medians: width -> seconds of one forward of that many new tokens after `context`."""
    return forward_costs(runner, context, widths, repeats, warmups, seed).seconds


def time_forward(runner: ModelRunner, context: int, width: int, repeats: int = 15, seed: int = 0) -> float:
    """Median seconds of one forward of `width` new tokens after `context` cached tokens."""
    return forward_times(runner, context, [width], repeats, seed=seed)[width]


def measure_step_costs(target: ModelRunner, draft: ModelRunner, context: int = 256,
                       verify_widths: tuple[int, ...] = (1, 2, 3, 4, 5, 7, 9), repeats: int = 15) -> ForwardTimes:
    target_verify = {w: time_forward(target, context, w, repeats) for w in verify_widths}
    return ForwardTimes(context=context, target_step_s=target_verify.get(1) or time_forward(target, context, 1, repeats),
                     draft_step_s=time_forward(draft, context, 1, repeats), target_verify_s=target_verify)
