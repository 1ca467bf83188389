"""The LLM scheduler: the only thread that runs the LLM, for every session at once (continuous batching).

It runs :mod:`jobs <cosyvoice.llm.job>` in the shape of vLLM v1's engine core, one iteration at a time:

1. :meth:`LLMScheduler.schedule`: sleep until something can run; retire cancelled tickets; admit waiting ones
   into free KV-cache rows (lowest row first, so held rows stay a short prefix) and start their jobs; re-poll
   parked ones that were woken; return a :class:`~cosyvoice.engine.plan.SchedulePlan` of the rows that step:
   multi-embedding steps (prefill, text-stream extensions) and one-embedding decode steps;
2. :meth:`LLMRunner.execute <cosyvoice.engine.runner.LLMRunner.execute>` runs the plan on the device (it owns
   the KV slot pool, the CUDA graphs and sampling) and returns each stepping ticket's token;
3. :meth:`LLMScheduler.update`: the tickets advance by their step, tokens go to the jobs (``send``), emitted
   tokens to the tickets' listeners; finished, failed and cancelled jobs free their row; listeners of ended
   tickets are told once the step is over.

A ticket's lifecycle is its :class:`~cosyvoice.engine.plan.Status`. Sessions beyond the pool's rows wait in
the queue for a row (the engine has no admission of its own: the service's is the only one). A job that yields
``Wait`` is parked until :meth:`LLMScheduler.wake` (a text stream's listener); a ticket the engine holds back
(:meth:`LLMScheduler.hold`: its session's first chunk is being computed) keeps its row but does not step until
released; when nothing can run, the thread sleeps on a condition variable (no polling).
"""

from __future__ import annotations

import heapq
import logging
import threading
from collections import deque

import torch

from cosyvoice.engine.plan import SchedulePlan, Status, Ticket
from cosyvoice.engine.runner import LLMRunner
from cosyvoice.errors import ResourceLimitError
from cosyvoice.llm import CosyVoice3LM
from cosyvoice.llm.job import Wait

logger = logging.getLogger(__name__)


