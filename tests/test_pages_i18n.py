"""The workbench, rater, results and long-form pages in Chinese for a Chinese browser (as the studio is), in a real
chromium on the web UI's app: every word of the pages' own is translated, numbers included; an English browser
keeps them as written."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gradio", reason="the web UI needs the 'ui' extra")
from browser import FLAGS, require_browser

sync_api, CHROMIUM = require_browser()

from test_webui import make_studio, serving  # noqa: E402

from cosyvoice.settings import default_data_dir  # noqa: E402
from cosyvoice.takes.store import TakeStore  # noqa: E402
from cosyvoice.workbench import listening  # noqa: E402

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
# what stays as it is in any language: names, units, formats, file names, the test's data
KEPT = re.compile(r"^(CosyVoice3 Studio|MUSHRA|ACX|RMS dB|wav|mp3|flac|opus|m4b|mp4|takes\.csv|subtitles\.(srt|vtt)|"
                  r"segments\.json|text,voice,mode,instruction,seed,speed,steps,precision,label|"
                  r"voice|steps|precision|label|en-allison, fr-june|"
                  r"# Title|\[pause:1\.5s\]|Alice: line|Alice \(whispering\): line|Alice = voice name|sysA|sysB|"
                  r"one|A|B|X|ref|take-\w+|test-\w+|[A-Z_]+ test|ab|abx|mos|cmos|mushra|mushra_noref|"
                  r"[\d.,:/ ()·%–-]+|http\S+)$")


OWNER = "d" * 32  # the browser (cv-browser id) whose test it is


@pytest.fixture(scope="module")
def app(tts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    root = tmp_path_factory.mktemp("i18n")
    studio = make_studio(tts, root)
    store = TakeStore(default_data_dir(studio.service.voices.dir.parent))
    t = np.arange(7200) / 24000
    a, b = (store.add_take((0.2 * np.sin(2 * np.pi * f * t)).astype(np.float32), 24000, {"text": "one"}, label=label)
            for f, label in ((220, "sysA"), (330, "sysB")))
    test_id = listening.create_test(store, "mushra_noref", [{"takes": [a.id, b.id]}], owner=f"browser:{OWNER}")
    with serving(studio) as url:
        yield url, test_id


def untranslated(page) -> list[str]:
    """Visible texts, placeholders and titles of the page that are still English."""
    texts = page.evaluate("""() => {
        const out = [];
        const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
        for (let n = walker.nextNode(); n; n = walker.nextNode()) {
            const el = n.parentElement;
            if (!el || ["SCRIPT", "STYLE"].includes(el.nodeName) || !el.getClientRects().length) continue;
            if (getComputedStyle(el).visibility === "hidden") continue;
            out.push(n.data.trim());
        }
        for (const el of document.querySelectorAll("[placeholder], [title]")) {
            if (el.getClientRects().length) out.push(el.getAttribute("placeholder") || el.getAttribute("title"));
        }
        return out.filter(Boolean);
    }""")
    return [t for t in texts if re.search(r"[A-Za-z]{2,}", t) and not re.search(r"[\u3000-\u9fff\uff00-\uffef]", t)
            and not KEPT.match(t)]


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    with sync_api.sync_playwright() as playwright:
        yield lambda locale: playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=str(CHROMIUM), headless=True,
            args=FLAGS, viewport={"width": 1280, "height": 900}, locale=locale)


def test_a_chinese_browser_gets_every_page_in_chinese(app, browser) -> None:
    url, test_id = app
    ARTIFACTS.mkdir(exist_ok=True)
    context = browser("zh-CN")
    context.add_cookies([{"name": "cv-browser", "value": OWNER, "url": url}])  # the test's owner (its results page)
    page = context.new_page()
    page.goto(f"{url}workbench/rate/{test_id}")
    page.wait_for_function("() => window.wb && window.wb.ready")
    assert page.inner_text("#start") == "开始" and page.title() == "听音测试"
    assert untranslated(page) == []
    page.fill("#name", "小明")
    page.click("#start")
    sync_api.expect(page.locator("#begin")).to_have_text("开始第一项")
    assert untranslated(page) == []
    page.click("#begin")
    sync_api.expect(page.locator("#item-progress")).to_have_text("第 1 项，共 1 项")
    sync_api.expect(page.locator(".mushra .scale span")).to_have_text(["劣", "差", "中", "良", "优"])
    assert page.locator(".mushra .value").first.inner_text() == "未评分"
    assert untranslated(page) == []
    page.screenshot(path=str(ARTIFACTS / "zh-rater.png"), full_page=True)
    for button in page.locator("button.play").all():  # the item played, rated and saved: the questionnaire
        button.click()
        sync_api.expect(page.locator(f".slot[data-slot='{button.get_attribute('data-slot')}']")).to_have_class(
            "slot played", timeout=15000)
    assert untranslated(page) == []  # the states after playing ("✓ played to the end", the position)
    for value in page.locator(".mushra .value").all():
        value.click()
    page.click("#submit")
    sync_api.expect(page.locator("#questionnaire")).to_be_visible()
    assert untranslated(page) == []
    page.check("input[name=device][value='headphones']")
    page.fill("#native-language", "中文")
    page.click("#send-questionnaire")
    sync_api.expect(page.locator("#done")).to_be_visible()
    assert untranslated(page) == []

    for path, ready, heading in (("workbench/", "() => window.wb && window.wb.ready", "听音测试工作台"),
                                 (f"workbench/tests/{test_id}", "() => window.wbReady", "汇总"),
                                 ("studio/longform", "() => window.longformReady === true", "长文本项目")):
        page.goto(url + path)
        page.wait_for_function(ready)
        assert heading in page.inner_text("body")
        left = untranslated(page)
        assert left == [], (path, left)
        page.screenshot(path=str(ARTIFACTS / f"zh-{path.split('/')[0] or 'page'}-{len(path)}.png"), full_page=True)
    context.close()

    english = browser("en-US").new_page()
    english.goto(f"{url}workbench/rate/{test_id}")
    english.wait_for_function("() => window.wb && window.wb.ready")
    assert english.inner_text("#start") == "Start" and english.title() == "Listening test"


def test_every_standard_instruction_has_its_chinese() -> None:
    table = (Path(listening.__file__).with_name("static") / "i18n.js").read_text(encoding="utf-8")
    missing = [kind for kind, text in listening.DEFAULT_INSTRUCTIONS.items() if f'"{text}":' not in table]
    assert missing == []
