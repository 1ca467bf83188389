"""Blind listening tests on a real store: designs, per-rater plans, listen-gating, canonical answers, results."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from cosyvoice.errors import AlreadyExistsError, ConflictError, InvalidInputError
from cosyvoice.takes.store import Take, TakeStore
from cosyvoice.workbench import listening, listening_results

SECONDS = 0.8  # take length: long enough that an immediate 'ended' is refused (tolerance 0.3 s)


def make_takes(store: TakeStore, labels: list[str], texts: list[str]) -> dict[tuple[str, str], Take]:
    out = {}
    for text in texts:
        for k, label in enumerate(labels):
            pcm = (0.2 * np.sin(np.arange(int(24000 * SECONDS)) * (0.05 + 0.01 * k))).astype(np.float32)
            out[(label, text)] = store.add_take(pcm, 24000, {"text": text, "segments": [text]}, label=label)
    return out


class Clock:
    """The store's wall clock, moved by the test: a take plays through in no time."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def listen(store: TakeStore, rater, position: int) -> None:
    """Every slot of the item played through (plays overlap, so one take's length covers them all)."""
    slots = [s["slot"] for s in rater.plan[position]["slots"]]
    for slot in slots:
        listening.record_play(store, rater, position, slot, "play")
    store.clock.now += SECONDS - listening.LISTEN_TOLERANCE_SECONDS + 0.05
    for slot in slots:
        listening.record_play(store, rater, position, slot, "ended")


@pytest.fixture()
def store(tmp_path: Path) -> TakeStore:
    return TakeStore(tmp_path, clock=Clock())


def test_played_through_needs_the_takes_length_on_the_servers_clock() -> None:
    assert listening.played_through([("A", "play", 10.0), ("A", "ended", 11.0)], "A", 1.2)  # within 0.3 s
    assert not listening.played_through([("A", "play", 10.0), ("A", "ended", 10.5)], "A", 1.2)  # seeked / sped up
    assert not listening.played_through([("A", "ended", 12.0)], "A", 1.2)  # no play before it
    assert not listening.played_through([("B", "play", 10.0), ("B", "ended", 12.0)], "A", 1.2)  # another slot
    assert listening.played_through([("A", "play", 1.0), ("A", "ended", 1.1), ("A", "play", 5.0),
                                     ("A", "ended", 6.0)], "A", 1.2)  # a replay counts


def test_ab_design_plans_and_gated_answers(store: TakeStore) -> None:
    takes = make_takes(store, ["sysA", "sysB", "bad"], ["one", "two"])
    items = listening.design("ab", store.takes(), ["sysA", "sysB"], anchor="bad")
    assert [it["takes"] for it in items[:1]] == [[takes[("sysA", "one")].id, takes[("sysB", "one")].id]]
    assert sum("check" in it for it in items) == 2 and len(items) == 4
    test_id = listening.create_test(store, "ab", items, allow_none=True)
    ann = listening.join(store, test_id, "  Ann  ")
    assert ann.name == "Ann"
    with pytest.raises(AlreadyExistsError, match="personal link"):  # a name is no secret: it never resumes Ann
        listening.join(store, test_id, "Ann")
    bob = listening.join(store, test_id, "Bob")
    # each rater's order and sides come from their own recorded seed
    assert listening.make_plan("ab", items, ann.seed) == ann.plan
    assert sorted(e["item"] for e in bob.plan) == [0, 1, 2, 3]

    peek = listening.next_item(store, ann, view=False)  # the page before the first item: no clock started
    assert (peek["viewed"], peek["played"]) == (False, []) and store.events(ann.id, 0) == []
    state = listening.next_item(store, ann)
    assert state["position"] == 0 and [s["slot"] for s in state["slots"]] == ["A", "B"]
    assert "take" not in str(state["slots"])  # the page never learns which take is where
    assert listening.next_item(store, ann)["viewed"] is True
    with pytest.raises(InvalidInputError, match="to the end first"):
        listening.submit(store, ann, 0, {"choice": "A"})
    listening.record_play(store, ann, 0, "A", "play")
    listening.record_play(store, ann, 0, "A", "ended")  # at once: not played through
    with pytest.raises(InvalidInputError, match="play A, B to the end first"):
        listening.submit(store, ann, 0, {"choice": "A"})
    assert listening.next_item(store, ann)["played"] == []
    listen(store, ann, 0)
    assert listening.next_item(store, ann)["played"] == ["A", "B"]  # what a page reloaded now shows played
    with pytest.raises(InvalidInputError, match="choose A or B or no preference"):
        listening.submit(store, ann, 0, {"choice": "C"})
    answer = listening.submit(store, ann, 0, {"choice": "B"})
    assert answer.answer == {"choice": ann.plan[0]["slots"][1]["take"], "shown": "B"} and answer.plays == 3
    # the same answer again (a page whose reply was lost) is accepted as it was; another one is refused
    assert listening.submit(store, ann, 0, {"choice": "B"}) == answer
    with pytest.raises(ConflictError, match="answered already"):
        listening.submit(store, ann, 0, {"choice": "A"})
    assert len(store.answers(rater_id=ann.id)) == 1
    assert listening.next_item(store, ann)["position"] == 1


