"""The web UI in a real browser: Debian's chromium driven by Playwright, the app on loopback, the tiny bundle.

Every test reads what a person would see (toasts, buttons, the live player's state) and the server's own
times. Screenshots and the measured timings go to ``test-artifacts/`` (kept by CI, ignored by git).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

gr = pytest.importorskip("gradio", reason="the web UI needs the 'ui' extra")
from browser import FLAGS, require_browser  # noqa: E402

sync_api, CHROMIUM = require_browser()

from test_webui import TEXT, TRANSCRIPT, make_studio, serving  # noqa: E402
from waiting import until  # noqa: E402

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
STREAM_TEXT = "Hello there, this take is streamed to you."
LONG_TEXT = "This is a long take that somebody wants to stop halfway through. " * 8
TABS = {"zero_shot": "Zero-shot clone", "cross_lingual": "Cross-lingual", "instruct2": "Instruct"}
TIMINGS: dict[str, dict] = {}
# Draws two CJK characters and an unassigned code point in the page's font: real glyphs differ from each
# other and from the missing-glyph box (what a machine without a CJK font shows for every character).
CJK_GLYPHS_DRAWN = """() => {
  const canvas = document.createElement("canvas");
  canvas.width = canvas.height = 48;
  const g = canvas.getContext("2d");
  g.font = "32px " + getComputedStyle(document.querySelector("#text textarea")).fontFamily;
  const draw = (ch) => { g.clearRect(0, 0, 48, 48); g.fillText(ch, 4, 36);
                         return g.getImageData(0, 0, 48, 48).data.join(","); };
  const a = draw("要"), b = draw("朗"), missing = draw("\\u{10FFFD}");
  return a !== b && a !== missing && b !== missing && /[1-9]/.test(a);
}"""
# Before any page script: every text the queue line (#queue-place) shows, in order, and any raw Gradio queue
# progress ("queue: 2/2 | 0.6s") that a person could see (checked at most every 50 ms: it used to stay for seconds).
QUEUE_WATCH = """(() => {
  window.cvSeen = { place: [""], raw: [] };
  const QUEUE = /queue:\\s*\\d+/;
  // what a person can see: Gradio's hidden progress keeps its text, at opacity 0
  const VISIBLE = { checkOpacity: true, checkVisibilityCSS: true, opacityProperty: true, visibilityProperty: true };
  let pending = false;
  const rawCheck = () => {  // Gradio's own progress text wherever it can be seen, with the element that shows it
    pending = false;
    if (!document.body || !QUEUE.test(document.body.innerText)) return;
    for (const el of document.body.querySelectorAll("*")) {
      if (QUEUE.test(el.innerText) && ![...el.children].some((child) => QUEUE.test(child.innerText))
          && el.checkVisibility(VISIBLE)) {
        const owner = el.closest("[id]");
        window.cvSeen.raw.push(`${el.innerText.trim()} (in ${owner ? "#" + owner.id : "?"})`);
      }
    }
  };
  new MutationObserver(() => {
    const line = document.getElementById("queue-place");
    const text = line && !line.hidden ? line.textContent : "";
    if (window.cvSeen.place.at(-1) !== text) window.cvSeen.place.push(text);
    if (!pending) { pending = true; setTimeout(rawCheck, 50); }
  }).observe(document, { subtree: true, childList: true, characterData: true, attributes: true });
})()"""


# The network as a busy machine may deliver it: the queue stream's close_stream reaches the page only at
# window.cvNet.release(), while the answers to joins come through (cvNet.answered counts them). Installed before the
# page's own scripts, so their fetch wrapper takes this one for the network.
HELD_CLOSE = """(() => {
  const net = window.cvNet = { held: [], answered: 0, hold: true };
  net.release = () => { net.hold = false; net.held.splice(0).forEach((go) => go()); };
  const original = window.fetch.bind(window);
  window.fetch = async (input, init) => {
    const response = await original(input, init);
    const url = String(input.url || input);
    if (url.includes("/queue/join")) net.answered += 1;
    if (!url.includes("/queue/data") || !response.body) return response;
    const reader = response.body.getReader();
    const body = new ReadableStream({ async pull(out) {
      const { value, done } = await reader.read();
      if (done) return out.close();
      if (net.hold && new TextDecoder().decode(value).includes("close_stream")) {
        await new Promise((go) => net.held.push(go));
      }
      out.enqueue(value);
    } });
    return new Response(body, { status: response.status, statusText: response.statusText,
                                headers: response.headers });
  };
})()"""


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    with sync_api.sync_playwright() as playwright:
        # a fresh profile per run: nothing cached, no first-run or sync traffic
        yield lambda **kw: playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=str(CHROMIUM), headless=True,
            args=FLAGS, viewport={"width": 1280, "height": 1000}, **kw)


@pytest.fixture(scope="module")
def context(browser) -> Iterator:
    ctx = browser(locale="en-US")
    yield ctx
    ctx.close()


@pytest.fixture(scope="module")
def app(tts, tmp_path_factory: pytest.TempPathFactory, short_prompt_wav: Path) -> Iterator[tuple]:
    studio = make_studio(tts, tmp_path_factory.mktemp("browser"), builtin_prompt=short_prompt_wav)
    with serving(studio) as url:
        yield studio, url
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "webui-timings.json").write_text(json.dumps(TIMINGS, indent=2))


def open_page(context, url: str, *, new_visitor: bool = True):
    """A page of the app; ``new_visitor``: as a browser never seen before (no history cookie), else as the
    browser of the pages open before it (its tabs share one take history)."""
    if new_visitor:
        context.clear_cookies()
    page = context.new_page()
    page.goto(url)
    page.wait_for_selector("#generate button, button#generate")
    page.wait_for_function("() => window.cvStudio !== undefined")
    return page


def upload_prompt(page, path: Path) -> None:
    page.set_input_files("#prompt input[type=file]", str(path))
    sync_api.expect(page.locator("#prompt [data-testid='waveform-controls']")).to_be_attached(timeout=15000)


@contextlib.contextmanager
def page_with_held_close(browser, url: str) -> Iterator:
    """A page of the app whose event stream's close_stream reaches it only at ``window.cvNet.release()``
    (:data:`HELD_CLOSE`), in a context of its own."""
    ctx = browser(locale="en-US")
    ctx.add_init_script(HELD_CLOSE)
    try:
        yield open_page(ctx, url)
    finally:
        ctx.close()


def status_says(page, text: str, timeout: float | None = None) -> None:
    """The status line comes to say ``text`` (Playwright's default wait unless ``timeout``); else the failure carries
    what the page showed instead: a take refused or failed says why in a toast and leaves the status line empty."""
    try:
        sync_api.expect(page.locator("#status")).to_contain_text(text, timeout=timeout)
    except AssertionError as exc:
        shown = {"status": page.locator("#status").inner_text(timeout=1000),
                 "voice": page.locator("#voice input").input_value(timeout=1000),
                 "toasts": page.get_by_test_id("toast-text").all_inner_texts()}
        raise AssertionError(f"{exc}\nthe page showed {shown}") from None


def toast(page, text: str) -> None:
    """A warning toast saying ``text`` appears; then it is closed, as a person would."""
    sync_api.expect(page.get_by_test_id("toast-text").filter(has_text=text).first).to_be_visible(timeout=15000)
    for _ in range(10):  # info toasts also go by themselves: close whatever is still there
        closes = page.get_by_test_id("toast-close")
        if not closes.count():
            break
        with contextlib.suppress(sync_api.Error):
            closes.first.click(timeout=2000)


def assert_usable(page) -> None:
    """Nothing blocks the controls: no error badge, the voice dropdown takes a click, Generate is enabled."""
    assert page.locator(".error, [data-testid='status-tracker'] .error").count() == 0
    page.click("#voice input", timeout=3000)  # fails if anything covers the dropdown
    page.keyboard.press("Escape")
    sync_api.expect(page.locator("#generate")).to_be_enabled()


def take_summary(page) -> dict:
    return page.evaluate("() => window.cvStudio.summary(Object.keys(window.cvStudio.takes).at(-1))")


def record(studio, name: str, summary: dict) -> dict:
    times = studio.times[summary["id"]]
    ms = {key: summary[key] for key in ("clickAt", "firstByteAt", "firstSoundAt", "endAt")}
    server = {"start": times.start * 1000, "first_chunk": times.first_chunk * 1000, "finished": times.finished * 1000}
    TIMINGS[name] = {
        "click_to_sound_ms": round(ms["firstSoundAt"] - ms["clickAt"], 1),
        "server_first_chunk_to_sound_ms": round(ms["firstSoundAt"] - server["first_chunk"], 1),
        "click_to_server_first_chunk_ms": round(server["first_chunk"] - ms["clickAt"], 1),
        "click_to_server_start_ms": round(server["start"] - ms["clickAt"], 1),
        "sound_before_generation_finished_ms": round(server["finished"] - ms["firstSoundAt"], 1),
        "stalls": summary["stalls"], "gaps_ms": summary["gapsMs"], "chunks": len(times.chunks),
        "audio_seconds": summary["samples"] / summary["rate"],
    }
    return {**ms, **{f"server_{k}": v for k, v in server.items()}}


@pytest.mark.parametrize("mode", list(TABS))
def test_each_tab_plays_while_generating(context, app: tuple, mode: str, short_prompt_wav: Path) -> None:
    studio, url = app
    page = open_page(context, url)
    page.get_by_role("tab", name=TABS[mode]).click()
    upload_prompt(page, short_prompt_wav)
    page.fill("#text textarea", STREAM_TEXT)
    if mode == "zero_shot":
        page.fill("#transcript textarea", TRANSCRIPT)
    if mode == "instruct2":
        page.fill("#instruction textarea", "Speak slowly and calmly.")
    page.fill("#seed input", "2")
    sync_api.expect(page.locator("#stream input")).to_be_checked()
    page.click("#generate")
    status_says(page, "Take 1:", timeout=60000)  # the server finished
    page.wait_for_function("() => { const t = Object.values(window.cvStudio.takes).at(-1);"
                           " return t && t.streamDone && t.firstSoundAt !== null }")
    summary = take_summary(page)
    assert summary["state"] == "playing" and summary["stalls"] == 0 and summary["samples"] > 0, summary
    t = record(studio, mode, summary)
    # the audio started playing before the server finished generating
    assert t["clickAt"] < t["server_first_chunk"] <= t["firstSoundAt"] < t["server_finished"], t
    status_says(page, "Take 1:")
    # what was heard and when is the player's to say, in the browser's own time
    first = (summary["firstSoundAt"] - summary["clickAt"]) / 1000
    sync_api.expect(page.locator("#live-player")).to_contain_text(f"first sound {first:.2f} s after the click")
    sync_api.expect(page.locator(".take-meta").first).to_contain_text(f"mode {TABS[mode]}")
    sync_api.expect(page.locator(".take-meta").first).to_contain_text("seed 2")
    page.fill("#seed input", "-1")
    page.locator(".reuse-seed").first.click()  # a good take is reproducible: its seed goes back in the form
    sync_api.expect(page.locator("#seed input")).to_have_value("2")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"webui-{mode}.png"), full_page=True)
    page.evaluate("() => window.cvStudio.stop()")  # the rest of the take would play for many seconds
    page.close()


def test_stop_ends_a_long_take_and_frees_the_session(context, app: tuple, short_prompt_wav: Path) -> None:
    studio, url = app
    page = open_page(context, url)
    page.get_by_role("tab", name=TABS["cross_lingual"]).click()
    upload_prompt(page, short_prompt_wav)
    page.fill("#text textarea", LONG_TEXT)
    page.fill("#seed input", "4")  # a take that runs to the length limit (a random seed may end it within seconds)
    page.click("#generate")
    sync_api.expect(page.locator("#generate")).to_be_disabled()  # no silent double clicks
    page.wait_for_function("() => document.getElementById('live-player').dataset.state === 'playing'",
                           timeout=60000)
    take_id = take_summary(page)["id"]
    page.click("#voice input", timeout=3000)  # no processing overlay covers the voice controls meanwhile
    page.keyboard.press("Escape")
    page.click("#stop")
    stopped_at = time.time()
    sync_api.expect(page.locator("#live-player")).to_have_attribute("data-state", "stopped")
    sync_api.expect(page.locator("#generate")).to_be_enabled(timeout=5000)
    sync_api.expect(page.locator("#stop")).to_be_disabled()
    status_says(page, "stopped")  # what was made is kept, marked stopped
    deadline = time.time() + 10
    def busy() -> bool:
        return bool(studio.service.model.engine.active_sessions or studio.service.status().active_sessions
                    or studio.times[take_id].finished is None)

    while busy() and time.time() < deadline:
        time.sleep(0.05)
    assert not busy()  # the engine session and the service's slot are free
    TIMINGS["stop"] = {"stop_click_to_server_finished_ms": round((studio.times[take_id].finished - stopped_at) * 1000)}
    page.fill("#text textarea", TEXT)  # the session is free: the next take runs to the end
    page.click("#generate")
    status_says(page, "Take 2:", timeout=60000)
    assert_usable(page)
    page.close()


def test_without_websockets_the_player_says_why_nothing_plays(context, tts, tmp_path: Path, short_prompt_wav: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The server as it runs where the websockets package is missing: uvicorn finds no WebSocket library and
    answers the live audio's WebSocket with 404. The take is still made; the player line says, in red, why
    nothing plays, and nothing claims a first sound."""
    monkeypatch.setattr("uvicorn.protocols.websockets.auto.AutoWebSocketsProtocol", None)
    studio = make_studio(tts, tmp_path, builtin_prompt=short_prompt_wav)
    with serving(studio) as url:
        page = open_page(context, url)
        upload_prompt(page, short_prompt_wav)
        page.fill("#text textarea", TEXT)
        page.fill("#transcript textarea", TRANSCRIPT)
        page.click("#generate")
        player = page.locator("#live-player")
        sync_api.expect(player).to_have_attribute("data-state", "failed")
        sync_api.expect(player).to_have_attribute("role", "alert")
        sync_api.expect(player).to_contain_text("Live playback is off: this server cannot accept WebSockets (its "
                                                "Python lacks the websockets package")
        sync_api.expect(player).to_be_visible()
        assert page.evaluate("() => getComputedStyle(document.getElementById('live-player')).color") == \
            "rgb(185, 28, 28)"
        status_says(page, "Take 1:", timeout=60000)  # made all the same
        for line in (page.locator("#status"), player):
            sync_api.expect(line).not_to_contain_text("first")
        assert take_summary(page)["samples"] == 0
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "webui-live-unavailable.png"))
        page.close()


