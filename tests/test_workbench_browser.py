"""Raters in a real browser (Debian's chromium via Playwright) against the REST server as a real process.

Two raters complete a 4-item A/B test and a 4-item MOS test through their links; one leaves half-way and resumes
on another "device" (a fresh browser profile) after the server was killed and started again; the CSV export holds
exactly their answers with the take ids; listen-gating refuses a rating before playback ends. On the web UI's app
behind API keys, a rater without a key finishes a test through the link alone. Screenshots go to
``test-artifacts/``.
"""

from __future__ import annotations

import csv
import io
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from browser import FLAGS as CHROMIUM_FLAGS
from browser import require_browser
from waiting import free_port, until, until_ready

sync_api, CHROMIUM = require_browser()

from cosyvoice.takes.store import TakeStore  # noqa: E402
from cosyvoice.workbench import listening  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "test-artifacts"
FLAGS = [*CHROMIUM_FLAGS, "--autoplay-policy=no-user-gesture-required"]
SECONDS = 0.5  # each stimulus: played to its end before each answer, as a rater must
OWNER = "c" * 32  # the experimenter's browser (its cv-browser id): the takes and tests are its own


class App:
    """``python -m cosyvoice.server.rest`` on one loopback port; ``restart()`` kills it (-9) and starts it again."""

    def __init__(self, bundle: Path, root: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "cosyvoice.server.rest", "--model-dir", str(bundle), "--voice-dir",
                     str(root / "voices"), "--port", str(self.port), "--device", "cpu", "--log-level", "warning"]
        self.env = {**os.environ, "PYTHONPATH": str(REPO), "COSYVOICE_DATA_DIR": str(root / "data")}
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(self.args, env=self.env)
        until(self.healthy, 120, "the server's start")

    def healthy(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, "the server exited"
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(30)

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture(scope="module")
def setup(tiny_bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[App, str, str]]:
    root = tmp_path_factory.mktemp("workbench-browser")
    store = TakeStore(root / "data")
    for k, text in enumerate(["one", "two", "three", "four"]):
        for j, label in enumerate(["sysA", "sysB"]):
            t = np.arange(int(24000 * SECONDS)) / 24000
            pcm = (0.2 * np.sin(2 * np.pi * (220 + 40 * k + 110 * j) * t)).astype(np.float32)
            store.add_take(pcm, 24000, {"text": text, "segments": [text], "voice": "tone", "mode": "test", "seed": k},
                           label=label, owner=f"browser:{OWNER}")
    ab = listening.create_test(store, "ab", listening.design("ab", store.takes(), ["sysA", "sysB"]), title="A/B",
                               owner=f"browser:{OWNER}")
    mos_items = listening.design("mos", store.takes(), ["sysA", "sysB"])[:4]
    mos = listening.create_test(store, "mos", mos_items, title="MOS", owner=f"browser:{OWNER}")
    store.close()
    app = App(tiny_bundle_dir, root)
    yield app, ab, mos
    app.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    with sync_api.sync_playwright() as playwright:
        # each call: a fresh profile, i.e. another device (no local storage shared)
        yield lambda locale="en-US": playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=str(CHROMIUM), headless=True,
            args=FLAGS, viewport={"width": 1100, "height": 900}, locale=locale)


def join(context, url: str, name: str):
    """A new rater: the personal link is shown before the first item, then the first item."""
    page = context.new_page()
    page.goto(url)
    page.wait_for_function("() => window.wb && window.wb.ready")
    page.fill("#name", name)
    page.click("#start")
    sync_api.expect(page.locator("#ready")).to_be_visible()
    assert page.input_value("#personal-link").endswith(f"?rater={page.evaluate('() => wb.rater')}")
    page.click("#begin")
    sync_api.expect(page.locator("#rating, #done").locator("visible=true")).to_have_count(1)
    return page


def answer_item(page, choice: str) -> None:
    """Play every sample to its end, then choose and save, as a rater would."""
    expect = sync_api.expect
    progress = page.locator("#item-progress").inner_text()
    for button in page.locator("button.play").all():
        slot = button.get_attribute("data-slot")
        button.click()
        expect(page.locator(f".slot[data-slot='{slot}']")).to_have_class("slot played", timeout=15000)
    page.check(f"input[value='{choice}']")
    expect(page.locator("#submit")).to_be_enabled()
    page.click("#submit")
    page.wait_for_function("""(before) => !document.getElementById("done").hidden ||
        !document.getElementById("questionnaire").hidden ||
        document.getElementById("item-progress").textContent !== before""", arg=progress)  # next item, or the end


