"""The command line's shared options: models, method, k, n-gram / suffix / lookahead, heads.

Every command module (generate_cli, demo, serve_cli, research_cli, replay_cli, train_cli) adds its
options from here and turns the parsed namespace into a SpecConfig with
`config_from_args`, once, at the edge; cli.py only assembles the subcommands. Nothing
here imports a command module, so there is no import circle.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path
import re
from collections.abc import Callable, Sequence

from specdec.config import DEFAULT_DRAFT, DEFAULT_TARGET, QUANTIZATIONS, HeadOptions, SpecConfig, option_groups
from specdec.option_fields import flags_of, non_negative_int, number_in, positive_int, probability
from specdec.proposers.registry import AUTO_METHOD, METHODS, methods_reading

LENIENCE_HELP = ("LOSSY below 1 (Leviathan et al., Appendix A.5): a drafted token t is accepted with probability "
                 "min(1, p(t) / (l q(t))) instead of min(1, p(t) / q(t)), and at temperature 0 whenever "
                 "p(t) >= l max p. Faster, but the output no longer follows the target's distribution (nor "
                 "equals its greedy output); `specdec bench --lenience` measures the drift. (default: 1 = exact)")


# ---- argparse types: bad values are one clear line, before anything loads ----------------------


def int_or_auto(minimum: int) -> Callable[[str], int | str]:
    """An argparse type: "auto", or an integer >= minimum."""
    def parse(text: str) -> int | str:
        if text == "auto":
            return "auto"
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum} or auto, got {text}")
        return value
    return parse


k_value = int_or_auto(1)  # -k
tree_size_value = int_or_auto(0)  # --tree-size


def tree_size_list(text: str) -> list[int | str]:
    """bench's --tree-size: '10,auto' -> [10, 'auto'] (each a tree size, in the order given)."""
    values = [value.strip() for value in text.split(",") if value.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers >= 0 or auto, got {text!r}")
    return list(dict.fromkeys(tree_size_value(value) for value in values))


lenience = number_in("(0, 1]", lambda v: 0.0 < v <= 1.0)
non_negative_float = number_in("[0, inf)", lambda v: 0.0 <= v < math.inf)


def number_list(text: str, kind: type, minimum: float, what: str) -> list:
    """'1,2,4' -> [1, 2, 4]; every value >= minimum, else one clear error naming `what`."""
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < minimum for v in values):
        raise ValueError(f"{what} must be comma-separated {kind.__name__}s >= {minimum:g}, got {text!r}")
    return values


def float_list(text: str) -> list[float]:
    return number_list(text, float, 0, "temperatures")


def int_list(text: str) -> list[int]:
    return number_list(text, int, 1, "k values")


def k_list(text: str) -> list[int | str]:
    """'2,4,auto' -> [2, 4, 'auto']: fixed k values >= 1 in the order given, auto last."""
    values = [x.strip() for x in text.split(",") if x.strip()]
    fixed = [x for x in values if x != "auto"]
    try:
        ks: list[int | str] = [int(x) for x in fixed]
    except ValueError:
        ks = [0]
    if not values or any(k < 1 for k in ks):
        raise ValueError(f"k values must be comma-separated integers >= 1 or auto, got {text!r}")
    return ks + ["auto"] * ("auto" in values)


def lenience_list(text: str) -> list[float]:
    values = number_list(text, float, 0, "lenience values")
    if any(not 0 < v <= 1 for v in values):
        raise ValueError(f"lenience values must lie in (0, 1], got {text!r}")
    return values


def results_path(location: str) -> Path:
    """A `specdec bench` OUT directory (or its results.jsonl) -> the results.jsonl, or the results.jsonl.gz
    an archived run keeps where there is no plain one (benchmarks/results)."""
    path = Path(location)
    if path.suffix not in (".jsonl", ".gz"):
        path = path / "results.jsonl"
    packed = path.with_name(path.name + ".gz")
    return packed if path.suffix == ".jsonl" and not path.exists() and packed.exists() else path


# ---- option groups -----------------------------------------------------------------------------


