"""What the integration tests on the embedded real models share (test_real_*.py).

The pair is loaded once per test process (the session fixtures qwen_pair and plain_references in
conftest.py; `make test` runs two processes, see the Makefile) as `specdec generate` loads it,
and the target's plain greedy answers are computed once. The prompts are few on purpose: each
property (greedy equality of a method, batched == alone, a head served by vLLM) needs a
copy-heavy prompt, prose, code and answers that end inside a draft, which four short prompts
give; the prompt over 1,000 tokens (positions past a thousand, attention over many key blocks)
joins the cases whose own state grows with it: the draft model's cache, the suffix tree, the
heads' caches and trees, batched rows and chunked prefill. See docs/exactness.md.
"""

from __future__ import annotations

import hashlib
import inspect
import shutil
import textwrap as textwrap_module
from pathlib import Path

import torch

from specdec.engine import SpecEngine
from specdec.models.loader import load_model
from specdec.sampling import SamplingParams

CODE_PROMPT = "Write a Python function that returns the n-th Fibonacci number."
SHORT_ANSWER_PROMPT = "Explain in two sentences what a hash table is."  # ends (EOS) inside the 64 tokens
COPY_PROMPT = (
    "Rename `values` to `samples` in this function and reply with the code only.\n\n"
    "def spread(values):\n    lowest = min(values)\n    highest = max(values)\n"
    "    return highest - lowest, len(values)\n"
)
PROSE_PROMPT = "Explain in a short paragraph why the sky is blue."
# Over 1,000 tokens (1,048 with the chat template): the first part of the stdlib's textwrap module.
LONG_PROMPT = ("Explain what the following module does, then list its public functions.\n\n"
               + inspect.getsource(textwrap_module)[:4000])
SHORT_PROMPTS = [CODE_PROMPT, SHORT_ANSWER_PROMPT, COPY_PROMPT, PROSE_PROMPT]
# The EAGLE-3 quick head of test_real_eagle3.py and test_real_vllm.py: trained mostly on the target's
# own answers to the prompts vLLM serves, so the vLLM test checks serving, not how far a quick head
# generalises (24 steps on the usual mix left vLLM 4% of its drafts accepted).
SERVED_PROMPTS = [CODE_PROMPT, SHORT_ANSWER_PROMPT]
EAGLE3_QUICK_HEAD = dict(corpus_windows=2, steps=36)
WITH_LONG_PROMPT = [*SHORT_PROMPTS, LONG_PROMPT]
# The heads' tests decode two prompts each: a prompt the quick head was distilled on (so drafts are
# accepted), and for chains an answer that ends (EOS) inside a draft, for trees the long prompt (the
# head's own cache and the tree's compaction past the first growth). The other short prompts showed
# nothing new for a head (the files' time is mostly loading, plain answers and training, not this).
HEAD_CHAIN_PROMPTS = [CODE_PROMPT, SHORT_ANSWER_PROMPT]
HEAD_TREE_PROMPTS = [PROSE_PROMPT, LONG_PROMPT]
NEW_TOKENS = 64


def load_pair():
    """The pair as `specdec generate` loads it: the target w8a8 or w4a8 by what the CPU runs fastest
    exactly, the draft in its int4 format (the isa tests cover the other formats at the real shapes)."""
    target = load_model("qwen2.5-coder-1.5b", device="cpu", quantize="auto", progress=False)
    draft = load_model("qwen2.5-coder-0.5b", device="cpu", quantize="auto", progress=False, role="draft")
    assert target.backend == draft.backend == "native"
    return target, draft


def plain_answers(target, prompts=WITH_LONG_PROMPT) -> dict[str, list[int]]:
    """The target's plain greedy answer to each prompt (by default every prompt above)."""
    plain = SpecEngine(target.runner, None, target.tokenizer, eos_token_ids=target.eos_token_ids)
    params = SamplingParams(temperature=0)
    return {prompt: plain.generate(prompt, params, max_new_tokens=NEW_TOKENS, chat=True).token_ids
            for prompt in prompts}


def assert_every_prompt_equal(target, proposer, plain_references, prompts, k) -> None:
    """Greedy speculative decoding of each prompt, one after another through one engine, gives
    the target's plain greedy answer token for token, and some drafts were accepted."""
    spec = SpecEngine(target.runner, proposer, target.tokenizer, k=k, eos_token_ids=target.eos_token_ids)
    params, accepted = SamplingParams(temperature=0), 0
    mismatches = []
    for prompt in prompts:
        reference = plain_references[prompt]
        out = spec.generate(prompt, params, max_new_tokens=NEW_TOKENS, chat=True)
        accepted += out.stats.accepted_tokens
        if out.token_ids != reference:
            first = next(i for i, (a, b) in enumerate(zip(out.token_ids + [-1], reference + [-2])) if a != b)
            mismatches.append(f"{prompt[:40]!r}: differs at token {first}")
    assert not mismatches, f"{len(mismatches)}/{len(prompts)} prompts differ: {mismatches}"
    assert accepted > 0  # speculation really happened