def finish(page, choice: str, items: int) -> None:
    for _ in range(items):
        answer_item(page, choice)
    answer_questionnaire(page)


def answer_questionnaire(page, device: str = "headphones", language: str = "English") -> None:
    """The end-of-test questions, answered; then the thank-you."""
    sync_api.expect(page.locator("#questionnaire")).to_be_visible()
    page.check(f"input[name=device][value='{device}']")
    page.fill("#native-language", language)
    page.click("#send-questionnaire")
    sync_api.expect(page.locator("#done")).to_be_visible()


def listen_gated(page) -> None:
    """The page keeps Save disabled until the chosen sample played through, and the server refuses a rating sent
    before playback ends; then the sample is marked played."""
    sync_api.expect(page.locator("#submit")).to_be_disabled()
    page.check("input[value='A']")
    sync_api.expect(page.locator("#submit")).to_be_disabled()
    page.click("button.play[data-slot='A']")
    refused = page.evaluate("""async () => {
        const r = await fetch(`/workbench/api/raters/${wb.rater}/answers`, {method: "POST",
            headers: {"Content-Type": "application/json"},
            body: JSON.stringify({position: wb.state.position, answer: {choice: "A"}})});
        return [r.status, (await r.json()).error.message]; }""")
    assert refused[0] == 400 and "to the end first" in refused[1]
    sync_api.expect(page.locator(".slot[data-slot='A']")).to_have_class("slot played", timeout=15000)


def owner_views_results(owner, url: str, ab: str, mos: str) -> None:
    """The owner's view, in the experimenter's browser: progress per rater and the results with an interval plot
    (MOS), preference counts and a p-value (A/B)."""
    owner.goto(f"{url}/workbench/tests/{mos}")
    owner.wait_for_function("() => window.wbReady")
    sync_api.expect(owner.locator("#raters tr")).to_have_count(2)
    sync_api.expect(owner.locator("#interval-plot circle")).to_have_count(2)
    owner.screenshot(path=str(ARTIFACTS / "workbench-results.png"), full_page=True)
    owner.goto(f"{url}/workbench/tests/{ab}")
    owner.wait_for_function("() => window.wbReady")
    sync_api.expect(owner.locator("#summary table tbody tr")).not_to_have_count(0)
    owner.screenshot(path=str(ARTIFACTS / "workbench-results-ab.png"), full_page=True)


def owner_makes_and_deletes(owner, url: str) -> None:
    """From the owner's page: a new test, a batch whose failures are reported per row, a refused and a done
    deletion."""
    owner.goto(f"{url}/workbench/")
    owner.wait_for_function("() => window.wb && window.wb.ready")
    sync_api.expect(owner.locator("#takes tr")).to_have_count(8)
    # a new test from the page: MUSHRA without reference over the two conditions, one item per text
    owner.select_option("#kind", "mushra_noref")
    owner.check("#conditions input[value='sysA']")
    owner.check("#conditions input[value='sysB']")
    owner.click("#create-test")
    sync_api.expect(owner.locator("#create-status")).to_contain_text("Created with 4 items")
    sync_api.expect(owner.locator("#tests tr")).to_have_count(3)
    # texts x voices from the page: a batch over REST, its failures reported per row (this server has no voices)
    owner.fill("#grid-texts", "Hello there.\nGood morning.")
    owner.fill("#grid-voices", "nobody")
    owner.click("#grid-run")
    batch = owner.locator("#batches tr").first
    sync_api.expect(batch).to_contain_text("2 of 2 rows", timeout=60000)
    sync_api.expect(batch).to_contain_text("row 1: unknown voice")
    owner.screenshot(path=str(ARTIFACTS / "workbench-owner.png"), full_page=True)
    # deleting: a take a test uses is refused with the reason; the test made from the page goes
    owner.on("dialog", lambda dialog: dialog.accept())
    owner.locator("#takes tr").first.locator("button.delete-take").click()
    sync_api.expect(owner.locator("#takes-status")).to_contain_text("used by the listening test")
    sync_api.expect(owner.locator("#takes tr")).to_have_count(8)
    owner.locator("#tests tr").last.locator("button.delete-test").click()
    sync_api.expect(owner.locator("#tests tr")).to_have_count(2)


def stranger_sees_nothing(page, url: str) -> None:
    """Another browser sees none of the owner's takes and tests (a private server: cosyvoice/owners.py)."""
    page.goto(f"{url}/workbench/")
    page.wait_for_function("() => window.wb && window.wb.ready")
    sync_api.expect(page.locator("#takes tr")).to_have_count(0)
    sync_api.expect(page.locator("#tests tr")).to_have_count(0)


