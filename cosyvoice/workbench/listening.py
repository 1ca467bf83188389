"""Blind listening tests over stored takes: designs, per-rater plans, listen-gating, answers, results.

Kinds: ``ab`` (pairwise preference, "no preference" optional), ``abx`` (is X, one of the pair drawn per rater,
A or B: can listeners tell the two apart at all), ``mos`` (ITU-T P.800 ACR, 1–5), ``cmos``
(−3..+3, a take against a reference), ``mushra`` (0–100 for several takes beside an explicit reference, with
the reference hidden among them and an optional anchor) and ``mushra_noref`` (the same without any reference,
so a system that beats the human recording is not penalised).

A test's items are canonical (take ids, no sides); each rater gets a plan drawn from a seed recorded with the
rater: item order, A/B sides, stimulus order. Raters see slot names only ("A", "B", "1", …), never take ids.
An answer counts only when the server saw every slot of the item play through to its end (listen-gating by
the server's clock), and is stored in the canonical form, so sides and order never leak into results
(:mod:`cosyvoice.workbench.listening_results` reads them).
"""

from __future__ import annotations

import itertools
import math
import random
import secrets
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from cosyvoice.errors import AlreadyExistsError, ConflictError, InvalidInputError, NotFoundError
from cosyvoice.owners import LOCAL, Caller
from cosyvoice.settings import Limits, env_name
from cosyvoice.takes.store import Answer, Rater, Take, TakeStore
from cosyvoice.workbench import assignment

KINDS = ("ab", "abx", "mos", "cmos", "mushra", "mushra_noref")
PAIRED = ("ab", "abx")  # kinds whose items are two takes compared with each other
SCALES = {"mos": (1, 5), "cmos": (-3, 3), "mushra": (0, 100), "mushra_noref": (0, 100)}
PUBLIC_TITLE = "Listening test"  # what raters see when the owner gives no public title
HIDDEN_REFERENCE_MIN = 90  # MUSHRA post-screening (ITU-R BS.1534): the hidden reference should score >= 90
LISTEN_TOLERANCE_SECONDS = 0.3  # play start to end may fall this much short of the take's length (clock jitter)
MAX_TRAINING = 20  # labelled examples on a test's training page
# the end-of-test questionnaire: what the rater listened with, and their native language (exported in raters.csv)
LISTENING_DEVICES = ("headphones", "earbuds", "loudspeakers", "laptop or phone speaker")
DEFAULT_INSTRUCTIONS = {
    "ab": "Listen to both samples, A and B, to the end. Then choose the one that sounds better overall.",
    "abx": "Listen to A, B and X to the end. X is the same recording as either A or B: say which.",
    "mos": "Listen to each sample to the end, then rate its overall quality: 5 Excellent, 4 Good, 3 Fair, "
           "2 Poor, 1 Bad.",
    "cmos": "Listen to A and B to the end, then say how B compares with A, from -3 (much worse) to +3 (much "
            "better); 0 means about the same.",
    "mushra": "Listen to the reference and to every sample to the end. Rate each sample from 0 to 100 for how "
              "close it is to the reference; one of them is the reference itself.",
    "mushra_noref": "Listen to every sample to the end. Rate each from 0 (bad) to 100 (excellent) for overall "
                    "quality, comparing them with each other.",
}


def condition(take: Take) -> str:
    """A take's condition: its label, else its own id (an unlabelled take is a condition of its own)."""
    return take.label or take.id


# ----------------------------------------------------------------------------- designs


