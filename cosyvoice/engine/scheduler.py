"""The LLM scheduler: the only thread that runs the LLM, for every session at once (continuous batching).

It owns a KV-cache slot pool allocated once (row = session, a static number of positions) and runs
:mod:`jobs <cosyvoice.llm.job>` in the shape of vLLM v1's engine core, one iteration at a time:

1. **schedule** (:meth:`LLMScheduler._schedule`): sleep until something can run; admit waiting tickets into
   free rows (lowest row first, so active rows stay a short prefix); retire cancelled ones; start new jobs
   and re-poll parked ones that were woken; the rows that step now form a :class:`StepBatch`: multi-embedding
   steps (prefill, text-stream extensions) and one-embedding decode steps;
2. **run** (:meth:`LLMScheduler._run`): prefill rows one at a time on a row view of the cache, then ONE batched
   decode call over the row prefix ``0 .. hi-1`` (rows without a step get a dummy input written at their own
   next slot, which their next real step overwrites before anything reads it), then ONE batched sampling call
   and ONE host sync (``tolist``);
3. **update** (:meth:`LLMScheduler._update`): tokens go to the jobs (``send``), emitted tokens to the tickets'
   listeners; finished, failed and cancelled jobs free their row; listeners of ended tickets are told.

Sessions beyond the pool's rows wait in the queue for a row (the engine has no admission of its own: the
service's is the only one). A job that yields ``Wait`` is parked until :meth:`LLMScheduler.wake` (a text
stream's listener); when nothing can run, the thread sleeps on a condition variable (no polling).
Randomness is per ticket (seed + draw counter, :func:`~cosyvoice.llm.sampling.ras_sample_rows`), so a row's
tokens do not depend on its neighbours.
"""

from __future__ import annotations

import heapq
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cosyvoice.engine.cuda_graphs import GraphedDecoder
from cosyvoice.errors import ResourceLimitError
from cosyvoice.llm import CosyVoice3LM, KVCache
from cosyvoice.llm.job import Job, Step, Wait
from cosyvoice.llm.sampling import history_tails, ras_sample_rows, to_device

#: called with tokens to pass on (from the scheduler thread: must not block)
TokenListener = Callable[[tuple[int, ...]], None]
#: called once when the job has ended: None (finished or cancelled) or the exception that ended it
DoneListener = Callable[[BaseException | None], None]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Ticket:
    """One LLM job in the scheduler: its seed, listeners, and the flags other threads set."""

    job: Job
    seed: int
    on_tokens: TokenListener
    on_done: DoneListener
    cancelled: bool = False
    woken: bool = False
    done: bool = False
    # owned by the scheduler thread
    row: int = -1
    position: int = 0
    counter: int = 0
    request: Step | Wait | None = None


@dataclass
class StepBatch:
    """The rows one iteration runs: multi-embedding steps (one at a time) and one-embedding steps (batched)."""

    prefill: list[Ticket] = field(default_factory=list)
    decode: list[Ticket] = field(default_factory=list)

    @property
    def tickets(self) -> list[Ticket]:
        return self.prefill + self.decode