def answers_as_given(app: App, given_by_test: dict[str, dict[str, str]], ab: str) -> None:
    """answers.csv has each rater's answer at every position, with what they were shown and heard."""
    store = TakeStore(app.env["COSYVOICE_DATA_DIR"])
    for test_id, answers in given_by_test.items():
        text = httpx.get(f"{app.url}/workbench/api/tests/{test_id}/answers.csv", cookies={"cv-browser": OWNER}).text
        rows = list(csv.DictReader(io.StringIO(text)))
        assert len(rows) == 8 and sorted({r["rater"] for r in rows}) == ["Ann", "Bob"]
        raters = {r.name: r for r in store.raters(test_id)}
        for rater_name, given in answers.items():
            mine = sorted((r for r in rows if r["rater"] == rater_name), key=lambda r: int(r["position"]))
            assert [int(r["position"]) for r in mine] == [0, 1, 2, 3]
            assert all(r["answer"] == given and int(r["plays"]) >= 1 for r in mine)
            plan = raters[rater_name].plan
            for r in mine:
                shown = {s["slot"]: s["take"] for s in plan[int(r["position"])]["slots"]}
                assert r["shown"] == ";".join(f"{k}={v}" for k, v in shown.items())
                if test_id == ab:  # the chosen side's take, as the rater heard it
                    assert r["answer_take"] == shown[given]
                    assert sorted(r["take_ids"].split(";")) == sorted(shown.values())
                else:
                    assert r["take_ids"] == shown["X"] and r["score"] == given


def test_two_raters_finish_ab_and_mos_one_resuming_after_a_restart(setup, browser) -> None:
    """Ann goes on, on another device, through her personal link (her rater id): her name alone is refused."""
    app, ab, mos = setup
    ARTIFACTS.mkdir(exist_ok=True)
    ann_device = browser()
    ann = join(ann_device, f"{app.url}/workbench/rate/{ab}", "Ann")
    sync_api.expect(ann.locator("#item-progress")).to_have_text("Item 1 of 4")

    listen_gated(ann)
    ann.screenshot(path=str(ARTIFACTS / "workbench-rater.png"), full_page=True)

    answer_item(ann, "A")
    answer_item(ann, "A")
    sync_api.expect(ann.locator("#item-progress")).to_have_text("Item 3 of 4")
    personal_link = ann.locator("#resume-link").get_attribute("href")
    ann_device.close()  # Ann leaves half-way

    app.restart()  # kill -9 and start again: her two answers are on disk

    bob_device = browser()
    bob = join(bob_device, f"{app.url}/workbench/rate/{ab}", "Bob")
    finish(bob, "B", 4)
    bob = join(bob_device, f"{app.url}/workbench/rate/{mos}", "Bob")
    finish(bob, "3", 4)

    phone = browser()  # Ann again, on another device: her name is no key to her answers
    impostor = phone.new_page()
    impostor.goto(f"{app.url}/workbench/rate/{ab}")
    impostor.wait_for_function("() => window.wb && window.wb.ready")
    impostor.fill("#name", "Ann")
    impostor.click("#start")
    sync_api.expect(impostor.locator("#error")).to_contain_text("open your personal link")
    sync_api.expect(impostor.locator("#rating")).to_be_hidden()
    impostor.close()
    ann = phone.new_page()  # her personal link resumes where she left
    ann.goto(personal_link)
    sync_api.expect(ann.locator("#item-progress")).to_have_text("Item 3 of 4")
    finish(ann, "A", 2)
    ann = join(phone, f"{app.url}/workbench/rate/{mos}", "Ann")
    ann.screenshot(path=str(ARTIFACTS / "workbench-rater-mos.png"), full_page=True)
    finish(ann, "4", 4)

    owner_device = browser()
    owner_device.add_cookies([{"name": "cv-browser", "value": OWNER, "url": app.url}])
    owner = owner_device.new_page()
    owner_views_results(owner, app.url, ab, mos)
    owner_makes_and_deletes(owner, app.url)
    stranger_sees_nothing(phone.new_page(), app.url)
    owner_device.close()
    phone.close()
    bob_device.close()

    answers_as_given(app, {ab: {"Ann": "A", "Bob": "B"}, mos: {"Ann": "4", "Bob": "3"}}, ab)


