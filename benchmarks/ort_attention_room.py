"""How the cached DiT graph should read a key/value buffer with room, measured on one attention layer in onnxruntime.

The stream keeps each block's keys/values in a buffer [B, H, capacity, D] with up to GROWTH (1.5x) room after the
past. Inside the graph the attention can read the whole capacity with the room masked (more attention work) or
Slice the past first (a past-sized copy per block, freed after it); format 1 took the past exactly and returned
past + new (a copy that leaves the graph). One layer at the released sizes (CFG batch 2, 16 heads of 64), one
thread, onnxruntime's CPU memory arena off as in :class:`~cosyvoice.backends.ort.OrtGraph`; CPU milliseconds per
call (process time), the median of ``--repeats`` runs of ``--calls`` calls.

    python benchmarks/ort_attention_room.py --new 50 --past 250 500 1000 1500 3000
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyvoice.flow.dit_cache import PastFrames, attend_past

BATCH, HEADS, DIM_HEAD = 2, 16, 64


class Joined(nn.Module):
    """Format 1: past + new joined and returned."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, past_k: Tensor, past_v: Tensor, mask: Tensor
                ) -> tuple[Tensor, Tensor, Tensor]:
        k, v = torch.cat((past_k, k), dim=2), torch.cat((past_v, v), dim=2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask), k, v


class Sliced(nn.Module):
    """Format 2 as exported: the buffers sliced to the past (the mask's keys less its queries)."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, past_k: Tensor, past_v: Tensor, mask: Tensor) -> Tensor:
        length = mask.shape[1] - q.shape[2]
        return attend_past(q, k, v, PastFrames(past_k[:, :, :length], past_v[:, :, :length]), mask)


class Masked(nn.Module):
    """The alternative: attend over the whole capacity, the room masked out (the mask covers capacity + new)."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, past_k: Tensor, past_v: Tensor, mask: Tensor) -> Tensor:
        return attend_past(q, k, v, PastFrames(past_k, past_v), mask)


def session(module: nn.Module, n: int, folder: Path) -> object:
    import onnxruntime as ort

    names = ["q", "k", "v", "past_k", "past_v", "mask"]
    example = [torch.randn(BATCH, HEADS, n, DIM_HEAD) for _ in range(3)] + \
        [torch.randn(BATCH, HEADS, 8, DIM_HEAD) for _ in range(2)] + [torch.ones(n, 8 + n, dtype=torch.bool)]
    axes = {"past_k": {2: "capacity"}, "past_v": {2: "capacity"}, "mask": {1: "keys"}}
    path = folder / f"{type(module).__name__}.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, tuple(example), str(path), input_names=names, dynamic_axes=axes, dynamo=False,
                          opset_version=18)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.enable_cpu_mem_arena = 1, False
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def cpu_ms(run: object, feed: dict[str, np.ndarray], calls: int, repeats: int) -> float:
    run(None, feed)
    times = []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(calls):
            run(None, feed)
        times.append((time.process_time() - start) / calls * 1e3)
    return statistics.median(times)


def feeds(n: int, past: int, capacity: int, rng: np.random.Generator) -> dict[str, dict[str, np.ndarray]]:
    """Each variant's inputs for ``past`` frames in a buffer of ``capacity`` (room zeros: masked, never NaN)."""
    new = {name: rng.standard_normal((BATCH, HEADS, n, DIM_HEAD), dtype=np.float32) for name in "qkv"}
    exact = {f"past_{c}": rng.standard_normal((BATCH, HEADS, past, DIM_HEAD), dtype=np.float32) for c in "kv"}
    buffers = {name: np.concatenate((x, np.zeros((BATCH, HEADS, capacity - past, DIM_HEAD), np.float32)), axis=2)
               for name, x in exact.items()}
    mask = np.ones((n, past + n), bool)
    room = np.concatenate((mask[:, :past], np.zeros((n, capacity - past), bool), mask[:, past:]), axis=1)
    return {"Joined": {**new, **exact, "mask": mask}, "Sliced": {**new, **buffers, "mask": mask},
            "Masked": {**new, **buffers, "mask": room}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new", type=int, default=50, help="new frames per call (one chunk)")
    parser.add_argument("--past", type=int, nargs="+", default=[250, 500, 1000, 1500, 3000])
    parser.add_argument("--room", type=float, default=1.25, help="capacity / past (1..GROWTH; 1.25 on average)")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as folder:
        runs = {type(m).__name__: session(m, args.new, Path(folder)).run for m in (Joined(), Sliced(), Masked())}
        print(f"| past frames | format 1: joined, returned ms | slice the past ms | masked room ({args.room}x) ms |")
        print("| --- | --- | --- | --- |")
        for past in args.past:
            inputs = feeds(args.new, past, int(past * args.room), rng)
            ms = [cpu_ms(runs[name], inputs[name], args.calls, args.repeats) for name in runs]
            print(f"| {past} | " + " | ".join(f"{x:.2f}" for x in ms) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
