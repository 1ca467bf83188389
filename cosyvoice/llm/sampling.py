"""Repetition-aware sampling (VALL-E 2) of speech tokens, as the official ``ras_sampling``, for a batch of rows.

One function, :func:`ras_sample_rows`, samples every row of a [B, V] score batch on the scores'
device: the nucleus (top-p / top-k, the reference's float32 running sum), a draw from it, the
repetition check against each row's history tail, and the fallback draw from the full softmax
without the repeated token. Nothing in it reads a value back to the host, so the caller pays one
sync per step for all rows (``tokens.tolist()``).

Randomness is counter-based: a row's uniform numbers are an integer hash of (its session seed, its
draw counter), computed with int64 tensor ops on the device (:func:`uniforms`). No
``torch.Generator`` and no global RNG, so a seed gives the same tokens whatever else is in the
batch, on any runner: :class:`SeededSampler` is the same function with B = 1 for the eager path.
The reference's own draws come from ``torch.multinomial`` and cannot be replayed; parity asks that
its seeded draws lie in our candidate set (:func:`nucleus_candidates`, checked by the parity tool).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from cosyvoice.config import SamplingConfig

_MASK32 = 0xFFFFFFFF
_SEED_SALT = 0x3243F6A8  # digits of pi: keeps seed 0 from hashing a zero word


def nucleus_candidates(scores: torch.Tensor, top_p: float, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The nucleus the official sampler draws from: (token ids [n], their probabilities [n]).

    softmax, stable sort by descending probability, then keep the next token while the running
    sum of the kept probabilities is below ``top_p`` and fewer than ``top_k`` are kept: the token
    that crosses ``top_p`` is included. Probabilities are not renormalised (multinomial does not
    need it).
    """
    probs, ids = scores.softmax(dim=0).sort(descending=True, stable=True)
    head = probs[:top_k].detach().float().cpu().numpy()
    # the reference adds float32 scalars one at a time; numpy's float32 cumsum does the same
    # (torch.cumsum on CPU would accumulate in double), and the comparison happens in float32
    before = np.concatenate(([np.float32(0.0)], np.cumsum(head[:-1], dtype=np.float32)))
    n = int(np.count_nonzero(before < np.float32(top_p)))
    return ids[:n], probs[:n]


