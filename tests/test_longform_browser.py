"""The long-form project page in a real browser (Debian's chromium driven by Playwright), served by the web UI
on loopback with the tiny bundle: paste text, review and edit the table, generate, regenerate one segment,
export and download. Screenshots go to ``test-artifacts/`` (kept by CI, ignored by git)."""

from __future__ import annotations

import re
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from mutagen.mp3 import MP3, BitrateMode

pytest.importorskip("gradio", reason="the web UI needs the 'ui' extra")
from browser import FLAGS, require_browser

sync_api, CHROMIUM = require_browser()

from test_webui import make_studio, serving  # noqa: E402

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
TEXT = "Hi there.\n\nGood day to you.\n\nBye now."


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The served web UI's folder (its data folder: ``data``)."""
    return tmp_path_factory.mktemp("longform-browser")


@pytest.fixture(scope="module")
def app(tts, root: Path, short_prompt_wav: Path) -> Iterator[str]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COSYVOICE_DATA_DIR", str(root / "data"))  # read by the router on its first request
        studio = make_studio(tts, root, builtin_prompt=short_prompt_wav)
        with serving(studio) as url:
            yield url


@pytest.fixture(scope="module")
def page(app: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    with sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=str(CHROMIUM), headless=True,
            args=FLAGS, viewport={"width": 1400, "height": 1000}, accept_downloads=True, locale="en-US")
        page = context.new_page()
        page.goto(app + "studio/longform")
        page.wait_for_function("() => window.longformReady === true")
        yield page
        context.close()


def shot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"longform-{name}.png"), full_page=True)


def statuses(page) -> list[str]:
    return page.locator("#segments tr.segment .status").all_inner_texts()


def test_paste_review_generate_regenerate_export_download(page, tmp_path: Path) -> None:
    """The page's whole round: paste and review, generate while playing along, regenerate one segment, export
    and download, then a bad value refused by a toast."""
    _paste_create_and_edit(page)
    first_take, second_take = _generate_and_play_along(page)
    new_take = _regenerate_the_second_segment(page, first_take, second_take)
    _export_and_download(page, tmp_path, [first_take, new_take])
    _a_bad_speed_is_refused(page)


def _paste_create_and_edit(page) -> None:
    """Paste a text, pick the built-in narrator, create: the table shows the segments as they will be read; one
    segment edited is normalised by the server (numbers spelled out as they will be read)."""
    page.fill("#new-name", "Browser project")
    page.select_option("#new-voice", label="Narrator (built-in)")
    page.fill("#new-text", TEXT)
    page.click("#create")
    rows = page.locator("#segments tr.segment")
    rows.first.wait_for()
    assert rows.count() == 3
    assert [rows.nth(i).locator("textarea.text").input_value() for i in range(3)] == \
        ["Hi there.", "Good day to you.", "Bye now."]
    assert statuses(page) == ["pending"] * 3
    text = rows.nth(2).locator("textarea.text")
    text.fill("Bye, 2 times.")
    text.blur()
    page.wait_for_function("() => document.querySelectorAll('#segments tr.segment textarea.text')[2].value"
                           " === 'Bye, two times.'")
    shot(page, "1-table")


def _generate_and_play_along(page) -> tuple[str, str]:
    """Generate, and play along: "Play all" waits for each segment and plays it once it is made; stopped, it
    plays nothing. The first two segments' takes."""
    page.click("#generate")
    page.click("#play")
    page.wait_for_function("() => document.querySelector('#play-state').textContent === 'playing 1 of 3'",
                           timeout=120_000)
    assert page.locator("#segments tr.segment.playing").count() == 1
    page.wait_for_function("() => [...document.querySelectorAll('#segments .status')]"
                           ".every(s => s.textContent === 'done')", timeout=180_000)
    page.wait_for_function("() => document.querySelector('#progress-text').textContent"
                           ".startsWith('3 of 3 segments done')")
    assert page.locator("#segments audio").count() == 3
    page.wait_for_function("() => document.querySelector('#play-state').textContent === 'playing 2 of 3'",
                           timeout=60_000)  # the first take played to its end, then its pause
    page.click("#play")  # stop
    assert page.inner_text("#play-state") == "" and page.locator("#segments tr.segment.playing").count() == 0
    rows = page.locator("#segments tr.segment")
    first_take = rows.nth(0).locator("select.takes").input_value()
    second_take = rows.nth(1).locator("select.takes").input_value()
    shot(page, "2-generated")
    return first_take, second_take


