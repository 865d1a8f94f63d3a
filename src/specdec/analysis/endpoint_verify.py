"""`specdec verify --endpoint URL --reference URL`: does speculation change what *your* server says?

The local `specdec verify` (analysis/lossless.py) run against two deployments of one model, e.g.
vLLM with a speculative config and vLLM without, or `specdec serve --method draft` and
`--method autoregressive`. From each prompt both servers draw `samples` seeded continuations of
two tokens (/v1/completions); a chi-square test of homogeneity with the total-variation distance
compares the first token and the first two tokens, Bonferroni-corrected over the tests; then
greedy continuations (temperature 0) of a prompt set must be identical.

Each draw has its own seed and the two servers get disjoint seed ranges, so the two samples are
independent (equal seeds could make a speculative server and a plain one agree draw by draw
even where their distributions differ). Token identities come from vLLM's `return_token_ids`
extension (also served by specdec), else from `logprobs` tokens, else from the text, which
only allows the test on the two-token pair (a text does not say where the first token ends).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from specdec.analysis.lossless import verdict_lines
from specdec.bench.openai_client import Endpoint, EndpointError, add_api_key_args, client, parse_endpoints, \
    post_json, resolve_model

IDENTITIES = ("token ids", "logprobs tokens", "text")  # best first
SEEDS_PER_PROMPT = 2**24  # draws of one prompt on one side never reach the next prompt's seeds
SIDE_OFFSET = 2**30  # the reference's seeds; all below 2**31 for servers with 32-bit seeds
# Tokens asked per draw; the first two are the outcome. Servers sample the first token from the
# prefill, so the second is the first that speculation can produce, and some draft only while a
# whole draft fits in what is left to write (specdec: k <= max_tokens - 2 after the first token).
DRAW_TOKENS = 8


@dataclass
class Capabilities:
    """What one server's /v1/completions accepts: n > 1, and which token identities it returns."""

    n: bool
    identities: set[str]


@dataclass
class SpeculationSeen:
    """specdec's per-response `speculative` counts, summed: did the endpoint actually draft?"""

    drafted: int = 0
    accepted: int = 0
    reported: bool = False
    lenience: float | None = None  # a lossy specdec server says so

    def add(self, body: dict) -> None:
        spec = body.get("speculative")
        if isinstance(spec, dict) and "drafted_tokens" in spec:
            self.reported = True
            self.drafted += spec["drafted_tokens"]
            self.accepted += spec["accepted_tokens"]
            self.lenience = spec.get("lenience", self.lenience)


@dataclass
class Sampler:
    """Draws of one endpoint: the sampling fields every request carries and how outcomes are read."""

    endpoint: Endpoint
    sampling: dict  # temperature, top_p, top_k as the request sends them
    identity: str = "text"
    n: int = 1
    seen: SpeculationSeen = field(default_factory=SpeculationSeen)

    def request(self, prompt: str, max_tokens: int, seed: int, n: int = 1, identity: str | None = None) -> dict:
        identity = identity or self.identity
        body = {"prompt": prompt, "max_tokens": max_tokens, "seed": seed, **self.sampling}
        if n > 1:
            body["n"] = n
        if identity == "token ids":
            body["return_token_ids"] = True
        elif identity == "logprobs tokens":
            body["logprobs"] = 1
        return body

    @property
    def draw_tokens(self) -> int:
        """A text cannot be cut after two tokens: then the request asks for two."""
        return 2 if self.identity == "text" else DRAW_TOKENS

    def outcomes(self, body: dict, first: int | None = None) -> list:
        """One hashable outcome per choice: a tuple of (the first `first`) token ids / token strings, or
        the text."""
        identity = self.identity
        out = []
        for choice in body.get("choices") or []:
            if identity == "token ids":
                tokens = choice.get("token_ids")
            elif identity == "logprobs tokens":
                tokens = (choice.get("logprobs") or {}).get("tokens")
            else:
                out.append(choice.get("text", ""))
                continue
            if not isinstance(tokens, list):
                raise ValueError(f"{self.endpoint.redacted_url('/v1/completions')} stopped returning {identity}")
            out.append(tuple(tokens[:first]) or ("<none>",))  # an empty completion is an outcome too
        return out


