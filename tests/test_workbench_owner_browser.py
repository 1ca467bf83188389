"""The owner's workbench page in a real browser (Debian's chromium via Playwright) against the REST server as a
real process on loopback without keys (a laptop): the batch CLI's takes reach the page and its conditions; a
failed "Create test" says why beside its button, in place of the success before it; a batch whose server is
killed with ``kill -9`` mid-way is shown as interrupted (while the server is away the page says so, never
"Failed to fetch"), and resumed from the page to its end."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from browser import FLAGS, require_browser

sync_api, CHROMIUM = require_browser()

from test_workbench_browser import ARTIFACTS, REPO, App  # noqa: E402
from test_workbench_screening import screened_test  # noqa: E402
from waiting import until_ready  # noqa: E402

from cosyvoice.takes.store import TakeStore  # noqa: E402

expect = sync_api.expect
TRANSCRIPT = "A short test prompt."


@pytest.fixture(scope="module")
def app(tiny_bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory, short_prompt_wav: Path) -> Iterator[App]:
    served = App(tiny_bundle_dir, tmp_path_factory.mktemp("owner-browser"))
    until_ready(served.proc, served.url)  # the model loaded (its pages and lists answer before)
    saved = httpx.post(f"{served.url}/v1/voices", data={"name": "Narrator", "transcript": TRANSCRIPT},
                       files={"audio": ("a.wav", short_prompt_wav.read_bytes(), "audio/wav")}, timeout=60)
    assert saved.status_code == 201, saved.text
    batch_cli_takes(served, tiny_bundle_dir, tmp_path_factory.mktemp("cli"))
    yield served
    served.stop()


def batch_cli_takes(app: App, tiny_bundle_dir: Path, work: Path) -> None:
    """README step 1: the batch CLI, as another process, writes two takes (conditions cliA and cliB) into the
    server's data folder; every test of the page starts from them."""
    rows = work / "rows.csv"
    rows.write_text("text,voice,seed,label\n"
                    "Good morning to you.,Narrator,1,cliA\nGood morning to you.,Narrator,2,cliB\n")
    root = Path(app.env["COSYVOICE_DATA_DIR"]).parent
    made = subprocess.run([sys.executable, "-m", "cosyvoice.tools.batch", str(rows), "--out", str(work / "out"),
                           "--model-dir", str(tiny_bundle_dir), "--voice-dir", str(root / "voices"),
                           "--data-dir", str(root / "data"), "--device", "cpu"],
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """``browser()``: a fresh browser profile, i.e. another visitor (its own cv-browser identity, from the page)."""
    with sync_api.sync_playwright() as playwright:
        yield lambda: playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("profile")), executable_path=str(CHROMIUM), headless=True, args=FLAGS,
            viewport={"width": 1280, "height": 900}, locale="en-US")


@pytest.fixture(scope="module")
def page(app: App, browser) -> Iterator:
    """The owner page in one browser."""
    context = browser()
    opened = context.new_page()
    opened.on("dialog", lambda dialog: dialog.accept())
    yield opened
    context.close()


def open_owner_page(page, app: App) -> None:
    page.goto(f"{app.url}/workbench/")
    page.wait_for_function("() => window.wb && window.wb.ready")


def test_the_batch_clis_takes_reach_the_workbench_of_a_keyless_local_server(app: App, page) -> None:
    """README step 2, after the CLI's run (the ``app`` fixture): the browser lists the CLI's takes."""
    open_owner_page(page, app)
    expect(page.locator("#takes tr")).to_have_count(2)
    expect(page.locator("#takes")).to_contain_text("Good morning to you.")
    expect(page.locator("#conditions input")).to_have_count(2)
    assert page.locator("#conditions input").evaluate_all("boxes => boxes.map(b => b.value)") == ["cliA", "cliB"]
    expect(page.locator("#machine-note")).to_be_hidden()  # nothing to explain: this server shows them