def test_a_rater_without_a_key_finishes_a_test_on_the_web_ui_behind_keys(tts, browser, tmp_path: Path) -> None:
    pytest.importorskip("gradio", reason="the web UI needs the 'ui' extra")
    from test_webui import make_studio, serving

    from cosyvoice.owners import key_owner
    from cosyvoice.settings import default_data_dir

    studio = make_studio(tts, tmp_path, api_keys=("the-key",))
    store = TakeStore(default_data_dir(studio.service.voices.dir.parent))
    t = np.arange(7200) / 24000  # 0.3 s
    a, b = (store.add_take((0.2 * np.sin(2 * np.pi * f * t)).astype(np.float32), 24000, {"text": "one"}, label=label)
            for f, label in ((220, "sysA"), (330, "sysB")))
    test_id = listening.create_test(store, "ab", [{"takes": [a.id, b.id]}], title="Behind keys",
                                    owner=key_owner("the-key"))
    with serving(studio) as url:
        device = browser()
        refused: list[str] = []
        device.on("response", lambda r: refused.append(f"{r.status} {r.url}") if r.status >= 400 else None)
        page = join(device, f"{url}workbench/rate/{test_id}", "Ann")
        finish(page, "B", 1)
        device.close()
        assert refused == []  # the rate page asks nothing of the gated routes
        assert httpx.get(f"{url}workbench/api/tests/{test_id}/results").status_code == 401
        [row] = csv.DictReader(io.StringIO(httpx.get(f"{url}workbench/api/tests/{test_id}/answers.csv",
                                                     headers={"Authorization": "Bearer the-key"}).text))
        assert (row["rater"], row["answer"], row["answer_take"]) == ("Ann", "B", row["shown"].split("B=")[1])


@pytest.fixture(scope="module")
def abx_and_mushra(setup) -> tuple[str, str]:
    """An ABX test and a MUSHRA test (hidden reference) over the same takes, added beside the running server."""
    app, _, _ = setup
    store = TakeStore(app.env["COSYVOICE_DATA_DIR"])
    abx = listening.create_test(store, "abx", listening.design("abx", store.takes(), ["sysA", "sysB"])[:2],
                                title="ABX", owner=f"browser:{OWNER}")
    mushra = listening.create_test(store, "mushra", listening.design("mushra", store.takes(), ["sysA", "sysB"],
                                                                     reference="sysA")[:2], title="MUSHRA",
                                   owner=f"browser:{OWNER}")
    store.close()
    return abx, mushra


def play_all(page) -> None:
    for button in page.locator("button.play").all():
        slot = button.get_attribute("data-slot")
        button.click()
        sync_api.expect(page.locator(f".slot[data-slot='{slot}']")).to_have_class("slot played", timeout=15000)


def blind_audio(page) -> None:
    """Nothing in a sample's answer dates it or names it across items (no file name, no date, no tag)."""
    headers = page.evaluate("""async () => {
        const r = await fetch(`/workbench/api/raters/${wb.rater}/audio/${wb.state.position}/X`);
        return Object.fromEntries(r.headers.entries()); }""")
    assert headers["cache-control"] == "no-store" and headers["content-type"] == "audio/wav"
    assert not {"etag", "last-modified", "content-disposition"} & set(headers), headers


