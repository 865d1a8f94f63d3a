"""An EAGLE-3 head trained here, exported by `specdec export-head` and served by vLLM's CPU build
(marked `integration` and `vllm`). `make test` runs it alone after the rest: vLLM's server holds
~11 GB in float32 (its weights twice), which does not fit beside two test processes in 24 GB."""

import os

import pytest
import torch

from real_models import EAGLE3_QUICK_HEAD, SERVED_PROMPTS, load_pair, plain_answers, quick_heads_fixture
from specdec.models.hub import resolve_model_path
from specdec.models.loader import load_model

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


@pytest.fixture(scope="module")
def every_core():
    """Alone on the machine: this file's own work (load, answers, training) on every core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def quick_heads(every_core, tmp_path_factory, request):
    """test_real_eagle3.py's quick EAGLE-3 head: read from pytest's cache where `make test`'s first
    run left it, else trained here (the pair loaded only then)."""
    def pair_and_answers():
        pair = load_pair()
        return pair, plain_answers(pair[0], SERVED_PROMPTS)

    return quick_heads_fixture(pair_and_answers, tmp_path_factory, self_distilled_prompts=SERVED_PROMPTS,
                               store=getattr(request.config, "cache", None), **EAGLE3_QUICK_HEAD)


def test_vllm_serves_an_exported_eagle3_head(quick_heads, tmp_path_factory):
    """Train here, serve at scale: an EAGLE-3 head trained on the real target, written by
    `specdec export-head` in the speculators layout, served by vLLM's CPU build (`make vllm`)
    with --speculative-config method eagle3 (in float32). vLLM must report accepted draft tokens,
    and each of its greedy tokens must be the target's argmax under specdec's unquantized float32
    forward, or trail it by no more than rounding (vLLM's kernels are not specdec's; see
    bench/vllm_peer.py). On the AVX2 EPYC its output equalled specdec's plain output exactly."""
    from pathlib import Path

    from specdec.bench.vllm_peer import chat_completion_ids, greedy_agreement, spec_decode_counters, vllm_python, \
        vllm_server
    from specdec.cli import main

    target_path = resolve_model_path("qwen2.5-coder-1.5b", progress=False)
    python = vllm_python(Path(__file__).resolve().parents[1])
    exported = tmp_path_factory.mktemp("speculators") / "head"
    assert main(["export-head", "--head", str(quick_heads("eagle3")), "--out", str(exported),
                 "--speculative-tokens", "3"]) == 0
    config = '{"method": "eagle3", "model": "%s", "num_speculative_tokens": 3}' % exported
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    # 1 GiB of KV cache holds 4 x 1,024 tokens ~4 times over (the default is 4). Eager: the test
    # checks what vLLM serves, not its speed (its torch.compile warm-up took 2.5 minutes).
    with vllm_server(target_path, python=python, log_path=log, speculative_config=config, kv_cache_gib=1,
                     enforce_eager=True) as url:
        answers = [chat_completion_ids(url, str(target_path), prompt, max_tokens=64) for prompt in SERVED_PROMPTS]
        counters = spec_decode_counters(url)
    reference = load_model("qwen2.5-coder-1.5b", device="cpu", dtype="float32", quantize="none", progress=False)
    for prompt, (prompt_ids, output_ids) in zip(SERVED_PROMPTS, answers):
        agreement = greedy_agreement(reference.runner, prompt_ids, output_ids)
        assert agreement.tokens >= 16 and agreement.within(0.05), (prompt, agreement)
    # 28% of 141 drafts were accepted on the AVX2 EPYC (specdec's rate for such a head is similar).
    assert counters["num_draft_tokens"] > 0, counters
    assert counters["num_accepted_tokens"] >= 0.05 * counters["num_draft_tokens"], counters