def design(kind: str, takes: Sequence[Take], conditions: Sequence[str], *, reference: str | None = None,
           anchor: str | None = None) -> list[dict[str, Any]]:
    """Items comparing ``conditions`` (take labels) text by text: takes of the same text are matched in the
    order they were made. ``reference``: the condition CMOS and MUSHRA compare against; ``anchor``: a condition
    that must sound worst, used as attention checks (MOS/A/B/CMOS) or as MUSHRA's anchor."""
    _check_kind(kind)
    by_text: dict[str, dict[str, list[Take]]] = defaultdict(lambda: defaultdict(list))
    for take in sorted(takes, key=lambda t: t.seq):
        by_text[take.provenance.get("text", "")][condition(take)].append(take)
    conditions = list(dict.fromkeys(conditions))
    if len(conditions) < (2 if kind in PAIRED else 1):
        raise InvalidInputError(f"choose {'two' if kind in PAIRED else 'one'} or more conditions (take labels) to "
                                f"compare{': this kind compares two at a time' if kind in PAIRED else ''}",
                                "conditions")
    if kind in ("cmos", "mushra") and not reference:
        raise InvalidInputError(f"a {kind} test needs a reference condition", "reference")
    items: list[dict[str, Any]] = []
    for group in by_text.values():
        ref, anchors = group.get(reference or "", []), group.get(anchor or "", [])
        if kind in PAIRED:
            for a, b in itertools.combinations(conditions, 2):
                items += [{"takes": [x.id, y.id]} for x, y in zip(group.get(a, []), group.get(b, []), strict=False)]
            if kind == "ab" and anchors and group.get(conditions[0]):
                good = group[conditions[0]][0].id
                items.append({"takes": [good, anchors[0].id], "check": {"expect": good}})
        elif kind == "mos":
            items += [{"takes": [t.id]} for c in conditions for t in group.get(c, [])]
            items += [{"takes": [t.id], "check": {"max": 2}} for t in anchors[:1]]
        elif kind == "cmos":
            if not ref:
                continue
            items += [{"takes": [t.id], "reference": ref[0].id} for c in conditions if c != reference
                      for t in group.get(c, [])]
            if anchors:
                items.append({"takes": [anchors[0].id], "reference": ref[0].id, "check": {"max": -1}})
        else:
            stimuli = [group[c][0].id for c in conditions if c not in (reference, anchor) and group.get(c)]
            if not stimuli or (kind == "mushra" and not ref):
                continue
            item: dict[str, Any] = {"takes": stimuli}
            if kind == "mushra":
                item["reference"] = ref[0].id
            if anchors:
                item["anchor"] = anchors[0].id
            items.append(item)
    if not items:
        raise InvalidInputError("no items: no text has takes of the chosen conditions (labels) to compare",
                                "conditions")
    return items


def check_items(kind: str, items: object, store: TakeStore, caller: Caller = LOCAL,
                limits: Limits | None = None) -> list[dict[str, Any]]:
    """Explicit items (REST), validated: at most ``limits.max_test_items``, the right number of takes per kind,
    every take stored and visible to ``caller`` (nobody builds a test from another's takes)."""
    _check_kind(kind)
    if not isinstance(items, list) or not items:
        raise InvalidInputError("items must be a non-empty list", "items")
    _bounded(items, limits or Limits.from_env())
    out = []
    for n, item in enumerate(items, 1):
        if not isinstance(item, dict) or not isinstance(item.get("takes"), list) or not item["takes"]:
            raise InvalidInputError(f"item {n} needs 'takes', a list of take ids", "items")
        count = len(item["takes"])
        want = {"ab": count == 2, "abx": count == 2, "mos": count == 1, "cmos": count == 1}.get(kind, count >= 1)
        if not want:
            raise InvalidInputError(f"item {n}: a {kind} item has {'2 takes' if kind in PAIRED else '1 take'}",
                                    "items")
        if kind in ("cmos", "mushra") and not isinstance(item.get("reference"), str):
            raise InvalidInputError(f"item {n}: a {kind} item needs a 'reference' take id", "items")
        for take_id in [*item["takes"], *(item[k] for k in ("reference", "anchor") if item.get(k))]:
            try:
                store.take(str(take_id), caller)
            except NotFoundError as exc:
                raise InvalidInputError(f"item {n}: no take {take_id!r}", "items") from exc
        out.append({k: item[k] for k in ("takes", "reference", "anchor", "check") if k in item})
    return out


