"""EAGLE, Medusa and MLP-speculator heads on a tiny target: training lowers the loss and resumes exactly;
drafting with them (chains and trees) is lossless: greedy equals plain decoding, sampling
keeps the target's distribution."""

import pytest
import torch
from conftest import make_model, make_native, run_all

from specdec.analysis.lossless import distribution_tests
from specdec.engine import SpecEngine
from specdec.engine.batch import BatchEngine
from specdec.models.heads import FrozenVocabulary, HeadConfig, build_head, load_head, save_head
from specdec.models.hf import HFRunner
from specdec.proposers.base import Proposer
from specdec.proposers.batched import RowwiseProposer
from specdec.proposers.heads import EagleProposer, MedusaProposer, MLPSpeculatorProposer, medusa_tree
from specdec.proposers.head_methods import HeadOptions
from specdec.proposers.registry import build_proposer
from specdec.proposers.stop_rules import ConfidenceStop
from specdec.sampling import SamplingParams
from specdec.training.train_head import TrainOptions, extract_features, load_features, train_head

PROMPTS = [[5, 9, 12, 3, 7], [20, 21, 22, 23], [2, 8, 8, 8, 30, 31, 2]]


@pytest.fixture(scope="module")
def model():
    """A tiny target with a peaked output (top-1 mass ~0.6, like a real LM's), so its text is learnable."""
    model = make_model(seed=0)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(5.0)
    return model


@pytest.fixture(scope="module")
def target(model):
    return make_native(model)


@pytest.fixture(scope="module")
def vocab(model):
    """The tiny target's embedding and (untied) output head, all 64 tokens."""
    return FrozenVocabulary(model.get_input_embeddings().weight, model.get_output_embeddings().weight,
                            torch.arange(model.config.vocab_size))


@pytest.fixture(scope="module")
def windows(target, tmp_path_factory):
    """The target's own sampled text (what EAGLE and Medusa-2 train on), 48 windows of 48 tokens."""
    plain = SpecEngine(target, None, None, eos_token_ids=frozenset())
    chunks = []
    for index in range(48):
        start = [2 + index % 30, 2 + (index * 7) % 30]
        result = plain.generate(start, SamplingParams(temperature=0.7, seed=index), max_new_tokens=46)
        chunks.append(start + result.token_ids)
    shards = extract_features(target, chunks, tmp_path_factory.mktemp("features"), progress=False)
    return load_features(shards)


def _train(kind, target, vocab, windows, path, steps=60, **options):
    tokens, features, _ = windows
    config = HeadConfig.for_target(kind, target.decoder.config, num_medusa_heads=3, mlp_stages=3,
                                   draft_vocab_size=len(vocab.vocab_ids))
    train_options = TrainOptions(steps=steps, lr=1e-2, warmup=5, checkpoint_every=steps, heldout_windows=8,
                                 **options)
    extra = train_head(config, vocab, tokens, features, path, train_options, device=torch.device("cpu"),
                       progress=False, log=lambda message: None)
    return extra, load_head(path)


@pytest.fixture(scope="module")
def eagle(target, vocab, windows, tmp_path_factory):
    return _train("eagle", target, vocab, windows, tmp_path_factory.mktemp("eagle") / "eagle.safetensors")


@pytest.fixture(scope="module")
def medusa(target, vocab, windows, tmp_path_factory):
    return _train("medusa", target, vocab, windows, tmp_path_factory.mktemp("medusa") / "medusa.safetensors")


@pytest.fixture(scope="module")
def mlp(target, vocab, windows, tmp_path_factory):
    return _train("mlp-speculator", target, vocab, windows, tmp_path_factory.mktemp("mlp") / "mlp.safetensors")


def mlp_vocabulary(vocab, head):
    """What models/heads/loading.py hands the proposer: the target's embedding, the head's own output rows."""
    return FrozenVocabulary.with_output_rows(vocab.embedding, head.module.output.weight, vocab.vocab_ids)


def _mean(values):
    return sum(values) / len(values)


@pytest.mark.parametrize("kind", ["eagle", "medusa", "mlp-speculator"])
def test_training_lowers_the_loss_and_beats_chance(kind, eagle, medusa, mlp, target):
    extra, head = {"eagle": eagle, "medusa": medusa, "mlp-speculator": mlp}[kind]
    losses = [row["loss"] for row in extra["history"]]
    assert _mean(losses[-10:]) < 0.8 * _mean(losses[:5]), losses
    top1 = head.config.accuracies[0][0]  # held-out, teacher-forced, depth 1
    assert top1 > 5 / target.vocab_size  # chance is 1 / 64
    assert extra["step"] == 60 and head.config.kind == kind


