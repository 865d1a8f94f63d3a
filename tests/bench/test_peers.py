"""The peer benchmark's parsing: llama.cpp's own timing lines, and specdec configuration strings."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import llama_cpp_peer as llama_cpp  # noqa: E402
import peers  # noqa: E402

COMPLETION_LOG = """\
0.07.068.379 I common_perf_print:        load time =    2241.21 ms
0.07.068.394 I common_perf_print: prompt eval time =     472.78 ms /    42 tokens (   11.26 ms per token,    88.84 tokens per second)
0.07.068.408 I common_perf_print:        eval time =    3847.48 ms /   127 runs   (   30.30 ms per token,    33.01 tokens per second)
"""
SPECULATIVE_LOG = """\
0.37.775.824 I encoded   42 tokens in    8.072 seconds, speed:    5.203 t/s
0.37.775.848 I decoded  129 tokens in   23.496 seconds, speed:    5.490 t/s
0.37.775.923 I n_accept  = 111
0.37.775.938 I accept    = 81.618%
0.37.775.945 I common_perf_print: prompt eval time =   31215.22 ms /   195 tokens (  160.08 ms per token,     6.25 tokens per second)
0.37.775.946 I common_perf_print:        eval time =       0.00 ms /     1 runs   (    0.00 ms per token,      inf tokens per second)
"""


def test_plain_timings_come_from_the_perf_lines():
    timings = llama_cpp.run_timings("plain", COMPLETION_LOG)
    assert timings["prompt_tokens"] == 42 and timings["tokens"] == 128  # the first token comes from the prompt
    assert timings["decode_tok_s"] == pytest.approx(127 / 3.84748)
    assert timings["ttft_s"] == pytest.approx(0.47278)


def test_speculative_timings_come_from_the_example_summary_not_the_target_perf_lines():
    timings = llama_cpp.run_timings("speculative", SPECULATIVE_LOG)
    assert timings["prompt_tokens"] == 42 and timings["tokens"] == 129
    assert timings["decode_tok_s"] == pytest.approx(129 / 23.496)
    assert timings["acceptance"] == pytest.approx(0.81618)


def test_a_crashed_run_has_no_timings():
    assert llama_cpp.run_timings("plain", "Segmentation fault (core dumped)\n") is None
    assert llama_cpp.run_timings("lookup", COMPLETION_LOG) is None


def test_specdec_configurations_parse():
    assert peers.parse_config("fast=draft:k=auto,quantize=w8a8") == ("fast", "draft", "auto", "w8a8")
    assert peers.parse_config("plain=autoregressive") == ("plain", "autoregressive", 4, "none")
    with pytest.raises(ValueError, match="unknown option"):
        peers.parse_config("x=draft:k=4,colour=red")


def test_openvino_speculative_modes_are_checked_against_its_own_plain_output():
    def row(config, prompt, ids):
        return dict(config=config, prompt=prompt, category="code", temperature=0, tokens=len(ids),
                    decode_tok_s=10.0, ttft_s=1.0, token_ids=ids)

    rows = [row("llama.cpp plain", "a", [1, 2, 3]), row("openvino plain", "a", [1, 2, 3]),
            row("openvino plain", "b", [4, 5]), row("openvino lookup", "a", [1, 2, 3]),
            row("openvino lookup", "b", [4, 6])]
    summary = peers.summarise(rows)
    assert "openvino lookup: 1/2 outputs identical to OpenVINO's plain decoding" in summary
    assert "openvino plain: " not in summary
