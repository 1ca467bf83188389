"""A listening test's records in the take store's database: tests, their raters, play events and answers, and the
takes' objective scores. A base of :class:`~cosyvoice.takes.store.TakeStore` (one database, one lock, one clock),
apart to keep that class small; the listening tests themselves are :mod:`cosyvoice.workbench.listening`'s.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from cosyvoice.errors import AlreadyExistsError, ConflictError, InvalidInputError, NotFoundError, PermissionDeniedError
from cosyvoice.owners import LOCAL, Caller

# test and rater ids are the only secret of a rater's link (the API-key gates let raters in without a key):
# 128 random bits, unguessable; take and batch ids stay short names behind the key
LINK_ID_BYTES = 16


def new_id(prefix: str, nbytes: int = 6) -> str:
    """A random id that says what it names (``take-…``, ``test-…``): short where it is only a name."""
    return f"{prefix}-{secrets.token_hex(nbytes)}"


@dataclass(frozen=True)
class Rater:
    id: str
    test: str
    name: str
    created: float
    seed: int
    plan: list[dict[str, Any]]
    questionnaire: dict[str, Any] | None = None


@dataclass(frozen=True)
class Answer:
    test: str
    rater: str
    position: int
    item: int
    answer: Any
    seconds: float
    plays: int
    check_failed: bool | None
    created: float


class RatingRecords:
    """Tests, raters, events, answers and scores, written through the store's ``_tx`` and read through its
    ``_rows``, timed by its ``clock``."""

    clock: Callable[[], float]
    _tx: Callable[[], AbstractContextManager[sqlite3.Connection]]
    _rows: Callable[..., list[sqlite3.Row]]

    def add_test(self, kind: str, title: str, instructions: str, spec: dict[str, Any], owner: str | None = None) -> str:
        test_id = new_id("test", LINK_ID_BYTES)
        with self._tx() as db:
            db.execute("INSERT INTO tests (id, created, kind, title, instructions, spec, owner) VALUES (?,?,?,?,?,?,?)",
                       (test_id, self.clock(), kind, title, instructions, json.dumps(spec), owner))
        return test_id

    def test(self, test_id: str, caller: Caller = LOCAL) -> dict[str, Any]:
        """The test ``test_id`` as its owner sees it, if ``caller`` may (raters reach theirs through the link, as
        the local caller)."""
        rows = self._rows("SELECT * FROM tests WHERE id=?", test_id)
        if not rows or not caller.sees(rows[0]["owner"]):
            raise NotFoundError(f"no test {test_id!r}", "test")
        return {**dict(rows[0]), "spec": json.loads(rows[0]["spec"])}

    def tests(self, caller: Caller = LOCAL) -> list[dict[str, Any]]:
        return [{**dict(r), "spec": json.loads(r["spec"])} for r in self._rows("SELECT * FROM tests ORDER BY created")
                if caller.sees(r["owner"])]

    def update_test(self, test_id: str, caller: Caller, changes: dict[str, Any]) -> dict[str, Any]:
        """Change settings of a test that ``caller`` owns (merged into its spec); the test as it is then."""
        test = self.test(test_id, caller)
        if not caller.owns(test["owner"]):
            raise PermissionDeniedError("only the test's owner (or an admin) may change it", "test")
        spec = {**test["spec"], **changes}
        with self._tx() as db:
            db.execute("UPDATE tests SET spec=? WHERE id=?", (json.dumps(spec), test_id))
        return {**test, "spec": spec}

    def delete_test(self, test_id: str, caller: Caller = LOCAL) -> dict[str, Any]:
        """Delete a test that ``caller`` owns, with its raters, their play events and answers (its takes stay)."""
        test = self.test(test_id, caller)
        if not caller.owns(test["owner"]):
            raise PermissionDeniedError("only the test's owner (or an admin) may delete it", "test")
        with self._tx() as db:
            raters = "SELECT id FROM raters WHERE test=?"
            db.execute(f"DELETE FROM events WHERE rater IN ({raters})", (test_id,))
            db.execute("DELETE FROM answers WHERE test=?", (test_id,))
            db.execute("DELETE FROM raters WHERE test=?", (test_id,))
            db.execute("DELETE FROM tests WHERE id=?", (test_id,))
        return test

    def add_rater(self, test_id: str, name: str, seed: int, plan: list[dict[str, Any]], max_raters: int = 0) -> Rater:
        """A new rater of ``test_id``; a name already taken in that test raises :class:`AlreadyExistsError`, a test
        that has ``max_raters`` (0: no cap) already a :class:`ConflictError` (counted in the same transaction)."""
        rater = Rater(new_id("rater", LINK_ID_BYTES), test_id, name, self.clock(), seed, plan)
        try:
            with self._tx() as db:
                if max_raters and db.execute("SELECT COUNT(*) FROM raters WHERE test=?", (test_id,)).fetchone()[0] \
                        >= max_raters:
                    raise ConflictError(f"this test has all the raters it takes ({max_raters})", "test")
                db.execute("INSERT INTO raters (id, test, name, created, seed, plan) VALUES (?,?,?,?,?,?)",
                           (rater.id, test_id, name, rater.created, seed, json.dumps(plan)))
        except sqlite3.IntegrityError as exc:
            raise AlreadyExistsError(f"a rater named {name!r} has started this test already", "name") from exc
        return rater

    def rater(self, rater_id: str) -> Rater:
        rows = self._rows("SELECT * FROM raters WHERE id=?", rater_id)
        if not rows:
            raise NotFoundError("no such rater: use the test's link to start again", "rater")
        return _rater(rows[0])

    def set_questionnaire(self, rater_id: str, answers: dict[str, Any]) -> None:
        """The rater's end-of-test answers (kept with the rater: one per rater, exported in raters.csv)."""
        with self._tx() as db:
            db.execute("UPDATE raters SET questionnaire=? WHERE id=?", (json.dumps(answers), rater_id))

    def raters(self, test_id: str) -> list[Rater]:
        return [_rater(r) for r in self._rows("SELECT * FROM raters WHERE test=? ORDER BY created", test_id)]

    # ------------------------------------------------------------------ events and answers

    def add_event(self, rater_id: str, position: int, slot: str, kind: str) -> float:
        at = self.clock()
        with self._tx() as db:
            db.execute("INSERT INTO events (rater, position, slot, kind, at) VALUES (?,?,?,?,?)",
                       (rater_id, position, slot, kind, at))
        return at

    def events(self, rater_id: str, position: int) -> list[tuple[str, str, float]]:
        """(slot, kind, time) of one item's events, in order."""
        return [(r["slot"], r["kind"], r["at"]) for r in
                self._rows("SELECT slot, kind, at FROM events WHERE rater=? AND position=? ORDER BY id", rater_id,
                           position)]

    def add_answer(self, answer: Answer) -> None:
        """One answer, in one transaction; a second answer to the same item is refused (answers are final)."""
        try:
            with self._tx() as db:
                db.execute("INSERT INTO answers (test, rater, position, item, answer, seconds, plays, check_failed, "
                           "created) VALUES (?,?,?,?,?,?,?,?,?)",
                           (answer.test, answer.rater, answer.position, answer.item, json.dumps(answer.answer),
                            answer.seconds, answer.plays, None if answer.check_failed is None else
                            int(answer.check_failed), answer.created))
        except sqlite3.IntegrityError as exc:
            raise InvalidInputError("this item is answered already", "position") from exc

    def answers(self, *, test_id: str | None = None, rater_id: str | None = None) -> list[Answer]:
        sql, args = "SELECT * FROM answers WHERE 1=1", []
        if test_id is not None:
            sql, args = sql + " AND test=?", [*args, test_id]
        if rater_id is not None:
            sql, args = sql + " AND rater=?", [*args, rater_id]
        return [Answer(r["test"], r["rater"], r["position"], r["item"], json.loads(r["answer"]), r["seconds"],
                       r["plays"], None if r["check_failed"] is None else bool(r["check_failed"]), r["created"])
                for r in self._rows(sql + " ORDER BY id", *args)]


    # ------------------------------------------------------------------ objective scores

    def put_scores(self, scores: dict[str, dict[str, float | None]]) -> None:
        """Each take's scorecard (replacing an older one), in one transaction."""
        with self._tx() as db:
            db.executemany("INSERT OR REPLACE INTO scores (take, scores, created) VALUES (?,?,?)",
                           [(take_id, json.dumps(values), self.clock()) for take_id, values in scores.items()])

    def scores(self) -> dict[str, dict[str, float | None]]:
        return {r["take"]: json.loads(r["scores"]) for r in self._rows("SELECT take, scores FROM scores")}


def _rater(row: sqlite3.Row) -> Rater:
    return Rater(row["id"], row["test"], row["name"], row["created"], row["seed"], json.loads(row["plan"]),
                 json.loads(row["questionnaire"]) if row["questionnaire"] else None)