class LLMScheduler:
    """Continuous batching of LLM jobs on one device; see the module docstring."""

    def __init__(self, lm: CosyVoice3LM, rows: int, max_positions: int, name: str = "cosyvoice-scheduler",
                 cuda_graphs: bool = False, threads: int | None = None) -> None:
        self.lm = lm
        self.threads = threads  # intra-op threads of this thread's torch calls (None: torch's global setting)
        self.cuda_graphs = cuda_graphs  # CUDA only, unverified: see cosyvoice/engine/cuda_graphs.py
        self.rows = rows
        self.max_positions = max_positions
        self.name = name
        self._cond = threading.Condition()
        self._pending: deque[Ticket] = deque()
        self._free = list(range(rows))  # a heap: the lowest free row is taken first
        self._active: dict[int, Ticket] = {}
        self._done: list[tuple[Ticket, BaseException | None]] = []  # retired this step, listeners not yet told
        self._cache: KVCache | None = None
        self._graphed: GraphedDecoder | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self.steps = 0  # batched iterations that ran a forward call

    # ------------------------------------------------------------------ other threads

    def submit(self, ticket: Ticket) -> None:
        """Queue a ticket; it is admitted between steps as soon as a row is free."""
        with self._cond:
            if self._stop:
                raise ResourceLimitError("the engine was shut down (Engine.close()); create a new one")
            if self._thread is None:
                self._cache = self.lm.llm.new_cache(self.rows, self.max_positions)
                if self.cuda_graphs and self._cache.device.type == "cuda":
                    self._graphed = GraphedDecoder(self.lm, self._cache)
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
            self._pending.append(ticket)
            self._cond.notify()

    def wake(self, ticket: Ticket) -> None:
        """The ticket's input may have changed: re-poll it if it is waiting."""
        with self._cond:
            ticket.woken = True
            self._cond.notify()

    def cancel(self, ticket: Ticket) -> None:
        """Stop the ticket before its next step; its ``on_done(None)`` follows from the scheduler thread."""
        with self._cond:
            ticket.cancelled = True
            self._cond.notify()

    @property
    def active(self) -> int:
        with self._cond:
            return len(self._active) + len(self._pending)

    def stop(self) -> None:
        """Ask the thread to end after its current step (pending and active tickets end with an error)."""
        with self._cond:
            self._stop = True
            self._cond.notify()

    def close(self) -> None:
        """:meth:`stop`, wait for the thread, free the cache."""
        self.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._cache = self._graphed = None

    # ------------------------------------------------------------------ the scheduler thread

    def _runnable(self, t: Ticket) -> bool:
        return t.cancelled or t.request is None or isinstance(t.request, Step) or t.woken

    @torch.inference_mode()  # jobs build their next inputs in send(): no autograd anywhere in this thread
    def _loop(self) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)  # this thread's OpenMP team only (docs/perf.md, "Threads")
        while (batch := self._schedule()) is not None:
            if batch.tickets:
                self._step(batch)
            del batch  # hold no finished ticket (nor its listeners' owners) while asleep
            self._notify_done()  # after the step's tensors are gone: a finished session finds nothing held
        with self._cond:
            left = [*self._active.values(), *self._pending]
            self._active.clear()
            self._pending.clear()
        err = ResourceLimitError("the engine was shut down")
        for t in left:
            self._retire(t, err)
        self._notify_done()

    def _notify_done(self) -> None:
        done, self._done = self._done, []
        for t, error in done:
            try:
                t.on_done(error)
            except Exception:  # a listener's bug must not stop the scheduler
                logger.exception("LLM ticket listener failed")

    def _step(self, batch: StepBatch) -> None:
        """Run and update one batch; a failed forward call ends the jobs in it, not the scheduler."""
        try:
            tokens = self._run(batch)
        except BaseException as exc:
            for t in batch.tickets:
                self._retire(t, exc)
            return
        self._update(batch, tokens)

    # ------------------------------------------------------------------ 1. schedule

    def _schedule(self) -> StepBatch | None:
        """Sleep until something can run; admit, retire cancelled, start and re-poll jobs; the rows that step."""
        with self._cond:
            while not self._stop and not (self._pending and self._free) and \
                    not any(self._runnable(t) for t in self._active.values()) and \
                    not any(t.cancelled for t in self._pending):
                self._cond.wait()
            if self._stop:
                return None
            dropped = [t for t in self._pending if t.cancelled]
            for t in dropped:
                self._pending.remove(t)
            while self._pending and self._free:
                t = self._pending.popleft()
                t.row = heapq.heappop(self._free)
                self._active[t.row] = t
            tickets = sorted(self._active.values(), key=lambda t: t.row)
            woken = set()
            for t in tickets:
                if isinstance(t.request, Wait) and t.woken:
                    t.woken = False
                    woken.add(t)
        for t in dropped:
            self._retire(t, None)
        for t in tickets:
            if t.cancelled:
                self._retire(t, None)
            elif t.request is None:
                self._advance(t, None, first=True)
            elif t in woken:
                self._advance(t, None)
        batch = StepBatch()
        for t in tickets:
            if t.done or not isinstance(t.request, Step):
                continue
            if t.position + t.request.embeds.shape[0] > self.max_positions:
                self._retire(t, ResourceLimitError(
                    f"the utterance reached the engine's {self.max_positions} LLM positions per session; split the "
                    "text into shorter segments or raise COSYVOICE_MAX_LLM_POSITIONS"))
            elif t.request.embeds.shape[0] == 1:
                batch.decode.append(t)
            else:
                batch.prefill.append(t)
        return batch

    # ------------------------------------------------------------------ 2. run

    def _run(self, batch: StepBatch) -> dict[Ticket, int | None]:
        """The model calls of one iteration; each stepping ticket's sampled token (None: the job picks its own)."""
        logps: dict[Ticket, torch.Tensor] = {}
        for t in batch.prefill:  # prefill / extend: one row at a time on its view of the pool
            _, logp = self.lm.decode_step(t.request.embeds[None], t.position, self._cache.rows(t.row, t.row + 1))
            logps[t] = logp[0]
            # advanced now: the batched call below writes this row's dummy at its NEXT slot, not over the first
            # slot it has just filled
            t.position += t.request.embeds.shape[0]
        if batch.decode:
            logps.update(zip(batch.decode, self._decode_batch(batch.decode), strict=True))
        for t in batch.decode:
            t.position += 1
        self.steps += 1
        sampling = [t for t in batch.tickets if t.request.sample]
        tokens: dict[Ticket, int | None] = dict.fromkeys(batch.tickets)
        if sampling:
            scores = self.lm.apply_bans(torch.stack([logps[t] for t in sampling]), [t.request for t in sampling])
            cfg = self.lm.cfg.sampling
            device = scores.device
            tails = to_device(history_tails([t.request.history for t in sampling], cfg.win_size), device)
            seeds = to_device([t.seed for t in sampling], device, torch.int64)
            counters = to_device([t.counter for t in sampling], device, torch.int64)
            drawn = ras_sample_rows(scores, tails, seeds, counters, cfg).tolist()  # the step's one host sync
            for t, token in zip(sampling, drawn, strict=True):
                t.counter += 1
                tokens[t] = token
        return tokens

    def _decode_batch(self, decoding: list[Ticket]) -> list[torch.Tensor]:
        """One forward call for the one-embedding steps of ``decoding`` over the row prefix; their log-probs."""
        hi = max(t.row for t in decoding) + 1
        if self._graphed is not None:
            hi = self._graphed.bucket(hi)
        hidden_size = decoding[0].request.embeds.shape[-1]
        first = decoding[0].request.embeds
        embeds = first.new_zeros(hi, 1, hidden_size)
        positions = [0] * hi
        for row in range(hi):  # rows that do not step write a dummy at their own next slot (never read)
            other = self._active.get(row)
            if other is not None:
                positions[row] = min(other.position, self.max_positions - 1)
        for t in decoding:
            embeds[t.row, 0] = t.request.embeds[0]
        pos = to_device(positions, first.device, torch.int64)[:, None]
        logp = None
        if self._graphed is not None:
            try:
                logp = self._graphed.decode(embeds, pos)
            except RuntimeError:  # a failed capture must not take the engine down: decode eagerly from now on
                logger.exception("CUDA graph capture of the decode step failed; decoding eagerly")
                self._graphed = None
        if logp is None:
            hidden = self.lm.llm.forward_cached(embeds, pos, self._cache.rows(0, hi), kv_len=max(positions) + 1)
            logp = self.lm.log_probs(hidden[:, 0])
        return [logp[t.row] for t in decoding]

    # ------------------------------------------------------------------ 3. update

    def _update(self, batch: StepBatch, tokens: dict[Ticket, int | None]) -> None:
        """Give each job its token; what it emits goes to its listener; ended jobs free their rows."""
        for t in batch.tickets:
            self._advance(t, tokens[t])

    def _advance(self, t: Ticket, value: int | None, first: bool = False) -> None:
        """Resume the job with ``value`` (its first ``next`` when ``first``); pass on what it emits.

        A failure of the job or of its listener ends that ticket only, never the batch.
        """
        request: Step | Wait | None = None
        try:
            request = next(t.job) if first else t.job.send(value)
            emit = request.emit
        except StopIteration as finished:
            emit = finished.value or ()
        except Exception as exc:
            self._retire(t, exc)
            return
        try:
            if emit:
                t.on_tokens(tuple(emit))
        except Exception as exc:
            self._retire(t, exc)
            return
        if request is None:
            self._retire(t, None)
        else:
            t.request = request

    def _retire(self, t: Ticket, error: BaseException | None) -> None:
        """End a ticket: free its row, close its job; its listener is told (once) after the step."""
        with self._cond:
            if t.done:
                return
            t.done = True
            if self._active.get(t.row) is t:
                del self._active[t.row]
                heapq.heappush(self._free, t.row)
        t.request = None
        try:
            t.job.close()
        except Exception:  # a job's cleanup failing must not stop the scheduler
            logger.exception("LLM job failed to close")
        self._done.append((t, error))  # told once the step is over (_notify_done)

