"""specdec serve: the OpenAI-compatible server (parser and handler; cli.py owns the shared options)."""

from __future__ import annotations

import os
import sys

EPILOG_SERVE = """\
examples:
  specdec serve                                        # the embedded target, auto method (copy on a CPU,
                                                       #   ngram on CUDA), k per step by goodput, port 8000
  specdec serve --method draft --port 8001             # the embedded pair: the 0.5B draft drafts
  specdec serve --method eagle3-tree --head ./my-eagle3 --tree-size 8   # a trained EAGLE-3 head, its trees
  specdec serve --method autoregressive                # the same server without speculation (a baseline)
  specdec serve --target ./my-llama-3b --draft ./my-llama-1b --max-batch 16 --served-model-name llama

then, from any OpenAI client:
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"model": "qwen2.5-coder-1.5b", "messages": [{"role": "user", "content": "Write fizzbuzz"}]}'
  python -c "import openai; c = openai.OpenAI(base_url='http://127.0.0.1:8000/v1', api_key='-'); \\
             print(c.completions.create(model='qwen2.5-coder-1.5b', prompt='def fib(n):', max_tokens=64))"
  # a request's own method and k (k 0: plain decoding), among GET /v1/models' speculative.methods:
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
       -d '{"model": "qwen2.5-coder-1.5b", "prompt": "def fib(n):", "speculative": {"method": "suffix", "k": 6}}'

Endpoints: POST /v1/completions, POST /v1/chat/completions (stream: true for
server-sent events), GET /v1/models, GET /health, GET /metrics (Prometheus).
Requests from many clients are decoded together, up to --max-batch at once;
up to --max-queue more wait for a row, and past that the server answers 429.
Each response has `usage` and `speculative` (drafted / accepted tokens, mean
accepted length). Output is lossless: exactly the target's distribution.
"""