def check_training(examples: object, store: TakeStore, caller: Caller = LOCAL,
                   limits: Limits | None = None) -> list[dict[str, str]]:
    """A test's training page: labelled examples (``{"take": id, "label": text}``) raters hear before the first
    item, each take stored and visible to ``caller``, each label a short text."""
    bound = (limits or Limits.from_env()).max_test_title_chars
    if not isinstance(examples, list) or len(examples) > MAX_TRAINING:
        raise InvalidInputError(f"training must be a list of at most {MAX_TRAINING} examples", "training")
    out = []
    for n, example in enumerate(examples, 1):
        if not isinstance(example, dict) or not isinstance(example.get("take"), str) or \
                not isinstance(example.get("label"), str) or not example["label"].strip():
            raise InvalidInputError(f"training example {n} needs 'take' (a take id) and 'label' (what it shows)",
                                    "training")
        if len(example["label"]) > bound:
            raise InvalidInputError(f"training example {n}: the label has {len(example['label'])} characters; at "
                                    f"most {bound} are allowed ({env_name('max_test_title_chars')})", "training")
        try:
            store.take(example["take"], caller)
        except NotFoundError as exc:
            raise InvalidInputError(f"training example {n}: no take {example['take']!r}", "training") from exc
        out.append({"take": example["take"], "label": example["label"].strip()})
    return out


def _bounded(items: list, limits: Limits) -> None:
    if len(items) > limits.max_test_items:
        raise InvalidInputError(f"the test has {len(items):,} items; at most {limits.max_test_items:,} are allowed "
                                f"({env_name('max_test_items')})", "items")


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise InvalidInputError(f"unknown test kind {kind!r}; use one of {', '.join(KINDS)}", "kind")


# ----------------------------------------------------------------------------- raters