def test_each_invalid_input_shows_its_message_and_blocks_nothing(context, app: tuple, short_prompt_wav: Path,
                                                                   tmp_path: Path) -> None:
    _, url = app
    page = open_page(context, url)
    page.click("#generate")
    toast(page, "text is empty; type something to say")
    assert_usable(page)

    page.fill("#text textarea", "x" * 6000)
    sync_api.expect(page.locator("#char-counter")).to_contain_text("6,000 / 5,000 characters: over the limit by 1,000")
    page.click("#generate")
    toast(page, "text has 6000 characters; at most 5000 are allowed")
    assert page.input_value("#text textarea") == "x" * 6000  # never cut silently
    assert_usable(page)

    page.fill("#text textarea", TEXT)
    page.click("#generate")
    toast(page, "upload or record a prompt voice")
    assert_usable(page)

    short = tmp_path / "too-short.wav"
    sf.write(short, np.zeros(4000, np.float32), 16000)
    page.set_input_files("#prompt input[type=file]", str(short))
    toast(page, "This recording cannot be used: the prompt audio is 0.25 s long")  # checked on upload
    sync_api.expect(page.locator("#prompt input[type=file]")).to_have_count(1)  # removed again: ready for another
    assert_usable(page)

    upload_prompt(page, short_prompt_wav)
    page.click("#generate")
    toast(page, "zero-shot cloning needs the transcript")
    assert_usable(page)

    page.get_by_role("tab", name=TABS["instruct2"]).click()
    page.click("#generate")
    toast(page, "instruct mode needs an instruction")
    assert_usable(page)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "webui-after-errors.png"), full_page=True)
    page.close()


