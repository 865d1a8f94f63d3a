"""This machine's cost table: a model's forward of n new tokens after a context, in milliseconds and
in 1-token steps, as the JSON that `specdec replay --costs` prices its replays with
(analysis/replay.py: cost_table reads the target's ratios, draft_cost_table the draft's forwards
over the target's 1-token step).

Replay prices a step that drafts d tokens at cost(1 + d) target steps and plain decoding at one
step a token, so the ratios are what carry a replay's prediction; the milliseconds say how fast
the machine was that minute. A draft is timed in the target's process, after it: two processes on
one VM can get memory of different speed for the same weights, and a ratio across them would
measure that (benchmarks/RESULTS.md, "A draft model's oracle").

`specdec costs` and benchmarks/verify_cost.py both write this file through `model_costs` and
`cost_file`, which time forwards with analysis/measure.py's forward_costs (docs/architecture.md,
"Cost of a forward").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specdec.analysis.measure import forward_costs
from specdec.analysis.roofline import measure_bandwidth
from specdec.models.cpu_features import cpu_model, effective_isa
from specdec.proposers.draft_model import CONTEXT_WINDOW

TARGET_ROWS = (1, 2, 3, 5, 9, 17)  # a step, then verification of k = 1, 2, 4, 8, 16 drafts
DRAFT_ROWS = (1, 2, 9, 64)  # a drafting forward (1-2 tokens), a catch-up after copied steps, a prompt chunk
DRAFT_CONTEXT = CONTEXT_WINDOW + 64  # the most of a prompt a draft reads, and answer tokens after it


def forwards_per_model(rows: Sequence[int], repeats: int, warmups: int = 2) -> int:
    """How many forwards model_costs runs (a progress bar's total): a warm-up, the prefill, and every
    row in every pass."""
    return 2 + (warmups + repeats) * len(rows)


def check_fits(model, context: int, rows: Sequence[int], option: str = "the context") -> None:
    """A clear ValueError where `context` cached tokens and the longest row exceed what the model
    holds (model: a LoadedModel, models/loader.py); `option` names what to lower."""
    if context + max(rows) > model.runner.max_context:
        raise ValueError(f"{context} cached tokens and a forward of {max(rows)} exceed {model.name}'s context of "
                         f"{model.runner.max_context} tokens: lower {option} or the longest row")


def model_costs(model, context: int, rows: Sequence[int], repeats: int, *, tree: bool = False,
                on_forward: Callable[[], None] | None = None) -> dict:
    """One model's entry of the cost file: its format, the prefill's tokens/s over `context` tokens,
    and the median milliseconds of a forward of each of `rows` new tokens after them (`step_ms`),
    with each over the first row's (`ratio`; rows[0] = 1: a multiple of one decode step). On a CPU
    also the bandwidth at which this process reads memory (`read_gb_s`, as `specdec doctor`
    measures it: the model's own weight mapping where it is large enough): the same VM can give one
    process's weights memory far slower than another's, which moves every row, so the file says
    which this was.

    model: a LoadedModel (models/loader.py); check_fits() first."""
    check_fits(model, context, rows)
    runner = model.runner
    measured = forward_costs(runner, context, rows, repeats, tree=tree, on_forward=on_forward)
    step_ms = {n: measured.seconds[n] * 1e3 for n in rows}
    entry = dict(format=model.describe(), quantize=model.quantize, context=context,
                 prefill_tok_s=context / measured.prefill_s, tree=tree, repeats=repeats, step_ms=step_ms,
                 ratio={n: step_ms[n] / step_ms[rows[0]] for n in rows})
    if runner.device.type == "cpu":  # as analysis/roofline.py's cost_curve: the weights' own mapping where it has one
        pages = getattr(getattr(runner, "decoder", None), "weight_pages", ())
        entry["read_gb_s"] = measure_bandwidth(pages=pages[0] if pages else None) / 1e9
    return entry


def machine(device: torch.device) -> dict:
    """Where the table was measured: the CPU and the oneDNN path in force (cost_table's label names
    them), the threads, and the GPU where the models ran on one."""
    facts = dict(cpu=cpu_model(), isa=effective_isa(), threads=torch.get_num_threads(), torch=torch.__version__)
    if device.type == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(device)
    return facts


def cost_file(device: torch.device, targets: Sequence[dict], draft: dict | None = None) -> dict:
    """The JSON `specdec replay --costs` reads: the machine, the targets' entries ("results"; replay
    reads the first), and a draft's entry timed in the same process ("draft"), where there is one."""
    output = dict(machine(device), results=list(targets))
    if draft is not None:
        output["draft"] = draft
    return output
