"""The batched engine on the embedded real models (marked `integration`): requests decoded side by
side, each one's output its plain greedy output alone (prompts: real_models.py)."""

import pytest

from real_models import NEW_TOKENS, SHORT_PROMPTS, WITH_LONG_PROMPT
from specdec.sampling import SamplingParams

pytestmark = pytest.mark.integration  # one test process runs this file (conftest.py)


@pytest.mark.parametrize("method,k,prefill_chunk,prompts", [("draft", 4, None, WITH_LONG_PROMPT),
                                                            ("ngram", 4, None, SHORT_PROMPTS),
                                                            ("suffix", 4, None, SHORT_PROMPTS),
                                                            ("ngram+draft", "auto", 96, WITH_LONG_PROMPT)],
                         ids=["draft", "ngram", "suffix", "ngram+draft-chunked-goodput"])
def test_real_pair_batched_engine_equals_each_request_alone(qwen_pair, plain_references, method, k, prefill_chunk,
                                                            prompts):
    """The requests decoded side by side in one batched engine (ragged lengths, the long prompt
    among them where the draft model's rows grow with it): each one's output is its plain greedy
    output alone. The last case is the server's other paths on the real quantized kernels: prompts
    prefilled 96 tokens per step (chunked prefill, while other rows decode) and the step's k chosen
    by goodput."""
    from specdec.engine.batch import BatchEngine
    from specdec.proposers.registry import build_batch_proposer

    target, draft = qwen_pair
    slots = len(prompts)
    runner = target.runner.with_batch_size(slots, initial_cache_len=1536)
    draft_runner = draft.runner.with_batch_size(slots, initial_cache_len=1536)
    engine = BatchEngine(runner, build_batch_proposer(method, slots=slots, draft_runner=draft_runner),
                         target.tokenizer, k=k, eos_token_ids=target.eos_token_ids, prefill_chunk=prefill_chunk)
    params = SamplingParams(temperature=0)
    outputs = {index: [] for index in range(slots)}
    for index, prompt in enumerate(prompts):
        engine.add(index, engine.make_request(prompt, params, max_new_tokens=NEW_TOKENS, chat=True))
    widest = 0
    while engine.running:
        widest = max(widest, engine.running)
        for update in engine.step():
            outputs[update.handle] += update.token_ids
    assert widest == slots
    for index, prompt in enumerate(prompts):
        assert outputs[index] == plain_references[prompt], f"request {index} ({prompt[:40]!r}) differs"
