"""A draft with another tokenizer (proposers/cross_vocabulary.py): the tokens both spell the same
are bridged, byte-level and SentencePiece spellings included; the draft re-reads the target's text
in its own tokens; greedy output is the target's and sampling keeps its distribution.

The drafts here are the target's own weights with the embedding and output rows moved to another
tokenizer's ids: where that tokenizer spells the text as the target's does, the draft guesses what
the target chooses among the tokens it can spell, which checks the context the draft reads as much as
the ids it maps."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conftest import CHARS, EOS, VOCAB_SIZE, make_native, make_peaked_model
from specdec.analysis.lossless import distribution_tests
from specdec.cli import main
from specdec.engine import SpecEngine
from specdec.proposers.base import ProposeContext
from specdec.proposers.registry import build_proposer
from specdec.proposers.cross_vocabulary import (RETOKENIZED_TAIL, CrossVocabularyDraftProposer, VocabularyBridge,
                                                _complete_utf8, token_spellings)
from specdec.sampling import SamplingParams

PROMPTS = ["the cat sat on the mat. the dog", "hello there, how are you?", "a b c d e f g"]


ALPHABET = CHARS + "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123"  # with <unk> and the end token: VOCAB_SIZE tokens


def char_tokenizer(ids: dict[str, int], merges: list[tuple[str, str]] = ()) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE(vocab={"<unk>": 0, EOS: 1, **ids}, merges=list(merges), unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token=EOS)


def target_tokenizer() -> PreTrainedTokenizerFast:
    """One character a token and every id of the tiny models spelled: the target writes no token a
    draft could not spell."""
    assert len(ALPHABET) + 2 == VOCAB_SIZE
    return char_tokenizer({c: i + 2 for i, c in enumerate(ALPHABET)})


def other_tokenizer(merges: bool) -> PreTrainedTokenizerFast:
    """The same characters at other ids (reversed); with merges, "th" and "the" in place of "2" and "3"."""
    ids = {c: VOCAB_SIZE - 1 - i for i, c in enumerate(ALPHABET)}
    if not merges:
        return char_tokenizer(ids)
    ids["th"], ids["the"] = ids.pop("2"), ids.pop("3")
    return char_tokenizer(ids, [("t", "h"), ("th", "e")])


@pytest.fixture(scope="module")
def tokenizer():
    return target_tokenizer()


def moved_copy(model: torch.nn.Module, bridge: VocabularyBridge) -> torch.nn.Module:
    """The target's weights with each shared token's embedding and output rows at the draft's id."""
    draft = type(model)(model.config)
    draft.load_state_dict(model.state_dict())
    shared = (bridge.draft_to_target >= 0).nonzero().flatten()
    with torch.no_grad():
        for weight in (draft.get_input_embeddings().weight, draft.get_output_embeddings().weight):
            weight[shared] = weight.clone()[bridge.draft_to_target[shared]]
    return draft.eval()


def test_tokens_spelled_the_same_are_bridged_and_others_are_not():
    target, draft = target_tokenizer(), other_tokenizer(merges=True)
    bridge = VocabularyBridge.between(draft, target, VOCAB_SIZE, VOCAB_SIZE)
    for char in "az .\n":
        assert int(bridge.draft_to_target[draft.convert_tokens_to_ids(char)]) == target.convert_tokens_to_ids(char)
    assert int(bridge.draft_to_target[draft.convert_tokens_to_ids("the")]) == -1  # the target has no such token
    assert int(bridge.draft_to_target[1]) == 1  # the end-of-text token: the same added token
    assert bridge.shared == VOCAB_SIZE - 2 and bridge.draft_texts[draft.convert_tokens_to_ids("the")] == b"the"


def test_byte_level_and_sentencepiece_spellings_are_bytes():
    byte_level = Tokenizer(models.BPE(vocab={"\u0120the": 0, "\u010a": 1, "\u00c3\u00a9": 2, "a": 3}, merges=[]))
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.decoder = decoders.ByteLevel()
    keys, texts = token_spellings(PreTrainedTokenizerFast(tokenizer_object=byte_level), 5)
    assert keys[:4] == [b" the", b"\n", "é".encode(), b"a"] and keys[4] is None and texts[0] == b" the"
    piece = Tokenizer(models.BPE(vocab={"\u2581the": 0, "<0x0A>": 1, "b": 2}, merges=[]))
    piece.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback()])
    keys, _ = token_spellings(PreTrainedTokenizerFast(tokenizer_object=piece), 3)
    assert keys == [b" the", b"\n", b"b"]
    assert _complete_utf8("ab€".encode()[:-1]) == 2 and _complete_utf8("ab€".encode()) == 5


