"""The jobs' rows, for the job runner (:mod:`cosyvoice.jobs`): the ``jobs.sqlite3`` schema of the data folder, a
job as read (:class:`Job`, its :class:`JobState`), and the reads and writes of those rows. Every process on the
folder reads them (progress, cancels); the process that runs a job writes its progress.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import sqlite3
import threading
from dataclasses import dataclass
from typing import Any

from cosyvoice.errors import NotFoundError
from cosyvoice.system.sqlite import write_transaction

DB_NAME = "jobs.sqlite3"
SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,                     -- which registered kind makes its tasks (batch, longform)
    subject TEXT NOT NULL,                  -- what it works on (a batch, a project): one running job per subject
    owner TEXT,
    state TEXT NOT NULL,                    -- JobState
    params TEXT NOT NULL,                   -- JSON: what the kind needs to make the tasks again (resume)
    total INTEGER NOT NULL,                 -- items
    position INTEGER NOT NULL DEFAULT 0,    -- items handled: a resumed job starts here
    done INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    units_total REAL NOT NULL,              -- the ETA's weights (a row: 1; a segment: its characters)
    units_done REAL NOT NULL DEFAULT 0,
    work_seconds REAL NOT NULL DEFAULT 0,   -- time spent on handled items: units_done / work_seconds is the rate
    current TEXT,                           -- the item being made
    error TEXT,                             -- why the job failed or stopped
    cancel INTEGER NOT NULL DEFAULT 0,      -- asked to stop (by any process)
    host TEXT NOT NULL,                     -- the process that runs it (host, pid)
    pid INTEGER NOT NULL,
    created REAL NOT NULL,
    started REAL,
    finished REAL
);
CREATE INDEX IF NOT EXISTS jobs_by_subject ON jobs (subject, state);
CREATE TABLE IF NOT EXISTS job_errors (
    id INTEGER PRIMARY KEY AUTOINCREMENT,   -- one row per failed item: appending never rewrites earlier ones
    job TEXT NOT NULL,
    item TEXT NOT NULL,
    field TEXT,
    message TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS job_errors_by_job ON job_errors (job, id);
"""


class JobState(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    INTERRUPTED = "interrupted"  # its process stopped or died while it ran; resume() continues it

    @property
    def active(self) -> bool:
        return self in (JobState.QUEUED, JobState.RUNNING)


@dataclass(frozen=True)
class Job:
    id: str
    kind: str
    subject: str
    owner: str | None
    state: JobState
    params: dict[str, Any]
    total: int
    position: int
    done: int
    failed: int
    units_total: float
    units_done: float
    work_seconds: float
    current: str | None
    error: str | None
    cancel: bool
    created: float
    started: float | None
    finished: float | None

    @property
    def eta_seconds(self) -> float | None:
        """Seconds left at the rate measured so far (None before the first item, 0 once it ended)."""
        if not self.state.active:
            return 0.0
        if not self.units_done:
            return None
        return round(self.work_seconds / self.units_done * max(0.0, self.units_total - self.units_done), 1)


class JobRecords:
    """Reading and writing job rows through the runner's connection ``_db`` and ``_lock``; ``_host`` and ``_pid``
    name the runner's process, ``read_only`` why it may not write (a read-only data folder)."""

    _db: sqlite3.Connection
    _lock: threading.RLock
    _host: str
    _pid: int
    read_only: str | None

    def job(self, job_id: str) -> Job:
        rows = self._rows("SELECT * FROM jobs WHERE id=?", job_id)
        if not rows:
            raise NotFoundError(f"no job {job_id!r}", "job")
        return job_of(rows[0])

    def jobs(self, subject: str, *, active: bool = False) -> list[Job]:
        """The jobs of ``subject``, oldest first (``active``: only queued and running ones)."""
        sql = "SELECT * FROM jobs WHERE subject=?" + (" AND state IN ('queued', 'running')" if active else "")
        return [job_of(r) for r in self._rows(sql + " ORDER BY created", subject)]

    def errors(self, job_id: str, limit: int = 1000) -> list[dict[str, Any]]:
        """The job's item errors in order: ``{item, field, message}``."""
        return [dict(r) for r in self._rows("SELECT item, field, message FROM job_errors WHERE job=? ORDER BY id "
                                            "LIMIT ?", job_id, limit)]

    def _interrupt_dead(self) -> None:
        """Jobs left running or queued by a process of this host that is gone are interrupted (resumable)."""
        rows = self._rows("SELECT id, pid FROM jobs WHERE state IN ('queued', 'running') AND host=?", self._host)
        dead = [r["id"] for r in rows if r["pid"] != self._pid and not alive(r["pid"])]
        for job_id in dead:
            self._update(job_id, state=JobState.INTERRUPTED.value, current=None)

    def _local(self, job: Job) -> bool:
        row = self._rows("SELECT host, pid FROM jobs WHERE id=?", job.id)[0]
        return (row["host"], row["pid"]) == (self._host, self._pid)

    def _update(self, job_id: str, **values: object) -> None:
        with self._tx() as db:
            db.execute(f"UPDATE jobs SET {', '.join(f'{k}=?' for k in values)} WHERE id=?", (*values.values(), job_id))

    def _tx(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        return write_transaction(self._db, self._lock, self.read_only)

    def _rows(self, sql: str, *args: object) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()


def job_of(row: sqlite3.Row) -> Job:
    return Job(row["id"], row["kind"], row["subject"], row["owner"], JobState(row["state"]), json.loads(row["params"]),
               row["total"], row["position"], row["done"], row["failed"], row["units_total"], row["units_done"],
               row["work_seconds"], row["current"], row["error"], bool(row["cancel"]), row["created"], row["started"],
               row["finished"])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True
