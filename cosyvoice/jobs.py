"""THE runner of long work (batches, long-form renders and exports): jobs in SQLite, run by a bounded pool of
workers.

A job is a list of items (a batch's rows, a project's segments). Its kind, a function the feature registers,
turns a job into :class:`Task` s; the runner runs them in order, catches every exception per item and records
it with a message people understand ("disk full", "model error, see server log"; the traceback goes to the
log), keeps progress and an ETA from the measured rate, and ends the job ``done``, ``failed`` or ``cancelled``.

All state is rows in ``jobs.sqlite3`` in the data folder, so any process on that folder (another server, a
Ray Serve replica, the CLI) reads a job's progress and may cancel it: a cancel is a flag in the row, which the
running process turns into its :class:`~cosyvoice.engine.CancelToken` within :data:`WATCH_SECONDS`. A job runs
in the process that submitted (or resumed) it; one whose process died while it ran is ``interrupted``, and
:meth:`JobRunner.resume` continues it from its first unfinished item. Synthesis inside a task waits its turn
in the service's admission FIFO (``TTSService.synthesize(wait=True)``), never in a retry loop of its own.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cosyvoice.engine import CancelToken
from cosyvoice.errors import CosyVoiceError, InvalidInputError, ResourceLimitError, StorageError
from cosyvoice.job_records import DB_NAME, SCHEMA, Job, JobRecords, JobState
from cosyvoice.service import PreparedRequest, SynthesisRequest, TTSService
from cosyvoice.system.fs import disk_full
from cosyvoice.system.sqlite import open_store

logger = logging.getLogger(__name__)

# a job as the features read it, and its state, from the rows it is kept in
__all__ = ["MODEL_ERROR", "STOPPED_WHILE_RUNNING", "WATCH_SECONDS", "Cancelled", "Interrupted", "Job", "JobGone",
           "JobRunner", "JobState", "Kind", "Made", "Task", "describe", "release", "runner", "synthesize"]

WATCH_SECONDS = 0.5  # how soon a cancel written by another process reaches the job's running process
MODEL_ERROR = "model error, see server log"
STOPPED_WHILE_RUNNING = "the server stopped while it ran; resume it"


class Cancelled(Exception):
    """Raised by a task that saw its token cancelled before it kept anything: the item is not counted."""


class Interrupted(Exception):
    """The service stopped a task's request (the server is shutting down): the job can be resumed later."""


class JobGone(CosyVoiceError):
    """The job's subject was deleted meanwhile (e.g. by another server): the job ends cancelled, cleanly."""


@dataclass(frozen=True)
class Task:
    """One item of a job: ``run(token)`` makes and keeps it (raising :class:`Cancelled` if the token was
    cancelled before anything was kept); ``failed(message)`` records an error where the feature shows it."""

    key: str  # the item's name in errors (a row number, a segment id)
    units: float  # its weight in the ETA
    run: Callable[[CancelToken], None]
    failed: Callable[[str], None] | None = None


Kind = Callable[["Job"], Iterator[Task]]  # every task of a job, from its first item (the runner skips handled ones)


@dataclass(frozen=True)
class Made:
    """One request's audio, made whole for a job's item."""

    pcm: np.ndarray  # float32 samples
    prepared: PreparedRequest
    speech_tokens: list[list[int]]  # per text segment of the request, the speech tokens the LLM said
    seconds: float  # from the call to the last chunk (admission wait included)
    first_chunk_seconds: float | None

    @property
    def timings(self) -> dict[str, float | None]:
        """The timings a take's provenance records."""
        return {"synthesis_seconds": self.seconds, "first_chunk_seconds": self.first_chunk_seconds}