def test_an_interrupted_run_resumes_where_it_stopped(target, vocab, windows, tmp_path):
    """Stop at the step-10 checkpoint, run the same command again: the weights equal an uninterrupted run's."""
    _, whole = _train("eagle", target, vocab, windows, tmp_path / "whole.safetensors", steps=20)

    class Interrupt(Exception):
        pass

    def stop_at_first_checkpoint(message):
        raise Interrupt(message)

    tokens, features, _ = windows
    config = HeadConfig.for_target("eagle", target.decoder.config)
    options = TrainOptions(steps=20, lr=1e-2, warmup=5, checkpoint_every=10, heldout_windows=8)
    path = tmp_path / "resumed.safetensors"
    with pytest.raises(Interrupt):
        train_head(config, vocab, tokens, features, path, options, device=torch.device("cpu"), progress=False,
                   log=stop_at_first_checkpoint)
    assert load_head(path).extra["step"] == 10
    messages = []
    train_head(config, vocab, tokens, features, path, options, device=torch.device("cpu"), progress=False,
               log=messages.append)
    assert messages[0].startswith("resuming") and "step 10/20" in messages[0]
    resumed = load_head(path)
    for name, weight in whole.module.state_dict().items():
        assert torch.equal(weight, resumed.module.state_dict()[name]), name


def _proposers(eagle, medusa, vocab, mlp=None):
    return {
        "mlp chain": lambda: MLPSpeculatorProposer(mlp[1].module, mlp_vocabulary(vocab, mlp[1])),
        "mlp chain stopping": lambda: MLPSpeculatorProposer(mlp[1].module, mlp_vocabulary(vocab, mlp[1]),
                                                            stop_rule=ConfidenceStop(0.5)),
        "eagle chain": lambda: EagleProposer(eagle[1].module, vocab),
        "eagle chain stopping": lambda: EagleProposer(eagle[1].module, vocab, stop_rule=ConfidenceStop(0.5)),
        "eagle tree": lambda: EagleProposer(eagle[1].module, vocab, tree_size=8, tree_topk=3),
        "eagle tree auto": lambda: EagleProposer(eagle[1].module, vocab, tree_size="auto", tree_topk=3),
        "medusa chain": lambda: MedusaProposer(medusa[1].module, vocab),
        "medusa tree": lambda: MedusaProposer(medusa[1].module, vocab, tree_size=8,
                                              accuracies=medusa[1].config.accuracies),
    }


@pytest.mark.parametrize("name", ["eagle chain", "eagle tree", "eagle tree auto", "medusa chain", "medusa tree",
                                  "mlp chain", "mlp chain stopping", "eagle chain stopping"])
def test_greedy_with_a_head_is_plain_greedy(name, target, vocab, eagle, medusa, mlp):
    proposer = _proposers(eagle, medusa, vocab, mlp)[name]()
    spec = SpecEngine(target, proposer, None, k=4, eos_token_ids=frozenset())
    plain = SpecEngine(target, None, None, eos_token_ids=frozenset())
    accepted = 0
    for prompt in PROMPTS:
        result = spec.generate(prompt, SamplingParams(temperature=0), max_new_tokens=40)
        assert result.token_ids == plain.generate(prompt, SamplingParams(temperature=0), max_new_tokens=40).token_ids
        accepted += result.stats.accepted_tokens
    assert accepted > 10  # the head's drafts were really used, not all rejected


BATCH_PROMPTS = [*PROMPTS, [9, 9, 4, 40, 41, 9, 9], [33]]
MIXED_PARAMS = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1),
                SamplingParams(0.7, top_k=5, seed=2), SamplingParams(0.9, top_p=0.8, seed=3),
                SamplingParams(temperature=0), SamplingParams(0.8, seed=4)]


