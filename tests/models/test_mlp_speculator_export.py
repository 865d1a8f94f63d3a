"""The MLP speculator in fms-extras' layout. Export: the files alone, run with the equations of
fms-extras' and vLLM's MLPSpeculator, draft what specdec's proposer drafts; tokens outside the head's
vocabulary score 0. Import (models/heads/fms_speculator.py): a published checkpoint (its own
embeddings and heads, scale_input, tied weights) drafts what those equations draft, exactly."""

import json
import math

import pytest
import torch
from conftest import make_model, make_native
from fms_checkpoints import published
from specdec.analysis.lossless import distribution_tests
from specdec.engine import SpecEngine
from safetensors.torch import load_file, save_file

from specdec.models.heads import FrozenVocabulary, HeadConfig, LoadedHead, build_head
from specdec.models.heads.fms_speculator import load_fms_speculator
from specdec.models.heads.mlp_speculator_export import export_mlp_speculator
from specdec.proposers.base import ProposeContext
from specdec.proposers.heads import MLPSpeculatorProposer
from specdec.sampling import SamplingParams


def reference_chain(directory, feature: torch.Tensor, token: int, steps: int) -> list[int]:
    """vLLM's MLPSpeculator (its MLPSpeculatorLayerNorm, state and embedding weights, GELU; greedy
    tokens), written from the exported directory alone."""
    config = json.loads((directory / "config.json").read_text())
    weights = {name.replace("speculator.", ""): value  # as vLLM's load_weights names them
               for name, value in load_file(str(directory / "model.safetensors")).items()}
    inner = config["inner_dim"] or config["emb_dim"]
    state_weight = 0.5 ** (0.5 / config["n_predict"])
    emb_weight = math.sqrt((1 - state_weight ** 2) * (inner / 2))
    state, drafted = feature, []
    if config.get("scale_input"):  # fms-extras' ln0: no scale, no shift
        state = state * torch.rsqrt(state.pow(2).mean(-1, keepdim=True) + 1e-6) / math.sqrt(2)
    for stage in range(steps):
        z = weights[f"emb.{stage}.weight"][token]
        state = state @ weights[f"proj.{stage}.weight"].T + z * (emb_weight / state_weight)
        state = state * torch.rsqrt(state.pow(2).mean(-1, keepdim=True) + 1e-6)
        state = torch.nn.functional.gelu(weights[f"ln.{stage}.weight"] * state + weights[f"ln.{stage}.bias"])
        token = int((state @ weights[f"head.{stage}.weight"].T).argmax())
        drafted.append(token)
    return drafted


@pytest.fixture(scope="module")
def tiny():
    model = make_model(seed=3)
    return model, make_native(model)


def _head(target, vocab_ids: torch.Tensor, seed: int = 0) -> tuple[LoadedHead, FrozenVocabulary]:
    torch.manual_seed(seed)
    config = HeadConfig.for_target("mlp-speculator", target.decoder.config, mlp_stages=3,
                                   draft_vocab_size=len(vocab_ids))
    module = build_head(config)
    for norm in module.ln:  # not the identity the training starts from: the export must carry them
        torch.nn.init.normal_(norm.weight, 1.0, 0.3)
        torch.nn.init.normal_(norm.bias, 0.0, 0.3)
    torch.nn.init.normal_(module.output.weight)
    module.eval().requires_grad_(False)
    vocab = FrozenVocabulary.with_output_rows(target.decoder.embedding, module.output.weight, vocab_ids)
    return LoadedHead(config, module, vocab_ids, {}), vocab


def test_the_exported_files_draft_what_the_proposer_drafts(tiny, tmp_path):
    model, target = tiny
    head, vocab = _head(target, torch.arange(model.config.vocab_size))
    out = export_mlp_speculator(head, vocab, tmp_path / "mlp", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["n_predict"], config["vocab_size"]) == ("mlp_speculator", 3, 64)
    assert len(config["top_k_tokens_per_head"]) == config["n_predict"]  # vLLM's config asserts it
    proposer = MLPSpeculatorProposer(head.module, vocab)
    generator = torch.Generator().manual_seed(0)
    for trial in range(8):
        feature = torch.randn(1, 1, model.config.hidden_size, generator=generator)
        token_ids = torch.tensor([[5, 9, 2 + 7 * trial]])
        proposer.reset()
        drafted = proposer.propose(ProposeContext(token_ids, SamplingParams(temperature=0), None, 64, feature), 3)
        assert drafted.token_ids[0].tolist() == reference_chain(out, feature[0], int(token_ids[0, -1]), 3)


def test_tokens_outside_the_head_vocabulary_score_zero(tiny, tmp_path):
    model, target = tiny
    kept = torch.arange(0, model.config.vocab_size, 2)
    head, vocab = _head(target, kept, seed=1)
    weights = load_file(str(export_mlp_speculator(head, vocab, tmp_path / "mlp") / "model.safetensors"))
    for stage in range(3):
        rows = weights[f"head.{stage}.weight"].float()
        assert torch.equal(rows[kept], head.module.output.weight.to(torch.bfloat16).float())
        assert not rows[1::2].any()
        assert torch.equal(weights[f"emb.{stage}.weight"].float(), target.decoder.embedding.to(torch.bfloat16).float())


