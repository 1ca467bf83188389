"""The studio's embedded databases (workbench, long-form projects): one way to open them and to write, and one
way to serve a data folder the server cannot write (read-only)."""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

from cosyvoice.errors import ReadOnlyError, ResourceLimitError, StorageError
from cosyvoice.settings import DATA_DIR_SETTING, STORE_BUSY_SETTING, store_busy_seconds
from cosyvoice.system.fs import DISK_FULL_MESSAGE, unwritable

logger = logging.getLogger(__name__)


def data_folder_read_only(folder: str | Path, *, create: bool = True) -> str | None:
    """Why nothing can be stored in the data folder ``folder`` (its setting named), or None where it can be
    written. The folder is created if missing (``create=False``: see :func:`~cosyvoice.system.fs.unwritable`)."""
    denied = unwritable(folder, create=create)
    if denied is None:
        return None
    logger.warning("the data folder %s is not writable (%s); its takes, tests and projects are served read-only "
                   "(set %s to a folder the server can write)", folder, denied.strerror, DATA_DIR_SETTING)
    return (f"the server's data folder is read-only ({DATA_DIR_SETTING}): takes, listening tests and long-form "
            "projects can be read, but nothing can be made or changed")


def open_database(path: str | Path) -> sqlite3.Connection:
    """A connection shared by a store's threads (the store serialises writes with its lock), in WAL mode so
    readers never wait, with ``synchronous=FULL`` so a committed row survives ``kill -9`` and power loss."""
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=store_busy_seconds())
    db.row_factory = sqlite3.Row
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("PRAGMA foreign_keys=ON")
    return db


def open_read_only(path: Path, schema: str) -> sqlite3.Connection:
    """A store's database in a folder it cannot write, to read: the file as it is (read-only; immutable where
    SQLite cannot make its WAL index beside it), or an empty database of ``schema`` where none was stored."""
    if not path.is_file():
        db = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)
        db.executescript(schema)
    else:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False,
                             isolation_level=None)
        try:
            db.execute("SELECT count(*) FROM sqlite_master").fetchone()
        except sqlite3.OperationalError:
            db.close()
            db = sqlite3.connect(f"{path.resolve().as_uri()}?immutable=1", uri=True, check_same_thread=False,
                                 isolation_level=None)
    db.row_factory = sqlite3.Row
    return db


def require_writable(read_only: str | None) -> None:
    """:class:`ReadOnlyError` for a store that cannot write (``read_only``: why), before work it could not keep."""
    if read_only:
        raise ReadOnlyError(read_only)


def open_store(folder: Path, name: str, schema: str) -> tuple[sqlite3.Connection, str | None]:
    """A store's database ``name`` in the data folder ``folder``, its ``schema`` made (idempotent), and why it
    is read-only (None: writable; see :func:`data_folder_read_only`)."""
    read_only = data_folder_read_only(folder)
    if read_only:
        return open_read_only(folder / name, schema), read_only
    db = open_database(folder / name)
    db.executescript(schema)
    return db, None


@contextlib.contextmanager
def write_transaction(db: sqlite3.Connection, lock: threading.RLock,
                      read_only: str | None = None) -> Iterator[sqlite3.Connection]:
    """One write transaction: BEGIN IMMEDIATE (another process waits instead of failing half-way), rolled back
    whole on any error; a full disk raises :class:`StorageError` (the database is as it was), a lock another
    process holds past ``COSYVOICE_STORE_BUSY_SECONDS`` :class:`ResourceLimitError` (busy: retry). ``read_only``:
    the store's reason it cannot write (:class:`ReadOnlyError`)."""
    require_writable(read_only)
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
            code = exc.sqlite_errorcode & 0xFF
            if code not in (sqlite3.SQLITE_FULL, sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
                raise
            if db.in_transaction:
                db.execute("ROLLBACK")
            if code == sqlite3.SQLITE_FULL:
                raise StorageError(DISK_FULL_MESSAGE) from exc
            raise ResourceLimitError(f"the data folder's database is locked by another process (waited "
                                     f"{store_busy_seconds():g} s, {STORE_BUSY_SETTING}); nothing was changed: "
                                     "retry in a moment") from exc


def add_columns(db: sqlite3.Connection, table: str, columns: dict[str, str]) -> None:
    """Add the ``columns`` (name -> declaration) a database made by an older version lacks; existing rows get the
    declaration's default (NULL without one)."""
    have = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
    for name, declaration in columns.items():
        if name not in have:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {declaration}")