def test_abx_and_mushra_items_and_an_answer_sent_while_the_server_restarts(setup, abx_and_mushra, browser) -> None:
    app, _, _ = setup
    abx, mushra = abx_and_mushra
    expect = sync_api.expect
    device = browser()

    # ABX: A, B and X played; the rater says which one X is; the answer is scored against the plan
    page = join(device, f"{app.url}/workbench/rate/{abx}", "Cleo")
    blind_audio(page)
    expect(page.locator("#question")).to_have_text("X is the same recording as A or as B. Which one?")
    assert page.locator("button.play").evaluate_all("bs => bs.map(b => b.dataset.slot)") == ["A", "B", "X"]
    answer_item(page, "A")
    answer_item(page, "B")
    answer_questionnaire(page)
    rows = list(csv.DictReader(io.StringIO(httpx.get(f"{app.url}/workbench/api/tests/{abx}/answers.csv",
                                                     cookies={"cv-browser": OWNER}).text)))
    assert len(rows) == 2
    for row in rows:
        shown = dict(pair.split("=") for pair in row["shown"].split(";"))
        assert row["answer_take"] == shown[row["answer"]] and row["score"] == str(int(shown["X"] == row["answer_take"]))
    owner_device = browser()  # the experimenter's browser
    owner_device.add_cookies([{"name": "cv-browser", "value": OWNER, "url": app.url}])
    results = owner_device.new_page()
    results.goto(f"{app.url}/workbench/tests/{abx}")
    results.wait_for_function("() => window.wbReady")
    correct = sum(int(r["score"]) for r in rows)
    expect(results.locator("#summary td").nth(1)).to_have_text(f"{correct} of 2")
    owner_device.close()

    # MUSHRA: BS.1534's scale labels; a slider nobody moved keeps Save disabled, a click confirms a value as it is
    page = join(device, f"{app.url}/workbench/rate/{mushra}", "Cleo")
    expect(page.locator(".mushra .scale span")).to_have_text(["Bad", "Poor", "Fair", "Good", "Excellent"])
    play_all(page)
    sliders = page.locator("#controls input[type=range]")
    assert sliders.count() == 2  # the stimulus and the hidden reference (the anchor-less design)
    expect(page.locator("#submit")).to_be_disabled()
    expect(page.locator("#submit-hint")).to_contain_text("Move every slider")
    sliders.nth(0).focus()
    for _ in range(30):
        page.keyboard.press("ArrowRight")
    expect(page.locator(".mushra .value").nth(0)).to_have_text("80 Excellent")
    expect(page.locator("#submit")).to_be_disabled()  # one slider still untouched
    page.locator(".mushra .value").nth(1).click()  # keep 50: confirmed
    expect(page.locator(".mushra .value").nth(1)).to_have_text("50 Fair")
    expect(page.locator("#submit")).to_be_enabled()
    page.screenshot(path=str(ARTIFACTS / "workbench-rater-mushra.png"), full_page=True)

    # the server goes away as the rater saves: "reconnecting", and the answer arrives once it is back
    app.stop()
    page.click("#submit")
    expect(page.locator("#reconnecting")).to_be_visible(timeout=15000)
    assert page.evaluate(f"() => JSON.parse(localStorage.getItem('wb-pending:{mushra}')).answer.scores") is not None
    page.screenshot(path=str(ARTIFACTS / "workbench-rater-reconnecting.png"), full_page=True)
    app.start()
    expect(page.locator("#reconnecting")).to_be_hidden(timeout=60000)
    expect(page.locator("#item-progress")).to_have_text("Item 2 of 2")
    rows = list(csv.DictReader(io.StringIO(httpx.get(f"{app.url}/workbench/api/tests/{mushra}/answers.csv",
                                                     cookies={"cv-browser": OWNER}).text)))
    assert sorted(int(r["score"]) for r in rows) == [50, 80]
    device.close()


def test_a_thousand_takes_are_paged_and_filtered_and_the_forms_come_first(setup, browser) -> None:
    app, _, _ = setup
    store = TakeStore(app.env["COSYVOICE_DATA_DIR"])
    pcm = np.zeros(2400, np.float32)
    for k in range(1000):
        text = f"bulk line {k}"
        store.add_take(pcm, 24000, {"text": text, "segments": [text]}, label="bulk", owner=f"browser:{OWNER}")
    store.close()
    device = browser()
    device.add_cookies([{"name": "cv-browser", "value": OWNER, "url": app.url}])
    page = device.new_page()
    answers: list = []  # the take lists the page fetched
    page.on("response", lambda r: r.url.split("?")[0].endswith(("/api/takes", "/api/takes/page")) and answers.append(r))
    page.goto(f"{app.url}/workbench/")
    page.wait_for_function("() => window.wb && window.wb.ready")
    sizes = [len(r.json()["takes"]) for r in answers]
    assert sizes and max(sizes) <= 50, sizes  # one page of 50 was fetched, not every take
    expect = sync_api.expect
    expect(page.locator("#takes tr")).to_have_count(50)
    total = page.evaluate("() => wb.total")
    assert total >= 1000
    expect(page.locator("#takes-range")).to_have_text(f"1–50 of {total}")
    expect(page.locator("#takes tr td.text").first).to_have_text("bulk line 999")  # newest first
    # the forms stand above the long list
    headings = page.locator("h2").all_inner_texts()
    assert headings.index("2. New blind test") < headings.index("4. Takes")
    page.click("#takes-older")
    expect(page.locator("#takes-range")).to_have_text(f"51–100 of {total}")
    page.fill("#filter-text", "LINE 12")  # any case
    page.locator("#filter-text").dispatch_event("change")
    expect(page.locator("#takes-range")).to_have_text("1–11 of 11")  # line 12 and lines 120..129
    page.fill("#filter-text", "")
    page.select_option("#filter-label", "sysA")
    page.locator("#filter-text").dispatch_event("change")
    expect(page.locator("#takes tr td:nth-child(2)")).to_have_text(["sysA"] * 4)
    width = page.evaluate("() => document.documentElement.scrollWidth")
    assert width <= 1100, width  # nothing overflows the page
    page.screenshot(path=str(ARTIFACTS / "workbench-owner-paged.png"), full_page=True)
    device.close()