def check_batched_heads_equal_each_alone(model, target, make_proposer, k=3):
    """Three rows at once, requests of different lengths joining as rows free up, greedy and seeded
    sampling mixed: every request's tokens are those it gets alone (SpecEngine, same proposer).
    Returns the batched engine's accepted drafts (so callers can check drafting really happened)."""
    batched = BatchEngine(make_native(model, batch_size=3), RowwiseProposer(make_proposer, 3), None, k=k,
                          eos_token_ids=frozenset(), max_k=4)
    alone = SpecEngine(target, make_proposer(), None, k=3, eos_token_ids=frozenset())
    lengths = [30, 9, 24, 40, 12, 20]
    requests = {i: batched.make_request(prompt, params, max_new_tokens=n)
                for i, (prompt, params, n) in enumerate(zip(BATCH_PROMPTS, MIXED_PARAMS, lengths))}
    accepted = []
    original_step = batched.step

    def counting_step():
        updates = original_step()
        accepted.extend(update.accepted for update in updates)
        return updates

    batched.step = counting_step
    got = run_all(batched, requests)
    for i, (prompt, params, n) in enumerate(zip(BATCH_PROMPTS, MIXED_PARAMS, lengths)):
        if k == "auto" and not params.greedy:
            continue  # goodput chooses other k than alone: other draws, equal in distribution only
        single = alone if k != "auto" else SpecEngine(target, None, None, eos_token_ids=frozenset())
        result = single.generate(prompt, params, max_new_tokens=n)
        assert got[i] == (result.token_ids, result.finish_reason), f"request {i} ({params})"
    return sum(accepted)


@pytest.mark.parametrize("name", ["eagle chain", "eagle tree", "medusa chain", "medusa tree", "mlp chain"])
def test_batched_heads_equal_each_request_alone(name, model, target, vocab, eagle, medusa, mlp):
    """The server's engine with a head: one proposer per row over one head, trees verified in one
    forward with each row's own mask, each row's features queued for its proposer."""
    accepted = check_batched_heads_equal_each_alone(model, target, _proposers(eagle, medusa, vocab, mlp)[name])
    assert accepted > 20  # the heads' drafts were really used, trees past their first level included


@pytest.mark.parametrize("name", ["eagle chain", "eagle tree"])
def test_batched_heads_with_goodput_k_stay_greedy_exact(name, model, target, vocab, eagle, medusa):
    """k auto: each row's k per step from measured costs (0 included); greedy rows still equal plain."""
    check_batched_heads_equal_each_alone(model, target, _proposers(eagle, medusa, vocab)[name], k="auto")


class PathCounter(Proposer):
    """Wraps a proposer; counts steps where more than one drafted token was accepted."""

    reads_target_hidden = True

    def __init__(self, inner):
        self.inner, self.accepted = inner, []

    def reset(self):
        self.inner.reset()

    def propose(self, ctx, max_k):
        return self.inner.propose(ctx, max_k)

    def on_verified(self, num_accepted):
        self.accepted.append(int(num_accepted[0]))
        self.inner.on_verified(num_accepted)


@pytest.mark.parametrize("name", ["eagle chain", "eagle tree", "eagle tree auto", "medusa tree", "mlp chain",
                                  "mlp chain stopping"])
def test_sampling_with_a_head_keeps_the_target_distribution(name, target, vocab, eagle, medusa, mlp):
    """1000 speculative draws at T=0.8 against 1000 plain ones: first token and first two tokens."""
    params = SamplingParams(temperature=0.8)
    proposer = PathCounter(_proposers(eagle, medusa, vocab, mlp)[name]())
    spec = SpecEngine(target, proposer, None, k=3, eos_token_ids=frozenset())
    plain = SpecEngine(target, None, None, eos_token_ids=frozenset())
    prompt = PROMPTS[0]
    spec_draws = list(spec.sample_continuations(prompt, params, 1000))
    plain_draws = list(plain.sample_continuations(prompt, params, 1000, seed=10_000))
    # Acceptances really happen (Medusa's tiny heads are right less often: one level is what they reach;
    # auto-sized trees on this tiny target are mostly a node or two, verification costing what it does).
    deep = 2 if name in ("eagle chain", "eagle tree") else 1
    assert sum(n >= deep for n in proposer.accepted) > 50, proposer.accepted
    tests = distribution_tests(spec_draws, plain_draws)
    assert all(t.dof >= 3 for t in tests)
    assert min(t.p_value for t in tests) > 1e-4, tests


