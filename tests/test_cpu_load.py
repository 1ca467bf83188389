"""The other work on the machine while this process measures (cosyvoice/system/cpu_load.py): what auto uses to
tell a quiet measurement from one taken beside a neighbour."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cosyvoice.system.cpu_load import OtherWork, machine_busy_seconds


def _stat(path: Path, busy_ticks: int) -> int:
    """A /proc/stat whose first core this process may run on has been busy ``busy_ticks``; the number of those
    cores. A core it may not run on is busy too: it does not count."""
    mine = sorted(os.sched_getaffinity(0))
    lines = [f"cpu  {busy_ticks + 10 ** 6} 0 0 5000 7 0 0 0 0 0"]
    lines += [f"cpu{n} {busy_ticks if n == mine[0] else 0} 0 0 2500 3 0 0 0 0 0" for n in mine]
    lines += [f"cpu{max(mine) + 1} 1000000 0 0 0 0 0 0 0 0 0", "intr 1"]
    path.write_text("\n".join(lines) + "\n")
    return len(mine)


def test_other_work_is_the_machines_busy_time_less_this_process(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    cores = _stat(stat, 100)
    assert machine_busy_seconds(stat) == (100 / os.sysconf("SC_CLK_TCK"), cores)  # idle and iowait are not busy
    quiet, busy = OtherWork(stat), OtherWork(stat)
    sum(range(10 ** 5))  # this process's own work is not the others'
    assert quiet.share() == 0.0
    _stat(stat, 100 + 10 ** 9)
    assert busy.share() == 1.0
    assert OtherWork(tmp_path / "missing").share() is None
    (tmp_path / "odd").write_text("not a stat file\n")
    assert machine_busy_seconds(tmp_path / "odd") is None


@pytest.mark.skipif(machine_busy_seconds() is None, reason="the kernel's /proc/stat is Linux's")
def test_another_programs_cpu_counts_as_other_work() -> None:
    """A program spinning beside this one: at least its CPU seconds show in the share (the rest of the machine may add
    more, never less)."""
    tick = os.sysconf("SC_CLK_TCK")
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])

    def burned() -> float:
        fields = Path(f"/proc/{burner.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick  # utime, stime

    try:
        first, work, start = burned(), OtherWork(), time.monotonic()
        while burned() - first < 0.5:  # until the burner has had half a CPU second
            time.sleep(0.02)
        share, wall, spent = work.share(), time.monotonic() - start, burned() - first
    finally:
        burner.kill()
        burner.wait()
    _, cores = machine_busy_seconds()
    assert share is not None and share * wall * cores >= spent - 3 / tick - 0.02, (share, wall, spent)