def test_a_voice_picked_while_the_page_loads_stays_picked(context, tts, tmp_path: Path, short_prompt_wav: Path) -> None:
    """The page load's own voice list (this visitor's uploads too) answers late on a busy server; a voice picked
    from the first list meanwhile is kept, not reset to none (the take then had no voice: "upload or record a
    prompt voice", and an empty status)."""
    studio = make_studio(tts, tmp_path, builtin_prompt=short_prompt_wav)
    release, answered = threading.Event(), threading.Event()
    visitor_voices = studio.visitor_voices

    def late(request: gr.Request | None = None) -> dict:
        release.wait(30)
        try:
            return visitor_voices(request)
        finally:
            answered.set()

    studio.visitor_voices = late
    with serving(studio) as url:
        page = open_page(context, url)
        page.click("#voice input")
        page.get_by_role("option", name="Narrator").click()
        sync_api.expect(page.locator("#preview audio, #preview [data-testid='waveform-Voice preview']").first
                        ).to_be_attached(timeout=15000)
        with page.expect_response(lambda r: r.request.method == "POST" and answered.is_set()):
            release.set()
            assert answered.wait(30)
        page.evaluate("() => new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(done)))")
        sync_api.expect(page.locator("#voice input")).to_have_value("Narrator (built-in)")
        page.close()


def test_a_saved_voice_survives_a_restart(tts, browser, tmp_path: Path, short_prompt_wav: Path) -> None:
    ctx = browser(locale="en-US")
    try:
        with serving(make_studio(tts, tmp_path)) as url:
            page = open_page(ctx, url)
            upload_prompt(page, short_prompt_wav)
            page.fill("#transcript textarea", TRANSCRIPT)
            page.fill("#save-as textarea, #save-as input", "Survivor")
            page.click("#save")
            sync_api.expect(page.locator("#voice input")).to_have_value("Survivor", timeout=30000)
            page.close()
        with serving(make_studio(tts, tmp_path)) as url:  # a new server process's library, from the same folder
            page = open_page(ctx, url, new_visitor=False)  # the visitor who saved it (voices keep their creator)
            page.click("#voice input")
            page.get_by_role("option", name="Survivor").click()
            sync_api.expect(page.locator("#preview audio, #preview [data-testid='waveform-Voice preview']").first
                            ).to_be_attached(timeout=15000)
            page.fill("#text textarea", TEXT)
            page.click("#generate")
            status_says(page, "voice: Survivor", timeout=60000)
            exported = _rename_export_delete_and_import(page, tmp_path / "exported.voice.safetensors")
            _import_under_a_taken_name(page, exported, short_prompt_wav)
            page.close()
    finally:
        ctx.close()