def _names_param(error: EndpointError, param: str) -> bool:
    return error.status == 400 and (error.param == param or re.search(rf"\b{param}\b", error.message) is not None)


def probe(http, sampler: Sampler, prompt: str) -> Capabilities:
    """Ask once with n=2 and token ids, once with logprobs: what does this server support?"""
    url = sampler.endpoint.redacted_url("/v1/completions")
    n_ok = True
    try:
        body = post_json(http, sampler.endpoint, "/v1/completions", sampler.request(prompt, 2, 0, 2, "token ids"))
    except EndpointError as error:
        if not _names_param(error, "n"):
            raise
        n_ok = False
        body = post_json(http, sampler.endpoint, "/v1/completions", sampler.request(prompt, 2, 0, 1, "token ids"))
    choices = body.get("choices") or []
    if not choices:
        raise ValueError(f"{url}: the answer has no choices; is this an OpenAI-compatible server?")
    n_ok = n_ok and len(choices) == 2  # some servers ignore n
    identities = {"text"}
    if all(isinstance(c.get("token_ids"), list) for c in choices):
        identities.add("token ids")
    try:
        body = post_json(http, sampler.endpoint, "/v1/completions",
                         sampler.request(prompt, 2, 0, 1, "logprobs tokens"))
        if all(isinstance((c.get("logprobs") or {}).get("tokens"), list) for c in body.get("choices") or [{}]):
            identities.add("logprobs tokens")
    except EndpointError as error:
        if error.status != 400:
            raise
    return Capabilities(n_ok, identities)


