"""The engine against the reference decoder (sampling/reference.py): for every method that runs on a
tiny model, greedy and sampled, SpecEngine (engine/step.py, rejection.py, tree.py) emits the same
tokens, step by step, as the plain-Python algorithm, and consumes the same random draws.

The reference asks a fresh cache for each distribution it needs (the whole context in one forward),
so the engine's KV rollback, tree masks, lookahead windows and kept paths are checked along the way.
Model-free drafts (copies, trees, head proposals) are replayed from what the engine's proposer
proposed for the same context; the draft model drafts in the reference itself. Trees come from
eagle-tree, medusa and lookahead's verification branch (suffix drafts chains on these prompts).
"""

from __future__ import annotations

import pytest
import torch

from conftest import make_model, make_native, make_peaked_model
from specdec.engine import SpecEngine
from specdec.models.heads import FrozenVocabulary, HeadConfig, LoadedHead, build_head
from specdec.proposers.head_methods import HeadOptions
from specdec.proposers.registry import build_proposer
from specdec.proposers.scored_copy import CopyOptions
from specdec.proposers.suffix import SuffixOptions
from specdec.sampling import SamplingParams
from specdec.sampling.reference import Draft, draft_with_model, draw, speculative_decode
from specdec.sampling.tree import tree_depths

PROMPTS = ["abc abc abc, abc abc", "the quick brown fox"]
K, NEW_TOKENS = 3, 32
MODES = {"greedy": SamplingParams(temperature=0), "sampled": SamplingParams(temperature=0.8, seed=7)}
COPY_METHODS = ["ngram", "suffix", "copy", "ngram+draft", "copy+draft", "lookahead"]
HEAD_METHODS = {"eagle": "eagle", "eagle-tree": "eagle", "medusa": "medusa"}


@pytest.fixture(scope="module")
def models():
    """A tiny random target, peaked so that sampled text repeats and copies get accepted at T = 0.8, and
    a one-layer random draft."""
    return make_peaked_model(seed=0), make_model(seed=1, layers=1, random_bias=True)


def whole_context(runner):
    """A runner as the reference's model: ids [L] -> the raw logits [V] after them, from an empty cache."""
    def logits(ids: list[int]) -> torch.Tensor:
        runner.truncate([0])
        return runner.forward(torch.tensor([ids]), torch.arange(len(ids))[None], last_n_logits=1).logits[0, -1]
    return logits


def head_for(kind, model, target):
    """An untrained head (random weights, seeded) and the target's vocabulary, as build_proposer takes them."""
    torch.manual_seed(0)
    config = HeadConfig.for_target(kind, target.decoder.config, num_medusa_heads=3)
    vocab_ids = torch.arange(model.config.vocab_size)
    vocabulary = FrozenVocabulary(model.get_input_embeddings().weight, model.get_output_embeddings().weight, vocab_ids)
    return LoadedHead(config, build_head(config).eval(), vocab_ids, {}), vocabulary


def build(method, models, target):
    """The method's proposer, as the registry builds it for one row (no cache of earlier requests)."""
    if method in HEAD_METHODS:
        head, vocabulary = head_for(HEAD_METHODS[method], models[0], target)
        return build_proposer(method, loaded_head=head, head_vocabulary=vocabulary,
                              head=HeadOptions(tree_size=6 if method != "eagle" else 0, tree_topk=2))
    proposer = build_proposer(method, draft_runner=make_native(models[1]), suffix=SuffixOptions(cache_requests=0),
                              copy=CopyOptions(corpus_tokens=0))
    if method in ("copy", "copy+draft"):
        proposer.step_costs.measured = False  # draft lengths that follow no timing
    return proposer


class Replay:
    """The reference's `propose` for a method it does not implement: the engine's own proposal for the
    same context (a KeyError if the engine never reached it). Sampled drafts (probs) are drawn again
    from their recorded distributions with the reference's generator, in drafting order, so the
    draws line up and the tokens must come out the same."""

    def __init__(self, engine: SpecEngine) -> None:
        self.proposals, proposer = {}, engine.engine.proposer
        original = proposer.propose

        def recording(contexts, max_ks):
            proposal = original(contexts, max_ks)
            self.proposals[tuple(contexts[0].token_ids[0].tolist())] = proposal
            return proposal
        proposer.propose = recording

    def __call__(self, tokens: list[int], k: int, generator: torch.Generator | None) -> Draft:
        proposal = self.proposals.pop(tuple(tokens))
        count = int(proposal.num_tokens[0])
        token_ids, parents = proposal.token_ids[0, :count].tolist(), proposal.tree()
        assert (count if parents is None else max(tree_depths(parents), default=0)) <= k  # a tree: k deep
        if proposal.probs is not None:
            assert [draw(q, generator) for q in proposal.probs[0, :count]] == token_ids
        return Draft(token_ids, None if parents is None else list(parents),
                     None if proposal.probs is None else proposal.probs[0, :count])


def run_both(method, mode, models, tokenizer, monkeypatch):
    """One prompt after another through the engine and the reference; each request's steps from both,
    and each one's generator after its last draw (None when greedy)."""
    target = make_native(models[0])
    engine = SpecEngine(target, build(method, models, target), tokenizer, k=K, eos_token_ids=frozenset())
    params, draft = MODES[mode], whole_context(make_native(models[1]))

    def propose(tokens, k, generator):  # the draft method: the reference drafts with the model itself
        return draft_with_model(draft, tokens, k, params, generator)

    if method != "draft":
        propose = Replay(engine)
    made, make_generator = [], SamplingParams.make_generator  # the engine's generators, to compare after
    monkeypatch.setattr(SamplingParams, "make_generator", lambda self, device="cpu": made.append(
        make_generator(self, device)) or made[-1])
    reference_target, runs = whole_context(target.with_batch_size(1)), []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        out = engine.generate(ids, params, max_new_tokens=NEW_TOKENS)
        generator = None if params.greedy else torch.Generator().manual_seed(params.seed)
        steps = speculative_decode(reference_target, propose, ids, params, generator, k=K, max_new_tokens=NEW_TOKENS)
        runs.append((out, steps, made[-1], generator))
    return runs


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", ["draft", *COPY_METHODS, *HEAD_METHODS])
def test_the_engine_emits_the_reference_decoders_tokens_from_the_same_draws(method, mode, models, tokenizer,
                                                                           monkeypatch):
    drafted = 0
    for out, steps, engine_generator, generator in run_both(method, mode, models, tokenizer, monkeypatch):
        assert out.token_ids == [token for step in steps for token in step.tokens]
        assert out.stats.accepted_per_step == [step.accepted for step in steps]
        assert out.stats.drafted_tokens == sum(step.drafted for step in steps)
        if generator is not None:  # sampled: the same number of draws, the same values
            assert torch.equal(engine_generator.get_state(), generator.get_state())
        drafted += out.stats.drafted_tokens
    assert drafted > 0
