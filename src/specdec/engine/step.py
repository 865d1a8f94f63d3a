"""One speculative step over B rows: the only decode loop (docs/architecture.md).

SpecEngine runs it over one row, BatchEngine over its running requests (Chen et al. 2023, Algorithm 2):
  1. the proposer drafts up to max_ks[b] tokens for row b (-1 padded: rows are ragged);
  2. one target forward over every row's [last_token, *drafts], each row at its own positions
     (a tree's nodes at the root's position + depth, each seeing only its ancestors; a lookahead
     row's Jacobi window after its drafts, which no verified input sees);
  3-4. each row is verified alone, with its own params and generator (verify_proposal), so row b
     draws exactly the random numbers it would draw alone;
  5. each row's target cache rolls back to its committed tokens but the last (which opens the next
     step), the proposer forgets the rejected drafts, and a head proposer's rows queue the features
     of their committed inputs;
  6. commit_row cuts each row at EOS / stop string / max_new_tokens / the context;
  7. with `-k auto`, run_adaptive_step has engine/adaptive.py choose each row's k before the step
     and learn from it after.
With no proposer, or max_ks all 0, every row drafts nothing and this is plain decoding (Algorithm 1)
through the very same code, which makes the baseline honest.

Cache convention: a row's target cache holds every committed token except the last one, which is
the first input of the next step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from specdec.engine.metrics import RequestStats
from specdec.engine.request import Request, token_logprobs
from specdec.proposers.base import PROPOSER, DraftProposal, LookaheadInputs, ProposeContext
from specdec.proposers.batched import BatchProposer
from specdec.sampling.params import SamplingParams
from specdec.sampling.rejection import VerifyResult, greedy_verify, lenient_greedy_verify, rejection_sample
from specdec.sampling.tree import TreeVerifyResult, greedy_verify_tree, sample_verify_tree, tree_attention_mask, \
    tree_depths, typical_verify_tree
from specdec.sampling.warp import greedy_tokens, warp_logits


@dataclass
class Row:
    """One running request, as the step sees it."""

    request: Request
    generator: torch.Generator | None
    tokens: list[int]  # prompt and committed tokens
    stats: RequestStats = field(default_factory=RequestStats)
    # Head proposers only: the target's features [1, n, H] of committed tokens its proposer has not read.
    pending_hidden: torch.Tensor | None = None


@dataclass
class StepResult:
    """What one step did, per row b."""

    tokens: list[list[int]]  # verified: accepted drafts + one target token (commit_row cuts them)
    drafted: list[int]
    accepted: list[int]
    kept_inputs: list[list[int]]  # the forward's inputs now committed, root first (their logits emitted them)
    trees: tuple[tuple[int, ...] | None, ...]  # row b's draft tree (its parents), or None: a chain
    logits: torch.Tensor  # [B, W, V] the target's raw logits at the forward's inputs
    width: int  # drafts of the widest row: the forward verified B x (width + 1) tokens
    forward_tokens: int  # tokens in the forward, lookahead windows and padding included
    propose_s: float  # the proposer's time
    verify_s: float  # the forward and verification, rollback included
    errors: list[str | None] = field(default_factory=list)  # row b's own failure (it commits nothing), or None


def run_step(target, proposer: BatchProposer | None, rows: Sequence[Row], max_ks: Sequence[int]) -> StepResult:
    """Steps 1-5 over rows 0..B-1 of the target's cache (and the proposer's): propose, one target
    forward over every row's [last token, *drafts] (a chain, or a tree with its mask), verify (greedy
    matching or rejection sampling), roll back what was rejected in both caches.

    Args:
        target: the ModelRunner whose cache rows 0..B-1 hold the rows' committed tokens but the last.
        proposer: the BatchProposer drafting for the rows, or None (plain steps).
        rows: row b's state (its committed tokens, request, generator, pending target features).
        max_ks: row b's most drafted tokens this step (0: a plain step for that row).
    Returns:
        StepResult: per row the verified tokens (accepted drafts and one target token), drafted and
        accepted counts, the target's raw logits [B, W, V] at the forward's inputs, the forward's
        token count, and the proposer's and the verification's seconds.
    """
    device, batch = target.device, len(rows)
    lengths = [len(row.tokens) for row in rows]
    room = min(target.max_context - length for length in lengths)  # every row writes k+1 positions
    reads_hidden = proposer is not None and proposer.reads_target_hidden
    started = time.perf_counter()

    # 1. Propose, each row within its own cap.
    if proposer is not None and max(max_ks) >= 1:
        contexts = []
        for row, max_k in zip(rows, max_ks):
            hidden = None
            if reads_hidden and max_k >= 1:  # a row drafting nothing keeps its queue for later
                hidden, row.pending_hidden = row.pending_hidden, None
            contexts.append(ProposeContext(torch.tensor([row.tokens], device=device), row.request.params,
                                           row.generator, target.vocab_size, target_hidden=hidden))
        proposal = proposer.propose(contexts, max_ks)
    else:
        proposal = DraftProposal.empty(batch, device)
    proposal = proposal.truncated(room)  # a tree may hold more nodes than its depth: what the fullest row fits
    draft_ids = proposal.token_ids.to(device)  # [B, k]
    k = draft_ids.shape[1]
    trees = proposal.trees or (None,) * batch

    # 2. One target forward over [last_token, *drafts] of every row, each at its own positions.
    proposed = time.perf_counter()
    last = torch.tensor([[row.tokens[-1]] for row in rows], device=device)  # [B, 1]
    layout = step_layout(torch.cat([last, draft_ids.clamp_min(0)], dim=1), trees,
                         proposal.lookaheads or (None,) * batch, room)
    positions = torch.tensor(lengths, device=device)[:, None] - 1 + layout.offsets.to(device)
    # Rectangular, [B, k+1]: a ragged forward (the decoder's `valid`) measured slower at 2-8 clients on the
    # Zen 4 EPYC (benchmarks/results/serve-goodput/ragged).
    if reads_hidden:
        select_target_features(target, proposer.target_layers)
    if layout.among_new is None:  # chains: the causal forward every runner has (the transformers one too)
        output = target.forward(layout.inputs, positions, rows=slice(0, batch))
    else:  # a tree or a lookahead window: the native decoder's mask among the new tokens
        output = target.forward(layout.inputs, positions, rows=slice(0, batch), among_new=layout.among_new.to(device))
    logits = output.logits  # [B, k+1 (+ lookahead tokens), V]
    for b, lookahead in enumerate(layout.lookaheads):  # lookahead decoding: each row's Jacobi update
        if lookahead is not None:
            proposer.read_lookahead(b, logits[b, k + 1:k + 1 + lookahead.token_ids.shape[1]])

    # 3-4. Verify each row alone: its own width, params and generator.
    drafted = proposal.num_tokens.tolist()  # host sync: commit code
    verified, accepted, kept_inputs, errors = [], [], [], []
    for b, row in enumerate(rows):
        width = drafted[b]
        probs = None if proposal.probs is None else proposal.probs[b:b + 1, :width]
        row_proposal = DraftProposal(draft_ids[b:b + 1, :width], proposal.num_tokens[b:b + 1], probs,
                                     trees=None if trees[b] is None else (trees[b],))
        try:  # a row's own failure (its sampling state, its logits) fails that row alone
            row_accepted, tokens, inputs = verify_proposal(row_proposal, logits[b:b + 1, :width + 1],
                                                           row.request.params, row.generator)
            check_vocabulary(tokens, target.vocab_size)
            error = None
        except Exception as failure:  # noqa: BLE001 - reported to the row's client, never emitted
            row_accepted, tokens, inputs, error = 0, [], [0], f"{type(failure).__name__}: {failure}"
        accepted.append(row_accepted)
        verified.append(tokens)
        kept_inputs.append(inputs)
        errors.append(error)

    # 5. Roll back each row to its committed tokens but the last: a tree row keeps its accepted path,
    #    packed after the root; a chain row its prefix.
    for b, parents in enumerate(trees):
        if parents is not None:
            target.keep_path(lengths[b] - 1, kept_inputs[b][1:], row=b)
    target.truncate([length + a for length, a in zip(lengths, accepted)], rows=slice(0, batch))
    if reads_hidden:
        for b, row in enumerate(rows):
            queue_hidden(row, None if output.hidden is None else output.hidden[b:b + 1, kept_inputs[b]])
    if proposer is not None and k > 0:
        proposer.on_verified(torch.tensor(accepted))
    return StepResult(verified, drafted, accepted, kept_inputs, trees, logits, k, layout.inputs.numel(),
                      propose_s=proposed - started,
                      verify_s=time.perf_counter() - proposed, errors=errors)


class NoTokenError(RuntimeError):
    """The target's distribution at a step held no token to emit (its logits all NaN or -inf)."""


