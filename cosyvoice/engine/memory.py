"""How much memory the engine's caches may take when a deployment does not say: a share of what the device
has free when the engine starts (``Limits.flow_cache_mb`` None).

A fixed default cannot fit every machine: 32 GiB of incremental flow cache suits an 80 GB GPU shared by 64
streams, but on a 24 GB two-core CPU box one stream (``max_sessions=1``) could grow it past the machine's
memory (a 60 s stream holds ~10.8 GB of DiT keys/values in float32 at 10 steps) and be killed by the kernel.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from cosyvoice.flow import FlowStream

#: the share of the memory free at the engine's start that all flow caches together may hold; the rest is
#: headroom for the weights' working set, transient activations and the allocator's fragmentation (a growing
#: cache frees buffers of every size)
FLOW_CACHE_SHARE = 0.5
#: the most a default budget grants (the former fixed default: 64 GPU streams of ~30 s in bf16)
FLOW_CACHE_MAX_MB = 32768.0


def default_flow_cache_mb(free_bytes: int) -> float:
    """The flow-cache budget in MiB for a device with ``free_bytes`` free: :data:`FLOW_CACHE_SHARE` of it, at
    most :data:`FLOW_CACHE_MAX_MB`."""
    return min(FLOW_CACHE_MAX_MB, FLOW_CACHE_SHARE * free_bytes / 2**20)


def free_memory_bytes(device: torch.device) -> int:
    """Bytes free on ``device`` now: a GPU's free memory, or the host's available memory (``MemAvailable``; its
    total where that cannot be read), bounded by the process's cgroup limit where one is set (a container sees
    the host's /proc/meminfo)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    free = _meminfo_available()
    limit = _cgroup_room()
    return free if limit is None else min(free, limit)


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cgroup_room() -> int | None:
    """cgroup v2's ``memory.max`` less ``memory.current``; None without a limit."""
    root = Path("/sys/fs/cgroup")
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((root / "memory.current").read_text()))
    except (OSError, ValueError):
        return None


class FlowCacheLedger:
    """Which streams keep their incremental flow cache, within one budget (bytes) for all of them.

    Every stream is guaranteed ``share`` bytes (the budget over ``max_sessions``: what it gets however busy the
    engine is); beyond that it borrows what the other streams leave free, so a stream alone on a small machine
    keeps its cache as far as the whole budget allows instead of recomputing past ``1 / max_sessions`` of it
    (with the default 8 sessions on a 24 GB CPU box that share ended incremental streaming ~3 s into a request).
    A stream that asks for no more than its share always gets it: streams that borrowed are dropped to make
    room, the largest first. A dropped stream recomputes from then on (the reference's path, the same audio up
    to rounding), so under memory pressure a stream's rounding can depend on what else runs.
    The token-to-wave worker thread's own: no lock.
    """

    def __init__(self, budget: float, share: float) -> None:
        self.budget, self.share = budget, share
        self.fallbacks = 0  # streams dropped to recomputing since the start
        self._held: dict[int, tuple[int, FlowStream]] = {}  # stream key -> (bytes reserved, the stream)

    def fits(self, key: int, need: int) -> bool:
        """Whether a stream asking for ``need`` bytes in all would keep its cache (:meth:`reserve` decides)."""
        return need <= self.share or need + self._others(key) <= self.budget

    def reserve(self, key: int, stream: FlowStream, need: int) -> None:
        """Let ``stream`` grow to ``need`` bytes, or drop its cache where it cannot; within its share, borrowers
        are dropped first to make room."""
        if not stream.caching:
            return
        if not self.fits(key, need):
            self._drop(key, stream)
            return
        borrowers = sorted(((held, k) for k, (held, _) in self._held.items() if k != key and held > self.share),
                           reverse=True)
        while need + self._others(key) > self.budget and borrowers:
            other = borrowers.pop(0)[1]
            self._drop(other, self._held[other][1])
        self._held[key] = (need, stream)

    def release(self, key: int) -> None:
        """The stream ``key`` ended: its bytes are free."""
        self._held.pop(key, None)

    @property
    def reserved(self) -> int:
        return sum(held for held, _ in self._held.values())

    def _others(self, key: int) -> int:
        return sum(held for k, (held, _) in self._held.items() if k != key)

    def _drop(self, key: int, stream: FlowStream) -> None:
        stream.drop_cache()
        self._held.pop(key, None)
        self.fallbacks += 1
