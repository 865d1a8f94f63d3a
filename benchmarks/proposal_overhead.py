"""The model-free proposers live on single bench prompts, with each proposal's own time: decode tok/s,
tau, drafted tokens per step and milliseconds per propose() (benchmarks/RESULTS.md, "Scored copying
live: --method copy against ngram, suffix and llama.cpp (issue 60)"). Plain decoding runs twice among
them, as the VM's speed drifts.

    python benchmarks/proposal_overhead.py rag,math
"""
import sys
import time
sys.path.insert(0, "benchmarks")
from peers import load_prompts, TARGET
from public_engines import SharedModels  # the factory's engines: `specdec generate --method M -k auto --quantize w4a8`
from specdec.config import SpecConfig
from specdec.sampling import SamplingParams
models = SharedModels()
target = models.target(SpecConfig(target=TARGET, quantize="w4a8"))
prompts = load_prompts(["specdec"], 1)
want = sys.argv[1].split(",")
for prompt in prompts:
    if prompt.category not in want: continue
    text = target.tokenizer.apply_chat_template([{"role": "user", "content": prompt.turns[0]}], tokenize=False, add_generation_prompt=True)
    ids = target.tokenizer(text, add_special_tokens=False)["input_ids"]
    for method in ["autoregressive", "ngram", "suffix", "copy", "autoregressive", "copy", "suffix"]:
        engine = models.engine(SpecConfig(target=TARGET, method=method, k="auto", quantize="w4a8"))
        proposer, spent = engine.proposer, [0.0, 0]
        if proposer is not None:
            orig = proposer.propose
            def timed(ctx, k, orig=orig):
                t = time.perf_counter(); r = orig(ctx, k); spent[0] += time.perf_counter() - t; spent[1] += 1; return r
            proposer.propose = timed  # the engine's own proposer object, so every step goes through the timer
        out = engine.generate(ids, SamplingParams(temperature=0), max_new_tokens=128)
        s = out.stats
        print(f"{prompt.category:10s} {method:14s} {s.generated_tokens / s.decode_time_s:6.1f} tok/s tau {s.mean_accepted_length:.2f} "
              f"drafted/step {s.drafted_tokens / s.target_forwards:.2f} steps {s.target_forwards} propose {1e3 * spent[0] / max(spent[1], 1):.2f} ms x{spent[1]}"
              + (f" costs {[round(proposer.step_costs.cost(n), 2) for n in (2, 5, 9)]}" if method == "copy" else ""), flush=True)
