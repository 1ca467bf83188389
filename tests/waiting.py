"""The tests' one polling wait, for conditions that no event signals (another process's answers over HTTP, a
server's counters); where the product has an event or a callback, tests wait on that instead."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

POLL_S = 0.05  # the wait returns within this of the condition holding (a server is asked 20 times a second)


def until(check: Callable[[], T], timeout: float = 30.0, what: str = "condition") -> T:
    """``check()``'s first truthy value, asked until it comes; fails the test once ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"{what} not reached in {timeout:g} s (last: {value!r})"
        time.sleep(POLL_S)
    return value
