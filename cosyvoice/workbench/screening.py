"""Rater screening by the rules listening-test reports are judged by, so a published result can be defended.

Each rule flags a rater; a flagged rater is left out of the statistics only on request (the results give them
with and without), and ``answers.csv`` carries every rater's flags:

* ``hidden_reference`` (ITU-R BS.1534-3 post-screening, MUSHRA): the hidden reference rated below 90 on more
  than 15 % of the rater's items;
* ``anchor`` (BS.1534-3, MUSHRA): the mid-range anchor rated above 90 on more than 15 % of them;
* ``gold`` (ITU-T P.808's gold and trapping questions): an attention-check item of the design (an anchor that
  must lose, or score low) failed;
* ``straight_lining`` (P.808's rating-variance gate): the variance of the rater's scores, mapped onto P.808's
  1–5 scale so the bound means the same on every scale, is below 0.15 (scored kinds; two scores or more);
* ``incomplete`` (P.808's per-rater acceptance: a session counts once finished): fewer answers than items.

P.808's other gate, every clip played to its end, holds for every answer by construction: the server refuses a
rating before each sample of the item played through (:func:`cosyvoice.workbench.listening.submit`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import numpy as np

REFERENCE_MIN = 90  # BS.1534-3: a hidden reference below this is a miss, an anchor above it too
SHARE_MAX = 0.15  # BS.1534-3: more than this share of items missed flags the rater
VARIANCE_MIN = 0.15  # P.808: ratings (on 1-5) varying less than this are straight-lining
RULES = {
    "hidden_reference": f"rated the hidden reference below {REFERENCE_MIN} on more than {SHARE_MAX:.0%} of items",
    "anchor": f"rated the mid anchor above {REFERENCE_MIN} on more than {SHARE_MAX:.0%} of items",
    "gold": "failed an attention-check (gold) item",
    "straight_lining": f"ratings vary too little (variance on a 1–5 scale below {VARIANCE_MIN})",
    "incomplete": "has not answered every item",
}
COLUMNS = ("rater_flags", "rater_accepted")  # added to answers.csv


def screen(rows: list[dict[str, Any]], progress: list[dict[str, Any]],
           scale: tuple[float, float] | None) -> list[dict[str, Any]]:
    """Per rater (``progress``: :func:`listening_results.progress`): its flags (rule names, in :data:`RULES`' order),
    whether it is accepted (no flag) and the measures the rules read, from the test's answer ``rows``
    (:func:`listening_results.export_rows`; ``scale``: the kind's rating scale, None for choices)."""
    by_rater: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_rater[r["rater_id"]].append(r)
    out = []
    for p in progress:
        mine = by_rater.get(p["rater_id"], [])
        measures = {"hidden_reference_misses": _share(mine, "hidden reference", lambda s: s < REFERENCE_MIN),
                    "anchor_misses": _share(mine, "anchor", lambda s: s > REFERENCE_MIN),
                    "gold_failed": sum(r["check"] != "" and r["check_failed"] == 1 for r in mine),
                    "variance": _variance((float(r["score"]) for r in mine if r["check"] == ""), scale),
                    "answered": p["answered"], "items": p["total"]}
        flags = [rule for rule, hit in (
            ("hidden_reference", (measures["hidden_reference_misses"] or 0) > SHARE_MAX),
            ("anchor", (measures["anchor_misses"] or 0) > SHARE_MAX),
            ("gold", measures["gold_failed"] > 0),
            ("straight_lining", measures["variance"] is not None and measures["variance"] < VARIANCE_MIN),
            ("incomplete", p["answered"] < p["total"])) if hit]
        out.append({"rater": p["rater"], "rater_id": p["rater_id"], "flags": flags, "accepted": not flags,
                    **measures})
    return out


def flagged(screened: list[dict[str, Any]]) -> set[str]:
    """The ids of the raters screening flags."""
    return {r["rater_id"] for r in screened if r["flags"]}


def with_flags(rows: list[dict[str, Any]], screened: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` (answers.csv's) with their rater's flags (``;``-joined) and acceptance (1/0): :data:`COLUMNS`."""
    by_id = {r["rater_id"]: r for r in screened}
    return [{**r, "rater_flags": ";".join(by_id[r["rater_id"]]["flags"]),
             "rater_accepted": int(by_id[r["rater_id"]]["accepted"])} for r in rows]


def _share(rows: list[dict[str, Any]], role: str, missed: Any) -> float | None:
    """The share of the rater's items whose sample in ``role`` was ``missed`` (None: no item has one)."""
    scores = [float(r["score"]) for r in rows if r["answer_condition"] == role]
    return sum(map(missed, scores)) / len(scores) if scores else None


def _variance(scores: Iterable[float], scale: tuple[float, float] | None) -> float | None:
    """The population variance of ``scores`` mapped onto 1–5 (None: choices, or fewer than two scores)."""
    values = np.array(list(scores) if scale else [], dtype=float)
    if values.size < 2:
        return None
    low, high = scale
    return float(np.var(1 + 4 * (values - low) / (high - low)))
