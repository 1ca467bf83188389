"""Speed change of a streamed utterance: linear time-scaling of the mel, chunk by chunk, before the vocoder.

Non-streaming synthesis stretches the whole mel at once (``F.interpolate(mel, size=int(T / speed),
mode="linear")``, the reference's rule). Output frame ``j`` of that reads the input at
``(j + 0.5) * T / N - 0.5``; streamed, ``T`` is not known yet, so :class:`MelTimeScale` reads at
``(j + 0.5) * speed - 0.5`` (``T / N`` differs from ``speed`` only by ``N``'s rounding), emits each output
frame as soon as both input frames it blends have arrived, and on the last chunk stops at the non-streamed
count ``int(T / speed)``. Concatenated chunks are therefore one continuous stretch of the whole mel (no
seam at chunk boundaries) with exactly the non-streamed number of frames.
"""

from __future__ import annotations

import math

import torch


class MelTimeScale:
    """Time-scales consecutive mel chunks [B, C, n] of one utterance by ``speed`` (> 1: faster, shorter)."""

    def __init__(self, speed: float) -> None:
        if not speed > 0:
            raise RuntimeError(f"speed must be positive, got {speed}")
        self.speed = float(speed)
        self._buf: torch.Tensor | None = None  # input frames [start, total) still needed
        self._start = 0  # absolute index of the first buffered input frame
        self._total = 0  # input frames received
        self._emitted = 0  # output frames produced
        self._finalized = False

    def _source(self, j: torch.Tensor) -> torch.Tensor:
        return ((j + 0.5) * self.speed - 0.5).clamp(min=0.0)

    def __call__(self, mel: torch.Tensor, finalize: bool) -> torch.Tensor:
        """The output frames that ``mel`` (the next input frames) completes; all the rest when ``finalize``."""
        if self._finalized:
            raise RuntimeError("this MelTimeScale was finalised; start a new one for a new utterance")
        self._finalized = finalize
        self._buf = mel if self._buf is None else torch.cat([self._buf, mel], dim=2)
        self._total += mel.shape[2]
        limit = int(self._total / self.speed)  # never more than a non-streamed run of the frames so far
        if not finalize:
            # frame j needs input floor(src_j) + 1 < total, i.e. (j + 0.5) * speed - 0.5 < total - 1
            limit = min(limit, max(0, math.ceil((self._total - 0.5) / self.speed - 0.5)))
        if limit <= self._emitted or self._total == 0:
            return mel[:, :, :0]
        j = torch.arange(self._emitted, limit, dtype=torch.float64)
        src = self._source(j)
        lo = src.floor().long().clamp(max=self._total - 1)
        hi = (lo + 1).clamp(max=self._total - 1)
        weight = (src - lo).to(mel.dtype).to(mel.device)
        buf = self._buf
        a = buf[:, :, (lo - self._start).to(buf.device)]
        b = buf[:, :, (hi - self._start).to(buf.device)]
        out = a + (b - a) * weight
        self._emitted = limit
        keep_from = int(self._source(torch.tensor(float(limit), dtype=torch.float64)).floor())
        keep_from = min(max(keep_from, self._start), self._total - 1)
        self._buf, self._start = buf[:, :, keep_from - self._start:], keep_from
        return out