def test_a_failed_create_shows_its_error_beside_the_button(app: App, page) -> None:
    open_owner_page(page, app)
    page.select_option("#kind", "ab")
    page.check("#conditions input[value='cliA']")
    page.check("#conditions input[value='cliB']")
    page.click("#create-test")
    status = page.locator("#create-status")
    expect(status).to_contain_text("Created with 1 items")
    page.uncheck("#conditions input[value='cliB']")  # one condition: an A/B test needs two
    page.click("#create-test")
    expect(status).to_contain_text("choose two or more conditions")
    expect(status).not_to_contain_text("Created")  # the old success is gone
    assert status.get_attribute("class") == "error"
    button, said = page.locator("#create-test").bounding_box(), status.bounding_box()
    assert 0 <= said["y"] - (button["y"] + button["height"]) < 40, (button, said)  # right under the button
    assert said["y"] + said["height"] <= 900 + page.evaluate("scrollY")  # and on screen


def test_a_batch_killed_with_kill_9_is_shown_interrupted_and_resumed_from_the_page(app: App, page) -> None:
    open_owner_page(page, app)
    page.fill("#grid-texts", "\n".join(f"Sentence number {i} is spoken here." for i in range(1, 31)))
    page.fill("#grid-voices", "Narrator")
    page.click("#grid-run")
    row = page.locator("#batches tr").first
    expect(row).to_have_attribute("data-state", "running", timeout=60000)
    page.wait_for_function("() => document.querySelector('#batches tr progress').value >= 2", timeout=120000)

    app.stop()  # kill -9: the page keeps asking, and says the server does not answer
    expect(page.locator("#batch-status")).to_contain_text("The server does not answer", timeout=15000)
    app.start()
    expect(page.locator("#batch-status")).to_be_empty(timeout=30000)
    expect(row).to_have_attribute("data-state", "interrupted")
    expect(row.locator(".state")).to_have_text("interrupted: its server stopped")
    assert "s left" not in row.inner_text()  # no frozen ETA

    until_ready(app.proc, app.url)
    page.reload()  # after a reload the batch is still listed, with its Resume button
    page.wait_for_function("() => window.wb && window.wb.ready")
    row = page.locator("#batches tr").first
    row.locator("button.batch-resume").click()
    expect(row).to_have_attribute("data-state", "done", timeout=240000)
    expect(row).to_contain_text("30 of 30 rows")
    batch = row.get_attribute("data-batch")
    takes = httpx.get(f"{app.url}/workbench/api/takes", params={"batch": batch},
                      cookies={"cv-browser": page.context.cookies()[0]["value"]}).json()["takes"]
    assert sorted(t["row"] for t in takes) == list(range(1, 31))  # each row once: none lost, none made twice


def test_another_visitors_results_link_says_there_is_no_such_test(app: App, page, browser) -> None:
    """Not an empty results skeleton with a red line: a plain message, and no tables."""
    open_owner_page(page, app)
    results = page.locator("#tests a", has_text="results").first.get_attribute("href")
    other = browser()
    stranger = other.new_page()
    stranger.goto(app.url + results)
    stranger.wait_for_function("() => window.wbReady")
    expect(stranger.locator("#title")).to_have_text("No such test")
    expect(stranger.locator("#error")).to_contain_text("belongs to another visitor")
    expect(stranger.locator("#results")).to_be_hidden()
    other.close()


def test_the_takes_fit_a_laptop_and_a_phone_with_whole_players_and_long_texts_folded(app: App, page) -> None:
    """A 1,000-character take takes three lines until clicked, and every player keeps room for its play button
    (it was squeezed to 62 px), at 1,280 px and at 390 px (a phone: each take a small card)."""
    store = TakeStore(app.env["COSYVOICE_DATA_DIR"])
    long_text = "A very long take. " * 55  # 990 characters
    store.add_take((0.2 * np.sin(np.arange(2400) / 5)).astype(np.float32), 24000,
                   {"text": long_text, "segments": [long_text]}, label="cliA")  # the CLI's: this page shows it
    store.close()
    for width in (1280, 390):
        page.set_viewport_size({"width": width, "height": 844})
        open_owner_page(page, app)
        text = page.locator("#takes tr").first.locator("td.text")
        expect(text).to_contain_text("A very long take.")
        assert text.bounding_box()["height"] < 90, text.bounding_box()  # three lines
        players = page.locator("#takes audio").evaluate_all("all => all.map(a => a.getBoundingClientRect().width)")
        assert players and min(players) >= 150, players
        wide = page.evaluate("""(width) => [...document.querySelectorAll("body *")].filter(e =>
            e.getBoundingClientRect().right > width + 0.5).map(e => `${e.tagName}#${e.id}.${e.className}`)""", width)
        assert page.evaluate("() => document.documentElement.scrollWidth") <= width, wide
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"workbench-owner-{width}.png"), full_page=True)
    text.click()  # the whole text, on request
    assert text.bounding_box()["height"] > 300