def _regenerate_the_second_segment(page, first_take: str, second_take: str) -> str:
    """Regenerate the second segment: a second take, chosen; the others keep theirs. The new take."""
    rows = page.locator("#segments tr.segment")
    rows.nth(1).locator("button.regen").click()
    page.wait_for_function("() => { const s = document.querySelectorAll('#segments select.takes')[1];"
                           " return s.options.length === 3 && !s.disabled; }", timeout=120_000)
    page.wait_for_function("() => [...document.querySelectorAll('#segments .status')]"
                           ".every(s => s.textContent === 'done')", timeout=60_000)
    assert rows.nth(0).locator("select.takes").input_value() == first_take
    new_take = rows.nth(1).locator("select.takes").input_value()
    assert new_take and new_take != second_take
    shot(page, "3-regenerated")
    return new_take


def _export_and_download(page, tmp_path: Path, takes: list[str]) -> None:
    """Export WAV: a real file download with the mix of ``takes`` (the first segments' chosen ones), as long as
    the segment table says; then the subtitles, with the edited text."""
    page.select_option("#export-format", "wav")
    with page.expect_download() as download:
        page.click("#export")
    page.wait_for_selector("#toast.info")
    assert page.inner_text("#toast") == "exported Browser-project.wav"
    saved = tmp_path / download.value.suggested_filename
    download.value.save_as(saved)
    assert saved.name == "Browser-project.wav"
    audio, rate = sf.read(saved)
    project = page.evaluate("() => current.id")
    table = page.request.get(f"{page.url.split('/studio')[0]}/v1/longform/projects/{project}/segments.json").json()
    assert abs(len(audio) / rate - table["duration"]) < 0.01
    assert [s["take"] for s in table["segments"]][:len(takes)] == takes
    with page.expect_download() as subtitles:
        page.click("#download-srt")
    srt = Path(subtitles.value.path()).read_text()
    assert "Good day to you." in srt and "Bye, two times." in srt
    shot(page, "4-exported")


def _a_bad_speed_is_refused(page) -> None:
    """Bad input: a toast names the problem, nothing changes."""
    speed = page.locator("#segments tr.segment").nth(0).locator("input.speed")
    speed.fill("9")
    speed.blur()
    page.wait_for_selector("#toast:not(.info)")
    assert page.inner_text("#toast").startswith("speed must be between 0.5 and 2")
    page.wait_for_function("() => document.querySelector('#segments input.speed').value === '1'")
    shot(page, "5-error")


def test_a_pdf_book_becomes_chapters_and_is_mastered_to_acx(page, tmp_path: Path) -> None:
    from test_longform_books import pdf_book
    from test_longform_delivery import png

    book = tmp_path / "book.pdf"
    book.write_bytes(pdf_book(outline=True, body="Hi.", paragraphs=1))
    page.fill("#new-name", "PDF book")
    page.fill("#new-text", "")
    page.select_option("#new-voice", label="Narrator (built-in)")
    page.select_option("#new-preset", "none")
    page.set_input_files("#new-file", str(book))
    page.click("#create")
    page.wait_for_function("() => current && current.name === 'PDF book'")
    chapters = page.locator("#segments tr.chapter td:first-child").all_inner_texts()
    assert chapters == ["Chapter: The Beginning", "Chapter: The Middle"]
    page.click("#generate")
    page.wait_for_function("() => current.progress.total > 0 && current.progress.done === current.progress.total",
                           timeout=600_000)
    page.fill("#book-author", "Ann Author")
    page.fill("#book-narrator", "Ned Narrator")
    page.click("#save-book")
    page.wait_for_function("() => current.settings.narrator === 'Ned Narrator'")
    cover = tmp_path / "cover.png"
    cover.write_bytes(png())
    page.set_input_files("#book-cover", str(cover))
    page.wait_for_function("() => document.querySelector('#cover-state').textContent === 'cover set'")
    page.click("#acx-check")  # the tiny model's raw takes are near full scale
    page.wait_for_function("() => document.querySelector('#acx-state').textContent === 'does not meet ACX'",
                           timeout=120_000)
    files = page.locator("#acx-table tbody tr td:first-child").all_inner_texts()
    assert files == ["01-The-Beginning.mp3", "02-The-Middle.mp3"]
    assert page.locator("#acx-master").is_visible()
    shot(page, "6-acx-fails")
    page.click("#acx-master")
    page.wait_for_function("() => document.querySelector('#acx-state').textContent === 'meets ACX'",
                           timeout=120_000)
    assert page.locator("#acx-table td.fail").count() == 0 and page.locator("#acx-table td.pass").count() == 2
    assert page.locator("#acx-table tbody td:nth-child(3)").all_inner_texts() == [
        "MP3 192 kbps CBR, 44100 Hz, mono"] * 2
    assert page.input_value("#preset") == "acx" and not page.locator("#acx-master").is_visible()
    shot(page, "7-acx-mastered")
    with page.expect_download() as download:
        page.click("#acx-download")
    archive = tmp_path / download.value.suggested_filename
    download.value.save_as(archive)
    assert archive.name == "PDF-book-ACX.zip"
    with zipfile.ZipFile(archive) as z:  # the files as delivered, read by mutagen (FFmpeg's LAME wrote them)
        assert z.namelist() == files
        z.extractall(tmp_path)
    for i, (name, title) in enumerate(zip(files, ["The Beginning", "The Middle"], strict=True), 1):
        mp3 = MP3(tmp_path / name)
        assert mp3.info.bitrate_mode == BitrateMode.CBR and round(mp3.info.bitrate / 1000) == 192
        assert (mp3.info.sample_rate, mp3.info.channels) == (44100, 1)
        assert [str(mp3.tags[k]) for k in ("TIT2", "TALB", "TPE1", "TCOM", "TRCK")] == [
            title, "PDF book", "Ann Author", "Ned Narrator", f"{i}/2"]
        assert mp3.tags.getall("APIC")[0].data == png()


