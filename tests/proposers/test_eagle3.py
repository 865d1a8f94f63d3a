"""EAGLE-3 on a tiny 4-layer target: the inner-layer features, training-time test (its mask
and its agreement with drafting), training, lossless drafting (chain and tree), and the
speculators layout vLLM loads (export -> load -> the same drafts; a directory written from
the format's published field list)."""

import json

import pytest
import torch
from conftest import make_native, make_peaked_model

from specdec.analysis.lossless import distribution_tests
from specdec.engine import SpecEngine
from specdec.models.heads.eagle3 import unrolled_mask
from specdec.models.heads import FrozenVocabulary, HeadConfig, load_head
from specdec.models.heads.speculators import export_speculators, load_speculators
from specdec.proposers.base import ProposeContext
from specdec.proposers.heads import EagleProposer
from specdec.sampling import SamplingParams
from specdec.training.train_head import (TrainOptions, eagle3_loss, extract_features, load_features, train_head,
                                         unroll_eagle3)
from test_heads import check_batched_heads_equal_each_alone

AUX = [1, 2, 3]
PROMPTS = [[5, 9, 12, 3, 7], [20, 21, 22, 23], [2, 8, 8, 8, 30, 31, 2]]


@pytest.fixture(scope="module")
def model():
    return make_peaked_model(seed=3, layers=4)


@pytest.fixture(scope="module")
def target(model):
    return make_native(model)


@pytest.fixture(scope="module")
def vocab(model):
    return FrozenVocabulary(model.get_input_embeddings().weight, model.get_output_embeddings().weight,
                            torch.arange(model.config.vocab_size))


@pytest.fixture(scope="module")
def windows(target, tmp_path_factory):
    """The target's own sampled text, 40 windows of 40 tokens, with final and inner features."""
    plain = SpecEngine(target, None, None, eos_token_ids=frozenset())
    chunks = []
    for index in range(40):
        start = [2 + index % 30, 2 + (index * 7) % 30]
        result = plain.generate(start, SamplingParams(temperature=0.7, seed=index), max_new_tokens=38)
        chunks.append(start + result.token_ids)
    shards = extract_features(target, chunks, tmp_path_factory.mktemp("features3"), progress=False, aux_layers=AUX)
    return load_features(shards)


@pytest.fixture(scope="module")
def eagle3(target, vocab, windows, tmp_path_factory):
    tokens, features, aux = windows
    config = HeadConfig.for_target("eagle3", target.decoder.config, aux_layers=AUX)
    path = tmp_path_factory.mktemp("eagle3") / "eagle3.safetensors"
    options = TrainOptions(steps=80, lr=1e-2, warmup=5, checkpoint_every=80, heldout_windows=6, ttt_steps=3)
    extra = train_head(config, vocab, tokens, features, path, options, device=torch.device("cpu"), progress=False,
                       log=lambda message: None, aux=aux)
    return extra, load_head(path)


def test_inner_features_are_the_residual_stream_entering_each_layer(model, target):
    """capture_layers(i, ...) hands over what enters layer i: transformers' hidden_states[i]."""
    tokens = torch.tensor([PROMPTS[0]])
    positions = torch.arange(tokens.shape[1])[None]
    target.reset()
    target.decoder.capture_layers(AUX)
    try:
        captured = target.forward(tokens, positions).hidden
    finally:
        target.decoder.capture_layers(())
        target.reset()
    with torch.no_grad():
        reference = model(tokens, output_hidden_states=True).hidden_states
    expected = torch.cat([reference[i] for i in AUX], dim=-1)
    assert captured.shape == (1, tokens.shape[1], 3 * model.config.hidden_size)
    torch.testing.assert_close(captured, expected, atol=1e-4, rtol=1e-4)
    target.decoder.capture_layers([*AUX, 4])  # 4 = the final features, which training reads beside them
    try:
        both = target.forward(tokens, positions).hidden
    finally:
        target.decoder.capture_layers(())
        target.reset()
    final = target.forward(tokens, positions).hidden
    target.reset()
    assert torch.equal(both[..., :-32], captured) and torch.equal(both[..., -32:], final)
    with pytest.raises(ValueError, match="outside the target's 4 layers"):
        target.decoder.capture_layers([5])


