"""What every real-browser test needs: Playwright and Debian's chromium (never a downloaded browser)."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import pytest

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def require_browser() -> tuple[ModuleType, Path]:
    """(``playwright.sync_api``, the chromium binary), or skip the calling test module with the reason."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="the browser tests need playwright (the dev extra)")
    chromium = Path(os.environ.get("COSYVOICE_CHROMIUM", "/usr/bin/chromium"))
    if not chromium.is_file():
        pytest.skip(f"no chromium at {chromium} (apt-get install chromium, or set COSYVOICE_CHROMIUM)",
                    allow_module_level=True)
    return sync_api, chromium
