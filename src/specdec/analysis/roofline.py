"""What a target forward of n tokens costs on this machine, next to the two floors it cannot beat.

Speculation pays when verifying k drafts costs little more than one step. A forward of n new
tokens cannot take less than the larger of two floors:

- the weight-read floor: every weight the forward reads, once, at the memory bandwidth measured
  here (bytes / bandwidth). A one-token step of a quantized model sits near it;
- the arithmetic floor: its multiply-adds (projections, head and attention, n rows each) at the
  peak rate measured here for the kernels' own instruction (VNNI's vpdpbusd, or vpmaddubsw, for
  int8 sums; a large torch.mm for float weights).

Below the weight floor, n tokens cost what one does; once the arithmetic floor passes it, they
cost n times more. `specdec doctor` prints the measured cost next to both (docs/architecture.md,
"Cost of a forward"), so a user sees how far this machine's kernels are from what it could do.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.analysis.measure import forward_times
from specdec.models import huge_pages

TOKENS = (1, 2, 5, 9, 17, 33)  # a step, then verification of k = 1, 4, 8, 16, 32 drafts


@dataclass
class CostRow:
    tokens: int
    seconds: float  # median forward of `tokens` new tokens after the context
    weight_floor_s: float
    arithmetic_floor_s: float

    @property
    def floor_s(self) -> float:
        return max(self.weight_floor_s, self.arithmetic_floor_s)


@dataclass
class CostCurve:
    context: int
    weight_bytes: int
    bandwidth: float  # bytes/s, measured
    peak: float  # multiply-adds/s, measured
    peak_kind: str  # which instruction or kernel the peak was measured on
    rows: list[CostRow]

    def table(self) -> str:
        step = self.rows[0].seconds
        lines = [f"cost of a forward after {self.context} cached tokens: weight floor = "
                 f"{self.weight_bytes / 1e9:.2f} GB / {self.bandwidth / 1e9:.1f} GB/s; arithmetic floor = "
                 f"multiply-adds / {self.peak / 1e9:.0f} G/s ({self.peak_kind})",
                 f"  {'tokens':>6} {'ms':>8} {'x step':>7} {'weight floor':>13} {'arith. floor':>13} {'x floor':>8}"]
        for row in self.rows:
            lines.append(f"  {row.tokens:>6} {row.seconds * 1e3:>8.1f} {row.seconds / step:>6.2f}x "
                         f"{row.weight_floor_s * 1e3:>10.1f} ms {row.arithmetic_floor_s * 1e3:>10.1f} ms "
                         f"{row.seconds / row.floor_s:>7.2f}x")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"context": self.context, "weight_bytes": self.weight_bytes, "bandwidth_bytes_s": self.bandwidth,
                "peak_multiply_adds_s": self.peak, "peak_kind": self.peak_kind,
                "rows": [{"tokens": row.tokens, "ms": row.seconds * 1e3, "weight_floor_ms": row.weight_floor_s * 1e3,
                          "arithmetic_floor_ms": row.arithmetic_floor_s * 1e3} for row in self.rows]}


def weight_bytes(decoder) -> int:
    """Bytes a forward reads once whatever its rows: every tensor of the decoder but the embedding,
    of which a forward reads only its tokens' rows. Tensors a module keeps outside its parameters
    and buffers count too (PackedLinear's oneDNN-packed weight)."""
    embedding = getattr(decoder, "embedding", None)
    tensors = [*decoder.parameters(), *decoder.buffers()]
    for module in decoder.modules():
        tensors += [value for value in vars(module).values() if isinstance(value, torch.Tensor)]
    seen, total = set(), 0
    for tensor in tensors:
        if tensor is embedding or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        total += tensor.numel() * tensor.element_size()
    return total


def multiply_adds(decoder, tokens: int, context: int) -> int:
    """Multiply-adds of a forward of `tokens` new tokens after `context` cached ones: every
    projection and the head (in x out per row), and attention's q.k and weights.v per key seen."""
    per_row = sum(module.in_features * module.out_features for module in decoder.modules()
                  if hasattr(module, "in_features") and hasattr(module, "out_features"))
    config = decoder.config
    keys_seen = tokens * context + tokens * (tokens + 1) // 2  # causal: token i sees context + i keys
    attention = 2 * config.num_layers * config.num_heads * config.head_dim * keys_seen
    return tokens * per_row + attention


def median_seconds(work, device: torch.device, repeats: int = 5) -> float:
    """Median wall seconds of work() over `repeats` calls after one warm-up, the device synchronized
    around each call (on CUDA the call only queues its kernels)."""
    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    work()
    times = []
    for _ in range(repeats):
        synchronize()
        started = time.perf_counter()
        work()
        synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def last_level_cache_bytes(caches: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The largest CPU cache this machine reports (Linux sysfs; 0 where it says nothing)."""
    sizes = []
    for entry in caches.glob("index*/size"):
        text = entry.read_text().strip().upper()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=0)


def measure_bandwidth(megabytes: int | None = None, repeats: int = 5, pages: torch.Tensor | None = None) -> float:
    """Bytes/s of reading memory far larger than any last-level cache, with this process's threads:
    `pages`, the native decoder's own weight mapping (models/huge_pages.py), where it is that large;
    else a buffer of 256 MB, or four times the last-level cache where that is larger (VMs on hosts
    with 480 MB of L3 report it, and a 256 MB sum then partly reads cache), on 2 MB pages where the
    system gives them. Why the weights' own pages first: on a 2-core Zen 4 VM the same 256 MB buffer
    read at one of two rates far apart depending on where it landed, so a buffer of its own measured
    its placement, not the floor of the reads a step makes (benchmarks/RESULTS.md, "w4a8: one block
    at a time (issue 38, items 1 and 3)"). The weights are read by an int32 maximum, which any
    bytes allow and which streams as fast as a float sum (an int32 sum does not)."""
    if megabytes is None:
        megabytes = min(4096, max(256, 4 * last_level_cache_bytes() // 2**20))
    if pages is not None and pages.numel() >= megabytes * 2**20 and pages.numel() % 4 == 0:
        words = pages.view(torch.int32)
        return pages.numel() / median_seconds(words.amax, pages.device, repeats)
    buffer = huge_pages.zeros((megabytes * 2**20 // 4,), torch.float32).fill_(1.0)
    return buffer.numel() * 4 / median_seconds(buffer.sum, buffer.device, repeats)


def measure_peak(decoder) -> tuple[float, str]:
    """Multiply-adds/s at this machine's peak for the decoder's kernels: the int8 dot-product
    instruction the w4a8/w8a8 kernels issue, else a large float matmul in the decoder's dtype."""
    from specdec.models.native import kernels
    from specdec.models.native.linear import W8A8Linear
    from specdec.models.native.w4a8 import ISA_PATHS, W4A8Linear, isa_path

    quantized = any(isinstance(module, (W4A8Linear, W8A8Linear)) for module in decoder.modules())
    path = isa_path()
    if quantized and decoder.device.type == "cpu" and kernels.load() is None and path != "scalar":
        instruction = "vpdpbusd" if path == "avx512_vnni" else "vpmaddubsw"
        return torch.ops.specdec_w4a8.int8_peak(ISA_PATHS[path]), f"int8 {instruction}, {path} path"
    size = 2048
    a = torch.randn(size, size, dtype=decoder.dtype, device=decoder.device)
    b = torch.randn(size, size, dtype=decoder.dtype, device=decoder.device)
    seconds = median_seconds(lambda: a @ b, a.device)
    return size**3 / seconds, f"{str(decoder.dtype).removeprefix('torch.')} matmul"


def cost_curve(runner, context: int = 512, tokens=TOKENS, repeats: int = 5) -> CostCurve:
    """Measure the forward costs of `runner` at `tokens` new tokens after `context` cached ones, and
    this machine's floors for them. Leaves the runner's cache empty."""
    decoder = runner.decoder
    tokens = [n for n in tokens if context + n <= runner.max_context]
    pages = getattr(decoder, "weight_pages", ())  # the native decoder's weight mapping, where it has one
    bandwidth = measure_bandwidth(pages=pages[0] if pages else None)
    peak, peak_kind = measure_peak(decoder)
    read = weight_bytes(decoder)
    seconds = forward_times(runner, context, tokens, repeats, warmups=1)
    rows = [CostRow(tokens=n, seconds=seconds[n], weight_floor_s=read / bandwidth,
                    arithmetic_floor_s=multiply_adds(decoder, n, context) / peak) for n in tokens]
    return CostCurve(context=context, weight_bytes=read, bandwidth=bandwidth, peak=peak, peak_kind=peak_kind,
                     rows=rows)
