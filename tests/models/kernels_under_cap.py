"""Which kernels the real-shape probe runs under this process's ONEDNN_MAX_CPU_ISA.

Run by test_invariance.py as `python kernels_under_cap.py DTYPE QUANTIZE` with ONEDNN_VERBOSE=1:
each projection at every row count the doctor's probes call it with (`specdec doctor --synthetic`:
1..64 rows, a tree's 8, ragged rows' 12 and 15), then the chunked windows through the model at one
small context (hidden_only: the head's row counts are the loop's), so it takes seconds; then it
prints one line naming specdec's own kernel paths (attention's among them). oneDNN prints one `exec` line
per call, naming its implementation and shapes; the test compares those lines between caps.
"""

import json
import sys

import torch

from specdec.doctor import kernels_in_use
from specdec.models.native import NativeRunner
from specdec.models.native.invariance import PROJECTION_ROWS, QWEN2_5_1_5B_LAYER, TREE_PARENTS, \
    decoder_projections, hidden_only, probe_chunkings, random_decoder

# Beyond PROJECTION_ROWS, the model probes' forwards: a tree of 7 nodes and its root, and 3 ragged
# rows of 4 and then 5 tokens.
MODEL_ROWS = (len(TREE_PARENTS) + 1, 3 * 4, 3 * 5)


@torch.inference_mode()
def main(dtype: str, quantize: str) -> None:
    decoder = random_decoder(QWEN2_5_1_5B_LAYER, dtype=getattr(torch, dtype), quantize=quantize)
    for linear in decoder_projections(decoder).values():
        width = linear.in_features if hasattr(linear, "in_features") else linear.weight.shape[1]
        for rows in sorted(set(PROJECTION_ROWS) | set(MODEL_ROWS)):
            linear(torch.randn(rows, width).to(decoder.dtype))
    runner = NativeRunner(decoder, initial_cache_len=256)
    with hidden_only(decoder):
        probe_chunkings(runner, [65])
    sys.stdout.flush()
    print("specdec kernels: " + json.dumps(kernels_in_use(decoder), sort_keys=True), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
