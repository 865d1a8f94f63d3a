"""NativeRunner: the ModelRunner over NativeDecoder and a StaticKVCache."""

from __future__ import annotations

import os
import sys

import torch

from specdec.models.kv_cache import StaticKVCache
from specdec.models.native.attention import KEY_BLOCK
from specdec.models.native.captured import FixedSteps
from specdec.models.native.linear import DenseLinear
from specdec.models.native.model import NativeDecoder
from specdec.models.runner import ForwardOutput


# Every forward on CUDA runs exactly this many new tokens per row (see NativeRunner.step_tokens).
CUDA_STEP_TOKENS = 64


class NativeRunner:
    """Any batch size; rows may hold different lengths (per-row truncate).

    step_tokens (default: CUDA_STEP_TOKENS on CUDA, None on CPU): every forward runs
    exactly this many new tokens per row, the real ones followed by padding that no
    real token sees (chains longer than that run in several calls). On a GPU the
    kernels' launch shapes, not only the library, decide the rounding: cuBLAS picks
    its GEMM by row count, and PyTorch's CUDA reductions (RMSNorm's mean, softmax)
    split a row's sum across threads by how many rows share the call. Measured on an
    H100 (benchmarks/cuda_check.py), greedy draft k=4 on a random-weight 1.5B target
    left plain greedy at its 77th token, and fp32 projections of 2..64 rows differed
    from one row. One shape per step makes a plain step, a 5-token verification and
    a 40-node tree the same kernels, so a position's logits cannot depend on how many
    tokens shared its forward (docs/architecture.md, "Batch invariance", held by
    construction). On a GPU a 64-token forward of a 1.5B model costs what a 1-token
    one does (it reads the same weights); on CPUs rows cost time, and the kernels
    are invariant by themselves (linear.batch_invariant), so CPUs never pad.

    cuda_graphs ("auto": on for a CUDA runner with fixed steps, unless SPECDEC_CUDA_GRAPHS=0):
    each fixed-shape step is recorded once as a CUDA graph and replayed (captured.py), which
    takes the ~1,700 kernel launches of a step off the host. False runs the same steps eagerly.

    head_rows [N] (optional): the decoder's head scores only these target ids
    (a reduced-vocabulary draft, as in EAGLE-3, Li et al. 2025, arXiv 2503.01840);
    the N logits are scattered back into a full-width row with -inf elsewhere,
    so callers see the usual [B, T, V] and never sample an unscored token.
    """

    def __init__(self, decoder: NativeDecoder, *, batch_size: int = 1,
                 head_rows: torch.Tensor | None = None, max_context: int | None = None,
                 initial_cache_len: int = 2048, step_tokens: int | None | str = "auto",
                 cuda_graphs: bool | str = "auto") -> None:
        config = decoder.config
        self.decoder = decoder
        self.device = decoder.device
        self.vocab_size = config.vocab_size
        self.max_context = max_context or config.max_position_embeddings
        self.head_rows = None if head_rows is None else head_rows.to(self.device)
        # The safe path, set where the invariance probe failed (check_invariance): see _one_token_per_call.
        self.one_token_per_call = False
        if step_tokens == "auto":
            step_tokens = CUDA_STEP_TOKENS if self.device.type == "cuda" else None
        if step_tokens is not None and (isinstance(step_tokens, bool) or not isinstance(step_tokens, int)
                                        or step_tokens < 1):
            raise ValueError(f"step_tokens must be an integer >= 1, None or 'auto', got {step_tokens!r}")
        self.step_tokens = step_tokens
        # Bumped by everything that changes the cache: SpecEngine reuses a cached prompt prefix only
        # while the version is the one its last request left (no one else used the runner since).
        self.cache_version = 0
        if step_tokens is not None:  # the batched step's GEMMs in blocks of one row's step (DenseLinear)
            for module in decoder.modules():
                if isinstance(module, DenseLinear):
                    module.row_block = step_tokens
        # The padding of the context's last step needs slots past the context: never read, never kept.
        self.cache = StaticKVCache(num_layers=config.num_layers, batch_size=batch_size,
                                   num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                                   max_capacity=self.max_context + (step_tokens or 0),
                                   dtype=decoder.dtype, device=self.device,
                                   initial_capacity=initial_cache_len, capacity_multiple=KEY_BLOCK)
        if cuda_graphs == "auto":
            cuda_graphs = (self.device.type == "cuda" and step_tokens is not None
                           and os.environ.get("SPECDEC_CUDA_GRAPHS", "1") != "0")
        if cuda_graphs and (self.device.type != "cuda" or step_tokens is None):
            raise ValueError(f"CUDA graphs record fixed-shape steps on a GPU: this runner is on {self.device} "
                             f"with step_tokens={step_tokens}")
        self.cuda_graphs = bool(cuda_graphs)
        self.fixed_steps = None if step_tokens is None else FixedSteps(decoder, self.cache, capture=self.cuda_graphs)

    @property
    def seq_len(self) -> int:
        return max(self.cache.seq_lens)

    @property
    def batch_size(self) -> int:
        return len(self.cache.seq_lens)

    def row_lengths(self, rows: slice | None = None) -> list[int]:
        """Cached tokens of each row (of rows, a contiguous block; default all)."""
        return self.cache.seq_lens[rows or slice(None)]

    def with_batch_size(self, batch_size: int, *, max_context: int | None = None,
                        initial_cache_len: int = 512) -> NativeRunner:
        """A runner over the same weights with its own cache of batch_size rows (a server's slots)."""
        runner = NativeRunner(self.decoder, batch_size=batch_size, head_rows=self.head_rows,
                              max_context=min(max_context or self.max_context, self.max_context),
                              initial_cache_len=initial_cache_len, step_tokens=self.step_tokens,
                              cuda_graphs=self.cuda_graphs)
        runner.one_token_per_call = self.one_token_per_call
        return runner

    def check_invariance(self, out=None) -> bool:
        """The cheap invariance probe (native/invariance.py), once per loaded target. Where it
        fails, switch to the safe path and say so: never silently inexact."""
        from specdec.models.native.invariance import cheap_probe

        report = cheap_probe(self.decoder, self.step_tokens)
        if not report.ok:
            self.one_token_per_call = True
            worst = report.failures[0]
            print(f"specdec: batch invariance failed on this machine ({len(report.failures)} probes, e.g. "
                  f"{worst.name}: max |diff| {worst.max_abs_diff:.3g}); verifying one token per call so "
                  "output stays exact (speculation gains nothing). Run `specdec doctor` for details.",
                  file=out or sys.stderr)
        return report.ok

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T]
        *,
        last_n_logits: int | None = None,
        among_new: torch.Tensor | None = None,  # [B, T, T] bool, which new tokens each new token sees
        rows: slice | None = None,  # only these cache rows (contiguous, step 1); B = their count
        valid: torch.Tensor | None = None,  # [B, T] bool: a ragged batch's real tokens (None: all)
    ) -> ForwardOutput:
        cache = self._cache_rows(rows)
        self.cache_version += 1
        if token_ids.shape[0] != len(cache.seq_lens):
            raise ValueError(f"this forward covers {len(cache.seq_lens)} cache rows, got {token_ids.shape[0]} rows")
        token_ids, positions = token_ids.to(self.device), positions.to(self.device)
        if max(cache.seq_lens) + token_ids.shape[1] > self.max_context:
            raise ValueError(f"{max(cache.seq_lens) + token_ids.shape[1]} tokens do not fit the model's context of "
                             f"{self.max_context} tokens")
        if self.one_token_per_call and last_n_logits is None and token_ids.numel() > 1:
            logits, hidden = self._one_token_per_call(token_ids, positions, among_new, rows)
        elif self.step_tokens is not None and valid is None:
            logits, hidden = self._fixed_steps(token_ids, positions, cache, self._first_row(rows), among_new,
                                               last_n_logits)
        else:
            logits, hidden = self.decoder(token_ids, positions, cache, among_new=among_new,
                                          last_n_logits=last_n_logits, valid=valid)
        if self.head_rows is not None:
            full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
            logits = full.index_copy_(-1, self.head_rows, logits)
        return ForwardOutput(logits=logits, hidden=hidden)

    def _fixed_steps(self, token_ids: torch.Tensor, positions: torch.Tensor, cache, first_row: int,
                     among_new: torch.Tensor | None, last_n_logits: int | None):
        """The forward in calls of exactly step_tokens new tokens per row (see the class docstring).

        A chain of more runs in consecutive calls (a prompt's prefill, in pieces); a tree of more
        (its nodes must see each other in one call) runs padded to a multiple of step_tokens."""
        step, total = self.step_tokens, token_ids.shape[1]
        if total > step and among_new is None:
            pieces = [self._fixed_steps(token_ids[:, start:start + step], positions[:, start:start + step], cache,
                                        first_row, None, last_n_logits) for start in range(0, total, step)]
            # With last_n_logits (a prefill) each piece hands back only its last rows: never a whole prompt's logits.
            logits, hidden = torch.cat([p[0] for p in pieces], dim=1), torch.cat([p[1] for p in pieces], dim=1)
            return (logits[:, -last_n_logits:] if last_n_logits else logits), hidden
        width = -(-total // step) * step
        pad = width - total
        before = list(cache.seq_lens)
        if pad:
            rows = token_ids.shape[0]
            token_ids = torch.cat([token_ids, token_ids.new_zeros(rows, pad)], dim=1)
            # The padding continues each row's positions (any rotary position would do: no real token sees it).
            positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, pad + 1, device=positions.device)],
                                  dim=1)
            if among_new is not None:  # real tokens see what they saw; each padding token sees itself
                padded = torch.eye(width, dtype=torch.bool, device=among_new.device).repeat(rows, 1, 1)
                padded[:, :total, :total] = among_new.to(torch.bool)
                among_new = padded
        logits, hidden = self.fixed_steps.forward(token_ids, positions, cache, first_row, among_new)
        if pad:
            cache.truncate([length + total for length in before])  # the padding's keys and values go
        logits, hidden = logits[:, :total], hidden[:, :total]
        return (logits[:, -last_n_logits:] if last_n_logits else logits), hidden

    def _one_token_per_call(self, token_ids: torch.Tensor, positions: torch.Tensor,
                            among_new: torch.Tensor | None, rows: slice | None):
        """The safe path (the invariance probe failed here): every decoded position in a call
        of its own, exactly as plain decoding makes it, so verification and batching cannot
        change a logit. Prefill (last_n_logits) stays one call: plain and speculative
        decoding prefill alike. Verification then costs k+1 plain steps."""
        if among_new is not None:
            raise ValueError("tree verification is not exact on this machine (the invariance probe failed; "
                             "see `specdec doctor`): use a chain method such as draft or ngram")
        first = self._first_row(rows)
        per_row = []  # (logits [1, T, V], hidden [1, T, H]) of each row
        for row in range(token_ids.shape[0]):
            cache = self.cache.rows(first + row, first + row + 1)
            steps = [self.decoder(token_ids[row:row + 1, t:t + 1], positions[row:row + 1, t:t + 1], cache)
                     for t in range(token_ids.shape[1])]
            per_row.append((torch.cat([logits for logits, _ in steps], dim=1),
                            torch.cat([hidden for _, hidden in steps], dim=1)))
        return torch.cat([logits for logits, _ in per_row]), torch.cat([hidden for _, hidden in per_row])

    @property
    def exact_prefix_reuse(self) -> bool:
        """Whether keeping cached tokens and feeding only the rest gives what one fresh forward
        would (chunking invariance, docs/exactness.md): not on the safe path, whose probe failed."""
        return not self.one_token_per_call

    def truncate(self, seq_lens: torch.Tensor | list[int], rows: slice | None = None) -> None:
        self.cache_version += 1
        cache = self._cache_rows(rows)
        lengths = [int(n) for n in torch.as_tensor(seq_lens).reshape(-1).tolist()]
        if len(lengths) == 1 and len(cache.seq_lens) > 1:
            lengths = lengths * len(cache.seq_lens)
        cache.truncate([min(new, old) for new, old in zip(lengths, cache.seq_lens)])

    # The cache's storage is (re)allocated inside forward, under inference mode, once a row
    # outgrows it; in-place copies into such an inference tensor are allowed only in that mode.
    @torch.inference_mode()
    def keep_path(self, start: int, offsets: list[int], row: int | None = None) -> None:
        """Tree verification's rollback of one row: keep the root at slot start and the
        accepted path's inputs (offsets from start, root excluded), packed after it.
        row: the cache row (None: the only one)."""
        if row is None and self.batch_size != 1:
            raise ValueError("name the row whose tree to keep: this runner holds several")
        self.cache_version += 1
        self.cache.keep_path(0 if row is None else row, start, offsets)

    @torch.inference_mode()
    def move_row(self, source: int, destination: int) -> None:
        self.cache_version += 1
        self.cache.move_row(source, destination)

    @torch.inference_mode()
    def swap_rows(self, first: int, second: int) -> None:
        self.cache_version += 1
        self.cache.swap_rows(first, second)

    def _first_row(self, rows: slice | None) -> int:
        return 0 if rows is None else rows.indices(self.batch_size)[0]

    def _cache_rows(self, rows: slice | None):
        if rows is None:
            return self.cache
        start, stop, step = rows.indices(self.batch_size)
        if step != 1:
            raise ValueError("rows must be a contiguous block")
        return self.cache.rows(start, stop)

    def reset(self) -> None:
        self.cache_version += 1
        self.cache.reset()
