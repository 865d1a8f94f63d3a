"""The MLP speculator's export: the files alone, run with the equations of fms-extras' and vLLM's
MLPSpeculator, draft what specdec's proposer drafts; tokens outside the head's vocabulary score 0."""

import json
import math

import pytest
import torch
from conftest import make_model, make_native
from safetensors.torch import load_file

from specdec.models.heads import FrozenVocabulary, HeadConfig, LoadedHead, build_head
from specdec.models.heads.mlp_speculator_export import export_mlp_speculator
from specdec.proposers.base import ProposeContext
from specdec.proposers.heads import MLPSpeculatorProposer
from specdec.sampling import SamplingParams


def reference_chain(directory, feature: torch.Tensor, token: int, steps: int) -> list[int]:
    """vLLM's MLPSpeculator (its MLPSpeculatorLayerNorm, state and embedding weights, GELU; greedy
    tokens), written from the exported directory alone."""
    config = json.loads((directory / "config.json").read_text())
    weights = load_file(str(directory / "model.safetensors"))
    inner = config["inner_dim"] or config["emb_dim"]
    state_weight = 0.5 ** (0.5 / config["n_predict"])
    emb_weight = math.sqrt((1 - state_weight ** 2) * (inner / 2))
    state, drafted = feature, []
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