def add_serve_command(sub) -> None:
    import argparse

    from specdec.cli_options import add_method_args, add_model_args, positive_int
    from specdec.proposers.registry import BESIDE_ANY_METHOD, RUNS_ALONE

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with speculative decoding and batching",
                           epilog=EPILOG_SERVE, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(serve)
    add_method_args(serve, adaptive=False)  # the batched engine drafts a fixed k
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1; 0.0.0.0 "
                                                           "exposes the server to your network)")
    serve.add_argument("--port", type=int, default=8000, help="default: 8000")
    serve.add_argument("--max-batch", type=positive_int, default=8,
                       help="requests decoded together, one KV-cache row each (default: 8)")
    serve.add_argument("--max-queue", type=int, default=64,
                       help="requests that may wait for a free row; past it the answer is 429 (default: 64)")
    serve.add_argument("--spec-max-batch", default="auto", metavar="N|auto",
                       help="with a fixed -k: draft only while at most N requests run; larger batches decode "
                            "plainly, as vLLM's speculative_disable_by_batch_size does. A batch fills a CPU's cores "
                            "from a few rows on, and then rejected drafts cost time (benchmarks/RESULTS.md). auto "
                            "(default): 1 on CPU, no limit on CUDA. -k auto (the default) decides per step instead")
    serve.add_argument("--max-context", type=positive_int, default=None,
                       help="cap on prompt + completion tokens per request (default: the target's context)")
    serve.add_argument("--default-max-tokens", type=positive_int, default=256,
                       help="chat completions without max_tokens stop here (default: 256; completions follow "
                            "OpenAI's 16)")
    serve.add_argument("--served-model-name", default=None,
                       help="the name clients pass as `model` (default: the --target argument)")
    serve.add_argument("--lenience", type=float, default=1.0, metavar="L",
                       help="every request's lenience: LOSSY below 1 (Leviathan et al., Appendix A.5), drafts are "
                            "accepted more easily and the output drifts from the target's; /v1/models and each "
                            "response's `speculative` block say so (default: 1 = exact)")
    serve.add_argument("--prefill-chunk", type=int, default=256, metavar="N",
                       help="chunked prefill: a newcomer's prompt is read N tokens per step, between the running "
                            "requests' decode steps, so a long prompt does not stall every stream for its whole "
                            "length (default: 256; 0 = whole prompts at once). Output is unchanged, bit for bit")
    serve.add_argument("--no-prompt-cache", dest="prompt_cache", action="store_false",
                       help="forget each request's cache when it finishes. By default a finished request's row "
                            "stays in a free slot, and a later prompt that begins with its tokens (a chat's next "
                            "turn, an agent's next call) reads only the rest: same output, bit for bit, less "
                            "prefill (usage.prompt_tokens_details.cached_tokens says how much)")
    _add_tenant_options(serve)
    serve.add_argument("--request-methods", default="auto", metavar="LIST|auto|none",
                       help="the methods a request may choose besides --method, in the body's `speculative` "
                            "object (e.g. {\"speculative\": {\"method\": \"ngram\", \"k\": 4}}; k 0 = plain): "
                            f"auto (default) = every one that needs no model but the target ({', '.join(BESIDE_ANY_METHOD)}; "
                            f"none beside {', '.join(RUNS_ALONE)}), none = --method only, or a "
                            "comma-separated list. Each is built when first asked for; the output is the same "
                            "whichever a request picks, only its speed changes")
    limits = serve.add_argument_group("limits (docs/security.md): what one request may cost")
    limits.add_argument("--max-body-mb", type=float, default=4.0, metavar="MB",
                        help="a larger request body gets 413 before it is parsed (default: 4)")
    limits.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                        help="a client pausing longer than S seconds while sending its body gets 408 (default: 30)")
    limits.add_argument("--max-prompt-chars", type=positive_int, default=None, metavar="N",
                        help="a longer prompt (or chat, its messages' text) gets 400 before it is tokenized "
                             "(default: 32 per token of the context)")
    limits.add_argument("--max-tokens-cap", type=positive_int, default=None, metavar="N",
                        help="max_tokens above N gets 400; requests without max_tokens stop at N (default: the "
                             "context)")
    limits.add_argument("--request-deadline", type=float, default=600.0, metavar="S",
                        help="a request still running S seconds after it arrived fails with 504 and frees its "
                             "row (default: 600; 0 = none)")
    limits.add_argument("--max-stop-chars", type=positive_int, default=1000, metavar="N",
                        help="each stop string at most N characters, all of them 4N (default: 1000)")
    limits.add_argument("--limit-concurrency", type=positive_int, default=None, metavar="N",
                        help="open connections past N get 503 from uvicorn (default: 2 x (max-batch + max-queue) "
                             "+ 16)")
    limits.add_argument("--timeout-keep-alive", type=float, default=5.0, metavar="S",
                        help="an idle keep-alive connection closes after S seconds (default: 5, uvicorn's)")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def _add_tenant_options(serve) -> None:
    """Who may call the server, and whose caches a request may share (docs/security.md)."""
    serve.add_argument("--api-key", action="append", default=None, metavar="KEY",
                       help="require `Authorization: Bearer KEY` on /v1 routes (and /metrics): others get 401. "
                            "Repeat it to give each client its own key: each key is a tenant, and the prompt cache "
                            "and suffix decoding's cache are shared only within one. Default: $SPECDEC_API_KEY, "
                            "else none (anyone who reaches the port may use it, and every client shares the caches)")
    serve.add_argument("--tenant-header", default=None, metavar="NAME",
                       help="split tenants further by this request header (e.g. X-Tenant), which a proxy you trust "
                            "must set: a client that can set it itself can pick any tenant")
    serve.add_argument("--shared-cache", action="store_true",
                       help="one prompt cache and suffix cache for every client, whatever its key: faster for one "
                            "trusted team, but a client can tell from cached_tokens, its time to first token and "
                            "the acceptance counts how much of another's conversation its prompt repeats")
    serve.add_argument("--public-metrics", action="store_true",
                       help="with an API key, leave /metrics open (for a Prometheus scraper without the key); "
                            "/health is always open")


def spec_max_batch_of(text: str, device_type: str) -> int | None:
    """'auto' -> 1 on CPU, None (no limit) elsewhere; else a positive integer."""
    if text == "auto":
        return 1 if device_type == "cpu" else None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--spec-max-batch must be auto or an integer >= 1, got {text!r}")
    return int(text)


