"""What a trained head's drafted token costs, as a fraction of the target's step, in one process.

    python benchmarks/head_draft_cost.py --kind mlp-speculator --head HEAD.safetensors [--context 512] [--passes 15]

The target (w4a8 on a CPU, as `specdec generate` loads it) reads a context of --context tokens of a
real answer; then, interleaved pass by pass (these VMs' speed drifts within minutes), its 1-token step
and the head's proposal of k = 1, 2 and 4 tokens (the head fed that context's features first, as the
engine does after a prefill, outside the timing). Medians; the drafted token's cost is the slope of
the proposal's time over k, so a proposal's fixed costs show apart.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.config import SpecConfig
from specdec.factory import load_models
from specdec.models.heads import load_head_for
from specdec.proposers.base import ProposeContext
from specdec.proposers.head_methods import HeadOptions
from specdec.proposers.registry import build_proposer
from specdec.sampling import SamplingParams

KS = (1, 2, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", choices=["eagle3", "mlp-speculator", "medusa", "eagle"], required=True)
    parser.add_argument("--head", required=True)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--passes", type=int, default=15)
    args = parser.parse_args()
    method = {"eagle3": "eagle3", "mlp-speculator": "mlp-speculator", "medusa": "medusa", "eagle": "eagle"}[args.kind]
    config = SpecConfig(method=method, options=(HeadOptions(path=args.head),)).resolved("cpu")
    target, _ = load_models(config, need_draft=False)
    head, vocab = load_head_for(target, args.kind, args.head)
    # By hand beside the factory's load_models: the timing needs the proposer alone, outside an engine.
    proposer = build_proposer(method, loaded_head=head, head_vocabulary=vocab)
    runner = target.runner
    text = "def fibonacci(n):\n    " + " ".join(f"value_{i} = {i} * n" for i in range(400))
    ids = target.tokenizer(text, add_special_tokens=False)["input_ids"][:args.context]
    runner.reset()
    from specdec.engine.step import select_target_features

    select_target_features(runner, proposer.target_layers)
    out = runner.forward(torch.tensor([ids[:-1]]), torch.arange(len(ids) - 1)[None], last_n_logits=1)
    context = ProposeContext(torch.tensor([ids]), SamplingParams(temperature=0), None, runner.vocab_size,
                             target_hidden=out.hidden)
    proposer.propose(context, 1)  # feeds the context's features once
    after = ProposeContext(torch.tensor([ids]), SamplingParams(temperature=0), None, runner.vocab_size)
    step_ms, propose_ms = [], {k: [] for k in KS}
    position = len(ids) - 1
    for _ in range(args.passes):
        start = time.perf_counter()
        runner.forward(torch.tensor([[ids[-1]]]), torch.tensor([[position]]), last_n_logits=1)
        step_ms.append((time.perf_counter() - start) * 1000)
        runner.truncate([position])
        for k in KS:
            start = time.perf_counter()
            proposer.propose(after, k)
            propose_ms[k].append((time.perf_counter() - start) * 1000)
    step = statistics.median(step_ms)
    medians = {k: statistics.median(times) for k, times in propose_ms.items()}
    per_token = (medians[KS[-1]] - medians[KS[0]]) / (KS[-1] - KS[0])
    print(f"target step (1 token after {len(ids) - 1}): {step:.2f} ms")
    for k, ms in medians.items():
        print(f"{args.kind} proposal of k = {k}: {ms:.2f} ms ({ms / step:.3f} of a step)")
    print(f"per drafted token (slope k = {KS[0]}..{KS[-1]}): {per_token:.2f} ms = {per_token / step:.3f} of a step")


if __name__ == "__main__":
    main()
