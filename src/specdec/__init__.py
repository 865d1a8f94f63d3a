"""specdec: lossless speculative decoding for Hugging Face language models.

A cheap proposer guesses the next k tokens, the target model scores all k+1
positions in one forward pass, and modified rejection sampling (Chen et al. 2023,
arXiv 2302.01318; Leviathan et al. 2022, arXiv 2211.17192) keeps exactly the
target's output distribution.
"""

__version__ = "0.1.0"

from specdec.sampling.params import SamplingParams  # noqa: E402

__all__ = ["SamplingParams", "__version__"]
