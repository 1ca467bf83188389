"""What the LLM scheduler and its runner pass each other: a ticket per job, its status, one iteration's plan.

The shape of vLLM v1's engine core: :meth:`LLMScheduler.schedule <cosyvoice.engine.scheduler.LLMScheduler.schedule>`
returns a :class:`SchedulePlan`, :meth:`LLMRunner.execute <cosyvoice.engine.runner.LLMRunner.execute>` runs it on
the device and returns each stepping ticket's token, and ``update`` gives the tokens to the jobs. A ticket's
lifecycle is one :class:`Status`, written by the scheduler thread only.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from cosyvoice.llm.job import Job, Step

#: called with tokens to pass on (from the scheduler thread: must not block)
TokenListener = Callable[[tuple[int, ...]], None]
#: called once when the job has ended: None (finished or cancelled) or the exception that ended it
DoneListener = Callable[[BaseException | None], None]


class Status(enum.Enum):
    """Where a ticket is in its life; every ``FINISHED_*`` is final (its row is free, its job closed)."""

    WAITING = "waiting"  # queued for a KV-cache row
    RUNNING = "running"  # holds a row; its job asked for a step
    PARKED = "parked"  # holds a row; its job waits for input (a text stream) until woken
    FINISHED_STOPPED = "finished_stopped"  # the job ended by its own rule (a stop id, its max_len)
    FINISHED_LENGTH = "finished_length"  # the row's positions ran out (the job fails with ResourceLimitError)
    FINISHED_ABORTED = "finished_aborted"  # cancelled
    FINISHED_ERROR = "finished_error"  # the job, its listener or the device call failed, or the engine shut down

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED_")


@dataclass(eq=False)
class Ticket:
    """One LLM job in the scheduler: its seed and listeners; the rest is the scheduler thread's."""

    job: Job
    seed: int
    on_tokens: TokenListener
    on_done: DoneListener
    status: Status = Status.WAITING
    row: int = -1  # its KV-cache row once admitted
    position: int = 0  # slots filled: where its next step's embeddings go
    counter: int = 0  # random draws made: the position in its seeded stream
    request: Step | None = None  # the step its job asked for (RUNNING)


@dataclass
class SchedulePlan:
    """One iteration: which tickets step and where every held row's next slot is.

    ``prefill`` tickets feed several embeddings (a prompt, a text-stream extension), one at a time; ``decode``
    tickets one embedding each, in one batched call over the row prefix. ``slots`` maps every row held by a
    ticket (parked ones too) to its next free slot once this plan's prefills ran: rows of the prefix that do not
    decode get a dummy input there, which their next real step overwrites before anything reads it.
    """

    prefill: list[Ticket] = field(default_factory=list)
    decode: list[Ticket] = field(default_factory=list)
    slots: dict[int, int] = field(default_factory=dict)

    @property
    def tickets(self) -> list[Ticket]:
        return self.prefill + self.decode