def make_plan(kind: str, items: list[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    """A rater's items in their order, each with its slots (name, take, role), all drawn from ``seed``."""
    rng = random.Random(seed)
    order = list(range(len(items)))
    rng.shuffle(order)
    plan = []
    for i in order:
        item = items[i]
        if kind == "ab":
            pair = list(item["takes"])
            if rng.random() < 0.5:
                pair.reverse()
            slots = [{"slot": s, "take": t, "role": "stimulus"} for s, t in zip("AB", pair, strict=True)]
        elif kind == "abx":
            pair = list(item["takes"])
            rng.shuffle(pair)
            slots = [{"slot": s, "take": t, "role": "stimulus"} for s, t in zip("AB", pair, strict=True)]
            slots.append({"slot": "X", "take": rng.choice(pair), "role": "x"})
        elif kind == "mos":
            slots = [{"slot": "X", "take": item["takes"][0], "role": "stimulus"}]
        elif kind == "cmos":
            pair = [(item["reference"], "reference"), (item["takes"][0], "stimulus")]
            if rng.random() < 0.5:
                pair.reverse()
            slots = [{"slot": s, "take": t, "role": r} for s, (t, r) in zip("AB", pair, strict=True)]
        else:
            stimuli = [(t, "stimulus") for t in item["takes"]]
            if kind == "mushra":
                stimuli.append((item["reference"], "hidden_reference"))
            if item.get("anchor"):
                stimuli.append((item["anchor"], "anchor"))
            rng.shuffle(stimuli)
            slots = [{"slot": str(k), "take": t, "role": r} for k, (t, r) in enumerate(stimuli, 1)]
            if kind == "mushra":
                slots.insert(0, {"slot": "ref", "take": item["reference"], "role": "reference"})
        plan.append({"item": i, "slots": slots})
    return plan


def join(store: TakeStore, test_id: str, name: object) -> Rater:
    """A new rater with its own seed. A name another rater of the test has is refused: a name is no secret, and
    only the rater's own id (kept in the browser it started in, and in its personal link) resumes it."""
    test = store.test(test_id)
    if not isinstance(name, str) or not name.strip():
        raise InvalidInputError("enter your name to start", "name")
    name = " ".join(name.split())[:80]
    seed = secrets.randbelow(2**31)
    cap, chosen = assignment.admit(test), assignment.items_for(store, test, seed)
    plan = [e for e in make_plan(test["kind"], test["spec"]["items"], seed) if chosen is None or e["item"] in chosen]
    try:
        return store.add_rater(test_id, name, seed, plan, max_raters=cap)
    except AlreadyExistsError as exc:
        raise AlreadyExistsError(f"a rater named {name!r} has started this test already: to go on, open your "
                                 "personal link (or this page in the browser you started in); otherwise choose "
                                 "another name", "name") from exc


def entry_at(rater: Rater, position: object) -> dict[str, Any]:
    if not isinstance(position, int) or isinstance(position, bool) or not 0 <= position < len(rater.plan):
        raise InvalidInputError(f"position must be 0..{len(rater.plan) - 1}", "position")
    return rater.plan[position]


def next_item(store: TakeStore, rater: Rater, *, view: bool = True) -> dict[str, Any]:
    """What the page shows next: the first unanswered item, or done. With ``view`` its view is recorded (time spent
    starts); ``viewed`` says whether it was shown before, ``played`` which of its slots the server saw play to the
    end (a page reloaded mid-item shows them played)."""
    test = store.test(rater.test)
    answered = {a.position for a in store.answers(rater_id=rater.id)}
    total = len(rater.plan)
    state = {"test": test["id"], "title": test["title"], "kind": test["kind"], "rater": rater.name,
             "answered": len(answered), "total": total, "allow_none": bool(test["spec"].get("allow_none"))}
    for position, entry in enumerate(rater.plan):
        if position not in answered:
            events = store.events(rater.id, position)
            viewed = any(kind == "view" for _, kind, _ in events)
            if view and not viewed:
                store.add_event(rater.id, position, "", "view")
            lo, hi = SCALES.get(test["kind"], (None, None))
            slots = [{"slot": s["slot"], "rated": s["role"] != "reference"} for s in entry["slots"]]
            played = [s["slot"] for s in entry["slots"]
                      if played_through(events, s["slot"], store.take(s["take"]).seconds)]
            return {**state, "done": False, "position": position, "slots": slots, "scale": [lo, hi],
                    "viewed": viewed, "played": played}
    asked = test["spec"].get("questionnaire", False)
    return {**state, "done": True,
            "questionnaire": None if not asked else "given" if rater.questionnaire is not None else "pending"}


def answer_questionnaire(store: TakeStore, rater: Rater, payload: object) -> dict[str, Any]:
    """The end-of-test questionnaire, once every item is answered; the same answers again are accepted, others
    refused (like answers, they are final)."""
    if not store.test(rater.test)["spec"].get("questionnaire", False):
        raise InvalidInputError("this test has no questionnaire", "questionnaire")
    if len(store.answers(rater_id=rater.id)) < len(rater.plan):
        raise InvalidInputError("answer every item first; the questionnaire comes at the end", "questionnaire")
    if not isinstance(payload, dict) or payload.get("listening_device") not in LISTENING_DEVICES:
        raise InvalidInputError(f"say what you listened with: {', '.join(LISTENING_DEVICES)}", "listening_device")
    language = payload.get("native_language")
    if not isinstance(language, str) or not language.strip() or len(language) > 80:
        raise InvalidInputError("enter your native language (at most 80 characters)", "native_language")
    answers = {"listening_device": payload["listening_device"], "native_language": " ".join(language.split())}
    if rater.questionnaire is not None and {k: rater.questionnaire[k] for k in answers} != answers:
        raise ConflictError("the questionnaire is answered already", "questionnaire")
    if rater.questionnaire is None:
        store.set_questionnaire(rater.id, {**answers, "at": round(store.clock(), 3)})
    return next_item(store, store.rater(rater.id))


def slot_take(store: TakeStore, rater: Rater, position: object, slot: object) -> Take:
    """The take a rater's slot plays (the server's secret: the rater's page knows only the slot's name)."""
    take_id = next((x["take"] for x in entry_at(rater, position)["slots"] if x["slot"] == slot), None)
    if take_id is None:
        raise InvalidInputError(f"no sample {slot!r} in this item", "slot")
    return store.take(take_id)


def record_play(store: TakeStore, rater: Rater, position: object, slot: object, kind: object) -> None:
    """A play or ended event of one slot, on the server's clock."""
    entry = entry_at(rater, position)
    if kind not in ("play", "ended"):
        raise InvalidInputError("event must be 'play' or 'ended'", "event")
    if slot not in {s["slot"] for s in entry["slots"]}:
        raise InvalidInputError(f"no sample {slot!r} in this item", "slot")
    store.add_event(rater.id, position, str(slot), str(kind))


def played_through(events: list[tuple[str, str, float]], slot: str, seconds: float) -> bool:
    """Whether some 'ended' of ``slot`` came at least the take's length (less a small tolerance) after the
    'play' before it, by the server's clock: a seek to the end or a faster playback rate does not count."""
    started = None
    for s, kind, at in events:
        if s != slot:
            continue
        if kind == "play":
            started = at
        elif kind == "ended" and started is not None:
            if at - started >= seconds - LISTEN_TOLERANCE_SECONDS:
                return True
            started = None
    return False


def submit(store: TakeStore, rater: Rater, position: object, payload: object) -> Answer:
    """Check listen-gating and the answer's range, convert it to canonical form, store it (one transaction). The
    same answer sent again is accepted as it was (idempotent)."""
    entry = entry_at(rater, position)
    test = store.test(rater.test)
    kind, item = test["kind"], test["spec"]["items"][entry["item"]]
    events = store.events(rater.id, position)  # type: ignore[arg-type]
    unplayed = [s["slot"] for s in entry["slots"]
                if not played_through(events, s["slot"], store.take(s["take"]).seconds)]
    if unplayed:
        raise InvalidInputError(f"play {', '.join(unplayed)} to the end first; only then does your rating count",
                                "answer")
    if not isinstance(payload, dict):
        raise InvalidInputError("answer must be an object", "answer")
    answer, failed = _canonical(kind, entry, item, payload, bool(test["spec"].get("allow_none")))
    saved = next((a for a in store.answers(rater_id=rater.id) if a.position == position), None)
    if saved is not None:  # a page retrying a save whose reply it lost gets the same reply; a changed answer is refused
        if saved.answer != answer:
            raise ConflictError("this item is answered already; answers are final", "position")
        return saved
    views = [at for s, k, at in events if k == "view"]
    now = store.clock()
    record = Answer(test["id"], rater.id, position, entry["item"], answer,  # type: ignore[arg-type]
                    round(now - (views[0] if views else now), 3), sum(k == "play" for _, k, _ in events), failed,
                    now)
    store.add_answer(record)
    return record


def _score(value: object, kind: str) -> int | float:
    lo, hi = SCALES[kind]
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not lo <= value <= hi or (
            kind != "mushra" and kind != "mushra_noref" and value != int(value)):
        raise InvalidInputError(f"a rating must be {'a whole number ' if lo < 0 or hi == 5 else ''}from {lo} to "
                                f"{hi}", "answer")
    return value


def _canonical(kind: str, entry: dict[str, Any], item: dict[str, Any], payload: dict[str, Any],
               allow_none: bool) -> tuple[dict[str, Any], bool | None]:
    check = item.get("check")
    slots = {s["slot"]: s for s in entry["slots"]}
    if kind == "ab":
        choice = payload.get("choice")
        if choice == "none" and allow_none:
            chosen = "none"
        elif choice in ("A", "B"):
            chosen = slots[choice]["take"]
        else:
            raise InvalidInputError("choose A or B" + (" or no preference" if allow_none else ""), "answer")
        return {"choice": chosen, "shown": choice}, None if check is None else chosen != check["expect"]
    if kind == "abx":
        if payload.get("choice") not in ("A", "B"):
            raise InvalidInputError("say whether X is A or B", "answer")
        chosen, x = slots[payload["choice"]]["take"], slots["X"]["take"]
        return {"chosen": chosen, "x": x, "correct": chosen == x, "shown": payload["choice"]}, None
    if kind in ("mos", "cmos"):
        shown = _score(payload.get("score"), kind)
        # CMOS asks "B compared with A"; canonical: the stimulus compared with the reference
        score = -shown if kind == "cmos" and slots["A"]["role"] == "stimulus" else shown
        failed = None if check is None else not check.get("min", -math.inf) <= score <= check.get("max", math.inf)
        return {"score": score, "shown": shown}, failed
    given = payload.get("scores")
    rated = [s for s in entry["slots"] if s["role"] != "reference"]
    if not isinstance(given, dict) or set(given) != {s["slot"] for s in rated}:
        raise InvalidInputError("rate every sample", "answer")
    scores = [{"take": s["take"], "role": s["role"], "score": _score(given[s["slot"]], kind)} for s in rated]
    failed = None
    hidden = [s["score"] for s in scores if s["role"] == "hidden_reference"]
    anchor = [s["score"] for s in scores if s["role"] == "anchor"]
    if hidden:
        failed = hidden[0] < HIDDEN_REFERENCE_MIN
    elif anchor:
        failed = anchor[0] > min(s["score"] for s in scores if s["role"] == "stimulus")
    return {"scores": scores}, failed


def create_test(store: TakeStore, kind: str, items: list[dict[str, Any]], *, title: str = "",
                instructions: str = "", allow_none: bool = False, name: str = "",
                limits: Limits | None = None, owner: str | None = None,
                training: list[dict[str, str]] | None = None, questionnaire: bool = True,
                settings: dict[str, Any] | None = None) -> str:
    """Store ``owner``'s test over ``items`` (from :func:`design` or :func:`check_items`). ``title`` and
    ``instructions`` are what raters see (a neutral title and the kind's standard wording by default: the owner's
    working ``name``, which often names the systems compared, is never shown to them). These three and the
    number of items are bounded by ``limits``: every rater's page carries the title and instructions, every
    rater's plan the items. ``training``: labelled examples raters hear before the first item (from
    :func:`check_training`); ``questionnaire``: ask each rater at the end what they listened with and their native
    language (``raters.csv``); ``settings``: who joins and which items each rater gets
    (:mod:`cosyvoice.workbench.assignment`)."""
    _check_kind(kind)
    chosen = assignment.check_settings(settings or {})
    if not all(isinstance(x, str) for x in (title, instructions, name)):
        raise InvalidInputError("name, title and instructions must be text", "title")
    limits = limits or Limits.from_env()
    _bounded(items, limits)  # designed from labels, as listed
    for field, value, setting in (("name", name, "max_test_title_chars"), ("title", title, "max_test_title_chars"),
                                  ("instructions", instructions, "max_test_instructions_chars")):
        bound = getattr(limits, setting)
        if len(value) > bound:
            raise InvalidInputError(f"the {field} has {len(value)} characters; at most {bound} are allowed "
                                    f"({env_name(setting)})", field)
    return store.add_test(kind, title.strip() or PUBLIC_TITLE, instructions.strip() or DEFAULT_INSTRUCTIONS[kind],
                          {"allow_none": bool(allow_none) and kind == "ab", "items": items,
                           "name": name.strip() or f"{kind.upper()} test", "training": training or [],
                           "questionnaire": bool(questionnaire), **chosen}, owner)


def owner_name(test: dict[str, Any]) -> str:
    """The owner's name for a test (tests made before names existed: their title)."""
    return test["spec"].get("name") or test["title"]
