"""The reference's strategy, kept OUT of the production engine as the benchmark baseline.

:class:`ReferenceEngine` runs each request as the official CosyVoice does: an LLM thread of its own per request
(batch 1, a KV cache of its own: :func:`run_ticket_eager`), and flow + vocoder in the caller's thread, by default
re-run over the whole utterance for every chunk. It uses the production engine's parts for everything else (the
LLM job, the chunk policy and token-to-wave state, the seeded sampler at B = 1), so for a seed it gives the batched
engine's tokens and audio, and the benchmark compares strategies, not implementations.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator

import torch

from cosyvoice.config import CosyVoice3Config
from cosyvoice.engine import AudioChunk, CancelToken, Session, Ticket, Token2Wav
from cosyvoice.engine.engine import llm_job
from cosyvoice.flow import CausalMaskedDiffWithDiT
from cosyvoice.frontend.frontend import ModelInput
from cosyvoice.hifigan import CausalHiFTGenerator
from cosyvoice.llm import CosyVoice3LM
from cosyvoice.llm.job import run_eager
from cosyvoice.llm.sampling import SeededSampler
from cosyvoice.settings import Limits


def run_ticket_eager(lm: CosyVoice3LM, ticket: Ticket, positions: int, wait: Callable[[], None] | None = None,
                     should_stop: Callable[[], bool] | None = None) -> None:
    """Run one ticket alone on the calling thread with a KV cache of ``positions`` of its own (the reference's
    strategy). Same job, same sampler at B = 1, so it gives the scheduler's tokens for a seed; ``should_stop`` is
    polled before every step."""
    error: BaseException | None = None
    try:
        cache = lm.llm.new_cache(1, positions)
        with torch.inference_mode():
            for token in run_eager(lm, ticket.job, cache, SeededSampler(ticket.seed, lm.cfg.sampling), wait=wait,
                                   should_stop=should_stop):
                ticket.on_tokens((token,))
    except BaseException as exc:  # handed to the listener, which re-raises it in the consumer's thread
        error = exc
    finally:
        ticket.on_done(error)


class ReferenceEngine:
    """``synthesize`` / ``close`` / ``active_sessions`` as :class:`~cosyvoice.engine.Engine`, the reference's way."""

    def __init__(self, config: CosyVoice3Config, llm: CosyVoice3LM, flow: CausalMaskedDiffWithDiT,
                 hift: CausalHiFTGenerator, device: torch.device, limits: Limits | None = None,
                 fixed_tokens: int | None = None,
                 incremental_flow: bool = False, incremental_vocoder: bool = False) -> None:
        self.llm, self.limits, self.fixed_tokens = llm.eval(), limits or Limits(), fixed_tokens
        self.sample_rate = config.sample_rate
        self.t2w = Token2Wav(config, flow.eval(), hift.eval(), device, incremental_flow, incremental_vocoder)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._running = 0

    @property
    def active_sessions(self) -> int:
        with self._lock:
            return self._running

    def close(self) -> None:
        """Nothing to stop: each request's thread ends with it."""

    def synthesize(self, inp: ModelInput, stream: bool = False, speed: float = 1.0, seed: int = 0,
                   sample_offset: int = 0, first_index: int = 0, *, fixed_tokens: int | None = None,
                   cancel: CancelToken | None = None) -> Iterator[AudioChunk]:
        fixed = self.fixed_tokens if fixed_tokens is None else CosyVoice3LM.check_fixed_tokens(fixed_tokens)
        job, positions = llm_job(self.llm, inp, self.limits, None, fixed)
        session = Session(id=next(self._ids), seed=seed, inp=inp, stream=stream, speed=float(speed),
                          sample_offset=sample_offset, first_index=first_index)
        return self._run(session, job, positions, cancel)

    def _run(self, session: Session, job, positions: int, cancel: CancelToken | None) -> Iterator[AudioChunk]:
        def on_tokens(tokens: tuple[int, ...]) -> None:
            session.add_tokens(tokens)
            session.wake_reader()

        def on_done(error: BaseException | None) -> None:
            session.llm_finished(error)
            session.wake_reader()

        ticket = Ticket(job, session.seed, on_tokens, on_done)
        session.cancel.subscribe(session.wake_reader)
        unlink = cancel.subscribe(session.cancel.cancel) if cancel is not None else (lambda: None)
        stopped = threading.Event()
        thread = threading.Thread(target=run_ticket_eager, args=(self.llm, ticket, positions, None, stopped.is_set),
                                  daemon=True, name=f"reference-llm-{session.id}")
        state = self.t2w.open(session)
        with self._lock:
            self._running += 1
        thread.start()
        try:
            while True:
                with session.cond:
                    session.cond.wait_for(lambda: state.due(session) or session.cancelled)
                if session.cancelled:
                    return
                work = state.take(session)
                if isinstance(work, BaseException):
                    raise work
                chunk = self.t2w.chunk(session, state, work)  # in the caller's thread
                if chunk is None:  # cancelled meanwhile
                    return
                yield chunk
                if chunk.final:
                    return
        finally:
            unlink()
            stopped.set()
            thread.join()
            with self._lock:
                self._running -= 1
