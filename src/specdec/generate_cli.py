"""specdec generate: one prompt, streamed to the terminal (or one JSON object)."""

from __future__ import annotations

import argparse
import json
import sys

from specdec.cli_options import LENIENCE_HELP, add_method_args, add_model_args, config_from_args, lenience, positive_int

EPILOG_GENERATE = """\
examples:
  specdec generate --chat "Write a Python function that checks whether a number is prime."
  specdec generate --method autoregressive --max-new-tokens 64 "def quicksort(xs):"
  specdec generate --temperature 0.7 --top-p 0.9 --seed 1 --stats --chat "Tell me about tides."
  specdec generate -k auto --stats --chat "Explain Python's GIL in three sentences."
  specdec generate --method ngram -k 8 --chat "Rename x to total in: def f(x): return x + 1"
  specdec generate --temperature 0.7 --lenience 0.5 --chat "Write a haiku."   # LOSSY: faster, not exact
  specdec generate --method ngram+draft -k 8 --draft-k 4 --chat "Summarise: ..."
  specdec generate --method suffix -k 8 --chat "..."   # suffix trees over this and earlier requests
  specdec generate --method lookahead --chat "..."    # the target guesses ahead for itself (pays on GPUs)
  specdec generate --target ./my-llama-3b --draft ./my-llama-1b -k 6 --json "Hello"
  specdec train-head --kind eagle && specdec generate --method eagle-tree --stats --chat "..."
  specdec train-head --kind eagle3 --self-distill 160 && specdec generate --method eagle3 --chat "..."
  specdec generate --method eagle3 --head ./some-eagle3-speculators-dir --chat "..."   # as vLLM loads it
  specdec generate --method medusa --tree-size 8 --temperature 0.7 --typical-acceptance --chat "..."  # LOSSY

With no --method (auto) specdec drafts by n-gram lookup, loading no draft model
(the fastest lossless method measured on CPUs and on an H100, where a draft step
costs what a target step does); --method draft, or naming a --draft, picks the draft model anywhere.
Models are names from `specdec models list` (converted on first use) or local
Hugging Face model directories. The draft must share the target's tokenizer.
ngram needs no draft model: it copies what followed the context's last n tokens
earlier in the context (prompt lookup decoding), which pays off when the answer
repeats the input: code edits, summaries, extraction, multi-turn chat.
At temperature 0 the output is token for token the target's greedy output;
at temperature > 0 it follows exactly the target's (warped) distribution.
-k auto keeps that guarantee (it only changes how many tokens are drafted);
--lenience below 1 gives it up for speed.
eagle, eagle-tree and medusa draft with heads trained on the target's own hidden
states (`specdec train-head`); trees are verified in one target pass and stay
lossless; --typical-acceptance gives that up for more accepted tokens.
"""


def add_generate_command(sub) -> None:
    gen = sub.add_parser("generate", help="generate text for one prompt", epilog=EPILOG_GENERATE,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    gen.add_argument("prompt", help="the prompt text (use --chat to wrap it in the model's chat template)")
    add_model_args(gen)
    add_method_args(gen)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), > 0 samples")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]; 1 = off (default)")
    gen.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x top probability; 0 = off")
    gen.add_argument("--seed", type=int, default=None, help="seed of the request's random generator")
    gen.add_argument("--lenience", type=lenience, default=1.0, metavar="L", help=LENIENCE_HELP)
    gen.add_argument("--typical-acceptance", action="store_true",
                     help="LOSSY (Medusa, Cai et al. 2024): at temperature > 0 keep a drafted token when the "
                          "target gives it more than min(0.09, 0.3 exp(-entropy)), so unsure targets accept more; "
                          "the output no longer follows the target's distribution. For chains and trees "
                          "(default: off = exact)")
    gen.add_argument("--max-new-tokens", type=positive_int, default=128, help="default: 128")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable); not included in the output")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    gen.add_argument("--stats", action="store_true", help="print per-request speculative statistics")
    gen.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, stats) instead")


def format_stats(stats) -> str:
    per_position = ", ".join(f"{rate:.2f}" for rate in stats.acceptance_per_position) or "-"
    return (
        f"generated {stats.generated_tokens} tokens in {stats.total_time_s:.2f}s "
        f"({stats.tokens_per_s:.2f} tok/s; prefill {stats.prefill_time_s:.2f}s)\n"
        f"target forwards {stats.target_forwards}, "
        f"drafted per step {stats.drafted_tokens / max(stats.target_forwards, 1):.2f}, "
        f"mean accepted length {stats.mean_accepted_length:.2f}, "
        f"acceptance rate {stats.acceptance_rate:.2%} ({stats.accepted_tokens}/{stats.drafted_tokens})\n"
        f"acceptance per draft position: {per_position}"
    )


def cmd_generate(args) -> int:
    from specdec.factory import load_engine
    from specdec.sampling import SamplingParams

    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p, args.seed, args.lenience,
                            args.typical_acceptance)
    config = config_from_args(args)
    engine, _, _ = load_engine(config)
    prompt_kwargs = dict(max_new_tokens=args.max_new_tokens, stop=args.stop, chat=args.chat)
    if args.json:
        result = engine.generate(args.prompt, params, **prompt_kwargs)
        print(json.dumps({
            "text": result.text, "token_ids": result.token_ids, "prompt_tokens": len(result.prompt_token_ids),
            "finish_reason": result.finish_reason, "method": config.method, "k": config.k,
            "stats": result.stats.to_dict(),
        }, indent=2))
        return 0
    stats = None
    for chunk in engine.stream(args.prompt, params, **prompt_kwargs):
        print(chunk.text, end="", flush=True)
        stats = chunk.stats or stats
    print()
    if args.stats and stats is not None:
        print(format_stats(stats), file=sys.stderr, flush=True)
    return 0