@pytest.fixture(scope="module")
def target_model():
    return make_peaked_model(seed=3)


@pytest.mark.parametrize("merges", [False, True], ids=["same-spelling", "merged-tokens"])
def test_greedy_output_is_the_targets(target_model, tokenizer, merges):
    draft_tokenizer = other_tokenizer(merges)
    bridge = VocabularyBridge.between(draft_tokenizer, tokenizer, VOCAB_SIZE, VOCAB_SIZE)
    draft = make_native(moved_copy(target_model, bridge))
    spec = SpecEngine(make_native(target_model), CrossVocabularyDraftProposer(draft, bridge), tokenizer, k=4,
                      eos_token_ids=frozenset())
    plain = SpecEngine(make_native(target_model), None, tokenizer, eos_token_ids=frozenset())
    greedy = SamplingParams(temperature=0)
    drafted = accepted = 0
    for prompt in PROMPTS:
        result = spec.generate(prompt, greedy, max_new_tokens=40)
        assert result.token_ids == plain.generate(prompt, greedy, max_new_tokens=40).token_ids
        drafted, accepted = drafted + result.stats.drafted_tokens, accepted + result.stats.accepted_tokens
    assert drafted > 40 and accepted > 0
    if not merges:  # the draft is the target in other ids, reading the same text: it guesses right
        assert accepted == drafted


def test_the_draft_reads_what_the_target_wrote_at_every_step(target_model, tokenizer):
    """The draft is the target in other ids: its first guess at each step is the target's own choice,
    whatever the step before left in its cache (drafts never accepted)."""
    bridge = VocabularyBridge.between(other_tokenizer(merges=False), tokenizer, VOCAB_SIZE, VOCAB_SIZE)
    proposer = CrossVocabularyDraftProposer(make_native(moved_copy(target_model, bridge)), bridge)
    plain = SpecEngine(make_native(target_model), None, tokenizer, eos_token_ids=frozenset())
    greedy = SamplingParams(temperature=0)
    written = plain.generate(PROMPTS[0], greedy, max_new_tokens=30)
    tokens = written.prompt_token_ids + written.token_ids
    checked = 0
    for length in range(len(written.prompt_token_ids), len(tokens), 2):  # steps of two tokens, drafts dropped
        context = torch.tensor([tokens[:length]])
        proposal = proposer.propose(ProposeContext(context, greedy, None, VOCAB_SIZE), 3)
        proposer.on_verified(torch.tensor([0]))
        with torch.no_grad():
            logits = target_model(context).logits[0, -1]
        assert int(proposal.token_ids[0, 0]) == int(logits.argmax())
        checked += 1
    assert checked >= 15


def test_past_the_window_the_draft_reads_only_what_is_new(target_model, tokenizer):
    """A context longer than the draft's window: the window is read once, then each step feeds the
    draft the new tokens and the few re-encoded before them, never the window again."""
    bridge = VocabularyBridge.between(other_tokenizer(merges=True), tokenizer, VOCAB_SIZE, VOCAB_SIZE)
    draft = make_native(moved_copy(target_model, bridge))
    widths = []
    forward = draft.forward

    def recording(token_ids, positions, **options):
        widths.append(token_ids.shape[1])
        return forward(token_ids, positions, **options)

    draft.forward = recording
    proposer = CrossVocabularyDraftProposer(draft, bridge, context_window=12)
    tokens = tokenizer(PROMPTS[0] + " " + PROMPTS[1], add_special_tokens=False)["input_ids"]
    greedy = SamplingParams(temperature=0)
    reads = []
    for length in range(20, len(tokens), 2):
        widths.clear()
        proposer.propose(ProposeContext(torch.tensor([tokens[:length]]), greedy, None, VOCAB_SIZE), 2)
        proposer.on_verified(torch.tensor([0]))
        reads.append(widths[0])  # the catch-up forward; the rest are one drafted token each
    assert reads[0] >= 10 and len(reads) >= 10
    assert max(reads[1:]) <= RETOKENIZED_TAIL + 2, reads
    assert proposer.unread_tokens(len(tokens)) == len(tokens) - (length - 0)