def test_a_batch_on_a_full_disk_shows_its_error_and_the_page_stops_polling(tiny_bundle_dir: Path, browser,
                                                                          short_prompt_wav: Path,
                                                                          tmp_path: Path) -> None:
    """Defect 2 where the owner looks: the batch's error is in its row of the batch list, its Stop button goes
    away and the page asks for the batches no more."""
    from test_jobs import fill, tmpfs

    with tmpfs(tmp_path / "data" / "takes") as takes:
        fill(takes)
        app = App(tiny_bundle_dir, tmp_path)
        try:
            until_ready(app.proc, app.url, 120)
            saved = httpx.post(f"{app.url}/v1/voices", data={"name": "Narrator", "transcript": "A short test prompt."},
                               files={"audio": ("p.wav", short_prompt_wav.read_bytes(), "audio/wav")}, timeout=60)
            assert saved.status_code == 201, saved.text
            device = browser()
            device.add_cookies([{"name": "cv-browser", "value": OWNER, "url": app.url}])
            page = device.new_page()
            polls: list[str] = []
            page.on("request", lambda r: polls.append(r.url) if "/workbench/api/batches" in r.url else None)
            page.goto(f"{app.url}/workbench/")
            page.wait_for_function("() => window.wb && window.wb.ready")
            page.fill("#grid-texts", "Hello there.\nAnd again.")
            page.fill("#grid-voices", "Narrator")
            page.click("#grid-run")
            expect = sync_api.expect
            batch = page.locator("#batches tr").first
            expect(batch).to_have_attribute("data-state", "failed", timeout=60_000)
            expect(batch).to_contain_text("disk full")
            expect(batch.locator("button")).to_have_count(0)  # neither Stop nor Resume
            asked = len(polls)
            page.wait_for_timeout(3000)  # the page polled every second while the batch ran
            assert len(polls) == asked, polls[asked:]
            device.close()
        finally:
            app.stop()


@pytest.fixture(scope="module")
def ab_two(setup) -> str:
    """A two-item A/B test added beside the running server."""
    app, _, _ = setup
    store = TakeStore(app.env["COSYVOICE_DATA_DIR"])
    test_id = listening.create_test(store, "ab", listening.design("ab", store.takes(), ["sysA", "sysB"])[:2],
                                    title="Two items", owner=f"browser:{OWNER}")
    store.close()
    return test_id


def test_the_personal_link_comes_first_and_a_reload_keeps_what_was_played(setup, ab_two, browser) -> None:
    """The link is offered (and copied) before the first item, also after a reload there; a reload mid-item shows
    the samples the server saw played to the end as played, so only the others are left to play."""
    app, _, _ = setup
    expect = sync_api.expect
    device = browser()
    device.grant_permissions(["clipboard-read", "clipboard-write"], origin=app.url)
    page = device.new_page()
    page.goto(f"{app.url}/workbench/rate/{ab_two}")
    page.wait_for_function("() => window.wb && window.wb.ready")
    expect(page.locator("#intro")).to_contain_text("with your personal link (you get it before the first item)")
    page.fill("#name", "Dora")
    page.click("#start")
    expect(page.locator("#ready")).to_be_visible()
    expect(page.locator("#rating")).to_be_hidden()
    link = page.input_value("#personal-link")
    page.click("#copy-link")
    expect(page.locator("#copy-status")).to_have_text("Copied.")
    assert page.evaluate("() => navigator.clipboard.readText()") == link
    page.reload()  # no item seen yet: the link is offered again
    page.wait_for_function("() => window.wb && window.wb.ready")
    expect(page.locator("#ready")).to_be_visible()
    page.click("#begin")
    expect(page.locator("#item-progress")).to_have_text("Item 1 of 2")
    page.click("button.play[data-slot='A']")
    expect(page.locator(".slot[data-slot='A']")).to_have_class("slot played", timeout=15000)

    page.reload()
    page.wait_for_function("() => window.wb && window.wb.ready")
    expect(page.locator("#ready")).to_be_hidden()
    expect(page.locator("#item-progress")).to_have_text("Item 1 of 2")
    expect(page.locator(".slot[data-slot='A']")).to_have_class("slot played")
    expect(page.locator(".slot[data-slot='A'] .state")).to_have_text("✓ played to the end")
    expect(page.locator(".slot[data-slot='B']")).to_have_class("slot")
    page.check("input[value='A']")
    expect(page.locator("#submit-hint")).to_have_text("Play every sample to the end first.")
    page.click("button.play[data-slot='B']")
    expect(page.locator(".slot[data-slot='B']")).to_have_class("slot played", timeout=15000)
    expect(page.locator("#submit")).to_be_enabled()
    page.click("#submit")
    expect(page.locator("#item-progress")).to_have_text("Item 2 of 2")
    device.close()


