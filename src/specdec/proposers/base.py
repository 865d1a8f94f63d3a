"""The Proposer interface (every hook, with its default) and the DraftProposal it returns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple
import torch

from specdec.sampling.params import SamplingParams


@dataclass(frozen=True)
class LookaheadInputs:
    """Extra tokens a proposer asks the target to read in the verification forward without
    verifying them (lookahead decoding's Jacobi window): placed after the drafts, at the root's
    position + offsets, seeing the root and, among themselves, what mask allows; never the
    drafts, and the drafts never them. Their logits go to the proposer's read_lookahead();
    their cache entries are dropped with the step's rollback."""

    token_ids: torch.Tensor  # [1, m] int64
    offsets: torch.Tensor  # [m] positions after the root's (>= 1)
    mask: torch.Tensor  # [m, m] bool: which of these tokens each one sees (itself included)


@dataclass(frozen=True)
class DraftProposal:
    token_ids: torch.Tensor  # [B, k] int64, padded with -1
    num_tokens: torch.Tensor  # [B] int64; 0 means "no draft"
    probs: torch.Tensor | None  # [B, k, V] warped draft distribution; None = point mass
    # Row b's draft tree, or None for a chain: trees[b][i] is node i's parent, -1 = the root (the
    # last committed token), in topological order (sampling/tree.py). None = every row a chain.
    trees: tuple[tuple[int, ...] | None, ...] | None = None
    # Row b's lookahead tokens, or None. None = no row carries any.
    lookaheads: tuple[LookaheadInputs | None, ...] | None = None

    def tree(self, row: int = 0) -> tuple[int, ...] | None:
        """Row's draft tree (its parents), or None for a chain."""
        return None if self.trees is None else self.trees[row]

    def lookahead(self, row: int = 0) -> LookaheadInputs | None:
        """Row's lookahead tokens, or None."""
        return None if self.lookaheads is None else self.lookaheads[row]

    @staticmethod
    def of_row(tokens: list[int], parents: Sequence[int] | None, device: torch.device | str,
               probs: torch.Tensor | None = None, lookahead: LookaheadInputs | None = None) -> DraftProposal:
        """One row of drafted tokens (a chain, or a tree given by parents)."""
        return DraftProposal(token_ids=torch.tensor([tokens], dtype=torch.int64, device=device).reshape(1, -1),
                             num_tokens=torch.tensor([len(tokens)], dtype=torch.int64, device=device), probs=probs,
                             trees=None if parents is None else (tuple(parents),),
                             lookaheads=None if lookahead is None else (lookahead,))

    def truncated(self, nodes: int) -> DraftProposal:
        """The first `nodes` drafts of every row: what fits the context's last positions. A tree's
        nodes are in topological order, so a prefix is still a tree; verification stays exact."""
        if self.token_ids.shape[1] <= nodes:
            return self
        trees = None if self.trees is None else tuple(None if tree is None else tree[:nodes] for tree in self.trees)
        return DraftProposal(self.token_ids[:, :nodes], self.num_tokens.clamp(max=nodes),
                             None if self.probs is None else self.probs[:, :nodes], trees, self.lookaheads)

    @staticmethod
    def empty(batch_size: int = 1, device: torch.device | str = "cpu") -> DraftProposal:
        return DraftProposal(
            token_ids=torch.empty(batch_size, 0, dtype=torch.int64, device=device),
            num_tokens=torch.zeros(batch_size, dtype=torch.int64, device=device),
            probs=None,
        )


def chain_or_tree(parents: Sequence[int]) -> Sequence[int] | None:
    """None where parents describe a chain (each node the child of the one before): the engine
    verifies and rolls back a chain more cheaply than a tree."""
    return None if all(parent == index - 1 for index, parent in enumerate(parents)) else parents


def committed_since(seen: Sequence[int], token_ids: torch.Tensor) -> list[int] | None:
    """The committed tokens of token_ids [1, L] after the `seen` ones a proposer has read, or None
    when token_ids does not continue them (shorter, or different at the last token read): a new
    request, to be read from the start. Only the new tokens cross to the host."""
    count, context_len = len(seen), token_ids.shape[1]
    if count > context_len or (count and int(token_ids[0, count - 1]) != seen[-1]):
        return None
    return token_ids[0, count:].tolist()


class Source(NamedTuple):
    """Where a row's drafts would come from this step, for -k auto's controller (engine/adaptive.py),
    which keeps acceptance rates per (name, detail) and costs per name. A composite proposer offers a
    row several (ngram+draft: the n-gram lookup's match of length n, and the draft model) and the
    controller picks one; a single proposer is one source, PROPOSER."""

    name: str
    detail: int = 0  # a finer class with its own rates (an n-gram match's length)
    reads_backlog: bool = False  # it reads the committed tokens it missed first (a draft model: unread_tokens)


PROPOSER = Source("proposer", reads_backlog=True)  # a proposer with one source


@dataclass(frozen=True)
class ProposeContext:
    token_ids: torch.Tensor  # [B, L] int64: every committed token, prompt included
    params: SamplingParams  # the request's warp; drafts must come from the same warp
    generator: torch.Generator | None  # the request's randomness
    vocab_size: int  # width of the target's logits; draft probs must match it
    # Only for proposers that read the target's features (reads_target_hidden, the
    # EAGLE / Medusa heads): [1, n, H] the target's final-norm hidden states of the
    # committed tokens it has not yet been given, oldest first. The cache holds every
    # committed token but the last, so after them exactly one token has no feature yet.
    target_hidden: torch.Tensor | None = None


class Proposer:
    """Guesses up to max_k next tokens, then hears how many were accepted (one request, B = 1).

    The proposer owns its state (a draft KV cache, an n-gram index) and must only ever keep state
    derived from committed tokens: on_verified() is where it forgets rejected guesses. Every hook
    the engine calls is declared here with a default that does nothing, so the engine calls them
    directly and a proposer overrides only what it uses (as HF's CandidateGenerator declares its
    hooks; docs/architecture.md).
    """

    # The engine keeps the target's features of the committed tokens (ProposeContext.target_hidden)
    # for proposers that read them: the EAGLE, EAGLE-3 and Medusa heads.
    reads_target_hidden: bool = False
    # Which target layers' inputs those features include besides the final norm's (EAGLE-3).
    target_layers: tuple[int, ...] = ()
    # Tokens a drafting step adds to the verification forward besides its drafts (lookahead
    # decoding's Jacobi window); -k auto's controller (engine/adaptive.py) counts them in the step's cost.
    extra_verify_tokens: int = 0
    # --tree-size auto: the controller that sizes the next tree from measured verification costs
    # (proposers/tree_budget.py); the engine records each tree step into it. None = fixed trees.
    tree_budget = None
    # Scored copying (proposers/scored_copy.py) chooses each draft's length itself from the verification
    # costs the engine records into step_costs (engine/step.py: record_step_costs): under -k auto the
    # engine then asks it for the whole k, and the controller does not choose a length on top.
    sizes_own_drafts: bool = False
    step_costs = None  # a StepCosts (record, record_batch), or None: the engine records nothing

    def propose(self, ctx: ProposeContext, max_k: int) -> DraftProposal:
        """Guess the next tokens of one request.

        Args:
            ctx: token_ids [1, L] int64, every committed token (prompt included); the request's
                params and generator (drafts are warped as the target's tokens will be); vocab_size V;
                target_hidden [1, n, H] for proposers that read the target's features.
            max_k: the most tokens (chain) or nodes (tree) to draft, >= 0.
        Returns:
            DraftProposal with token_ids [1, k] int64 (k <= max_k), num_tokens [1] (0: no draft this
            step), probs [1, k, V] (the draft distribution each token was drawn from) or None (point
            masses: copies), and trees (the row's parents) where the draft is a tree.
        """
        raise NotImplementedError

    def on_verified(self, num_accepted: torch.Tensor) -> None:
        """[B] drafts accepted in the last proposal: roll back own state. Stateless: nothing."""

    def reset(self) -> None:
        """Forget the request: a new one starts."""

    def unread_tokens(self, context_len: int) -> int:
        """Committed tokens it has not read yet (a draft model's own prefill: 1-2 between steps, a
        prompt's worth at a request's start), so -k auto can weigh reading them against what
        drafting would save. 0 where it keeps no such state."""
        return 0

    def read_lookahead(self, logits: torch.Tensor) -> None:
        """The target's logits [m, V] at the lookahead tokens its last proposal carried."""

    def end_request(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """A request finished: what was written (suffix decoding's cache learns across requests)."""

    def start_tenant(self, tenant: str | None) -> None:
        """The next request is tenant's (None: the default): what it learns from earlier requests
        comes from that tenant's alone (suffix decoding's cache; docs/security.md). Called before
        reset() (BatchProposer.set_row_tenant). Nothing is shared across requests by default:
        nothing to do."""

    def forget_earlier_requests(self) -> None:
        """Empty what it learned from earlier requests, so the next runs as if it were the first."""