def test_an_auto_sized_tree_is_measured_and_sized_step_by_step(target, vocab, eagle):
    """--tree-size auto: the engine reports each tree's verification to the proposer's budget, which sizes
    the next tree from it (the choice itself, on given costs: test_tree_budget.py)."""
    proposer = EagleProposer(eagle[1].module, vocab, tree_size="auto", tree_topk=3)
    spec = SpecEngine(target, proposer, None, k=4, eos_token_ids=frozenset())
    sizes = []
    original = proposer.tree_budget.choose

    def recording_choose(path_probs):
        sizes.append(original(path_probs))
        return sizes[-1]

    proposer.tree_budget.choose = recording_choose
    for prompt in PROMPTS:
        spec.generate(prompt, SamplingParams(temperature=0), max_new_tokens=30)
    measured = proposer.tree_budget._verify_s.samples
    assert len(measured) > 10 and {int(tokens) - 1 for tokens, _ in measured} <= set(sizes)
    assert sizes[:2] == [8, 4]  # two sizes measured before a line is drawn through them (then: timings)
    assert all(size <= 2 * max(sizes[:index] or [8]) for index, size in enumerate(sizes))  # stretched gently


def test_an_eagle_tree_is_a_proper_tree_within_its_budget(target, vocab, eagle):
    from specdec.proposers.base import ProposeContext

    proposer = EagleProposer(eagle[1].module, vocab, tree_size=9, tree_topk=3)
    engine = SpecEngine(target, proposer, None, k=4, eos_token_ids=frozenset())
    engine.generate(PROMPTS[0], SamplingParams(temperature=0), max_new_tokens=3)  # primes the head's cache
    tokens = torch.tensor([PROMPTS[0] + [1, 2, 3]])
    proposer.reset()
    output = target.forward(tokens[:, :-1], torch.arange(tokens.shape[1] - 1)[None])
    target.reset()
    ctx = ProposeContext(tokens, SamplingParams(), None, target.vocab_size, target_hidden=output.hidden)
    proposal = proposer.propose(ctx, 4)
    parents = proposal.tree()
    assert len(parents) == 9 and proposal.token_ids.shape == (1, 9)
    assert all(-1 <= p < i for i, p in enumerate(parents))
    assert max(parents) >= 0  # deeper than one layer
    siblings = {}
    for node, parent in enumerate(parents):
        siblings.setdefault(parent, []).append(int(proposal.token_ids[0, node]))
    assert all(len(set(group)) == len(group) for group in siblings.values())  # no token twice under a parent
    assert proposer.cache.length == proposer.committed  # drafts left nothing behind


@pytest.mark.parametrize("per_token_s,forwards", [(0.1, 1), (0.0001, 4)], ids=["dear", "cheap"])
def test_an_auto_sized_tree_grows_only_while_deeper_nodes_can_pay(target, vocab, eagle, per_token_s, forwards):
    """Where a verified token costs a whole step no draft pays: after the head reads the committed
    tokens (one forward) it drafts one layer and stops, instead of paying for the tree's depth. Where
    tokens are nearly free it grows to depth k (3 more forwards)."""
    from specdec.proposers.base import ProposeContext

    proposer = EagleProposer(eagle[1].module, vocab, tree_size="auto", tree_topk=3)
    for _ in range(3):
        for nodes in (1, 8):
            proposer.tree_budget.record(verified_tokens=nodes + 1, verify_s=0.1 + per_token_s * nodes, accepted=0)
    tokens = torch.tensor([PROMPTS[0] + [1, 2, 3]])
    output = target.forward(tokens[:, :-1], torch.arange(tokens.shape[1] - 1)[None])
    target.reset()
    calls = []
    hook = proposer.head.register_forward_hook(lambda *args: calls.append(1))
    try:
        proposer.propose(ProposeContext(tokens, SamplingParams(), None, target.vocab_size,
                                        target_hidden=output.hidden), 4)
    finally:
        hook.remove()
    assert len(calls) == forwards


@pytest.mark.parametrize("kind", ["eagle", "mlp-speculator"])
def test_head_confidence_stops_a_chain_under_k_auto_only(kind, target, vocab, eagle, mlp):
    """--head-confidence P: the chain ends after the first token the head gave less than P; with k auto
    only (a fixed k drafts all k), and never on a token the head is sure of."""
    head = eagle[1] if kind == "eagle" else mlp[1]
    vocabulary = vocab if kind == "eagle" else mlp_vocabulary(vocab, head)
    options = dict(loaded_head=head, head_vocabulary=vocabulary, head=HeadOptions(confidence=0.999))
    assert build_proposer(kind, adaptive=True, **options).stop_rule == ConfidenceStop(0.999)
    assert build_proposer(kind, adaptive=False, **options).stop_rule is None
    assert build_proposer(kind, adaptive=True, loaded_head=head, head_vocabulary=vocabulary).stop_rule is None
    spec = SpecEngine(target, build_proposer(kind, adaptive=True, **options), None, k=3, eos_token_ids=frozenset())
    lengths = set()
    original = spec.proposer.propose

    def recording(ctx, max_k):
        proposal = original(ctx, max_k)
        lengths.add(int(proposal.num_tokens[0]))
        return proposal

    spec.proposer.propose = recording
    spec.generate(PROMPTS[0], SamplingParams(temperature=0), max_new_tokens=24)
    assert lengths == {1}  # no tiny head is 99.9% sure of its first token
    with pytest.raises(ValueError, match="confidence threshold"):
        HeadOptions(confidence=1.0)


