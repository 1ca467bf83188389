"""The DiT's incremental state: each finished chunk's keys/values and position-conv tails per block
(:class:`DiTCache`), grown in place with room to spare so a stream copies its cache a logarithmic number of times,
and the row and stacking views the batched flow uses; :class:`PastFrames` and :func:`attend_past`, the cached
graph's reading of a block's past in place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from cosyvoice.system.pages import mapped_zeros


@dataclass
class DiTCache:
    """State of the finished frames ``0 .. length-1`` of one utterance at one ODE time.

    ``length`` is a multiple of the chunk size: under the chunk mask these frames are final.
    ``conv_tails`` are the last kernel-1 inputs of each position conv, ``kv`` each block's
    keys/values [B, heads, length, dim_head] (after RoPE).
    """

    length: int
    conv_tails: tuple[Tensor, Tensor]
    kv: list[tuple[Tensor, Tensor]]


#: a cache buffer that must grow holds this much more than it needs, so a stream copies its keys/values a
#: logarithmic number of times over its life instead of once per chunk
GROWTH = 1.5
#: on the CPU, at least this many frames of room (20 s of speech): the room is never written before the stream reaches
#: it, so it costs address space, not memory (:func:`~cosyvoice.system.pages.mapped_zeros`), and a stream up to that
#: long copies its cache once, when it starts from its voice's shared prefix, instead of once per growth
ROOM_FRAMES = 1024


def append_frames(past: Tensor, new: Tensor) -> Tensor:
    """``past`` [B, H, L, D] followed by ``new`` [B, H, n, D] along the frames, written in place into the buffer
    ``past`` is the start of when that buffer has room (the stream's own, :func:`owns_room`), else into a new
    buffer with room to grow (:data:`GROWTH`; on the CPU at least :data:`ROOM_FRAMES`, in a mapping of its own);
    returns the [B, H, L + n, D] view. The frames after ``L`` of a
    buffer are scratch: only a stream's own cache (never a shared voice prefix, :func:`compact`) has any. A traced
    or compiled graph (ONNX export, ``torch.compile``) gets the plain concatenation: no storage, no shape logic."""
    if torch.jit.is_tracing() or torch.compiler.is_compiling():
        return torch.cat((past, new), dim=2)
    b, h, length, d = past.shape
    total = length + new.shape[2]
    if owns_room(past, total):
        out = past.as_strided((b, h, total, d), past.stride())
    else:
        if past.device.type == "cpu":
            buffer = mapped_zeros((b, h, max(total + ROOM_FRAMES, int(total * GROWTH)), d), past.dtype)
        else:  # device memory is committed when allocated (and TensorRT's profiles bound the room by GROWTH)
            buffer = past.new_empty(b, h, max(total, int(total * GROWTH)), d)
        out = buffer[:, :, :total]
        out[:, :, :length] = past
    out[:, :, length:] = new
    return out


class PastFrames(NamedTuple):
    """A block's past keys/values [B, H, L, D] that the attention reads where they are and never extends: the
    exported cached graph's past (slices of the stream's buffers), so the graph returns only the new frames' keys/values
    and the runner appends them in place (:func:`append_frames`) instead of the graph copying the whole cache out."""

    k: Tensor
    v: Tensor


#: how far below its row's top score a score is clamped before exp(): e^-80 (~1.8e-35) is beneath float32's
#: resolution of the softmax's sum, which is at least 1 (the top's own term). onnxruntime-CPU's exp() takes a slow
#: path wherever its result underflows (~18x per element, docs/perf.md), as every masked score's (-inf) does
SCORE_FLOOR = -80.0


def attend_past(q: Tensor, k: Tensor, v: Tensor, past: PastFrames, mask: Tensor) -> Tensor:
    """Attention of ``q`` over ``past`` then ``k``/``v`` (the new frames) under the boolean ``mask`` [n, L + n],
    without joining keys, values or scores: one softmax over both score blocks, shifted by their common maximum
    (onnxruntime-CPU: ~25% less than concatenating the scores at 3000 past frames, docs/perf.md). The softmax is
    float32 whatever the products' dtype, as autocast keeps it in the fp16 graphs.

    Only the mask's columns of the new frames are read: the past is finished chunks, which every query of a
    chunk-causal or full mask sees. The new frames' mask enters as an additive bias (0 or -inf; onnxruntime's
    ``Where`` over the broadcast scores costs ~6x its ``Add``), and their shifted scores are clamped at
    :data:`SCORE_FLOOR` before exp(), so a masked key weighs e^-80 of the top one instead of exactly 0."""
    length = past.k.shape[2]
    q = q * q.shape[-1] ** -0.5
    bias = torch.where(mask[:, length:], 0.0, float("-inf"))
    old = (q @ past.k.transpose(-1, -2)).float()
    new = (q @ k.transpose(-1, -2)).float() + bias
    top = torch.maximum(old.amax(-1, keepdim=True), new.amax(-1, keepdim=True))  # an empty past's max is -inf
    old, new = (old - top).exp(), (new - top).clamp_min(SCORE_FLOOR).exp()
    return (old @ past.v + new @ v) / (old.sum(-1, keepdim=True) + new.sum(-1, keepdim=True))


def owns_room(past: Tensor, frames: int) -> bool:
    """Whether ``past`` is the leading frames of a [B, H, capacity, D] buffer of at least ``frames`` frames."""
    b, h, _, d = past.shape
    capacity = past.stride(1) // d
    dense = past.stride() == (h * capacity * d, capacity * d, d, 1)
    return dense and past.storage_offset() == 0 and capacity >= frames \
        and past.untyped_storage().nbytes() >= b * h * capacity * d * past.element_size()


def compact(cache: DiTCache) -> DiTCache:
    """``cache`` with its keys/values exactly their frames (no room): for a cache shared by streams, which must
    never write into one buffer's scratch frames at once. Tensors that already are (a graph's outputs) stay."""
    def exact(t: Tensor) -> Tensor:
        alone = t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes
        return t if alone else t.clone()

    return DiTCache(cache.length, cache.conv_tails, [(exact(k), exact(v)) for k, v in cache.kv])


def cache_rows(cache: DiTCache | None, lo: int, hi: int) -> DiTCache | None:
    """Rows ``lo .. hi-1`` of a cache (views)."""
    if cache is None:
        return None
    return DiTCache(cache.length, (cache.conv_tails[0][lo:hi], cache.conv_tails[1][lo:hi]),
                    [(k[lo:hi], v[lo:hi]) for k, v in cache.kv])


def cache_cat(caches: list[DiTCache]) -> DiTCache:
    """Stack caches of equal length row-wise."""
    assert len({c.length for c in caches}) == 1
    return DiTCache(caches[0].length, tuple(torch.cat([c.conv_tails[i] for c in caches]) for i in range(2)),
                    [(torch.cat([c.kv[i][0] for c in caches]), torch.cat([c.kv[i][1] for c in caches]))
                     for i in range(len(caches[0].kv))])
