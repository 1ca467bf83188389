"""A listening test's results, read from its canonical answers: one row per answer (``answers.csv``,
:data:`EXPORT_COLUMNS`), one per rater (``raters.csv``), each rater's progress, and a summary's per-condition
statistics and rater agreement."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Collection
from typing import Any

from cosyvoice.takes.store import SCORE_METRICS, Take, TakeStore
from cosyvoice.workbench import stats
from cosyvoice.workbench.listening import SCALES, condition

EXPORT_COLUMNS = ("test", "kind", "rater", "rater_id", "item", "position", "take_ids", "conditions", "shown",
                  "answer", "answer_take", "answer_condition", "score", "seconds", "plays", "check", "check_failed",
                  "answered_at", *(f"obj_{m}" for m in SCORE_METRICS))
RATER_COLUMNS = ("test", "rater", "rater_id", "started", "answered", "total", "listening_device", "native_language",
                 "questionnaire_at")


def export_rows(store: TakeStore, test_id: str) -> list[dict[str, Any]]:
    """One row per answer (MUSHRA: per rated sample) with take ids and condition labels (``EXPORT_COLUMNS``)."""
    test = store.test(test_id)
    raters = {r.id: r for r in store.raters(test_id)}
    takes: dict[str, Take] = {}

    def cond(take_id: str) -> str:
        if take_id not in takes:
            takes[take_id] = store.take(take_id)
        return condition(takes[take_id])

    scores = store.scores()

    def objective(take_id: str) -> dict[str, Any]:
        """The answered take's scorecard (empty until one was computed)."""
        values = scores.get(take_id, {})
        return {f"obj_{m}": "" if values.get(m) is None else values[m] for m in SCORE_METRICS}

    rows = []
    for a in store.answers(test_id=test_id):
        rater, item = raters[a.rater], test["spec"]["items"][a.item]
        entry = rater.plan[a.position]
        ids = [*item["takes"], *(item[k] for k in ("reference", "anchor") if item.get(k))]
        base = {"test": test_id, "kind": test["kind"], "rater": rater.name, "rater_id": rater.id, "item": a.item,
                "position": a.position, "take_ids": ";".join(ids), "conditions": ";".join(cond(t) for t in ids),
                "shown": ";".join(f"{s['slot']}={s['take']}" for s in entry["slots"]), "seconds": a.seconds,
                "plays": a.plays, "check": "" if item.get("check") is None else _check_text(item["check"]),
                "check_failed": "" if a.check_failed is None else int(a.check_failed),
                "answered_at": round(a.created, 3)}
        if test["kind"] == "ab":
            chosen = a.answer["choice"]
            rows.append({**base, "answer": a.answer["shown"], "answer_take": "" if chosen == "none" else chosen,
                         "answer_condition": "none" if chosen == "none" else cond(chosen), "score": "",
                         **objective(chosen)})
        elif test["kind"] == "abx":
            rows.append({**base, "answer": a.answer["shown"], "answer_take": a.answer["chosen"],
                         "answer_condition": cond(a.answer["chosen"]), "score": int(a.answer["correct"]),
                         **objective(a.answer["chosen"])})
        elif test["kind"] in ("mos", "cmos"):
            rows.append({**base, "answer": a.answer["shown"], "answer_take": item["takes"][0],
                         "answer_condition": cond(item["takes"][0]), "score": a.answer["score"],
                         **objective(item["takes"][0])})
        else:
            for s in a.answer["scores"]:
                rows.append({**base, "answer": s["score"], "answer_take": s["take"],
                             "answer_condition": s["role"].replace("_", " ") if s["role"] != "stimulus"
                             else cond(s["take"]), "score": s["score"], **objective(s["take"])})
    return rows


def _check_text(check: dict[str, Any]) -> str:
    return ";".join(f"{k}={v}" for k, v in check.items())


def rater_rows(store: TakeStore, test_id: str) -> list[dict[str, Any]]:
    """``raters.csv``: one row per rater (``RATER_COLUMNS``) with the questionnaire's answers (empty: not given)."""
    answered: dict[str, int] = defaultdict(int)
    for a in store.answers(test_id=test_id):
        answered[a.rater] += 1
    rows = []
    for rater in store.raters(test_id):
        given = rater.questionnaire or {}
        rows.append({"test": test_id, "rater": rater.name, "rater_id": rater.id, "started": round(rater.created, 3),
                     "answered": answered[rater.id], "total": len(rater.plan),
                     "listening_device": given.get("listening_device", ""),
                     "native_language": given.get("native_language", ""), "questionnaire_at": given.get("at", "")})
    return rows


def progress(store: TakeStore, test_id: str) -> list[dict[str, Any]]:
    """Per rater: answered of total, attention checks failed, last answer time."""
    answers = store.answers(test_id=test_id)
    out = []
    for rater in store.raters(test_id):
        mine = [a for a in answers if a.rater == rater.id]
        out.append({"rater": rater.name, "rater_id": rater.id, "answered": len(mine), "total": len(rater.plan),
                    "checks_failed": sum(bool(a.check_failed) for a in mine), "seed": rater.seed,
                    "last_answer": max((a.created for a in mine), default=None)})
    return out