def _rename_export_delete_and_import(page, exported: Path) -> Path:
    """The rest of the library on the saved voice: rename, export (downloaded to ``exported``), delete (only
    after confirming), import the export again."""
    page.click("#manage")
    page.fill("#new-name textarea, #new-name input", "Survivor Two")
    page.click("#rename")
    sync_api.expect(page.locator("#voice input")).to_have_value("Survivor Two")
    page.click("#export")
    sync_api.expect(page.locator("#exported")).to_contain_text("Survivor_Two.voice")
    with page.expect_download() as download:
        page.locator("#exported a").first.click()
    download.value.save_as(exported)
    page.click("#delete")
    sync_api.expect(page.locator("#confirm-row")).to_contain_text("Delete the voice Survivor Two?")
    page.click("#cancel-delete")  # nothing happens without the confirmation
    sync_api.expect(page.locator("#confirm-row")).to_be_hidden()
    page.click("#delete")
    page.click("#confirm-delete")
    toast(page, "Deleted voice 'Survivor Two'")
    sync_api.expect(page.locator("#voice input")).to_have_value("")
    page.set_input_files("#import input[type=file]", str(exported))
    toast(page, "Imported voice 'Survivor Two'")
    sync_api.expect(page.locator("#voice input")).to_have_value("Survivor Two")
    return exported


def _import_under_a_taken_name(page, exported: Path, prompt_wav: Path) -> None:
    """The export's name taken by another voice meanwhile: the page asks for another name and keeps the file."""
    page.click("#delete")
    page.click("#confirm-delete")
    toast(page, "Deleted voice 'Survivor Two'")
    upload_prompt(page, prompt_wav)
    page.fill("#transcript textarea", "Another voice took this name.")
    page.fill("#save-as textarea, #save-as input", "Survivor Two")
    page.click("#save")
    toast(page, "Saved voice 'Survivor Two'")
    page.set_input_files("#import input[type=file]", str(exported))
    toast(page, "A voice named 'Survivor Two' exists already: type another name")
    page.fill("#import-name textarea, #import-name input", "Survivor Three")
    page.click("#import-again")
    toast(page, "Imported voice 'Survivor Three'")
    sync_api.expect(page.locator("#voice input")).to_have_value("Survivor Three")
    sync_api.expect(page.locator("#import-name")).to_be_hidden()


def test_a_recording_replaces_a_picked_voice(context, app: tuple, short_prompt_wav: Path) -> None:
    """Uploading a prompt clears the picked voice and its preview in the page itself (no round trip that could
    land after a voice saved meanwhile)."""
    _, url = app
    page = open_page(context, url)
    page.click("#voice input")
    page.get_by_role("option", name="Narrator").click()
    sync_api.expect(page.locator("#voice input")).to_have_value("Narrator (built-in)")
    upload_prompt(page, short_prompt_wav)
    sync_api.expect(page.locator("#voice input")).to_have_value("")
    sync_api.expect(page.locator("#preview audio")).to_have_count(0)
    page.close()


def test_chinese_page(browser, app: tuple, short_prompt_wav: Path) -> None:
    _, url = app
    ctx = browser(locale="zh-CN")
    try:
        page = open_page(ctx, url)
        sync_api.expect(page.get_by_text("要朗读的文本")).to_be_visible()
        sync_api.expect(page.locator("#demo-banner")).to_contain_text("演示模式")
        page.click("#generate")
        toast(page, "输入有误：")  # the server's messages too, in the page's language
        page.get_by_role("tab", name="跨语种").click()
        upload_prompt(page, short_prompt_wav)
        page.fill("#text textarea", TEXT)
        page.click("#generate")
        status_says(page, "第 1 条：", timeout=60000)
        status_says(page, "声音：上传的录音")
        sync_api.expect(page.locator(".take-meta").first).to_contain_text("模式 跨语种")
        page.evaluate("() => window.cvStudio.stop()")
        sync_api.expect(page.get_by_role("tab", name="跨语种")).to_be_visible()
        assert page.evaluate(CJK_GLYPHS_DRAWN), "CJK text renders as missing-glyph boxes: install fonts-noto-cjk"
        page.click("#voice input")
        assert page.get_by_role("option").first.inner_text().startswith("Narrator（内置）")  # built-ins first
        page.keyboard.press("Escape")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "webui-zh.png"), full_page=True)
        page.close()
    finally:
        ctx.close()


def one_session_studio(tts, tmp_path: Path):
    """A studio whose service runs one session at a time, so a second take waits in the queue."""
    from dataclasses import replace

    from test_webui import studio_over

    from cosyvoice.service import TTSService

    library = make_studio(tts, tmp_path).service.voices
    return studio_over(TTSService(tts.model, library, limits=replace(tts.limits, max_sessions=1)))


def test_tabs_queue_for_one_session_in_click_order(tts, browser, tmp_path: Path, short_prompt_wav: Path) -> None:
    """COSYVOICE_MAX_SESSIONS=1 and four tabs clicking Generate together: the waiting tabs show their place in
    the queue with Generate locked and Stop enabled; they are served in click order; Stop and closing the tab
    work while waiting, and no tab is left processing."""
    studio = one_session_studio(tts, tmp_path)
    ctx = browser(locale="en-US")
    ctx.add_init_script(QUEUE_WATCH)
    try:
        with serving(studio) as url:
            pages = _four_tabs_ready_to_generate(ctx, url, short_prompt_wav)
            ids = _generate_one_tab_after_another(pages, studio)
            # their places in words, in click order
            for page, place in zip(pages[1:], ("next", "2nd", "3rd"), strict=True):
                sync_api.expect(page.locator("#generate")).to_be_disabled()
                sync_api.expect(page.locator("#stop")).to_be_enabled()
                sync_api.expect(page.locator("#queue-place")).to_have_text(f"waiting: {place} in line")
            ARTIFACTS.mkdir(exist_ok=True)
            pages[2].screenshot(path=str(ARTIFACTS / "webui-queued.png"), full_page=True)
            pages[3].close()  # a waiting tab closed: its take leaves the queue
            pages[2].click("#stop")  # Stop while waiting: the tab is free at once and its take never runs
            sync_api.expect(pages[2].locator("#queue-place")).to_be_hidden()
            sync_api.expect(pages[2].locator("#generate")).to_be_enabled(timeout=5000)
            sync_api.expect(pages[2].locator("#stop")).to_be_disabled()
            # the first take, heard, is stopped: the slot passes to the next in line (its take is kept)
            pages[0].wait_for_function("() => document.getElementById('live-player').dataset.state === 'playing'",
                                       timeout=60000)
            pages[0].click("#stop")
            _assert_served_in_click_order_one_at_a_time(pages, studio, ids)
            _assert_the_second_tab_said_its_wait(pages[1])
            for page in pages[:3]:  # Gradio's own progress never showed
                assert page.evaluate("() => window.cvSeen.raw") == []
            assert studio.service.status().active_sessions == 0 and not studio._running
    finally:
        ctx.close()


