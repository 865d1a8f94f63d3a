"""Squared error of the w4a8 weights against the weights they quantize, per projection kind, next to
the earlier format (fp16 scale and min per group of 32, min/max rounding: GGUF's Q4_1, 5 bits a weight).

The embedded models were quantized to GGUF Q4_K_M before we got them, so their weights sit on Q4_K's
grids (groups of 32 on 6-bit codes under fp16 steps per 256 inputs): the 8-bit codes' search finds
those grids where min/max rounding does not. One JSON line per projection kind, then the total.

    python benchmarks/w4a8_weight_error.py [--model qwen2.5-coder-1.5b] [--layers 0 5 14 27]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from safetensors import safe_open

from specdec.models.hub import fetch
from specdec.models.native.w4a8 import GROUP_SIZE, W4A8Linear


def fp16_per_group(weight: torch.Tensor) -> torch.Tensor:
    """The earlier format's weights: scale = fp16((high - low) / 15), min = fp16(low), nearest level."""
    groups = weight.reshape(weight.shape[0], -1, GROUP_SIZE)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale, minimum = ((high - low) / 15).clamp_min(2.0 ** -14).half().float(), low.half().float()
    return (torch.round((groups - minimum) / scale).clamp(0, 15) * scale + minimum).reshape(weight.shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--layers", type=int, nargs="+", default=[0, 5, 14, 27])
    args = parser.parse_args()
    directory = fetch(args.model, progress=False)
    errors: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    with safe_open(str(directory / "model.safetensors"), "pt") as tensors:
        for name in tensors.keys():
            parts = name.split(".")
            if (len(parts) < 4 or parts[1] != "layers" or int(parts[2]) not in args.layers
                    or not name.endswith("proj.weight")):
                continue
            weight = tensors.get_tensor(name).float()
            ours = W4A8Linear(weight, None, torch.float32).dequantized()
            kind = parts[-2]
            errors[kind][0] += ((ours - weight) ** 2).sum().item()
            errors[kind][1] += ((fp16_per_group(weight) - weight) ** 2).sum().item()
    for kind, (ours, earlier) in sorted(errors.items()):
        print(json.dumps({"model": args.model, "layers": args.layers, "projection": kind,
                          "error_ratio_vs_fp16_per_group": round(ours / earlier, 3)}))
    total = [sum(values) for values in zip(*errors.values())]
    print(json.dumps({"model": args.model, "layers": args.layers, "projection": "all",
                      "error_ratio_vs_fp16_per_group": round(total[0] / total[1], 3)}))


if __name__ == "__main__":
    main()