def check_vocabulary(tokens: Sequence[int], vocab_size: int) -> None:
    """The last guard of "never a wrong token" (docs/architecture.md): every verified token is an id
    of the vocabulary. The samplers give -1 where the target's logits held no candidate
    (sampling/warp.py: candidate_logits), and nothing outside 0..V-1 may reach a client."""
    bad = next((token for token in tokens if not 0 <= token < vocab_size), None)
    if bad is not None:
        raise NoTokenError(f"the target's logits held no finite value to choose a token from (sampled id {bad}); "
                           f"the model's output is broken (NaN or -inf everywhere): nothing was emitted")


def run_adaptive_step(target, proposer: BatchProposer | None, rows: Sequence[Row], caps: Sequence[int],
                      controller, handles: Sequence, fixed: Sequence[bool] | None = None) -> StepResult:
    """run_step with each row's k (at most its cap) chosen by the controller (engine/adaptive.py,
    None: the caps themselves), which then learns from what the step measured. Rows the controller
    does not size take their caps: fixed[b] (a request that asked for its own k), and rows whose
    proposer sizes its own drafts (scored copying). In a batch mixing both kinds the controller's
    measured proposer time is the whole step's."""
    if controller is None or proposer is None:
        return run_step(target, proposer, rows, caps)
    chosen = [b for b in range(len(rows)) if not (proposer.sizes_own_drafts_of(b) or (fixed and fixed[b]))]
    if not chosen:
        return run_step(target, proposer, rows, caps)
    unread = [proposer.unread_tokens(b, len(rows[b].tokens)) for b in chosen]
    offered = [proposer.sources(b, rows[b].tokens) for b in chosen]  # a composite's choices
    offered = None if all(offer is None for offer in offered) else offered
    ks = controller.choose([handles[b] for b in chosen], [caps[b] for b in chosen], unread,
                           [rows[b].request.remaining for b in chosen], offered)
    sources, max_ks = list(controller.sources), list(caps)
    for b, k in zip(chosen, ks):
        max_ks[b] = k
    if offered is not None:
        every_row = [PROPOSER] * len(rows)
        for b, source in zip(chosen, sources):
            every_row[b] = source
        proposer.use_sources(every_row)
    result = run_step(target, proposer, rows, max_ks)
    # Context the proposer read this step (a draft model's catch-up, where it drafted nothing).
    caught_up = sum(before - proposer.unread_tokens(b, len(rows[b].tokens))
                    for b, before, k in zip(chosen, unread, ks) if k >= 1)
    controller.record([handles[b] for b in chosen], ks, [result.drafted[b] for b in chosen],
                      [result.accepted[b] for b in chosen], draft_s=result.propose_s, tokens=result.forward_tokens,
                      verify_s=result.verify_s, caught_up=caught_up, sources=sources)
    return result