def new_project(page, app: str, name: str, *, text: str = "", book: Path | None = None) -> None:
    """A project made from the page's form (the built-in narrator), open once the page shows it."""
    page.goto(app + "studio/longform")
    page.wait_for_function("() => window.longformReady === true")
    page.fill("#new-name", name)
    page.select_option("#new-voice", label="Narrator (built-in)")
    if book is not None:
        page.set_input_files("#new-file", str(book))
    else:
        page.fill("#new-text", text)
    page.click("#create")
    page.wait_for_function("(name) => current && current.name === name", arg=name)


def test_a_project_has_its_own_address_and_the_form_is_cleared(page, app: str) -> None:
    new_project(page, app, "Addressed", text="One line.")
    assert page.input_value("#new-name") == "" and page.input_value("#new-text") == ""  # a second click makes none
    project = page.evaluate("() => current.id")
    assert page.url.endswith(f"?project={project}")
    other = page.context.new_page()  # the address alone opens it
    other.goto(page.url)
    other.wait_for_function("() => window.longformReady === true")
    assert other.evaluate("() => current && current.id") == project
    other.goto(app + "studio/longform?project=nope")
    other.wait_for_function("() => window.longformReady === true")
    sync_api.expect(other.locator("#toast")).to_be_visible()
    other.close()


def test_a_docx_book_becomes_chapters(page, app: str, tmp_path: Path) -> None:
    import docx

    document = docx.Document()
    for title in ("Morning", "Evening"):
        document.add_heading(title, 1)
        document.add_paragraph(f"It was {title.lower()}.")
    book = tmp_path / "book.docx"
    document.save(book)
    new_project(page, app, "DOCX book", book=book)
    chapters = page.locator("#segments tr.chapter td:first-child").all_inner_texts()
    assert chapters == ["Chapter: Morning", "Chapter: Evening"]
    texts = page.locator("#segments textarea.text").evaluate_all("ts => ts.map(t => t.value)")
    assert texts == ["Morning.", "It was morning.", "Evening.", "It was evening."]


