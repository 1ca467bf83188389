"""The files the page hands a visitor (a take's download, an exported voice, the takes' ZIP, a named-API take): each
in a folder of its own under one root that Gradio is allowed to serve, kept a day as Gradio's own cache; and the
recordings a visitor hands the page (Gradio stores them)."""

from __future__ import annotations

import shutil
import tempfile
import time
import weakref
from pathlib import Path

from app.i18n import say
from cosyvoice.errors import InvalidInputError

FILE_LIFETIME_SECONDS = 86400  # takes, exports and ZIPs stay downloadable this long (also Gradio's cache)


def uploaded(path: str | None, zh: bool = False) -> str | None:
    """A recording Gradio stored for this page; a vanished file gets a message without its server path."""
    if path and not Path(path).is_file():
        raise InvalidInputError(say(zh, "expired"))
    return path or None


class PageFiles:
    """One root folder of handed-out files per studio (``launch`` lets Gradio serve it, nothing else), removed with
    the studio or at the process's exit: nothing serves it after that, and each start makes a new one, so a kept
    root would stay in the temporary folder for good (a test run left one per studio it built)."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="cosyvoice-takes-"))
        self._remove = weakref.finalize(self, shutil.rmtree, self.root, ignore_errors=True)

    def folder(self) -> Path:
        """A new folder for files handed to the page; those older than a day go (as Gradio's own cache)."""
        cutoff = time.time() - FILE_LIFETIME_SECONDS
        for old in self.root.iterdir():
            if old.stat().st_mtime < cutoff:
                shutil.rmtree(old, ignore_errors=True)
        return Path(tempfile.mkdtemp(dir=self.root))
