"""The embedded real models, end to end (marked `integration`; `make test` runs them).

Greedy speculative output must equal plain greedy output of the same target,
token for token, on real Qwen2.5-Coder weights (native backend with an int4
draft, the default, and the transformers backend); the native decoder must
reproduce transformers' logits on the same weights; and a draft with another
tokenizer must be refused with a clear error.
"""

import pytest
import torch

from specdec.engine import SpecEngine
from specdec.models.loader import check_same_vocabulary, load_model
from specdec.proposers import DraftModelProposer, NgramProposer, NgramThenDraftProposer
from specdec.sampling import SamplingParams

pytestmark = pytest.mark.integration

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences what a hash table is.",
]
COPY_PROMPT = (
    "Rename `values` to `samples` in this function and reply with the code only.\n\n"
    "def spread(values):\n    lowest = min(values)\n    highest = max(values)\n"
    "    return highest - lowest, len(values)\n"
)


@pytest.fixture(scope="module")
def qwen_pair():
    target = load_model("qwen2.5-coder-1.5b", device="cpu", progress=False)
    draft = load_model("qwen2.5-coder-0.5b", device="cpu", quantize="auto", progress=False)
    assert target.backend == draft.backend == "native"
    return target, draft


def test_transformers_backend_pair_greedy_speculative_equals_plain():
    target = load_model("qwen2.5-coder-1.5b", device="cpu", backend="hf", progress=False)
    draft = load_model("qwen2.5-coder-0.5b", device="cpu", backend="hf", progress=False)
    eos = target.eos_token_ids
    params = SamplingParams(temperature=0)
    reference = SpecEngine(target.runner, None, target.tokenizer, eos_token_ids=eos).generate(
        PROMPTS[0], params, max_new_tokens=16, chat=True)
    out = SpecEngine(target.runner, DraftModelProposer(draft.runner), target.tokenizer, k=4,
                     eos_token_ids=eos).generate(PROMPTS[0], params, max_new_tokens=16, chat=True)
    assert out.token_ids == reference.token_ids and out.stats.accepted_tokens > 0


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_native_decoder_reproduces_transformers_logits(name):
    reference = load_model(name, device="cpu", backend="hf", dtype="float32", progress=False)
    ids = torch.tensor([reference.tokenizer(COPY_PROMPT + PROMPTS[1])["input_ids"]])
    positions = torch.arange(ids.shape[1])[None]
    expected = reference.runner.forward(ids, positions).logits
    fp32 = load_model(name, device="cpu", backend="native", dtype="float32", progress=False)
    torch.testing.assert_close(fp32.runner.forward(ids, positions).logits, expected, atol=2e-3, rtol=1e-4)
    bf16 = load_model(name, device="cpu", backend="native", dtype="bfloat16", progress=False)
    agreement = (bf16.runner.forward(ids, positions).logits.argmax(-1) == expected.argmax(-1)).float().mean()
    assert agreement >= 0.95


@pytest.mark.parametrize("prompt", PROMPTS)
def test_real_pair_greedy_speculative_equals_plain(qwen_pair, prompt):
    target, draft = qwen_pair
    check_same_vocabulary(target.tokenizer, draft.tokenizer)
    eos = target.eos_token_ids
    plain = SpecEngine(target.runner, None, target.tokenizer, eos_token_ids=eos)
    spec = SpecEngine(target.runner, DraftModelProposer(draft.runner), target.tokenizer, k=4, eos_token_ids=eos)
    params = SamplingParams(temperature=0)
    reference = plain.generate(prompt, params, max_new_tokens=24, chat=True)
    out = spec.generate(prompt, params, max_new_tokens=24, chat=True)
    assert out.token_ids == reference.token_ids
    assert out.text == reference.text and len(out.text) > 20
    assert out.stats.accepted_tokens > 0 and out.stats.mean_accepted_length > 1.0




