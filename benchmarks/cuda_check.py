"""One GPU lease, one script: is specdec exact on CUDA, and what does a step cost there?

  python benchmarks/cuda_check.py --out DIR [--tokenizer DIR] [--new-tokens 128]

Only 64 MiB of files travel to a lent GPU, so the models are random-weight
decoders of the real shapes (Qwen2.5-Coder-1.5B target, 0.5B draft): the
costs of a forward depend on shapes, not on weights, and a random model's
near-uniform logits make greedy equality the strictest test of bit-exactness
(every near-tie is a chance for a rounding difference to flip a token).

1. The invariance probe of `specdec doctor --synthetic` (one real-shape layer),
   bf16 and fp32: projections by row count, chunkings, ragged rows, a tree.
2. End to end on the full-depth random target, greedy: speculative output
   (ngram, the target drafting for itself, a 0.5B-shaped draft) == plain output,
   with tokens/s, acceptance and steps.
3. Costs: the target's forward over n new tokens (chain and tree) after a
   512-token context, over the 1-token step; the draft's 1-token step. From
   these the predicted speedup of each method follows (planning/theory.py).
4. CUDA graphs (models/native/captured.py): the same forwards eager and replayed
   give the same bits (bf16 and fp32), and the step's cost eager vs replayed at
   1..64 tokens for the target and draft shapes, against the weight-read floor.
   Sections 2 and 3 run on the default runner, which replays recorded steps.

Writes DIR/cuda_check.json and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from specdec.models.native import NativeRunner
from specdec.models.native.config import DecoderConfig
from specdec.models.native.invariance import random_decoder

QWEN_1_5B = DecoderConfig(
    model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
    num_kv_heads=2, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768,
    tie_word_embeddings=True, qkv_bias=True)
QWEN_0_5B = DecoderConfig(
    model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
    num_kv_heads=2, head_dim=64, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768,
    tie_word_embeddings=True, qkv_bias=True)
ROWS = (1, 2, 5, 9, 16, 32, 64, 65)
RANDOM_MODEL_SECTIONS = ("captured_costs", "kernels", "compiled", "sampling", "e2e", "batched", "e2e_unpadded", "costs",
                         "e2e_fp32", "batched_fp32")
PROMPT = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
          "def factorial(n):\n    if n < 2:\n        return 1\n    return n * factorial(n - 1)\n\n") * 3


def doctor(dtype: str, out: Path, contexts: str, device: str = "cuda") -> dict:
    """`specdec doctor --synthetic` on CUDA in a subprocess, its JSON report read back."""
    path = out / f"doctor-{dtype}.json"
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "specdec.cli", "doctor", "--synthetic", "--device", device,
                             "--dtype", dtype, "--quantize", "none", "--contexts", contexts, "--json", str(path)],
                            capture_output=True, text=True, timeout=600)
    (out / f"doctor-{dtype}.log").write_text(result.stdout + result.stderr)
    report = json.loads(path.read_text()) if path.exists() else {"cases": []}
    failures = [case["name"] for case in report["cases"] if not case["identical"]]
    return {"dtype": dtype, "returncode": result.returncode, "cases": len(report["cases"]),
            "failures": failures, "seconds": round(time.perf_counter() - started, 1),
            "tail": result.stdout[-1500:] + result.stderr[-1500:]}


def cuda_ms(fn, reps: int) -> float:
    """Median milliseconds of fn() over reps, timed with CUDA events after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if not torch.cuda.is_available():  # a CPU dry run of this script
            started = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - started))
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def random_tree(nodes: int, generator: torch.Generator) -> torch.Tensor:
    """[1, n, n] bool ancestor mask of a random tree in topological order (node 0 the root)."""
    from specdec.sampling.tree import tree_attention_mask

    parents = [int(torch.randint(0, i, (1,), generator=generator)) - 1 for i in range(1, nodes)]  # -1: the root
    return tree_attention_mask(parents)[None]


