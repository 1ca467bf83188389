"""Books into long-form projects and out to audiobook platforms: PDF and DOCX files become chapters from their
headings, the ACX check measures what ACX measures, and mastering meets it; the LLM looping is recognised."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import soundfile as sf

from cosyvoice.errors import InvalidInputError
from cosyvoice.longform import documents, finishing, script

SR = 24000
BODY = "It was a won-\nderful day, and the words went on and on across the page. " * 3


def pdf_book(outline: bool, body: str = BODY, paragraphs: int = 2) -> bytes:
    """Two chapters with a sub-heading each, in larger type than the body; bookmarks when ``outline``."""
    from fpdf import FPDF

    pdf = FPDF()
    for i, title in enumerate(["The Beginning", "The Middle"]):
        pdf.add_page()
        if outline:
            pdf.start_section(title)
        pdf.set_font("helvetica", "B", 20)
        pdf.multi_cell(0, 10, title, new_x="LMARGIN", new_y="NEXT")
        pdf.set_font("helvetica", "B", 15)
        pdf.multi_cell(0, 8, "A section", new_x="LMARGIN", new_y="NEXT")
        pdf.set_font("helvetica", size=12)
        for p in range(paragraphs):
            pdf.multi_cell(0, 6, f"Paragraph {p} of chapter {i}. {body}", new_x="LMARGIN", new_y="NEXT")
            pdf.ln(6)
        pdf.set_y(-20)
        pdf.cell(0, 10, str(i + 1), align="C")  # a page number, not text
    return bytes(pdf.output())


@pytest.mark.parametrize("outline", [True, False], ids=["outline", "type-size"])
def test_a_pdf_becomes_chapters_of_paragraphs(outline: bool) -> None:
    text, chapters = documents.read_document("book.pdf", pdf_book(outline))
    assert [title for title, _ in chapters] == ["The Beginning", "The Middle"]
    paragraphs = chapters[1][1].split("\n\n")
    assert paragraphs[0] == "A section"  # a lower heading stays as a paragraph of its own
    assert paragraphs[1].startswith("Paragraph 0 of chapter 1. It was a wonderful day,")  # hyphenation joined
    assert len(paragraphs) == 3 and paragraphs[2].startswith("Paragraph 1 of chapter 1.")
    assert "\n2\n" not in text and not text.rstrip().endswith("2")  # page numbers dropped
    blocks = script.document_blocks(text, chapters)
    assert [b.chapter for b in blocks if b.chapter] == ["The Beginning", "The Middle"]


def test_a_docx_becomes_chapters_at_its_top_headings() -> None:
    import docx

    document = docx.Document()
    document.add_heading("My Book", 0)
    document.add_paragraph("Front matter.")
    for name in ("Part A", "Part B"):
        document.add_heading(name, 1)
        document.add_paragraph(f"{name} opens.")
        document.add_heading("Details", 2)
        document.add_paragraph(f"{name} goes on.")
    buffer = io.BytesIO()
    document.save(buffer)
    _, chapters = documents.read_document("book.docx", buffer.getvalue())
    assert chapters == [("My Book", "Front matter."),
                        ("Part A", "Part A opens.\n\nDetails\n\nPart A goes on."),
                        ("Part B", "Part B opens.\n\nDetails\n\nPart B goes on.")]


def test_a_document_without_headings_is_plain_text() -> None:
    import docx

    document = docx.Document()
    document.add_paragraph("One.")
    document.add_paragraph("Two.")
    buffer = io.BytesIO()
    document.save(buffer)
    assert documents.read_document("notes.docx", buffer.getvalue()) == ("One.\n\nTwo.", None)


@pytest.mark.parametrize(("name", "data", "message"), [
    ("book.pdf", b"%PDF-1.4 broken", "the PDF could not be read"),
    ("book.docx", b"PK not a zip", "the DOCX could not be read"),
    ("book.docx", b"", "the DOCX could not be read"),
])
def test_unreadable_books_are_named_errors(name: str, data: bytes, message: str) -> None:
    with pytest.raises(InvalidInputError, match=message) as err:
        documents.read_document(name, data)
    assert err.value.field == "file"


def test_a_pdf_without_text_asks_for_text_recognition() -> None:
    from fpdf import FPDF

    pdf = FPDF()
    pdf.add_page()
    pdf.rect(10, 10, 50, 50)  # a scanned page: drawing, no text
    with pytest.raises(InvalidInputError, match="no text layer"):
        documents.read_document("scan.pdf", bytes(pdf.output()))


# ----------------------------------------------------------------------------- ACX


def speech_like(seconds: float = 8.0, level: float = 0.05, noise: float = 0.003, seed: int = 0) -> np.ndarray:
    """Voiced bursts with pauses, hiss throughout (noise -50 dBFS) and one click near full scale."""
    t = np.arange(int(seconds * SR)) / SR
    voiced = np.sin(2 * np.pi * 0.4 * t) > -0.3
    x = level * np.sin(2 * np.pi * 180 * t) * (1 + np.sin(2 * np.pi * 3 * t)) ** 2 * voiced
    x = x + noise * np.random.default_rng(seed).standard_normal(len(t))
    x[2 * SR: 2 * SR + 50] = 0.9
    return x.astype(np.float32)


def test_the_acx_check_measures_rms_peak_and_noise_floor() -> None:
    tone = (0.1 * np.sqrt(2) * np.sin(2 * np.pi * 440 * np.arange(SR * 2) / SR)).astype(np.float32)
    quiet = (1e-4 * np.random.default_rng(1).standard_normal(SR)).astype(np.float32)
    report = finishing.acx_check(np.concatenate([tone, quiet]), SR)
    assert report.peak_db == pytest.approx(20 * np.log10(0.1 * np.sqrt(2)), abs=0.01)
    assert report.rms_db == pytest.approx(10 * np.log10(0.01 * 2 / 3), abs=0.05)  # -21.8 dB over all 3 s
    assert report.noise_floor_db == pytest.approx(-80, abs=0.5)  # the quietest half second
    assert report.passed and report.as_dict()["problems"] == []
    loud = finishing.acx_check(speech_like(), SR)
    assert loud.problems == [f"RMS {loud.rms_db:.1f} dB is outside -23 to -18 dB", "peak -0.9 dB is above -3 dB",
                             f"noise floor {loud.noise_floor_db:.1f} dB is above -60 dB"]
    silent = finishing.acx_check(np.zeros(SR, np.float32), SR).as_dict()
    assert silent["noise_floor_db"] is None and silent["rms_db"] is None  # digital silence, not -inf in JSON


def test_the_meter_fed_in_pieces_equals_one_pass() -> None:
    x = np.concatenate([speech_like(seed=2), np.zeros(SR, np.float32), speech_like(seed=3)])
    meter = finishing.AcxMeter(SR)
    for piece in np.array_split(x, 37):
        meter.feed(piece)
    whole = finishing.acx_check(x, SR)
    assert meter.report().as_dict() == whole.as_dict()


@pytest.mark.parametrize("level", [0.005, 0.05, 0.3])
def test_mastering_meets_acx_per_segment_and_as_a_chapter(level: float) -> None:
    segments = [finishing.finish_segment(speech_like(level=level, noise=level / 20, seed=s), SR,
                                         finishing.Finish("acx", 0.1)) for s in range(3)]
    for segment in segments:
        assert finishing.acx_check(segment, SR).passed, finishing.acx_check(segment, SR)
    pause = np.zeros(int(0.8 * SR), np.float32)
    chapter = finishing.acx_check(np.concatenate([segments[0], pause, segments[1], pause, segments[2]]), SR)
    assert chapter.passed and -21.5 < chapter.rms_db < -19.5 and chapter.peak_db <= -3.5 + 1e-6


def test_the_limiter_never_passes_its_ceiling_and_keeps_quiet_audio_as_it_is() -> None:
    x = speech_like(level=0.2)
    y = finishing.limit_peaks(x, SR, -6.0)
    assert np.max(np.abs(y)) <= 10 ** (-6 / 20) + 1e-7
    quiet = 0.1 * x
    assert np.array_equal(finishing.limit_peaks(quiet, SR, -6.0), quiet)


# ----------------------------------------------------------------------------- suspect takes


def test_a_looping_take_is_recognised_and_sampled_speech_is_not() -> None:
    rng = random.Random(0)
    speech = [rng.randrange(6561) for _ in range(400)]
    assert finishing.token_loop(speech) is None
    phrase = speech[:12]
    looped = speech[:100] + phrase * 8 + speech[100:]
    assert finishing.token_loop(looped) == "the speech loops: 12 token(s) said 8 times from 4.0 s"
    assert finishing.token_loop(speech[:100] + [7] * 80) == "the speech loops: 1 token(s) said 80 times from 4.0 s"
    assert finishing.token_loop(speech[:100] + [7] * 60) is None  # 2.4 s of one token: a pause, not a loop


def test_the_models_length_bounds_flag_a_take() -> None:
    assert finishing.token_bounds(200, (20, 200), 10) == (
        "ran to the model's length limit (200 speech tokens for 10 text tokens)")
    assert finishing.token_bounds(20, (20, 200), 10) == (
        "stopped at the model's shortest length (20 speech tokens for 10 text tokens)")
    assert finishing.token_bounds(70, (20, 200), 10) is None


# ----------------------------------------------------------------------------- a project


@pytest.fixture(scope="module")
def studio(tts, tmp_path_factory: pytest.TempPathFactory):
    from cosyvoice.context import StudioContext
    from cosyvoice.service import TTSService
    from cosyvoice.settings import Limits
    from cosyvoice.voices import VoiceLibrary

    folder = tmp_path_factory.mktemp("books")
    service = TTSService(tts.model, VoiceLibrary(folder / "voices", tts.frontend, model_dir=tts.model_dir),
                         Limits(max_sessions=2, queue_timeout_seconds=60))
    t = np.arange(24000) / 16000
    vowel = sum(np.sin(2 * np.pi * k * 200 * t) / k for k in range(1, 8)) * (1 - np.cos(2 * np.pi * 2 * t))
    sf.write(folder / "narrator.wav", (0.1 * vowel).astype(np.float32), 16000)
    service.create_voice("Narrator", folder / "narrator.wav", "Hello, I read books.")
    context = StudioContext(service=service, data_dir=folder / "data")
    yield context.studio()
    context.close()


def test_a_generated_book_is_checked_per_chapter_and_mastered_to_acx(studio) -> None:
    project = studio.editor.create("Book", "# One\n\nHi there.\n\n# Two\n\nBye now.", voice="Narrator",
                                   preset="none")
    studio.renders.generate(project.id)
    studio.renders.wait(project.id, timeout=300)
    before = studio.mixer.acx(project.id)
    assert [c["title"] for c in before["chapters"]] == ["One", "Two"]
    assert before["book"]["seconds"] == pytest.approx(studio.mixer.timeline(project.id).seconds, abs=1e-3)
    assert not before["passed"]  # the tiny model's raw takes are near full scale
    studio.editor.update_settings(project.id, preset="acx")
    after = studio.mixer.acx(project.id)
    assert after["passed"], after
    timeline = studio.mixer.export_to(io.BytesIO(), project.id, "wav")
    assert timeline.acx == after
    assert studio.mixer.segments_json(project.id, timeline)["acx"] == after


def test_a_short_pdf_tells_its_headings_from_its_body() -> None:
    _, chapters = documents.read_document("short.pdf", pdf_book(outline=False, body="Hi.", paragraphs=1))
    assert chapters == [("The Beginning", "A section\n\nParagraph 0 of chapter 0. Hi."),
                        ("The Middle", "A section\n\nParagraph 0 of chapter 1. Hi.")]


def test_a_suspect_take_is_made_again_and_every_take_is_kept(studio) -> None:
    # the tiny random model speaks to its length limit: every take is suspect, the guard's worst case
    project = studio.editor.create("Guarded", "Hello there.", voice="Narrator", preset="none", retries=2)
    studio.renders.generate(project.id)
    studio.renders.wait(project.id, timeout=300)
    [segment] = studio.segments(project.id)
    takes = studio.store.takes(project.id)[segment.id]
    assert len(takes) == 3 and all(t.flags for t in takes)  # made again twice, all three kept
    assert any("the model's length limit" in f or "loops" in f for t in takes for f in t.flags)
    assert segment.chosen_take == min(takes, key=lambda t: len(t.flags)).id
    assert len({t.seed for t in takes}) == 3
    studio.editor.update_settings(project.id, retries=0)
    studio.renders.regenerate(project.id, segment.id)
    studio.renders.wait(project.id, timeout=300)
    assert len(studio.store.takes(project.id)[segment.id]) == 4  # no retries: one take, flagged
    with pytest.raises(InvalidInputError, match="retries must be"):
        studio.editor.update_settings(project.id, retries=9)
