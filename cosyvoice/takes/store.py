"""THE take store of the studio, and the workbench's store: one SQLite database (every take's metadata: the web UI's,
the API's, batches' and long-form's; batches, tests, raters, play events, answers) and the takes' audio as WAV
files beside it.

A take is one row (its owner, label, provenance: model digest, software, precision, seed, speed, steps, text, ...)
and one file: a 32-bit float WAV (:func:`cosyvoice.encoding.float_wav`, the samples exactly as made; takes stored
before as 16-bit WAV are read as they are, and long-form's older takes keep their file in ``longform/<project>/``,
named relative to ``takes/``). Every write is one transaction in WAL mode with ``synchronous=FULL``: a committed
answer survives ``kill -9`` (and a power cut); a process killed mid-answer loses at most that answer. A take's audio
file is written (atomically, fsynced) before its row, so a row never names a missing file; an orphan file left by a
crash between the two is harmless. A take a listening test uses cannot be deleted (the refusal names the tests).
Safe to share between threads (one connection, one lock) and between processes (SQLite's own locking, with a busy
timeout).
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf

from cosyvoice.encoding import float_wav
from cosyvoice.errors import ConflictError, InvalidInputError, NotFoundError, PermissionDeniedError
from cosyvoice.owners import LOCAL, Caller
from cosyvoice.system.fs import atomic_write
from cosyvoice.system.sqlite import add_columns, open_store, require_writable, write_transaction
from cosyvoice.takes.ratings import Answer, Rater, RatingRecords, new_id

# what the features import from the take store (a listening test's records are kept in cosyvoice.takes.ratings)
__all__ = ["DB_NAME", "SCORE_METRICS", "Answer", "Rater", "Take", "TakeStore", "finite", "test_take_ids"]

DB_NAME = "workbench.sqlite3"
# the objective scorecard's measures of a take (cosyvoice.workbench.scorecard), kept with it for the exports
SCORE_METRICS = ("seconds", "rms_dbfs", "peak_dbfs", "sim_campplus", "sim_resemblyzer", "dnsmos_sig", "dnsmos_bak",
                 "dnsmos_ovrl")
AUDIO_DIR = "takes"
#: a take made one at a time (the studio page, the named API), not a batch row nor a long-form segment
_SINGLE = "batch IS NULL AND json_extract(provenance, '$.longform') IS NULL"

SCHEMA = """
CREATE TABLE IF NOT EXISTS takes (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- the page's history grows by seq: 'after' cursors
    id TEXT UNIQUE NOT NULL,
    created REAL NOT NULL,
    owner TEXT,                             -- cosyvoice.owners' owner string; NULL: local (CLI, or made before owners)
    batch TEXT,
    row INTEGER,
    label TEXT NOT NULL DEFAULT '',         -- the condition (system) the take belongs to
    audio TEXT NOT NULL,                    -- file name under takes/ (long-form's older takes: ../longform/...)
    sample_rate INTEGER NOT NULL,
    samples INTEGER NOT NULL,
    provenance TEXT NOT NULL                -- JSON: how the take was made (see batch.Provenance)
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY,                    -- also its job's id: progress, errors and state are the job's
    created REAL NOT NULL,
    source TEXT NOT NULL,
    total INTEGER NOT NULL,
    pid INTEGER NOT NULL DEFAULT 0,         -- unused (0): databases made before cosyvoice.jobs require it
    owner TEXT                              -- who started it (as takes.owner)
);
CREATE TABLE IF NOT EXISTS tests (
    id TEXT PRIMARY KEY,
    created REAL NOT NULL,
    kind TEXT NOT NULL,
    title TEXT NOT NULL,
    instructions TEXT NOT NULL,
    spec TEXT NOT NULL,                     -- JSON: options and items (listening.TestSpec)
    owner TEXT                              -- who made it (as takes.owner); raters need only its link
);
CREATE TABLE IF NOT EXISTS raters (
    id TEXT PRIMARY KEY,
    test TEXT NOT NULL REFERENCES tests(id),
    name TEXT NOT NULL,
    created REAL NOT NULL,
    seed INTEGER NOT NULL,                  -- drew this rater's order and sides
    plan TEXT NOT NULL,                     -- JSON: the items in this rater's order, stimuli on their slots
    questionnaire TEXT,                     -- JSON: the end-of-test answers (listening device, language); NULL: none
    UNIQUE (test, name)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    rater TEXT NOT NULL REFERENCES raters(id),
    position INTEGER NOT NULL,
    slot TEXT NOT NULL,                     -- '' for the item being shown
    kind TEXT NOT NULL,                     -- view | play | ended
    at REAL NOT NULL                        -- server clock: listen-gating never trusts the page's
);
CREATE INDEX IF NOT EXISTS events_by_rater ON events (rater, position);
CREATE TABLE IF NOT EXISTS answers (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    test TEXT NOT NULL REFERENCES tests(id),
    rater TEXT NOT NULL REFERENCES raters(id),
    position INTEGER NOT NULL,
    item INTEGER NOT NULL,
    answer TEXT NOT NULL,                   -- JSON, canonical (independent of sides and order)
    seconds REAL NOT NULL,
    plays INTEGER NOT NULL,
    check_failed INTEGER,                   -- NULL: not an attention check
    created REAL NOT NULL,
    UNIQUE (rater, position)
);
CREATE TABLE IF NOT EXISTS scores (
    take TEXT PRIMARY KEY REFERENCES takes(id),
    scores TEXT NOT NULL,                   -- JSON {metric: value or null}
    created REAL NOT NULL
);
"""


def finite(pcm: np.ndarray, take_id: str | None = None) -> np.ndarray:
    """``pcm`` if every sample is a number. A model fault (an overflow in a fast path) or a damaged file gives NaN
    or infinite samples, which a meter reads as silence and an encoder refuses: they are never kept, mixed or
    served. ``take_id``: a stored take's (409, make it again), else audio about to be kept (400)."""
    if bool(np.isfinite(pcm).all()):
        return pcm
    if take_id is None:
        raise InvalidInputError("the audio made holds samples that are not numbers (NaN or infinity); nothing was "
                                "kept: make it again (another seed, or precision fp32)", "audio")
    raise ConflictError(f"take {take_id} is damaged: its audio holds samples that are not numbers (NaN or "
                        "infinity); make it again", "take")


@dataclass(frozen=True)
class Take:
    seq: int
    id: str
    created: float
    owner: str | None
    batch: str | None
    row: int | None
    label: str
    audio: str
    sample_rate: int
    samples: int
    provenance: dict[str, Any]

    @property
    def seconds(self) -> float:
        return self.samples / self.sample_rate

    @property
    def longform(self) -> dict[str, Any] | None:
        """The long-form project and segment the take was made for (as made; None: not a long-form take)."""
        return self.provenance.get("longform")

    @property
    def source(self) -> str:
        """Where the take was made, for people (the owner string itself may name an API key's hash)."""
        if self.longform is not None:
            return "long-form"
        if self.batch is not None:
            return "batch"
        if self.owner is not None and self.owner.startswith(("browser:", "session:")):
            return "web UI"
        return "API"

    def json(self) -> dict[str, Any]:
        return {"seq": self.seq, "id": self.id, "created": self.created, "batch": self.batch, "row": self.row,
                "label": self.label, "source": self.source, "sample_rate": self.sample_rate,
                "seconds": round(self.seconds, 3), "provenance": self.provenance}


class TakeStore(RatingRecords):
    """The database and audio folder under ``root`` (created if missing; reopened as it was). A folder this
    process cannot write is served read-only: :attr:`read_only` says why, and every write raises it."""

    def __init__(self, root: str | Path, clock: Callable[[], float] = time.time) -> None:
        self.root = Path(root)
        self.clock = clock  # the wall clock of every stored time (a listening test's plays are timed by it)
        self.audio_dir = self.root / AUDIO_DIR
        self.path = self.root / DB_NAME
        self._lock = threading.RLock()
        self._db, self.read_only = open_store(self.root, DB_NAME, SCHEMA)  # an existing database is opened as it is
        if not self.read_only:
            self.audio_dir.mkdir(parents=True, exist_ok=True)
            with self._tx() as db:  # a database from before owners: its batches and tests are the local owner's
                for table in ("batches", "tests"):
                    add_columns(db, table, {"owner": "TEXT"})
                add_columns(db, "raters", {"questionnaire": "TEXT"})

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _tx(self) -> AbstractContextManager[sqlite3.Connection]:
        return write_transaction(self._db, self._lock, self.read_only)

    def _rows(self, sql: str, *args: Any) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # ------------------------------------------------------------------ takes

    def add_take(self, pcm: np.ndarray, sample_rate: int, provenance: dict[str, Any], *, label: str = "",
                 owner: str | None = None, batch: str | None = None, row: int | None = None) -> Take:
        """Write the audio (float samples as the engine makes them, kept exactly: :func:`float_wav`), then the
        row: a take exists once its row does."""
        require_writable(self.read_only)  # before its audio is written
        finite(pcm)
        take_id = new_id("take")
        name = f"{take_id}.wav"
        data = float_wav(pcm, sample_rate)
        atomic_write(self.audio_dir / name, lambda tmp: Path(tmp).write_bytes(data))
        created = self.clock()
        with self._tx() as db:
            seq = db.execute("INSERT INTO takes (id, created, owner, batch, row, label, audio, sample_rate, samples, "
                             "provenance) VALUES (?,?,?,?,?,?,?,?,?,?)",
                             (take_id, created, owner, batch, row, label, name, sample_rate, int(pcm.size),
                              json.dumps(provenance))).lastrowid
        return Take(seq, take_id, created, owner, batch, row, label, name, sample_rate, int(pcm.size), provenance)

    def take(self, take_id: str, caller: Caller = LOCAL) -> Take:
        """The take ``take_id`` if ``caller`` may see it (another owner's is "not found", as if it did not exist)."""
        rows = self._rows("SELECT * FROM takes WHERE id=?", take_id)
        if not rows or not caller.sees(rows[0]["owner"]):
            raise NotFoundError(f"no take {take_id!r}", "take")
        return _take(rows[0])

    def visible_takes(self, caller: Caller, *, mine: bool = False, after: int = 0, batch: str | None = None,
                      limit: int = 1000) -> list[Take]:
        """:meth:`takes` that ``caller`` may see (``mine``: only its own takes made one at a time, whatever the
        sharing: the studio page's history, without its batches and long-form projects)."""
        if mine:
            return self.takes(owner=caller.owner, any_owner=False, after=after, batch=batch, limit=limit, single=True)
        where, args = _seen_by(caller)
        return self._select_takes(where, args, after=after, batch=batch, limit=limit)

    def take_page(self, caller: Caller, *, offset: int = 0, limit: int = 50, batch: str = "", label: str = "",
                  text: str = "") -> tuple[list[Take], int]:
        """One page of the takes ``caller`` may see, newest first, with how many match: filtered by batch id,
        label (exact) and text (contained, any case), so the owner page stays light at thousands of takes."""
        seen, args = _seen_by(caller)
        where = [seen]
        for column, value in (("batch", batch), ("label", label)):
            if value:
                where, args = [*where, f"{column} = ?"], [*args, value]
        if text:
            pattern = "%" + text.lower().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            where = [*where, "lower(json_extract(provenance, '$.text')) LIKE ? ESCAPE '\\'"]
            args = [*args, pattern]
        sql = " AND ".join(where)
        total = self._rows(f"SELECT COUNT(*) FROM takes WHERE {sql}", *args)[0][0]
        rows = self._rows(f"SELECT * FROM takes WHERE {sql} ORDER BY seq DESC LIMIT ? OFFSET ?", *args, limit, offset)
        return [_take(r) for r in rows], total

    def take_labels(self, caller: Caller) -> list[str]:
        """The labels (conditions) of the takes ``caller`` may see: what a new test can compare."""
        seen, args = _seen_by(caller)
        sql = f"SELECT DISTINCT label FROM takes WHERE label != '' AND {seen}"
        return [r[0] for r in self._rows(sql + " ORDER BY label", *args)]

    def delete_take(self, take_id: str, caller: Caller = LOCAL) -> Take:
        """Delete a take (its row, scores and audio) that ``caller`` owns; a take a listening test uses is refused
        (its answers refer to it): the error names the tests."""
        take = self.take(take_id, caller)
        if not caller.owns(take.owner):
            raise PermissionDeniedError("only the take's owner (or an admin) may delete it", "take")
        with self._tx() as db:
            if db.execute("SELECT 1 FROM takes WHERE id=?", (take_id,)).fetchone() is None:
                raise NotFoundError(f"no take {take_id!r}", "take")  # another process deleted it meanwhile
            users = _test_users(db, [take_id]).get(take_id)
            if users:
                raise ConflictError(f"take {take_id!r} is used by the listening test(s) "
                                    f"{', '.join(map(repr, users))}: delete those first", "take")
            _delete_rows(db, [take_id])
        self.audio_path(take).unlink(missing_ok=True)
        return take

    def remove_takes(self, take_ids: list[str]) -> dict[str, list[str]]:
        """Delete the takes ``take_ids`` that no listening test uses, in one transaction, then their audio; returns
        the others (take id -> the tests that keep it). For a feature deleting what holds them (a long-form
        project), whose own owner check came first."""
        with self._tx() as db:
            kept = _test_users(db, take_ids)
            gone = [_take(r) for r in db.execute("SELECT * FROM takes WHERE id IN (SELECT value FROM json_each(?))",
                                                 (json.dumps([t for t in take_ids if t not in kept]),))]
            _delete_rows(db, [t.id for t in gone])
        for take in gone:
            self.audio_path(take).unlink(missing_ok=True)
        return kept

    def adopt_takes(self, takes: list[Take]) -> None:
        """Rows for takes whose audio another store wrote before this one kept every take (long-form's), under
        their own ids, in one transaction; a take already here is left as it is (adopting again changes nothing)."""
        with self._tx() as db:
            db.executemany("INSERT OR IGNORE INTO takes (id, created, owner, batch, row, label, audio, sample_rate, "
                           "samples, provenance) VALUES (?,?,?,?,?,?,?,?,?,?)",
                           [(t.id, t.created, t.owner, t.batch, t.row, t.label, t.audio, t.sample_rate, t.samples,
                             json.dumps(t.provenance)) for t in takes])

    def existing(self, take_ids: list[str]) -> dict[str, Take]:
        """The takes of ``take_ids`` that exist, by id (whoever owns them: for features that hold take ids)."""
        rows = self._rows("SELECT * FROM takes WHERE id IN (SELECT value FROM json_each(?))", json.dumps(take_ids))
        return {r["id"]: _take(r) for r in rows}

    def takes(self, *, owner: str | None = None, any_owner: bool = True, after: int = 0, batch: str | None = None,
              limit: int = 1000, single: bool = False) -> list[Take]:
        """Takes in the order they were made, those with ``seq > after`` (a page fetches only what is new);
        ``any_owner=False`` keeps only ``owner``'s (a browser's history); ``single``: only takes made one at a
        time (no batch row, no long-form segment), which a browser's history numbers."""
        where, args = ("1", []) if any_owner else ("owner IS ?", [owner])
        return self._select_takes(where, args, after=after, batch=batch, limit=limit, single=single)

    def _select_takes(self, where: str, args: list[Any], *, after: int, batch: str | None, limit: int,
                      single: bool = False) -> list[Take]:
        """:meth:`takes` whose owner meets the SQL condition ``where`` (with its ``args``)."""
        sql, args = f"SELECT * FROM takes WHERE {where} AND seq > ?", [*args, after]
        if batch is not None:
            sql, args = sql + " AND batch = ?", [*args, batch]
        if single:
            sql += f" AND {_SINGLE}"
        return [_take(r) for r in self._rows(sql + " ORDER BY seq LIMIT ?", *args, limit)]

    def count_takes(self, owner: str | None, *, upto: int | None = None) -> int:
        """How many takes ``owner`` made one at a time (up to seq ``upto``): a take's number in its history."""
        sql, args = f"SELECT COUNT(*) FROM takes WHERE owner IS ? AND {_SINGLE}", [owner]
        if upto is not None:
            sql, args = sql + " AND seq <= ?", [*args, upto]
        return self._rows(sql, *args)[0][0]

    def audio_path(self, take: Take) -> Path:
        return Path(os.path.normpath(self.audio_dir / take.audio))  # ../longform/... without takes/ having to exist

    def read_audio(self, take: Take) -> np.ndarray:
        """The take's samples as float32, as they were stored (float32, or 16-bit for older takes)."""
        samples, _ = sf.read(self.audio_path(take), dtype="float32")
        return finite(samples, take.id)

    # ------------------------------------------------------------------ batches

    def start_batch(self, source: str, total: int, owner: str | None = None) -> str:
        """A batch's record (its rows run as the job of the same id: :mod:`cosyvoice.workbench.batch`)."""
        batch_id = new_id("batch")
        with self._tx() as db:
            db.execute("INSERT INTO batches (id, created, source, total, pid, owner) VALUES (?,?,?,?,0,?)",
                       (batch_id, self.clock(), source, total, owner))
        return batch_id

    def batch(self, batch_id: str, caller: Caller = LOCAL) -> dict[str, Any]:
        rows = self._rows("SELECT id, created, source, total, owner FROM batches WHERE id=?", batch_id)
        if not rows or not caller.sees(rows[0]["owner"]):
            raise NotFoundError(f"no batch {batch_id!r}", "batch")
        return {k: rows[0][k] for k in ("id", "created", "source", "total")}

    def batches(self, caller: Caller, limit: int = 20) -> list[str]:
        """The ids of the ``limit`` newest batches ``caller`` may see, newest first (the owner page's list)."""
        seen, args = _seen_by(caller)
        return [r["id"] for r in self._rows(f"SELECT id FROM batches WHERE {seen} ORDER BY created DESC LIMIT ?",
                                            *args, limit)]

def test_take_ids(spec: dict[str, Any]) -> list[str]:
    """Every take a test plays (its items' rated, reference and anchor takes, then its training examples), each
    once, in the items' order."""
    return list(dict.fromkeys([*(t for item in spec["items"]
                                 for t in [*item["takes"], *(item[k] for k in ("reference", "anchor") if item.get(k))]),
                               *(x["take"] for x in spec.get("training", []))]))


def _test_users(db: sqlite3.Connection, take_ids: list[str]) -> dict[str, list[str]]:
    """Which of ``take_ids`` listening tests use: take id -> the tests' titles (or ids), oldest test first."""
    wanted, users = set(take_ids), dict[str, list[str]]()
    for r in db.execute("SELECT id, title, spec FROM tests ORDER BY created"):
        for take_id in wanted.intersection(test_take_ids(json.loads(r["spec"]))):
            users.setdefault(take_id, []).append(r["title"] or r["id"])
    return users


def _delete_rows(db: sqlite3.Connection, take_ids: list[str]) -> None:
    """The rows of ``take_ids`` and their scores (inside the caller's transaction; the files are the caller's)."""
    ids = json.dumps(take_ids)
    db.execute("DELETE FROM scores WHERE take IN (SELECT value FROM json_each(?))", (ids,))
    db.execute("DELETE FROM takes WHERE id IN (SELECT value FROM json_each(?))", (ids,))


def _seen_by(caller: Caller) -> tuple[str, list[str | None]]:
    """The SQL condition (and its arguments) on ``owner`` of the rows ``caller`` may see."""
    if caller.sees_all:
        return "1", []
    owners = list(caller.seen_owners)
    return "(" + " OR ".join(["owner IS ?"] * len(owners)) + ")", owners


def _take(row: sqlite3.Row) -> Take:
    return Take(row["seq"], row["id"], row["created"], row["owner"], row["batch"], row["row"], row["label"],
                row["audio"], row["sample_rate"], row["samples"], json.loads(row["provenance"]))


