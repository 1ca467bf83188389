"""LLM jobs: one request's decoding algorithm as a coroutine, apart from whoever runs the network.

A job never touches the model. It yields :class:`Step` requests ("append these input embeddings to
my KV-cache row, then give me the next token") and receives the chosen token through ``send``. When
it needs input that has not arrived yet (a text stream), it yields :class:`Wait` and is resumed with
``send(None)`` once its input may have changed. Tokens for the listener travel in ``emit`` of the
next request, and in the generator's return value at the end.

So one algorithm serves every runner: :func:`run_eager` (one row at a time, the reference's strategy:
our test oracle and benchmark baseline) and the batched scheduler, which packs the one-embedding steps
of all active jobs into a single decode call. Jobs are built by :class:`~cosyvoice.llm.CosyVoice3LM`
(``generate_job``) and by the text-stream algorithm.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass

import torch

from cosyvoice.errors import ResourceLimitError


@dataclass(frozen=True)
class Step:
    """Feed ``embeds`` [T, H] at the row's next T positions, then pick the next token from the last one."""

    embeds: torch.Tensor
    history: Sequence[int] = ()  # tokens decoded so far (the job's own list): repetition-aware sampling reads its tail
    ban_sos: bool = False  # set index speech_token_size to -inf before sampling (min_len / ignore_eos rule)
    ban_stop: bool = False  # set every stop id to -inf before sampling (fixed-length benchmark requests)
    keep_fill: bool = False  # with ban_stop: the fill token stays allowed (text-stream decoding between text blocks)
    sample: bool = True  # False: the job decides this token itself and ignores what it is sent
    emit: tuple[int, ...] = ()  # tokens for the listener, produced since the previous request


@dataclass(frozen=True)
class Wait:
    """Nothing to feed until the job's input changes; resume with ``send(None)``."""

    emit: tuple[int, ...] = ()


#: yields Step | Wait, is sent the chosen token (Step) or None (Wait), returns the last tokens to emit
Job = Generator[Step | Wait, int | None, tuple[int, ...]]
#: (log-probs [V] after the ban, decoded history) -> token id
Sampler = Callable[[torch.Tensor, Sequence[int]], int]


def run_eager(lm, job: Job, cache, sample: Sampler, *, wait: Callable[[], None] | None = None,
              should_stop: Callable[[], bool] | None = None) -> Iterator[int]:
    """Run ``job`` alone on ``lm`` (a CosyVoice3LM) with its own ``cache`` (batch 1): a lazy token iterator.

    Work happens only when the consumer asks for the next token, so closing the iterator stops at
    once. ``should_stop`` is polled before every forward call; ``wait`` blocks until a waiting job's
    input may have changed (required for jobs that can wait).
    """
    position = 0
    try:
        request = next(job)
        while True:
            yield from request.emit
            if should_stop is not None and should_stop():
                return
            if isinstance(request, Wait):
                if wait is None:
                    raise RuntimeError("this job waits for input but the runner was given no wait()")
                wait()
                request = job.send(None)
                continue
            n = request.embeds.shape[0]
            if position + n > cache.max_len:
                raise ResourceLimitError(f"the request needs more than {cache.max_len} LLM positions; "
                                         "shorten the text")
            with torch.inference_mode():
                _, logp = lm.decode_step(request.embeds[None], position, cache)
                position += n
                scores = lm.apply_bans(logp, [request])[0]
                token = sample(scores, request.history) if request.sample else None
                request = job.send(token)  # the job builds its next input here: no autograd either
    except StopIteration as done:
        yield from done.value or ()
    finally:
        job.close()


class TokenStream:
    """Token ids that arrive over time (a chat LLM's text, tokenised piece by piece), read by one job.

    Writers ``put`` and finally ``close`` (with the writer's exception, if it failed); the job
    ``take``s without blocking and yields :class:`Wait` while nothing new is there. Runners learn of
    new input through ``wait`` (blocking, for a runner thread of its own) or a ``subscribe``d callback
    (the scheduler, which must never block on one request).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: list[int] = []
        self._closed = False
        self._error: BaseException | None = None
        self._listeners: list[Callable[[], None]] = []

    def put(self, ids: Sequence[int]) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("put() after close()")
            self._pending.extend(int(i) for i in ids)
            self._cond.notify_all()
        self._notify()

    def close(self, error: BaseException | None = None) -> None:
        with self._cond:
            self._closed, self._error = True, error
            self._cond.notify_all()
        self._notify()

    def take(self) -> tuple[list[int], bool]:
        """(ids that arrived since the last take, whether the stream has ended); re-raises a writer's error."""
        with self._cond:
            if self._error is not None:
                raise self._error
            ids, self._pending = self._pending, []
            return ids, self._closed

    def wait(self, timeout: float | None = None) -> None:
        """Block until there is something to take or the stream has ended."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending or self._closed, timeout)

    def subscribe(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener`` (from the writer's thread) whenever input arrives or the stream ends; returns the
        unsubscribe function."""
        with self._cond:
            self._listeners.append(listener)
            pending = bool(self._pending) or self._closed
        if pending:
            listener()
        return lambda: self._discard(listener)

    def _discard(self, listener: Callable[[], None]) -> None:
        with self._cond:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def _notify(self) -> None:
        with self._cond:
            listeners = list(self._listeners)
        for listener in listeners:
            listener()