def nucleus_rows(scores: torch.Tensor, top_p: float, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`nucleus_candidates` for every row of ``scores`` [B, V], on their device.

    Returns (ids [B, k], probs [B, k], keep [B, k] bool): row b's candidates are the first
    ``keep[b].sum()`` entries, equal to ``nucleus_candidates(scores[b])``. The running sum is a
    sequence of float32 additions, one column at a time, as the reference adds its scalars.
    """
    probs = scores.float().softmax(dim=-1)
    k = min(top_k, probs.shape[-1])
    # the stable descending sort's first k, via top-k of a unique integer key: the float32 bits of a
    # non-negative probability order like the value; the low bits put lower indices first among equal ones
    shift = max(probs.shape[-1] - 1, 1).bit_length()
    index = torch.arange(probs.shape[-1], device=probs.device)
    key = probs.view(torch.int32).long() * (1 << shift) + ((1 << shift) - 1 - index)
    ids = key.topk(k, dim=-1).indices
    probs = probs.gather(1, ids)
    running = torch.zeros_like(probs[:, 0])
    before = [running]
    for j in range(k - 1):
        running = running + probs[:, j]
        before.append(running)
    keep = torch.stack(before, dim=1) < torch.tensor(top_p, dtype=torch.float32)
    return ids, probs, keep


# ----------------------------------------------------------------------------- counter-based randomness


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) without int64 overflow: multiply 16-bit halves separately."""
    lo = (x & 0xFFFF) * c
    hi = (((x >> 16) * c) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xor-shift / multiply, "lowbias32"): a bijection with full avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One float64 in [0, 1) per row, a pure function of (seed in [0, 2**63), counter in [0, 2**32)).

    Int64 tensor ops only, on the tensors' device: the same (seed, counter) gives the same number on
    every device and in every batch. 53 bits from two chained 32-bit hashes.
    """
    lo, hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    key = _hash32(_hash32(lo ^ _SEED_SALT) ^ hi)
    a = _hash32(key ^ (counters & _MASK32))
    b = _hash32(a ^ _SEED_SALT)
    bits = (a >> 5) * (1 << 26) + (b >> 6)  # 27 + 26 bits
    return bits.double() * (1.0 / (1 << 53))


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index per row drawn with probability proportional to ``weights`` [B, N] (>= 0), given ``u`` [B] in [0, 1).

    The first index whose running sum exceeds ``u * total``; zero-weight entries are never chosen.
    """
    cumulative = weights.double().cumsum(dim=-1)
    target = (u * cumulative[:, -1])[:, None]
    index = (cumulative <= target).sum(dim=-1)
    last = (weights > 0).long().cumsum(dim=-1).argmax(dim=-1)  # last positive entry (rounding guard)
    return torch.minimum(index, last)


# ----------------------------------------------------------------------------- the sampler


def ras_sample_rows(scores: torch.Tensor, tails: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
                    cfg: SamplingConfig) -> torch.Tensor:
    """One token per row of log-probs ``scores`` [B, V] (bans already applied), on their device.

    ``tails`` [B, W] are each row's last ``win_size`` decoded tokens (-1 where shorter); ``seeds`` and
    ``counters`` [B] int64 select the row's random numbers (draw ``2 * counter`` for the nucleus,
    ``2 * counter + 1`` for the fallback). A nucleus draw that already occurs ``win_size * tau_r``
    times in the tail is replaced by a draw from the softmax over all other tokens, as the reference.
    Returns int64 tokens [B] on the device (no host sync).
    """
    ids, probs, keep = nucleus_rows(scores, cfg.top_p, cfg.top_k)
    first = ids.gather(1, _inverse_cdf(probs * keep, uniforms(seeds, 2 * counters))[:, None])[:, 0]
    repeats = (tails == first[:, None]).sum(dim=-1)
    repeated = repeats >= cfg.win_size * cfg.tau_r
    banned = scores.float().scatter(1, first[:, None], -float("inf"))
    fallback = _inverse_cdf(banned.softmax(dim=-1), uniforms(seeds, 2 * counters + 1))
    return torch.where(repeated, fallback, first)


def to_device(data: torch.Tensor | Sequence, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small host array on ``device`` without a host sync: on CUDA through pinned memory and an asynchronous
    copy (a plain ``.to("cuda")`` of pageable memory synchronises the stream, once per tensor per step)."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def history_tails(histories: Sequence[Sequence[int]], win_size: int) -> torch.Tensor:
    """[B, win_size] int64 (CPU) of each history's last ``win_size`` tokens, left-padded with -1."""
    out = torch.full((len(histories), win_size), -1, dtype=torch.int64)
    for row, history in enumerate(histories):
        tail = list(history[-win_size:]) if win_size else []
        if tail:
            out[row, win_size - len(tail):] = torch.tensor(tail, dtype=torch.int64)
    return out


class SeededSampler:
    """One session's random stream as a ``Sampler`` for :func:`~cosyvoice.llm.job.run_eager`: B = 1 rows of
    :func:`ras_sample_rows`, with the draw counter advancing per sampled token exactly as the scheduler's."""

    def __init__(self, seed: int, cfg: SamplingConfig) -> None:
        self.seed, self.cfg, self.counter = int(seed), cfg, 0

    def __call__(self, scores: torch.Tensor, history: Sequence[int]) -> int:
        device = scores.device
        tails = to_device(history_tails([history], self.cfg.win_size), device)
        seeds = to_device([self.seed], device, torch.int64)
        counters = to_device([self.counter], device, torch.int64)
        self.counter += 1
        return int(ras_sample_rows(scores[None], tails, seeds, counters, self.cfg)[0])