def add_model_args(parser: argparse.ArgumentParser, draft: bool = True) -> None:
    parser.add_argument("--target", default=DEFAULT_TARGET,
                        help=f"target model name or HF directory (default: {DEFAULT_TARGET})")
    if draft:
        parser.add_argument("--draft", default=None,  # None: not named; the default draft loads when one is needed
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
                             "quantizing changes the target's own output slightly "
                             "(docs/cpu-and-quantization.md, 'What the fast default costs')")
    if draft:
        parser.add_argument("--draft-quantize", default="auto", choices=["auto", *QUANTIZATIONS],
                            help="the draft's weights; never changes the output, only the speed "
                                 "(default: auto = w4a8 on an x86 CPU, else int4 on a CPU with bf16, else none)")
        parser.add_argument("--draft-vocab", type=positive_int, default=None, metavar="N",
                            help="the draft's head scores only the N most frequent tokens (EAGLE-3's reduced "
                                 "vocabulary; native backend; lossless; default: the full vocabulary)")


def add_method_args(parser: argparse.ArgumentParser, adaptive: bool = True) -> None:
    """-k defaults to auto: one request's adaptive k (measured at least as good as the best fixed k:
    benchmarks/RESULTS.md), or the server's goodput k per step (at least plain's throughput at 1 to 16
    clients: benchmarks/results/serve-goodput)."""
    parser.add_argument("--method", default=AUTO_METHOD, choices=[AUTO_METHOD, *METHODS], metavar="METHOD",
                        help="; ".join(f"{name}: {text}" for name, text in METHODS.items()) +
                             "; auto (default): the fastest lossless method measured on the device, copy on a CPU "
                             "and ngram on CUDA (no draft model; benchmarks/RESULTS.md); with --draft, ngram+draft "
                             "(-k auto: each step drafts from the lookup's match or the draft model, whichever pays) "
                             "or draft (a fixed k)")
    if not adaptive:  # the batched engine (serve): goodput per step, or a fixed k
        parser.add_argument("-k", type=k_value, default="auto", metavar="K|auto",
                            help="auto (default): each step the k (0 included) that maximises the batch's expected "
                                 "committed tokens per second, from the measured step costs and each request's "
                                 "acceptance (goodput, as SmartSpec); --spec-max-batch then does not apply. Or "
                                 "a fixed number of draft tokens per step, >= 1 (copying with ngram likes 8). "
                                 "Lossless either way")
        parser.add_argument("--max-k", type=positive_int, default=8, help="the largest k auto may choose (default: 8)")
        add_ngram_args(parser)
        add_head_args(parser)
        return
    parser.add_argument("-k", type=k_value, default="auto", metavar="K|auto",
                        help="draft tokens per step, >= 1, or auto (default: auto; copying with ngram "
                             "likes 8). auto: each step's k in 1..--max-k from the request's recent acceptance "
                             "and the measured step costs (Leviathan et al.'s expected tokens/s); the draft model "
                             "also stops early below --draft-confidence and n-gram drafts follow the match "
                             "length. Still lossless")
    adaptive_group = parser.add_argument_group("adaptive k (-k auto)")
    adaptive_group.add_argument("--max-k", type=positive_int, default=8,
                                help="the largest k auto may choose (default: 8)")
    adaptive_group.add_argument("--draft-confidence", type=probability, default=0.4, metavar="P",
                                help="the draft model stops after a token it drew with probability below P "
                                     "(transformers' assistant_confidence_threshold; default: 0.4; 0 = never)")
    add_ngram_args(parser)
    add_head_args(parser)


def add_head_args(parser: argparse.ArgumentParser, sweep: bool = False) -> None:
    """sweep (bench): --tree-size takes a comma-separated list, each size its own row of the run."""
    heads = parser.add_argument_group(f"{HeadOptions.TITLE} (--method {', '.join(methods_reading(HeadOptions))})")
    heads.add_argument("--head", default=None, metavar="PATH",
                       help="a head checkpoint from `specdec train-head`, or for eagle3 a speculators / EAGLE-3 "
                            "directory (config.json + safetensors, as vLLM loads) (default: the one trained for "
                            "--target in the models' cache)")
    heads.add_argument("--tree-size", type=tree_size_list if sweep else tree_size_value, default=None,
                       metavar="N,auto" if sweep else "N|auto",
                       help="drafted tree nodes per step (default: 10; medusa 0 = a chain). Each node is one more "
                            "token the target verifies: on a CPU small trees pay, on a GPU EAGLE-2 uses ~60. "
                            "auto (eagle-tree, eagle3-tree; not serve): each step as many of the head's most "
                            "confident nodes as pay, from their path probabilities and the measured cost of "
                            "verifying n tokens on this machine" +
                            ("; comma-separated: every tree method at every size, interleaved" if sweep else ""))
    heads.add_argument("--tree-topk", type=positive_int, default=4,
                       help="eagle-tree: candidates per expanded node and nodes expanded per layer (default: 4)")
    heads.add_argument("--head-confidence", type=probability, default=0.0, metavar="P",
                       help="-k auto: a head's chain (eagle, eagle3, mlp-speculator) stops after a token its head "
                            "gave probability below P, as --draft-confidence stops the draft model's (default: 0 "
                            "= never; the controller's k alone)")