def test_the_results_show_each_raters_screening_and_leave_the_flagged_out_on_request(app: App, page) -> None:
    """Five raters of a MUSHRA test (the CLI's, shown on this laptop server): a straight-liner, one who rates the
    hidden reference low and one who rates the anchor high are flagged; the statistics change when asked."""
    store = TakeStore(app.env["COSYVOICE_DATA_DIR"])
    test_id = screened_test(store, None)
    store.close()
    page.set_viewport_size({"width": 1280, "height": 900})
    page.goto(f"{app.url}/workbench/tests/{test_id}")
    page.wait_for_function("() => window.wbReady")
    expect(page.locator("#raters tr")).to_have_count(5)
    flags = dict(zip(page.locator("#raters tr td:first-child").all_inner_texts(),
                     page.locator("#raters td.flags").all_inner_texts(), strict=True))
    assert flags["Ann"] == flags["Bob"] == "accepted", flags
    assert "vary too little" in flags["Cy"] and "hidden reference below 90" in flags["Di"], flags
    assert "mid anchor above 90" in flags["Eve"], flags
    expect(page.locator("#screening-note")).to_have_text("3 of 5 raters flagged")
    mean = page.locator("#summary tr", has_text="sysA").locator("td").nth(1)
    expect(mean).to_have_text("80.00")  # every rater
    page.check("#exclude-flagged")
    expect(mean).to_have_text("75.00")  # Ann and Bob only
    page.screenshot(path=str(ARTIFACTS / "workbench-results-screened.png"), full_page=True)


def test_a_test_is_closed_from_the_page_and_its_design_imported_again(app: App, page, tmp_path: Path) -> None:
    open_owner_page(page, app)
    row = page.locator("#tests tr").first
    row.locator("button.close-test").click()
    expect(row).to_contain_text("closed")
    expect(row.locator("button.close-test")).to_have_text("Open again")
    design = httpx.get(app.url + row.locator("a", has_text="design").get_attribute("href"),
                       cookies={"cv-browser": page.context.cookies()[0]["value"]})
    assert design.status_code == 200, design.text
    (tmp_path / "design.json").write_bytes(design.content)
    page.set_input_files("#design-file", str(tmp_path / "design.json"))
    expect(page.locator("#create-status")).to_contain_text(f"Created with {len(design.json()['items'])} items")
    (tmp_path / "broken.json").write_text("{not json")
    page.set_input_files("#design-file", str(tmp_path / "broken.json"))
    expect(page.locator("#create-status")).to_contain_text("broken.json is not JSON")


def test_the_chinese_page_keeps_users_words_that_read_like_its_own(app: App, page) -> None:
    """The translator leaves user data alone: a test named "Create test" stays so beside the translated button."""
    made = httpx.post(f"{app.url}/workbench/api/tests", cookies={"cv-browser": page.context.cookies()[0]["value"]},
                      json={"kind": "ab", "conditions": ["cliA", "cliB"], "name": "Create test"})
    assert made.status_code == 201, made.text
    page.goto(f"{app.url}/workbench/?lang=zh")
    page.wait_for_function("() => window.wb && window.wb.ready")
    expect(page.locator("#create-test")).to_have_text("创建测试")
    expect(page.locator("#tests tr").last.locator("td").first).to_have_text("Create test")
    expect(page.locator("#tests tr").last.locator("td").nth(1)).to_have_text("A/B 偏好")  # the kind, in words