def _four_tabs_ready_to_generate(ctx, url: str, prompt_wav: Path) -> list:
    """Four tabs of one browser, each with its prompt, text and seed set. The first take runs while the others
    queue, and is stopped once they have been checked: its whole text, so that a loaded machine's slower page
    cannot outlast it; the second runs after it, short."""
    texts = (LONG_TEXT, "Next in line, a short take.", LONG_TEXT[:160], LONG_TEXT[:180])
    pages = []
    for n, text in enumerate(texts):
        page = open_page(ctx, url, new_visitor=n == 0)
        page.get_by_role("tab", name=TABS["cross_lingual"]).click()
        upload_prompt(page, prompt_wav)
        page.fill("#text textarea", text)
        # a seed whose take runs to the length limit: with a random one, about one take in four of the
        # random model ends within seconds, and the first could finish before the others queue
        page.fill("#seed input", "4")
        pages.append(page)
    return pages


def _generate_one_tab_after_another(pages: list, studio) -> list[str]:
    """Generate clicked in each tab, each click reaching the server before the next: the first take runs, the
    others wait (locked Generate, Stop ready, their place shown). The takes' ids, in click order."""
    ids = []
    for n, page in enumerate(pages):
        page.click("#generate")
        page.wait_for_function("() => Object.keys(window.cvStudio.takes).length > 0")
        ids.append(take_summary(page)["id"])
        if n == 0:  # the first take runs: its handler has started
            until(lambda: ids[0] in studio.times, 15, "the first take's handler started")
        else:
            sync_api.expect(page.locator("#queue-place")).to_contain_text("waiting: ", timeout=15000)
    return ids


def _assert_served_in_click_order_one_at_a_time(pages: list, studio, ids: list[str]) -> None:
    """The first two tabs' takes made in click order, the second's audio only after the first's session closed;
    the stopped and the closed tabs' takes never made audio."""
    for page, number in ((pages[0], 1), (pages[1], 2)):  # one browser's tabs: one history
        status_says(page, f"Take {number}:", timeout=120000)
        sync_api.expect(page.locator("#generate")).to_be_enabled()
    starts = [studio.times[i].start for i in ids[:2]]
    assert starts[0] < starts[1], starts  # first come, first served
    # one session at a time: the second take made no audio until the first one's session had closed (its
    # handler starts as soon as Stop ends the first handler, then waits for the engine's one slot)
    assert studio.times[ids[0]].finished <= studio.times[ids[1]].first_chunk
    deadline = time.time() + 10
    while ids[2] in studio.times and studio.times[ids[2]].finished is None and time.time() < deadline:
        time.sleep(0.05)
    for gone in ids[2:]:  # the stopped one and the closed one never made audio
        assert gone not in studio.times or studio.times[gone].first_chunk is None, gone
    sync_api.expect(pages[2].locator("#queue-place")).to_be_hidden()  # not left waiting


def _assert_the_second_tab_said_its_wait(page) -> None:
    """The second take's line: its place, then "starting…" when it left the queue, then nothing once it ran;
    its first sound is counted from when its turn came, the wait in line said apart."""
    seen = page.evaluate("() => window.cvSeen")
    assert seen["place"][-3:] == ["waiting: next in line", "starting…", ""], seen
    page.wait_for_function("() => window.cvStudio.summary(window.cvStudio.current()).firstSoundAt")
    second = take_summary(page)
    waited = (second["turnAt"] - second["clickAt"]) / 1000
    assert waited > 1.0, second
    sync_api.expect(page.locator("#live-player")).to_contain_text(
        f"s after its turn came ({waited:.1f} s in line before it)")


def test_a_waiting_take_says_its_place_in_chinese(tts, browser, tmp_path: Path, short_prompt_wav: Path) -> None:
    """One session and two tabs of a Chinese browser: the second take's place is said in Chinese while it waits,
    then that it is starting; Gradio's raw "queue: 1/1" never shows."""
    studio = one_session_studio(tts, tmp_path)
    ctx = browser(locale="zh-CN")
    ctx.add_init_script(QUEUE_WATCH)
    try:
        with serving(studio) as url:
            pages = [open_page(ctx, url, new_visitor=n == 0) for n in range(2)]
            for page in pages:
                page.get_by_role("tab", name="跨语种").click()
                upload_prompt(page, short_prompt_wav)
                page.fill("#text textarea", LONG_TEXT)
                page.fill("#seed input", "4")  # a take that runs to the length limit
            pages[0].click("#generate")
            pages[0].wait_for_function("() => document.getElementById('live-player').dataset.state === 'playing'",
                                       timeout=60000)
            pages[1].click("#generate")
            sync_api.expect(pages[1].locator("#queue-place")).to_have_text("排队中：下一个就是你", timeout=15000)
            sync_api.expect(pages[1].locator("#queue-place")).to_be_visible()
            ARTIFACTS.mkdir(exist_ok=True)
            pages[1].screenshot(path=str(ARTIFACTS / "webui-queued-zh.png"), full_page=True)
            pages[0].click("#stop")  # the first take ends: the second leaves the queue
            sync_api.expect(pages[1].locator("#status").get_by_text("生成中")).to_be_visible(timeout=60000)
            sync_api.expect(pages[1].locator("#queue-place")).to_be_hidden()
            pages[1].click("#stop")
            sync_api.expect(pages[1].locator("#generate")).to_be_enabled(timeout=5000)
            seen = [page.evaluate("() => window.cvSeen") for page in pages]
            assert seen[1]["place"][-3:] == ["排队中：下一个就是你", "即将开始…", ""], seen[1]
            assert seen[0]["raw"] == seen[1]["raw"] == [], seen
    finally:
        ctx.close()


