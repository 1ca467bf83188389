"""The project store: projects, their segment tables and every take, in SQLite; take audio in files beside it.

One database file (``longform.sqlite3`` in the data folder, WAL journal, every change one transaction) and one
folder of take audio per project (``longform/<project>/<take>.wav``, float32 samples exactly as synthesised, so
a mix made from them is bit-identical across restarts). A take's file is written (atomically, fsynced) before
its row, so a row always has its audio; a file whose row cannot be written (a full disk, a deleted project) is
removed. Nothing is deleted except by deleting the project: takes of a segment that is
edited, split or merged are kept (they no longer match its text, so they are not used until chosen again).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sqlite3
import threading
import time
import uuid
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import soundfile as sf

from cosyvoice.errors import NotFoundError
from cosyvoice.utils.fs import atomic_write
from cosyvoice.utils.sqlite import add_columns, open_store, require_writable, write_transaction

DB_NAME = "longform.sqlite3"
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


def new_id() -> str:
    return uuid.uuid4().hex[:12]


class ProjectStore:
    """Thread-safe: one connection, one lock, each change a transaction. A data folder this process cannot write
    is served read-only: :attr:`read_only` says why, and every change raises it."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.audio_root = self.root / "longform"
        self._lock = threading.RLock()
        self._db, self.read_only = open_store(self.root, DB_NAME, SCHEMA)
        if not self.read_only:
            with self.transaction() as db:
                db.execute("UPDATE segments SET state = 'idle' WHERE state = 'running'")  # a job the last run left
                add_columns(db, "projects", {"owner": "TEXT"})  # a database from before owners: local projects

    def transaction(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        return write_transaction(self._db, self._lock, self.read_only)

    def close(self) -> None:
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

    def delete_project(self, project_id: str) -> Project:
        project = self.project(project_id)
        with self.transaction() as db:
            db.execute("DELETE FROM takes WHERE project_id = ?", (project_id,))
            db.execute("DELETE FROM segments WHERE project_id = ?", (project_id,))
            db.execute("DELETE FROM projects WHERE id = ?", (project_id,))
        shutil.rmtree(self.audio_root / project_id, ignore_errors=True)  # a take written meanwhile removes itself
        return project

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

    def add_take(self, segment: Segment, audio: np.ndarray, sample_rate: int, *, seed: int, voice_id: str,
                 flags: list[str], seconds_to_make: float, choose: bool = True) -> Take:
        """Keep a take of ``segment`` as it is now (its audio file first, then its row); ``choose`` marks it."""
        require_writable(self.read_only)  # before its audio is written
        take = Take(new_id(), segment.project_id, segment.id, seed, segment.text, segment.voice, voice_id,
                    segment.instruction, segment.speed, len(audio), sample_rate, flags, seconds_to_make, time.time())
        path = self.take_path(take)
        wav = io.BytesIO()
        sf.write(wav, audio.astype(np.float32), sample_rate, subtype="FLOAT", format="WAV")
        path.parent.mkdir(parents=True, exist_ok=True)
        row = asdict(take) | {"flags": json.dumps(flags)}
        try:
            atomic_write(path, lambda tmp: Path(tmp).write_bytes(wav.getvalue()))
            with self.transaction() as db:
                if db.execute("SELECT 1 FROM projects WHERE id = ?", (segment.project_id,)).fetchone() is None:
                    raise NotFoundError("the project was deleted meanwhile", "project")
                db.execute(f"INSERT INTO takes ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                           tuple(row.values()))
                if choose:
                    db.execute("UPDATE segments SET chosen_take = ?, state = 'idle', error = NULL WHERE id = ?",
                               (take.id, segment.id))
                self.touch(db, segment.project_id)
        except BaseException:  # no row: no file either (and no folder, if its project is gone)
            path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                path.parent.rmdir()
            raise
        return take

    def takes(self, project_id: str) -> dict[str, list[Take]]:
        """Every take of the project by segment id, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM takes WHERE project_id = ? ORDER BY created",
                                    (project_id,)).fetchall()
        out: dict[str, list[Take]] = {}
        for r in rows:
            out.setdefault(r["segment_id"], []).append(_take(r))
        return out

    def take(self, project_id: str, take_id: str) -> Take:
        with self._lock:
            row = self._db.execute("SELECT * FROM takes WHERE id = ? AND project_id = ?",
                                   (take_id, project_id)).fetchone()
        if row is None:
            raise NotFoundError(f"no take {take_id!r} in this project", "take")
        return _take(row)

    def take_path(self, take: Take) -> Path:
        return self.audio_root / take.project_id / f"{take.id}.wav"

    def take_audio(self, take: Take) -> np.ndarray:
        audio, _ = sf.read(self.take_path(take), dtype="float32")
        return audio


def _project(row: sqlite3.Row) -> Project:
    return Project(**(dict(row) | {"settings": json.loads(row["settings"])}))


def _take(row: sqlite3.Row) -> Take:
    return Take(**(dict(row) | {"flags": json.loads(row["flags"])}))