def synthesize(service: TTSService, request: SynthesisRequest, token: CancelToken, owner: str | None = None) -> Made:
    """``request``'s audio for a job, as ``owner`` asks it (the voices it may use: another's unsaved upload is
    not found); waits for its slot in the service's admission, in order. Raises
    :class:`Cancelled` if ``token`` was cancelled meanwhile, :class:`Interrupted` if the service stopped the
    request (shutting down): a cut-short take is never kept."""
    started = time.perf_counter()
    first: float | None = None
    pieces: list[np.ndarray] = []
    tokens: list[list[int]] = [[]]
    own = CancelToken()  # the request's: the service's shutdown cancels it, not the job
    unsubscribe = token.subscribe(own.cancel)
    try:
        session = service.synthesize(request, cancel=own, wait=True, owner=owner)
        prepared = session.prepared
        with session:
            for chunk in session:
                if first is None and chunk.pcm.numel():
                    first = time.perf_counter() - started
                pieces.append(chunk.pcm.reshape(-1).cpu().numpy())
                tokens[-1].extend(chunk.tokens)
                if chunk.final:
                    tokens.append([])
    except ResourceLimitError:  # refused while it waited (cancelled, shutting down, too long), or cut short
        if token.cancelled:
            raise Cancelled from None
        if service.shutting_down:  # CancelledByShutdown, or the engine closed under it as the process exits
            raise Interrupted from None
        raise
    finally:
        unsubscribe()
    if token.cancelled:
        raise Cancelled
    if own.cancelled:
        raise Interrupted
    pcm = np.concatenate(pieces).astype(np.float32) if pieces else np.zeros(0, np.float32)
    return Made(pcm, prepared, tokens[:-1] if not tokens[-1] else tokens, time.perf_counter() - started, first)


def describe(exc: BaseException) -> str:
    """An item's error as its user reads it. Errors written for users keep their message; a full disk says so;
    anything else is a model error whose traceback goes to the log."""
    if isinstance(exc, OSError) and disk_full(exc):
        return str(disk_full(exc))
    if isinstance(exc, (InvalidInputError, ResourceLimitError, JobGone)):  # StorageError is a ResourceLimitError
        return str(exc)
    logger.error("a job's item failed", exc_info=exc)
    return MODEL_ERROR


