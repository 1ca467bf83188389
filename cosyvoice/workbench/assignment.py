"""Who may join a listening test, and which of its items a new rater gets.

A test's settings (in its spec, set when it is made, ``max_raters`` and ``closed`` also later by its owner):

* ``closed``: the test takes no new raters (those who started may finish);
* ``max_raters``: at most this many raters (0: no cap), counted in the same transaction that adds one;
* ``items_per_rater``: each rater gets this many of the items (0: all) plus every attention-check item, chosen so
  that every condition, then every item, is heard about equally often: the condition heard least so far first,
  then its item heard least, ties drawn from the rater's seed.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

from cosyvoice.errors import ConflictError, InvalidInputError
from cosyvoice.takes.store import TakeStore

SETTINGS = ("items_per_rater", "max_raters")  # whole numbers, 0: off


def check_settings(settings: dict[str, Any]) -> dict[str, int]:
    """The test settings of ``settings`` as whole numbers (0 when absent), each refused by name when it is not."""
    out = {}
    for name in SETTINGS:
        value = settings.get(name) or 0
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 1_000_000:
            raise InvalidInputError(f"{name} must be a whole number from 0 (no limit) up, got {value!r}", name)
        out[name] = value
    return out


def admit(test: dict[str, Any]) -> int:
    """The cap on raters a new one must stay under (0: none); a closed test refuses with the reason."""
    if test["spec"].get("closed"):
        raise ConflictError("this test is closed: it takes no new raters", "test")
    return int(test["spec"].get("max_raters") or 0)


def items_for(store: TakeStore, test: dict[str, Any], seed: int) -> set[int] | None:
    """The item indices a new rater of ``test`` gets (None: all of them), balanced against the raters so far."""
    items = test["spec"]["items"]
    checks = {i for i, item in enumerate(items) if item.get("check")}
    wanted = int(test["spec"].get("items_per_rater") or 0)
    if not wanted or wanted >= len(items) - len(checks):
        return None
    labels = store.existing(sorted({t for item in items for t in item["takes"]}))
    condition = [tuple(sorted(labels[t].label if t in labels else t for t in item["takes"])) for item in items]
    heard = Counter(entry["item"] for rater in store.raters(test["id"]) for entry in rater.plan)
    per_condition = Counter()
    for i, n in heard.items():
        per_condition[condition[i]] += n
    candidates = [i for i in range(len(items)) if i not in checks]
    random.Random(seed).shuffle(candidates)  # ties go to the earliest: drawn
    chosen: set[int] = set()
    for _ in range(wanted):
        best = min((i for i in candidates if i not in chosen), key=lambda i: (per_condition[condition[i]], heard[i]))
        chosen.add(best)
        per_condition[condition[best]] += 1
        heard[best] += 1
    return chosen | checks
