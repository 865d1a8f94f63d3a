"""EAGLE-3 on the embedded real target (marked `integration`): a head trained here in a few
minutes, greedy speculative == plain as a chain and as a tree (prompts: real_models.py). Served by
vLLM: test_real_vllm.py."""

import pytest

from real_models import CODE_PROMPT, EAGLE3_QUICK_HEAD, LONG_PROMPT, SERVED_PROMPTS, assert_every_prompt_equal, \
    quick_heads_fixture

pytestmark = pytest.mark.integration  # one test process runs this file (conftest.py)


@pytest.fixture(scope="module")
def quick_heads(qwen_pair, plain_references, tmp_path_factory, request):
    """One quick EAGLE-3 head for the chain and the tree, trained mostly on the target's own answers
    to two of the prompts: test_real_vllm.py's head, which its run reads from pytest's cache."""
    return quick_heads_fixture(lambda: (qwen_pair, plain_references), tmp_path_factory,
                               self_distilled_prompts=SERVED_PROMPTS, store=getattr(request.config, "cache", None),
                               **EAGLE3_QUICK_HEAD)


@pytest.mark.parametrize("method,prompts", [("eagle3", SERVED_PROMPTS), ("eagle3-tree", [CODE_PROMPT, LONG_PROMPT])],
                         ids=["eagle3", "eagle3-tree"])
def test_real_target_eagle3_greedy_equals_plain(qwen_pair, plain_references, quick_heads, method, prompts):
    from specdec.models.heads import load_head_for
    from specdec.proposers.head_methods import HeadOptions
    from specdec.proposers.registry import build_proposer

    target, _ = qwen_pair
    head, vocabulary = load_head_for(target, "eagle3", quick_heads("eagle3"))
    proposer = build_proposer(method, loaded_head=head, head_vocabulary=vocabulary, head=HeadOptions(tree_size=8))  # chains ignore it
    assert_every_prompt_equal(target, proposer, plain_references, prompts, k=4)