def request_methods_of(text: str, method: str) -> tuple[str, ...] | None:
    """--request-methods -> build_server's request_methods (None: auto), checked before any model loads."""
    from specdec.proposers.registry import check_request_methods

    if text == "auto":
        return None
    if text == "none":
        return ()
    try:
        return check_request_methods(method, [name.strip() for name in text.split(",") if name.strip()])
    except ValueError as error:
        raise ValueError(f"--request-methods: {error}") from None


def limits_of(args):
    """The ServerLimits the flags ask for; a clear error for a bad value, before any model loads."""
    from specdec.server.guards import ServerLimits

    for flag, value in (("--max-body-mb", args.max_body_mb), ("--body-timeout", args.body_timeout),
                        ("--timeout-keep-alive", args.timeout_keep_alive)):
        if not value > 0:
            raise ValueError(f"{flag} must be > 0, got {value:g}")
    if not args.request_deadline >= 0:
        raise ValueError(f"--request-deadline must be >= 0 (0 = none), got {args.request_deadline:g}")
    return ServerLimits(max_body_bytes=int(args.max_body_mb * 1024 * 1024), body_timeout_s=args.body_timeout,
                        max_prompt_chars=args.max_prompt_chars, max_tokens_cap=args.max_tokens_cap,
                        deadline_s=args.request_deadline or None, max_stop_chars=args.max_stop_chars)


def cmd_serve(args) -> int:
    from specdec.cli_options import config_from_args
    from specdec.proposers.registry import check_method

    config = config_from_args(args)
    check_method(config.method)
    spec_max_batch_of(args.spec_max_batch, "cpu")  # validate before loading models
    if args.prefill_chunk < 0:
        raise ValueError(f"--prefill-chunk must be >= 0 (0 = whole prompts), got {args.prefill_chunk}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if not 0 < args.lenience <= 1:
        raise ValueError(f"--lenience must be in (0, 1] (1 = exact, < 1 = lossy), got {args.lenience:g}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    limits = limits_of(args)
    request_methods = request_methods_of(args.request_methods, config.method)
    import uvicorn

    from specdec.factory import check_before_loading, load_head, load_models
    from specdec.server import build_server

    check_before_loading(config)  # a head's file, the method's options: before any load
    target, draft = load_models(config)
    if draft is not None and draft.bridge is not None:
        raise ValueError("specdec serve drafts with the target's tokenizer only; a draft with another tokenizer "
                         "drafts in generate, bench, verify and specdec.load")
    name = args.served_model_name or config.target
    spec_max_batch = spec_max_batch_of(args.spec_max_batch, target.runner.device.type)
    api_key = args.api_key or ([os.environ["SPECDEC_API_KEY"]] if os.environ.get("SPECDEC_API_KEY") else None)
    app = build_server(target.runner, target.tokenizer, name=name, config=config,
                       draft_runner=draft.runner if draft else None, slots=args.max_batch,
                       max_queue=args.max_queue, eos_token_ids=target.eos_token_ids, max_context=args.max_context,
                       default_max_tokens=args.default_max_tokens, spec_max_batch=spec_max_batch,
                       lenience=args.lenience, api_key=api_key, public_metrics=args.public_metrics,
                       prefill_chunk=args.prefill_chunk or None, head=load_head(config, target),
                       prompt_cache=args.prompt_cache, limits=limits, shared_cache=args.shared_cache,
                       tenant_header=args.tenant_header, request_methods=request_methods)
    drafting = "" if config.method == "autoregressive" or spec_max_batch is None else \
        f", drafting while <= {spec_max_batch} run"
    if config.k == "auto" and config.method != "autoregressive":
        drafting = f", k per step by goodput, <= {config.max_k}"
    method = config.method if config.method == "autoregressive" else f"{config.method}, k={config.k}"
    print(f"specdec: serving {name!r} ({method}, {args.max_batch} rows{drafting}, queue "
          f"{args.max_queue}) on http://{args.host}:{args.port}/v1"
          f"{' (API key required)' if api_key else ''}", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                limit_concurrency=args.limit_concurrency or 2 * (args.max_batch + args.max_queue) + 16,
                timeout_keep_alive=args.timeout_keep_alive)
    return 0
