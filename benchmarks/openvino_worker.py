"""One OpenVINO GenAI pipeline, serving generation requests as JSON lines (benchmarks/openvino_peer.py).

Runs in OpenVINO's own virtualenv (it imports openvino_genai, never specdec):

  VENV/bin/python benchmarks/openvino_worker.py --mode plain|speculative|lookup --target DIR [--draft DIR]
      [--threads N] [--assistant-tokens K] [--max-ngram 3]

then reads one request a line on stdin ({"text", "max_new_tokens", "temperature", "top_p", "seed"})
and answers each with one line: {"token_ids", "tokens", "decode_tok_s", "ttft_s", "prompt_tokens"}
or {"error"}. The text is already chat-formatted: it is encoded without special tokens and the
pipeline's own chat template is off, so both engines read the same tokens. Decode speed is the
pipeline's own time per output token (perf_metrics' TPOT), as llama.cpp's perf lines give its.
A "ready" line goes out once the pipeline is loaded and has run one short warm-up generation.
"""

from __future__ import annotations

import argparse
import json
import sys


def pipeline(args):
    import openvino_genai as ov_genai

    options = {"INFERENCE_NUM_THREADS": args.threads}
    if args.mode == "speculative":
        draft = ov_genai.draft_model(args.draft, "CPU", INFERENCE_NUM_THREADS=args.threads)
        return ov_genai.LLMPipeline(args.target, "CPU", draft_model=draft, **options)
    if args.mode == "lookup":
        return ov_genai.LLMPipeline(args.target, "CPU", prompt_lookup=True, **options)
    return ov_genai.LLMPipeline(args.target, "CPU", **options)


def generate(pipe, args, request: dict) -> dict:
    import openvino_genai as ov_genai

    config = ov_genai.GenerationConfig()
    config.max_new_tokens = request["max_new_tokens"]
    config.apply_chat_template = False
    config.ignore_eos = False
    temperature = request.get("temperature", 0.0)
    if temperature > 0:
        config.do_sample = True
        config.temperature = temperature
        config.top_p = request.get("top_p", 1.0)
        config.top_k = 0
        config.rng_seed = request.get("seed", 1)
    else:
        config.do_sample = False
    if args.mode in ("speculative", "lookup"):
        config.num_assistant_tokens = args.assistant_tokens
    if args.mode == "lookup":
        config.max_ngram_size = args.max_ngram
    encoded = pipe.get_tokenizer().encode(request["text"], add_special_tokens=False)
    prompt_tokens = int(encoded.input_ids.get_shape()[1])
    result = pipe.generate(encoded, config)
    token_ids = [int(t) for t in result.tokens[0]]
    perf = result.perf_metrics
    tpot_ms = perf.get_tpot().mean
    return dict(token_ids=token_ids, tokens=len(token_ids), prompt_tokens=prompt_tokens,
                decode_tok_s=1e3 / tpot_ms if tpot_ms > 0 else None, ttft_s=perf.get_ttft().mean / 1e3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("plain", "speculative", "lookup"), required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--assistant-tokens", type=int, default=8)
    parser.add_argument("--max-ngram", type=int, default=3)
    args = parser.parse_args()
    pipe = pipeline(args)
    # The first generation pays for compiling the model's shapes: not any prompt's time to first token.
    generate(pipe, args, dict(text="def hello():", max_new_tokens=4))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            answer = generate(pipe, args, json.loads(line))
        except Exception as error:  # noqa: BLE001 - one failed request must not end the worker
            answer = {"error": f"{type(error).__name__}: {error}"}
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