def _overlaps(a: dict, b: dict) -> bool:
    return a["x"] < b["x"] + b["width"] and b["x"] < a["x"] + a["width"] and \
        a["y"] < b["y"] + b["height"] and b["y"] < a["y"] + a["height"]


def test_uploads_and_messages_as_a_visitor_sees_them(context, app: tuple, tmp_path: Path,
                                                     short_prompt_wav: Path) -> None:
    """Toasts clear of the voice controls; a WebM recording accepted; a picture named .wav and an over-long text
    explained plainly; Record without a microphone says why."""

    _, url = app
    page = open_page(context, url)
    fake = tmp_path / "holiday.wav"
    fake.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(4096))  # a PNG renamed .wav
    page.set_input_files("#prompt input[type=file]", str(fake))
    sync_api.expect(page.get_by_test_id("toast-text").first).to_contain_text("holiday.wav' is not an audio file we "
                                                                             "can read", timeout=15000)
    page.click("#save")  # a second toast, from the voice controls
    sync_api.expect(page.get_by_test_id("toast-text")).to_have_count(2, timeout=15000)
    page.wait_for_timeout(500)  # the toasts' entry animation
    covered = [page.locator(sel).bounding_box() for sel in ("#save-as", "#save", "#manage", "#generate", "#stop")]
    for box in page.locator(".toast-wrap [data-testid='toast-body']").all():
        assert not any(_overlaps(box.bounding_box(), c) for c in covered), box.bounding_box()
    texts = " ".join(page.get_by_test_id("toast-text").all_inner_texts())
    assert "ffmpeg" not in texts and "libsndfile" not in texts
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "webui-toasts.png"))
    for close in page.get_by_test_id("toast-close").all():
        close.click()

    page.fill("#text textarea", "x" * 6000)
    page.click("#generate")
    toast(page, "text has 6000 characters; at most 5000 are allowed")
    assert "COSYVOICE_" not in " ".join(page.get_by_test_id("toast-text").all_inner_texts())

    webm = _webm_opus(short_prompt_wav, tmp_path / "recording.webm")  # what a browser's recorder makes
    upload_prompt(page, webm)
    page.wait_for_timeout(1000)  # the server's check of the upload
    assert page.get_by_test_id("toast-text").count() == 0, page.get_by_test_id("toast-text").all_inner_texts()
    # the uploaded recording plays, and no link or attribute of it shows where the server keeps the file
    sync_api.expect(page.locator("#prompt [data-testid='waveform-controls']")).to_be_visible()
    assert page.evaluate("""() => [...document.querySelectorAll('#prompt *')].flatMap(e => [...e.attributes])
        .filter(a => /file=|\\/tmp\\//.test(a.value)).map(a => a.value)""") == []

    page.locator("#prompt button[aria-label='Clear']").click()
    page.locator("#prompt button[aria-label='Record audio']").click()  # this machine has no microphone
    sync_api.expect(page.locator("#mic-message")).to_contain_text("No microphone was found")
    page.screenshot(path=str(ARTIFACTS / "webui-no-microphone.png"))
    page.close()


def test_a_click_answered_as_the_event_stream_closes_still_shows_its_outcome(browser, app: tuple) -> None:
    """A click the server takes just after closing the page's event stream (the session's events were all done),
    its answer reaching the browser before that close, as on a busy machine: its warning still shows (Gradio's
    client alone would wait for it on the closing stream, and the toast would never come)."""
    with page_with_held_close(browser, app[1]) as page:
        page.click("#manage")
        page.click("#save")  # no recording: a warning, and then the server closes the stream
        page.wait_for_function("() => window.cvNet.held.length > 0")
        answered = page.evaluate("window.cvNet.answered")
        page.click("#rename")  # no voice picked: a warning
        page.wait_for_function(f"() => window.cvNet.answered > {answered}")
        page.evaluate("window.cvNet.release()")
        texts = page.get_by_test_id("toast-text")
        sync_api.expect(texts.filter(has_text="upload or record a prompt voice first")).to_be_visible()
        sync_api.expect(texts.filter(has_text="pick a saved voice to rename")).to_be_visible(timeout=15000)


def test_an_upload_as_the_event_stream_closes_holds_no_click_back(browser, app: tuple, short_prompt_wav: Path) -> None:
    """A recording uploaded while the page's event stream is closing (a picked voice's preview was its last event):
    Gradio's client answers close_stream by aborting its latest stream, which the upload's progress stream is by
    then; the upload's own step and every later click still go through (they used to wait for an abort of the
    event stream that never came: the voice stayed picked and no button answered again)."""
    with page_with_held_close(browser, app[1]) as page:
        page.click("#voice input")
        page.get_by_role("option", name="Narrator").click()  # its preview is the session's last event
        page.wait_for_function("() => window.cvNet.held.length > 0")
        answered = page.evaluate("window.cvNet.answered")
        upload_prompt(page, short_prompt_wav)  # a progress stream, then the recording's check joins the queue
        page.wait_for_function(f"() => window.cvNet.answered > {answered}")
        page.evaluate("window.cvNet.release()")
        sync_api.expect(page.locator("#voice input")).to_have_value("")
        page.click("#manage")
        page.click("#rename")  # no voice picked now: a warning
        toast(page, "pick a saved voice to rename")


