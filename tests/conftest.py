"""Tiny random models and a character-level tokenizer, built from configs (no downloads)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import string
import sys

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from specdec.models.hf import HFRunner
from specdec.models.native import DecoderConfig, NativeDecoder, NativeRunner

CHARS = string.ascii_lowercase + " .,!?\n"
EOS = "<eos>"
VOCAB_SIZE = 64  # logits width; the tokenizer uses the first len(CHARS) + 2 ids
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")

# Tiny models run fastest on one thread: thread hand-offs cost more than their matmuls.
torch.set_num_threads(1)


def vector_path_caps() -> dict[str, str | None]:
    """The ONEDNN_MAX_CPU_ISA caps that make specdec's kernels take each path this CPU has: "generic"
    (scalar, under SSE41), "avx2", and "best" (AVX-512) where there is one."""
    from specdec.models.cpu_features import effective_isa

    isa = effective_isa() or ""
    caps: dict[str, str | None] = {"generic": "SSE41"}
    if isa.startswith(("AVX2", "AVX512", "AMX")):
        caps["avx2"] = "AVX2"
    if isa.startswith(("AVX512", "AMX")):
        caps["best"] = None
    return caps


def results_under_caps(script: str, tmp_path, caps: dict[str, str | None]) -> dict:
    """Run `python -c script OUT` once per cap (None: no cap) and load what each run saved at OUT."""
    import os
    import subprocess

    results = {}
    for name, cap in caps.items():
        env = dict(os.environ)
        env.pop("ONEDNN_MAX_CPU_ISA", None)
        if cap:
            env["ONEDNN_MAX_CPU_ISA"] = cap
        path = tmp_path / f"{name}.pt"
        subprocess.run([sys.executable, "-c", script, str(path)], env=env, check=True, timeout=300)
        results[name] = torch.load(path)
    return results


def make_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, EOS: 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    # BPE with no merges = one token per character; Fuse joins them back without spaces.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token=EOS)


def make_other_tokenizer() -> PreTrainedTokenizerFast:
    """make_tokenizer's characters at other ids (reversed): a draft with another tokenizer."""
    vocab = {"<unk>": 0, EOS: 1, **{c: len(CHARS) + 1 - i for i, c in enumerate(CHARS)}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token=EOS)


def make_model(seed: int, family: str = "qwen2", layers: int = 2, hidden: int = 32, random_bias: bool = False,
               **extra) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=1, **extra,
    )
    model = Qwen2ForCausalLM(Qwen2Config(**common)) if family == "qwen2" else LlamaForCausalLM(LlamaConfig(**common))
    # Random init gives near-uniform logits; sharpen them so greedy paths and
    # acceptance are not decided by round-off.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
        for name, parameter in model.named_parameters():
            if random_bias and name.endswith("bias"):  # transformers initialises biases to zero
                parameter.normal_(0.0, 0.5)
    return model.eval()


def make_peaked_model(seed: int, layers: int = 2) -> torch.nn.Module:
    """make_model with top-1 mass ~0.3-0.4, like a real LM's on prose: sampled continuations repeat
    (so drafts from them get accepted) while sampling still spreads over several tokens."""
    model = make_model(seed=seed, layers=layers)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(2.5)
    return model


def save_tiny_pair(root) -> dict[str, str]:
    """A tiny target and one-layer draft saved as Hugging Face directories under root (with the
    chat tokenizer), for the commands that load models by path: {"target": path, "draft": path}."""
    tokenizer = make_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    paths = {}
    for name, seed, layers in (("target", 0, 2), ("draft", 1, 1)):
        make_model(seed=seed, layers=layers).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        paths[name] = str(root / name)
    return paths


def make_native(model: torch.nn.Module, *, dtype: torch.dtype = torch.float32, quantize: str = "none",
                head_rows: torch.Tensor | None = None, batch_size: int = 1, **runner_options) -> NativeRunner:
    """The native runner over the same weights as a transformers model."""
    config = DecoderConfig.from_hf(model.config.to_dict())
    decoder = NativeDecoder.from_state_dict(config, dict(model.state_dict()), dtype=dtype,
                                            device=torch.device("cpu"), quantize=quantize, head_rows=head_rows)
    return NativeRunner(decoder, batch_size=batch_size, head_rows=head_rows, **runner_options)


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer()


@pytest.fixture
def target_runner() -> HFRunner:
    return HFRunner(make_model(seed=0))


@pytest.fixture
def draft_runner() -> HFRunner:
    return HFRunner(make_model(seed=1, layers=1))