def commit_row(row: Row, result: StepResult, b: int, max_context: int) -> list[int]:
    """Step 6 for row b: its verified tokens cut at EOS / stop string / max_new_tokens (request.py) and
    at the context's end; the stats, and the logprobs where the request asked. Returns the tokens kept."""
    request = row.request
    kept = request.commit(result.tokens[b])
    row.tokens += kept
    if request.logprobs is not None:  # the target's, at the inputs that emitted them
        logprobs = token_logprobs(result.logits[b, result.kept_inputs[b]], kept, request.params, request.logprobs)
        request.token_logprobs += logprobs
    row.stats.record_step(result.drafted[b], result.accepted[b], len(kept))
    if not request.finished and len(row.tokens) >= max_context:
        request.finish("length")
    return kept


def queue_hidden(row: Row, hidden: torch.Tensor | None) -> None:
    """Queue a row's committed tokens' features [1, n, H] for its proposer's next draft."""
    if hidden is None:
        raise ValueError("this proposer reads the target's hidden states; the target's runner gives none "
                         "(use the native backend: --backend native)")
    row.pending_hidden = hidden if row.pending_hidden is None else torch.cat([row.pending_hidden, hidden], dim=1)


def prefill(target, row: Row, start: int, count: int, cache_row: int, features: tuple[int, ...] | None) -> None:
    """Feed row.tokens[start:start + count] into the target's cache row cache_row; features: the
    target's features the proposer reads (select_target_features), queued for it; None: none."""
    device = target.device
    ids = torch.tensor([row.tokens[start:start + count]], dtype=torch.int64, device=device)
    positions = torch.arange(start, start + count, device=device)[None]
    if features is not None:
        select_target_features(target, features)
    output = target.forward(ids, positions, rows=slice(cache_row, cache_row + 1), last_n_logits=1)
    if features is not None:
        queue_hidden(row, output.hidden)


