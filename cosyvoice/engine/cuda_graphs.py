"""CUDA graphs of the scheduler's batched decode step, one per batch bucket, over the static KV-cache length.

UNVERIFIED: written without a GPU (none was lent when this landed); nothing runs it on the CPU, and the
engine uses it only when asked (``Engine(..., cuda_graphs=True)``, benchmark ``--cuda-graphs``). What must
be measured and checked on a GPU is listed in docs/perf.md.

Why: an eager decode step of the released Qwen2-0.5B is ~940 kernel launches, so it is bound by launch
latency, not by the GPU. A graph replays the whole step (embeddings in, log-probs out) as one launch. The
step is captured for a batch of ``bucket`` rows (the row prefix ``0 .. bucket-1``) reading all
``max_positions`` slots under the position mask, so its shapes never change between steps; rows of the
prefix that do not decode get a dummy input at their own next slot, as in the eager batched step.
"""

from __future__ import annotations

import logging

import torch

from cosyvoice.llm import CosyVoice3LM, KVCache

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class GraphedDecoder:
    """``decode(embeds [b, 1, H], positions [b, 1]) -> log-probs [b, V]`` for b = :meth:`bucket` (CUDA only)."""

    def __init__(self, lm: CosyVoice3LM, cache: KVCache) -> None:
        if cache.device.type != "cuda":
            raise ValueError("CUDA graphs need the KV cache on a CUDA device")
        self.lm, self.cache = lm, cache
        # one private memory pool per bucket: buckets replay in any order, which a shared pool does not allow
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def bucket(self, rows: int) -> int:
        """The smallest captured batch size that covers ``rows`` (at most the pool's rows)."""
        return next((b for b in BUCKETS if b >= rows and b <= self.cache.batch), self.cache.batch)

    def _step(self, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rows = self.cache.view(0, embeds.shape[0])  # every slot: a fixed shape
        hidden = self.lm.llm(embeds, positions, rows)
        return self.lm.log_probs(hidden[:, 0])

    def decode(self, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b = embeds.shape[0]
        if b not in self._graphs:
            self._capture(embeds, positions)
        graph, static_embeds, static_positions, out = self._graphs[b]
        static_embeds.copy_(embeds)
        static_positions.copy_(positions)
        graph.replay()
        return out

    def _capture(self, embeds: torch.Tensor, positions: torch.Tensor) -> None:
        static_embeds, static_positions = embeds.clone(), positions.clone()
        side = torch.cuda.Stream(embeds.device)
        side.wait_stream(torch.cuda.current_stream(embeds.device))
        with torch.cuda.stream(side):  # warm-up outside the graph (allocator, kernel selection)
            for _ in range(2):
                self._step(static_embeds, static_positions)
        torch.cuda.current_stream(embeds.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._step(static_embeds, static_positions)
        self._graphs[embeds.shape[0]] = (graph, static_embeds, static_positions, out)
        logger.info("captured the decode step for %d rows", embeds.shape[0])