def test_a_save_whose_reply_is_lost_as_the_server_dies_goes_on_once_it_is_back(setup, ab_two, browser) -> None:
    """The server stores the answer and dies before its reply is whole: the page says it is reconnecting, sends
    the answer again once the server is back (accepted as the same answer) and shows the next item, no error."""
    app, _, _ = setup
    expect = sync_api.expect
    device = browser()
    page = join(device, f"{app.url}/workbench/rate/{ab_two}", "Emil")
    play_all(page)
    page.check("input[value='B']")

    def cut_off(route) -> None:
        reply = route.fetch()  # the server saves the answer...
        app.stop()  # ...and dies: the page gets half a reply
        route.fulfill(status=200, content_type="application/json", body=reply.text()[:12])

    page.route("**/answers", cut_off, times=1)
    page.click("#submit")
    expect(page.locator("#reconnecting")).to_be_visible(timeout=15000)
    app.start()
    expect(page.locator("#reconnecting")).to_be_hidden(timeout=60000)
    expect(page.locator("#item-progress")).to_have_text("Item 2 of 2")
    expect(page.locator("#error")).to_be_empty()
    rows = list(csv.DictReader(io.StringIO(httpx.get(f"{app.url}/workbench/api/tests/{ab_two}/answers.csv",
                                                     cookies={"cv-browser": OWNER}).text)))
    assert [(r["rater"], r["position"], r["answer"]) for r in rows if r["rater"] == "Emil"] == [("Emil", "0", "B")]
    device.close()


@pytest.fixture(scope="module")
def long_abx(setup) -> str:
    """An ABX test over two 2.5 s takes: long enough to pause, switch and loop a region mid-sample."""
    app, _, _ = setup
    store = TakeStore(app.env["COSYVOICE_DATA_DIR"])
    t = np.arange(int(24000 * 2.5)) / 24000
    a, b = (store.add_take((0.2 * np.sin(2 * np.pi * f * t)).astype(np.float32), 24000, {"text": "long"}, label=label,
                           owner=f"browser:{OWNER}") for f, label in ((300, "longA"), (450, "longB")))
    test_id = listening.create_test(store, "abx", [{"takes": [a.id, b.id]}], title="Player", owner=f"browser:{OWNER}")
    store.close()
    return test_id


def test_the_player_pauses_shows_the_position_switches_at_the_same_position_and_loops_a_region(
        setup, long_abx, browser) -> None:
    """Keys A/B/X switch samples (the new one starts where the last stopped), space pauses (also with the
    Play/pause button focused: one toggle), a loop region repeats; none of those plays counts as played to the end,
    and only whole plays from the start unlock saving."""
    app, _, _ = setup
    expect = sync_api.expect
    device = browser()
    page = join(device, f"{app.url}/workbench/rate/{long_abx}", "Finn")
    now = "(s) => wb.player.samples.get(s).audio.currentTime"
    page.keyboard.press("a")
    page.wait_for_function(f"() => ({now})('A') > 0.6")
    page.focus("#playpause")
    page.keyboard.press(" ")
    expect(page.locator(".slot[data-slot='A'] .state")).to_have_text("paused")
    expect(page.locator("button.play[data-slot='A']")).to_have_text("▶ Play")
    paused_at = page.evaluate(now, "A")
    expect(page.locator("#position")).to_have_text(f"{paused_at:.2f} / 2.50 s")
    expect(page.locator("#now-playing")).to_have_text("Sample A")
    page.keyboard.press(" ")  # resumes A where it was
    page.wait_for_function("() => !wb.player.samples.get('A').audio.paused")
    page.keyboard.press("b")  # B takes over at A's position
    page.wait_for_function("() => !wb.player.samples.get('B').audio.paused")
    assert page.evaluate("() => wb.player.samples.get('A').audio.paused")
    assert page.evaluate(now, "B") >= paused_at
    expect(page.locator(".slot[data-slot='B'] .state")).to_have_text("playing a segment…")
    expect(page.locator(".slot[data-slot='B'] .state")).to_have_text("not played yet", timeout=15000)  # it ended
    expect(page.locator(".slot.played")).to_have_count(0)  # A interrupted, B from the middle: neither counts

    # a loop region: X repeats 1.0..1.4 s (two wraps seen) and never counts
    page.fill("#seg-from", "1")
    page.fill("#seg-to", "1.4")
    page.check("#loop")
    page.evaluate("""() => { window.seeks = 0;
        wb.player.samples.get('X').audio.addEventListener('seeked', () => window.seeks++); }""")
    page.keyboard.press("x")
    page.wait_for_function("() => window.seeks >= 3", timeout=15000)  # the start of the region, then two wraps
    assert 0.95 <= page.evaluate(now, "X") <= 1.7
    expect(page.locator(".slot[data-slot='X'] .state")).to_have_text("playing a segment…")
    page.keyboard.press(" ")
    expect(page.locator(".slot.played")).to_have_count(0)
    expect(page.locator("#submit-hint")).to_have_text("Play every sample to the end first.")

    page.fill("#seg-from", "")
    page.fill("#seg-to", "")
    page.click("#rewind")
    page.keyboard.press("a")  # the whole sample looped: its first pass from the start counts, it plays on
    expect(page.locator(".slot[data-slot='A']")).to_have_class("slot played", timeout=15000)
    page.wait_for_function("() => !wb.player.samples.get('A').audio.paused")
    page.keyboard.press(" ")
    page.uncheck("#loop")
    page.click("#rewind")  # B would take over where A paused: back to the start first
    for slot in "BX":  # whole plays from the start count
        page.click(f"button.play[data-slot='{slot}']")
        expect(page.locator(f".slot[data-slot='{slot}']")).to_have_class("slot played", timeout=15000)
    page.check("input[value='A']")
    page.click("#submit")
    answer_questionnaire(page)
    device.close()