def test_narrow_screen_puts_the_voice_picker_above_generate(browser, app: tuple) -> None:
    _, url = app
    ctx = browser(locale="en-US")
    try:
        page = ctx.new_page()
        page.set_viewport_size({"width": 390, "height": 844})
        page.goto(url)
        page.wait_for_selector("#generate")
        voice, generate = page.locator("#voice").bounding_box(), page.locator("#generate").bounding_box()
        assert voice["y"] + voice["height"] <= generate["y"], (voice, generate)
        # the three modes side by side, none behind Gradio's "⋯" menu
        modes = page.locator("[role=tablist]").first.get_by_role("tab")
        assert modes.all_inner_texts() == [TABS["zero_shot"], TABS["cross_lingual"], TABS["instruct2"]]
        assert not page.locator(".overflow-menu button").first.is_visible()
        assert page.evaluate("document.documentElement.scrollWidth") <= 390  # nothing runs off the side
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "webui-390px.png"), full_page=True)
    finally:
        ctx.close()


def _take_with_format(context, url: str, short_prompt_wav: Path, fmt: str):
    page = open_page(context, url)
    page.get_by_role("tab", name=TABS["cross_lingual"]).click()
    upload_prompt(page, short_prompt_wav)
    page.fill("#text textarea", TEXT)
    page.click("#format input")
    page.get_by_role("option", name=fmt).click()
    page.click("#generate")
    status_says(page, "Take 1:", timeout=60000)
    page.evaluate("() => window.cvStudio.stop()")  # the noise of the tiny model need not play on
    return page


def test_all_takes_download_as_a_zip_made_on_the_click(context, app: tuple, short_prompt_wav: Path) -> None:
    studio, url = app
    page = _take_with_format(context, url, short_prompt_wav, "WAV")
    made = len(list(studio._files.rglob("cosyvoice-takes-*.zip")))
    with page.expect_download() as download:
        page.click("#download-all")
    assert download.value.suggested_filename == "cosyvoice-takes-1.zip"
    assert len(list(studio._files.rglob("cosyvoice-takes-*.zip"))) == made + 1  # one ZIP, made when asked for
    page.close()


def test_flac_download_is_a_complete_file(context, app: tuple, short_prompt_wav: Path, tmp_path: Path) -> None:
    _, url = app
    page = _take_with_format(context, url, short_prompt_wav, "FLAC")
    with page.expect_download() as download:
        page.locator("#download a").first.click()
    path = tmp_path / "take.flac"
    download.value.save_as(path)
    page.close()
    info = sf.info(path)
    assert info.frames > 0 and info.frames == len(sf.read(path)[0])  # the length is in the header


def test_signing_in_with_a_key(tts, browser, tmp_path: Path, short_prompt_wav: Path) -> None:
    """COSYVOICE_API_KEYS set: the page asks for a key first; with it, takes play live as usual."""
    ctx = browser(locale="en-US")
    try:
        with serving(make_studio(tts, tmp_path, api_keys=("the-key",))) as url:
            page = ctx.new_page()
            page.goto(url)
            sync_api.expect(page.locator("#key")).to_be_visible()  # the sign-in page, nothing of the app
            assert page.locator("#generate").count() == 0
            page.fill("#key", "a guess")
            page.click("button[type=submit]")
            sync_api.expect(page.get_by_role("alert")).to_contain_text("Wrong API key")
            page.fill("#key", "the-key")
            page.click("button[type=submit]")
            page.wait_for_selector("#generate")
            page.wait_for_function("() => window.cvStudio !== undefined")
            page.get_by_role("tab", name=TABS["cross_lingual"]).click()
            upload_prompt(page, short_prompt_wav)
            page.fill("#text textarea", TEXT)
            page.click("#generate")
            status_says(page, "Take 1:", timeout=60000)
            page.wait_for_function("() => { const t = Object.values(window.cvStudio.takes).at(-1);"
                                   " return t && t.streamDone && t.samples > 0 }")  # the live audio came too
            page.evaluate("() => window.cvStudio.stop()")
            sync_api.expect(page.locator("#take-history .take")).to_have_count(1)  # the history, behind the key too
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "webui-signed-in.png"))
            page.close()
    finally:
        ctx.close()


def test_my_upload_is_listed_after_a_reload_and_not_for_another_visitor(context, browser, app: tuple,
                                                                        short_prompt_wav: Path) -> None:
    """An upload belongs to the browser (its cv-browser identity, cosyvoice/owners.py), not to one page load."""
    _, url = app
    mine = open_page(context, url)
    upload_prompt(mine, short_prompt_wav)
    mine.fill("#transcript textarea", "My private words.")
    mine.fill("#text textarea", TEXT)
    mine.click("#generate")
    sync_api.expect(mine.locator("#status")).to_contain_text("Take 1:", timeout=60000)
    mine.evaluate("() => window.cvStudio.stop()")
    mine.reload()  # a new page load lists the voices again; the upload was cached under this browser
    mine.wait_for_selector("#generate button, button#generate")
    mine.wait_for_function("() => window.cvStudio !== undefined")
    mine.click("#voice input")
    options = mine.get_by_role("option").all_inner_texts()
    assert any("recent upload" in o and "private words" in o for o in options), options
    mine.keyboard.press("Escape")
    ctx = browser(locale="en-US")  # someone else, in another browser
    try:
        theirs = open_page(ctx, url)
        theirs.click("#voice input")
        options = theirs.get_by_role("option").all_inner_texts()
        assert options and not any("private words" in o or "recent upload" in o for o in options), options
        theirs.close()
    finally:
        ctx.close()
    mine.close()


def _webm_opus(wav: Path, out: Path) -> Path:
    """``wav`` as WebM/Opus at 48 kHz, encoded in process with PyAV (no ffmpeg binary on the machine)."""
    import av
    import soundfile as sf

    samples, rate = sf.read(wav, dtype="float32", always_2d=True)
    resampler = av.AudioResampler(format="s16", layout="mono", rate=48000)
    with av.open(str(out), "w", format="webm") as container:
        stream = container.add_stream("libopus", rate=48000, layout="mono")
        frame = av.AudioFrame.from_ndarray(samples.mean(axis=1, keepdims=True).T.copy(), format="fltp", layout="mono")
        frame.sample_rate = rate
        for piece in resampler.resample(frame):
            for packet in stream.encode(piece):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return out


