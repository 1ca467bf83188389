"""The LLM runner: the device side of the scheduler's loop (vLLM v1's model runner).

:meth:`LLMRunner.execute` does every model call of one :class:`~cosyvoice.engine.plan.SchedulePlan`: each prefill
row alone on its view of the KV slot pool, then ONE batched decode call over the row prefix ``0 .. hi-1``
(replayed from a CUDA graph per batch bucket when asked; a failed capture falls back to eager decoding for good),
the bans, ONE batched sampling call and ONE host sync (``tolist``). It owns the pool and the graphs and keeps no
per-ticket state: positions and draw counters live on the tickets, which the scheduler's update advances.
Randomness is per ticket (seed + draw counter, :func:`~cosyvoice.llm.sampling.ras_sample_rows`), so a row's
tokens do not depend on its neighbours.
"""

from __future__ import annotations

import logging

import torch

from cosyvoice.engine.cuda_graphs import GraphedDecoder
from cosyvoice.engine.plan import SchedulePlan, Ticket
from cosyvoice.llm import CosyVoice3LM
from cosyvoice.llm.sampling import history_tails, ras_sample_rows, to_device

logger = logging.getLogger(__name__)


class LLMRunner:
    """Runs plans on one device with a KV-cache pool of ``rows`` rows of ``max_positions`` slots."""

    def __init__(self, lm: CosyVoice3LM, rows: int, max_positions: int, cuda_graphs: bool = False) -> None:
        self.lm = lm
        self.max_positions = max_positions
        self.cache = lm.llm.new_cache(rows, max_positions)
        # CUDA only, unverified: see cosyvoice/engine/cuda_graphs.py
        self.graphed = GraphedDecoder(lm, self.cache) if cuda_graphs and self.cache.device.type == "cuda" else None
        self.steps = 0  # plans that ran a forward call

    def execute(self, plan: SchedulePlan) -> dict[Ticket, int | None]:
        """The model calls of one plan; each stepping ticket's sampled token (None: its job picks its own)."""
        logps = {t: self._prefill(t) for t in plan.prefill}
        if plan.decode:
            logps.update(zip(plan.decode, self._decode(plan), strict=True))
        self.steps += 1
        return self._sample(plan.tickets, logps)

    def _prefill(self, t: Ticket) -> torch.Tensor:
        """Feed a multi-embedding step on the ticket's row alone; the log-probs [V] after its last embedding."""
        _, logp = self.lm.decode_step(t.request.embeds[None], t.position, self.cache.view(t.row, t.row + 1))
        return logp[0]

    def _decode(self, plan: SchedulePlan) -> list[torch.Tensor]:
        """One forward call for the one-embedding steps over the row prefix; their log-probs."""
        decoding = plan.decode
        hi = max(t.row for t in decoding) + 1
        if self.graphed is not None:
            hi = self.graphed.bucket(hi)
        first = decoding[0].request.embeds
        embeds = first.new_zeros(hi, 1, first.shape[-1])
        for t in decoding:
            embeds[t.row, 0] = t.request.embeds[0]
        # rows that do not step write a dummy at their own next slot (never read); free rows at slot 0
        positions = [min(plan.slots.get(row, 0), self.max_positions - 1) for row in range(hi)]
        pos = to_device(positions, first.device, torch.int64)[:, None]
        logp = self._replay(embeds, pos)
        if logp is None:
            hidden = self.lm.llm(embeds, pos, self.cache.view(0, hi, slots=max(positions) + 1))
            logp = self.lm.log_probs(hidden[:, 0])
        return [logp[t.row] for t in decoding]

    def _replay(self, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The graphed decode step's log-probs, or None to decode eagerly (no graphs, or their capture failed)."""
        if self.graphed is None:
            return None
        try:
            return self.graphed.decode(embeds, positions)
        except RuntimeError:  # a failed capture must not take the engine down: decode eagerly from now on
            logger.exception("CUDA graph capture of the decode step failed; decoding eagerly")
            self.graphed = None
            return None

    def _sample(self, tickets: list[Ticket], logps: dict[Ticket, torch.Tensor]) -> dict[Ticket, int | None]:
        """Bans, then one batched draw for the tickets whose step samples; the step's one host sync."""
        sampling = [t for t in tickets if t.request.sample]
        tokens: dict[Ticket, int | None] = dict.fromkeys(tickets)
        if not sampling:
            return tokens
        scores = self.lm.apply_bans(torch.stack([logps[t] for t in sampling]), [t.request for t in sampling])
        cfg = self.lm.cfg.sampling
        device = scores.device
        tails = to_device(history_tails([t.request.history for t in sampling], cfg.win_size), device)
        seeds = to_device([t.seed for t in sampling], device, torch.int64)
        counters = to_device([t.counter for t in sampling], device, torch.int64)
        drawn = ras_sample_rows(scores, tails, seeds, counters, cfg).tolist()
        tokens.update(zip(sampling, drawn, strict=True))
        return tokens
