"""Which CPU kernel should a projection use? Median ms per call for 1..16 rows.

The fused gate/up projection of Qwen2.5-Coder-1.5B (17920 x 1536), the
largest matrix a decode step reads besides the head, in each weight format the
native backend offers. Decoding reads it with 1 row; verifying k drafts with
k+1 rows. Speculation pays when the 5- and 9-row columns stay close to the 1-row one.
Calls cycle through four copies of the matrix (more bytes than a CPU's last-level
cache), so the weights come from memory as in a real forward, not from cache.

--layers times what a step really runs: the target's four w4a8 projections (q/k/v, o,
gate/up, down) of 8 random-weight layers in order (~230 MB, past any last-level cache),
at 1..17 rows, interleaved over 12 passes; the median per projection, a layer's sum, and
the bytes per second that sum reads.

--head times the w4a8 target's output head (151936 x 1536 in w8a8) on specdec's kernel
(kernels/w8a8.cpp) and on oneDNN's qlinear, interleaved, at 1..17 rows (the same bits on VNNI CPUs).

--blocks times whole forwards of the embedded w4a8 target (--model: or the draft; 1, 3, 5 and 9 new
tokens after 300 cached ones) in three forms: op by op from Python, each decoder block as one C++
call (kernels/block.cpp's chain_layers over one block), and every block in one call, interleaved over
--passes, and asserts that all give the same logits. `--model glue` times the draft's 24 layers at
hidden size 128 (random w4a8 weights): there a forward is nearly all glue.

  python benchmarks/native_kernels.py
  python benchmarks/native_kernels.py --layers
  python benchmarks/native_kernels.py --head
  python benchmarks/native_kernels.py --blocks [--model qwen2.5-coder-0.5b] [--passes 21]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specdec.models.native.linear import DenseLinear, make_linear, w8a8_available
from specdec.models.native.w4a8 import w4a8_available

ROWS = (1, 2, 5, 9, 16)
COPIES = 4


def time_call(fns, x, repeats: int = 40) -> float:
    for fn in fns:
        fn(x)
    times = []
    for i in range(repeats):
        fn = fns[i % len(fns)]
        started = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


# Qwen2.5-Coder-1.5B's projections, [out, in]: q/k/v fused, o, gate/up fused, down.
LAYER_SHAPES = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960)}
LAYER_ROWS = (1, 2, 5, 9, 17)


def time_layers(layers: int = 8, passes: int = 12) -> list[dict]:
    """Per-projection median microseconds of w4a8 calls over `layers` layers' weights, in a step's order."""
    from specdec.models.native.w4a8 import W4A8Linear

    torch.manual_seed(0)
    stack = [{name: W4A8Linear(torch.randn(*shape) * 0.02, None, torch.bfloat16) for name, shape in LAYER_SHAPES.items()}
             for _ in range(layers)]
    layer_bytes = sum(m.packed.numel() + m.codes.numel() + 2 * m.supers.numel() for m in stack[0].values())
    inputs = {(rows, name): torch.randn(rows, shape[1]).bfloat16() for rows in LAYER_ROWS
              for name, shape in LAYER_SHAPES.items()}
    times = {key: [] for key in inputs}
    with torch.inference_mode():
        for _ in range(passes):
            for rows in LAYER_ROWS:
                for layer in stack:
                    for name, module in layer.items():
                        started = time.perf_counter()
                        module(inputs[(rows, name)])
                        times[(rows, name)].append(time.perf_counter() - started)
    results = []
    print(f"{'rows':>4}" + "".join(f"{name:>10}" for name in LAYER_SHAPES) + f"{'layer us':>10}{'GB/s':>7}")
    for rows in LAYER_ROWS:
        per = {name: statistics.median(times[(rows, name)]) * 1e6 for name in LAYER_SHAPES}
        layer_us = sum(per.values())
        results.append(dict(rows=rows, us=per, layer_us=layer_us, gb_per_s=layer_bytes / layer_us / 1e3))
        print(f"{rows:>4}" + "".join(f"{t:>10.1f}" for t in per.values()) + f"{layer_us:>10.1f}"
              f"{layer_bytes / layer_us / 1e3:>7.1f}", flush=True)
    return results


def time_head(passes: int = 9) -> list[dict]:
    """Median ms of the output head in w8a8 on each kernel, rows interleaved; says where their bits differ."""
    from specdec.models.native.linear import W8A8Linear

    torch.manual_seed(0)
    weight = torch.randn(151936, 1536) * 0.02
    heads = {kernel: W8A8Linear(weight, None, torch.bfloat16, kernel=kernel) for kernel in ("onednn", "specdec")}
    megabytes = weight.numel() / 1e6
    del weight
    times = {(kernel, rows): [] for kernel in heads for rows in LAYER_ROWS}
    with torch.inference_mode():
        for _ in range(passes):
            for rows in LAYER_ROWS:
                x = torch.randn(rows, 1536).bfloat16()
                outputs = []
                for kernel, head in heads.items():
                    started = time.perf_counter()
                    outputs.append(head(x))
                    times[(kernel, rows)].append(time.perf_counter() - started)
                if not torch.equal(*outputs):  # equal on VNNI (tested); oneDNN's AMX path is not measured
                    print(f"  {rows} rows: the kernels differ by up to "
                          f"{(outputs[0].float() - outputs[1].float()).abs().max().item():.3g}")
    results = []
    print(f"{'rows':>4}{'oneDNN ms':>11}{'GB/s':>7}{'specdec ms':>12}{'GB/s':>7}")
    for rows in LAYER_ROWS:
        onednn, ours = (statistics.median(times[(kernel, rows)]) * 1e3 for kernel in heads)
        results.append(dict(rows=rows, onednn_ms=onednn, specdec_ms=ours, megabytes=megabytes))
        print(f"{rows:>4}{onednn:>11.2f}{megabytes / onednn:>7.1f}{ours:>12.2f}{megabytes / ours:>7.1f}",
              flush=True)
    return results


def _loaded_runner(model: str):
    from specdec.models.loader import load_model

    return load_model(model, quantize="w4a8", progress=False).runner


def glue_runner(layers: int = 24):
    """The draft's 24 layers at hidden size 128 with random w4a8 weights: a forward's time is then
    nearly all its glue (calls, dispatch, small ops), which the weights' reading hides in a real one."""
    from specdec.models.native import NativeRunner
    from specdec.models.native.config import DecoderConfig
    from specdec.models.native.invariance import random_decoder

    config = DecoderConfig(model_type="qwen2", vocab_size=1024, hidden_size=128, intermediate_size=256,
                           num_layers=layers, num_heads=2, num_kv_heads=1, head_dim=64, rope_theta=1e6,
                           rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=True, qkv_bias=True)
    return NativeRunner(random_decoder(config, dtype=torch.bfloat16, quantize="w4a8"), initial_cache_len=512)


