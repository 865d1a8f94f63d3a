"""EAGLE, Medusa and MLP-speculator heads on the embedded real target (marked `integration`): heads trained here in
seconds, greedy speculative == plain for chains and trees (prompts: real_models.py). EAGLE-3 and
vLLM: test_real_eagle3.py (another test process can run it meanwhile)."""

import pytest

from real_models import CODE_PROMPT, HEAD_CHAIN_PROMPTS, HEAD_TREE_PROMPTS, PROSE_PROMPT, assert_every_prompt_equal, \
    quick_heads_fixture

pytestmark = pytest.mark.integration  # one test process runs this file (conftest.py)


@pytest.fixture(scope="module")
def quick_heads(qwen_pair, plain_references, tmp_path_factory):
    """Quick heads that also saw the target's answers to two of the prompts, so that a minute of
    training is enough for some drafts to be accepted."""
    return quick_heads_fixture(lambda: (qwen_pair, plain_references), tmp_path_factory,
                               self_distilled_prompts=[CODE_PROMPT, PROSE_PROMPT])


@pytest.mark.parametrize("method,prompts", [("eagle", HEAD_CHAIN_PROMPTS), ("eagle-tree", HEAD_TREE_PROMPTS),
                                            ("medusa", HEAD_CHAIN_PROMPTS), ("mlp-speculator", HEAD_CHAIN_PROMPTS)],
                         ids=["eagle", "eagle-tree", "medusa", "mlp-speculator"])
def test_real_target_head_methods_greedy_equal_plain(qwen_pair, plain_references, quick_heads, method, prompts):
    from specdec.models.heads import load_head_for
    from specdec.proposers.head_methods import HeadOptions
    from specdec.proposers.registry import build_proposer, head_kind

    target, _ = qwen_pair
    kind = head_kind(method)
    head, vocabulary = load_head_for(target, kind, quick_heads(kind))
    proposer = build_proposer(method, loaded_head=head, head_vocabulary=vocabulary, head=HeadOptions(tree_size=8))  # chains ignore it
    assert_every_prompt_equal(target, proposer, plain_references, prompts, k=4)