class LLMScheduler:
    """Continuous batching of LLM jobs on one device; see the module docstring."""

    def __init__(self, lm: CosyVoice3LM, rows: int, max_positions: int, name: str = "cosyvoice-scheduler",
                 cuda_graphs: bool = False, threads: int | None = None) -> None:
        self.lm = lm
        self.threads = threads  # intra-op threads of this thread's torch calls (None: torch's global setting)
        self.cuda_graphs = cuda_graphs
        self.rows = rows
        self.max_positions = max_positions
        self.name = name
        self.runner: LLMRunner | None = None  # made with the thread: the KV pool is allocated on first use
        self._cond = threading.Condition()
        self._waiting: deque[Ticket] = deque()
        self._free = list(range(rows))  # a heap: the lowest free row is taken first
        self._held: dict[int, Ticket] = {}  # row -> the ticket holding it (RUNNING or PARKED)
        self._aborted: set[Ticket] = set()  # cancelled from another thread, retired at the next schedule
        self._woken: set[Ticket] = set()  # their input may have changed: re-polled once parked
        self._held_back: set[Ticket] = set()  # RUNNING, but not stepped until released (hold)
        self._done: list[tuple[Ticket, BaseException | None]] = []  # retired this step, listeners not yet told
        self._thread: threading.Thread | None = None
        self._stop = False

    @property
    def steps(self) -> int:
        """Iterations that ran a forward call."""
        return self.runner.steps if self.runner is not None else 0

    # ------------------------------------------------------------------ other threads

    def submit(self, ticket: Ticket) -> None:
        """Queue a ticket; it is admitted between steps as soon as a row is free (one cancelled before it was
        submitted has ended already: it is not queued)."""
        with self._cond:
            if self._stop:
                raise ResourceLimitError("the engine was shut down (Engine.close()); create a new one")
            if ticket.status.finished:
                return
            if self._thread is None:
                self.runner = LLMRunner(self.lm, self.rows, self.max_positions, self.cuda_graphs)
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
            self._waiting.append(ticket)
            self._cond.notify()

    def wake(self, ticket: Ticket) -> None:
        """The ticket's input may have changed: re-poll it if it is parked (now or once it parks)."""
        with self._cond:
            if not ticket.status.finished:
                self._woken.add(ticket)
                self._cond.notify()

    def hold(self, ticket: Ticket, held: bool) -> None:
        """Hold the ticket back from the steps after the current one (``held``) or release it. Why: on a CPU the
        LLM's decoding beyond what its session's pending first chunk needs takes the cores that chunk runs on."""
        with self._cond:
            if held and not ticket.status.finished:
                self._held_back.add(ticket)
            elif not held and ticket in self._held_back:
                self._held_back.discard(ticket)
                self._cond.notify()

    def cancel(self, ticket: Ticket) -> None:
        """Stop the ticket before its next step; its ``on_done(None)`` follows from the scheduler thread."""
        with self._cond:
            if not ticket.status.finished:
                self._aborted.add(ticket)
                self._cond.notify()

    def stepping(self) -> bool:
        """Whether the LLM has a step to run: a running ticket not held back, a woken parked one, a ticket to admit
        or to retire. When it has none (held for a first chunk, finished, waiting for text), the token-to-wave
        worker widens its own torch team to the cores this thread leaves idle."""
        with self._cond:
            return self._runnable()

    @property
    def active(self) -> int:
        with self._cond:
            return len(self._held) + len(self._waiting)

    def stop(self) -> None:
        """Ask the thread to end after its current step (waiting and held tickets end with an error)."""
        with self._cond:
            self._stop = True
            self._cond.notify()

    def close(self) -> None:
        """:meth:`stop`, wait for the thread, free the KV pool and graphs."""
        self.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self.runner = None

    # ------------------------------------------------------------------ the scheduler thread

    @torch.inference_mode()  # jobs build their next inputs in send(): no autograd anywhere in this thread
    def _loop(self) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)  # this thread's OpenMP team only (docs/perf.md, "Threads")
        while (plan := self.schedule()) is not None:
            if plan.tickets:
                self._step(plan)
            del plan  # hold no finished ticket (nor its listeners' owners) while asleep
            self._notify_done()  # after the step's tensors are gone: a finished session finds nothing held
        with self._cond:
            left = [*self._held.values(), *self._waiting, *self._aborted]
            self._waiting.clear()
        err = ResourceLimitError("the engine was shut down")
        for t in left:
            self._retire(t, Status.FINISHED_ERROR, err)
        self._notify_done()

    def _step(self, plan: SchedulePlan) -> None:
        """Execute and update one plan; a failed device call ends the tickets in it, not the scheduler."""
        try:
            tokens = self.runner.execute(plan)
        except BaseException as exc:
            for t in plan.tickets:
                self._retire(t, Status.FINISHED_ERROR, exc)
            return
        self.update(plan, tokens)

    def _notify_done(self) -> None:
        done, self._done = self._done, []
        for t, error in done:
            try:
                t.on_done(error)
            except Exception:  # a listener's bug must not stop the scheduler
                logger.exception("LLM ticket listener failed")

    # ------------------------------------------------------------------ 1. schedule

    def _runnable(self) -> bool:
        """Whether an iteration has anything to do (under the lock)."""
        return bool(self._aborted or (self._waiting and self._free)) or any(
            (t.status is Status.RUNNING and t not in self._held_back) or t in self._woken
            for t in self._held.values())

    def schedule(self) -> SchedulePlan | None:
        """Sleep until something can run; retire cancelled, admit and start, re-poll woken tickets; the plan of
        the rows that step. None once the scheduler is stopped."""
        with self._cond:
            while not self._stop and not self._runnable():
                self._cond.wait()
            if self._stop:
                return None
            aborted, self._aborted = self._aborted, set()
            for t in aborted:
                if t in self._waiting:
                    self._waiting.remove(t)
            admitted = []
            while self._waiting and self._free:
                t = self._waiting.popleft()
                t.row = heapq.heappop(self._free)
                self._held[t.row] = t
                admitted.append(t)
            woken = [t for t in self._held.values() if t.status is Status.PARKED and t in self._woken]
            self._woken.difference_update(woken)
        for t in aborted:
            self._retire(t, Status.FINISHED_ABORTED)
        for t in admitted:
            self._advance(t, None, first=True)
        for t in woken:
            self._advance(t, None)
        return self._plan()

    def _plan(self) -> SchedulePlan:
        """The rows whose job asked for a step; a step past the row's positions ends its ticket instead."""
        plan = SchedulePlan()
        with self._cond:
            held_back = set(self._held_back)
        for t in sorted(self._held.values(), key=lambda t: t.row):
            if t.status is not Status.RUNNING or t in held_back:
                continue
            n = t.request.embeds.shape[0]
            if t.position + n > self.max_positions:
                self._retire(t, Status.FINISHED_LENGTH, ResourceLimitError(
                    f"the utterance reached the engine's {self.max_positions} LLM positions per session; split the "
                    "text into shorter segments or raise COSYVOICE_MAX_LLM_POSITIONS"))
            else:
                (plan.decode if n == 1 else plan.prefill).append(t)
        prefilled = {t.row: t.request.embeds.shape[0] for t in plan.prefill}
        plan.slots = {row: t.position + prefilled.get(row, 0) for row, t in self._held.items()}
        return plan

    # ------------------------------------------------------------------ 3. update

    def update(self, plan: SchedulePlan, tokens: dict[Ticket, int | None]) -> None:
        """Each stepping ticket advances by its step and its job gets its token; what it emits goes to its
        listener; ended jobs free their rows."""
        for t in plan.tickets:
            t.position += t.request.embeds.shape[0]
            if t.request.sample:
                t.counter += 1
            self._advance(t, tokens[t])

    def _advance(self, t: Ticket, value: int | None, first: bool = False) -> None:
        """Resume the job with ``value`` (its first ``next`` when ``first``); pass on what it emits.

        A failure of the job or of its listener ends that ticket only, never the plan.
        """
        try:
            request = next(t.job) if first else t.job.send(value)
        except StopIteration as finished:
            if self._emit(t, finished.value or ()):
                self._retire(t, Status.FINISHED_STOPPED)
            return
        except Exception as exc:
            self._retire(t, Status.FINISHED_ERROR, exc)
            return
        if not self._emit(t, request.emit):
            return
        parked = isinstance(request, Wait)
        t.status = Status.PARKED if parked else Status.RUNNING
        t.request = None if parked else request

    def _emit(self, t: Ticket, tokens: tuple[int, ...]) -> bool:
        """Pass ``tokens`` to the ticket's listener; False (the ticket ended) if the listener failed."""
        try:
            if tokens:
                t.on_tokens(tuple(tokens))
        except Exception as exc:
            self._retire(t, Status.FINISHED_ERROR, exc)
            return False
        return True

    def _retire(self, t: Ticket, status: Status, error: BaseException | None = None) -> None:
        """End a ticket: free its row, close its job; its listener is told (once) after the step."""
        with self._cond:
            if t.status.finished:
                return
            t.status = status
            if self._held.get(t.row) is t:
                del self._held[t.row]
                heapq.heappush(self._free, t.row)
            self._woken.discard(t)
            self._aborted.discard(t)
            self._held_back.discard(t)
        t.request = None
        try:
            t.job.close()
        except Exception:  # a job's cleanup failing must not stop the scheduler
            logger.exception("LLM job failed to close")
        self._done.append((t, error))  # told once the step is over (_notify_done)
