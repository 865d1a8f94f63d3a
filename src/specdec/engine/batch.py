"""BatchEngine: many requests at once, one target forward per step (continuous batching).

Each running request owns one row of the target's cache (and of the draft's),
and the running rows are kept packed at 0..B-1: a newcomer is prefilled into
row B, a request that finishes is replaced by the last row (move_row). A step
is engine/step.py's run_step over all rows together, the code SpecEngine runs
over one: each row drafts up to its own cap (what it may still emit, the
context, -k auto's controller: engine/adaptive.py), one target forward verifies every row,
each row accepts its own number of drafts and rolls back to its own length;
then each row commits (commit_row), and finished rows leave. Row b draws
exactly the random numbers it would draw alone, and its tokens depend only
on its own context, so a request's output does not depend on what
else runs beside it (tests compare with SpecEngine).

Prompt caching across requests: a finished request's cache row is kept in a free row, with the
tokens it holds (prompt and answer). A newcomer whose prompt begins with such tokens (the next
turn of a chat, an agent's next call) takes a copy of that row and prefills only the rest, as
llama.cpp's server does with its slots. Exact by the native decoder's chunking invariance (its
probe), the same law that makes SpecEngine.reuse_prefix and verification exact.

Rows may draft trees (EAGLE-2's dynamic tree, Medusa's static one): the step's
forward then carries each row's ancestor mask (a chain row's is causal) and each
node sits at its depth, so the native decoder's tree attention gives every node the
keys plain decoding gives it, in the same blocks (models/native/attention.py): a
row's logits are bit for bit those of its own tree forward alone. Each row then
keeps its accepted path (keep_path). Head proposers read the target's features:
each row queues those of its committed tokens until its proposer next drafts.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from specdec.engine.adaptive import AdaptiveK
from specdec.engine.metrics import RequestStats
from specdec.engine.request import MAX_STOP_STRING_CHARS, PLAIN_METHOD, Request, Speculation, TokenLogprob, \
    check_generation_options, common_prefix_length, encode_prompt
from specdec.engine.step import Row, commit_row, prefill, record_step_costs, run_adaptive_step
from specdec.models.loader import eos_ids_of
from specdec.models.runner import ModelRunner
from specdec.proposers.base import Proposer
from specdec.proposers.batched import BatchProposer, as_batch
from specdec.sampling.params import SamplingParams


MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs


@dataclass
class RowUpdate:
    """What one step did for one request."""

    handle: Hashable  # the caller's name for the request
    token_ids: list[int]  # committed this step
    text: str  # new text that is safe to show (held back: partial UTF-8, a possible stop string)
    finish_reason: str | None  # "eos" | "stop" | "length" | "error" on the request's last update
    stats: RequestStats  # the request's running totals
    drafted: int = 0  # this step's drafts for the request
    accepted: int = 0  # of which accepted
    logprobs: list[TokenLogprob] | None = None  # token_ids' log-probabilities, where the request asked
    error: str | None = None  # finish_reason "error": why this request failed (the others run on)


@dataclass
class _Running(Row):
    handle: Hashable = None  # the caller's name for the request
    admitted: float = 0.0  # when add() took it (time to first token counts from here)
    decode_started: float = 0.0
    tenant: str | None = None  # whose cached prompts and outputs it may share (server/guards.py)
    prefilled: int = 0  # prompt tokens in the cache (all but the last once prefilled)
    overtaken: int = 0  # shorter prompts admitted later but prefilled first (bounded: no starvation)


@dataclass
class StepInfo:
    """The last step, for metrics."""

    rows: int = 0
    time_s: float = 0.0


class BatchEngine:
    """Speculative decoding of up to target.batch_size requests at a time.

    >>> engine = BatchEngine(target.with_batch_size(8), DraftModelProposer(draft.with_batch_size(8)),
    ...                      tokenizer, k=4)
    >>> engine.add("a", engine.make_request("def fib(n):", SamplingParams(), max_new_tokens=64))
    >>> while engine.running: updates = engine.step()
    """

    def __init__(self, target: ModelRunner, proposer: BatchProposer | Proposer | None = None,
                 tokenizer: object | None = None, *, k: int | str = 4, eos_token_ids: frozenset[int] | None = None,
                 spec_max_batch: int | None = None, prefill_chunk: int | None = None, max_k: int = 8,
                 prompt_cache: bool = True) -> None:
        """
        Args:
            target: the ModelRunner whose cache rows the requests decode in (target.batch_size rows).
            proposer: a BatchProposer with as many rows (a one-row Proposer for a one-row target), or
                None: plain decoding.
            tokenizer: the target's; None where prompts come as ids.
            k: drafted tokens per step, an int >= 1, or "auto" (engine/adaptive.py chooses each step's
                k in 0..max_k per row); a request may ask for its own (Speculation), at most max_k.
            eos_token_ids: tokens that end a request (default: the tokenizer's).
            spec_max_batch: above this many decoding rows, steps run plain (None: never).
            prefill_chunk: prompt tokens prefilled per step while other rows decode (None: a new
                request's whole prompt at once).
            prompt_cache: keep finished requests' cache rows in free rows for later prompts that begin
                with their tokens (on where the target's prefix reuse is exact and the proposer does not
                read the target's features, which a copied row would lack).
        """
        if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"k (draft tokens per step) must be an integer >= 1 or 'auto', got {k!r}")
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                          or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk must be an integer >= 1 or None, got {prefill_chunk!r}")
        if spec_max_batch is not None and (isinstance(spec_max_batch, bool) or not isinstance(spec_max_batch, int)
                                           or spec_max_batch < 1):
            raise ValueError(f"spec_max_batch must be an integer >= 1 or None, got {spec_max_batch!r}")
        # k "auto": each step's k from measured costs and each row's acceptance (engine/adaptive.py)
        self.adaptive = AdaptiveK.for_proposer(max_k, proposer) if k == "auto" else None
        if isinstance(proposer, Proposer) and target.batch_size != 1:
            raise ValueError("a single-sequence proposer serves one row: build the proposer with slots=batch_size")
        self.target, self.proposer, self.tokenizer = target, as_batch(proposer), tokenizer
        self.k = max_k if k == "auto" else k  # the most a row of the engine's own k drafts in a step
        self.k_setting, self.max_k = k, max_k  # a request's own k (Speculation) may be any of 0..max_k
        # Past this many running requests, steps draft nothing (vLLM's speculative_disable_by_batch_size):
        # a big batch already fills the hardware, and rejected drafts would only cost compute.
        self.spec_max_batch = spec_max_batch
        self.eos_token_ids = eos_ids_of(tokenizer) if eos_token_ids is None else frozenset(eos_token_ids)
        self.slots = target.batch_size
        self.max_context = target.max_context
        self._rows: list[_Running] = []  # decoding, packed in cache rows 0..R-1
        self._prefilling: list[_Running] = []  # admitted, prompt not yet fully prefilled: rows R, R+1, ...
        self.prefill_chunk = prefill_chunk
        self.last_step = StepInfo()
        self.shared_prefills = 0  # requests whose prefill was copied from a running twin (same prompt)
        # EAGLE / EAGLE-3 / Medusa: the proposer reads the target's features (all of a row's, from its prefill on).
        self._reads_hidden = proposer is not None and proposer.reads_target_hidden
        self._feature_layers = tuple(proposer.target_layers) if proposer is not None else ()
        # A copied row lacks the features a head proposer reads, and only a runner whose forward in pieces
        # equals one forward (the native runner's chunking invariance) may skip a prefix: not transformers'.
        self.prompt_cache_possible = not self._reads_hidden and bool(getattr(target, "exact_prefix_reuse", False))
        self.prompt_cache = prompt_cache and self.prompt_cache_possible
        self._parked: dict[int, tuple[str | None, list[int]]] = {}  # free row -> (tenant, the tokens it holds)
        self.reused_prompt_tokens = 0  # prompt tokens copied from other rows (parked, or a twin's) instead of prefilled

    # ---- requests ---------------------------------------------------------------------------

    def make_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                     max_new_tokens: int = 128, stop: Sequence[str] = (), chat: bool = False,
                     ignore_eos: bool = False, logprobs: int | None = None,
                     max_stop_chars: int = MAX_STOP_STRING_CHARS, speculation: Speculation | None = None) -> Request:
        """Validate and encode; raises ValueError for bad input, before anything runs.
        logprobs: report each token's log-probability and this many top alternatives (None: off).
        max_stop_chars: each stop string's most characters, and a quarter of all of theirs (a server's
        --max-stop-chars). speculation: the request's own method and k (check_speculation)."""
        speculation = self.check_speculation(speculation or Speculation())
        stop = check_generation_options(max_new_tokens, stop, max_stop_string_chars=max_stop_chars,
                                        max_stop_chars_total=4 * max_stop_chars)
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in 0..{MAX_TOP_LOGPROBS} or None, got {logprobs!r}")
        ids = encode_prompt(self.tokenizer, prompt, self.max_context, chat, self.target.vocab_size)
        return Request(prompt_ids=ids,
                       params=params or SamplingParams(), max_new_tokens=max_new_tokens,
                       eos_token_ids=frozenset() if ignore_eos else self.eos_token_ids, stop=stop,
                       tokenizer=self.tokenizer, logprobs=logprobs, speculation=speculation)

    @property
    def request_methods(self) -> tuple[str, ...]:
        """The methods a request may name (its Speculation): a proposer of several methods' (the
        server's, proposers/per_request.py), the engine's own first; () where only the engine's own runs."""
        return () if self.proposer is None else tuple(self.proposer.methods)

    def check_speculation(self, speculation: Speculation) -> Speculation:
        """A request's Speculation, refused (ValueError naming what is loaded) where this engine cannot run it."""
        if speculation.method is not None and speculation.method not in self.request_methods:
            loaded = ", ".join(self.request_methods) or "only its own method; a request cannot choose another"
            raise ValueError(f"method {speculation.method!r} is not loaded on this engine; loaded: {loaded}")
        if isinstance(speculation.k, int) and speculation.k > self.max_k:
            raise ValueError(f"k must be at most {self.max_k} here (the engine's max_k), got {speculation.k}")
        return speculation

    def _row_k(self, request: Request) -> int | str:
        """A row's k: its request's own (plain decoding: 0), else the engine's."""
        if request.speculation.method == PLAIN_METHOD:
            return 0
        return self.k_setting if request.speculation.k is None else request.speculation.k

    @property
    def running(self) -> int:
        """Requests holding a row: decoding, or still being prefilled."""
        return len(self._rows) + len(self._prefilling)

    @property
    def free_slots(self) -> int:
        return self.slots - self.running

    def handles(self) -> list[Hashable]:
        return [row.handle for row in (*self._rows, *self._prefilling)]

    def add(self, handle: Hashable, request: Request, tenant: str | None = None) -> None:
        """Give the request the next free row. Its prompt is prefilled now (prefill_chunk None), or by
        the next steps, at most prefill_chunk tokens per step, while the running rows keep decoding;
        it decodes from the step after its prefill is complete.

        tenant: the request shares cached prompts (a twin's prefill, a parked row) and suffix decoding's
        earlier outputs with requests of the same tenant only. Across tenants a shared cache would
        tell a client, through cached_tokens, its time to first token and the acceptance counts, how
        much of another's conversation its prompt repeats (docs/security.md)."""
        if not self.free_slots:
            raise RuntimeError("no free row: wait until a request finishes")
        running = _Running(request, request.params.make_generator(self.target.device), list(request.prompt_ids),
                           handle=handle, admitted=time.perf_counter(), tenant=tenant)
        running.stats.prompt_tokens = len(request.prompt_ids)
        row = self.running  # rows are packed: decoding rows first, then the ones being prefilled
        # A twin's prefill is shared by copying its cache rows; a head proposer would also need the
        # prompt's features, which the twin's proposer has already read: prefill those requests anew.
        twin = None if self._reads_hidden else self._row_with_prompt(request.prompt_ids, tenant)
        if twin is not None:
            self._vacate(row)
            # The same prompt runs already (n > 1 samples, or a repeated request): its row's cache begins
            # with exactly this prefill, computed by the same forward, so copy it instead of recomputing.
            self.target.move_row(twin, row)  # a copy: the source row keeps its entries
            reused = len(request.prompt_ids) - 1
            self.target.truncate([reused], rows=slice(row, row + 1))
            self.shared_prefills += 1
        else:
            reused = self._reuse_parked(request.prompt_ids, row, tenant)
        if reused:
            running.prefilled = running.stats.prompt_tokens_reused = reused
            self.reused_prompt_tokens += reused
            self._prefilling.append(running)  # it holds entries: after every waiting row, never reordered
        else:
            self.target.truncate([0], rows=slice(row, row + 1))
            self._queue_for_prefill(running)
        if self.prefill_chunk is None:
            self._prefill(budget=None)

    MIN_REUSED_TOKENS = 8  # a shorter common prefix is not worth a row copy

    def _reuse_parked(self, prompt_ids: list[int], row: int, tenant: str | None) -> int:
        """Give row the entries of tenant's parked row sharing the longest prefix with prompt_ids (all
        but the prompt's last token at most); how many it got (0: none worth taking). The parked row is
        used up: the conversation it holds parks again, longer, when this request finishes."""
        best, best_length = None, 0
        for parked, (owner, tokens) in self._parked.items():
            if owner != tenant:
                continue
            length = common_prefix_length(tokens, prompt_ids, len(prompt_ids) - 1)
            if length > best_length or (length == best_length and parked == row):
                best, best_length = parked, length
        if best is None or best_length < self.MIN_REUSED_TOKENS:
            self._vacate(row)
            return 0
        if best == row:
            self._parked.pop(row)
        elif row in self._parked:  # keep what row holds parked, where best was
            self.target.swap_rows(best, row)
            self._parked[best] = self._parked.pop(row)
        else:
            self.target.move_row(best, row)
            self._parked.pop(best)
        self.target.truncate([best_length], rows=slice(row, row + 1))
        return best_length

    def _vacate(self, row: int) -> None:
        """Row is about to be overwritten: what is parked there moves to another free row, if one is."""
        if row not in self._parked:
            return
        spare = next((free for free in range(row + 1, self.slots) if free not in self._parked), None)
        if spare is not None:
            self.target.move_row(row, spare)
            self._parked[spare] = self._parked[row]
        del self._parked[row]

    def _parkable(self, row: int) -> list[int] | None:
        """The tokens whose entries finished row holds, if worth keeping for later prompts."""
        cached = min(len(self._rows[row].tokens), self.target.row_lengths(slice(row, row + 1))[0])
        return self._rows[row].tokens[:cached] if cached >= self.MIN_REUSED_TOKENS else None

    def _queue_for_prefill(self, running: _Running) -> None:
        """Shortest prompt first among the prompts not yet begun: with chunked prefill, a short question
        then gets its first token after its own prefill, not after every longer document admitted before
        it (16 clients arriving at once on a 2-core CPU: a much shorter median time to first token than
        whole prefills or chunks in arrival order; benchmarks/RESULTS.md, "Serving at every load: goodput
        k, chunked prefill shortest-first, heads in the batched engine (issue 22)"). What only
        changes is when a row is prefilled, never what it holds. A prompt is overtaken at most `slots`
        times, so a long one cannot starve behind a stream of short ones. Rows not yet begun hold
        nothing, so reordering them moves no cache entries."""
        queue = self._prefilling
        position = len(queue)
        while (position > 0 and queue[position - 1].prefilled == 0
               and len(queue[position - 1].request.prompt_ids) > len(running.request.prompt_ids)
               and queue[position - 1].overtaken < self.slots):
            position -= 1
        for overtaken in queue[position:]:
            overtaken.overtaken += 1
        queue.insert(position, running)

    def _prefill(self, budget: int | None) -> None:
        """Prefill waiting rows in arrival order, up to `budget` prompt tokens (None: all of them).
        The cache holds all but a prompt's last token, which opens its first step. Chunks give the
        cache the same entries, bit for bit, as one whole prefill (the native decoder's chunking
        invariance, checked by its probe): chunking changes when, never what."""
        while self._prefilling and (budget is None or budget > 0):
            running = self._prefilling[0]
            row = len(self._rows)  # the first waiting row sits right after the decoding ones
            want = len(running.request.prompt_ids) - 1 - running.prefilled
            count = want if budget is None else min(want, budget)
            if count > 0:
                started = time.perf_counter()
                prefill(self.target, running, running.prefilled, count, row, self.features)
                running.prefilled += count
                running.stats.prefill_time_s += time.perf_counter() - started
                if budget is not None:
                    budget -= count
            if running.prefilled < len(running.request.prompt_ids) - 1:
                return  # the budget ran out mid-prompt
            self._prefilling.pop(0)  # complete: it decodes from the next step, in place
            self.start_row(row, running.handle, running.tenant, running.request.speculation.method)
            running.decode_started = time.perf_counter()
            self._rows.append(running)

    @property
    def features(self) -> tuple[int, ...] | None:
        """The target's features the proposer reads: its final ones (), or those of these layers
        (EAGLE-3); None where it reads none."""
        return self._feature_layers if self._reads_hidden else None

    def start_row(self, row: int, handle: Hashable, tenant: str | None = None, method: str | None = None) -> None:
        """A request starts decoding in row: the proposer (its request's method, None: the engine's) and
        -k auto's controller start afresh there."""
        if self.proposer is not None:
            self.proposer.set_row_method(row, method)
            self.proposer.set_row_tenant(row, tenant)
            self.proposer.start_row(row)
        if self.adaptive is not None:
            self.adaptive.start_row(handle)

    def _row_with_prompt(self, prompt_ids: list[int], tenant: str | None) -> int | None:
        """A decoding row of tenant's whose prompt is prompt_ids (its first len - 1 cache entries are their
        prefill)."""
        if len(prompt_ids) < 2:
            return None
        for row, running in enumerate(self._rows):
            if running.tenant == tenant and running.request.prompt_ids == prompt_ids:
                return row
        return None

    def remove(self, handle: Hashable) -> bool:
        """Drop a request (its client went away); False if it is not running."""
        for row, running in enumerate(self._rows):
            if running.handle == handle:
                self._free(row)
                return True
        for index, running in enumerate(self._prefilling):
            if running.handle == handle:
                self._drop_prefilling(index)
                return True
        return False

    def clear(self) -> list[Hashable]:
        """Drop every request (after an error); returns their handles."""
        handles = self.handles()
        if self.adaptive is not None:
            for handle in handles:
                self.adaptive.forget(handle)
        self._rows.clear()
        self._prefilling.clear()
        self._parked.clear()  # an error may have left any row half-written
        return handles

    def forget_prompt_cache(self) -> None:
        """Drop the parked rows (their entries may have been overwritten: another engine shares the target)."""
        self._parked.clear()

    def forget_earlier_requests(self) -> None:
        """Empty what earlier requests left: the prompt cache, and what the proposer learned (suffix
        decoding's cache), so the next request runs as if it were the first."""
        self.forget_prompt_cache()
        if self.proposer is not None:
            self.proposer.forget_earlier_requests()

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[RowUpdate]:
        """One speculative step over every decoding request, after at most prefill_chunk tokens of
        waiting prompts (chunked prefill: a long prompt no longer stalls every stream for its length).

        Returns:
            One RowUpdate per request that moved: its handle, the new text and token ids, and on its
            last update finish_reason and RequestStats (the request has then left its row).
        """
        started = time.perf_counter()
        if self._prefilling:
            self._prefill(self.prefill_chunk)
        if not self._rows:
            return []
        rows, batch = self._rows, len(self._rows)
        # Every row writes k+1 positions, so the fullest row bounds k for all.
        room = min(self.max_context - len(row.tokens) for row in rows)
        # A request's first step is plain, as in SpecEngine (its first token as soon as plain decoding's).
        row_ks = [self._row_k(row.request) for row in rows]
        max_ks = [0 if row.stats.target_forwards == 0 else
                  max(0, min(self.max_k if k == "auto" else k, row.request.remaining - 1, room - 1))
                  for row, k in zip(rows, row_ks)]
        if self.spec_max_batch is not None and batch > self.spec_max_batch:
            max_ks = [0] * batch  # plain decoding this step; the draft catches up when speculation resumes
        if self.adaptive is None and "auto" in row_ks and self.proposer is not None:  # a request asked for it
            self.adaptive = AdaptiveK.for_proposer(self.max_k, self.proposer)

        # Steps 1-5 and 7 (engine/step.py), then 6: commit, cut at EOS / stop / length; finished rows leave.
        result = run_adaptive_step(self.target, self.proposer, rows, max_ks, self.adaptive,
                                   [row.handle for row in rows], fixed=[k != "auto" for k in row_ks])
        record_step_costs(self.proposer, result)  # one row's: scored copying's costs, --tree-size auto's
        updates, finished, failed = [], [], set()
        now = time.perf_counter()
        for b, row in enumerate(rows):
            update = self._commit(row, result, b, now)
            updates.append(update)
            if update.error is not None:
                failed.add(b)
            if update.finish_reason is not None:
                finished.append(b)
        for b in reversed(finished):  # descending, so packing never moves a row still to be freed
            if self.proposer is not None and b not in failed:
                self.proposer.end_row(b, self._rows[b].request.prompt_ids, self._rows[b].request.generated)
            # A failed row's cache may be half-written: never parked for later prompts.
            parked = self._parkable(b) if self.prompt_cache and b not in failed else None
            tenant = self._rows[b].tenant
            self._free(b, keep=parked is not None)
            if parked is not None:  # the freed row, now the first free one, holds it
                self._parked[self.running] = (tenant, parked)
        self.last_step = StepInfo(batch, time.perf_counter() - started)
        return updates

    def _commit(self, row: _Running, result, b: int, now: float) -> RowUpdate:
        """Step 6 for row b (commit_row), as the row's update. A failure that is the row's own (its
        verification: engine/step.py's errors; its stop strings or detokenizing here) ends that row
        with finish_reason "error", and every other row runs on."""
        before = len(row.request.token_logprobs)
        error = result.errors[b] if result.errors else None
        kept, text = [], ""
        if error is None:
            try:
                kept = commit_row(row, result, b, self.max_context)
                text = row.request.text_delta() if self.tokenizer is not None else ""
            except Exception as failure:  # noqa: BLE001 - this request's own, reported to its client
                error = f"{type(failure).__name__}: {failure}"
        row.stats.decode_time_s = now - row.decode_started
        if kept and not row.stats.first_token_s:
            row.stats.first_token_s = now - row.admitted
        logprobs = row.request.token_logprobs[before:] if row.request.logprobs is not None else None
        if error is not None:
            row.request.finish("error")
            return RowUpdate(row.handle, [], "", "error", row.stats, result.drafted[b], 0, None, error)
        return RowUpdate(row.handle, kept, text, row.request.finish_reason, row.stats,
                         result.drafted[b], result.accepted[b], logprobs)

    def _free(self, row: int, keep: bool = False) -> None:
        """Pack: the last decoding row moves into the freed one, and the rows being prefilled follow.
        keep: by swaps instead of copies, so the freed row's entries end in the first free row."""
        if self.adaptive is not None:  # the request is gone: so are its rates
            self.adaptive.forget(self._rows[row].handle)
        last = len(self._rows) - 1

        def move(source: int, destination: int) -> None:  # a lone row never moves (transformers' runner has one)
            (self.target.swap_rows if keep else self.target.move_row)(source, destination)

        if row != last:
            move(last, row)
            if self.proposer is not None:
                self.proposer.move_row(last, row)
            self._rows[row] = self._rows[last]
        self._rows.pop()
        for index in range(len(self._prefilling)):
            move(last + 1 + index, last + index)

    def _drop_prefilling(self, index: int) -> None:
        first = len(self._rows)
        for later in range(index + 1, len(self._prefilling)):
            self.target.move_row(first + later, first + later - 1)
        self._prefilling.pop(index)

