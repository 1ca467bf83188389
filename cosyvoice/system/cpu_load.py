"""How much of the machine's CPU went to other work while this process measured something.

Timings taken beside other work say little about the code timed: auto's precision checks (:mod:`cosyvoice.backends.
precision`) compare candidates by their seconds, and a neighbour that starts or stops between two candidates ranks
them by the neighbour. The kernel counts each core's busy time (``/proc/stat``: user, nice, system, interrupts and
the time a hypervisor gave to other guests); over the cores this process may run on, less its own CPU time, that is
the other work. Elsewhere than Linux nothing is known: :class:`OtherWork` says None.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

#: the fields of a core's /proc/stat line (``cpuN``) that are busy time (user nice system idle iowait irq softirq
#: steal ...): every one but idle and iowait
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)


def machine_busy_seconds(stat: Path = Path("/proc/stat")) -> tuple[float, int] | None:
    """(CPU seconds the cores this process may run on have been busy since boot, how many of them), or None where
    the kernel does not say. Only those cores (its CPU affinity, in a container its cpuset): work elsewhere on the
    host does not compete with it."""
    try:
        lines = stat.read_text(encoding="ascii").splitlines()
    except OSError:
        return None
    mine = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    busy, cores = 0, 0
    for line in lines:
        fields = line.split()
        if len(fields) < 9 or not fields[0].startswith("cpu") or not fields[0][3:].isdigit():
            continue
        if mine is None or int(fields[0][3:]) in mine:
            busy += sum(int(fields[1 + i]) for i in _BUSY_FIELDS)
            cores += 1
    return (busy / os.sysconf("SC_CLK_TCK"), cores) if cores else None


class OtherWork:
    """From its creation: the share of the machine's cores that went to work other than this process's
    (:meth:`share`: 0 on a quiet machine, 0.5 when another program kept one of two cores busy throughout)."""

    def __init__(self, stat: Path = Path("/proc/stat")) -> None:
        self._stat = stat
        self._start, self._own, self._wall = machine_busy_seconds(stat), time.process_time(), time.monotonic()

    def share(self) -> float | None:
        """The other work's share of every core since creation (None where /proc/stat is not there)."""
        now, wall = machine_busy_seconds(self._stat), time.monotonic() - self._wall
        if now is None or self._start is None or wall <= 0:
            return None
        others = (now[0] - self._start[0]) - (time.process_time() - self._own)
        return min(1.0, max(0.0, others / (wall * now[1])))
