"""What the leak tests measure: resident memory and live tensors of this process (Linux /proc)."""

from __future__ import annotations

import gc
import os
import warnings

import torch


def rss_bytes() -> int:
    """Resident memory of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def live_tensors() -> int:
    """Tensors reachable by the garbage collector (a leak test compares two counts)."""
    with warnings.catch_warnings():  # isinstance() on some torch module attributes warns about deprecation
        warnings.simplefilter("ignore")
        return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())