@torch.inference_mode()
def forward_costs(runner: NativeRunner, context: int, rows=ROWS, reps: int = 20) -> dict:
    """ms of one forward over n new tokens after `context` cached ones, chain and tree."""
    device = runner.device
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 150_000, (1, context), generator=generator)
    runner.reset()
    runner.forward(prompt, torch.arange(context)[None], last_n_logits=1)
    costs = {"chain": {}, "tree": {}}
    for n in rows:
        ids = torch.randint(0, 150_000, (1, n), generator=generator).to(device)
        chain_positions = torch.arange(context, context + n, device=device)[None]
        mask = random_tree(n, generator).to(device)
        depths = mask.sum(-1) - 1
        tree_positions = context + depths

        def chain():
            runner.truncate([context])
            runner.forward(ids, chain_positions)

        def tree():
            runner.truncate([context])
            runner.forward(ids, tree_positions, among_new=mask)

        costs["chain"][n] = round(cuda_ms(chain, reps), 3)
        costs["tree"][n] = round(cuda_ms(tree, reps), 3)
    runner.reset()
    return costs


@torch.inference_mode()
def replayed_equals_eager(config: DecoderConfig, dtype: torch.dtype, device: torch.device) -> dict:
    """The same forwards on one decoder, eager and as replayed CUDA graphs (captured.py): a
    prefill in 64-token pieces across the key buckets, chain steps of 1, 5 and 17 tokens with
    rollbacks, a 9-node tree, then more prefill. Every logit must be the same bits."""
    decoder = random_decoder(config, dtype=dtype, device=device)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 150_000, (1, 1400), generator=generator)
    tree = random_tree(9, generator)
    results = {}
    for name, graphs in (("eager", False), ("replayed", device.type == "cuda")):
        runner = NativeRunner(decoder, initial_cache_len=2048, cuda_graphs=graphs)
        outputs = [runner.forward(ids[:, :700], torch.arange(700)[None], last_n_logits=1).logits]
        for n in (1, 5, 17, 1, 5, 17):
            start = runner.seq_len
            outputs.append(runner.forward(ids[:, start:start + n], torch.arange(start, start + n)[None]).logits)
            runner.truncate([start + n - 1])
        start = runner.seq_len
        outputs.append(runner.forward(ids[:, start:start + 9], (start + tree.sum(-1) - 1), among_new=tree).logits)
        runner.truncate([start + 1])
        start = runner.seq_len
        outputs.append(runner.forward(ids[:, start:1400], torch.arange(start, 1400)[None]).logits)
        results[name] = ([logits.cpu() for logits in outputs],
                         runner.fixed_steps.recorded if runner.fixed_steps else 0)
    eager, replayed = results["eager"][0], results["replayed"][0]
    return {"dtype": str(dtype), "forwards": len(eager), "recorded_graphs": results["replayed"][1],
            "identical": [torch.equal(a, b) for a, b in zip(eager, replayed)],
            "max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(eager, replayed))}


def bandwidth(device: torch.device, megabytes: int = 2048) -> float:
    """Bytes/s of reading a buffer far larger than the L2 cache (a sum), median of 10."""
    buffer = torch.ones(megabytes * 2**20 // 4, device=device)
    return buffer.numel() * 4 / (cuda_ms(buffer.sum, 10) / 1e3)


def captured_costs(target: NativeRunner, draft: NativeRunner, reps: int) -> dict:
    """Step ms at 1/5/9/17/64 tokens after 512, eager and replayed, target and draft shapes, and
    how close the replayed 1-token step comes to its weight-read floor (bytes / bandwidth)."""
    from specdec.analysis.roofline import weight_bytes

    read = bandwidth(target.device)
    table = {"bandwidth_GB_s": round(read / 1e9, 1)}
    for name, runner, rows in (("target", target, (1, 5, 9, 17, 64)), ("draft", draft, (1, 2, 5))):
        eager = NativeRunner(runner.decoder, initial_cache_len=2048, cuda_graphs=False)
        entry = {"weights_GB": round(weight_bytes(runner.decoder) / 1e9, 3),
                 "floor_ms": round(weight_bytes(runner.decoder) / read * 1e3, 3),
                 "eager": forward_costs(eager, 512, rows=rows, reps=reps),
                 "replayed": forward_costs(runner, 512, rows=rows, reps=reps)}
        entry["floor_fraction_1_token"] = round(entry["floor_ms"] / entry["replayed"]["chain"][1], 3)
        table[name] = entry
    return table


def replay_cost_file(report: dict) -> dict | None:
    """The costs section's target step as the cost file `specdec replay --costs` and
    benchmarks/candidate_scorer.py read (analysis/machine_costs.py's format): the chain's forwards
    over its 1-token step, and the tree's as a second entry ("tree": true; planning/costs.py's
    tree_cost_ratios prices a tree's step by it). None where the section did not run."""
    costs = report.get("costs", {}).get("target_1.5B_bf16_ctx512", {})
    if "chain" not in costs:
        return None
    fmt = "random-weight Qwen2.5-Coder-1.5B shape, bf16, replayed fixed steps"

    def entry(shape: str) -> dict:
        step_ms = {str(n): ms for n, ms in costs[shape].items()}
        one = float(costs["chain"]["1"] if "1" in costs["chain"] else costs["chain"][1])
        return dict(format=fmt, quantize="none", context=512, tree=shape == "tree", step_ms=step_ms,
                    ratio={n: ms / one for n, ms in step_ms.items()})

    return dict(gpu=report["device"], torch=report["torch"], results=[entry("chain"), entry("tree")])


def device_time(event) -> float:
    """An event's own GPU microseconds (the attribute's name changed across PyTorch versions)."""
    return getattr(event, "self_device_time_total", 0) or getattr(event, "self_cuda_time_total", 0)


@torch.inference_mode()
def kernel_profile(target: NativeRunner, context: int = 512, tree_nodes: int = 9) -> dict:
    """The GPU kernels of one step after `context` tokens, eager and replayed (torch.profiler): a
    1-token chain and a tree of `tree_nodes` nodes; how many kernels, their summed time, the step's
    wall time, and the ten costliest names. A replayed step whose kernels add up to its wall time
    is bound by the kernels themselves (fusion is next), not by launches or the host's work."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(0, 150_000, (1, context + tree_nodes), generator=torch.Generator().manual_seed(0))
    mask = random_tree(tree_nodes, torch.Generator().manual_seed(1))
    shapes = {"chain": (ids[:, context:context + 1], torch.tensor([[context]]), None),
              "tree": (ids[:, context:], context + mask.sum(-1) - 1, mask)}
    result = {}
    for name, graphs in (("eager", False), ("replayed", True)):
        graphs = graphs and target.device.type == "cuda"
        runner = NativeRunner(target.decoder, initial_cache_len=2048, cuda_graphs=graphs)
        runner.forward(ids[:, :context], torch.arange(context)[None], last_n_logits=1)
        for shape, (new_ids, positions, among_new) in shapes.items():
            def step():
                runner.truncate([context])
                runner.forward(new_ids, positions, among_new=among_new)

            for _ in range(3):
                step()
            synchronize()
            started = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step()
                synchronize()
            wall_ms = (time.perf_counter() - started) * 1e3
            kernels = [event for event in prof.key_averages() if event.device_type == torch.autograd.DeviceType.CUDA]
            kernels.sort(key=device_time, reverse=True)
            result[f"{name} {shape}"] = {
                "kernels": sum(event.count for event in kernels), "wall_ms_profiled": round(wall_ms, 3),
                "kernel_ms": round(sum(device_time(event) for event in kernels) / 1e3, 3),
                "top": [(event.key[:80], event.count, round(device_time(event) / 1e3, 3)) for event in kernels[:10]]}
    return result


@torch.inference_mode()
def compiled_step(target: NativeRunner, context: int = 512, reps: int = 10) -> dict:
    """What fusing the step's ~1,900 kernels would buy: the 64-token static step (captured.py)
    through torch.compile(mode="reduce-overhead"), timed against its replayed graph. A probe of
    the next step, not an exact path: inductor's fused reductions round otherwise than eager."""
    ids = torch.randint(0, 150_000, (1, context + 1), generator=torch.Generator().manual_seed(0))
    runner = NativeRunner(target.decoder, initial_cache_len=2048)
    runner.forward(ids[:, :context], torch.arange(context)[None], last_n_logits=1)
    runner.forward(ids[:, context:], torch.tensor([[context]]))
    step = next(step for key, step in runner.fixed_steps.steps.items() if step.starts[0] == context)
    replayed_ms = cuda_ms(step.graph.replay, reps)
    eager_logits = step.compute()[0].clone()
    started = time.perf_counter()
    compiled = torch.compile(step.compute, mode="reduce-overhead")
    compiled_logits = compiled()[0].clone()
    compile_seconds = time.perf_counter() - started
    return {"replayed_ms": round(replayed_ms, 3), "compiled_ms": round(cuda_ms(compiled, reps), 3),
            "compile_seconds": round(compile_seconds, 1),
            "max_abs_diff_vs_eager": float((compiled_logits - eager_logits).abs().max())}


def loaded(runner: NativeRunner, tokenizer=None, name: str = "random weights"):
    """An in-memory runner as specdec's factory takes a loaded model (models/loader.py's LoadedModel),
    so the engines here are built as `specdec generate` builds them; no token is an EOS (random weights
    would stop anywhere), so every run decodes its full length."""
    from specdec.models.loader import LoadedModel

    return LoadedModel(name, Path(name), runner, tokenizer, 0.0, backend="native", eos_token_ids=frozenset())


def end_to_end(target: NativeRunner, draft: NativeRunner, tokenizer, new_tokens: int,
               methods=("ngram", "lookahead", "self-draft", "draft", "copy")) -> dict:
    """Greedy plain vs speculative on the random full-depth target: equality, tok/s, acceptance."""
    from specdec.config import SpecConfig
    from specdec.factory import engine_for
    from specdec.proposers.scored_copy import CopyOptions
    from specdec.sampling import SamplingParams

    params = SamplingParams(temperature=0)
    prompt_ids = tokenizer.encode(PROMPT) if tokenizer is not None else list(range(1000, 1200))
    drafts = {"self-draft": lambda: loaded(target.with_batch_size(1)), "draft": lambda: loaded(draft)}
    # Scored copying (proposers/scored_copy.py) sizes its own drafts from the engine's measured
    # step costs: on a GPU's flat curve it may draft up to max_k = 16, as a chain or a tree.
    setups = {"plain": ("autoregressive", 4), "ngram k=4": ("ngram", 4), "lookahead k=4": ("lookahead", 4),
              "self-draft k=4": ("draft", 4), "draft 0.5B-shape k=4": ("draft", 4), "copy k=auto": ("copy", "auto"),
              "copy-trees k=auto": ("copy", "auto")}
    setups = {name: setup for name, setup in setups.items()
              if name == "plain" or name.split(" ")[0].split("-trees")[0] in methods}
    results, reference = {}, None
    for name, (method, k) in setups.items():
        config = SpecConfig(method=method, k=k, max_k=16, options=(CopyOptions(trees=name.startswith("copy-trees")),))
        draft_model = drafts[name.split(" ")[0]]() if method == "draft" else None
        engine = engine_for(config, loaded(target, tokenizer), draft_model)
        engine.generate(prompt_ids, params, max_new_tokens=8)  # warm-up
        runs = ("", " again") if name.startswith("copy") else ("",)  # again: the corpus holds the answer
        for again in runs:
            synchronize()
            started = time.perf_counter()
            out = engine.generate(prompt_ids, params, max_new_tokens=new_tokens)
            synchronize()
            seconds = time.perf_counter() - started
            if reference is None:
                reference = out.token_ids
            first_diff = next((i for i, (a, b) in enumerate(zip(out.token_ids, reference)) if a != b), None)
            results[name + again] = {"identical_to_plain": out.token_ids == reference, "first_difference": first_diff,
                                     "tok_per_s": round(len(out.token_ids) / seconds, 1),
                                     "acceptance": round(out.stats.acceptance_rate, 3) if engine.proposer else None,
                                     "tau": round(out.stats.mean_accepted_length, 2)}
    return results


def server_engine(target: NativeRunner, config, tokenizer, slots: int):
    """`specdec serve`'s engine of `slots` rows: server/__init__.py builds its BatchEngine over the
    factory's batch_proposer_for so (the factory makes no BatchEngine of its own)."""
    from specdec.engine.batch import BatchEngine
    from specdec.factory import batch_proposer_for

    return BatchEngine(target.with_batch_size(slots), batch_proposer_for(config, slots=slots), tokenizer, k=config.k,
                       max_k=config.max_k)


def batched_equals_alone(target: NativeRunner, tokenizer, slots: int = 3, new_tokens: int = 48,
                         methods=("ngram", "lookahead", "copy")) -> dict:
    """Three requests decoded side by side (BatchEngine, k=4) against each alone, greedy."""
    from specdec.config import SpecConfig
    from specdec.factory import plain_engine
    from specdec.sampling import SamplingParams

    params = SamplingParams(temperature=0)
    prompts = [tokenizer.encode(PROMPT), tokenizer.encode(PROMPT[:120]), tokenizer.encode("import os\n" * 20)]
    alone = plain_engine(loaded(target, tokenizer))
    expected = [alone.generate(prompt, params, max_new_tokens=new_tokens).token_ids for prompt in prompts]
    results = {}
    for method in methods:
        engine = server_engine(target, SpecConfig(method=method, k=4), tokenizer, slots)
        outputs = {i: [] for i in range(len(prompts))}
        for i, prompt in enumerate(prompts):
            engine.add(i, engine.make_request(prompt, params, max_new_tokens=new_tokens, ignore_eos=True))
        while engine.running:
            for update in engine.step():
                outputs[update.handle] += update.token_ids
        results[method] = [outputs[i] == expected[i] for i in range(len(prompts))]
    return results


def seeded_sampling(target: NativeRunner, tokenizer, slots: int = 3, new_tokens: int = 32) -> dict:
    """T=0.7 with seeds: a request run twice gives the same tokens; three side by side (BatchEngine)
    give each what it gets alone (ngram and lookahead, k=4)."""
    from specdec.config import SpecConfig
    from specdec.factory import engine_for
    from specdec.sampling import SamplingParams

    prompts = [tokenizer.encode(PROMPT), tokenizer.encode(PROMPT[:120]), tokenizer.encode("import os\n" * 20)]
    results = {}
    for method in ("ngram", "lookahead"):
        alone = engine_for(SpecConfig(method=method, k=4), loaded(target, tokenizer))
        params = [SamplingParams(temperature=0.7, seed=100 + i) for i in range(len(prompts))]
        expected = [alone.generate(p, q, max_new_tokens=new_tokens).token_ids for p, q in zip(prompts, params)]
        again = alone.generate(prompts[0], params[0], max_new_tokens=new_tokens).token_ids
        engine = server_engine(target, SpecConfig(method=method, k=4), tokenizer, slots)
        outputs = {i: [] for i in range(len(prompts))}
        for i, (prompt, param) in enumerate(zip(prompts, params)):
            engine.add(i, engine.make_request(prompt, param, max_new_tokens=new_tokens, ignore_eos=True))
        while engine.running:
            for update in engine.step():
                outputs[update.handle] += update.token_ids
        results[method] = {"reproducible": again == expected[0],
                           "batched_equals_alone": [outputs[i] == expected[i] for i in range(len(prompts))]}
    return results


def eagle3_on_device(device: torch.device) -> dict:
    """The tiny EAGLE-3 setup of tests/proposers/test_eagle3.py on this device: train-head's
    training loop (loss falls), then greedy chain and tree drafting with the head == plain."""
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import make_peaked_model

    from specdec.config import HeadOptions, SpecConfig
    from specdec.factory import engine_for, plain_engine
    from specdec.models.heads import FrozenVocabulary, HeadConfig, load_head
    from specdec.models.native import NativeDecoder
    from specdec.sampling import SamplingParams
    from specdec.training.train_head import TrainOptions, extract_features, load_features, train_head

    model = make_peaked_model(seed=3, layers=4)
    decoder = NativeDecoder.from_state_dict(DecoderConfig.from_hf(model.config.to_dict()), dict(model.state_dict()),
                                            dtype=torch.float32, device=device)
    target = NativeRunner(decoder)
    vocab = FrozenVocabulary(model.get_input_embeddings().weight.detach().to(device),
                             model.get_output_embeddings().weight.detach().to(device),
                             torch.arange(model.config.vocab_size, device=device))
    plain = plain_engine(loaded(target))
    chunks = []
    for index in range(40):
        start = [2 + index % 30, 2 + (index * 7) % 30]
        chunks.append(start + plain.generate(start, SamplingParams(temperature=0.7, seed=index),
                                             max_new_tokens=38).token_ids)
    folder = Path(tempfile.mkdtemp())
    tokens, features, aux = load_features(extract_features(target, chunks, folder, progress=False, aux_layers=[1, 2, 3]))
    config = HeadConfig.for_target("eagle3", decoder.config, aux_layers=[1, 2, 3])
    options = TrainOptions(steps=80, lr=1e-2, warmup=5, checkpoint_every=80, heldout_windows=6, ttt_steps=3)
    started = time.perf_counter()
    extra = train_head(config, vocab, tokens, features, folder / "eagle3.safetensors", options, device=device,
                       progress=False, log=lambda message: None, aux=aux)
    seconds = time.perf_counter() - started
    losses = [row["loss"] for row in extra["history"]]
    head = load_head(folder / "eagle3.safetensors", device=device)
    result = {"train_seconds": round(seconds, 1), "loss_first5": round(sum(losses[:5]) / 5, 3),
              "loss_last10": round(sum(losses[-10:]) / 10, 3), "accuracies": head.config.accuracies}
    path = str(folder / "eagle3.safetensors")
    for tree in (False, True):  # the head just trained, handed to the factory as the one loaded from `path`
        config = SpecConfig(method="eagle3-tree" if tree else "eagle3", k=4,
                            options=(HeadOptions(path=path, tree_size=8 if tree else None, tree_topk=3),))
        spec = engine_for(config, loaded(target), heads={("eagle3", path): (head, vocab)})
        same, accepted = [], 0
        for prompt in ([5, 9, 12, 3, 7], [20, 21, 22, 23], [2, 8, 8, 8, 30, 31, 2]):
            out = spec.generate(prompt, SamplingParams(temperature=0), max_new_tokens=40)
            same.append(out.token_ids == plain.generate(prompt, SamplingParams(temperature=0),
                                                        max_new_tokens=40).token_ids)
            accepted += out.stats.accepted_tokens
        result["tree" if tree else "chain"] = {"identical_to_plain": same, "accepted": accepted}
    return result


def random_models(args, report, section, tokenizer, device) -> None:
    """The sections on random-weight decoders of the real shapes."""
    target = NativeRunner(random_decoder(QWEN_1_5B, dtype=torch.bfloat16, device=device), initial_cache_len=2048)
    draft = NativeRunner(random_decoder(QWEN_0_5B, dtype=torch.bfloat16, device=device, seed=1),
                         initial_cache_len=2048)
    section("captured_costs", lambda: captured_costs(target, draft, args.reps))
    section("kernels", lambda: kernel_profile(target))
    section("compiled", lambda: compiled_step(target))
    section("sampling", lambda: seeded_sampling(target, tokenizer))
    section("e2e", lambda: end_to_end(target, draft, tokenizer, args.new_tokens))
    section("batched", lambda: batched_equals_alone(target, tokenizer))
    # The decoder's projections keep the row_block its fixed-step runner set: an unpadded runner
    # over it checks the fixed steps alone. Build it last (the section may be skipped).
    unpadded = NativeRunner(target.decoder, initial_cache_len=2048, step_tokens=None)
    section("e2e_unpadded", lambda: end_to_end(unpadded, draft, tokenizer, args.new_tokens,
                                               methods=("lookahead", "self-draft")))
    section("costs", lambda: {"target_1.5B_bf16_ctx512": forward_costs(target, 512, reps=args.reps),
                              "target_unpadded_ctx512": forward_costs(unpadded, 512, rows=(1, 5, 64), reps=args.reps),
                              "draft_0.5B_bf16_ctx512": forward_costs(draft, 512, rows=(1, 2, 5), reps=args.reps)})
    del target, draft, unpadded
    torch.cuda.empty_cache() if device.type == "cuda" else None
    if {"e2e_fp32", "batched_fp32"} <= set(args.skip.split(",")):
        return
    fp32 = NativeRunner(random_decoder(QWEN_1_5B, dtype=torch.float32, device=device), initial_cache_len=2048)
    section("e2e_fp32", lambda: end_to_end(fp32, None, tokenizer, args.new_tokens,
                                           methods=("lookahead", "self-draft", "copy")))
    section("batched_fp32", lambda: batched_equals_alone(fp32, tokenizer))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokenizer", type=Path, default=None, help="a directory with tokenizer.json (Qwen2.5)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--contexts", default="15,17,63,65,255,257,1023,1025,4095")
    parser.add_argument("--device", default="cuda", help="cuda; cpu for a dry run of this script")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--skip", default="", help="comma list of sections to skip: replayed, doctor, eagle3, "
                        "captured_costs, kernels, compiled, sampling, "
                        "e2e, batched, e2e_unpadded, costs, e2e_fp32, batched_fp32")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    skip = set(args.skip.split(","))
    device = torch.device(args.device)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "cuda": torch.version.cuda}
    print(json.dumps(report), flush=True)

    def section(name, fn):
        if name in skip:
            return
        started = time.perf_counter()
        try:
            report[name] = fn()
        except Exception:  # noqa: BLE001 - one failing section must not cost the lease the others
            report[name] = {"error": traceback.format_exc()[-3000:]}
        print(f"== {name} ({time.perf_counter() - started:.0f}s)\n{json.dumps(report[name], indent=1)}", flush=True)
        (args.out / "cuda_check.json").write_text(json.dumps(report, indent=1))

    section("replayed", lambda: [replayed_equals_eager(QWEN_0_5B, dtype, device)
                                 for dtype in (torch.bfloat16, torch.float32)])
    section("doctor", lambda: [doctor(dtype, args.out, args.contexts, args.device) for dtype in ("bfloat16", "float32")])
    tokenizer = None
    if args.tokenizer is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
    section("eagle3", lambda: eagle3_on_device(device))
    if not set(RANDOM_MODEL_SECTIONS) <= skip:
        random_models(args, report, section, tokenizer, device)
    for entry in report.get("replayed", []) if isinstance(report.get("replayed"), list) else []:
        print(f"replayed == eager {entry['dtype']}: {sum(entry['identical'])}/{entry['forwards']} forwards identical, "
              f"{entry['recorded_graphs']} graphs recorded, max |diff| {entry['max_abs_diff']}")
    captured = report.get("captured_costs", {})
    for name in ("target", "draft"):
        if name in captured:
            entry = captured[name]
            print(f"\n{name}: {entry['weights_GB']} GB of weights, floor {entry['floor_ms']} ms at "
                  f"{captured['bandwidth_GB_s']} GB/s; replayed 1-token step at "
                  f"{entry['floor_fraction_1_token']:.0%} of it")
            print("rows  eager chain ms  replayed chain ms (x step)  eager tree ms  replayed tree ms")
            one = entry["replayed"]["chain"][1]
            for n in entry["replayed"]["chain"]:
                print(f"{n:>4}  {entry['eager']['chain'][n]:13.3f}  {entry['replayed']['chain'][n]:17.3f} "
                      f"({entry['replayed']['chain'][n] / one:4.2f})  {entry['eager']['tree'][n]:13.3f}  "
                      f"{entry['replayed']['tree'][n]:16.3f}")
    for name, entry in report.get("kernels", {}).items():
        if isinstance(entry, dict):
            print(f"kernels of a 1-token step, {name}: {entry['kernels']} kernels, {entry['kernel_ms']} ms of GPU time;"
                  f" costliest {entry['top'][:3]}")
    table = replay_cost_file(report)
    if table is not None:
        (args.out / "replay_costs.json").write_text(json.dumps(table, indent=1) + "\n")
    costs = report.get("costs", {}).get("target_1.5B_bf16_ctx512", {})
    if "chain" in costs:
        one = costs["chain"][1]
        print("\nrows  chain ms (x step)  tree ms (x step)")
        for n in costs["chain"]:
            print(f"{n:>4}  {costs['chain'][n]:7.3f} ({costs['chain'][n] / one:4.2f})  "
                  f"{costs['tree'][n]:7.3f} ({costs['tree'][n] / one:4.2f})")
    for key in ("e2e", "e2e_unpadded", "e2e_fp32", "batched", "batched_fp32", "sampling", "eagle3"):
        for name, value in report.get(key, {}).items():
            print(f"{key:<13} {name:<22} {value}")
    for entry in report.get("doctor", []) if isinstance(report.get("doctor"), list) else []:
        print(f"doctor {entry['dtype']}: rc {entry['returncode']}, {len(entry['failures'])}/{entry['cases']} differ"
              f" e.g. {entry['failures'][:4]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