class JobRunner(JobRecords):
    """The jobs of one data folder in this process: at most ``workers`` run at once. Use :func:`runner` to
    share one per folder between the features of a process."""

    def __init__(self, data_dir: str | Path, workers: int = 1, clock: Callable[[], float] = time.time) -> None:
        assert workers >= 1
        self.root = Path(data_dir)
        self.clock = clock  # the wall clock of the jobs' created, started and finished times
        self.workers = workers
        self._host, self._pid = socket.gethostname(), os.getpid()
        self._lock = threading.RLock()
        # a data folder this process cannot write: its jobs are read (progress), none is submitted or changed
        self._db, self.read_only = open_store(self.root, DB_NAME, SCHEMA)
        self._kinds: dict[str, Kind] = {}
        self._tokens: dict[str, CancelToken] = {}  # this process's running jobs
        self._listeners: dict[str, Callable[[Job, str, str | None], None]] = {}
        self._wake = threading.Condition(self._lock)
        self._threads: list[threading.Thread] = []
        self._closed = False
        self.users = 0
        if not self.read_only:
            self._interrupt_dead()

    # ------------------------------------------------------------------ registering and submitting

    def register(self, kind: str, tasks: Kind) -> None:
        """How jobs of ``kind`` become tasks (a later registration of the same kind replaces it)."""
        with self._lock:
            self._kinds[kind] = tasks

    def submit(self, kind: str, subject: str, params: dict[str, Any], *, total: int, units: float,
               owner: str | None = None, job_id: str | None = None,
               listener: Callable[[Job, str, str | None], None] | None = None) -> Job:
        """Queue a job; it runs in this process once a worker is free and no other job of ``subject`` runs.
        ``listener(job, item, error)`` is called after each item (the CLI prints progress with it)."""
        assert kind in self._kinds, kind
        job_id = job_id or f"job-{uuid.uuid4().hex[:12]}"
        with self._tx() as db:
            db.execute("INSERT INTO jobs (id, kind, subject, owner, state, params, total, units_total, host, pid, "
                       "created) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                       (job_id, kind, subject, owner, JobState.QUEUED.value, json.dumps(params), total, units,
                        self._host, self._pid, self.clock()))
        if listener is not None:
            self._listeners[job_id] = listener
        self._start()
        return self.job(job_id)

    def resume(self, job_id: str) -> Job:
        """Continue an interrupted job from its first unfinished item, in this process."""
        with self._tx() as db:
            job = self.job(job_id)
            assert job.kind in self._kinds, job.kind
            if job.state is not JobState.INTERRUPTED:
                raise InvalidInputError(f"only an interrupted job can be resumed; this one is {job.state.value}",
                                        "job")
            db.execute("UPDATE jobs SET state=?, host=?, pid=?, cancel=0, error=NULL, finished=NULL WHERE id=?",
                       (JobState.QUEUED.value, self._host, self._pid, job_id))
        self._start()
        return self.job(job_id)

    def wait(self, job_id: str, timeout: float | None = None) -> Job:
        """Until the job is no longer queued or running in this process (tests, the CLI), or ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._wake:
            while (job := self.job(job_id)).state.active and self._local(job):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._wake.wait(WATCH_SECONDS if left is None else min(left, WATCH_SECONDS))
        return job

    # ------------------------------------------------------------------ cancelling and closing

    def cancel(self, job_id: str) -> Job:
        """Stop a job from any process: a queued one is cancelled now, a running one within one LLM step where
        it runs here, within :data:`WATCH_SECONDS` where another process runs it. Items made stay."""
        with self._tx() as db:
            job = self.job(job_id)
            if job.state is JobState.QUEUED:
                db.execute("UPDATE jobs SET state=?, cancel=1, finished=? WHERE id=?",
                           (JobState.CANCELLED.value, self.clock(), job_id))
            elif job.state is JobState.RUNNING:
                db.execute("UPDATE jobs SET cancel=1 WHERE id=?", (job_id,))
            token = self._tokens.get(job_id)
        if token is not None:
            token.cancel()
        with self._wake:
            self._wake.notify_all()
        return self.job(job_id)

    def close(self) -> None:
        """Stop this process's jobs (interrupted: another start resumes them), wait for their workers, close the
        database."""
        with self._wake:
            self._closed = True
            tokens = list(self._tokens.values())
            self._wake.notify_all()
        for token in tokens:
            token.cancel()
        for thread in self._threads:
            thread.join()
        with self._lock:
            self._db.close()

    # ------------------------------------------------------------------ workers

    def _start(self) -> None:
        """Wake the workers; start them on first use (at most ``workers``, plus the cancel watcher)."""
        with self._wake:
            if not self._threads:
                self._threads = [threading.Thread(target=self._work, daemon=True, name=f"cosyvoice-job-{i}")
                                 for i in range(self.workers)]
                self._threads.append(threading.Thread(target=self._watch, daemon=True, name="cosyvoice-job-watch"))
                for thread in self._threads:
                    thread.start()
            self._wake.notify_all()

    def _work(self) -> None:
        while True:
            with self._wake:
                job = None
                while not self._closed and (job := self._claim()) is None:
                    self._wake.wait()
                if self._closed:
                    return
                token = self._tokens[job.id] = CancelToken()
                self._wake.notify_all()  # the watcher follows this job's cancel flag from now on
            try:
                self._run(job, token)
            except Exception as exc:  # the runner's own bookkeeping failed (e.g. its database's disk is full)
                logger.exception("job %s stopped", job.id)
                with contextlib.suppress(Exception):
                    self._update(job.id, state=JobState.FAILED.value, current=None, error=describe(exc),
                                 finished=self.clock())
            finally:
                with self._wake:
                    self._tokens.pop(job.id, None)
                    self._listeners.pop(job.id, None)
                    self._wake.notify_all()

    def _claim(self) -> Job | None:
        """This process's oldest queued job whose subject has no running job, now running (call with the lock)."""
        kinds = list(self._kinds)
        with self._tx() as db:
            row = db.execute(f"SELECT * FROM jobs j WHERE state='queued' AND host=? AND pid=? AND kind IN "
                             f"({','.join('?' * len(kinds))}) AND NOT EXISTS (SELECT 1 FROM jobs r WHERE "
                             "r.subject=j.subject AND r.state='running') ORDER BY created LIMIT 1",
                             (self._host, self._pid, *kinds)).fetchone()
            if row is None:
                return None
            db.execute("UPDATE jobs SET state='running', started=COALESCE(started, ?) WHERE id=?",
                       (self.clock(), row["id"]))
        return self.job(row["id"])

    def _run(self, job: Job, token: CancelToken) -> None:
        tasks = itertools.islice(self._kinds[job.kind](job), job.position, None)
        end, error = JobState.DONE, None
        for task in tasks:
            if token.cancelled:
                end, error = self._stopped(job.id)
                break
            self._update(job.id, current=task.key)
            started = time.perf_counter()
            failure, field = None, None
            try:
                task.run(token)
            except Cancelled:
                end, error = self._stopped(job.id)
                break
            except Interrupted:
                end, error = JobState.INTERRUPTED, STOPPED_WHILE_RUNNING
                break
            except JobGone as exc:
                logger.info("job %s ends: %s", job.id, exc)
                end, error = JobState.CANCELLED, str(exc)
                break
            except Exception as exc:
                failure, field = describe(exc), getattr(exc, "field", None)
                self._record_failure(job.id, task, failure)
                if isinstance(exc, StorageError) or disk_full(exc):
                    end, error = JobState.FAILED, failure  # every later item would fail alike
            self._item_done(job.id, task, time.perf_counter() - started, failure, field)
            listener = self._listeners.get(job.id)
            if listener is not None:
                listener(self.job(job.id), task.key, failure)
            if error is not None:
                break
        else:
            if token.cancelled:
                end, error = self._stopped(job.id)
        final = self.job(job.id)
        if end is JobState.DONE and final.total and final.failed == final.total:
            end = JobState.FAILED  # every item failed: the items' errors say why
        self._update(job.id, state=end.value, current=None, error=error, finished=self.clock())

    def _stopped(self, job_id: str) -> tuple[JobState, str | None]:
        """How a job whose token was cancelled ends: cancelled by its user, or interrupted (resumable, as a dead
        process's job) when this process's runner closed under it."""
        if self._closed and not self.job(job_id).cancel:
            return JobState.INTERRUPTED, STOPPED_WHILE_RUNNING
        return JobState.CANCELLED, None

    @staticmethod
    def _record_failure(job_id: str, task: Task, failure: str) -> None:
        """Show the error where the feature shows it; that failing too (the same full disk) is only logged."""
        if task.failed is None:
            return
        try:
            task.failed(failure)
        except Exception:
            logger.exception("job %s could not record the error of item %s", job_id, task.key)

    def _item_done(self, job_id: str, task: Task, seconds: float, failure: str | None, field: str | None) -> None:
        """One item handled: its counts and time (a constant-size update), its error appended."""
        with self._tx() as db:
            db.execute("UPDATE jobs SET position=position+1, done=done+?, failed=failed+?, units_done=units_done+?, "
                       "work_seconds=work_seconds+? WHERE id=?",
                       (failure is None, failure is not None, task.units, seconds, job_id))
            if failure is not None:
                db.execute("INSERT INTO job_errors (job, item, field, message) VALUES (?,?,?,?)",
                           (job_id, task.key, field, failure))

    def _watch(self) -> None:
        """Cancels written by other processes reach this process's running jobs."""
        while True:
            with self._wake:
                if self._closed:
                    return
                while not self._tokens and not self._closed:
                    self._wake.wait()
                running = dict(self._tokens)
            if running:
                marks = ",".join("?" * len(running))
                for row in self._rows(f"SELECT id FROM jobs WHERE cancel=1 AND id IN ({marks})", *running):
                    running[row["id"]].cancel()
            time.sleep(WATCH_SECONDS)

_runners: dict[Path, JobRunner] = {}
_runners_lock = threading.Lock()


def runner(data_dir: str | Path, workers: int = 1, clock: Callable[[], float] = time.time) -> JobRunner:
    """The process's runner of ``data_dir`` (made on first use with ``workers`` and ``clock``); pair with
    :func:`release`."""
    key = Path(data_dir).resolve()
    with _runners_lock:
        found = _runners.get(key)
        if found is None:
            found = _runners[key] = JobRunner(key, workers, clock)
        found.users += 1
        return found


def release(jobs: JobRunner) -> None:
    """One user fewer; the last one closes the runner (its jobs here are interrupted)."""
    with _runners_lock:
        jobs.users -= 1
        if jobs.users > 0:
            return
        _runners.pop(jobs.root, None)
    jobs.close()

