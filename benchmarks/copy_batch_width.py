"""Scored copying in a batch: each row choosing its draft as if alone (the rows of a RowwiseProposer,
as before 2026-12-04) against the batch choosing one width for its rectangular forward
(scored_copy.ScoredCopyRows, what `specdec serve --method copy` runs), with plain decoding beside
them, in one process on one loaded target.

The server's steps verify rows x width tokens, width the widest row's drafts + 1 (engine/step.py).
Eight mixed prompts (serve_load.py's: HumanEval, MT-bench and the specdec suites interleaved), 64 new
tokens, greedy, run 1 and 4 at a time through a BatchEngine of 4 rows under -k auto, the three
engines in alternating order group by group, two rounds (the second repeats the first's prompts, as
a server sees repeated requests: copying's corpus of earlier requests finds them). Prints, per
round, tokens per second over its groups against plain. Builds the two proposers by hand: the rows-alone variant is not
a configuration a user can choose any more.

    python benchmarks/copy_batch_width.py [--rounds 3] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import sys
import time

sys.path.insert(0, "benchmarks")
from serve_load import mixed_prompts  # noqa: E402

from specdec.config import SpecConfig  # noqa: E402
from specdec.engine.batch import BatchEngine  # noqa: E402
from specdec.factory import load_models  # noqa: E402
from specdec.proposers.batched import RowwiseProposer  # noqa: E402
from specdec.proposers.scored_copy import CopyOptions, ScoredCopyRows, scored_copy_maker  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402

SLOTS = 4


def run_group(engine: BatchEngine, prompts: list[str], max_new_tokens: int) -> tuple[int, float, int]:
    """(tokens, seconds, steps) for the prompts decoded together."""
    for index, prompt in enumerate(prompts):
        engine.add(index, engine.make_request(prompt, SamplingParams(temperature=0), max_new_tokens=max_new_tokens,
                                              chat=True))
    tokens, steps, started = 0, 0, time.perf_counter()
    while engine.running:
        tokens += sum(len(update.token_ids) for update in engine.step())
        steps += 1
    return tokens, time.perf_counter() - started, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    target, _ = load_models(SpecConfig(quantize="w4a8"))
    prompts = mixed_prompts(["humaneval", "mt-bench", "specdec"], per_category=3)[:8]

    def engine(proposer) -> BatchEngine:
        # As `specdec serve` builds its engine: the proposer (by hand, not the factory: the rows-alone
        # variant is no configuration any more) in a BatchEngine.
        return BatchEngine(target.runner.with_batch_size(SLOTS), proposer, target.tokenizer, k="auto",
                           eos_token_ids=target.eos_token_ids)

    # Both copy variants by hand, not the factory's (it builds "one width" alone), from its row maker.
    engines = {"plain": engine(None), "rows alone": engine(RowwiseProposer(scored_copy_maker(CopyOptions()), SLOTS)),
               "one width": engine(ScoredCopyRows(scored_copy_maker(CopyOptions()), SLOTS))}
    for clients in (1, 4):
        for round_ in range(args.rounds):  # round 0: fresh prompts; later rounds repeat them
            totals = {name: [0, 0.0, 0] for name in engines}
            for start in range(0, len(prompts), clients):
                names = list(engines) if (start // clients + round_) % 2 == 0 else list(reversed(engines))
                for name in names:
                    for slot, value in enumerate(run_group(engines[name], prompts[start:start + clients],
                                                           args.max_new_tokens)):
                        totals[name][slot] += value
            plain = totals["plain"][0] / totals["plain"][1]
            print(f"{clients} at a time, round {round_}: " + "; ".join(
                f"{name} {tokens / seconds:.2f} tok/s ({tokens / seconds / plain:.2f}x, {steps} steps)"
                for name, (tokens, seconds, steps) in totals.items()), flush=True)

if __name__ == "__main__":
    main()
