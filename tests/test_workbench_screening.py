"""Rater screening (cosyvoice/workbench/screening.py) on a real store and over the REST API: a MUSHRA test with a
straight-lining rater, one who rates the hidden reference low and one who rates the anchor high is flagged rule by
rule; the statistics without the flagged raters equal the hand values; answers.csv carries every rater's flags."""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

import numpy as np
import pytest
from starlette.testclient import TestClient

from cosyvoice.owners import ANONYMOUS
from cosyvoice.server.rest import create_app
from cosyvoice.settings import ServerSettings, default_data_dir
from cosyvoice.takes.store import TakeStore
from cosyvoice.workbench import listening, screening

TEXTS = ("one", "two", "three", "four")
T_975_7 = 2.364624251592785  # Student t, 97.5 % quantile, 7 degrees of freedom (8 scores per condition)


def rating(item: int, name: str) -> dict[str, float]:
    """What each rater gives the item's samples, by condition."""
    good = {"Ann": {"hidden reference": 100, "sysA": 80, "sysB": 60, "anchor": 30},
            "Bob": {"hidden reference": 95, "sysA": 70, "sysB": 50, "anchor": 20}}
    if name in good:
        return good[name]
    if name == "Cy":  # straight-lining, at a value no BS.1534 rule catches
        return dict.fromkeys(("hidden reference", "sysA", "sysB", "anchor"), 90)
    if name == "Di":  # the hidden reference below 90 on 2 of 4 items
        return {"hidden reference": 60 if item < 2 else 100, "sysA": 75, "sysB": 55, "anchor": 25}
    return {"hidden reference": 100, "sysA": 85, "sysB": 65, "anchor": 95 if item == 0 else 20}  # Eve


def screened_test(store: TakeStore, owner: str | None) -> str:
    """A MUSHRA test of ``owner``'s, answered by the five raters of :func:`rating`."""
    pcm = (0.2 * np.sin(np.arange(6000) / 5)).astype(np.float32)  # 0.25 s: played through at once
    for text in TEXTS:
        for label in ("ref", "sysA", "sysB", "anchor"):
            store.add_take(pcm, 24000, {"text": text}, label=label, owner=owner)
    items = listening.design("mushra", store.takes(owner=owner, any_owner=False), ["sysA", "sysB"],
                             reference="ref", anchor="anchor")
    made = listening.create_test(store, "mushra", items, owner=owner)
    for name in ("Ann", "Bob", "Cy", "Di", "Eve"):
        rater = listening.join(store, made, name)
        for position, entry in enumerate(rater.plan):
            rated = [s for s in entry["slots"] if s["role"] != "reference"]
            for s in entry["slots"]:
                for event in ("play", "ended"):
                    listening.record_play(store, rater, position, s["slot"], event)
            given = rating(entry["item"], name)
            scores = {s["slot"]: given[s["role"].replace("_", " ") if s["role"] != "stimulus"
                                       else store.take(s["take"]).label] for s in rated}
            listening.submit(store, rater, position, {"scores": scores})
    return made


@pytest.fixture()
def test_id(tmp_path: Path) -> str:
    """The test, owned by a keyless client without a cookie."""
    store = TakeStore(default_data_dir(tmp_path / "voices"))
    made = screened_test(store, ANONYMOUS)
    store.close()
    return made


def ci_half(values: list[float]) -> float:
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return T_975_7 * sd / math.sqrt(len(values))


def test_flagged_raters_are_excluded_on_request_and_the_statistics_equal_the_hand_values(test_id: str,
                                                                                         tmp_path: Path) -> None:
    with TestClient(create_app(ServerSettings(voice_dir=str(tmp_path / "voices"), sharing="private"))) as client:
        results = client.get(f"/workbench/api/tests/{test_id}/results").json()
        answers = client.get(f"/workbench/api/tests/{test_id}/answers.csv")
    flags = {r["rater"]: r["flags"] for r in results["screening"]["raters"]}
    assert flags == {"Ann": [], "Bob": [], "Cy": ["straight_lining"], "Di": ["hidden_reference"], "Eve": ["anchor"]}
    cy = next(r for r in results["screening"]["raters"] if r["rater"] == "Cy")
    assert cy["variance"] == 0 and cy["hidden_reference_misses"] == 0 and not cy["accepted"]
    di = next(r for r in results["screening"]["raters"] if r["rater"] == "Di")
    assert di["hidden_reference_misses"] == 0.5 and di["variance"] > screening.VARIANCE_MIN

    everyone = {c["condition"]: c for c in results["summary"]["conditions"]}
    assert everyone["sysA"]["mean"] == pytest.approx((80 + 70 + 90 + 75 + 85) / 5) and everyone["sysA"]["n"] == 20
    accepted = {c["condition"]: c for c in results["screened_summary"]["conditions"]}
    assert {c: (v["mean"], v["n"]) for c, v in accepted.items()} == {
        "anchor": (25, 8), "hidden reference": (97.5, 8), "sysA": (75, 8), "sysB": (55, 8)}
    half = ci_half([80] * 4 + [70] * 4)  # 4.469
    assert (accepted["sysA"]["low"], accepted["sysA"]["high"]) == pytest.approx((75 - half, 75 + half))
    assert {r["rater"] for r in results["screened_summary"]["per_rater"]} == {"Ann", "Bob"}

    rows = list(csv.DictReader(io.StringIO(answers.text)))
    assert len(rows) == 5 * 4 * 4  # raters x items x rated samples
    by_rater = {r["rater"]: (r["rater_flags"], r["rater_accepted"]) for r in rows}
    assert by_rater == {"Ann": ("", "1"), "Bob": ("", "1"), "Cy": ("straight_lining", "0"),
                        "Di": ("hidden_reference", "0"), "Eve": ("anchor", "0")}


def test_gold_items_incomplete_sessions_and_choices_are_screened(tmp_path: Path) -> None:
    """P.808's gold and per-rater gates on a MOS test with an attention check: a failed check flags, an unfinished
    session flags; A/B answers (choices) are never called straight-lining."""
    rows = [{"rater_id": "r1", "answer_condition": "sysA", "score": 4, "check": "", "check_failed": ""},
            {"rater_id": "r1", "answer_condition": "sysB", "score": 2, "check": "", "check_failed": ""},
            {"rater_id": "r1", "answer_condition": "bad", "score": 4, "check": "max=2", "check_failed": 1},
            {"rater_id": "r2", "answer_condition": "sysA", "score": 3, "check": "", "check_failed": ""}]
    progress = [{"rater": "One", "rater_id": "r1", "answered": 3, "total": 3},
                {"rater": "Two", "rater_id": "r2", "answered": 1, "total": 3}]
    one, two = screening.screen(rows, progress, (1, 5))
    assert one["flags"] == ["gold"] and one["variance"] == pytest.approx(1.0)  # scores 4 and 2 on 1-5
    assert two["flags"] == ["incomplete"] and two["variance"] is None  # one score: no variance to judge
    choices = [{**r, "score": ""} for r in rows if r["check"] == ""]
    assert [r["flags"] for r in screening.screen(choices, progress[:1], None)] == [[]]
