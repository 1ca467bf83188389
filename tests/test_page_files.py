"""The web UI's handed-out files (takes, exports, ZIPs) live in one temporary root per studio, which goes with the
studio: a server start or a test run must not leave one behind for good."""

from __future__ import annotations

import gc

from app.files import PageFiles


def test_the_pages_handed_out_files_leave_the_temporary_folder_with_their_studio() -> None:
    files = PageFiles()
    root = files.root
    (files.folder() / "take.wav").write_bytes(b"RIFF")
    assert root.is_dir() and len(list(root.rglob("take.wav"))) == 1
    del files
    gc.collect()
    assert not root.exists()