def record_step_costs(proposer: BatchProposer | None, result: StepResult) -> None:
    """What a one-row step's verification cost, for the proposer that sizes drafts by it: scored
    copying's step_costs (proposers/scored_copy.py), and --tree-size auto's budget, which also learns
    how many of the tree's nodes were accepted (proposers/tree_budget.py). A step of several rows is
    recorded apart, by its forward's tokens (StepCosts.record_batch: what a batch's width costs)."""
    if proposer is None:
        return
    if len(result.drafted) != 1:
        if proposer.step_costs is not None:
            proposer.step_costs.record_batch(result.forward_tokens, result.verify_s)
        return
    if proposer.step_costs is not None:
        proposer.step_costs.record(result.forward_tokens, result.verify_s, tree=result.trees[0] is not None)
    if result.trees[0] is not None and proposer.tree_budget is not None:
        proposer.tree_budget.record(verified_tokens=result.width + 1, verify_s=result.verify_s,
                                    accepted=result.accepted[0])


def select_target_features(runner, layers: tuple[int, ...]) -> None:
    """Which features the target's forward hands over: its final ones (), or the named layers'
    (EAGLE-3). Set before every forward that reads them: engines may share one target's weights."""
    decoder = getattr(runner, "decoder", None)
    if decoder is None:
        if layers:
            raise ValueError("this head reads the target's inner layers: load the target with the native backend")
        return
    decoder.capture_layers(layers)


# ---- verification (steps 3-4) --------------------------------------------------------------


def verify_step(
    draft_ids: torch.Tensor,  # [B, k] int64, padded with -1
    num_draft: torch.Tensor,  # [B]
    draft_probs: torch.Tensor | None,  # [B, k, V]; None = point mass
    target_logits: torch.Tensor,  # [B, k+1, V] raw
    params: SamplingParams,
    generator: torch.Generator | None,
) -> VerifyResult:
    """Greedy matching at temperature 0, else warp the target and rejection-sample.

    params.lenience < 1 switches to the lossy lenient rules (sampling/rejection.py).
    """
    if params.greedy:
        if params.exact:
            return greedy_verify(draft_ids, num_draft, greedy_tokens(target_logits))
        return lenient_greedy_verify(draft_ids, num_draft, target_logits, params.lenience)
    target_probs = warp_logits(target_logits, params)  # [B, k+1, V]
    return rejection_sample(draft_ids, num_draft, draft_probs, target_probs, generator=generator,
                            lenience=params.lenience)


def verify_tree_step(
    proposal: DraftProposal,  # one row, a tree (or a chain, under typical acceptance)
    target_logits: torch.Tensor,  # [1, n+1, V] raw, at the root and at each node
    params: SamplingParams,
    generator: torch.Generator | None,
) -> TreeVerifyResult:
    """A tree (sampling/tree.py): greedy walk at temperature 0, else recursive rejection over
    siblings; with typical_acceptance (LOSSY) Medusa's rule, which also takes chains."""
    if params.lenience != 1.0:
        raise ValueError("lenience < 1 applies to chain drafts; tree drafts are verified exactly "
                         "(or with --typical-acceptance)")
    tokens = proposal.token_ids[0, : int(proposal.num_tokens[0])].tolist()
    tree = proposal.tree()
    parents = list(tree) if tree is not None else list(range(-1, len(tokens) - 1))
    if params.typical_acceptance and not params.greedy:
        return typical_verify_tree(tokens, parents, warp_logits(target_logits, params)[0], generator)
    if params.greedy:
        return greedy_verify_tree(tokens, parents, greedy_tokens(target_logits[0]).tolist())
    draft_probs = None if proposal.probs is None else proposal.probs[0]
    return sample_verify_tree(tokens, parents, draft_probs, warp_logits(target_logits, params)[0], generator)


