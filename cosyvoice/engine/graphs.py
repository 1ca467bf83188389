"""The packed DiT step compiled per static shape bucket: ``torch.compile`` (inductor) on the CPU, and on CUDA
with ``mode="reduce-overhead"``, which captures each bucket's step in a CUDA graph (one launch per Euler step
instead of hundreds). Opt-in: ``Engine(compile_dit=True)``.

Buckets: a packed call's rows (2 per session: classifier-free guidance) round up to a power of two, its new
frames to a multiple of 64 and its cached frames to a multiple of 256 (:func:`dit_buckets`); padded rows hold
one zero frame and no cache, and the chunk-causal masks keep real rows away from every padded key, so a bucket
only adds work, never changes a real row beyond float rounding. The policy's chunks (first hop padded to the
25-token grid, then 50, 100, 100 ... tokens: 50 k + 6 frames) fall into few buckets; the cache buckets grow
with the utterance, one compile each.

UNVERIFIED on CUDA (no GPU was lent when this landed): benchmarks/gpu_suite.py checks graphed == eager there.
On the CPU, tests/test_graphs.py checks compiled == eager.
"""

from __future__ import annotations

import torch

from cosyvoice.flow.dit import packed_trunk

ROW_BUCKETS = (2, 4, 8, 16, 32, 64)
WIDTH_STEP = 64
PAST_STEP = 256


def dit_buckets(rows: int, width: int, past: int) -> tuple[int, int, int]:
    """The shape bucket of a packed call with ``rows`` guidance rows, ``width`` new and ``past`` cached frames."""
    rows = next((b for b in ROW_BUCKETS if b >= rows), rows)
    return rows, -(-width // WIDTH_STEP) * WIDTH_STEP, -(-past // PAST_STEP) * PAST_STEP


class CompiledDiT:
    """``trunk`` (a compiled :func:`~cosyvoice.flow.dit.packed_trunk`) and its ``buckets``, for
    :func:`~cosyvoice.flow.extend_packed`."""

    buckets = staticmethod(dit_buckets)

    def __init__(self, device: torch.device, backend: str = "inductor", max_shapes: int = 64) -> None:
        import torch._dynamo  # only when compiling: it is slow to import

        # one compiled graph per bucket: let dynamo keep them all instead of falling back to eager after 8
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, max_shapes)
        mode = "reduce-overhead" if device.type == "cuda" and backend == "inductor" else None
        self.trunk = torch.compile(packed_trunk, dynamic=False, backend=backend, mode=mode)
