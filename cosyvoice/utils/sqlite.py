"""The studio's embedded databases (workbench, long-form projects): one way to open them and to write."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

from cosyvoice.errors import StorageError
from cosyvoice.utils.fs import DISK_FULL_MESSAGE


def open_database(path: str | Path) -> sqlite3.Connection:
    """A connection shared by a store's threads (the store serialises writes with its lock), in WAL mode so
    readers never wait, with ``synchronous=FULL`` so a committed row survives ``kill -9`` and power loss."""
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30.0)
    db.row_factory = sqlite3.Row
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("PRAGMA foreign_keys=ON")
    return db


@contextlib.contextmanager
def write_transaction(db: sqlite3.Connection, lock: threading.RLock) -> Iterator[sqlite3.Connection]:
    """One write transaction: BEGIN IMMEDIATE (another process waits instead of failing half-way), rolled back
    whole on any error; a full disk raises :class:`StorageError` (the database is as it was)."""
    with lock:
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        except sqlite3.OperationalError as exc:
            if exc.sqlite_errorcode & 0xFF != sqlite3.SQLITE_FULL:
                raise
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise StorageError(DISK_FULL_MESSAGE) from exc