def test_only_an_mlp_speculator_exports_in_its_layout(tiny, tmp_path):
    _, target = tiny
    config = HeadConfig.for_target("medusa", target.decoder.config, num_medusa_heads=2)
    medusa = LoadedHead(config, build_head(config), torch.arange(64), {})
    with pytest.raises(ValueError, match="only mlp-speculator heads"):
        export_mlp_speculator(medusa, None, tmp_path / "x")


def untied_copy(tied_dir, out):
    """The tied checkpoint with every stage's tensors written out, as the reference reads them."""
    config = json.loads((tied_dir / "config.json").read_text())
    weights = {name.removeprefix("speculator."): value for name, value in
               load_file(str(tied_dir / "model.safetensors")).items()}
    for stage in range(1, config["n_predict"]):
        for name in ("emb.{}.weight", "ln.{}.weight", "ln.{}.bias"):
            weights[name.format(stage)] = weights[name.format(0)]
        weights[f"proj.{stage}.weight"] = weights["proj.1.weight"]
    out.mkdir()
    save_file({name: value.clone() for name, value in weights.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**config, "tie_weights": False}))
    return out


def _chains(head, reference_dir, emb_dim: int, trials: int = 8) -> None:
    proposer = MLPSpeculatorProposer(head.module)
    generator = torch.Generator().manual_seed(1)
    for trial in range(trials):
        feature = torch.randn(1, 1, emb_dim, generator=generator)
        token_ids = torch.tensor([[5, 9, 2 + 7 * trial]])
        proposer.reset()
        drafted = proposer.propose(ProposeContext(token_ids, SamplingParams(temperature=0), None, 64, feature), 3)
        assert drafted.token_ids[0].tolist() == reference_chain(reference_dir, feature[0], int(token_ids[0, -1]), 3)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_published_speculator_drafts_what_its_equations_draft(tmp_path, tied):
    directory = published(tmp_path / "published", tied=tied)
    reference = untied_copy(directory, tmp_path / "untied") if tied else directory
    head = load_fms_speculator(directory, 32, 64)
    assert (head.config.kind, head.config.mlp_stages) == ("mlp-speculator", 3)
    _chains(head, reference, 32)


def test_an_exported_head_loads_back_and_drafts_the_same(tiny, tmp_path):
    model, target = tiny
    head, vocab = _head(target, torch.arange(model.config.vocab_size), seed=2)
    out = export_mlp_speculator(head, vocab, tmp_path / "mlp", dtype=torch.float32)
    loaded = load_fms_speculator(out, model.config.hidden_size, model.config.vocab_size)
    ours, theirs = MLPSpeculatorProposer(head.module, vocab), MLPSpeculatorProposer(loaded.module)
    generator = torch.Generator().manual_seed(3)
    for trial in range(8):
        feature = torch.randn(1, 1, model.config.hidden_size, generator=generator)
        context = ProposeContext(torch.tensor([[4, 2 + 5 * trial]]), SamplingParams(temperature=0), None, 64, feature)
        ours.reset(), theirs.reset()
        assert ours.propose(context, 3).token_ids.tolist() == theirs.propose(context, 3).token_ids.tolist()


def test_a_published_speculator_keeps_greedy_output_and_the_sampled_law(tiny, tmp_path):
    model, target = tiny
    directory = published(tmp_path / "published", emb_dim=model.config.hidden_size, vocab_size=60, seed=4)
    head = load_fms_speculator(directory, model.config.hidden_size, model.config.vocab_size)  # 60 of 64 tokens
    spec = SpecEngine(target, MLPSpeculatorProposer(head.module), None, k=3, eos_token_ids=frozenset())
    plain = SpecEngine(target, None, None, eos_token_ids=frozenset())
    greedy = SamplingParams(temperature=0)
    result = spec.generate([5, 9, 12, 3], greedy, max_new_tokens=30)
    assert result.token_ids == plain.generate([5, 9, 12, 3], greedy, max_new_tokens=30).token_ids
    assert result.stats.drafted_tokens > 0
    params = SamplingParams(temperature=0.9)
    tests = distribution_tests(list(spec.sample_continuations([5, 9], params, 600)),
                               list(plain.sample_continuations([5, 9], params, 600, seed=10_000)))
    assert min(test.p_value for test in tests) > 1e-4, tests


def test_a_published_speculator_that_does_not_fit_is_a_clear_error(tmp_path):
    directory = published(tmp_path / "published")
    with pytest.raises(ValueError, match="hidden size 32 and 64 tokens; this target has 48 and 64"):
        load_fms_speculator(directory, 48, 64)
    broken = published(tmp_path / "broken", tied=True)
    weights = load_file(str(broken / "model.safetensors"))
    del weights["speculator.proj.1.weight"]
    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks proj.1.weight"):
        load_fms_speculator(broken, 32, 64)
