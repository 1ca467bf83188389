"""Durable file replacement: a reader sees the old file or the new one, never a torn write, even after a crash."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from pathlib import Path

from cosyvoice.errors import StorageError

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
DISK_FULL_MESSAGE = "disk full: the server's data folder has no space left, so nothing was saved"


def disk_full(exc: BaseException) -> StorageError | None:
    """The :class:`StorageError` users see for a write that failed because the disk is full, else None."""
    return StorageError(DISK_FULL_MESSAGE) if isinstance(exc, OSError) and exc.errno in DISK_FULL else None
READ_ONLY_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})  # a folder this process may not write


def temp_path(path: Path) -> Path:
    """The temporary sibling :func:`atomic_write` writes through (a hidden ``.tmp`` file, unique per thread)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def atomic_write(path: str | Path, write: Callable[[str], object]) -> None:
    """``write(tmp)`` a temporary sibling, fsync it, rename it over ``path``, fsync the folder.

    A crash (even ``kill -9``) at any point leaves ``path`` as it was or complete; at worst a stale
    ``.<name>.*.tmp`` remains, which readers ignore. A full disk raises :class:`StorageError` (nothing left).
    """
    path = Path(path)
    tmp = temp_path(path)
    try:
        write(str(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        raise disk_full(exc) or exc from exc
    finally:
        tmp.unlink(missing_ok=True)
    try:
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:  # some platforms cannot open folders; the rename is still atomic
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unwritable(folder: str | Path, *, create: bool = True) -> OSError | None:
    """Why this process cannot write ``folder`` (a read-only mount, no permission), or None when it can: the
    folder is created if missing (``create=False``: its nearest existing parent is asked instead) and a probe
    file written and removed (permission bits alone do not say, e.g. for root or under ``chattr +i``). Other
    failures (not a folder, a broken disk) are raised."""
    folder = Path(folder)
    if not create and not folder.exists():
        return unwritable(next(p for p in folder.absolute().parents if p.exists()))
    probe = folder / f".probe.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        os.unlink(probe)
    except OSError as exc:
        if exc.errno in READ_ONLY_ERRNOS:
            return exc
        raise
    return None