def test_answers_export_and_summary(store: TakeStore) -> None:
    takes = make_takes(store, ["sysA", "sysB", "bad"], ["one", "two"])
    items = listening.design("mos", store.takes(), ["sysA", "sysB"], anchor="bad")
    assert len(items) == 6 and [it["check"] for it in items if "check" in it] == [{"max": 2}, {"max": 2}]
    test_id = listening.create_test(store, "mos", items)
    scores = {"sysA": 4, "sysB": 2, "bad": 3}  # Ann fails the anchor checks (3 > 2)
    for name, shift in (("Ann", 0), ("Bob", 1)):
        rater = listening.join(store, test_id, name)
        for position, entry in enumerate(rater.plan):
            take = store.take(entry["slots"][0]["take"])
            assert listening.next_item(store, rater)["position"] == position  # the page shows it: time starts
            listen(store, rater, position)
            listening.submit(store, rater, position, {"score": min(5, scores[take.label] + shift)})
    rows = listening_results.export_rows(store, test_id)
    assert len(rows) == 12 and set(rows[0]) == set(listening_results.EXPORT_COLUMNS)
    assert {r["take_ids"] for r in rows} == {t.id for t in takes.values()}
    assert [(r["plays"], r["seconds"] > 0) for r in rows] == [(1, True)] * 12
    assert [r["check_failed"] for r in rows if r["check"]] == [1, 1, 1, 1]  # Ann 3 and Bob 4 both exceed 2
    progress = {p["rater"]: p for p in listening_results.progress(store, test_id)}
    assert progress["Ann"]["answered"] == 6 and progress["Ann"]["checks_failed"] == 2
    summary = listening_results.summary(store, test_id)
    by = {c["condition"]: c for c in summary["conditions"]}
    assert set(by) == {"sysA", "sysB"}  # attention-check items are not a condition
    assert by["sysA"]["mean"] == pytest.approx(4.5) and by["sysA"]["n"] == 4
    # values 4,4,5,5: sd 0.57735, se 0.288675, t(0.975, 3) = 3.182446 -> half-width 0.918693
    assert by["sysA"]["high"] == pytest.approx(4.5 + 0.918693, abs=1e-5)
    per_rater = {(r["rater"], r["condition"]): (r["mean"], r["n"]) for r in summary["per_rater"]}
    assert per_rater == {("Ann", "sysA"): (4, 2), ("Ann", "sysB"): (2, 2), ("Bob", "sysA"): (5, 2),
                         ("Bob", "sysB"): (3, 2)}
    assert summary["agreement"]["measure"] == "Krippendorff's alpha (interval)"
    assert 0 < summary["agreement"]["value"] < 1


def test_cmos_is_stored_as_stimulus_against_reference_whatever_the_side(store: TakeStore) -> None:
    make_takes(store, ["ref", "new"], ["one", "two", "three", "four"])
    items = listening.design("cmos", store.takes(), ["new"], reference="ref")
    test_id = listening.create_test(store, "cmos", items)
    rater = listening.join(store, test_id, "Ann")
    for position, entry in enumerate(rater.plan):
        listen(store, rater, position)
        answer = listening.submit(store, rater, position, {"score": 2})  # "B is better than A"
        stimulus_is_b = entry["slots"][1]["role"] == "stimulus"
        assert answer.answer == {"score": 2 if stimulus_is_b else -2, "shown": 2}
    with pytest.raises(InvalidInputError, match="from -3 to 3"):
        listening._score(4, "cmos")


