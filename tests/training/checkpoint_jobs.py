"""A tiny EAGLE head's training run, checkpointing every step: the job tests/training/test_checkpoints.py
kills at random moments (through tests/killing.py) and resumes.

Everything is seeded, so a run's state after step n is the same in every process: the test compares
what a killed run left on disk with an uninterrupted run's checkpoint of the same step.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from specdec.models.heads import FrozenVocabulary, HeadConfig
from specdec.training.train_head import TrainOptions, train_head

HEAD_FILE = "head.safetensors"
STEPS = 16
VOCAB, HIDDEN, WINDOWS, LENGTH = 64, 32, 24, 16


def tiny_run() -> tuple:
    """(config, vocab, tokens, features, options) of a tiny EAGLE head on random "target features"."""
    generator = torch.Generator().manual_seed(0)
    config = HeadConfig(kind="eagle", hidden_size=HIDDEN, target_vocab_size=VOCAB, num_heads=4, num_kv_heads=2,
                        head_dim=HIDDEN // 4, intermediate_size=2 * HIDDEN)
    vocab = FrozenVocabulary(torch.randn(VOCAB, HIDDEN, generator=generator),
                             torch.randn(VOCAB, HIDDEN, generator=generator), torch.arange(VOCAB))
    tokens = torch.randint(VOCAB, (WINDOWS, LENGTH), generator=generator)
    features = torch.randn(WINDOWS, LENGTH, HIDDEN, generator=generator).to(torch.bfloat16)
    options = TrainOptions(steps=STEPS, batch_size=2, lr=1e-2, warmup=2, checkpoint_every=1, heldout_windows=2,
                           classification_positions=8)
    return config, vocab, tokens, features, options


def warm_up() -> None:
    """Run once in tests/killing.py's server before it forks: a child then starts training at once,
    instead of spending most of its life in train_head's first-call imports and kernel builds."""
    with tempfile.TemporaryDirectory() as directory:
        train_tiny_head(Path(directory))


def train_tiny_head(directory: Path, log=lambda message: None) -> dict:
    """Train (or resume) the tiny head in directory/head.safetensors, a checkpoint after every step."""
    config, vocab, tokens, features, options = tiny_run()
    return train_head(config, vocab, tokens, features, directory / HEAD_FILE, options, device=torch.device("cpu"),
                      progress=False, log=log)
