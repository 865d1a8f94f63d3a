"""Which token ids a reduced-vocabulary draft head keeps: the N most frequent on a shipped corpus.

EAGLE-3 (Li et al. 2025, arXiv 2503.01840) drafts over a reduced vocabulary:
the draft's output head scores only the N tokens the target emits most
often. That cuts the draft's largest matrix (on Qwen2.5-0.5B the 151,936 x 896
head is a fifth of all its weights) and costs nothing in correctness, because
rejection sampling is exact for any draft distribution: the draft simply
never proposes a token outside its N, and the target still can emit it.

Frequencies come from src/specdec/data/vocab_corpus.jsonl.gz (code and chat,
see its README). Tokens the corpus never shows are ranked by id, which for
byte-level BPE vocabularies is merge order: earlier merges are more frequent.
The tokenizer's special tokens (EOS, chat markers) are always kept.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from importlib import resources

import torch

CORPUS = "vocab_corpus.jsonl.gz"


def corpus_records() -> list[dict]:
    """The shipped corpus: {"source", "text"} per line (HumanEval, MT-bench; see data/README.md)."""
    with resources.files("specdec.data").joinpath(CORPUS).open("rb") as raw, gzip.open(raw, "rt") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def corpus_texts() -> list[str]:
    return [record["text"] for record in corpus_records()]


def frequent_token_ids(tokenizer, count: int, vocab_size: int, texts: list[str] | None = None) -> torch.Tensor:
    """[count] int64 ids, ascending: the special tokens plus the most frequent others.

    >>> ids = frequent_token_ids(tokenizer, 32768, 151936)   # a quarter of Qwen2.5's vocabulary
    """
    if count < 1:
        raise ValueError(f"the draft vocabulary size must be >= 1, got {count}")
    if count >= vocab_size:
        return torch.arange(vocab_size)
    texts = corpus_texts() if texts is None else texts
    counts = Counter(token for ids in tokenizer(texts, add_special_tokens=False)["input_ids"] for token in ids)
    special = {i for i in getattr(tokenizer, "all_special_ids", []) if i < vocab_size}
    special |= {i for i in getattr(tokenizer, "added_tokens_decoder", {}) if i < vocab_size}
    # Special tokens first, then by count (descending), then by id (BPE merge order).
    ranked = sorted(range(vocab_size), key=lambda i: (i not in special, -counts.get(i, 0), i))
    return torch.tensor(sorted(ranked[:count]), dtype=torch.int64)
