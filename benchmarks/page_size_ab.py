"""A model's weights on 4 KB pages against the same weights on 2 MB pages, in one process.

models/huge_pages.py moves a native model's weights onto transparent huge pages when it is
built. This loads the model twice, once with that move turned off, fills both caches with the same
context (timing that prefill), and times forwards of 1..17 new tokens on each, alternating pass by
pass (these VMs' memory bandwidth moves within minutes, so only a ratio measured in one process says
what the pages did). Both copies compute the same bits: the script checks that their logits are equal.

    python benchmarks/page_size_ab.py                                  # the 1.5B target, w4a8
    python benchmarks/page_size_ab.py --model qwen2.5-coder-0.5b       # the draft
    python benchmarks/page_size_ab.py --rows 1 5 9 --passes 21 --context 800
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from unittest import mock

import torch

from specdec.models import huge_pages
from specdec.models.cpu_features import cpu_model, effective_isa
from specdec.models.loader import load_model


def load(name: str, quantize: str, huge: bool):
    if huge:
        return load_model(name, quantize=quantize, progress=False, probe=False)
    with mock.patch.object(huge_pages, "huge_pages_unavailable", lambda: "turned off for the A/B"):
        return load_model(name, quantize=quantize, progress=False, probe=False)


def anon_huge_kb() -> int:
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--quantize", default="w4a8")
    parser.add_argument("--context", type=int, default=800)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 9, 17])
    parser.add_argument("--passes", type=int, default=15)
    parser.add_argument("--prefills", type=int, default=4, help="prefills of the context per copy, alternating")
    args = parser.parse_args()
    if (reason := huge_pages.huge_pages_unavailable()) is not None:
        raise SystemExit(f"nothing to compare: {reason}")
    before = anon_huge_kb()
    runners = {"4 KB": load(args.model, args.quantize, huge=False).runner}
    after_small = anon_huge_kb()
    runners["2 MB"] = load(args.model, args.quantize, huge=True).runner
    print(f"{cpu_model()} ({effective_isa()}), {torch.get_num_threads()} threads; {args.model} {args.quantize}, "
          f"{args.context} cached tokens; anonymous huge pages: +{(after_small - before) >> 10} MB for the "
          f"4 KB copy, +{(anon_huge_kb() - after_small) >> 10} MB for the 2 MB copy")
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 150_000, (1, args.context), generator=generator)
    logits = {}
    with torch.inference_mode():
        for name, runner in runners.items():
            runner.reset()
            logits[name] = runner.forward(prompt, torch.arange(args.context)[None], last_n_logits=1).logits
        if not torch.equal(logits["4 KB"], logits["2 MB"]):
            raise SystemExit("the two copies' logits differ: the pages must not change the bits")
        prefill = {name: [] for name in runners}
        for index in range(args.prefills):
            for name in (list(runners) if index % 2 == 0 else list(reversed(runners))):
                runners[name].reset()
                started = time.perf_counter()
                runners[name].forward(prompt, torch.arange(args.context)[None], last_n_logits=1)
                prefill[name].append(args.context / (time.perf_counter() - started))
        small, huge = (statistics.median(prefill[name]) for name in ("4 KB", "2 MB"))
        print(json.dumps({"prefill_tokens": args.context, "4KB_tok_s": round(small, 1), "2MB_tok_s": round(huge, 1),
                          "2MB/4KB": round(huge / small, 3)}), flush=True)
        for rows in args.rows:
            tokens = torch.randint(0, 150_000, (1, rows), generator=generator)
            positions = torch.arange(args.context, args.context + rows)[None]
            times = {name: [] for name in runners}
            for index in range(args.passes):
                for name in (list(runners) if index % 2 == 0 else list(reversed(runners))):
                    started = time.perf_counter()
                    runners[name].forward(tokens, positions)
                    times[name].append(time.perf_counter() - started)
                    runners[name].truncate([args.context])
            small, huge = (statistics.median(times[name]) * 1e3 for name in ("4 KB", "2 MB"))
            print(json.dumps({"rows": rows, "4KB_ms": round(small, 2), "2MB_ms": round(huge, 2),
                              "2MB/4KB": round(huge / small, 3)}), flush=True)


if __name__ == "__main__":
    main()