def test_mushra_hidden_reference_and_anchor(store: TakeStore) -> None:
    make_takes(store, ["ref", "sysA", "sysB", "anchor"], ["one"])
    items = listening.design("mushra", store.takes(), ["sysA", "sysB"], reference="ref", anchor="anchor")
    assert len(items) == 1 and len(items[0]["takes"]) == 2
    test_id = listening.create_test(store, "mushra", items)
    rater = listening.join(store, test_id, "Ann")
    slots = rater.plan[0]["slots"]
    assert slots[0]["slot"] == "ref" and {s["role"] for s in slots[1:]} == {"stimulus", "hidden_reference", "anchor"}
    listen(store, rater, 0)
    with pytest.raises(InvalidInputError, match="rate every sample"):
        listening.submit(store, rater, 0, {"scores": {"1": 50}})
    given = {s["slot"]: {"hidden_reference": 70, "anchor": 10}.get(s["role"], 60) for s in slots[1:]}
    answer = listening.submit(store, rater, 0, {"scores": given})
    assert answer.check_failed is True  # the hidden reference got 70 < 90
    rows = listening_results.export_rows(store, test_id)
    assert sorted(r["answer_condition"] for r in rows) == ["anchor", "hidden reference", "sysA", "sysB"]

    noref = listening.design("mushra_noref", store.takes(), ["sysA", "sysB"], anchor="anchor")
    assert "reference" not in noref[0]
    test2 = listening.create_test(store, "mushra_noref", noref)
    rater2 = listening.join(store, test2, "Ann")
    assert all(s["role"] != "reference" for s in rater2.plan[0]["slots"])


def test_bad_designs_and_names_are_refused(store: TakeStore) -> None:
    make_takes(store, ["sysA"], ["one"])
    with pytest.raises(InvalidInputError, match="unknown test kind"):
        listening.design("abcx", store.takes(), ["sysA"])
    with pytest.raises(InvalidInputError, match="needs a reference"):
        listening.design("cmos", store.takes(), ["sysA"])
    with pytest.raises(InvalidInputError, match="no items"):
        listening.design("ab", store.takes(), ["sysA", "nope"])
    for kind in ("ab", "abx"):  # one condition ticked: the reason is the missing second one, not "no items"
        with pytest.raises(InvalidInputError, match="choose two or more conditions"):
            listening.design(kind, store.takes(), ["sysA", "sysA"])
    with pytest.raises(InvalidInputError, match="choose one or more conditions"):
        listening.design("mos", store.takes(), [])
    with pytest.raises(InvalidInputError, match="no take 'take-x'"):
        listening.check_items("mos", [{"takes": ["take-x"]}], store)
    test_id = listening.create_test(store, "mos", [{"takes": [store.takes()[0].id]}])
    with pytest.raises(InvalidInputError, match="enter your name"):
        listening.join(store, test_id, " ")
    store.add_rater(test_id, "Zoe", 1, [])
    with pytest.raises(AlreadyExistsError):
        store.add_rater(test_id, "Zoe", 2, [])


def test_abx_draws_x_per_rater_scores_it_and_tests_against_guessing(store: TakeStore) -> None:
    takes = make_takes(store, ["sysA", "sysB"], ["one", "two", "three"])
    items = listening.design("abx", store.takes(), ["sysA", "sysB"])
    assert [it["takes"] for it in items] == [[takes[("sysA", t)].id, takes[("sysB", t)].id]
                                             for t in ("one", "two", "three")]
    test_id = listening.create_test(store, "abx", items)
    xs = set()
    for name in ("Ann", "Bob", "Cy", "Di"):
        rater = listening.join(store, test_id, name)
        for position, entry in enumerate(rater.plan):
            slots = {s["slot"]: s for s in entry["slots"]}
            assert list(slots) == ["A", "B", "X"] and slots["X"]["take"] in (slots["A"]["take"], slots["B"]["take"])
            xs.add(slots["X"]["take"] == slots["A"]["take"])
            listen(store, rater, position)
            with pytest.raises(InvalidInputError, match="X is A or B"):
                listening.submit(store, rater, position, {"choice": "none"})
            right = "A" if slots["X"]["take"] == slots["A"]["take"] else "B"
            wrong = "B" if right == "A" else "A"
            answer = listening.submit(store, rater, position, {"choice": wrong if name == "Di" else right})
            assert answer.answer["correct"] is (name != "Di")
    assert xs == {True, False}  # X is drawn per rater and item, not always the same side
    summary = listening_results.summary(store, test_id)
    [pair] = summary["pairs"]
    assert (pair["correct"], pair["n"]) == (9, 12)
    assert pair["p_value"] == pytest.approx(sum(math.comb(12, k) for k in range(9, 13)) / 2**12)  # 0.073
    assert {r["rater"]: r["correct"] for r in summary["per_rater"]} == {"Ann": 3, "Bob": 3, "Cy": 3, "Di": 0}
    rows = listening_results.export_rows(store, test_id)
    assert {r["score"] for r in rows} == {0, 1} and all(r["kind"] == "abx" for r in rows)


