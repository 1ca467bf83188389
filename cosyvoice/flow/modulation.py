"""The DiT's time conditioning, computed once per ODE time and kept: the AdaLN modulation cache.

Every DiT block (and the output norm) turns the time embedding into its shift/scale/gate rows with a
``dim -> 6 dim`` linear. Those depend on ``t`` alone, and the Euler grid of a step count is the same for every
request (both guidance rows share ``t``), so at the released sizes a step re-reads 567 MB of AdaLN weights to
recompute the same 22 rows of modulation. :class:`ModulationCache` keeps them per ODE time vector: the same
function on the same input, computed once, so the cached path is bit-equal to recomputing.

The key is the exact ``t`` vector (its float values, which also fix the batch size: a GEMM of another row count may
round differently), the dtype, and the identity and version of every weight it reads (a reload or an in-place
edit of those weights is a new key). Entries are evicted least recently used beyond a byte budget (~1.1 MB per
step of a released-size CFG pair; the default holds several step grids and packed batch sizes).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
from torch import Tensor


class Modulation(NamedTuple):
    """What the blocks read from ``t``: each block's ``[B, 6 dim]`` AdaLN row and the output norm's ``[B, 2 dim]``."""

    blocks: tuple[Tensor, ...]
    final: Tensor

    @property
    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in (*self.blocks, self.final))


def _version(p: Tensor) -> int:
    try:
        return p._version
    except RuntimeError:  # an inference tensor tracks no version (and cannot be edited outside inference mode)
        return 0


def cacheable(t: Tensor) -> bool:
    """Whether a call may use the cache: eager CPU inference (no autograd to record, no graph being traced,
    compiled or captured; on a GPU reading ``t``'s values would synchronise every call)."""
    return (t.device.type == "cpu" and t.ndim == 1 and not torch.is_grad_enabled()
            and not torch.jit.is_tracing() and not torch.compiler.is_compiling())


class ModulationCache:
    """Least-recently-used :class:`Modulation` per (``t`` values, dtype, weights), within ``max_bytes``."""

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple, Modulation] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def __deepcopy__(self, memo: dict) -> ModulationCache:
        return ModulationCache(self.max_bytes)  # a copied DiT may get other weights: it starts empty

    def __reduce__(self) -> tuple[type, tuple[int]]:
        return ModulationCache, (self.max_bytes,)  # pickled empty (a lock does not pickle; entries are derived)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def get(self, t: Tensor, weights: Iterable[Tensor], compute: Callable[[Tensor], Modulation]) -> Modulation:
        """The modulation of ``t`` [B]: cached, or ``compute(t)`` kept for next time."""
        key = (t.dtype, tuple(t.tolist()), tuple((p.data_ptr(), _version(p), p.dtype) for p in weights))
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return found
            self.misses += 1
        made = compute(t)
        size = made.nbytes
        if size > self.max_bytes:
            return made
        with self._lock:
            if key not in self._entries:
                self._entries[key] = made
                self._bytes += size
            while self._bytes > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self._bytes -= old.nbytes
        return made
