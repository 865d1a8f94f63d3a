"""Heads on any architecture: the transformers runner hands over the target's hidden states as the
native decoder does (models/hf.py, HFFeatures), so EAGLE, EAGLE-3 and Medusa heads train on a model
the native decoder does not run (a tiny GPT-2: learned positions, LayerNorm, GELU), EAGLE and EAGLE-3
chains draft on it with greedy output the target's own, and trees are refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from conftest import EOS, VOCAB_SIZE, make_model, make_tokenizer
from specdec.cli import main
from specdec.models.hf import HFRunner


def make_gpt2(seed: int = 0, layers: int = 2, hidden: int = 32) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB_SIZE, n_embd=hidden, n_layer=layers, n_head=4,
                                       n_positions=256, bos_token_id=1, eos_token_id=1))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # sharp logits, as conftest.make_model's
    return model.eval()


@pytest.mark.parametrize("make", [make_gpt2, lambda: make_model(seed=2, family="llama")], ids=["gpt2", "llama"])
def test_captured_features_are_the_residual_stream_and_the_final_norm(make):
    model = make()
    runner = HFRunner(model)
    ids = torch.randint(2, 30, (1, 9), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(9)[None]
    assert runner.forward(ids, positions).hidden is None  # nothing asked: no hidden states kept
    layers = runner.decoder.config.num_layers
    runner.reset()
    runner.decoder.capture_layers(())
    out = runner.forward(ids, positions)
    # The final features are what the output head reads: its logits come back from them.
    with torch.inference_mode():
        torch.testing.assert_close(model.get_output_embeddings()(out.hidden), out.logits, atol=1e-4, rtol=1e-4)
    runner.reset()
    runner.decoder.capture_layers((0, 1, layers))
    both = runner.forward(ids, positions).hidden
    size = runner.decoder.config.hidden_size
    assert both.shape == (1, 9, 3 * size)
    torch.testing.assert_close(both[..., 2 * size:], out.hidden)
    with torch.no_grad():
        reference = model(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(both[..., :size], reference[0])  # entering layer 0: the embeddings
    torch.testing.assert_close(both[..., size:2 * size], reference[1])
    with pytest.raises(ValueError, match="outside the target's 2 layers"):
        runner.decoder.capture_layers((3,))


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2") / "target"
    make_gpt2().save_pretrained(path)
    tokenizer = make_tokenizer()
    tokenizer.save_pretrained(path)
    assert tokenizer.convert_tokens_to_ids(EOS) == 1
    return str(path)


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_heads_train_and_draft_on_a_model_the_native_decoder_does_not_run(capsys, gpt2_dir, tmp_path):
    common = ["--target", gpt2_dir, "--max-new-tokens", "24", "--json", "hello world"]
    code, out, err = run(capsys, "generate", "--method", "autoregressive", *common)
    assert code == 0, err
    assert "transformers backend" in err  # GPT-2 is not native: the hf runner serves it
    plain = json.loads(out)["token_ids"]
    for kind, extra in (("eagle", []), ("eagle3", ["--aux-layers", "0,1,1"]), ("medusa", [])):
        head = tmp_path / f"{kind}.safetensors"
        code, _, err = run(capsys, "train-head", "--kind", kind, *extra, "--target", gpt2_dir, "--out", str(head),
                           "--max-tokens", "1024", "--seq-len", "64", "--steps", "3", "--checkpoint-every", "3")
        assert code == 0, err
        chain, tree = {"eagle": ("eagle", "eagle-tree"), "eagle3": ("eagle3", "eagle3-tree"),
                       "medusa": (None, "medusa")}[kind]
        if chain is not None:
            code, out, err = run(capsys, "generate", "--method", chain, "--head", str(head), "-k", "3", *common)
            assert code == 0, err
            result = json.loads(out)
            assert result["token_ids"] == plain, chain
            assert result["stats"]["drafted_tokens"] > 0, chain
        # A tree needs the native decoder's mask among the new tokens: a clear error, not a wrong token.
        code, out, err = run(capsys, "generate", "--method", tree, "--head", str(head), "--tree-size", "5", *common)
        assert code == 2 and "verifies chains only" in err and "native" in err, err