def test_training_examples_come_first_the_questionnaire_last_and_the_owners_words_stay_as_written(
        setup, browser) -> None:
    """A test made over REST with a training page, in a Chinese browser: the owner's title, instructions and
    example labels (words the page's own table translates) stay as written, the page's own words are Chinese;
    the examples play before the first item, the questionnaire comes after the last, and raters.csv has it."""
    app, _, _ = setup
    expect = sync_api.expect
    store = TakeStore(app.env["COSYVOICE_DATA_DIR"])
    one = {t.label: t.id for t in store.takes() if t.provenance.get("text") == "one"}
    store.close()
    made = httpx.post(f"{app.url}/workbench/api/tests", cookies={"cv-browser": OWNER}, json={
        "kind": "ab", "items": [{"takes": [one["sysA"], one["sysB"]]}], "title": "Start", "instructions": "Excellent",
        "training": [{"take": one["sysA"], "label": "Excellent"}, {"take": one["sysB"], "label": "Bad"}]})
    assert made.status_code == 201, made.text
    test_id = made.json()["id"]
    refused = httpx.post(f"{app.url}/workbench/api/tests", cookies={"cv-browser": OWNER}, json={
        "kind": "ab", "items": [{"takes": [one["sysA"], one["sysB"]]}],
        "training": [{"take": "take-nope", "label": "x"}]})
    assert refused.status_code == 400 and "training example 1: no take" in refused.json()["error"]["message"]

    device = browser("zh-CN")
    page = device.new_page()
    page.goto(f"{app.url}/workbench/rate/{test_id}")
    page.wait_for_function("() => window.wb && window.wb.ready")
    expect(page.locator("#title")).to_have_text("Start")
    expect(page.locator("#instructions")).to_have_text("Excellent")
    assert page.title() == "Start" and page.inner_text("#start") == "开始"
    page.fill("#name", "小红")
    page.click("#start")
    expect(page.locator("#training h2")).to_have_text("示例")
    expect(page.locator("#training-examples b")).to_have_text(["Excellent", "Bad"])
    audio = page.evaluate("""async () => {
        const r = await fetch(document.querySelector("#training-examples audio").src);
        return [r.status, r.headers.get("content-type"), r.headers.get("etag"),
                (await r.arrayBuffer()).byteLength]; }""")
    assert audio[:3] == [200, "audio/wav", None] and audio[3] > 1000
    page.click("#begin")
    expect(page.locator("#item-progress")).to_have_text("第 1 项，共 1 项")
    answer_item(page, "A")
    expect(page.locator("#questionnaire h2")).to_have_text("最后两个问题")
    page.check("input[name=device][value='earbuds']")  # Send waits for the language too, saying so in Chinese
    expect(page.locator("#send-questionnaire")).to_be_disabled()
    expect(page.locator("#questionnaire-hint")).to_have_text("请选择您的收听设备并填写您的母语。")
    answer_questionnaire(page, "earbuds", "中文")
    expect(page.locator("#done h2")).to_have_text("谢谢！")
    device.close()
    rows = list(csv.DictReader(io.StringIO(httpx.get(f"{app.url}/workbench/api/tests/{test_id}/raters.csv",
                                                     cookies={"cv-browser": OWNER}).text)))
    assert [(r["rater"], r["answered"], r["total"], r["listening_device"], r["native_language"]) for r in rows] == \
        [("小红", "1", "1", "earbuds", "中文")]