def test_the_unrolled_mask_matches_a_hand_worked_example():
    """3 roots, third unrolled step: the context (causal) block, then each earlier step's own draft."""
    expected = torch.tensor([
        # step 0 keys   step 1 keys   step 2 keys
        [1, 0, 0,       1, 0, 0,      1, 0, 0],
        [1, 1, 0,       0, 1, 0,      0, 1, 0],
        [1, 1, 1,       0, 0, 1,      0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(unrolled_mask(torch.tensor([0, 1, 2]), 3, 3), expected)
    assert torch.equal(unrolled_mask(torch.tensor([0, 1, 2]), 3, 1), expected[:, :3])
    # Deeper steps run at a few roots only: root 1 of 3 positions, second step.
    assert unrolled_mask(torch.tensor([1]), 3, 2).tolist() == [[True, True, False, True]]


def test_training_lowers_the_loss_and_reports_accuracy_per_depth(eagle3, target):
    extra, head = eagle3
    losses = [row["loss"] for row in extra["history"]]
    assert sum(losses[-10:]) / 10 < 0.8 * sum(losses[:5]) / 5, losses
    accuracies = head.config.accuracies
    assert len(accuracies) == 3  # one row per unrolled step
    # chance is 1 / 64; the third draft follows two of the head's own guesses in sampled text
    assert accuracies[0][0] > 5 / target.vocab_size and accuracies[2][0] > 1.5 / target.vocab_size
    assert head.config.kind == "eagle3" and head.config.aux_layers == AUX


def test_training_time_test_drafts_what_inference_drafts(eagle3, vocab, windows, target):
    """The unroll's greedy draft at root j, step s, is the token the proposer drafts at depth s + 1
    after the context t_0..t_{j+1}: training sees exactly what drafting will do."""
    tokens, features, aux = windows
    head = eagle3[1].module
    window = slice(0, 1)
    with torch.no_grad():
        unrolled = [vocab.to_target_ids(logits.argmax(-1))[0]
                    for _, logits, _ in unroll_eagle3(head, vocab, tokens[window], features[window].float(),
                                                      aux[window].float(), 3)]
    proposer = EagleProposer(head, vocab)
    for root in (0, 5, 17, 30, tokens.shape[1] - 4):  # the default roots: every one with 3 targets
        proposer.reset()
        context = tokens[window, : root + 2]  # t_0 .. t_{j+1}
        ctx = ProposeContext(context, SamplingParams(temperature=0), None, target.vocab_size,
                             target_hidden=aux[window, : root + 1].float())
        drafted = proposer.propose(ctx, 3).token_ids[0].tolist()
        assert drafted == [int(unrolled[step][root]) for step in range(3)], root


def test_the_loss_weights_deeper_steps_by_the_chance_they_are_reached(eagle3, vocab, windows):
    tokens, features, aux = windows
    options = TrainOptions(ttt_steps=3, classification_positions=0)
    _, stats = eagle3_loss(eagle3[1].module, vocab, tokens[:2], features[:2].float(), aux[:2].float(), options)
    assert set(stats) == {"kl_1", "kl_2", "kl_3", "top1_1", "top1_2", "top1_3"}
    # A few roots give the same per-root drafts as all of them (deeper steps only run at the roots).
    few = torch.tensor([3, 11, 20])
    with torch.no_grad():
        every = [logits[:, few] for _, logits, _ in unroll_eagle3(eagle3[1].module, vocab, tokens[:2],
                                                                  features[:2].float(), aux[:2].float(), 3)]
        some = [logits for _, logits, _ in unroll_eagle3(eagle3[1].module, vocab, tokens[:2],
                                                         features[:2].float(), aux[:2].float(), 3, few)]
    for a, b in zip(every, some):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_hass_top_k_distillation_adds_the_target_top_k_cross_entropy(eagle3, vocab, windows):
    """HASS's harmonized objective distillation (--topk-distill K): the loss grows by, at each step, the
    cross-entropy on the target's K most probable tokens, times the chance the step is reached."""
    tokens, features, aux = windows
    head, few = eagle3[1].module, (tokens[:2], features[:2].float(), aux[:2].float())
    plain_options = TrainOptions(ttt_steps=2, classification_positions=0)
    hass_options = TrainOptions(ttt_steps=2, classification_positions=0, topk_distill=3, topk_weight=0.5)
    with torch.no_grad():
        plain, _ = eagle3_loss(head, vocab, *few, plain_options)
        hass, _ = eagle3_loss(head, vocab, *few, hass_options)
        extra, reached = torch.zeros(()), None
        for _, logits, target_logp in unroll_eagle3(head, vocab, *few, 2):
            draft_logp = torch.log_softmax(logits, dim=-1)
            reached = torch.ones(draft_logp.shape[:2]) if reached is None else reached
            top = target_logp.topk(3, dim=-1)
            extra = extra + (reached * -(top.values.exp() * draft_logp.gather(-1, top.indices)).sum(-1)).mean()
            reached = reached * torch.minimum(draft_logp.exp(), target_logp.exp()).sum(-1)
    torch.testing.assert_close(hass, plain + 0.5 * extra, atol=1e-4, rtol=1e-4)
    assert float(extra) > 0


def _proposer(eagle3, vocab, tree):
    return EagleProposer(eagle3[1].module, vocab, tree_size=8 if tree else 0, tree_topk=3)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_greedy_with_eagle3_is_plain_greedy(tree, target, vocab, eagle3):
    spec = SpecEngine(target, _proposer(eagle3, vocab, tree), None, k=4, eos_token_ids=frozenset())
    plain = SpecEngine(target, None, None, eos_token_ids=frozenset())
    accepted = 0
    for prompt in PROMPTS:
        result = spec.generate(prompt, SamplingParams(temperature=0), max_new_tokens=40)
        assert result.token_ids == plain.generate(prompt, SamplingParams(temperature=0), max_new_tokens=40).token_ids
        accepted += result.stats.accepted_tokens
    assert accepted > 10  # the head's drafts were really used


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_batched_eagle3_equals_each_request_alone(tree, model, target, vocab, eagle3):
    """The server's engine: each row's proposer reads the target's inner layers of its own tokens."""
    accepted = check_batched_heads_equal_each_alone(model, target, lambda: _proposer(eagle3, vocab, tree))
    assert accepted > 20


def test_features_read_after_an_eagle3_request_are_the_final_ones(target, vocab, eagle3, windows, tmp_path):
    """An EAGLE-3 request leaves its layers selected on the shared runner; a later feature
    extraction for an EAGLE-1 or Medusa head must still read the final features (CI caught
    [.., 3H] features reaching a Medusa head)."""
    spec = SpecEngine(target, _proposer(eagle3, vocab, False), None, k=4, eos_token_ids=frozenset())
    spec.generate(PROMPTS[0], SamplingParams(temperature=0), max_new_tokens=8)
    tokens, features, _ = windows
    shards = extract_features(target, tokens[:2].tolist(), tmp_path / "final", progress=False)
    _, again, aux = load_features(shards)
    assert aux is None
    assert torch.equal(again, features[:2])


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_sampling_with_eagle3_keeps_the_target_distribution(tree, target, vocab, eagle3):
    params = SamplingParams(temperature=0.8)
    spec = SpecEngine(target, _proposer(eagle3, vocab, tree), None, k=3, eos_token_ids=frozenset())
    plain = SpecEngine(target, None, None, eos_token_ids=frozenset())
    spec_draws = list(spec.sample_continuations(PROMPTS[0], params, 1000))
    plain_draws = list(plain.sample_continuations(PROMPTS[0], params, 1000, seed=10_000))
    tests = distribution_tests(spec_draws, plain_draws)
    assert all(t.dof >= 3 for t in tests)
    assert min(t.p_value for t in tests) > 1e-4, tests


def _drafts(head, vocab, target, windows):
    tokens, _, aux = windows
    proposer = EagleProposer(head, vocab)
    out = []
    for root in (3, 11, 25):
        proposer.reset()
        ctx = ProposeContext(tokens[:1, : root + 2], SamplingParams(temperature=0), None, target.vocab_size,
                             target_hidden=aux[:1, : root + 1].float())
        out.append(proposer.propose(ctx, 4).token_ids[0].tolist())
    return out


def test_export_then_load_drafts_the_same_tokens(eagle3, vocab, target, windows, tmp_path):
    out = export_speculators(eagle3[1], vocab, tmp_path / "spec", verifier="tiny-target",
                             verifier_architectures=["Qwen2ForCausalLM"], max_position_embeddings=256,
                             dtype=torch.float32)
    document = json.loads((out / "config.json").read_text())
    assert document["speculators_model_type"] == "eagle3" and document["architectures"] == ["Eagle3Speculator"]
    assert document["speculators_config"]["algorithm"] == "eagle3"
    assert document["speculators_config"]["verifier"] == {"name_or_path": "tiny-target",
                                                          "architectures": ["Qwen2ForCausalLM"]}
    assert document["eagle_aux_hidden_state_layer_ids"] == AUX and document["draft_vocab_size"] == 64
    layer = document["transformer_layer_config"]
    assert (layer["num_hidden_layers"], layer["vocab_size"], layer["hidden_size"]) == (1, 64, 32)
    head, loaded_vocab = load_speculators(out, target.decoder, target.decoder.embedding.detach())
    assert _drafts(head.module, loaded_vocab, target, windows) == _drafts(eagle3[1].module, vocab, target, windows)


def test_a_directory_written_from_the_published_field_list_loads(model, target, tmp_path):
    """Not our writer: config.json and weights as the speculators docs and vLLM's loader name them,
    with a 48-token draft vocabulary (d2t offsets), EAGLE-3's original `midlayer.` names, and
    the result checked against the equations computed by hand."""
    from safetensors.torch import save_file

    hidden, heads, kv_heads, dim, width, draft_vocab = 32, 4, 2, 8, 40, 48
    generator = torch.Generator().manual_seed(7)

    def rand(*shape):
        return torch.randn(*shape, generator=generator) * 0.2

    kept = torch.sort(torch.randperm(64, generator=generator)[:draft_vocab]).values  # target ids, ascending
    weights = {
        "fc.weight": rand(hidden, 3 * hidden),
        "midlayer.input_layernorm.weight": 1 + rand(hidden), "midlayer.hidden_norm.weight": 1 + rand(hidden),
        "midlayer.self_attn.q_proj.weight": rand(heads * dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, heads * dim),
        "midlayer.post_attention_layernorm.weight": 1 + rand(hidden),
        "midlayer.mlp.gate_proj.weight": rand(width, hidden), "midlayer.mlp.up_proj.weight": rand(width, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, width),
        "norm.weight": 1 + rand(hidden), "lm_head.weight": rand(draft_vocab, hidden) * 5,
        "d2t": kept - torch.arange(draft_vocab), "t2d": torch.zeros(64, dtype=torch.bool).index_fill_(0, kept, True),
    }
    directory = tmp_path / "published"
    directory.mkdir()
    save_file(weights, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.1.0",
        "draft_vocab_size": draft_vocab, "norm_before_residual": True, "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": AUX,
        "transformer_layer_config": {
            "model_type": "llama", "hidden_size": hidden, "intermediate_size": width, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": dim, "num_hidden_layers": 1, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "vocab_size": 64, "max_position_embeddings": 256, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False},
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": "some/target", "architectures": ["Qwen2ForCausalLM"]}},
    }))
    head, head_vocab = load_speculators(directory, target.decoder, target.decoder.embedding.detach())
    assert head.config.norm_before_residual and head.config.target == "some/target"
    assert torch.equal(head_vocab.vocab_ids, kept)

    # One position by hand: g (3H) and the next token -> the draft's logits over its 48 tokens.
    g = torch.randn(1, 1, 3 * hidden, generator=generator)
    token = torch.tensor([[9]])

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    w = {k.replace("midlayer.", ""): v for k, v in weights.items()}
    h = g @ w["fc.weight"].T
    normed = norm(h, w["hidden_norm.weight"])
    x = torch.cat([norm(target.decoder.embedding[token], w["input_layernorm.weight"]), normed], dim=-1)
    v = (x @ w["self_attn.v_proj.weight"].T).view(1, 1, kv_heads, dim)  # one key: attention returns its value
    attended = v.repeat_interleave(heads // kv_heads, dim=2).reshape(1, 1, -1)
    y = normed + attended @ w["self_attn.o_proj.weight"].T  # norm_before_residual: the residual is normed
    z = norm(y, w["post_attention_layernorm.weight"])
    y = y + (torch.nn.functional.silu(z @ w["mlp.gate_proj.weight"].T) * (z @ w["mlp.up_proj.weight"].T)) \
        @ w["mlp.down_proj.weight"].T
    expected = norm(y, w["norm.weight"]) @ w["lm_head.weight"].T
    module = head.module
    with torch.no_grad():
        out = module(module.read_target(g), head_vocab.embed(token), torch.zeros(1, 1, dtype=torch.long))
        logits = head_vocab.logits(module.to_output(out))
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_speculators_directories_that_cannot_draft_here_are_clear_errors(eagle3, vocab, target, tmp_path):
    out = export_speculators(eagle3[1], vocab, tmp_path / "spec", verifier="t", verifier_architectures=[],
                             max_position_embeddings=256)
    document = json.loads((out / "config.json").read_text())
    document["transformer_layer_config"]["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
    document["transformer_layer_config"]["vocab_size"] = 128256
    (out / "config.json").write_text(json.dumps(document))
    with pytest.raises(ValueError, match="rope scaling 'llama3'.*128256-token target vocabulary"):
        load_speculators(out, target.decoder, target.decoder.embedding.detach())
    document["speculators_model_type"] = "mtp"
    (out / "config.json").write_text(json.dumps(document))
    with pytest.raises(ValueError, match="holds a mtp model"):
        load_speculators(out, target.decoder, target.decoder.embedding.detach())
