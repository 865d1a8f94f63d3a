"""An EAGLE-3 head trained here, exported by `specdec export-head` and served by vLLM's CPU build
(marked `integration` and `vllm`). `make test` runs it alone after the rest: vLLM's server holds
~11 GB in float32 (its weights twice), which does not fit beside two test processes in 24 GB.
An exported MLP speculator's config is read by vLLM's own class; vLLM does not serve that method."""

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


READ_MLP_SPECULATOR = """
import json, sys
from vllm.model_executor.models.registry import ModelRegistry
from vllm.transformers_utils.configs.mlp_speculator import MLPSpeculatorConfig
config = MLPSpeculatorConfig.from_pretrained(sys.argv[1])
print(json.dumps({"read": [config.n_predict, config.emb_dim, config.inner_dim, config.vocab_size],
                  "served": "MLPSpeculatorPreTrainedModel" in ModelRegistry.get_supported_archs()}))
"""


def test_vllm_reads_an_exported_mlp_speculator_but_does_not_serve_it(tmp_path):
    """`specdec export-head --kind mlp-speculator`'s layout is the one vLLM's MLPSpeculatorConfig reads
    (a tiny head here: the format, not the model, is under test). vLLM 0.32 keeps the model out of its
    registry until its V1 engine supports it, so no vLLM serves it here: when a release does, this
    test fails, and the head should be served as the EAGLE-3 one is above."""
    import json
    import subprocess
    from pathlib import Path

    from conftest import make_model, make_native
    from specdec.bench.vllm_peer import vllm_python
    from specdec.models.heads import FrozenVocabulary, HeadConfig, LoadedHead, build_head
    from specdec.models.heads.mlp_speculator_export import export_mlp_speculator

    target = make_native(make_model(seed=3))
    config = HeadConfig.for_target("mlp-speculator", target.decoder.config, mlp_stages=3, draft_vocab_size=64)
    module = build_head(config)
    vocab = FrozenVocabulary.with_output_rows(target.decoder.embedding, module.output.weight, torch.arange(64))
    out = export_mlp_speculator(LoadedHead(config, module, torch.arange(64), {}), vocab, tmp_path / "mlp")
    python = vllm_python(Path(__file__).resolve().parents[1])
    done = subprocess.run([str(python), "-c", READ_MLP_SPECULATOR, str(out)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    hidden = target.decoder.config.hidden_size
    assert report["read"] == [3, hidden, hidden, 64]
    assert report["served"] is False
