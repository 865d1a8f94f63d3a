"""Plain decoding and the methods asked for (the default, the draft model, ngram+draft unless told
otherwise), interleaved on 8 prompts.

Four free-text prompts (a story, a translation, a word problem, an explanation) and four that
copy their input (a code edit, an extraction, a question over a context, a summary), greedy, 128
new tokens, every engine on one loaded target (and one draft), prompt by prompt in alternating
order so that a slow minute of the machine falls on all of them. Prints each method's median
decode tok/s against plain per group, tau (tokens per target forward) and whether its tokens equal
plain decoding's. Which method the default should be is read from this kind of table.

    python benchmarks/methods_free_vs_copy.py [--max-new-tokens 128] [--repeats 2]
        [--methods default,draft,ngram+draft,copy,copy+draft,draft:learned] [--draft smollm2-135m]

A method followed by `:RULE` drafts with `--draft-stop RULE` (threshold, learned or a rule file), by
`:P` (a number) with `--draft-confidence P`.
"""

from __future__ import annotations

import argparse
import statistics

from specdec.config import SpecConfig
from specdec.factory import engine_for, load_models, plain_engine
from specdec.proposers.draft_model import DraftOptions
from specdec.sampling import SamplingParams

FREE = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Translate to French: The weather was cold, so we stayed inside and read books all afternoon.",
        "A train leaves at 3pm going 60 mph; another leaves at 4pm going 80 mph. When does the second catch up? "
        "Explain step by step.",
        "Explain how a hash map works to a new programmer."]
COPY = ["Rename the variable `lst` to `items` and `res` to `result` in this function, and return the whole "
        "function:\n\ndef dedupe(lst):\n    res = []\n    seen = set()\n    for x in lst:\n        if x not in seen:\n"
        "            seen.add(x)\n            res.append(x)\n    return res\n",
        "Extract every person and the date they joined as a JSON list of {name, joined}: Maria Lopez joined the team "
        "on 3 March 2021. Two months later, on 12 May 2021, Kenji Sato arrived from the Osaka office. The newest "
        "member, Priya Raman, started on 9 January 2023.",
        "Context: The Eiffel Tower was completed in 1889 for the World's Fair in Paris. It is 330 metres tall and was "
        "the tallest man-made structure in the world until 1930, when the Chrysler Building in New York surpassed it. "
        "Gustave Eiffel's company designed and built it.\nQuestion: Who built the Eiffel Tower, when was it finished, "
        "and what surpassed its height? Answer using the context.",
        "Summarize in three sentences: Speculative decoding speeds up language model inference by letting a cheap "
        "proposer guess several tokens that the large model then checks in one forward pass. Tokens that agree with "
        "the large model are kept, and the first disagreement is replaced by the large model's own choice, so the "
        "output is exactly what the large model alone would produce. The speedup depends on how often the guesses "
        "are right and on how cheap it is to check many tokens at once."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="passes over the prompts (medians over all)")
    parser.add_argument("--methods", default="default,draft,ngram+draft",
                        help="comma-separated: `default` (method auto, no draft model) or any --method name, "
                             "NAME:RULE for --draft-stop RULE, NAME:P for --draft-confidence P")
    parser.add_argument("--draft", default=None, help="the draft model (default: the embedded 0.5B; "
                        "smollm2-135m: one with another tokenizer)")
    args = parser.parse_args()
    target, draft = load_models(SpecConfig(method="draft", draft=args.draft), need_draft=True)
    engines = {"plain": plain_engine(target)}
    for name in args.methods.split(","):
        method, _, stop = name.partition(":")
        threshold = stop.replace(".", "", 1).isdigit()  # NAME:0.6: the confidence threshold 0.6
        options = (DraftOptions(stop=stop),) if stop and not threshold else ()
        confidence = float(stop) if threshold else SpecConfig.draft_confidence
        config = SpecConfig().resolved("cpu") if name == "default" else \
            SpecConfig(method=method, draft=args.draft, options=options, draft_confidence=confidence)
        engines[name] = engine_for(config, target, draft if config.needs_draft_model else None)
    prompts = (FREE + COPY) * args.repeats
    for engine in engines.values():  # a forward of a new width pays one-off setup costs: not in the medians
        for prompt in (FREE[1], COPY[0]):
            engine.generate(prompt, SamplingParams(), max_new_tokens=48, chat=True)
    rates = {name: [] for name in engines}
    taus = {name: [] for name in engines}
    tokens = {}
    for index, prompt in enumerate(prompts):
        for name in (list(engines) if index % 2 == 0 else list(reversed(engines))):
            engines[name].forget_earlier_requests()  # every prompt held out: no earlier answer to copy from
            result = engines[name].generate(prompt, SamplingParams(), max_new_tokens=args.max_new_tokens, chat=True)
            # Decode only: the engines share one target, whose prompt cache lets the second to run a
            # prompt skip most of its prefill (a draft model's reading of the prompt is decode time).
            rates[name].append(result.stats.generated_tokens / result.stats.decode_time_s)
            taus[name].append(result.stats.generated_tokens / max(result.stats.target_forwards, 1))
            tokens[name, index % len(FREE + COPY)] = result.token_ids
    print(f"{'method':12s} {'free':>6s} {'copy':>6s} {'all':>6s} {'tau':>5s}  identical to plain")
    free = [index % len(FREE + COPY) < len(FREE) for index in range(len(prompts))]
    for name in engines:
        ratios = [rate / plain for rate, plain in zip(rates[name], rates["plain"])]
        same = sum(tokens[name, index] == tokens["plain", index] for index in range(len(FREE + COPY)))
        by_group = [statistics.median(r for r, is_free in zip(ratios, free) if is_free == group) for group in (True, False)]
        print(f"{name:12s} {by_group[0]:5.2f}x {by_group[1]:5.2f}x {statistics.median(ratios):5.2f}x "
              f"{statistics.median(taus[name]):5.2f}  {same}/{len(FREE + COPY)}")
        for index, prompt in enumerate(FREE + COPY):  # each prompt's median over the repeats
            mine = [r for i, r in enumerate(ratios) if i % len(FREE + COPY) == index]
            print(f"    {statistics.median(mine):5.2f}x  {prompt[:60]!r}")


if __name__ == "__main__":
    main()
