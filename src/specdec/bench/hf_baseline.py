"""transformers' own generate(), plain and assisted: the baseline specdec is measured against."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch


def hf_generate(model, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int, assistant=None,
                k: int | None = None) -> tuple[list[int], float, None]:
    """Greedy model.generate(); returns (new token ids, seconds, None).

    With an assistant and k, a constant k with no confidence-based early stop:
    the same algorithm as specdec's fixed k. With an assistant and no k,
    transformers' defaults (its dynamic schedule), which is what users get.
    """
    input_ids = torch.as_tensor(prompt_ids).reshape(1, -1)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False)
    if assistant is not None:
        if k is not None:
            assistant.generation_config.num_assistant_tokens = k
            assistant.generation_config.num_assistant_tokens_schedule = "constant"
            assistant.generation_config.assistant_confidence_threshold = 0.0
        kwargs["assistant_model"] = assistant
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
    return out[0, input_ids.shape[1]:].tolist(), time.perf_counter() - started, None
