"""Shared fixtures: the golden folder (skips cleanly where it is absent)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cosyvoice.tools.parity.common import Golden

_DEFAULT_GOLDEN = Path(__file__).resolve().parents[2] / "shared" / "golden"  # ../shared/golden beside the clone
GOLDEN_DIR = Path(os.environ.get("COSYVOICE_GOLDEN_DIR", _DEFAULT_GOLDEN))


@pytest.fixture(scope="session")
def golden() -> Golden:
    if not (GOLDEN_DIR / "manifest.json").is_file():
        pytest.skip(f"golden fixtures not found at {GOLDEN_DIR} (set COSYVOICE_GOLDEN_DIR); parity tests need them")
    return Golden(GOLDEN_DIR)
