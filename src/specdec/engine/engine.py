"""SpecEngine: prefill, speculative step, generate, stream.

One step (docs/architecture.md; Chen et al. 2023, Algorithm 2):
  1. the proposer drafts up to k tokens;
  2. one target forward over [last_token, *draft];
  3. the target logits are warped with the request's SamplingParams;
  4. verification keeps the longest acceptable prefix plus one target token;
  5. target and proposer caches roll back to the committed tokens;
  6. tokens are committed, cut at EOS / stop string / max_new_tokens;
  7. stats are recorded.
With no proposer every step drafts nothing and this is plain autoregressive
decoding (Algorithm 1) through the very same code, which makes the baseline honest.

Cache convention: the target's KV cache holds every committed token except the
last one, which is the first input of the next step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from specdec.engine.adaptive import AdaptiveK
from specdec.engine.metrics import RequestStats
from specdec.engine.request import Request, check_generation_options, encode_prompt
from specdec.models.loader import eos_ids_of
from specdec.models.runner import ModelRunner
from specdec.proposers.base import DraftProposal, LookaheadInputs, ProposeContext, Proposer
from specdec.sampling.params import SamplingParams
from specdec.sampling.rejection import VerifyResult, greedy_verify, lenient_greedy_verify, rejection_sample
from specdec.sampling.tree import TreeVerifyResult, greedy_verify_tree, sample_verify_tree, tree_attention_mask, \
    tree_depths, typical_verify_tree
from specdec.sampling.warp import warp_logits


def verify_step(
    draft_ids: torch.Tensor,  # [B, k] int64, padded with -1
    num_draft: torch.Tensor,  # [B]
    draft_probs: torch.Tensor | None,  # [B, k, V]; None = point mass
    target_logits: torch.Tensor,  # [B, k+1, V] raw
    params: SamplingParams,
    generator: torch.Generator | None,
) -> VerifyResult:
    """Steps 3-4: greedy matching at temperature 0, else warp the target and rejection-sample.

    params.lenience < 1 switches to the lossy lenient rules (sampling/rejection.py).
    """
    if params.greedy:
        if params.exact:
            return greedy_verify(draft_ids, num_draft, target_logits.argmax(dim=-1))
        return lenient_greedy_verify(draft_ids, num_draft, target_logits, params.lenience)
    target_probs = warp_logits(target_logits, params)  # [B, k+1, V]
    return rejection_sample(draft_ids, num_draft, draft_probs, target_probs, generator=generator,
                            lenience=params.lenience)


def verify_tree_step(
    proposal: DraftProposal,  # one row, parents set
    target_logits: torch.Tensor,  # [1, n+1, V] raw, at the root and at each node
    params: SamplingParams,
    generator: torch.Generator | None,
) -> TreeVerifyResult:
    """Steps 3-4 for a tree (sampling/tree.py): greedy walk at temperature 0, else
    recursive rejection over siblings; with typical_acceptance (LOSSY) Medusa's rule,
    which also takes chains (parents None = one path)."""
    if params.lenience != 1.0:
        raise ValueError("lenience < 1 applies to chain drafts; tree drafts are verified exactly "
                         "(or with --typical-acceptance)")
    tokens = proposal.token_ids[0, : int(proposal.num_tokens[0])].tolist()
    parents = list(proposal.parents) if proposal.parents is not None else list(range(-1, len(tokens) - 1))
    if params.typical_acceptance and not params.greedy:
        return typical_verify_tree(tokens, parents, warp_logits(target_logits, params)[0], generator)
    if params.greedy:
        return greedy_verify_tree(tokens, parents, target_logits[0].argmax(dim=-1).tolist())
    draft_probs = None if proposal.probs is None else proposal.probs[0]
    return sample_verify_tree(tokens, parents, draft_probs, warp_logits(target_logits, params)[0], generator)


def verify_proposal(
    proposal: DraftProposal,  # one row, on the target's device: a chain (parents None) or a tree
    target_logits: torch.Tensor,  # [1, n+1, V] raw, at the root and at each drafted input
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[int, list[int], list[int]]:
    """Steps 3-4 for one row, chain or tree: (accepted drafts, the tokens to commit, the forward's
    inputs they came from, root first, for rollback and logprobs). SpecEngine and BatchEngine alike."""
    if proposal.parents is None and verifies_as_chain(params):
        result = verify_step(proposal.token_ids, proposal.num_tokens, proposal.probs, target_logits, params, generator)
        accepted = int(result.num_accepted[0])  # host sync: commit code
        return accepted, result.output_ids[0, : accepted + 1].tolist(), list(range(accepted + 1))
    tree = verify_tree_step(proposal, target_logits, params, generator)
    return tree.num_accepted, tree.output_ids, [0] + [node + 1 for node in tree.path]


class StepLayout(NamedTuple):
    inputs: torch.Tensor  # [B, W]: each row's root and drafts (k+1, padded), then its lookahead tokens
    offsets: torch.Tensor  # [B, W] each input's position after the root's
    among_new: torch.Tensor | None  # [B, W, W] which inputs each input sees; None: causal
    lookaheads: tuple[LookaheadInputs | None, ...]  # the lookahead tokens placed, per row


def step_layout(inputs: torch.Tensor, trees: Sequence[tuple[int, ...] | None],
                lookaheads: Sequence[LookaheadInputs | None], room: int) -> StepLayout:
    """The verification forward of one step (SpecEngine: one row; BatchEngine: every row).
    inputs [B, k+1]: root and drafts; trees: row b's parents, or None for a chain; lookaheads:
    row b's lookahead tokens, or None; room: cache entries past the root the fullest row still has.

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