# Longest first, so that two test processes (`make test`: pytest-xdist) finish together: the
# integration files (the real models; each loads the pair once per process), then the real-shape
# ISA probes (a subprocess each), then the unit tests on tiny models.
HEAVY_FIRST = ("test_real_vllm.py", "test_real_eagle3.py", "test_real_heads.py", "test_real_methods.py",
               "test_invariance.py")
ISA_PROBES = ("under_every_isa_cap[", "runs_the_kernels_its_stand_in_runs[")  # test_invariance.py's subprocesses


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Each test file in one test process, as its module fixtures (a pair of real models, a live
    server) and some tests' order expect; the real-shape ISA probes, one subprocess each, spread
    one by one."""
    from xdist.scheduler import LoadScopeScheduling

    class FilesTogetherIsaProbesApart(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return nodeid if any(probe in nodeid for probe in ISA_PROBES) else nodeid.split("::", 1)[0]

    config.option.loadscopereorder = False  # keep pytest_collection_modifyitems' order: longest first
    return FilesTogetherIsaProbesApart(config, log)


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return HEAVY_FIRST.index(name) if name in HEAVY_FIRST else len(HEAVY_FIRST)

    items.sort(key=rank)  # stable: each file keeps its own order


# The embedded real models for the integration files (tests/test_real_*.py): here, not in
# real_models.py, so that session scope means once per test process, not once per file.
@pytest.fixture(scope="session")
def qwen_pair():
    from real_models import load_pair

    return load_pair()


@pytest.fixture(scope="session")
def plain_references(qwen_pair) -> dict[str, list[int]]:
    """The target's plain greedy answer to every prompt of real_models.py (computed once)."""
    from real_models import plain_answers

    return plain_answers(qwen_pair[0])


# glibc's, to hand freed heap pages back to the OS (None elsewhere).
MALLOC_TRIM = getattr(ctypes.CDLL(ctypes.util.find_library("c")), "malloc_trim", None) if sys.platform == "linux" else None


@pytest.fixture(autouse=True)
def _return_freed_memory_after_real_models(request):
    """After each integration test, hand the memory its models freed back to the OS: glibc keeps
    freed heap pages (GBs after a transformers load), and two test processes share 24 GB."""
    yield
    if request.node.get_closest_marker("integration") is not None:
        gc.collect()
        if MALLOC_TRIM is not None:
            MALLOC_TRIM(0)


def pytest_terminal_summary(terminalreporter):
    """Say which oneDNN ISA caps the real-shape invariance tests ran under (tests/models/test_invariance.py),
    read from the passed reports, so that it holds when pytest-xdist ran them in other processes."""
    passed = terminalreporter.stats.get("passed", [])

    def caps(probe: str) -> list[str]:
        return [report.nodeid.rsplit("[", 1)[1].rstrip("]").replace("-", "/").removesuffix("/none")
                for report in passed if probe in report.nodeid]

    in_full, stood_in = caps(ISA_PROBES[0]), caps(ISA_PROBES[1])
    if not in_full:
        return
    from specdec.models.cpu_features import ISA_CAPS, cpu_model, supported_isa_caps

    missing = [cap for cap in ISA_CAPS if cap not in supported_isa_caps()]
    terminalreporter.write_line(f"invariance at real shapes on {cpu_model()}: passed under ONEDNN_MAX_CPU_ISA "
                                f"{', '.join(in_full)}"
                                + (f"; the same kernels as a cap above under {', '.join(stood_in)}" if stood_in
                                   else "")
                                + f"; not on this CPU: {', '.join(missing) or 'none'}")


def run_all(engine, requests: dict, errors: dict | None = None) -> dict:
    """Run a BatchEngine: admit requests whenever a row is free (continuous batching); collect
    each request's tokens and finish reason (and, into errors if given, each one's RowUpdate.error)."""
    waiting, out = list(requests.items()), {handle: [] for handle in requests}
    reasons, widest = {}, 0
    while waiting or engine.running:
        while waiting and engine.free_slots:
            engine.add(*waiting.pop(0))
        widest = max(widest, engine.running)
        for update in engine.step():
            out[update.handle] += update.token_ids
            if update.finish_reason:
                reasons[update.handle] = update.finish_reason
                if errors is not None:
                    errors[update.handle] = update.error
    assert widest == min(engine.slots, len(requests))  # requests really ran side by side
    return {handle: (out[handle], reasons[handle]) for handle in requests}
