"""A test's design over the REST API (cosyvoice/workbench/assignment.py): each rater gets a random subset of the
items with balanced coverage per condition; the owner caps the raters and closes the test; the design exported as
JSON makes the same test again."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from starlette.testclient import TestClient

from cosyvoice.owners import ANONYMOUS
from cosyvoice.server.rest import create_app
from cosyvoice.settings import ServerSettings, default_data_dir
from cosyvoice.takes.store import TakeStore

TEXTS = ("one", "two", "three", "four")


@pytest.fixture()
def client(tmp_path: Path) -> Iterator[tuple[TestClient, TakeStore]]:
    """A keyless server's API, as a client without a cookie, over takes of two conditions for four texts."""
    store = TakeStore(default_data_dir(tmp_path / "voices"))
    pcm = (0.2 * np.sin(np.arange(2400) / 5)).astype(np.float32)
    for text in TEXTS:
        for label in ("sysA", "sysB"):
            store.add_take(pcm, 24000, {"text": text}, label=label, owner=ANONYMOUS)
    with TestClient(create_app(ServerSettings(voice_dir=str(tmp_path / "voices"), sharing="private"))) as api:
        yield api, store


def join(api: TestClient, test_id: str, name: str):
    return api.post(f"/workbench/api/tests/{test_id}/raters", json={"name": name})


def test_each_rater_gets_a_balanced_subset_and_the_cap_and_closing_hold(client) -> None:
    api, store = client
    made = api.post("/workbench/api/tests", json={"kind": "mos", "conditions": ["sysA", "sysB"],
                                                  "items_per_rater": 2, "max_raters": 4})
    assert made.status_code == 201, made.text
    test_id = made.json()["id"]
    labels = {t.id: t.label for t in store.takes()}
    items = store.test(test_id)["spec"]["items"]
    for name in ("Ann", "Bob", "Cy", "Di"):
        assert join(api, test_id, name).status_code == 200
    plans = {r.name: [e["item"] for e in r.plan] for r in store.raters(test_id)}
    for name, plan in plans.items():  # two items each, one of each condition
        assert sorted(labels[items[i]["takes"][0]] for i in plan) == ["sysA", "sysB"], (name, plan)
    assert Counter(i for plan in plans.values() for i in plan) == dict.fromkeys(range(8), 1)  # every item once

    full = join(api, test_id, "Eve")
    assert full.status_code == 409 and "all the raters it takes (4)" in full.json()["error"]["message"]
    listed = api.get("/workbench/api/tests").json()["tests"][0]
    assert (listed["items_per_rater"], listed["max_raters"], listed["closed"]) == (2, 4, False)

    assert api.patch(f"/workbench/api/tests/{test_id}", json={"closed": True, "max_raters": 6}).json() == \
        {"id": test_id, "closed": True, "max_raters": 6}
    closed = join(api, test_id, "Eve")
    assert closed.status_code == 409 and "closed" in closed.json()["error"]["message"]
    assert api.patch(f"/workbench/api/tests/{test_id}", json={"closed": False}).status_code == 200
    assert join(api, test_id, "Eve").status_code == 200
    bad = api.patch(f"/workbench/api/tests/{test_id}", json={"max_raters": -1})
    assert bad.status_code == 400 and "max_raters" in bad.json()["error"]["message"]
    bad = api.post("/workbench/api/tests", json={"kind": "mos", "conditions": ["sysA"], "items_per_rater": -2})
    assert bad.status_code == 400 and "items_per_rater" in bad.json()["error"]["message"]


def test_a_designs_json_makes_the_same_test_again(client) -> None:
    api, _ = client
    made = api.post("/workbench/api/tests", json={"kind": "ab", "conditions": ["sysA", "sysB"], "name": "AB mine",
                                                  "title": "Which is better?", "allow_none": True, "max_raters": 3})
    test_id = made.json()["id"]
    exported = api.get(f"/workbench/api/tests/{test_id}/design.json")
    assert f'filename="{test_id}-design.json"' in exported.headers["content-disposition"]
    design = exported.json()
    assert (design["kind"], design["name"], design["title"], design["allow_none"], design["max_raters"],
            design["items_per_rater"]) == ("ab", "AB mine", "Which is better?", True, 3, 0)
    assert [sorted(item["labels"].values()) for item in design["items"]] == [["sysA", "sysB"]] * 4
    again = api.post("/workbench/api/tests", json=design)
    assert again.status_code == 201, again.text
    assert api.get(f"/workbench/api/tests/{again.json()['id']}/design.json").json() == design
    missing = {**design, "items": [{"takes": ["take-gone", design["items"][0]["takes"][1]]}]}
    refused = api.post("/workbench/api/tests", json=missing)  # a design whose takes this data folder lacks
    assert refused.status_code == 400 and "take-gone" in refused.json()["error"]["message"]