def test_medusa_tree_keeps_the_most_likely_paths():
    assert medusa_tree([[.6, .2], [.4, .1]], 3, 2) == [(0,), (0, 0), (1,)]
    assert medusa_tree([[.6, .2], [.4, .1]], 10, 1) == [(0,), (1,)]  # depth-limited
    paths = medusa_tree([[.5, .3, .1], [.5, .2, .1], [.4, .1, .1]], 8, 3)
    assert all(path[:-1] in paths for path in paths if len(path) > 1)  # ancestor-closed


def test_bad_checkpoints_and_mismatched_methods_are_clear_errors(tmp_path, eagle, vocab, target):
    with pytest.raises(FileNotFoundError, match="no head checkpoint"):
        load_head(tmp_path / "missing.safetensors")
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not a specdec head"):
        load_head(tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match="needs a medusa head"):
        build_proposer("medusa", loaded_head=eagle[1], head_vocabulary=vocab)
    with pytest.raises(ValueError, match="needs a trained eagle head"):
        build_proposer("eagle")
    with pytest.raises(ValueError, match="unknown head kind"):
        HeadConfig(kind="hydra", hidden_size=4, target_vocab_size=8)


def test_the_same_head_drafts_on_the_transformers_runner(model, eagle, vocab):
    """A head trained on the native decoder's features drafts on the transformers runner's (the same
    model's hidden_states, models/hf.py): greedy output plain's, and it guesses as often as natively."""
    runner = HFRunner(model)
    spec = SpecEngine(runner, EagleProposer(eagle[1].module, vocab), None, k=3, eos_token_ids=frozenset())
    plain = SpecEngine(HFRunner(model), None, None, eos_token_ids=frozenset())
    greedy, accepted = SamplingParams(temperature=0), 0
    for prompt in PROMPTS[:3]:
        result = spec.generate(prompt, greedy, max_new_tokens=24)
        assert result.token_ids == plain.generate(prompt, greedy, max_new_tokens=24).token_ids
        accepted += result.stats.accepted_tokens
    assert accepted > 10


def test_save_and_load_round_trip(tmp_path, target):
    config = HeadConfig.for_target("medusa", target.decoder.config, num_medusa_heads=2)
    head = build_head(config)
    torch.nn.init.normal_(head.blocks[0].weight)
    save_head(tmp_path / "m.safetensors", head, config, torch.arange(10), {"step": 3})
    loaded = load_head(tmp_path / "m.safetensors")
    assert loaded.config == config and loaded.extra == {"step": 3} and torch.equal(loaded.vocab_ids, torch.arange(10))
    assert torch.equal(loaded.module.blocks[0].weight, head.blocks[0].weight)


@pytest.mark.parametrize("name", ["eagle tree", "medusa tree"])
def test_typical_acceptance_accepts_more_and_stays_greedy_at_temperature_zero(name, target, vocab, eagle, medusa):
    """On a tree of top candidates (point masses, accepted w.p. p(x) when exact) Medusa's rule
    keeps any candidate above its threshold: more acceptance, at the price of exactness."""
    proposers = _proposers(eagle, medusa, vocab)
    spec = SpecEngine(target, proposers[name](), None, k=3, eos_token_ids=frozenset())
    plain = SpecEngine(target, None, None, eos_token_ids=frozenset())
    greedy = SamplingParams(temperature=0, typical_acceptance=True)
    assert (spec.generate(PROMPTS[1], greedy, max_new_tokens=30).token_ids
            == plain.generate(PROMPTS[1], greedy, max_new_tokens=30).token_ids)
    accepted = {}
    for typical in (False, True):
        params = SamplingParams(temperature=1.0, seed=3, typical_acceptance=typical)
        accepted[typical] = sum(spec.generate(prompt, params, max_new_tokens=60).stats.acceptance_rate
                                for prompt in PROMPTS)
    assert accepted[True] > accepted[False]
