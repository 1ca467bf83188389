"""The C library, loaded once for the few calls the process makes into it (:mod:`.malloc`, :mod:`.pages`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The process's C library (errno kept for the callers that read it), or None where it cannot be found."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name, use_errno=True) if name else None
    except OSError:
        return None


def function(name: str) -> ctypes._CFuncPtr | None:
    """``name`` from :func:`libc`, or None where the library or the symbol is missing (another C library)."""
    return getattr(libc(), name, None)