def prompt_lengths(target, prompts) -> list[int]:
    from specdec.engine.request import encode_prompt

    return [len(encode_prompt(target.tokenizer, prompt, target.runner.max_context, True, target.runner.vocab_size))
            for prompt in prompts]


def answered_windows(target, plain_references, prompts) -> list[list[int]]:
    """96-token windows (stride 32) over the chat-formatted prompts and the target's own greedy
    answers to them: self-distillation data for a quick head."""
    from specdec.engine.request import encode_prompt

    stream = []
    for prompt in prompts:
        stream += encode_prompt(target.tokenizer, prompt, target.runner.max_context, True, target.runner.vocab_size)
        stream += plain_references[prompt]
    return [stream[start:start + 96] for start in range(0, len(stream) - 95, 32)]


def quick_head(target, kind, directory, extra_windows: list[list[int]] = (), corpus_windows: int = 6,
               steps: int = 24):
    """A head for the real target trained in a minute on a few windows of the training corpus (a
    narrow layer, an 8k-token head vocabulary): weak, but some of its drafts get accepted, which is
    all greedy equality needs to exercise chains, trees and cache compaction. extra_windows
    (96 tokens each) join the training windows."""
    from specdec.models.heads import HeadConfig, frozen_vocabulary
    from specdec.models.native.reduced_vocab import frequent_token_ids
    from specdec.training.corpus import chat_texts, stdlib_documents, token_chunks
    from specdec.training.train_head import TrainOptions, extract_features, load_features, train_head

    chunks = token_chunks(target.tokenizer, chat_texts(target.tokenizer, stdlib_documents()[:40]), 96,
                          96 * corpus_windows)
    chunks += list(extra_windows)
    vocab_ids = frequent_token_ids(target.tokenizer, 8192, 151936)
    config = HeadConfig.for_target(kind, target.runner.decoder.config, intermediate_size=512,
                                   draft_vocab_size=len(vocab_ids))
    tokens, features, aux = load_features(extract_features(target.runner, chunks, directory / "features",
                                                           progress=False, aux_layers=config.aux_layers or None))
    vocab = frozen_vocabulary(target.runner, target.path, vocab_ids, torch.float32)
    path = directory / f"{kind}.safetensors"
    # Steps of 2 windows: training is most of these tests' time (an EAGLE-3 step unrolls 3 drafts
    # through the 8k-token head: ~7 s a step on one core at 4 windows).
    options = TrainOptions(steps=steps, batch_size=2, lr=2e-3, warmup=4, checkpoint_every=steps, heldout_windows=1)
    train_head(config, vocab, tokens, features, path, options,
               device=torch.device("cpu"), progress=False, log=lambda message: None, aux=aux)
    return path


def quick_heads_fixture(pair_and_answers, tmp_path_factory, self_distilled_prompts=(), store=None, **options):
    """kind -> a quick head's path, trained on first use and shared by the methods that draft with it.

    pair_and_answers() -> ((target, draft), the target's plain answers by prompt), called only when
    a head is trained. self_distilled_prompts: the head also trains (twice over) on the target's own
    answers to these (self-distillation in miniature: 2% of a quick head's drafts were accepted on
    unseen prompts, too few to assert on). options: quick_head's corpus_windows and steps.
    store: pytest's cache (request.config.cache, None without it). A trained head is kept there
    under a key of everything that makes it (quick_head_key), so `make test`'s second pytest run,
    the vLLM test alone, serves the head its first run trained instead of training it again."""
    heads = {}

    def head(kind):
        if kind not in heads:
            kept = None
            if store is not None:
                kept = store.mkdir("quick-heads") / f"{quick_head_key(kind, self_distilled_prompts, options)}.safetensors"
            if kept is not None and kept.is_file():
                heads[kind] = kept
                return kept
            (target, _), answers = pair_and_answers()
            extra = answered_windows(target, answers, self_distilled_prompts) * 2
            heads[kind] = quick_head(target, kind, tmp_path_factory.mktemp(kind), extra_windows=extra, **options)
            if kept is not None:
                partial = kept.with_suffix(".partial")
                shutil.copyfile(heads[kind], partial)
                partial.replace(kept)  # never half a head under the real name
        return heads[kind]

    return head


def quick_head_key(kind, self_distilled_prompts, options) -> str:
    """What a quick head depends on: its settings, the prompts it distils, this CPU's kernel paths
    (they pick the target's format, whose features it learns), and the code that trains and loads it."""
    import specdec
    from specdec.models.cpu_features import supported_isa_caps

    package = Path(specdec.__file__).parent
    sources = [Path(__file__), *sorted((package / "training").glob("*.py")),
               *sorted((package / "models" / "heads").glob("*.py"))]
    digest = hashlib.sha256(repr((kind, list(self_distilled_prompts), sorted(options.items()),
                                  supported_isa_caps())).encode())
    for source in sources:
        digest.update(source.read_bytes())
    return f"{kind}-{digest.hexdigest()[:16]}"