def summary(store: TakeStore, test_id: str, exclude: Collection[str] = (),
            rows: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Per-condition statistics, per-rater tables and agreement, from the export rows (``rows``: the test's
    :func:`export_rows`, when the caller has read them; attention-check items are left out of the condition
    statistics, their failures are counted in ``progress``), without the raters whose ids are in ``exclude`` (those
    screening flagged, on request)."""
    test = store.test(test_id)
    rows = [r for r in (export_rows(store, test_id) if rows is None else rows)
            if r["check"] == "" and r["rater_id"] not in exclude]
    out: dict[str, Any] = {"kind": test["kind"], "answers": len(rows), "conditions": [], "pairs": [],
                           "bradley_terry": None, "per_rater": [], "agreement": None,
                           "scale": list(SCALES[test["kind"]]) if test["kind"] in SCALES else None}
    if not rows:
        return out
    if test["kind"] == "ab":
        return {**out, **_ab_summary(rows)}
    if test["kind"] == "abx":
        return {**out, **_abx_summary(rows)}
    by_condition: dict[str, list[float]] = defaultdict(list)
    by_rater: dict[tuple[str, str], list[float]] = defaultdict(list)
    units: dict[tuple[int, str], dict[str, float]] = defaultdict(dict)
    for r in rows:
        by_condition[r["answer_condition"]].append(float(r["score"]))
        by_rater[(r["rater"], r["answer_condition"])].append(float(r["score"]))
        units[(r["item"], r["answer_take"])][r["rater_id"]] = float(r["score"])
    for name, values in sorted(by_condition.items()):
        ci = stats.mean_ci(values)
        out["conditions"].append({"condition": name, "mean": ci.estimate, "low": _num(ci.low), "high": _num(ci.high),
                                  "n": ci.n})
    out["per_rater"] = [{"rater": k[0], "condition": k[1], "mean": sum(v) / len(v), "n": len(v)}
                        for k, v in sorted(by_rater.items())]
    out["agreement"] = _agreement(units, "interval")
    return out


def _ab_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    pairs: dict[tuple[str, str], dict[str, int]] = {}
    comparisons, by_rater = [], defaultdict(lambda: defaultdict(int))
    units: dict[int, dict[str, str]] = defaultdict(dict)
    for r in rows:
        a, b = sorted(r["conditions"].split(";"))
        counts = pairs.setdefault((a, b), {a: 0, b: 0, "none": 0})
        chosen = r["answer_condition"]
        counts[chosen] += 1
        comparisons.append((a, b, 0.5 if chosen == "none" else float(chosen == a)))
        by_rater[r["rater"]][chosen] += 1
        units[r["item"]][r["rater_id"]] = chosen
    table = []
    for (a, b), counts in pairs.items():
        decided = counts[a] + counts[b]
        table.append({"a": a, "b": b, "wins_a": counts[a], "wins_b": counts[b], "none": counts["none"],
                      "share_a": counts[a] / decided if decided else None,
                      "p_value": stats.binomial_test(counts[a], decided)})
    try:
        bt = [{"condition": c, "score": i.estimate, "low": i.low, "high": i.high, "n": i.n}
              for c, i in sorted(stats.bradley_terry(comparisons).items(), key=lambda kv: -kv[1].low)]
    except ValueError as exc:
        bt = {"error": str(exc)}
    per_rater = [{"rater": rater, "condition": c, "chosen": n} for rater, d in sorted(by_rater.items())
                 for c, n in sorted(d.items())]
    return {"pairs": table, "bradley_terry": bt, "per_rater": per_rater, "agreement": _agreement(units, "nominal")}


def _abx_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per pair of conditions: how often X was named correctly, and the one-sided binomial p-value of doing
    that well by guessing; per rater the same."""
    pairs: dict[tuple[str, str], list[int]] = defaultdict(list)
    by_rater: dict[str, list[int]] = defaultdict(list)
    for r in rows:
        a, b = sorted(r["conditions"].split(";"))
        pairs[(a, b)].append(int(r["score"]))
        by_rater[r["rater"]].append(int(r["score"]))
    table = [{"a": a, "b": b, "correct": sum(v), "n": len(v), "share": sum(v) / len(v),
              "p_value": stats.binomial_tail(sum(v), len(v))} for (a, b), v in sorted(pairs.items())]
    per_rater = [{"rater": rater, "correct": sum(v), "n": len(v)} for rater, v in sorted(by_rater.items())]
    return {"pairs": table, "per_rater": per_rater}


def _agreement(units: dict[Any, dict[str, Any]], metric: str) -> dict[str, Any]:
    raters = sorted({r for u in units.values() for r in u})
    value = stats.krippendorff_alpha([[u.get(r) for r in raters] for u in units.values()], metric)
    return {"measure": f"Krippendorff's alpha ({metric})", "value": _num(value), "raters": len(raters)}


def _num(x: float) -> float | None:
    return None if math.isnan(x) else x
