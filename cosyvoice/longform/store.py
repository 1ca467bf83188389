"""The project store: projects, their segment tables and each segment's takes, in SQLite; the takes themselves
(audio, owner, label, provenance) are the studio's one take store's (:class:`TakeStore`).

One database file (``longform.sqlite3`` in the data folder, WAL journal, every change one transaction). Its
``takes`` table links a take of the take store to the segment it was made for and records what that segment said
then (text, voice, instruction, speed: a take is current while they match), its seed and the automatic check's
flags. A take is kept in the take store first (its float32 WAV written atomically and fsynced, then its row, owned
by the project's owner and labelled with the project's name), then linked here; a take whose link cannot be written
(a full disk, a project deleted meanwhile) is removed again. So a long-form take is also a workbench take: its owner
sees it there and can put it in a listening test.

Takes are removed with their project, except those a listening test uses, which stay in the take store (the answer
names them and their tests); a take deleted in the workbench (one no test uses) is gone from its segment here too
(a segment whose chosen take it was has no audio until generated again). Takes of a segment that is edited, split or
merged are kept (they no longer match its text, so they are not used until chosen again).

A data folder from before the one take store (takes' rows here, their float32 files in ``longform/<project>/``) is
adopted when it is first opened writable: each take becomes the take store's under its own id, its file left where
it is; one transaction, then ``user_version`` marks it done, and adopting again after a crash changes nothing. A
read-only folder from before is read as it is.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import soundfile as sf

from cosyvoice.errors import NotFoundError
from cosyvoice.system.sqlite import add_columns, open_store, write_transaction
from cosyvoice.takes.store import Take as StoredTake
from cosyvoice.takes.store import TakeStore, finite

logger = logging.getLogger(__name__)

DB_NAME = "longform.sqlite3"
TAKE_STORE_VERSION = 1  # longform.sqlite3's user_version once its takes are the take store's
SCHEMA = """
CREATE TABLE IF NOT EXISTS projects (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, kind TEXT NOT NULL, source TEXT NOT NULL,
    settings TEXT NOT NULL, created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS segments (
    id TEXT PRIMARY KEY, project_id TEXT NOT NULL REFERENCES projects(id) ON DELETE CASCADE,
    position INTEGER NOT NULL, text TEXT NOT NULL, voice TEXT NOT NULL, instruction TEXT NOT NULL,
    speed REAL NOT NULL, brk TEXT NOT NULL, pause REAL, chapter TEXT, speaker TEXT, chosen_take TEXT,
    state TEXT NOT NULL, error TEXT);
CREATE INDEX IF NOT EXISTS segments_by_project ON segments(project_id, position);
CREATE TABLE IF NOT EXISTS takes (
    id TEXT PRIMARY KEY, project_id TEXT NOT NULL REFERENCES projects(id) ON DELETE CASCADE,
    segment_id TEXT NOT NULL, seed INTEGER NOT NULL, text TEXT NOT NULL, voice TEXT NOT NULL,
    voice_id TEXT NOT NULL, instruction TEXT NOT NULL, speed REAL NOT NULL, samples INTEGER NOT NULL,
    sample_rate INTEGER NOT NULL, flags TEXT NOT NULL, seconds_to_make REAL NOT NULL, created REAL NOT NULL);
CREATE INDEX IF NOT EXISTS takes_by_segment ON takes(segment_id, created);
"""


@dataclass(frozen=True)
class Project:
    id: str
    name: str
    kind: str  # "document" | "dialogue"
    source: str  # the text or script it was made from
    settings: dict
    created: float
    updated: float
    owner: str | None = None  # cosyvoice.owners' owner string; None: local (a CLI, or made before owners)


@dataclass(frozen=True)
class Segment:
    id: str
    project_id: str
    position: int
    text: str
    voice: str  # a voice id
    instruction: str
    speed: float
    brk: str  # the break after it (script.BREAKS)
    pause: float | None  # seconds of silence after it; None: the project's pause for ``brk``
    chapter: str | None  # the title of the chapter it opens
    speaker: str | None
    chosen_take: str | None
    state: str  # idle | running | failed (done-ness is derived: its chosen take matches it)
    error: str | None


@dataclass(frozen=True)
class Take:
    """A segment's take: the take store's take ``id``, with what its segment said when it was made."""

    id: str
    project_id: str
    segment_id: str
    seed: int
    text: str  # what the take says: a take is current while these four equal its segment's
    voice: str
    voice_id: str  # the voice the service resolved
    instruction: str
    speed: float
    samples: int
    sample_rate: int
    flags: list[str]  # the automatic check's findings
    seconds_to_make: float
    created: float

    def matches(self, segment: Segment) -> bool:
        return (self.text, self.voice, self.instruction, self.speed) == (segment.text, segment.voice,
                                                                         segment.instruction, segment.speed)


def current_take(segment: Segment, takes: dict[str, list[Take]]) -> Take | None:
    """The segment's chosen take (among ``takes``, by segment id) if it still says what the segment says."""
    chosen = next((t for t in takes.get(segment.id, []) if t.id == segment.chosen_take), None)
    return chosen if chosen is not None and chosen.matches(segment) else None


def new_id() -> str:
    return uuid.uuid4().hex[:12]


class ProjectStore:
    """Thread-safe: one connection, one lock, each change a transaction. It stands on the process's one take store
    (``takes``, made by :class:`cosyvoice.context.StudioContext`) and keeps its database in that store's folder. A
    data folder this process cannot write is served read-only: :attr:`read_only` says why, and every change raises
    it."""

    def __init__(self, takes: TakeStore) -> None:
        self.root = takes.root
        self.audio_root = self.root / "longform"
        self._lock = threading.RLock()
        self._db, self.read_only = open_store(self.root, DB_NAME, SCHEMA)
        self.take_store = takes
        if not self.read_only:
            with self.transaction() as db:
                db.execute("UPDATE segments SET state = 'idle' WHERE state = 'running'")  # a job the last run left
                add_columns(db, "projects", {"owner": "TEXT"})  # a database from before owners: local projects
            self._adopt_takes()
        with self._lock:  # only a read-only folder from before the one take store stays so
            self._own_files = self._db.execute("PRAGMA user_version").fetchone()[0] < TAKE_STORE_VERSION

    def _adopt_takes(self) -> None:
        """Takes stored here before the one take store become its takes (see the module's docstring)."""
        with self._lock:
            if self._db.execute("PRAGMA user_version").fetchone()[0] >= TAKE_STORE_VERSION:
                return
            rows = self._db.execute("SELECT t.*, p.name AS project_name, p.owner AS project_owner, "
                                    "p.settings AS project_settings FROM takes t "
                                    "JOIN projects p ON p.id = t.project_id ORDER BY t.created").fetchall()
        self.take_store.adopt_takes([_adopted(r) for r in rows])
        with self.transaction() as db:
            db.execute(f"PRAGMA user_version = {TAKE_STORE_VERSION}")

    def transaction(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        return write_transaction(self._db, self._lock, self.read_only)

    def close(self) -> None:
        """Close the database (the take store is its maker's to close)."""
        with self._lock:
            self._db.close()

    # ------------------------------------------------------------------ projects

    def add_project(self, name: str, kind: str, source: str, settings: dict, segments: list[dict],
                    owner: str | None = None) -> Project:
        now = time.time()
        project = Project(new_id(), name, kind, source, settings, now, now, owner)
        with self.transaction() as db:
            db.execute("INSERT INTO projects (id, name, kind, source, settings, created, updated, owner) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                       (project.id, name, kind, source, json.dumps(settings), now, now, owner))
            for position, row in enumerate(segments):
                self._insert_segment(db, project.id, position, row)
        return project

    def projects(self) -> list[Project]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM projects ORDER BY updated DESC").fetchall()
        return [_project(r) for r in rows]

    def project(self, project_id: str) -> Project:
        with self._lock:
            row = self._db.execute("SELECT * FROM projects WHERE id = ?", (project_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"no project {project_id!r}", "project")
        return _project(row)

    def update_project(self, project_id: str, **changes: object) -> Project:
        self.project(project_id)
        with self.transaction() as db:
            for key, value in changes.items():
                assert key in ("name", "settings")
                db.execute(f"UPDATE projects SET {key} = ? WHERE id = ?",
                           (json.dumps(value) if key == "settings" else value, project_id))
            db.execute("UPDATE projects SET updated = ? WHERE id = ?", (time.time(), project_id))
        return self.project(project_id)

    def delete_project(self, project_id: str) -> tuple[Project, dict[str, list[str]]]:
        """Delete a project, its segments and its takes, except the takes listening tests use: those stay in the
        take store (their owner's, in the workbench) and are returned (take id -> the tests). The project goes
        first, so a crash between leaves takes in the workbench, never a project missing some."""
        project = self.project(project_id)
        with self.transaction() as db:
            take_ids = [r[0] for r in db.execute("SELECT id FROM takes WHERE project_id = ?", (project_id,))]
            db.execute("DELETE FROM takes WHERE project_id = ?", (project_id,))
            db.execute("DELETE FROM segments WHERE project_id = ?", (project_id,))
            if not db.execute("DELETE FROM projects WHERE id = ?", (project_id,)).rowcount:
                raise NotFoundError(f"no project {project_id!r}", "project")  # another process deleted it meanwhile
        kept = self.take_store.remove_takes(take_ids)  # a take written meanwhile removes itself
        with contextlib.suppress(OSError):  # the folder of its takes from before the one take store, once empty
            (self.audio_root / project_id).rmdir()
        return project, kept

    def touch(self, db: sqlite3.Connection, project_id: str) -> None:
        db.execute("UPDATE projects SET updated = ? WHERE id = ?", (time.time(), project_id))

    # ------------------------------------------------------------------ segments

    def segments(self, project_id: str) -> list[Segment]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM segments WHERE project_id = ? ORDER BY position",
                                    (project_id,)).fetchall()
        return [Segment(**dict(r)) for r in rows]

    def segment(self, project_id: str, segment_id: str) -> Segment:
        with self._lock:
            row = self._db.execute("SELECT * FROM segments WHERE id = ? AND project_id = ?",
                                   (segment_id, project_id)).fetchone()
        if row is None:
            raise NotFoundError(f"no segment {segment_id!r} in this project", "segment")
        return Segment(**dict(row))

    def update_segment(self, segment: Segment, **changes: object) -> Segment:
        with self.transaction() as db:
            for key, value in changes.items():
                assert key in {f.name for f in fields(Segment)} - {"id", "project_id", "position"}
                db.execute(f"UPDATE segments SET {key} = ? WHERE id = ?", (value, segment.id))
            self.touch(db, segment.project_id)
        return self.segment(segment.project_id, segment.id)

    def set_state(self, segment: Segment, state: str, error: str | None = None) -> None:
        with self.transaction() as db:
            db.execute("UPDATE segments SET state = ?, error = ? WHERE id = ?", (state, error, segment.id))

    def replace_segments(self, project_id: str, remove: list[Segment], insert_at: int, rows: list[dict],
                         takes_to: dict[str, int] | None = None) -> list[Segment]:
        """Replace ``remove`` (consecutive) by ``rows`` at position ``insert_at``; the takes of a removed
        segment go to the new row ``takes_to[old id]`` (never dropped). Returns the new segments."""
        with self.transaction() as db:
            for seg in remove:
                db.execute("DELETE FROM segments WHERE id = ?", (seg.id,))
            shift = len(rows) - len(remove)
            if shift:
                db.execute("UPDATE segments SET position = position + ? WHERE project_id = ? AND position >= ?",
                           (shift + 100_000_000, project_id, insert_at + len(remove)))
                db.execute("UPDATE segments SET position = position - 100000000 WHERE project_id = ? "
                           "AND position >= 100000000", (project_id,))
            ids = [self._insert_segment(db, project_id, insert_at + i, row) for i, row in enumerate(rows)]
            for old, index in (takes_to or {}).items():
                db.execute("UPDATE takes SET segment_id = ? WHERE segment_id = ?", (ids[index], old))
            self.touch(db, project_id)
        return [self.segment(project_id, i) for i in ids]

    @staticmethod
    def _insert_segment(db: sqlite3.Connection, project_id: str, position: int, row: dict) -> str:
        segment_id = row.get("id") or new_id()
        db.execute("INSERT INTO segments VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                   (segment_id, project_id, position, row["text"], row["voice"], row.get("instruction", ""),
                    float(row.get("speed", 1.0)), row["brk"], row.get("pause"), row.get("chapter"),
                    row.get("speaker"), row.get("chosen_take"), "idle", None))
        return segment_id

    # ------------------------------------------------------------------ takes

    def add_take(self, segment: Segment, keep: Callable[..., StoredTake], *, flags: list[str],
                 seconds_to_make: float, choose: bool = True) -> Take:
        """Keep a take of ``segment`` as it is now: ``keep(take_store, form=..., label=..., owner=...)`` stores it
        in the take store (:func:`cosyvoice.takes.provenance.keep_take`, with the project and segment in its
        record, under the project's name and owner), then its link here; ``choose`` marks it."""
        project = self.project(segment.project_id)
        stored = keep(self.take_store, form={"longform": {"project": project.id, "segment": segment.id}},
                      label=project.name, owner=project.owner)
        take = Take(stored.id, segment.project_id, segment.id, stored.provenance["seed"], segment.text, segment.voice,
                    stored.provenance["voice_id"], segment.instruction, segment.speed, stored.samples,
                    stored.sample_rate, flags, seconds_to_make, stored.created)
        row = asdict(take) | {"flags": json.dumps(flags)}
        try:
            with self.transaction() as db:
                if db.execute("SELECT 1 FROM projects WHERE id = ?", (segment.project_id,)).fetchone() is None:
                    raise NotFoundError("the project was deleted meanwhile", "project")
                db.execute(f"INSERT INTO takes ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                           tuple(row.values()))
                if choose:
                    db.execute("UPDATE segments SET chosen_take = ?, state = 'idle', error = NULL WHERE id = ?",
                               (take.id, segment.id))
                self.touch(db, segment.project_id)
        except BaseException:  # no link: no take either
            try:
                self.take_store.remove_takes([take.id])
            except Exception:  # e.g. the disk is still full: the take stays, its owner's, in the workbench
                logger.warning("take %s of project %s stays in the take store unlinked", take.id, project.id,
                               exc_info=True)
            raise
        return take

    def takes(self, project_id: str) -> dict[str, list[Take]]:
        """Every take of the project by segment id, oldest first (takes deleted in the workbench are gone)."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM takes WHERE project_id = ? ORDER BY created",
                                    (project_id,)).fetchall()
        held = self._held([r["id"] for r in rows])
        out: dict[str, list[Take]] = {}
        for r in rows:
            if r["id"] in held:
                out.setdefault(r["segment_id"], []).append(_take(r))
        return out

    def take(self, project_id: str, take_id: str) -> Take:
        with self._lock:
            row = self._db.execute("SELECT * FROM takes WHERE id = ? AND project_id = ?",
                                   (take_id, project_id)).fetchone()
        if row is None or not self._held([take_id]):
            raise NotFoundError(f"no take {take_id!r} in this project", "take")
        return _take(row)

    def _held(self, take_ids: list[str]) -> set[str]:
        """Which of ``take_ids`` the take store still has (all, in a read-only folder from before it)."""
        return set(take_ids) if self._own_files else set(self.take_store.existing(take_ids))

    def take_path(self, take: Take) -> Path:
        """The take's audio file, as the take store names it."""
        if self._own_files:
            return self.audio_root / take.project_id / f"{take.id}.wav"
        stored = self.take_store.existing([take.id]).get(take.id)
        if stored is None:
            raise NotFoundError(f"take {take.id!r} was deleted", "take")
        return self.take_store.audio_path(stored)

    def take_audio(self, take: Take) -> np.ndarray:
        """The take's samples; a damaged one (not numbers) is refused by its id, never mixed in."""
        audio, _ = sf.read(self.take_path(take), dtype="float32")
        return finite(audio, take.id)


def _adopted(row: sqlite3.Row) -> StoredTake:
    """A take long-form stored itself, as the take store keeps it (its file where it is: ``longform/<project>/``),
    with the provenance it had (what it did not record, as None)."""
    settings = json.loads(row["project_settings"])
    provenance = {"text": row["text"], "segments": [row["text"]], "mode": "instruct" if row["instruction"] else "sft",
                  "voice": "", "voice_id": row["voice_id"], "instruction": row["instruction"], "seed": row["seed"],
                  "speed": row["speed"], "steps": settings.get("steps"), "final": settings.get("final"),
                  "first_hop": settings.get("first_hop"), "model_id": None, "software": None,
                  "precision": None, "sample_rate": row["sample_rate"],
                  "timings": {"synthesis_seconds": round(row["seconds_to_make"], 4), "first_chunk_seconds": None,
                              "audio_seconds": round(row["samples"] / row["sample_rate"], 4)},
                  "longform": {"project": row["project_id"], "segment": row["segment_id"]}}
    return StoredTake(0, row["id"], row["created"], row["project_owner"], None, None, row["project_name"],
                      f"../longform/{row['project_id']}/{row['id']}.wav", row["sample_rate"], row["samples"],
                      provenance)


def _project(row: sqlite3.Row) -> Project:
    return Project(**(dict(row) | {"settings": json.loads(row["settings"])}))


def _take(row: sqlite3.Row) -> Take:
    return Take(**(dict(row) | {"flags": json.loads(row["flags"])}))
