"""ACX delivery, read back by readers that did not write it: mutagen reads the frame headers FFmpeg's LAME wrote
(bit rate, CBR, rate, channels, length), FFmpeg reads the tags mutagen wrote, and numpy measures the room tone
and levels of the decoded files. A delivery that ACX would refuse is never called one that meets ACX."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import av
import numpy as np
import pytest
import soundfile as sf
import test_longform_books
from mutagen import id3, mp3, mp4

from cosyvoice.encoding import encode_audio
from cosyvoice.errors import ConflictError, InvalidInputError
from cosyvoice.longform import delivery, finishing

studio = test_longform_books.studio  # the books tests' fixture: a narrator voice on the tiny bundle
BOOK = "# One\n\nHi there.\n\nGood day.\n\n# Two\n\nBye now."


def png() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def book(studio) -> str:
    project = studio.editor.create("Book file", BOOK, voice="Narrator", preset="acx", title="The Long Road",
                                   author="Ann Author", narrator="Ned Narrator")
    studio.renders.generate(project.id)
    assert studio.renders.wait(project.id, timeout=300)["done"] == len(studio.segments(project.id))
    studio.covers.set_cover(project.id, png())
    return project.id


def quiet_ends(x: np.ndarray, sr: int) -> tuple[float, float]:
    """Seconds before the first and after the last 10 ms block louder than -45 dBFS RMS."""
    n = sr // 100
    blocks = x[: len(x) // n * n].reshape(-1, n)
    loud = np.flatnonzero(np.sqrt(np.mean(blocks.astype(np.float64) ** 2, axis=1)) > 10 ** (-45 / 20))
    return loud[0] * n / sr, (len(x) - (loud[-1] + 1) * n) / sr


def test_the_acx_delivery_is_a_tagged_192k_cbr_mono_mp3_per_chapter(studio, book: str, tmp_path: Path) -> None:
    report = studio.delivery.make(book)
    assert report["passed"] and report["current"], report
    name, path = studio.delivery.archive(book)
    assert name == "The-Long-Road-ACX.zip"
    with zipfile.ZipFile(path) as z:
        assert z.namelist() == ["01-One.mp3", "02-Two.mp3"]
        z.extractall(tmp_path)
    assert [f["file"] for f in report["files"]] == ["01-One.mp3", "02-Two.mp3"]
    for i, (title, f) in enumerate(zip(["One", "Two"], report["files"], strict=True), 1):
        file = tmp_path / f["file"]
        info = mp3.MP3(file).info
        assert info.bitrate_mode == mp3.BitrateMode.CBR and round(info.bitrate / 1000) == 192
        assert (info.sample_rate, info.channels, info.layer, info.version) == (44100, 1, 3, 1)
        assert 0 < info.length <= 120 * 60
        with av.open(str(file)) as container:  # FFmpeg reads the tags mutagen wrote
            tags = container.metadata
            covers = [s for s in container.streams.video if s.disposition & av.stream.Disposition.attached_pic]
            assert len(covers) == 1
        assert (tags["title"], tags["album"], tags["artist"], tags["composer"], tags["track"]) == (
            title, "The Long Road", "Ann Author", "Ned Narrator", f"{i}/2")
        assert id3.ID3(file).getall("APIC")[0].data == png()
        x, sr = sf.read(file, dtype="float32")
        assert sr == 44100 and x.ndim == 1
        head, tail = quiet_ends(x, sr)
        assert 0.5 <= head <= 1.0 and 1.0 <= tail <= 5.0, (head, tail)
        assert head == pytest.approx(f["head_seconds"], abs=0.03) and tail == pytest.approx(f["tail_seconds"],
                                                                                           abs=0.03)
        rms = 20 * np.log10(np.sqrt(np.mean(x.astype(np.float64) ** 2)))
        assert -23 <= rms <= -18 and rms == pytest.approx(f["rms_db"], abs=0.1)
        assert 20 * np.log10(np.max(np.abs(x))) <= -3
        assert np.all(x[: int(0.4 * sr)] != 0.0)  # room tone, not digital silence
    assert report["files"][0]["bit_rate"] == 192000 and report["files"][0]["constant_bit_rate"]


def test_a_delivery_of_a_changed_project_is_refused_and_unmastered_levels_fail(studio, book: str) -> None:
    studio.delivery.make(book)
    studio.editor.update_settings(book, narrator="Someone Else")
    assert studio.delivery.report(book)["current"] is False
    with pytest.raises(ConflictError, match="changed since"):
        studio.delivery.archive(book)
    studio.editor.update_settings(book, preset="none")  # the tiny model's raw takes are near full scale
    try:
        report = studio.delivery.make(book)
        assert not report["passed"]
        assert all(any("peak" in p or "RMS" in p for p in f["problems"]) for f in report["files"])
    finally:
        studio.editor.update_settings(book, preset="acx", narrator="Ned Narrator")


def test_the_book_export_carries_title_author_narrator_and_cover(studio, book: str, tmp_path: Path) -> None:
    _, data, _ = studio.mixer.export(book, "m4b")
    (tmp_path / "book.m4b").write_bytes(data)
    tags = mp4.MP4(tmp_path / "book.m4b").tags
    assert (tags["\xa9nam"], tags["\xa9ART"], tags["\xa9wrt"]) == (["The Long Road"], ["Ann Author"],
                                                                  ["Ned Narrator"])
    assert bytes(tags["covr"][0]) == png()
    with av.open(str(tmp_path / "book.m4b")) as container:
        assert (container.metadata["title"], container.metadata["composer"]) == ("The Long Road", "Ned Narrator")
        assert [c["metadata"]["title"] for c in container.chapters()] == ["One", "Two"]  # still chaptered
        assert sum(f.samples for f in container.decode(audio=0)) > 0
    _, data, _ = studio.mixer.export(book, "mp3")
    with av.open(io.BytesIO(data)) as container:
        assert (container.metadata["album"], container.metadata["artist"]) == ("The Long Road", "Ann Author")


def test_the_check_reads_the_file_not_the_settings() -> None:
    sr = 24000
    t = np.arange(3 * sr) / sr
    x = (0.1 * np.sin(2 * np.pi * 220 * t) * (t > 0.7) * (t < 2.0)).astype(np.float32)
    report = delivery.check_mp3("plain.mp3", io.BytesIO(encode_audio(x, "mp3", sr)))  # the plain 64 kbps export
    assert report.problems[:2] == ["bit rate 64 kbps; ACX wants 192 kbps constant (CBR)",
                                   "sample rate 24000 Hz; ACX wants 44100 Hz"]
    assert not report.passed and report.as_dict()["sample_rate"] == 24000
    too_long = delivery.FileReport("long.mp3", report.frames, finishing.AcxReport(121 * 60, -20, -6, -70), 0.7,
                                   2.0, {})
    assert "121.0 minutes long; ACX takes at most 120 minutes a file" in too_long.problems


def test_a_cover_must_be_an_image_and_tags_are_one_line(studio, book: str) -> None:
    with pytest.raises(InvalidInputError, match="JPEG or PNG"):
        studio.covers.set_cover(book, b"GIF89a....")
    with pytest.raises(InvalidInputError, match="author is longer"):
        studio.editor.update_settings(book, author="x" * 300)
    assert studio.editor.update_settings(book, title="  The   Long Road ").settings["title"] == "The Long Road"