def draw(http, sampler: Sampler, prompt: str, samples: int, first_seed: int, concurrency: int,
         desc: str = "") -> list:
    """`samples` two-token continuations from requests of up to sampler.n choices each.

    Request j is seeded first_seed + j * sampler.n: vLLM seeds the i-th of n choices with seed + i,
    so consecutive seeds would repeat draws."""
    from tqdm.auto import tqdm

    outcomes: list = []
    next_seed = first_seed

    def one(job: tuple[int, int]) -> list:
        seed, n = job
        request = sampler.request(prompt, sampler.draw_tokens, seed, n)
        body = post_json(http, sampler.endpoint, "/v1/completions", request)
        sampler.seen.add(body)
        got = sampler.outcomes(body, first=2)
        bar.update(len(got))
        return got

    with ThreadPoolExecutor(max(concurrency, 1)) as pool, \
            tqdm(total=samples, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=False) as bar:
        while len(outcomes) < samples:  # a server may return fewer choices than asked: ask again
            missing = samples - len(outcomes)
            sizes = [sampler.n] * (missing // sampler.n) + [missing % sampler.n] * (missing % sampler.n > 0)
            jobs = [(next_seed + j * sampler.n, n) for j, n in enumerate(sizes)]
            next_seed += len(jobs) * sampler.n
            before = len(outcomes)
            for got in pool.map(one, jobs):
                outcomes.extend(got)
            if len(outcomes) == before:
                raise ValueError(f"{sampler.endpoint.redacted_url('/v1/completions')} returned no choices")
    return outcomes[:samples]


def greedy(http, sampler: Sampler, prompt: str, max_tokens: int, seed: int) -> tuple | str:
    """The temperature-0 continuation: token ids where both servers give them, else the text."""
    request = sampler.request(prompt, max_tokens, seed)
    request["temperature"] = 0.0
    for name in ("top_p", "top_k"):
        request.pop(name, None)
    body = post_json(http, sampler.endpoint, "/v1/completions", request)
    sampler.seen.add(body)
    return sampler.outcomes(body)[0]


@dataclass
class VerifySettings:
    prompts: list[str]  # the distribution check's
    greedy_prompts: list[tuple[str, str]]  # (name, text)
    samples: int = 1000
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    significance: float = 0.001
    max_new_tokens: int = 64
    seed: int = 0
    concurrency: int = 4

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError("--temperature must be > 0 for the distribution check (greedy is checked separately)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must lie in (0, 1], got {self.top_p}")
        if not 0 < self.significance < 1:
            raise ValueError(f"--significance must lie in (0, 1), got {self.significance}")
        if self.top_k < 0 or self.samples < 1 or self.concurrency < 1:
            raise ValueError("--top-k must be >= 0, --samples and --concurrency >= 1")
        if not 0 <= self.seed < SEEDS_PER_PROMPT:  # seeds stay below 2**31 (llama-server's are 32-bit)
            raise ValueError(f"--seed must lie in [0, 2**24) with --endpoint, got {self.seed}")

    @property
    def sampling(self) -> dict:
        fields = {"temperature": self.temperature}
        if self.top_p < 1:
            fields["top_p"] = self.top_p
        if self.top_k > 0:
            fields["top_k"] = self.top_k  # vLLM's, SGLang's and llama-server's extension
        return fields


def verify_endpoints(endpoint: Endpoint, reference: Endpoint, settings: VerifySettings, http=None) -> int:
    """Print the checks in `specdec verify`'s format; 0 when every check passes, 1 when one fails."""
    from tqdm.auto import tqdm

    from specdec.analysis.lossless import distribution_tests, homogeneity_test

    own = http is None
    http = http or client()
    try:
        samplers = [Sampler(e, settings.sampling) for e in (endpoint, reference)]
        capabilities = [probe(http, s, settings.prompts[0]) for s in samplers]
        identity = next(i for i in IDENTITIES if all(i in c.identities for c in capabilities))
        for sampler, caps in zip(samplers, capabilities):
            sampler.identity, sampler.n = identity, (min(settings.samples, 16) if caps.n else 1)
        tests = []
        for index, prompt in enumerate(settings.prompts):
            draws = []
            for side, sampler in enumerate(samplers):
                first_seed = side * SIDE_OFFSET + (index * SEEDS_PER_PROMPT + settings.seed) % SIDE_OFFSET
                draws.append(draw(http, sampler, prompt, settings.samples, first_seed, settings.concurrency,
                                  desc=f"{sampler.endpoint.label[:11]:<11} {prompt[:30]!r}"))
            if identity == "text":  # no token boundaries: only the pair is an outcome
                tests.append((prompt, homogeneity_test(draws[0], draws[1], "first two tokens")))
            else:
                tests += [(prompt, t) for t in distribution_tests(*draws)]
        same, skipped = [], []
        with ThreadPoolExecutor(settings.concurrency) as pool:
            for name, text in tqdm(settings.greedy_prompts, desc="greedy check", file=sys.stderr, leave=False):
                try:
                    outputs = list(pool.map(lambda s: greedy(http, s, text, settings.max_new_tokens, settings.seed),
                                            samplers))
                except EndpointError as error:  # a built-in prompt longer than the server's context
                    if error.status != 400:
                        raise
                    skipped.append(f"{name}: {error}")
                    continue
                same.append((name, outputs[0] == outputs[1]))
    finally:
        if own:
            http.close()
    return _print_verdict(endpoint, reference, settings, identity, tests, same, skipped, samplers[0].seen)


def _print_verdict(endpoint: Endpoint, reference: Endpoint, settings: VerifySettings, identity: str, tests: list,
                   greedy_same: list, skipped: list, seen: SpeculationSeen) -> int:
    threshold = settings.significance / max(len(tests), 1)  # Bonferroni over the tests
    print(f"distribution check: {endpoint.label} against {reference.label} ({endpoint.model}) at temperature "
          f"{settings.temperature:g}, {settings.samples} draws per side; fail below p = {threshold:.2g}")
    if identity != "token ids":
        print(f"  outcomes read from the {identity}" + (": the servers return no token boundaries, so only the "
                                                          "first-two-tokens test is possible" if identity == "text"
                                                          else ""))
    lines, failed = verdict_lines(tests, threshold)
    print("\n".join(lines))
    if greedy_same:
        count = sum(ok for _, ok in greedy_same)
        failed |= count != len(greedy_same)
        print(f"greedy check: {count}/{len(greedy_same)} prompts identical to {reference.label}"
              + "".join(f"\n  FAIL {name}" for name, ok in greedy_same if not ok)
              + "".join(f"\n  skipped {reason}" for reason in skipped))
    elif skipped:
        print("greedy check: every prompt skipped" + "".join(f"\n  skipped {reason}" for reason in skipped))
    if seen.reported:
        rate = f" ({seen.accepted / seen.drafted:.0%} accepted)" if seen.drafted else ""
        print(f"speculation on {endpoint.label}: {seen.drafted} tokens drafted, {seen.accepted} accepted{rate}"
              + ("; nothing was drafted, so nothing about speculation was tested" if not seen.drafted else "")
              + (f"; it runs with lenience {seen.lenience:g} (LOSSY by design)" if seen.lenience else ""))
    if not any(test.dof > 0 for _, test in tests):
        print("warning: too few draws for any outcome to be tested; raise --samples or lower --temperature")
    print(f"FAILED: {endpoint.label}'s output does not follow {reference.label}'s distribution" if failed else
          f"PASSED: no evidence that {endpoint.label}'s output distribution differs from {reference.label}'s")
    return 1 if failed else 0


# ---- command -----------------------------------------------------------------------------------


def add_endpoint_verify_args(parser) -> None:
    """--endpoint, --reference, --endpoint-model, --api-key, --api-key-env, --concurrency on `specdec verify`."""
    parser.add_argument("--endpoint", default=None, metavar="[LABEL=]URL",
                        help="check a running OpenAI-compatible server (e.g. vLLM with a speculative config) "
                             "against --reference instead of local models: http://HOST:PORT or .../v1")
    parser.add_argument("--reference", default=None, metavar="[LABEL=]URL",
                        help="the same model served without speculation: what --endpoint must match")
    parser.add_argument("--endpoint-model", action="append", default=None, metavar="NAME",
                        help="the model name to request (default: the one GET /v1/models lists); once for both "
                             "servers, or twice: --endpoint's, then --reference's")
    add_api_key_args(parser, "--endpoint's, then --reference's")
    parser.add_argument("--concurrency", type=int, default=4,
                        help="requests in flight per server with --endpoint (default: 4). A server that drafts "
                             "only at small batch sizes (specdec serve on a CPU, vLLM's "
                             "speculative_disable_by_batch_size) needs 1 for every draw to be speculated")


def cmd_verify_endpoints(args, default_prompts: Sequence[str] = ()) -> int:
    """specdec verify --endpoint URL --reference URL; default_prompts: the distribution check's without
    --prompt (the local verify's DEFAULT_VERIFY_PROMPTS, so both runs ask the same)."""
    from specdec.bench.prompt_sets import written

    if not (args.endpoint and args.reference):
        raise ValueError("checking servers needs both --endpoint URL (the deployment to check) and --reference URL "
                         "(the same model served without speculation)")
    prompts = args.prompt or list(default_prompts)
    if not prompts:
        raise ValueError("give the distribution check a prompt: --prompt TEXT")
    settings = VerifySettings(
        prompts=prompts, greedy_prompts=[(f"prompt {i + 1}", p) for i, p in enumerate(prompts)]
        + [(p.question_id, p.turns[0]) for p in written()[: max(args.greedy_prompts, 0)]],
        samples=args.samples, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        significance=args.significance, max_new_tokens=args.max_new_tokens, seed=args.seed,
        concurrency=getattr(args, "concurrency", 4))
    endpoints = parse_endpoints([args.endpoint, args.reference], args.endpoint_model, args.api_keys)
    with client() as http:
        endpoint, reference = (resolve_model(http, e) for e in endpoints)
        return verify_endpoints(endpoint, reference, settings, http)