@pytest.mark.parametrize("method", ["ngram", "ngram+draft"])
def test_real_target_ngram_greedy_equals_plain_and_copies(qwen_pair, method):
    target, draft = qwen_pair
    eos = target.eos_token_ids
    proposer = NgramProposer() if method == "ngram" else NgramThenDraftProposer(
        NgramProposer(ngram_min=2), DraftModelProposer(draft.runner), draft_max_k=3)
    plain = SpecEngine(target.runner, None, target.tokenizer, eos_token_ids=eos)
    spec = SpecEngine(target.runner, proposer, target.tokenizer, k=8, eos_token_ids=eos)
    params = SamplingParams(temperature=0)
    reference = plain.generate(COPY_PROMPT, params, max_new_tokens=32, chat=True)
    out = spec.generate(COPY_PROMPT, params, max_new_tokens=32, chat=True)
    assert out.token_ids == reference.token_ids and "samples" in out.text
    assert out.stats.mean_accepted_length > 1.5  # the edit copies most of the function


def test_real_pair_seeded_sampling_is_reproducible(qwen_pair):
    target, draft = qwen_pair
    spec = SpecEngine(target.runner, DraftModelProposer(draft.runner), target.tokenizer, k=3)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=5)
    first = spec.generate(PROMPTS[0], params, max_new_tokens=12, chat=True)
    second = spec.generate(PROMPTS[0], params, max_new_tokens=12, chat=True)
    assert first.token_ids == second.token_ids


def test_draft_with_another_tokenizer_is_refused(qwen_pair):
    target, _ = qwen_pair
    smol = load_model("smollm2-135m", device="cpu", progress=False)
    with pytest.raises(ValueError, match="tokenizer is incompatible"):
        check_same_vocabulary(target.tokenizer, smol.tokenizer)


@pytest.fixture(scope="module")
def quick_eagle(qwen_pair, tmp_path_factory):
    """An EAGLE head for the real target trained in seconds on a few windows of the training corpus
    (a narrow layer, an 8k-token head vocabulary): weak, but its drafts get accepted on text like
    what it saw, which is all greedy equality needs to exercise chains, trees and compaction."""
    from specdec.models.heads import HeadConfig, frozen_vocabulary
    from specdec.models.native.reduced_vocab import frequent_token_ids
    from specdec.training.corpus import chat_texts, stdlib_documents, token_chunks
    from specdec.training.train_head import TrainOptions, extract_features, load_features, train_head

    target, _ = qwen_pair
    chunks = token_chunks(target.tokenizer, chat_texts(target.tokenizer, stdlib_documents()[:40]), 96, 96 * 10)
    tokens, features = load_features(extract_features(target.runner, chunks, tmp_path_factory.mktemp("f"),
                                                      progress=False))
    vocab = frozen_vocabulary(target.runner, target.path, frequent_token_ids(target.tokenizer, 8192, 151936),
                              torch.float32)
    config = HeadConfig.for_target("eagle", target.runner.decoder.config, intermediate_size=512)
    path = tmp_path_factory.mktemp("head") / "eagle.safetensors"
    train_head(config, vocab, tokens, features, path, TrainOptions(steps=40, lr=2e-3, checkpoint_every=40,
                                                                   heldout_windows=1),
               device=torch.device("cpu"), progress=False, log=lambda message: None)
    return path, chunks


@pytest.mark.parametrize("method", ["eagle", "eagle-tree"])
def test_real_target_eagle_greedy_equals_plain(qwen_pair, quick_eagle, method):
    from specdec.models.heads import load_head_for
    from specdec.proposers.registry import build_proposer

    target, _ = qwen_pair
    path, chunks = quick_eagle
    head, vocabulary = load_head_for(target, "eagle", path)
    proposer = build_proposer(method, head=head, head_vocabulary=vocabulary, tree_size=8)
    eos = target.eos_token_ids
    plain = SpecEngine(target.runner, None, target.tokenizer, eos_token_ids=eos)
    spec = SpecEngine(target.runner, proposer, target.tokenizer, k=4, eos_token_ids=eos)
    params = SamplingParams(temperature=0)
    prompt = chunks[1][:64]  # text like the head's training windows
    reference = plain.generate(prompt, params, max_new_tokens=24)
    out = spec.generate(prompt, params, max_new_tokens=24)
    assert out.token_ids == reference.token_ids
    assert out.stats.accepted_tokens > 0
