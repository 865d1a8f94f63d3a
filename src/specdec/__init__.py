"""specdec: lossless speculative decoding for Hugging Face language models.

A cheap proposer guesses the next k tokens, the target model scores all k+1
positions in one forward pass, and modified rejection sampling (Chen et al. 2023,
arXiv 2302.01318; Leviathan et al. 2022, arXiv 2211.17192) keeps exactly the
target's output distribution.
"""

__version__ = "0.1.0"

from specdec.sampling.params import SamplingParams  # noqa: E402


_LAZY = {"load": "specdec.api", "LLM": "specdec.api", "SpecConfig": "specdec.config"}


def __getattr__(name: str):
    """specdec.load, specdec.LLM and specdec.SpecConfig, imported on first use so that the command
    line's subcommands do not pay for the engine at startup.

        llm = specdec.load("qwen2.5-coder-1.5b", method="draft", k="auto")
        llm.generate("Write fizzbuzz.", chat=True).text
    """
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "SpecConfig", "__version__", "load"]