def verifies_as_chain(params: SamplingParams) -> bool:
    """Chains go through verify_step unless typical acceptance (a tree rule) is asked for."""
    return params.greedy or not params.typical_acceptance


@dataclass
class StepOutcome:
    tokens: list[int]  # verified this step: accepted drafts + one target token
    drafted: int
    accepted: int
    draft_s: float  # the proposer's time
    verify_s: float  # the target's forward and the verification, up to the host sync


@dataclass
class StreamChunk:
    text: str  # new text since the previous chunk
    token_ids: list[int]  # tokens committed in this step
    finish_reason: str | None = None  # set on the last chunk: "eos" | "stop" | "length"
    stats: RequestStats | None = None  # set on the last chunk


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str
    stats: RequestStats = field(default_factory=RequestStats)


def select_target_features(runner, layers: tuple[int, ...]) -> None:
    """Which features the target's forward hands over: its final ones (), or the named layers'
    (EAGLE-3). Set per request, so engines sharing one target runner may read different ones."""
    decoder = getattr(runner, "decoder", None)
    if decoder is None:
        if layers:
            raise ValueError("this head reads the target's inner layers: load the target with the native backend")
        return
    decoder.capture_layers(layers)


class SpecEngine:
    """Speculative decoding of one target with one proposer (None = plain decoding).

    >>> engine = SpecEngine(target_runner, DraftModelProposer(draft_runner), tokenizer, k=4)
    >>> engine.generate("def fib(n):", SamplingParams(temperature=0), max_new_tokens=64).text

    k="auto" lets an AdaptiveK (engine/adaptive.py) choose each step's k in
    1..max_k from the request's recent acceptance and the measured step costs.
    """

    def __init__(
        self,
        target: ModelRunner,
        proposer: Proposer | None = None,
        tokenizer: object | None = None,
        *,
        k: int | str = 4,
        eos_token_ids: frozenset[int] | None = None,
        max_k: int = 8,
        reuse_prefix: bool = True,
    ) -> None:
        if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"k (draft tokens per step) must be an integer >= 1 or 'auto', got {k!r}")
        self.target = target
        self.proposer = proposer
        self.tokenizer = tokenizer
        self.k = k
        self.adaptive = AdaptiveK(max_k=max_k) if k == "auto" else None
        self.eos_token_ids = eos_ids_of(tokenizer) if eos_token_ids is None else frozenset(eos_token_ids)
        # The target's features not yet handed to a proposer that reads them ([1, n, H]).
        self._keeps_hidden = proposer is not None and proposer.reads_target_hidden
        self._pending_hidden: torch.Tensor | None = None
        # Prompt caching across requests (what llama-server's cache_prompt and vLLM's prefix caching
        # do): the target's cache still holds the last request's prompt and answer, so a prompt that
        # starts the same (a system prompt, a tool schema, the conversation so far) prefills only
        # the rest. Exact wherever a forward in pieces equals one forward (the native runner's
        # chunking invariance; not the transformers backend). Heads need the target's features of
        # every prompt token, so they prefill afresh.
        self.reuse_prefix = (reuse_prefix and not self._keeps_hidden
                             and bool(getattr(target, "exact_prefix_reuse", False)))
        self._cached: tuple[int, list[int]] | None = None  # (the runner's cache_version, the ids cached)

    # ---- input edge -------------------------------------------------------------------------

    def encode(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        """Prompt text (optionally wrapped in the chat template) or ids -> ids, validated."""
        return encode_prompt(self.tokenizer, prompt, self.target.max_context, chat, self.target.vocab_size)

    # ---- API --------------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        max_new_tokens: int = 128,
        stop: Sequence[str] = (),
        chat: bool = False,
    ) -> GenerationResult:
        request = self._make_request(prompt, params, max_new_tokens, stop, chat)
        stats = RequestStats()
        for _ in self._run(request, stats):
            pass
        return GenerationResult(
            text=request.text,
            token_ids=list(request.generated),
            prompt_token_ids=request.prompt_ids,
            finish_reason=request.finish_reason or "length",
            stats=stats,
        )

    def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        max_new_tokens: int = 128,
        stop: Sequence[str] = (),
        chat: bool = False,
    ) -> Iterator[StreamChunk]:
        """Yield text and tokens as soon as each step verifies them."""
        request = self._make_request(prompt, params, max_new_tokens, stop, chat)
        stats = RequestStats()
        for kept in self._run(request, stats):
            text = request.text_delta() if self.tokenizer is not None else ""
            if request.finished:
                yield StreamChunk(text, kept, request.finish_reason, stats)
                return
            if kept or text:
                yield StreamChunk(text, kept)

    def sample_continuations(
        self, prompt: str | Sequence[int], params: SamplingParams, samples: int, *, min_tokens: int = 2,
        seed: int = 0, chat: bool = False,
    ) -> Iterator[list[int]]:
        """Draw `samples` continuations of one prompt, each at least min_tokens long, for losslessness checks.

        The prompt is prefilled once; each draw then runs ordinary steps (with its own
        generator, seeded seed + i) until min_tokens are out, and rolls everything back
        to the prompt. Speculative and plain engines yield identically distributed
        lists if and only if speculation is lossless; EOS and max_tokens cuts are
        ignored here, on purpose: they do not change which tokens are drawn.
        """
        ids = self.encode(prompt, chat)
        device = self.target.device
        prefix = torch.tensor([ids], dtype=torch.int64, device=device)  # [1, L]
        self._prefill(prefix)
        prompt_hidden = self._pending_hidden
        for index in range(samples):
            self._pending_hidden = prompt_hidden
            step_params = replace(params, seed=seed + index)
            generator = step_params.make_generator(device)
            tokens, drawn = prefix, []
            self.target.truncate(torch.tensor([prefix.shape[1] - 1]))
            if self.proposer is not None:
                self.proposer.reset()
            if self.adaptive is not None:
                self.adaptive.start_request()
            while len(drawn) < min_tokens:
                context_left = self.target.max_context - tokens.shape[1]
                if context_left <= 1:
                    raise ValueError("the prompt leaves no room in the context for the sampled tokens")
                ctx = ProposeContext(tokens, step_params, generator, self.target.vocab_size)
                max_k = self._next_k(tokens.shape[1], min_tokens - len(drawn))
                kept = self._step(ctx, min(max_k, context_left - 1)).tokens
                drawn += kept
                tokens = torch.cat([tokens, torch.tensor([kept], dtype=torch.int64, device=device)], dim=1)
            yield drawn

    # ---- the loop ---------------------------------------------------------------------------

    def _make_request(self, prompt, params, max_new_tokens, stop, chat) -> Request:
        stop = check_generation_options(max_new_tokens, stop)
        return Request(
            prompt_ids=self.encode(prompt, chat),
            params=params or SamplingParams(),
            max_new_tokens=max_new_tokens,
            eos_token_ids=self.eos_token_ids,
            stop=stop,
            tokenizer=self.tokenizer,
        )

    def _run(self, request: Request, stats: RequestStats) -> Iterator[list[int]]:
        """Prefill, then steps until the request finishes; yields the tokens of each step."""
        device = self.target.device
        generator = request.params.make_generator(device)
        tokens = torch.tensor([request.prompt_ids], dtype=torch.int64, device=device)  # [1, L]
        stats.prompt_tokens = tokens.shape[1]

        started = request_started = time.perf_counter()
        if self.proposer is not None:
            self.proposer.reset()
        if self.adaptive is not None:
            self.adaptive.start_request()
        stats.prompt_tokens_reused = self._prefill(tokens)
        stats.prefill_time_s = time.perf_counter() - started

        started = time.perf_counter()
        while not request.finished:
            context_left = self.target.max_context - tokens.shape[1]
            if context_left <= 0:
                request.finish("length")
                break
            # At most remaining-1 drafts: a step emits num_accepted + 1 tokens. The first step is
            # plain, so the first token comes as soon as plain decoding's (time to first token):
            # a proposer's own prefill (a draft model reading the prompt) starts at the second.
            first_step = stats.target_forwards == 0
            max_k = 0 if first_step else min(self._next_k(tokens.shape[1], request.remaining),
                                             request.remaining - 1, context_left - 1)
            ctx = ProposeContext(tokens, request.params, generator, self.target.vocab_size)
            step = self._step(ctx, max_k)
            kept = request.commit(step.tokens)
            stats.record_step(step.drafted, step.accepted, len(kept))
            if kept:
                tokens = torch.cat([tokens, torch.tensor([kept], dtype=torch.int64, device=device)], dim=1)
            stats.decode_time_s = time.perf_counter() - started
            if kept and not stats.first_token_s:
                stats.first_token_s = time.perf_counter() - request_started
            yield kept
        self._end_request(request)
        if self.reuse_prefix:  # the cache holds the committed tokens' keys up to its length
            cached = min(self.target.seq_len, tokens.shape[1])
            self._cached = (self.target.cache_version, tokens[0, :cached].tolist())

    def forget_earlier_requests(self) -> None:
        """Empty what the proposer learned from earlier requests (suffix decoding's cache), so the
        next request runs as if it were the first (the bench measures requests alone this way)."""
        self._cached = None
        if self.proposer is not None:
            self.proposer.forget_earlier_requests()

    def _end_request(self, request: Request) -> None:
        """Tell a proposer that learns across requests (suffix decoding's cache) what was written."""
        if self.proposer is not None:
            self.proposer.end_request(request.prompt_ids, request.generated)

    def _next_k(self, context_len: int, remaining: int) -> int:
        if self.adaptive is None:
            return self.k
        return self.adaptive.next_k(self._unread_tokens(context_len), remaining)

    def _unread_tokens(self, context_len: int) -> int:
        """What the proposer must still read before it drafts (Proposer.unread_tokens; 0 where it keeps no state)."""
        return 0 if self.proposer is None else self.proposer.unread_tokens(context_len)

    def _prefill(self, tokens: torch.Tensor) -> int:  # [1, L]
        """A target cache holding every token but the last, which opens the first step; returns how
        many of them the last request left cached (reuse_prefix), which are not read again."""
        reused = self._reusable_prefix(tokens)
        if reused:
            self.target.truncate([reused])
        else:
            self.target.reset()
        self._cached = None
        self._pending_hidden = None
        if self._keeps_hidden:
            select_target_features(self.target, self.proposer.target_layers)
        if tokens.shape[1] - 1 > reused:
            positions = torch.arange(reused, tokens.shape[1] - 1, device=tokens.device)[None]
            output = self.target.forward(tokens[:, reused:-1], positions, last_n_logits=1)
            self._keep_hidden(output.hidden, None)
        return reused

    def _reusable_prefix(self, tokens: torch.Tensor) -> int:
        """Leading prompt tokens (all but the last) whose keys the target's cache holds from the
        last request, untouched since: the common prefix of the two token lists."""
        if not self.reuse_prefix or self._cached is None or self._cached[0] != self.target.cache_version:
            return 0
        cached, prompt = self._cached[1], tokens[0, :-1].tolist()
        common = 0
        for a, b in zip(cached, prompt):
            if a != b:
                break
            common += 1
        return common

    def _keep_hidden(self, hidden: torch.Tensor | None, inputs: list[int] | None) -> None:
        """Queue the target's features of the committed inputs (None = all) for the proposer."""
        if not self._keeps_hidden:
            return
        if hidden is None:
            raise ValueError("this proposer reads the target's hidden states; the target's runner gives none "
                             "(use the native backend: --backend native)")
        kept = hidden if inputs is None else hidden[:, inputs]
        pending = self._pending_hidden
        self._pending_hidden = kept if pending is None else torch.cat([pending, kept], dim=1)

    def _take_hidden(self, ctx: ProposeContext) -> ProposeContext:
        if not self._keeps_hidden:
            return ctx
        ctx, self._pending_hidden = replace(ctx, target_hidden=self._pending_hidden), None
        return ctx

    def _step(self, ctx: ProposeContext, max_k: int) -> StepOutcome:
        """One speculative step."""
        context_len = ctx.token_ids.shape[1]
        device = self.target.device
        started = time.perf_counter()

        # 1. Propose.
        caught_up = 0  # context the proposer read in this step (a catch-up step's tokens, if it drafted nothing)
        if self.proposer is not None and max_k >= 1:
            unread = self._unread_tokens(context_len)
            proposal = self.proposer.propose(self._take_hidden(ctx), max_k)
            caught_up = unread - self._unread_tokens(context_len)
        else:
            proposal = DraftProposal.empty(1, device)
        # A tree may hold more nodes than its depth: only as many as the context still has room for.
        proposal = proposal.truncated(self.target.max_context - context_len)
        draft_ids = proposal.token_ids.to(device)  # [1, k]
        k = draft_ids.shape[1]
        proposed = time.perf_counter()

        # 2. One target forward over [last_token, *draft] at positions L-1 .. L-1+k
        #    (a tree: at L-1 + depth, each node seeing only its ancestors; lookahead tokens after them).
        inputs = torch.cat([ctx.token_ids[:, -1:], draft_ids.clamp_min(0)], dim=1)  # [1, k+1]
        layout = step_layout(inputs, (proposal.parents,), (proposal.lookahead,), self.target.max_context - context_len)
        positions = context_len - 1 + layout.offsets.to(device)
        if layout.among_new is None:  # a chain: the causal forward every runner has (the HF one too)
            output = self.target.forward(layout.inputs, positions)
        else:  # a tree or a lookahead window: the native decoder's mask among the new tokens
            output = self.target.forward(layout.inputs, positions, among_new=layout.among_new.to(device))
        target_logits = output.logits[:, : k + 1]  # [1, k+1, V]
        if layout.lookaheads[0] is not None:
            self.proposer.read_lookahead(output.logits[0, k + 1:])

        # 3-4. Warp and verify; 5. roll back: keep the last token and the accepted
        #    drafts; the new final token is not cached yet (it opens the next step).
        num_accepted, tokens, kept_inputs = verify_proposal(replace(proposal, token_ids=draft_ids), target_logits,
                                                            ctx.params, ctx.generator)
        if proposal.parents is None:  # a chain's accepted path is its prefix: plain truncation
            self.target.truncate(torch.tensor([context_len + num_accepted]))
        else:
            self.target.keep_path(context_len - 1, kept_inputs[1:])
        self._keep_hidden(output.hidden, kept_inputs)
        if self.proposer is not None and k > 0:
            self.proposer.on_verified(torch.tensor([num_accepted]))

        # 6. The caller commits, cutting at EOS / stop / length; 7. adaptive k learns from the step.
        num_draft = int(proposal.num_tokens[0])
        outcome = StepOutcome(tokens, num_draft, num_accepted,
                              draft_s=proposed - started, verify_s=time.perf_counter() - proposed)
        if self.adaptive is not None:
            self.adaptive.record(drafted=num_draft, accepted=num_accepted, draft_s=outcome.draft_s,
                                 verified_tokens=k + 1, verify_s=outcome.verify_s, caught_up=caught_up)
        if proposal.parents is not None and self.proposer.tree_budget is not None:  # --tree-size auto
            self.proposer.tree_budget.record(verified_tokens=k + 1, verify_s=outcome.verify_s, accepted=num_accepted)
        return outcome
