"""Stop strings and an answer's text (engine/request.py): the incremental text equals a whole decode
at every commit, the stop cut equals the old search of the whole text after every token, the stream
never shows what a stop string cuts, the limits on stop strings, and a cost per token that does not
grow with the answer. Real tokenizers: the character-level one of conftest.py, the packaged Qwen2.5
byte-level BPE one where its model is converted (its multi-byte characters span tokens), and real
tokenizers built here with decoders that are not piecewise (decoded whole)."""

from __future__ import annotations

import inspect
import string
import textwrap

import pytest
from conftest import CHARS, make_tokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from specdec.engine.request import (MAX_STOP_CHARS_TOTAL, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, IncrementalText,
                                    Request, check_generation_options, decodes_piecewise)
from specdec.models import hub
from specdec.sampling.params import SamplingParams


REAL_MODEL = "qwen2.5-coder-0.5b"  # the packaged draft model; its tokenizer is the 1.5B target's
MULTI_BYTE_TEXT = "héllo wörld, naïve café: 世界 你好 🙂🚀 ∑x² ≠ ∞ — ok"
PROPERTY_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- the tokenizers -------------------------------------------------------------------------------


def byte_level_characters() -> dict[int, str]:
    """GPT-2's byte -> character map of byte-level BPE (each byte's token is spelt with it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    characters, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            characters[byte] = chr(byte)
        else:
            characters[byte] = chr(256 + extra)
            extra += 1
    return characters


@pytest.fixture(scope="module")
def qwen_tokenizer():
    if not hub.is_cached(REAL_MODEL):
        pytest.skip(f"{REAL_MODEL} is not converted here (`specdec models fetch {REAL_MODEL}`)")
    return AutoTokenizer.from_pretrained(hub.cache_root() / REAL_MODEL)


def qwen_ids(tokenizer) -> st.SearchStrategy[int]:
    """Token ids that make hard answers: any id (special, added, text), single bytes (so that a multi-byte
    character spans tokens, or stays incomplete, or is not UTF-8 at all), and real pieces of multi-byte text."""
    bytes_ = tokenizer.convert_tokens_to_ids(list(byte_level_characters().values()))
    added = list(tokenizer.backend_tokenizer.get_added_tokens_decoder())
    pieces = tokenizer(MULTI_BYTE_TEXT)["input_ids"] + tokenizer("\n\n</answer> STOP")["input_ids"]
    return st.one_of(st.integers(0, len(tokenizer) - 1), st.sampled_from(bytes_), st.sampled_from(added),
                     st.sampled_from(pieces))


def whole_decoding_tokenizer(kind: str) -> PreTrainedTokenizerFast:
    """A character-level tokenizer like conftest's, with a decoder that is not piecewise: WordPiece
    (tokens joined with spaces) and transformers' clean-up, which rewrites text already decoded
    ("x a '" becomes "x a's" when "s" comes); or SentencePiece's Metaspace, which drops the first space."""
    space = "\u2581" if kind == "metaspace" else " "
    vocab = {"<unk>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARS.replace(" ", space) + "'")}}
    if kind == "metaspace":
        backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
        backend.decoder = decoders.Metaspace()
    else:
        backend = Tokenizer(models.WordPiece(vocab=vocab, unk_token="<unk>"))
        backend.decoder = decoders.WordPiece(cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>",
                                   clean_up_tokenization_spaces=kind == "wordpiece-cleanup")


# ---- the references: the old code, which decoded the whole answer after every token -------------


def reference_commits(tokenizer, stop, eos_token_ids, max_new_tokens, batches, whole_text=False):
    """Request.commit as it was: after each token, decode the whole answer and search it for each stop
    string from (old text length - longest stop string) on; with whole_text, from its start. Returns,
    per batch, the tokens kept, the finish reason and the text after the commit.

    The two differ only where a decode rewrites text before that window (WordPiece's clean-up, below),
    where the old code missed the stop string; the new code finds it, as the whole-text search does."""
    generated, text, finish_reason, results = [], "", None, []
    for batch in batches:
        kept = []
        for token in batch:
            if finish_reason is not None:
                break
            generated.append(token)
            kept.append(token)
            if token in eos_token_ids:
                finish_reason = "eos"
                continue
            if stop:
                full = tokenizer.decode(generated, skip_special_tokens=True)
                start = 0 if whole_text else max(0, len(text) - max(len(s) for s in stop))
                hits = [i for i in (full.find(s, start) for s in stop) if i >= 0]
                text = full[: min(hits)] if hits else full
                if hits:
                    finish_reason = "stop"
                    continue
            if len(generated) >= max_new_tokens:
                finish_reason = "length"
        if finish_reason != "stop":
            text = tokenizer.decode(generated, skip_special_tokens=True)
        results.append((kept, finish_reason, text))
    return results


def split(tokens: list[int], sizes: list[int]) -> list[list[int]]:
    """tokens in consecutive batches of the given sizes (as steps commit them), the rest in one."""
    batches, start = [], 0
    for size in sizes:
        batches.append(tokens[start: start + size])
        start += size
    return [batch for batch in batches if batch] + ([tokens[start:]] if tokens[start:] else [])


def run_commits(tokenizer, stop, eos_token_ids, max_new_tokens, batches):
    """The same commits through Request; also checks, after each, what the stream has shown (where the
    tokenizer decodes piecewise: a whole decode may rewrite text already shown, as it always could)."""
    request = Request([1], SamplingParams(), max_new_tokens, frozenset(eos_token_ids), tuple(stop), tokenizer)
    results, shown = [], ""
    for batch in batches:
        kept = request.commit(batch)
        shown += request.text_delta()
        results.append((kept, request.finish_reason, request.text))
        if not decodes_piecewise(tokenizer):
            continue
        # Never shown: a stop string, text that a stop string cuts, or a character that may still change.
        if request.finished:
            assert shown == request.text
        else:
            assert request.text.startswith(shown)
    return results


def check_against_reference(tokenizer, tokens, stop, sizes, eos_token_ids=(), max_new_tokens=10_000) -> None:
    """Request's commits == the whole-text search's, and == the old code's where the decoder is piecewise
    (a piecewise decode never rewrites what it decoded but for a last incomplete character)."""
    batches = split(tokens, sizes)
    got = run_commits(tokenizer, stop, eos_token_ids, max_new_tokens, batches)
    eos_token_ids = frozenset(eos_token_ids)
    assert got == reference_commits(tokenizer, stop, eos_token_ids, max_new_tokens, batches, whole_text=True)
    if decodes_piecewise(tokenizer):
        assert got == reference_commits(tokenizer, stop, eos_token_ids, max_new_tokens, batches)


@st.composite
def answers_and_stops(draw, tokenizer, ids):
    """An answer (token ids), commit sizes, and stop strings: pieces of the answer's own text (so that
    they occur, inside a token or across tokens) and strings that may not occur."""
    tokens = draw(st.lists(ids, min_size=1, max_size=40))
    sizes = draw(st.lists(st.integers(1, 6), max_size=20))
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    stop = []
    for _ in range(draw(st.integers(0, 4))):
        if text and draw(st.booleans()):
            start = draw(st.integers(0, len(text) - 1))
            stop.append(text[start: start + draw(st.integers(1, 8))])
        else:
            stop.append(draw(st.text(alphabet=CHARS + "éö世界🙂\ufffd", min_size=1, max_size=4)))
    return tokens, sizes, stop


# ---- the text equals a whole decode at every commit -----------------------------------------------


@PROPERTY_SETTINGS
@given(data=st.data())
def test_incremental_text_equals_a_whole_decode_character_tokenizer(data):
    tokenizer = make_tokenizer()
    assert decodes_piecewise(tokenizer)
    tokens = data.draw(st.lists(st.integers(0, 63), max_size=60))  # ids past the vocabulary decode to nothing
    check_incremental_text(tokenizer, tokens, data.draw(st.lists(st.integers(1, 6), max_size=30)))


@PROPERTY_SETTINGS
@given(data=st.data())
def test_incremental_text_equals_a_whole_decode_byte_level_bpe(qwen_tokenizer, data):
    assert decodes_piecewise(qwen_tokenizer)
    tokens = data.draw(st.lists(qwen_ids(qwen_tokenizer), max_size=60))
    check_incremental_text(qwen_tokenizer, tokens, data.draw(st.lists(st.integers(1, 6), max_size=30)))


def check_incremental_text(tokenizer, tokens, sizes) -> None:
    """After each batch, one token at a time (a request with stop strings) and a batch at once (one
    without): text == decode(all so far, skip_special_tokens=True)."""
    per_token, per_batch, so_far = IncrementalText(tokenizer), IncrementalText(tokenizer), []
    for batch in split(tokens, sizes):
        for token in batch:
            per_token.extend([token])
        per_batch.extend(batch)
        so_far += batch
        whole = tokenizer.decode(so_far, skip_special_tokens=True)
        assert per_token.text == whole and per_batch.text == whole


def test_a_multi_byte_character_split_across_tokens_waits_for_its_last_byte(qwen_tokenizer):
    """'世' is three bytes; fed one byte token at a time it is pending (U+FFFD, not shown) until the last."""
    characters = byte_level_characters()
    byte_ids = qwen_tokenizer.convert_tokens_to_ids([characters[b] for b in "a世".encode()])
    request = Request([1], SamplingParams(), 10, tokenizer=qwen_tokenizer)
    shown = []
    for token in byte_ids:
        request.commit([token])
        shown.append(request.text_delta())
        assert request.text == qwen_tokenizer.decode(request.generated, skip_special_tokens=True)
    assert shown == ["a", "", "", "世"]


# ---- the stop cut equals the old whole-text search ----------------------------------------------


@PROPERTY_SETTINGS
@given(data=st.data())
def test_stop_cut_equals_the_old_whole_text_search_character_tokenizer(data):
    tokenizer = make_tokenizer()
    tokens, sizes, stop = data.draw(answers_and_stops(tokenizer, st.integers(0, 63)))
    eos = data.draw(st.sampled_from([(), (1,)]))
    check_against_reference(tokenizer, tokens, stop, sizes, eos, data.draw(st.integers(1, 50)))


@PROPERTY_SETTINGS
@given(data=st.data())
def test_stop_cut_equals_the_old_whole_text_search_byte_level_bpe(qwen_tokenizer, data):
    tokens, sizes, stop = data.draw(answers_and_stops(qwen_tokenizer, qwen_ids(qwen_tokenizer)))
    check_against_reference(qwen_tokenizer, tokens, stop, sizes, (qwen_tokenizer.eos_token_id,))


@pytest.mark.parametrize("kind", ["wordpiece-cleanup", "metaspace"])
@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_tokenizers_that_are_not_piecewise_decode_whole_and_cut_the_same(kind, data):
    """The clean-up rewrites text already decoded: the matcher reads again from where it changed, and
    finds the stop strings the rewrite makes (the old code missed those before its window)."""
    tokenizer = whole_decoding_tokenizer(kind)
    assert not decodes_piecewise(tokenizer)
    tokens, sizes, stop = data.draw(answers_and_stops(tokenizer, st.integers(0, len(CHARS) + 2)))
    check_against_reference(tokenizer, tokens, stop, sizes)


def test_a_rewritten_text_is_searched_again_where_it_changed():
    tokenizer = whole_decoding_tokenizer("wordpiece-cleanup")
    tokens = tokenizer.convert_tokens_to_ids(["x", "a", "'", "s"])
    assert [tokenizer.decode(tokens[:n]) for n in (3, 4)] == ["x a '", "x a's"]  # the space before ' went
    check_against_reference(tokenizer, tokens, ["a's"], [1, 1, 1, 1])
    request = Request([1], SamplingParams(), 10, stop=("a's",), tokenizer=tokenizer)
    request.commit(tokens)
    assert request.finish_reason == "stop" and request.text == "x "
    # Found by hypothesis: "c h c t h m '" + "d" is "c h c t h m'd", where "c t h m'" starts at 4;
    # the old code looked from 13 - 8 = 5 on and never stopped.
    tokens = tokenizer.convert_tokens_to_ids(list("chcthm'd"))
    assert tokenizer.decode(tokens) == "c h c t h m'd"
    check_against_reference(tokenizer, tokens, ["c t h m'"], [2, 6])
    assert reference_commits(tokenizer, ["c t h m'"], frozenset(), 10, [tokens])[0][1] is None


def test_the_stream_holds_back_what_could_grow_into_a_stop_string():
    tokenizer = make_tokenizer()
    request = Request([1], SamplingParams(), 100, stop=("stop here", "ops"), tokenizer=tokenizer)
    shown = []
    for piece in ["say sto", "p her", "x, o", "p", "s!"]:
        request.commit(tokenizer(piece)["input_ids"])
        shown.append(request.text_delta())
    # "sto" could begin "stop here", "sto" and "stop her" too; "o" and "op" could begin "ops".
    assert shown == ["say ", "", "stop herx, ", "", ""]
    assert request.finish_reason == "stop" and request.text == "say stop herx, "


def test_stop_strings_inside_one_token_and_across_tokens_cut_at_the_earliest(qwen_tokenizer):
    answer = qwen_tokenizer("def f():\n    return 1\n\n</answer> trailing words")["input_ids"]
    for stop, expected in [(["</answer>"], "def f():\n    return 1\n\n"), (["turn 1\n"], "def f():\n    re"),
                           (["trailing", "\n\n", "f()"], "def "), (["never"], None)]:
        check_against_reference(qwen_tokenizer, answer, stop, [1, 3, 2, 5, 4])
        request = Request([1], SamplingParams(), 100, stop=tuple(stop), tokenizer=qwen_tokenizer)
        request.commit(answer)
        assert request.text == (qwen_tokenizer.decode(answer) if expected is None else expected)


# ---- the limits ---------------------------------------------------------------------------------


def test_stop_string_limits_raise_clear_errors():
    assert (MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS, MAX_STOP_CHARS_TOTAL) == (16, 1_000, 4_000)
    assert check_generation_options(8, ["a"] * 16) == ("a",) * 16
    assert check_generation_options(8, "x" * 1_000) == ("x" * 1_000,)
    assert check_generation_options(8, ["x" * 1_000] * 4) == ("x" * 1_000,) * 4
    with pytest.raises(ValueError, match="at most 16 stop strings are allowed, got 17"):
        check_generation_options(8, ["a"] * 17)
    with pytest.raises(ValueError, match="at most 1000 characters; stop string 1 has 1001"):
        check_generation_options(8, ["ok", "x" * 1_001])
    with pytest.raises(ValueError, match="at most 4000 characters in all, got 4005"):
        check_generation_options(8, ["x" * 801] * 5)
    with pytest.raises(ValueError, match="at most 16 stop strings"):  # the case: 16 x 10,000
        check_generation_options(8, ["x" * 10_000] * 17)
    with pytest.raises(ValueError, match="at most 1000 characters; stop string 0 has 10000"):
        check_generation_options(8, ["x" * 10_000] * 16)


def test_stop_string_limits_can_be_set_per_call():
    """An operator's limits (the server passes its flags): tighter or looser than the defaults."""
    with pytest.raises(ValueError, match="at most 4 stop strings are allowed, got 5"):
        check_generation_options(8, ["a"] * 5, max_stop_strings=4)
    with pytest.raises(ValueError, match="at most 10 characters; stop string 0 has 11"):
        check_generation_options(8, ["x" * 11], max_stop_string_chars=10)
    with pytest.raises(ValueError, match="at most 12 characters in all, got 14"):
        check_generation_options(8, ["x" * 7] * 2, max_stop_chars_total=12)
    looser = check_generation_options(8, ["x" * 10_000] * 32, max_stop_strings=32, max_stop_string_chars=10_000,
                                      max_stop_chars_total=320_000)
    assert len(looser) == 32


def test_the_engine_refuses_too_long_stop_strings_before_running(target_runner, tokenizer):
    from specdec.engine import SpecEngine

    with pytest.raises(ValueError, match="stop string 0 has 1001"):
        SpecEngine(target_runner, None, tokenizer).generate("hello", max_new_tokens=4, stop=["x" * 1_001])


# ---- the cost per token does not grow with the answer -------------------------------------------

ANSWER_TOKENS = 2_000


def counting_decodes(tokenizer, monkeypatch) -> dict[str, int]:
    """Count the tokenizer's decode calls and the tokens they decode (the real decode still runs)."""
    counts, decode = {"calls": 0, "tokens": 0}, tokenizer.decode

    def counted(token_ids, *args, **kwargs):
        counts["calls"] += 1
        counts["tokens"] += len(token_ids)
        return decode(token_ids, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "decode", counted)
    return counts


def long_answer(tokenizer) -> list[int]:
    source = textwrap.dedent(inspect.getsource(textwrap)) + MULTI_BYTE_TEXT * 40
    tokens = tokenizer(source)["input_ids"]
    assert len(tokens) >= ANSWER_TOKENS
    return tokens[:ANSWER_TOKENS]


def sixteen_stops_that_never_match() -> tuple[str, ...]:
    """16 stop strings, 4,000 characters in all (the limits): each begins like the answer's text
    (so the matcher has work) and then goes where the answer never does."""
    return tuple(("def " + string.ascii_lowercase[i] * 200 + "\x00").ljust(250, "\x00") for i in range(16))


@pytest.mark.parametrize("which", ["character", "byte-level-bpe"])
def test_detokenizing_and_stop_matching_cost_is_linear_in_the_answer(which, request, monkeypatch):
    """A 2,000-token answer with 16 stop strings, committed as a speculative step would (a few tokens
    at a time, text_delta after each): the tokenizer decodes each token a bounded number of times.
    The old code decoded the whole answer after every token: n (n + 1) / 2 = 2,001,000 tokens."""
    tokenizer = make_tokenizer() if which == "character" else request.getfixturevalue("qwen_tokenizer")
    answer = (long_answer(tokenizer) if which == "byte-level-bpe"
              else tokenizer(("def fib(n): return n, ok?\n" * 100)[:ANSWER_TOKENS])["input_ids"])
    assert len(answer) == ANSWER_TOKENS
    stop = sixteen_stops_that_never_match()
    check_generation_options(ANSWER_TOKENS, stop)  # within the default limits
    counts = counting_decodes(tokenizer, monkeypatch)
    generation = Request([1], SamplingParams(), ANSWER_TOKENS, stop=stop, tokenizer=tokenizer)
    shown = ""
    for start in range(0, ANSWER_TOKENS, 3):
        generation.commit(answer[start: start + 3])
        shown += generation.text_delta()
    assert generation.finish_reason == "length"
    assert counts["calls"] <= ANSWER_TOKENS  # one small decode per token (a stop string is looked for after each)
    assert counts["tokens"] <= 4 * ANSWER_TOKENS  # a token waits for at most 3 more to end its character
    monkeypatch.undo()
    assert shown == generation.text == tokenizer.decode(answer, skip_special_tokens=True)
    # And the reference really is quadratic on the same answer: what the count above rules out.
    reference = counting_decodes(tokenizer, monkeypatch)
    reference_commits(tokenizer, stop, frozenset(), ANSWER_TOKENS, [answer[:200]])
    assert reference["tokens"] >= 200 * 201 // 2
