"""How much do bf16, int8, int4, w8a8 and w4a8 weights change the model? Teacher-forced logits on a fixed text.

For each model, one forward over a fixed ~600-token text (the first texts of
the shipped corpus: code and chat) in every format; each is compared with
transformers' fp32 logits on the same weights: top-1 agreement (how often the
greedy next token is the same), the largest absolute logit difference, and
the mean KL divergence KL(fp32 || format) of the next-token distributions.

  python benchmarks/native_quality.py
  python benchmarks/native_quality.py --models qwen2.5-coder-1.5b --formats "native w4a8"

A format this CPU cannot run (w8a8 without VNNI, say) is skipped with the reason.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdec.models.loader import load_model
from specdec.models.native.reduced_vocab import corpus_texts

FORMATS = [("native fp32", "float32", "none"), ("native bf16", "bfloat16", "none"),
           ("native int8", "bfloat16", "int8"), ("native int4", "bfloat16", "int4"),
           ("native w8a8", "bfloat16", "w8a8"), ("native w4a8", "auto", "w4a8")]  # w4a8: as the default runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"])
    parser.add_argument("--tokens", type=int, default=600)
    parser.add_argument("--formats", nargs="+", default=[label for label, _, _ in FORMATS],
                        help="labels from: " + ", ".join(label for label, _, _ in FORMATS))
    parser.add_argument("--json", default="benchmarks/results/native_quality.json")
    args = parser.parse_args()
    unknown = set(args.formats) - {label for label, _, _ in FORMATS}
    if unknown:
        parser.error(f"unknown formats: {', '.join(sorted(unknown))}")
    results = []
    for name in args.models:
        reference_model = load_model(name, backend="hf", dtype="float32")
        text = "\n\n".join(corpus_texts()[:3] + corpus_texts()[-3:])
        ids = torch.tensor([reference_model.tokenizer(text)["input_ids"][: args.tokens]])
        positions = torch.arange(ids.shape[1])[None]
        reference = reference_model.runner.forward(ids, positions).logits[0].float()
        del reference_model
        log_reference = reference.log_softmax(-1)
        print(f"\n{name}: {ids.shape[1]} tokens, reference = transformers fp32")
        print(f"{'format':<14}{'top-1 agree':>12}{'max |dlogit|':>14}{'mean KL':>10}")
        for label, dtype, quantize in FORMATS:
            if label not in args.formats:
                continue
            try:
                model = load_model(name, backend="native", dtype=dtype, quantize=quantize, progress=False)
            except ValueError as error:  # a format this CPU cannot run
                print(f"{label:<14}skipped: {error}", flush=True)
                continue
            runs_as = model.describe()
            logits = model.runner.forward(ids, positions).logits[0].float()
            del model
            agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
            max_diff = (logits - reference).abs().max().item()
            kl = (log_reference.exp() * (log_reference - logits.log_softmax(-1))).sum(-1).mean().item()
            results.append(dict(model=name, format=label, runs_as=runs_as, tokens=ids.shape[1],
                                top1_agreement=agree, max_abs_logit_diff=max_diff, mean_kl=kl))
            print(f"{label:<14}{agree:>12.1%}{max_diff:>14.3f}{kl:>10.4f}", flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
