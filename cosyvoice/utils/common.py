"""``cosyvoice.utils.common`` as official scripts import it: ``set_all_random_seed``."""

from __future__ import annotations

import random

import numpy as np
import torch

from cosyvoice.errors import InvalidInputError


def set_all_random_seed(seed: int) -> None:
    """Seed Python's, numpy's and torch's global generators (CUDA included).

    Requests without ``seed=`` draw their own seed from torch's global generator at the call, so this
    makes the next call's audio repeatable. Whole-number floats (a UI number box) are accepted.
    """
    if isinstance(seed, bool) or not float(seed).is_integer():
        raise InvalidInputError(f"a seed must be a whole number, got {seed!r}")
    value = int(seed)
    random.seed(value)
    np.random.seed(value % 2**32)  # numpy accepts [0, 2**32)
    torch.manual_seed(value)  # seeds every CUDA device as well