def test_sampling_keeps_the_target_distribution(target_model, tokenizer):
    draft_tokenizer = other_tokenizer(merges=True)
    bridge = VocabularyBridge.between(draft_tokenizer, tokenizer, VOCAB_SIZE, VOCAB_SIZE)
    draft = make_native(moved_copy(make_peaked_model(seed=4), bridge))  # a different model: rejections happen
    spec = SpecEngine(make_native(target_model), CrossVocabularyDraftProposer(draft, bridge), tokenizer, k=3)
    plain = SpecEngine(make_native(target_model), None, tokenizer)
    params = SamplingParams(temperature=0.9)
    spec_draws = list(spec.sample_continuations(PROMPTS[0], params, 1000, min_tokens=3))
    plain_draws = list(plain.sample_continuations(PROMPTS[0], params, 1000, min_tokens=3, seed=10_000))
    tests = distribution_tests(spec_draws, plain_draws)
    assert all(t.dof >= 3 for t in tests)
    assert min(t.p_value for t in tests) > 1e-4, tests


def test_ngram_then_a_bridged_draft_keeps_the_target_distribution(target_model, tokenizer):
    draft_tokenizer = other_tokenizer(merges=True)
    bridge = VocabularyBridge.between(draft_tokenizer, tokenizer, VOCAB_SIZE, VOCAB_SIZE)
    draft = make_native(moved_copy(make_peaked_model(seed=4), bridge))
    proposer = build_proposer("ngram+draft", draft_runner=draft, draft_bridge=bridge, adaptive=True,
                              draft_confidence=0.4)
    spec = SpecEngine(make_native(target_model), proposer, tokenizer, k="auto")
    plain = SpecEngine(make_native(target_model), None, tokenizer)
    params = SamplingParams(temperature=0.9)
    spec_draws = list(spec.sample_continuations(PROMPTS[0], params, 1000, min_tokens=3))
    plain_draws = list(plain.sample_continuations(PROMPTS[0], params, 1000, min_tokens=3, seed=10_000))
    assert proposer.steps_by_draft > 0 and proposer.steps_by_ngram > 0  # both sources drafted
    assert min(t.p_value for t in distribution_tests(spec_draws, plain_draws)) > 1e-4
    with pytest.raises(ValueError, match="one request at a time"):
        build_proposer("ngram+draft", slots=2, draft_runner=draft, draft_bridge=bridge)


def test_the_draft_method_bridges_a_draft_with_another_tokenizer(capsys, tmp_path, target_model):
    """Through the command line: `--method draft --draft DIR` with another tokenizer drafts through a
    bridge (said on stderr), greedy output plain's; so does ngram+draft (and method auto, which picks
    it); copy+draft, which weighs the draft model's batch against copying, refuses it."""
    target_dir, draft_dir = tmp_path / "target", tmp_path / "draft"
    target_model.save_pretrained(target_dir)
    target_tokenizer().save_pretrained(target_dir)
    draft_tokenizer = other_tokenizer(merges=True)
    bridge = VocabularyBridge.between(draft_tokenizer, target_tokenizer(), VOCAB_SIZE, VOCAB_SIZE)
    moved_copy(target_model, bridge).save_pretrained(draft_dir)
    draft_tokenizer.save_pretrained(draft_dir)
    common = ["--target", str(target_dir), "--max-new-tokens", "24", "--json", PROMPTS[0]]
    assert main(["generate", "--method", "autoregressive", *common]) == 0
    plain = json.loads(capsys.readouterr().out)["token_ids"]
    assert main(["generate", "--method", "draft", "--draft", str(draft_dir), "-k", "3", *common]) == 0
    captured = capsys.readouterr()
    assert "tokenizer differs" in captured.err and "tokens both spell the same" in captured.err
    result = json.loads(captured.out)
    assert result["token_ids"] == plain and result["stats"]["accepted_tokens"] > 0
    for method in ("ngram+draft", "auto"):  # auto with a --draft: ngram+draft, the bridged draft beside the lookup
        assert main(["generate", "--method", method, "--draft", str(draft_dir), *common]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["method"] == "ngram+draft" and result["token_ids"] == plain
    assert main(["generate", "--method", "copy+draft", "--draft", str(draft_dir), *common]) == 2
    assert "needs a draft with the target's tokenizer" in capsys.readouterr().err