def test_raters_see_the_public_title_never_the_owners_name(store: TakeStore) -> None:
    make_takes(store, ["sysA", "sysB"], ["one"])
    items = listening.design("ab", store.takes(), ["sysA", "sysB"])
    named = store.test(listening.create_test(store, "ab", items, name="AB sysA vs sysB"))
    assert (named["title"], listening.owner_name(named)) == (listening.PUBLIC_TITLE, "AB sysA vs sysB")
    titled = store.test(listening.create_test(store, "ab", items, title="Which voice do you prefer?"))
    assert (titled["title"], listening.owner_name(titled)) == ("Which voice do you prefer?", "AB test")
    rater = listening.join(store, named["id"], "Ann")
    assert listening.next_item(store, rater)["title"] == listening.PUBLIC_TITLE


def test_training_examples_and_the_end_of_test_questionnaire(store: TakeStore) -> None:
    takes = make_takes(store, ["sysA", "sysB"], ["one"])
    good, bad = takes[("sysA", "one")].id, takes[("sysB", "one")].id
    for examples, message in (({"take": good}, "a list"), ([{"take": good}], "needs 'take'"),
                              ([{"take": "take-nope", "label": "x"}], "no take 'take-nope'"),
                              ([{"take": good, "label": "x" * 201}], "201 characters")):
        with pytest.raises(InvalidInputError, match=message):
            listening.check_training(examples, store)
    training = listening.check_training([{"take": good, "label": " Clean "}, {"take": bad, "label": "Noisy"}], store)
    assert training == [{"take": good, "label": "Clean"}, {"take": bad, "label": "Noisy"}]
    test_id = listening.create_test(store, "mos", [{"takes": [good]}], training=training)
    assert store.test(test_id)["spec"]["training"] == training
    with pytest.raises(ConflictError, match="used by"):  # a training example is a take the test uses
        store.delete_take(bad)
    ann = listening.join(store, test_id, "Ann")
    with pytest.raises(InvalidInputError, match="answer every item first"):
        listening.answer_questionnaire(store, ann, {"listening_device": "headphones", "native_language": "German"})
    listen(store, ann, 0)
    state = listening.submit(store, ann, 0, {"score": 4}) and listening.next_item(store, ann)
    assert state["done"] and state["questionnaire"] == "pending"
    with pytest.raises(InvalidInputError, match="say what you listened with"):
        listening.answer_questionnaire(store, ann, {"listening_device": "ears", "native_language": "German"})
    with pytest.raises(InvalidInputError, match="native language"):
        listening.answer_questionnaire(store, ann, {"listening_device": "earbuds", "native_language": "  "})
    given = {"listening_device": "earbuds", "native_language": " Swiss  German "}
    assert listening.answer_questionnaire(store, ann, given)["questionnaire"] == "given"
    ann = store.rater(ann.id)
    assert listening.answer_questionnaire(store, ann, given)["questionnaire"] == "given"  # a retry: the same
    with pytest.raises(ConflictError, match="answered already"):
        listening.answer_questionnaire(store, ann, {**given, "listening_device": "headphones"})
    [row] = listening_results.rater_rows(store, test_id)
    assert set(row) == set(listening_results.RATER_COLUMNS)
    assert (row["rater"], row["answered"], row["total"], row["listening_device"], row["native_language"]) == \
        ("Ann", 1, 1, "earbuds", "Swiss German")
    untold = listening.create_test(store, "mos", [{"takes": [good]}], questionnaire=False)
    with pytest.raises(InvalidInputError, match="no questionnaire"):
        listening.answer_questionnaire(store, listening.join(store, untold, "Bob"), given)
