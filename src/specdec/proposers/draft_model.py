"""A small language model as the proposer (Chen et al. 2023, Algorithm 2).

The draft samples k tokens autoregressively from its own warped distribution,
keeping its own KV cache. After verification its cache is cut back to the
accepted prefix. Its cache never holds the token that closed a step (the
recovered or bonus token, and when all k were accepted also its own k-th
draft, which it sampled but never fed), so the next propose() first feeds
whatever committed tokens it has not seen: usually one, two after a full
acceptance. That catch-up pass is also where its first draft distribution comes from.

The draft's prefill is the one cost of speculation that plain decoding does not
have (on the embedded pair ~40% of the target's prefill time), so it is kept
out of the way:
- a request's first step is plain (SpecEngine and BatchEngine do not ask the
  proposer), so the first token comes as soon as plain decoding's;
- a long prompt is read in chunks of CATCH_UP_CHUNK tokens, one per step,
  drafting nothing until the draft has caught up (those steps are plain);
- the draft reads only the prompt's last CONTEXT_WINDOW tokens (the positions
  stay the true ones). A draft's context changes only how good its guesses are,
  never the output; what a long document adds, copying from it, is the n-gram
  proposer's strength (ngram+draft).

With a confidence threshold (`--k auto`; transformers' assistant_confidence_threshold)
the draft stops early, after the first token it drew with a probability below the
threshold: its later guesses would mostly be rejected and each costs a draft
forward and a verified position. Where to stop depends only on the draft's own
distribution and draws, never on the target, so verification stays exact.
"""

from __future__ import annotations

import torch

from specdec.models.runner import ModelRunner
from specdec.proposers.base import DraftProposal, ProposeContext, Proposer
from specdec.sampling.warp import sample_from_probs, warp_logits


def match_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Pad (with -inf) or cut the draft's logits [..., V_draft] to the target's width.

    Same-tokenizer pairs often differ only in padding rows of the embedding
    (e.g. a 151,936-row head over a 151,665-token vocabulary).
    """
    width = logits.shape[-1]
    if width == vocab_size:
        return logits
    if width > vocab_size:
        return logits[..., :vocab_size]
    pad = logits.new_full((*logits.shape[:-1], vocab_size - width), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


CATCH_UP_CHUNK = 64  # prompt tokens the draft reads per step while it is behind
CONTEXT_WINDOW = 256  # the draft reads at most this many of the prompt's last tokens


class DraftModelProposer(Proposer):
    def __init__(self, runner: ModelRunner, confidence_threshold: float | None = None,
                 catch_up_chunk: int = CATCH_UP_CHUNK, context_window: int | None = CONTEXT_WINDOW) -> None:
        if catch_up_chunk < 1:
            raise ValueError(f"catch_up_chunk must be >= 1, got {catch_up_chunk!r}")
        if context_window is not None and context_window < 1:
            raise ValueError(f"context_window must be >= 1 or None, got {context_window!r}")
        self.catch_up_chunk, self.context_window = catch_up_chunk, context_window
        if confidence_threshold is not None and not 0.0 <= confidence_threshold < 1.0:
            raise ValueError(f"confidence_threshold must lie in [0, 1) or be None, got {confidence_threshold!r}")
        self.runner = runner
        self.confidence_threshold = confidence_threshold
        self._proposal_start = 0  # context length when the last proposal was made
        self._fed_drafts = 0  # draft tokens of the last proposal that sit in the cache
        self._skipped = 0  # leading context tokens this request's draft never reads

    def reset(self) -> None:
        self.runner.reset()
        self._proposal_start = 0
        self._fed_drafts = 0
        self._skipped = 0

    def unread_tokens(self, context_len: int) -> int:
        """Committed tokens this draft has not read (Proposer.unread_tokens): what its next proposals
        feed before they can draft; at a request's start, the prompt's last context_window tokens."""
        skipped = self._skipped if self.runner.seq_len else self._window_skip(context_len)
        return max(0, context_len - self.runner.seq_len - skipped)

    def _window_skip(self, context_len: int) -> int:  # leading tokens a fresh request's draft never reads
        return 0 if self.context_window is None else max(0, context_len - self.context_window)

    def propose(self, ctx: ProposeContext, max_k: int) -> DraftProposal:
        device = self.runner.device
        context = ctx.token_ids  # [1, L]
        context_len = context.shape[1]
        if max_k < 1:
            return DraftProposal.empty(1, device)
        max_k = min(max_k, self.runner.max_context - context_len)
        if max_k < 1:
            return DraftProposal.empty(1, device)

        if self.runner.seq_len == 0:  # a request's first proposal: read only the last context_window
            self._skipped = self._window_skip(context_len)

        # 1. Catch up: feed committed tokens the draft has not seen yet (positions are the true ones).
        cached = self.runner.seq_len + self._skipped
        if cached >= context_len:  # should not happen; recover by refeeding the last token
            cached = context_len - 1
            self.runner.truncate(torch.tensor([cached - self._skipped]))
        if context_len - cached > self.catch_up_chunk:  # far behind: read one chunk, draft nothing yet
            positions = torch.arange(cached, cached + self.catch_up_chunk, device=device)[None]
            self.runner.forward(context[:, cached:cached + self.catch_up_chunk].to(device), positions,
                                last_n_logits=1)
            return DraftProposal.empty(1, device)
        positions = torch.arange(cached, context_len, device=device)[None]
        logits = self.runner.forward(context[:, cached:].to(device), positions, last_n_logits=1).logits[:, -1]

        # 2. Draft up to max_k tokens, each from the same warp the target will be judged by.
        draft_ids: list[torch.Tensor] = []
        draft_probs: list[torch.Tensor] = []
        for i in range(max_k):
            logits = match_vocab(logits, ctx.vocab_size)  # [1, V]
            if ctx.params.greedy:
                token = logits.argmax(dim=-1)  # point mass: greedy_verify needs no probs
                probs = None
            else:
                probs = warp_logits(logits, ctx.params)  # [1, V]
                token = sample_from_probs(probs, ctx.generator)
                draft_probs.append(probs)
            draft_ids.append(token)
            if i + 1 == max_k or self._unsure(logits, probs, token):
                break
            position = torch.full((1, 1), context_len + i, device=device)
            logits = self.runner.forward(token[:, None], position).logits[:, -1]

        drafted = len(draft_ids)
        self._proposal_start = context_len
        self._fed_drafts = drafted - 1
        return DraftProposal(
            token_ids=torch.stack(draft_ids, dim=1),  # [1, k]
            num_tokens=torch.full((1,), drafted, dtype=torch.int64, device=device),
            probs=torch.stack(draft_probs, dim=1) if draft_probs else None,  # [1, k, V]
        )

    def _unsure(self, logits: torch.Tensor, probs: torch.Tensor | None, token: torch.Tensor) -> bool:
        """Was the token just drafted drawn with a probability below the threshold?

        Sampling: the warped probability of the drawn token. Greedy: the top
        probability of the unwarped distribution (argmax has probability 1 after warping).
        """
        if self.confidence_threshold is None:
            return False
        if probs is None:
            probs = torch.softmax(logits.float(), dim=-1)
        return float(probs[0, token[0]]) < self.confidence_threshold  # host sync: the loop must decide

    def on_verified(self, num_accepted: torch.Tensor) -> None:
        # Keep the context plus the accepted drafts that were fed; drop the rest.
        accepted = int(num_accepted.reshape(-1)[0])
        keep = self._proposal_start + min(accepted, self._fed_drafts)
        self.runner.truncate(torch.tensor([keep - self._skipped]))
