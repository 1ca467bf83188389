"""The main thread's wait for a stop signal."""

from __future__ import annotations

import threading

#: how often a waiting main thread wakes to run Python's signal handlers
POLL_SECONDS = 0.5


def wait_in_main_thread(event: threading.Event | None = None) -> None:
    """Block the main thread until ``event`` is set (None: until a signal handler raises), waking every
    :data:`POLL_SECONDS`. Python runs signal handlers only in the main thread, and a process-directed signal (a
    service manager's SIGTERM) that the kernel hands to another of the process's threads does not interrupt the
    main thread's blocking wait: an unbounded ``Event.wait()`` sleeps through it (a web UI that never began its
    drain, seen in CI)."""
    event = event or threading.Event()
    while not event.wait(POLL_SECONDS):
        pass
