"""The tests' one polling wait, for conditions that no event signals (another process's answers over HTTP, a
server's counters); where the product has an event or a callback, tests wait on that instead. And the free
loopback port the servers those tests start listen on."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx

T = TypeVar("T")

POLL_S = 0.05  # the wait returns within this of the condition holding (a server is asked 20 times a second)


def free_port() -> int:
    """A loopback port nothing listens on now, for a server process to bind (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def until(check: Callable[[], T], timeout: float = 30.0, what: str = "condition") -> T:
    """``check()``'s first truthy value, asked until it comes; fails the test once ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"{what} not reached in {timeout:g} s (last: {value!r})"
        time.sleep(POLL_S)
    return value


def until_ready(process: subprocess.Popen, url: str, timeout: float = 180.0, log: Path | None = None) -> None:
    """Waits until the server ``process`` started answers ``url``'s /ready with 200 (its model loaded); fails at
    once, with its ``log`` where it writes one, if the process exits instead."""

    def ready() -> bool:
        assert process.poll() is None, f"the server exited:\n{log.read_text() if log else ''}"
        try:
            return httpx.get(f"{url}/ready", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    until(ready, timeout, "the server's readiness")
