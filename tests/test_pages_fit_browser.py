"""The workbench, rater, results and long-form pages at 1,280 px (a laptop) with realistic content, in Debian's
chromium: nothing is wider than the window, no player, table or control sticks out of its card, and counts read as
whole numbers; and a MUSHRA item finished on a 390 px phone. Full-page screenshots go to ``test-artifacts/`` (kept
by CI, ignored by git) for a person to look at; ``docs/screenshots/`` holds copies of them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from waiting import until

pytest.importorskip("gradio", reason="the web UI needs the 'ui' extra")
from browser import FLAGS, require_browser

sync_api, CHROMIUM = require_browser()

from test_webui import make_studio, serving  # noqa: E402

from cosyvoice.workbench import listening  # noqa: E402

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
WIDTH = 1280
OWNER = "d" * 32  # the experimenter's browser (its cv-browser id): the takes, tests and project are its own
SECONDS = 0.6  # each stimulus
TEXTS = ["The quick brown fox jumps over the lazy dog on the riverbank, just before the morning rain begins.",
         "今天天气很好，我们一起去公园散步，顺便买一点新鲜的水果回家吧。",
         "Chapter 12 costs $1,280.50 in total; call 555-0134 before 9:30 am on 3 June.",
         "Short one."]
CONDITIONS = ("sysA", "sysB", "anchor")
BOOK = ("# The Beginning\n\nHi there. It was a bright cold day in April, and the clocks were striking thirteen.\n\n"
        "Good day to you.\n\n# The End\n\nBye now.")
# What sticks out: the page wider than the window, or an element of a card (section) beyond its card's edges.
OVERFLOWS = """() => {
  const out = [];
  const page = document.documentElement;
  if (page.scrollWidth > page.clientWidth) out.push(`page ${page.scrollWidth} px wide, window ${page.clientWidth} px`);
  const name = (e) => e.tagName.toLowerCase() + (e.id ? "#" + e.id : "") +
    (typeof e.className === "string" && e.className.trim() ? "." + e.className.trim().split(/\\s+/).join(".") : "");
  const inner = "audio, table, svg, select, input, textarea, button, progress, label, .slot";
  for (const card of document.querySelectorAll("section, .card")) {
    const box = card.getBoundingClientRect();
    if (!box.width) continue;  // hidden
    for (const e of card.querySelectorAll(inner)) {
      const r = e.getBoundingClientRect();
      if (r.width && (r.right > box.right + 0.5 || r.left < box.left - 0.5)) {
        out.push(`${name(e)} spans ${Math.round(r.left)}..${Math.round(r.right)} in ${name(card)} ` +
                 `${Math.round(box.left)}..${Math.round(box.right)}`);
      }
    }
  }
  return out;
}"""


@pytest.fixture(scope="module")
def app(tts, tmp_path_factory: pytest.TempPathFactory, short_prompt_wav: Path) -> Iterator[tuple[str, str, str]]:
    """The web UI's app (workbench and long-form mounted) over a store with takes of three conditions, a MUSHRA
    test two raters have finished, an A/B test, and a long-form project; yields (url, MUSHRA test, project)."""
    studio = make_studio(tts, tmp_path_factory.mktemp("pages-fit"), builtin_prompt=short_prompt_wav)
    store = studio.store
    t = np.arange(int(24000 * SECONDS)) / 24000
    for k, text in enumerate(TEXTS):
        for j, label in enumerate(CONDITIONS):
            pcm = (0.2 * np.sin(2 * np.pi * (220 + 40 * k + 110 * j) * t)).astype(np.float32)
            store.add_take(pcm, 24000, {"text": text, "segments": [text], "voice": "Narrator", "mode": "zero_shot",
                                        "seed": 1000 + k}, label=label, owner=f"browser:{OWNER}")
    mushra = listening.create_test(store, "mushra", listening.design("mushra", store.takes(), list(CONDITIONS),
                                                                     reference="sysA", anchor="anchor"),
                                   name="MUSHRA sysA vs sysB (lowpass anchor)", title="Voice quality",
                                   owner=f"browser:{OWNER}")
    wall, now = store.clock, store.clock()
    store.clock = lambda: now  # the raters' plays take their time on the store's clock, not the test's
    for rater_name, shift in (("Ann", 0), ("Bob", 7)):
        rater = listening.join(store, mushra, rater_name)
        for position, entry in enumerate(rater.plan):
            slots = [s["slot"] for s in entry["slots"]]
            for slot in slots:  # every sample played through (the plays overlap: one wait covers them all)
                listening.record_play(store, rater, position, slot, "play")
            now += SECONDS
            for slot in slots:
                listening.record_play(store, rater, position, slot, "ended")
            scores = {s["slot"]: {"hidden_reference": 95, "anchor": 20}.get(s["role"], 60 + shift + position)
                      for s in entry["slots"] if s["role"] != "reference"}
            listening.submit(store, rater, position, {"scores": scores})
    store.clock = wall
    listening.create_test(store, "ab", listening.design("ab", store.takes(), ["sysA", "sysB"]),
                          name="AB sysA vs sysB", title="Which sounds better?", owner=f"browser:{OWNER}")
    with serving(studio) as url:
        yield url, mushra, book(url)


def book(url: str) -> str:
    """A long-form project of the experimenter's, made over the API and generated: two chapters, each segment
    with a take, the first with two (its row offers the choice). Returns its id."""
    # a new connection per call: no kept-alive connection the server may close just as it is reused
    with httpx.Client(base_url=f"{url}v1/longform", cookies={"cv-browser": OWNER}, timeout=60,
                      limits=httpx.Limits(max_keepalive_connections=0)) as api:
        narrator = next(v["id"] for v in api.get("/voices").json() if v["builtin"])
        created = api.post("/projects", json={"name": "A short book", "text": BOOK, "voice": narrator,
                                              "preset": "podcast"})
        assert created.status_code == 201, created.text
        project = created.json()
        detail = f"/projects/{project['id']}"

        def made(takes: int) -> None:
            """Wait until the job is over and the first segment has ``takes`` takes (the others one each)."""
            def done() -> bool:
                now = api.get(detail).json()
                return not now["progress"]["running"] and [len(s["takes"]) for s in now["segments"]] == \
                    [takes] + [1] * (len(now["segments"]) - 1)

            until(done, 300, f"the render of {takes} take(s)")

        assert api.post(f"{detail}/generate", json={}).is_success
        made(1)
        assert api.post(f"{detail}/segments/{project['segments'][0]['id']}/regenerate").is_success
        made(2)
    return project["id"]


@pytest.fixture(scope="module", params=["en-US", "zh-CN"])
def context(app: tuple, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """The experimenter's browser, English or Chinese (the words' widths differ)."""
    url = app[0]
    with sync_api.sync_playwright() as playwright:
        ctx = playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=str(CHROMIUM), headless=True,
            args=FLAGS, viewport={"width": WIDTH, "height": 800}, locale=request.param)
        ctx.add_cookies([{"name": "cv-browser", "value": OWNER, "url": url}])
        yield ctx
        ctx.close()


def fits(page, name: str) -> None:
    """Nothing sticks out at 1,280 px; the full page is kept as a screenshot."""
    ARTIFACTS.mkdir(exist_ok=True)
    lang = page.evaluate("() => window.wbLang")
    page.screenshot(path=str(ARTIFACTS / f"fit-1280-{name}-{lang}.png"), full_page=True)
    assert page.evaluate(OVERFLOWS) == []


def test_the_workbench_fits(app: tuple, context) -> None:
    url, _, _ = app
    page = context.new_page()
    page.goto(f"{url}workbench/")
    page.wait_for_function("() => window.wb && window.wb.ready")
    sync_api.expect(page.locator("#tests tr")).to_have_count(2)
    page.wait_for_function(f"() => document.querySelectorAll('#takes tr').length > {len(TEXTS) * len(CONDITIONS)}")
    labels = page.locator("#takes tr td:nth-child(2)").all_inner_texts()
    # the batch's takes, and the long-form project's (one take store: they are workbench takes, labelled by project)
    assert sorted(set(labels)) == sorted({*CONDITIONS, "A short book"}), labels
    assert sum(label in CONDITIONS for label in labels) == len(TEXTS) * len(CONDITIONS), labels
    fits(page, "workbench")
    page.close()


def test_the_rater_page_fits_during_a_mushra_item(app: tuple, context) -> None:
    url, mushra, _ = app
    page = context.new_page()
    page.goto(f"{url}workbench/rate/{mushra}")
    page.wait_for_function("() => window.wb && window.wb.ready")
    page.fill("#name", "Cleo" if page.evaluate("() => window.wbLang") == "en" else "小明")
    page.click("#start")
    sync_api.expect(page.locator("#ready")).to_be_visible()  # the personal link, before the first item
    assert page.evaluate(OVERFLOWS) == []
    page.click("#begin")
    sync_api.expect(page.locator("#rating")).to_be_visible()
    sync_api.expect(page.locator("#controls input[type=range]")).to_have_count(3)  # hidden reference, two more
    sync_api.expect(page.locator("#rater-name")).not_to_be_empty()
    fits(page, "rater")
    page.close()


def test_the_results_page_and_its_scorecard_fit_with_counts_as_whole_numbers(app: tuple, context) -> None:
    url, mushra, _ = app
    page = context.new_page()
    page.goto(f"{url}workbench/tests/{mushra}")
    page.wait_for_function("() => window.wbReady")
    sync_api.expect(page.locator("#raters tr").nth(1)).to_be_visible()  # Ann and Bob (and the rater tests' own)
    page.click("#scorecard-run")
    sync_api.expect(page.locator("#scorecard table tbody tr")).to_have_count(len(CONDITIONS), timeout=120_000)
    counts = page.locator("#scorecard td:nth-child(2)").all_inner_texts()
    assert counts == [str(len(TEXTS))] * len(CONDITIONS), counts
    ratings = page.locator("#summary td:nth-child(4), #per-rater td:nth-child(4)").all_inner_texts()  # n
    assert ratings and all(re.fullmatch(r"\d+", n) for n in ratings), ratings  # a count never reads "3.000"
    fits(page, "results")
    page.close()


def test_the_long_form_page_fits_with_a_project_open(app: tuple, context) -> None:
    url, _, project = app
    page = context.new_page()
    page.goto(f"{url}studio/longform?project={project}")
    page.wait_for_function("(id) => window.longformReady === true && current && current.id === id", arg=project)
    segments = page.evaluate("() => current.segments.length")
    sync_api.expect(page.locator("#segments audio")).to_have_count(segments)
    sync_api.expect(page.locator("#segments select.takes").first.locator("option")).to_have_count(3)
    fits(page, "longform")
    page.close()


PHONE = {"width": 390, "height": 844}
# A MUSHRA row on a phone: the slider's width, the scale labels' (do they fit, do they overlap, their font size),
# and how far each sample's Play button is from its own slider.
MUSHRA_LAYOUT = """() => {
  const spans = [...document.querySelectorAll(".mushra .scale span")].map(s => s.getBoundingClientRect());
  const labels = [...document.querySelectorAll(".mushra .scale span")];
  return {
    sliders: [...document.querySelectorAll(".mushra input[type=range]")].map(s => s.getBoundingClientRect().width),
    labelsFit: labels.every(s => s.scrollWidth <= s.clientWidth + 0.5),
    labelsApart: spans.every((r, i) => i === 0 || r.left >= spans[i - 1].right - 0.5),
    labelPx: Math.min(...labels.map(s => parseFloat(getComputedStyle(s).fontSize))),
    gaps: [...document.querySelectorAll(".mushra-row:not(.legend)")].map(row => {
      const button = row.querySelector("button.play").getBoundingClientRect();
      const slider = row.querySelector("input[type=range]").getBoundingClientRect();
      return Math.max(0, slider.top - button.bottom, button.top - slider.bottom);
    }),
  };
}"""


def test_a_mushra_item_is_finished_on_a_phone(app: tuple, context) -> None:
    """At 390 px the sliders take the width, the scale labels stay apart and readable, each Play button sits right
    above its slider, nothing sticks out; a rater plays every sample, rates with a click on each slider and saves."""
    url, mushra, _ = app
    expect = sync_api.expect
    page = context.new_page()
    page.set_viewport_size(PHONE)
    page.goto(f"{url}workbench/rate/{mushra}")
    page.evaluate("() => localStorage.clear()")  # a new rater, not the one this browser started before
    page.goto(f"{url}workbench/rate/{mushra}")
    page.wait_for_function("() => window.wb && window.wb.ready")
    lang = page.evaluate("() => window.wbLang")
    page.fill("#name", f"Phone {lang}")
    page.click("#start")
    sync_api.expect(page.locator("#ready")).to_be_visible()
    assert page.evaluate(OVERFLOWS) == []  # the personal link and its Copy button fit the phone too
    page.click("#begin")
    expect(page.locator("#controls input[type=range]")).to_have_count(3)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"fit-390-rater-{lang}.png"), full_page=True)
    layout = page.evaluate(MUSHRA_LAYOUT)
    assert min(layout["sliders"]) >= 0.75 * (PHONE["width"] - 40), layout  # was ~45 px
    assert layout["labelsFit"] and layout["labelsApart"] and layout["labelPx"] >= 12, layout
    assert max(layout["gaps"]) <= 32, layout  # each Play button right by its own slider
    assert page.evaluate(OVERFLOWS) == []
    for button in page.locator("button.play").all():
        slot = button.get_attribute("data-slot")
        button.click()
        expect(page.locator(f".slot[data-slot='{slot}']")).to_have_class("slot played", timeout=15000)
    for k, slider in enumerate(page.locator("#controls input[type=range]").all()):
        box = slider.bounding_box()
        slider.click(position={"x": box["width"] * (0.3 + 0.3 * k), "y": box["height"] / 2})
    expect(page.locator(".mushra .value.untouched")).to_have_count(0)
    assert page.evaluate(OVERFLOWS) == []
    page.click("#submit")
    expect(page.locator("#item-progress")).to_have_text("Item 2 of 4" if lang == "en" else "第 2 项，共 4 项")
    page.close()