def time_blocks(model: str = "qwen2.5-coder-1.5b", context: int = 300, passes: int = 9) -> list[dict]:
    """Median ms of an embedded w4a8 model's forward in each of model.py's BLOCK_FORMS, interleaved."""
    from specdec.models.native.model import BLOCK_FORMS

    runner = glue_runner() if model == "glue" else _loaded_runner(model)
    decoder = runner.decoder
    blocks = decoder.blocks
    if decoder.chain_call is None:
        raise SystemExit(f"{model}'s blocks cannot run as one call here (no w4a8 kernels)")
    generator = torch.Generator().manual_seed(0)
    vocab = decoder.config.vocab_size
    runner.forward(torch.randint(0, vocab, (1, context), generator=generator), torch.arange(context)[None],
                   last_n_logits=1)

    def forward(steps: int, form: str, tokens: torch.Tensor) -> torch.Tensor:
        decoder.block_form = form
        started = runner.seq_len
        logits = runner.forward(tokens, torch.arange(started, started + steps)[None]).logits
        runner.truncate([started])
        return logits

    times = {(steps, form): [] for steps in (1, 3, 5, 9) for form in BLOCK_FORMS}
    with torch.inference_mode():
        for _ in range(passes):
            for steps, form in times:
                tokens = torch.randint(0, vocab, (1, steps), generator=generator)
                started = time.perf_counter()
                forward(steps, form, tokens)
                times[(steps, form)].append(time.perf_counter() - started)
        for steps in (1, 9):
            tokens = torch.randint(0, vocab, (1, steps), generator=generator)
            logits = [forward(steps, form, tokens) for form in BLOCK_FORMS]
            assert all(torch.equal(other, logits[0]) for other in logits[1:]), "the forms differ"
    decoder.block_form = "one call"
    results = []
    print(f"{model}, {len(blocks)} blocks, {context} cached tokens; median ms over {passes} interleaved passes")
    print(f"{'tokens':>6}" + "".join(f"{form + ' ms':>18}" for form in BLOCK_FORMS) + f"{'one call / a block':>20}")
    for steps in (1, 3, 5, 9):
        ms = {form: statistics.median(times[(steps, form)]) * 1e3 for form in BLOCK_FORMS}
        results.append(dict(model=model, tokens=steps, context=context, op_by_op_ms=ms["op by op"],
                            call_per_block_ms=ms["a call a block"], one_call_ms=ms["one call"]))
        print(f"{steps:>6}" + "".join(f"{value:>18.2f}" for value in ms.values())
              + f"{ms['one call'] / ms['a call a block']:>20.3f}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", action="store_true", help="time the target's w4a8 projections layer by layer")
    parser.add_argument("--head", action="store_true", help="time the w8a8 output head on both kernels")
    parser.add_argument("--blocks", action="store_true",
                        help="time the real target's forward with its blocks as one call each and op by op")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b",
                        help="--blocks: the embedded model to time, or `glue`: the draft's 24 layers at hidden size "
                             "128 (random weights), whose forward is nearly all glue")
    parser.add_argument("--passes", type=int, default=9, help="--blocks: interleaved passes (medians over them)")
    parser.add_argument("--json", default=None, help="where to write the results (default: benchmarks/results/"
                        "native_kernels.json, or native_kernels_layers/_head/_blocks.json)")
    args = parser.parse_args()
    if args.layers or args.head or args.blocks:
        mode = "layers" if args.layers else "head" if args.head else "blocks"
        results = (time_blocks(args.model, passes=args.passes) if args.blocks
                   else {"layers": time_layers, "head": time_head}[mode]())
        path = Path(args.json or f"benchmarks/results/native_kernels_{mode}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1))
        return
    torch.manual_seed(0)
    weight = torch.randn(17920, 1536) * 0.02
    cpu = torch.device("cpu")
    formats = {
        "fp32 (oneDNN packed)": (torch.float32, "none"),
        "bf16, F.linear (unpacked)": (torch.bfloat16, "unpacked"),
        "bf16 (oneDNN packed)": (torch.bfloat16, "none"),
        "int8 weights, bf16 act": (torch.bfloat16, "int8"),
        "int4 weights (g32), bf16 act": (torch.bfloat16, "int4"),
        "w8a8 (int8 weights and act)": (torch.bfloat16, "w8a8"),
        "w4a8 (4-bit weights, int8 act)": (torch.bfloat16, "w4a8"),
    }
    results = []
    print(f"{'format':<30}" + "".join(f"{f'{m} row' + ('s' if m > 1 else ''):>10}" for m in ROWS) + "  MB read")
    with torch.inference_mode():
        for name, (dtype, quantize) in formats.items():
            reason = {"w8a8": w8a8_available, "w4a8": w4a8_available}.get(quantize, lambda: None)()
            if reason is not None:
                print(f"{name:<30}skipped: {reason}")
                continue
            if quantize == "unpacked":
                linears = [DenseLinear((weight + i * 1e-3).to(dtype), None) for i in range(COPIES)]
            else:
                linears = [make_linear(weight + i * 1e-3, None, dtype=dtype, device=cpu, quantize=quantize)
                           for i in range(COPIES)]
            times = [time_call(linears, torch.randn(m, 1536).to(dtype)) for m in ROWS]
            bytes_per_weight = {"int8": 1, "int4": 0.5, "w8a8": 1, "w4a8": 5 / 8}.get(quantize, dtype.itemsize)
            megabytes = weight.numel() * bytes_per_weight / 1e6
            results.append(dict(format=name, ms=dict(zip(map(str, ROWS), times)), weight_mb=megabytes))
            print(f"{name:<30}" + "".join(f"{t:>10.2f}" for t in times) + f"{megabytes:>9.0f}", flush=True)
    path = Path(args.json or "benchmarks/results/native_kernels.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