def test_a_suspect_take_is_flagged_made_again_and_the_choice_shown(page, app: str) -> None:
    new_project(page, app, "Guarded", text="Hello there.")
    page.fill("#retries", "2")
    page.click("#save-settings")
    page.wait_for_function("() => current.settings.retries === 2")
    page.click("#generate")
    # the tiny model speaks to its length limit: each take is suspect, so two more are made and all are kept
    page.wait_for_function("() => current.segments[0].takes.length === 3 && !current.progress.running",
                           timeout=300_000)
    flags = page.locator("#segments tr.segment .flags").first.inner_text()
    takes = page.evaluate("() => current.segments[0].takes.map(t => ({chosen: t.chosen, flags: t.flags}))")
    chosen = next(i for i, t in enumerate(takes) if t["chosen"])
    # which reasons each take has depends on the sampled tokens (the CPU's arithmetic): all three have some, the
    # one with the fewest is used, and the row says which and why
    assert all(t["flags"] for t in takes) and len(takes[chosen]["flags"]) == min(len(t["flags"]) for t in takes)
    assert flags == "\n".join([f"using take {chosen + 1} of 3; 3 sounded wrong", *takes[chosen]["flags"]]), flags
    options = page.locator("#segments select.takes option").all_inner_texts()
    assert len(options) == 4 and all(o.endswith(" · suspect") for o in options[1:])
    page.screenshot(path=str(ARTIFACTS / "longform-8-suspect.png"), full_page=True)


def test_a_dialogue_on_a_chinese_phone(page, app: str) -> None:
    """At 390 px each segment is a card that fits the window; the speaker's name stands above their line; a
    speaker without a mapped voice is named; a segment without a take offers Generate, and the reasons to listen
    to its take again are said in Chinese."""
    from test_pages_fit_browser import OVERFLOWS

    phone = page.context.new_page()
    phone.set_viewport_size({"width": 390, "height": 844})
    phone.goto(app + "studio/longform?lang=zh")
    phone.wait_for_function("() => window.longformReady === true")
    phone.fill("#new-name", "Phone talk")
    phone.select_option("#new-kind", "dialogue")
    phone.select_option("#new-voice", label="Narrator（内置）")
    phone.fill("#new-text", "Alice: Hello there.\nBob: Good day to you.")
    phone.click("#create")
    phone.wait_for_function("() => current && current.name === 'Phone talk'")
    sync_api.expect(phone.locator("#unmapped")).to_have_text(
        "“说话人”中没有为以下说话人指定声音：Alice, Bob；他们将使用Narrator（可在每段的“声音”中另选）")
    first = phone.locator("#segments tr.segment").first
    assert first.locator("td:nth-child(3) > *").evaluate_all("cs => cs.map(c => c.className)")[:2] == \
        ["speaker", "text"]
    assert first.locator(".speaker").inner_text() == "Alice:"
    sync_api.expect(first.locator("button.regen")).to_have_text("生成")
    assert phone.evaluate(OVERFLOWS) == []
    ARTIFACTS.mkdir(exist_ok=True)
    phone.screenshot(path=str(ARTIFACTS / "longform-390-zh.png"), full_page=True)
    first.locator("button.regen").click()
    phone.wait_for_function("() => current.segments[0].takes.length && !current.progress.running",
                            timeout=300_000)
    first = phone.locator("#segments tr.segment").first
    sync_api.expect(first.locator("button.regen")).to_have_text("重新生成")
    reasons = first.locator(".flags > div").all_inner_texts()
    # the tiny model's take runs to its length limit (or is otherwise suspect): each reason is in Chinese
    assert reasons and not any(re.search(r"[A-Za-z]{3,}", r) for r in reasons), reasons
    assert phone.evaluate(OVERFLOWS) == []
    phone.close()


def test_an_export_is_a_job_whose_failure_stays_beside_its_button(page, app: str, root: Path) -> None:
    """A take damaged after it was made fails the export job (the check before it passes): the page says why
    beside the Export button, and says it again once reopened, from the job the server kept."""
    new_project(page, app, "Damaged", text="Hi there.")
    page.click("#generate")
    page.wait_for_function("() => current.progress.total > 0 && current.progress.done === current.progress.total",
                           timeout=120_000)
    take = page.evaluate("() => current.segments[0].take")
    [path] = (root / "data").rglob(f"{take}.wav")
    audio, rate = sf.read(path, dtype="float32")
    sf.write(path, np.full_like(audio, np.nan), rate, subtype="FLOAT")
    page.select_option("#export-format", "mp3")
    page.click("#export")
    page.wait_for_selector("#export-state.fail")
    said = page.inner_text("#export-state")
    assert f"take {take} is damaged" in said and page.inner_text("#toast") == said
    assert page.is_enabled("#export")
    shot(page, "8-export-failed")
    page.reload()
    page.wait_for_function("() => window.longformReady === true")
    page.wait_for_selector("#export-state.fail")
    assert page.inner_text("#export-state") == said