def add_option_groups(parser: argparse.ArgumentParser, kinds: Sequence[type] | None = None, *,
                      recorded: bool = False) -> None:
    """One argparse group per flagged options dataclass of SpecConfig (option_fields.py), titled by
    the methods whose entries read it: --GROUP-FIELD flags, read back by options_from_args.

    kinds: those dataclasses only (default: every group's); recorded (replay): no flag has a default
    of its own, an unset one keeps the recorded run's value."""
    for options in option_groups().values() if kinds is None else kinds:
        declared = flags_of(options)
        if not declared:
            continue
        group = parser.add_argument_group(f"{options.TITLE} (--method {', '.join(methods_reading(options))})")
        for field, flag in declared:
            name = f"--{options.GROUP}-{flag.name or field.name.replace('_', '-')}"
            dest, help = f"{options.GROUP}_{field.name}", flag.help
            if recorded:
                help = re.sub(r"\s*\(default: [^)]*\)", "", help) + " (default: the run's)"
            if flag.parse is None:
                group.add_argument(name, dest=dest, action="store_true", default=None if recorded else False,
                                   help=help)
            else:
                group.add_argument(name, dest=dest, type=flag.parse, default=None if recorded else field.default,
                                   metavar=flag.metavar, choices=flag.choices, help=help)


def options_from_args(args: argparse.Namespace, recorded: dict[str, dict] | None = None) -> dict:
    """Option group -> its options from the parsed flags (a flag a command lacks: its default).
    recorded (replay): group -> the run's recorded fields, which a flag left unset keeps."""
    built = {}
    for group_name, options in option_groups().items():
        if not flags_of(options):
            continue
        known = {field.name for field in dataclasses.fields(options)}
        fields = {name: value for name, value in ((recorded or {}).get(group_name) or {}).items() if name in known}
        for field, _ in flags_of(options):
            given = getattr(args, f"{group_name}_{field.name}", None)
            if given is not None:
                fields[field.name] = given
            elif recorded is None:
                fields[field.name] = field.default
        built[group_name] = options(**fields)
    return built


def add_ngram_args(parser: argparse.ArgumentParser) -> None:
    """The model-free proposers' knobs (each options dataclass's flags) and the draft's cap under ngram+draft."""
    add_option_groups(parser)
    parser.add_argument("--draft-k", type=positive_int, default=None,
                        help="ngram+draft and copy+draft: at most this many draft-model tokens per step (default: k)")


# ---- namespace -> SpecConfig, once ---------------------------------------------------------------


def config_from_args(args: argparse.Namespace, *, resolve: bool = True, grid: bool = False) -> SpecConfig:
    """The SpecConfig a command's options describe (options a command lacks keep their defaults).

    resolve: settle --method auto for the device (the draft model where a --draft is named,
    else the device's fastest lossless method), so every command sees and prints a real method.
    grid: the command names lists of methods, k and tree sizes (bench, analyze): leave them to it."""
    def option(name: str, default=None):
        return getattr(args, name, default)

    method, k = (AUTO_METHOD, "auto") if grid else (option("method", AUTO_METHOD), option("k", "auto"))
    config = SpecConfig(
        target=args.target, method=method, k=k, draft=option("draft"),
        max_k=option("max_k", 8), draft_confidence=option("draft_confidence", 0.4), draft_k=option("draft_k"),
        device=option("device", "auto"), dtype=option("dtype", "auto"), backend=option("backend", "auto"),
        quantize=option("quantize", "auto"), draft_quantize=option("draft_quantize", "auto"),
        draft_vocab=option("draft_vocab"),
        # bench's --tree-size is a list (grid): each grid cell sets its own
        options=(*options_from_args(args).values(),
                 HeadOptions(option("head"), None if grid else option("tree_size"), option("tree_topk", 4),
                             option("head_confidence", 0.0))),
    )
    return config.resolved() if resolve else config
