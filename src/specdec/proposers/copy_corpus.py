"""Earlier requests' prompts and answers, which scored copying also copies from: one corpus per tenant,
newest kept, joined for copy_candidates.step_candidates.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from specdec.proposers.copy_candidates import SEPARATOR
from specdec.proposers.tenants import PerTenant

# Earlier prompts and answers searched per tenant: every step scans them (its time: benchmarks/RESULTS.md,
# "Scored copying live: --method copy against ngram, suffix and llama.cpp (issue 60)").
DEFAULT_CORPUS_TOKENS = 65_536


def check_corpus_tokens(max_tokens: int) -> None:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
        raise ValueError(f"the copy corpus size must be an integer >= 0 tokens, got {max_tokens!r}")


class CopyCorpus:
    """Earlier requests' prompts and answers, newest last, at most max_tokens of them (the oldest
    texts are dropped), joined by SEPARATORs for copy_candidates.step_candidates."""

    def __init__(self, max_tokens: int = DEFAULT_CORPUS_TOKENS) -> None:
        check_corpus_tokens(max_tokens)
        self.max_tokens = max_tokens
        self._texts: deque[tuple[np.ndarray, int]] = deque()  # (tokens, source: 2 prompt, 3 answer)
        self._size = 0
        self._joined: tuple[np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self._texts)

    def add(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        for text, source in ((prompt_ids, 2), (output_ids, 3)):
            tokens = np.asarray(text, np.int64)[-self.max_tokens:] if self.max_tokens else np.zeros(0, np.int64)
            if len(tokens):
                self._texts.append((tokens, source))
                self._size += len(tokens) + 1
        while self._texts and self._size > self.max_tokens + len(self._texts):
            tokens, _ = self._texts.popleft()
            self._size -= len(tokens) + 1
        self._joined = None

    def clear(self) -> None:
        self._texts.clear()
        self._size = 0
        self._joined = None

    def joined(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(tokens, source of each): the texts, each followed by a SEPARATOR; (None, None) when empty."""
        if not self._texts:
            return None, None
        if self._joined is None:
            self._joined = (np.concatenate([np.append(t, SEPARATOR) for t, _ in self._texts]),
                            np.concatenate([np.full(len(t) + 1, s) for t, s in self._texts]))
        return self._joined


class TenantCopyCorpora(PerTenant[CopyCorpus]):
    """One CopyCorpus per tenant (proposers/tenants.py)."""

    def __init__(self, max_tokens: int = DEFAULT_CORPUS_TOKENS) -> None:
        check_corpus_tokens(max_tokens)
        super().__init__(lambda: CopyCorpus(max_tokens))
        self.max_tokens = max_tokens
