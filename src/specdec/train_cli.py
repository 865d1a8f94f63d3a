"""specdec train-head: train an EAGLE or Medusa draft head for a target (training/train_head.py)."""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

EPILOG_TRAIN = """\
examples:
  specdec train-head --kind eagle                      # the embedded target; what --method eagle loads
  specdec train-head --kind medusa --steps 400
  specdec train-head --kind eagle --target ./my-llama-3b --out ./my-eagle.safetensors --max-tokens 400000

What it does: (1) the target reads --max-tokens tokens of training text once
(Python's standard library and its documentation as chat answers; no
download) and its hidden states are stored beside the checkpoint; (2) the
head trains on them with its paper's loss (EAGLE: smooth L1 on features +
0.1 x cross-entropy; Medusa: cross-entropy per head), checkpointing every
--checkpoint-every steps. Interrupt it any time: the same command resumes.
Uses a GPU when one is present (--device). On the embedded 1.5B target on a
2-core CPU the defaults take about 35 minutes for the first head (15 of them
for the features, which the second head reuses) and 20 for the second
(benchmarks/RESULTS.md).
The head never changes the output, only the speed: verification stays exact.
"""


def add_train_command(sub, add_model_args, positive_int) -> None:
    import argparse

    train = sub.add_parser("train-head", help="train an EAGLE or Medusa draft head on the target's hidden states",
                           epilog=EPILOG_TRAIN, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(train, draft=False)
    train.add_argument("--kind", choices=["eagle", "medusa"], required=True,
                       help="eagle: one decoder layer on [feature; next token] (Li et al. 2024); medusa: "
                            "residual heads for tokens t+2, t+3, ... (Cai et al. 2024)")
    train.add_argument("--out", default=None,
                       help="checkpoint path (default: the models' cache, where --method eagle/medusa look)")
    train.add_argument("--max-tokens", type=positive_int, default=49_152,
                       help="training text, in target tokens (default: 49152 = 96 windows of 512)")
    train.add_argument("--seq-len", type=positive_int, default=512, help="tokens per training window (default: 512)")
    train.add_argument("--steps", type=positive_int, default=300, help="optimizer steps (default: 300)")
    train.add_argument("--batch-size", type=positive_int, default=4, help="windows per step (default: 4)")
    train.add_argument("--lr", type=float, default=None,
                       help="peak learning rate (default: 3e-4 eagle, 1e-3 medusa; warmup then cosine)")
    train.add_argument("--head-vocab", type=positive_int, default=32768,
                       help="the head scores only the N most frequent tokens (EAGLE-3; default: 32768)")
    train.add_argument("--medusa-heads", type=positive_int, default=4, help="Medusa heads (default: 4)")
    train.add_argument("--intermediate-size", type=positive_int, default=None,
                       help="EAGLE layer's MLP width (default: the target's on a GPU, as in the paper; a third of "
                            "it on a CPU, where it sets both the training time and each draft step's cost)")
    train.add_argument("--checkpoint-every", type=positive_int, default=100, help="default: 100 steps")
    train.add_argument("--seed", type=int, default=0)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cmd_train_head(args, load_models) -> int:
    import torch

    from specdec.models.heads import HeadConfig, default_head_path, frozen_vocabulary
    from specdec.models.native.reduced_vocab import frequent_token_ids
    from specdec.training.corpus import chat_texts, stdlib_documents, token_chunks
    from specdec.training.train_head import TrainOptions, extract_features, load_features, train_head

    if args.backend == "hf":
        raise ValueError("train-head reads the target's hidden states through the native backend; drop --backend hf")
    args.backend = "native"
    out = Path(args.out) if args.out else default_head_path(args.target, args.kind)
    target, _ = load_models(args, need_draft=False)
    tokenizer, runner = target.tokenizer, target.runner

    started = time.perf_counter()
    chunks = token_chunks(tokenizer, chat_texts(tokenizer, stdlib_documents(), seed=args.seed), args.seq_len,
                          args.max_tokens)
    fingerprint = hashlib.sha256(f"{target.path}|{args.seq_len}|{args.max_tokens}|{args.seed}|{len(chunks)}"
                                 .encode()).hexdigest()[:12]
    features_dir = out.parent / f"features-{fingerprint}"
    _log(f"corpus: {len(chunks)} windows x {args.seq_len} tokens = {len(chunks) * args.seq_len} tokens "
         f"-> {features_dir}")
    shards = extract_features(runner, chunks, features_dir)
    features_s = time.perf_counter() - started
    tokens, features = load_features(shards)

    device = runner.device
    vocab_ids = frequent_token_ids(tokenizer, args.head_vocab, runner.vocab_size)
    train_dtype = torch.float32  # weights and optimizer in fp32; matmuls in bf16 under autocast where fast
    vocab = frozen_vocabulary(runner, target.path, vocab_ids, train_dtype)
    width = args.intermediate_size
    if width is None and device.type == "cpu":
        width = max(64, runner.decoder.config.intermediate_size // 3 // 64 * 64)
    config = HeadConfig.for_target(args.kind, runner.decoder.config, num_medusa_heads=args.medusa_heads,
                                   intermediate_size=width, target=str(args.target))
    options = TrainOptions(steps=args.steps, batch_size=args.batch_size,
                           lr=args.lr or (3e-4 if args.kind == "eagle" else 1e-3),
                           checkpoint_every=args.checkpoint_every, seed=args.seed)
    del target, runner  # frees the target's weights: the vocabulary holds the rows the head reuses
    extra = train_head(config, vocab, tokens, features, out, options, device=device, log=_log)
    _log(f"done: {out} (features {features_s / 60:.1f} min, training {extra.get('train_seconds', 0) / 60:.1f} min; "
         f"held-out top-1 by depth {[row[0] for row in extra.get('heldout_accuracies', [])]})")
    _log(f"use it: specdec generate --method {args.kind}{'' if args.out is None else f' --head {out}'} "
         f"--target {args.target} --stats --chat \"...\"")
    return 0