def test_the_history_is_kept_grows_incrementally_and_opens_batch_takes(context, app: tuple,
                                                                       short_prompt_wav: Path) -> None:
    """The Generate tab's history is the workbench store's: it survives a reload (numbers go on), a new take
    fetches only itself (no earlier take's audio again), and a batch take can be opened and reproduced."""
    studio, url = app
    page = open_page(context, url)
    fetched: list[str] = []
    page.on("request", lambda r: fetched.append(r.url) if "/workbench/api/takes" in r.url else None)
    page.get_by_role("tab", name=TABS["cross_lingual"]).click()
    upload_prompt(page, short_prompt_wav)
    _two_takes_grow_the_history_incrementally(page, studio, fetched)

    page.reload()
    page.wait_for_function("() => window.cvHistory !== undefined")
    sync_api.expect(page.locator("#take-history .take")).to_have_count(2)  # kept on the server, per browser
    sync_api.expect(page.locator("#take-history .take").first).to_contain_text("Take 2")
    sync_api.expect(page.locator("#download-all")).to_be_visible()

    _a_batch_take_opens_and_is_reproduced(page, context, studio)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "webui-history.png"), full_page=True)
    page.close()


def _two_takes_grow_the_history_incrementally(page, studio, fetched: list[str]) -> None:
    """Two takes made on the page: the history lists them newest first, the second listing asks only for what
    is new since the first, and no take's audio is downloaded before it is played."""
    history = page.locator("#take-history")
    sync_api.expect(history.locator(".no-takes")).to_be_visible()
    for n, seed in ((1, 3), (2, 4)):
        page.fill("#text textarea", f"Take number {n}.")
        page.fill("#seed input", str(seed))
        page.click("#generate")
        status_says(page, f"Take {n}:", timeout=60000)
        page.evaluate("() => window.cvStudio.stop()")
        sync_api.expect(history.locator(".take")).to_have_count(n)
    takes = history.locator(".take")
    sync_api.expect(takes.first.locator(".take-meta")).to_contain_text("Take 2")
    sync_api.expect(takes.first.locator(".take-meta")).to_contain_text("seed 4")
    sync_api.expect(takes.nth(1).locator(".take-text")).to_have_text("Take number 1.")
    listings = [u for u in fetched if "/workbench/api/takes?" in u]
    mine = studio.store.takes(owner=None, any_owner=True)[-2:]
    assert f"after={mine[0].seq}" in listings[-1], listings  # only what is new since take 1
    assert not [u for u in fetched if u.endswith("/audio")]  # nothing played yet, nothing downloaded
    assert page.evaluate("async () => { const a = document.querySelector('#take-history .take audio');"
                         " const r = await fetch(a.src); return [r.status, (await r.arrayBuffer()).byteLength] }") \
        [0] == 200  # each player plays the stored take


def _a_batch_take_opens_and_is_reproduced(page, context, studio) -> None:
    """A batch take (the CLI and the REST API run the same function) opens in the page and is reproduced there;
    this visitor's batch (one the REST API ran for this browser): a private server shows a visitor only its own."""
    from cosyvoice.workbench.batch import parse_rows, run_batch

    browser_id = next(c["value"] for c in context.cookies() if c["name"] == "cv-browser")
    [made] = run_batch(studio.service, studio.store,
                       parse_rows("text,voice,seed,label\nWords from a batch.,Narrator,11,sysA\n"),
                       owner=f"browser:{browser_id}").takes
    page.click("#take-history .history-view[data-view=all]")
    entry = page.locator(f"#take-history .take[data-take='{made.id}']")
    sync_api.expect(entry).to_contain_text("condition sysA", timeout=10000)
    sync_api.expect(entry).to_contain_text("batch")
    entry.locator(".open-take").click()
    sync_api.expect(page.locator("#text textarea")).to_have_value("Words from a batch.")
    sync_api.expect(page.locator("#seed input")).to_have_value("11")
    sync_api.expect(page.locator("#voice input")).to_have_value("Narrator (built-in)")
    sync_api.expect(page.locator("#stream input")).not_to_be_checked()
    page.click("#generate")
    # the history numbers the takes made on the page (its two and this one), not the batch's rows
    status_says(page, "Take 3:", timeout=60000)
    again = studio.store.takes(owner=None, any_owner=True)[-1]
    assert np.array_equal(studio.store.read_audio(again), studio.store.read_audio(made))  # the same samples
    page.click("#take-history .history-view[data-view=mine]")
    this_browser = page.locator("#take-history .history-list[data-view=mine] .take")
    sync_api.expect(this_browser).to_have_count(3)
    sync_api.expect(this_browser.first).to_contain_text("Take 3")
    sync_api.expect(this_browser.first.locator(".take-wav")).to_have_attribute("download", "take-3-seed11.wav")
    sync_api.expect(page.locator(f"#take-history .history-list[data-view=mine] .take[data-take='{made.id}']")
                    ).to_have_count(0)


def test_the_chunk_schedule_in_the_advanced_settings_reaches_the_take(context, app: tuple,
                                                                      short_prompt_wav: Path) -> None:
    """``final`` and ``first_hop`` set in the advanced settings are the take's schedule (its provenance says so,
    for a blind A/B test), "Use these settings" puts them back, and a first hop out of range is refused by name."""
    studio, url = app
    page = open_page(context, url)
    page.get_by_role("tab", name=TABS["cross_lingual"]).click()
    upload_prompt(page, short_prompt_wav)
    page.fill("#text textarea", "A take on the chunked schedule.")
    page.fill("#seed input", "6")
    page.locator("#advanced").get_by_text("Advanced settings").click()
    page.locator("#final").get_by_label("chunked").check()
    page.fill("#first-hop input", "30")
    page.click("#generate")
    toast(page, "first_hop must be a whole number of speech tokens from 1 to 25, got 30")
    assert_usable(page)
    page.fill("#first-hop input", "7")
    page.click("#generate")
    status_says(page, "Take 1:", timeout=60000)
    page.evaluate("() => window.cvStudio.stop()")
    take = studio.store.takes(owner=None, any_owner=True)[-1].provenance
    assert (take["final"], take["first_hop"], take["seed"]) == ("chunked", 7, 6)
    page.locator("#final").get_by_label("full (reference)").check()
    page.fill("#first-hop input", "")
    sync_api.expect(page.locator("#take-history .take")).to_have_count(1)
    page.locator("#take-history .take .open-take").first.click()
    sync_api.expect(page.locator("#first-hop input")).to_have_value("7")
    sync_api.expect(page.locator("#final").get_by_label("chunked")).to_be_checked()
    page.close()