def verify_proposal(
    proposal: DraftProposal,  # one row, on the target's device: a chain (no tree) or a tree
    target_logits: torch.Tensor,  # [1, n+1, V] raw, at the root and at each drafted input
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[int, list[int], list[int]]:
    """One row, chain or tree: (accepted drafts, the tokens to commit, the forward's inputs they came
    from, root first, for rollback and logprobs)."""
    if proposal.tree() is None and verifies_as_chain(params):
        result = verify_step(proposal.token_ids, proposal.num_tokens, proposal.probs, target_logits, params, generator)
        accepted = int(result.num_accepted[0])  # host sync: commit code
        return accepted, result.output_ids[0, : accepted + 1].tolist(), list(range(accepted + 1))
    tree = verify_tree_step(proposal, target_logits, params, generator)
    return tree.num_accepted, tree.output_ids, [0] + [node + 1 for node in tree.path]


def verifies_as_chain(params: SamplingParams) -> bool:
    """Chains go through verify_step unless typical acceptance (a tree rule) is asked for."""
    return params.greedy or not params.typical_acceptance


# ---- the forward's layout (step 2) ---------------------------------------------------------


class StepLayout(NamedTuple):
    inputs: torch.Tensor  # [B, W]: each row's root and drafts (k+1, padded), then its lookahead tokens
    offsets: torch.Tensor  # [B, W] each input's position after the root's
    among_new: torch.Tensor | None  # [B, W, W] which inputs each input sees; None: causal
    lookaheads: tuple[LookaheadInputs | None, ...]  # the lookahead tokens placed, per row


def step_layout(inputs: torch.Tensor, trees: Sequence[tuple[int, ...] | None],
                lookaheads: Sequence[LookaheadInputs | None], room: int) -> StepLayout:
    """The verification forward of one step. inputs [B, k+1]: root and drafts; trees: row b's
    parents, or None for a chain; lookaheads: row b's lookahead tokens, or None; room: cache entries
    past the root the fullest row still has.

    A tree row's nodes sit at the root's position + depth and see their ancestors. A row's
    lookahead tokens go after the k+1 verified inputs, at their own offsets, seeing the root and
    what their mask allows; no verified input sees them, so verified logits are a plain step's.
    Where the widest window would not fit the room, no row carries one this step. Padding (a row
    drafting less than the widest, a window shorter than the widest) sits at chain offsets and sees
    causally: no real input sees it, and rollback drops it."""
    batch, verified = inputs.shape
    extra = max((lookahead.token_ids.shape[1] for lookahead in lookaheads if lookahead is not None), default=0)
    if verified - 1 + extra > room:  # the window's cache entries would not fit the context: verify only
        lookaheads, extra = (None,) * batch, 0
    width = verified + extra
    offsets = torch.arange(width).repeat(batch, 1)
    if not any(trees) and not extra:  # chains, or trees without a node this step: the cheaper causal forward
        return StepLayout(inputs, offsets, None, tuple(lookaheads))
    among_new = torch.ones(width, width, dtype=torch.bool).tril().repeat(batch, 1, 1)
    if extra:
        inputs = torch.cat([inputs, inputs.new_zeros(batch, extra)], dim=1)
    for b, (parents, lookahead) in enumerate(zip(trees, lookaheads)):
        if parents:
            n = len(parents) + 1
            offsets[b, 1:n] = torch.tensor(tree_depths(parents))
            among_new[b, :n, :n] = tree_attention_mask(parents)
        if lookahead is not None:
            window = slice(verified, verified + lookahead.token_ids.shape[1])
            inputs[b, window] = lookahead.token_ids[0].to(inputs.device)
            offsets[b, window] = lookahead.offsets.cpu()
            among_new[b, window] = False
            among_new[b, window, 0] = True  # the root
            among_new[b, window, window] = lookahead.mask.cpu()
    return StepLayout(inputs, offsets, among_new, tuple(lookaheads))
