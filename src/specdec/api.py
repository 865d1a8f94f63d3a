"""The two-line Python API: `llm = specdec.load(...)`, then `llm.generate(...)` / `llm.stream(...)`.

    import specdec
    llm = specdec.load("qwen2.5-coder-1.5b", method="draft", k="auto")
    print(llm.generate("Write fizzbuzz in Python.", chat=True, max_new_tokens=64).text)

In the spirit of vLLM's `LLM(model, speculative_config=...)`: one call builds the engine
from a SpecConfig (inspect it as `llm.config`) through the same factory the CLI and the
server use, so the same options give the same engine whichever door a user takes. The
engine classes (specdec.engine.SpecEngine, the proposers) stay public for researchers:
`llm.engine` is one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

from specdec.config import DEFAULT_TARGET, HeadOptions, SpecConfig
from specdec.proposers.registry import OPTION_GROUPS
from specdec.engine import SpecEngine
from specdec.engine.engine import GenerationResult, StreamChunk
from specdec.sampling import SamplingParams


def _quiet(message: str) -> None:
    pass


class LLM:
    """A target model with its proposer, ready to generate; every output is the target's own
    (greedy: token for token; sampled: exactly its distribution)."""

    def __init__(self, engine: SpecEngine, config: SpecConfig, target, draft=None) -> None:
        self.engine, self.config = engine, config
        self.target, self.draft = target, draft  # models.loader.LoadedModel

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def generate(self, prompt: str | Sequence[int], *, max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
                 stop: Sequence[str] = (), chat: bool = False,
                 params: SamplingParams | None = None) -> GenerationResult:
        """Generate for one prompt (text, or token ids). chat: wrap the text in the model's chat
        template. params: a full SamplingParams instead of the sampling keywords."""
        return self.engine.generate(prompt, self._params(params, temperature, top_k, top_p, min_p, seed),
                                    max_new_tokens=max_new_tokens, stop=stop, chat=chat)

    def stream(self, prompt: str | Sequence[int], *, max_new_tokens: int = 128, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
               stop: Sequence[str] = (), chat: bool = False,
               params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        """As generate, yielding text as each step verifies it; the last chunk carries the stats."""
        return self.engine.stream(prompt, self._params(params, temperature, top_k, top_p, min_p, seed),
                                  max_new_tokens=max_new_tokens, stop=stop, chat=chat)

    @staticmethod
    def _params(params, temperature, top_k, top_p, min_p, seed) -> SamplingParams:
        return params if params is not None else SamplingParams(temperature, top_k, top_p, min_p, seed)

    def __repr__(self) -> str:
        return f"LLM({self.config.summary()} | {self.target.describe()})"


def load(target: str = DEFAULT_TARGET, *, method: str = "auto", k: int | str = "auto", draft: str | None = None,
         head: str | HeadOptions | None = None, config: SpecConfig | None = None, verbose: bool = False,
         **options) -> LLM:
    """Load a target (an embedded model name from `specdec models list` or a local Hugging Face
    directory) with a proposer, and return an LLM.

    method: any of specdec.config.METHODS (`specdec generate --help` lists them), or auto (copy on a
    CPU, ngram on CUDA; the draft model wherever a draft is named). k: tokens drafted per step, or
    "auto". head: a trained head's path (or HeadOptions) for the head methods. options: any other
    SpecConfig field (device, dtype, backend, quantize, draft_quantize, max_k, ...), or a method's
    options by group (ngram=NgramOptions(...), suffix=SuffixOptions(...), copy=CopyOptions(...), ...).
    config: a whole SpecConfig instead of the keywords. verbose: log the loading to stderr.
    """
    if config is None:
        fields = {field.name for field in dataclasses.fields(SpecConfig)} - {"options"}
        unknown = sorted(set(options) - fields - set(OPTION_GROUPS))
        if unknown:
            raise TypeError(f"load() got unknown options {', '.join(unknown)}; SpecConfig has: "
                            f"{', '.join(sorted(fields))}; the methods' option groups: {', '.join(OPTION_GROUPS)}")
        if isinstance(head, str):
            head = HeadOptions(path=head)
        groups = tuple(options.pop(group) for group in list(options) if group in OPTION_GROUPS)
        config = SpecConfig(target=target, method=method, k=k, draft=draft, options=(*groups, head or HeadOptions()),
                            **options)
    from specdec.factory import load_engine, log_to_stderr

    config = config.resolved()
    engine, loaded_target, loaded_draft = load_engine(config, log=log_to_stderr if verbose else _quiet,
                                                      progress=verbose)
    return LLM(engine, config, loaded_target, loaded_draft)
