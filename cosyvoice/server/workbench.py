"""The listening-test workbench over HTTP: a FastAPI router (REST API + the rater and owner pages).

Mounted by the REST server (``create_app``) and by the web UI's Gradio app, so both serve the same store:

* pages: ``/workbench/`` (owner: takes, batches, tests), ``/workbench/tests/{id}`` (owner: progress, results,
  plots, export), ``/workbench/rate/{id}`` (the link raters get);
* API under ``/workbench/api``: takes (incremental with ``?after=``), batches (jobs of :mod:`cosyvoice.jobs`:
  progress, ETA, per-row errors, ``/cancel``, ``/resume`` of an interrupted one), tests, raters, play events,
  answers, results, ``answers.csv`` and ``takes.csv``.

Raters reach their samples through ``/workbench/api/raters/{rater}/audio/{position}/{slot}``, which names no
take, so a page never reveals which system it plays. Errors have the REST server's JSON shape.

Behind API keys, a rater needs only the link: :func:`rater_route` names what a rater's page reaches, and the
apps hand it to both gates (the REST server's and the web UI's), which let exactly that through without a key.
The link's test id and the rater id the page then holds are the only secrets, so they are drawn with 128 random
bits; a rater's name never resumes a rater (only its id does).

Everything else belongs to its owner (:mod:`cosyvoice.owners`): takes, batches and tests are listed, read,
played and exported only by callers who may see them (the server's sharing; admins see all); another owner's
are "not found". Takes and tests are deleted by their owner (a take a test uses is refused, naming the test).
Long-form's takes are takes of the same store (owned by their project's owner, labelled with its name), so they
are listed, played, put in tests and deleted here like any other.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict
from starlette.routing import compile_path

from cosyvoice.context import StudioContext
from cosyvoice.encoding import encode_audio, file_format
from cosyvoice.errors import InvalidInputError, NotFoundError
from cosyvoice.jobs import JobRunner
from cosyvoice.owners import Caller
from cosyvoice.server.errors import error_route
from cosyvoice.server.routes import RouteTable
from cosyvoice.takes.export import TAKES_CSV_COLUMNS, takes_csv_rows, write_csv
from cosyvoice.takes.store import SCORE_METRICS, Take, TakeStore, test_take_ids
from cosyvoice.workbench import assignment, listening, listening_results, screening
from cosyvoice.workbench.batch import (
    batch_status,
    body_rows,
    check_precisions,
    submit_batch,
)
from cosyvoice.workbench.scorecard import scorecard

STATIC = Path(__file__).resolve().parents[1] / "workbench" / "static"
PAGES = {"owner": "owner.html", "results": "results.html", "rate": "rate.html"}
ASSETS = {"workbench.css": "text/css", "common.js": "text/javascript", "i18n.js": "text/javascript",
          "player.js": "text/javascript"}
# What a rater with only a test's link reaches (method, route under /workbench): the rate page and what it loads,
# the test's rater view (no take ids), joining, and the rater's own items, events, answers and audio. Not the owner
# and results pages, results, exports, scorecards, takes, batches, nor the list or creation of tests.
RATER_ROUTES = (("GET", "/rate/{test_id}"), *(("GET", f"/static/{name}") for name in ASSETS),
                ("GET", "/api/tests/{test_id}"), ("GET", "/api/tests/{test_id}/training/{n}"),
                ("POST", "/api/tests/{test_id}/raters"),
                ("GET", "/api/raters/{rater_id}/next"), ("POST", "/api/raters/{rater_id}/events"),
                ("POST", "/api/raters/{rater_id}/answers"), ("GET", "/api/raters/{rater_id}/audio/{position}/{slot}"),
                ("POST", "/api/raters/{rater_id}/questionnaire"))
_RATER_PATTERNS = tuple((method, compile_path("/workbench" + route)[0]) for method, route in RATER_ROUTES)


def rater_route(method: str, path: str) -> bool:
    """Whether a request may pass an API-key gate without a key: it is one a rater's page makes (``path`` as the
    app routes it, after any proxy's ``root_path``; matched as the router matches it, no trailing newline)."""
    return any(method == m and pattern.fullmatch(path) for m, pattern in _RATER_PATTERNS)


class Workbench:
    """What one mounted router serves, all of it the process's :class:`StudioContext`'s: the take store and the job
    runner, the service (asked only for batches and scorecards, so rating works while a model loads), the scorecard's
    models, input limits and who callers are."""

    def __init__(self, context: StudioContext) -> None:
        self.context = context
        self.service, self.scorer, self.limits, self.owners = (context.service, context.scorer, context.limits,
                                                               context.owners)

    def store(self) -> TakeStore:
        return self.context.takes

    def jobs(self) -> JobRunner:
        """The job runner of the data folder (shared with long-form; it makes batch rows once the model is loaded)."""
        return self.context.jobs

    def test_takes(self, test_id: str, caller: Caller) -> list[Take]:
        """Every take a test of ``caller``'s plays (its items' takes, references and anchors), each once."""
        s = self.store()
        return [s.take(t) for t in test_take_ids(s.test(test_id, caller)["spec"])]


def workbench_router(context: StudioContext) -> APIRouter:
    """The routes below over the process's ``context`` (its take store, jobs, service, limits and owners),
    mountable on any app (the REST server's, the web UI's)."""
    return routes.install(Workbench(context), prefix="/workbench", tags=["workbench"], route_class=error_route())


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NewTest(_Body):
    """A test over ``items`` (explicit take ids) or ``conditions`` (take labels; items are designed text by
    text, with ``reference`` / ``anchor`` labels)."""

    kind: str
    name: str = ""  # the owner's working name; raters see only ``title`` and ``instructions``
    title: str = ""
    instructions: str = ""
    allow_none: bool = False
    items: list[Any] | None = None
    conditions: list[str] | None = None
    reference: str | None = None
    anchor: str | None = None
    training: list[Any] | None = None  # labelled examples before the first item: [{"take": id, "label": text}]
    questionnaire: bool = True  # ask each rater's listening device and native language at the end
    items_per_rater: int = 0  # each rater gets this many items, balanced (0: all; cosyvoice.workbench.assignment)
    max_raters: int = 0  # 0: no cap


class TestChange(_Body):
    """What an owner may change on a running test: close it (or open it again), cap its raters."""

    closed: bool | None = None
    max_raters: int | None = None


class Joining(_Body):
    name: str = ""


class PlayEvent(_Body):
    position: int
    slot: str
    event: str


class Rating(_Body):
    position: int
    answer: Any = None


class Questionnaire(_Body):
    listening_device: str = ""
    native_language: str = ""


def _csv_file(rows: list[dict[str, Any]], columns: Iterable[str], name: str) -> Response:
    out = io.StringIO()
    write_csv(out, rows, columns)
    return Response(out.getvalue(), media_type="text/csv",
                    headers={"Content-Disposition": f'attachment; filename="{name}"'})


routes = RouteTable("workbench")
Bench = Annotated[Workbench, Depends(routes.state)]


def _caller(wb: Bench, request: Request) -> Caller:
    return wb.owners.behind_gate(request)


Who = Annotated[Caller, Depends(_caller)]


def _page(wb: Workbench, request: Request, name: str) -> HTMLResponse:
    """A page; without keys it gives the browser its identity, which owns what the browser makes."""
    return wb.owners.introduce(request, HTMLResponse((STATIC / PAGES[name]).read_text(encoding="utf-8"),
                                                     headers={"Cache-Control": "no-store"}))

# ------------------------------------------------------------------ pages


@routes.get("/static/{name}", include_in_schema=False)
def asset(name: str) -> Response:
    if name not in ASSETS:
        return Response(status_code=404)
    return Response((STATIC / name).read_bytes(), media_type=ASSETS[name])


@routes.get("/", include_in_schema=False)
def owner_page(wb: Bench, request: Request) -> HTMLResponse:
    return _page(wb, request, "owner")


@routes.get("/tests/{test_id}", include_in_schema=False)
def results_page(wb: Bench, request: Request, test_id: str) -> HTMLResponse:
    return _page(wb, request, "results")


@routes.get("/rate/{test_id}", include_in_schema=False)
def rate_page(wb: Bench, request: Request, test_id: str) -> HTMLResponse:
    return _page(wb, request, "rate")


# ------------------------------------------------------------------ takes and batches


@routes.get("/api/takes")
def takes(wb: Bench, who: Who, after: int = 0, batch: str | None = None, mine: bool = False,
          limit: int = 500) -> Any:
    """Takes made after ``after`` (a seq) that the caller may see: a page asks only for what is new. ``mine``:
    only the caller's own (the web UI's "this browser": a visitor is its browser, cosyvoice.owners)."""
    items = wb.store().visible_takes(who, mine=mine, after=after, batch=batch, limit=max(1, min(limit, 5000)))
    return {"takes": [t.json() for t in items], "last": items[-1].seq if items else after}


@routes.get("/api/takes/page")
def take_page(wb: Bench, who: Who, offset: int = 0, limit: int = 50, batch: str = "", label: str = "",
              text: str = "") -> Any:
    """The owner page's take table: one page, newest first, filtered; with the total, every label, and whether
    the caller sees this machine's own takes (the batch CLI's), so the page can say how to see them."""
    store = wb.store()
    items, total = store.take_page(who, offset=max(0, offset), limit=max(1, min(limit, 500)), batch=batch,
                                   label=label, text=text)
    return {"takes": [t.json() for t in items], "total": total, "offset": max(0, offset),
            "labels": store.take_labels(who), "machine": who.sees_all or who.local}


@routes.get("/api/takes.csv")
def takes_csv(wb: Bench, who: Who, batch: str | None = None) -> Response:
    return _csv_file(takes_csv_rows(wb.store().visible_takes(who, batch=batch, limit=1_000_000)), TAKES_CSV_COLUMNS,
                     "takes.csv")


@routes.get("/api/takes/{take_id}/audio")
def take_audio(wb: Bench, who: Who, take_id: str, format: str | None = None) -> Any:
    """A take's audio as stored (float32 WAV; 16-bit for older takes: what players fetch, with range requests),
    or, for a download, encoded to ``format`` (wav: 16-bit PCM, as the studio's Download box and ZIP give it;
    mp3, opus, flac, ...) under the name those give it, ``take-...seed<seed>``."""
    store = wb.store()
    take = store.take(take_id, who)
    if format is None:
        return FileResponse(store.audio_path(take), media_type="audio/wav", filename=f"{take.id}.wav")
    fmt = file_format(format)
    name = f"take-seed{take.provenance.get('seed')}-{take.id}.{fmt.extension}"
    return Response(encode_audio(store.read_audio(take), fmt.name, take.sample_rate), media_type=fmt.content_type,
                    headers={"Content-Disposition": f'attachment; filename="{name}"'})


@routes.delete("/api/takes/{take_id}")
def delete_take(wb: Bench, who: Who, take_id: str) -> Any:
    """The caller's own take, with its audio; refused (409) while a listening test uses it. A long-form take goes
    from its project too (a segment whose chosen take it was has no audio until generated again): the answer
    says so."""
    take = wb.store().delete_take(take_id, who)
    if take.longform is None:
        return {"deleted": take.id}
    return {"deleted": take.id, "longform": take.longform,
            "note": f"a take of the long-form project {take.label!r}: if it was its segment's chosen take, that "
                    "segment has no audio until it is generated again"}


@routes.post("/api/batches", status_code=202)
async def start_batch(wb: Bench, who: Who, request: Request) -> Any:
    """A CSV or JSONL body (or JSON ``{"rows": [...]}``): the batch runs as a job; poll its id. Rows naming a
    precision must name the one this server runs (400 otherwise: the batch CLI runs several)."""
    owner = who.owner
    parsed = body_rows(await request.body(), request.headers.get("content-type", ""), wb.limits)
    svc = wb.service()
    check_precisions(svc, parsed)
    batch_id = submit_batch(wb.jobs(), wb.store(), parsed,
                            source="http", owner=owner)
    return JSONResponse({"id": batch_id, "rows": len(parsed)}, 202)


@routes.get("/api/batches")
def batches(wb: Bench, who: Who) -> Any:
    """The caller's newest batches with their states, newest first: after a reload or a restart the owner page
    finds a running or interrupted batch here."""
    store, jobs, found = wb.store(), wb.jobs(), []
    for batch_id in store.batches(who):
        with contextlib.suppress(NotFoundError):  # a batch from before jobs existed has no state to show
            found.append(batch_status(jobs, store, batch_id))
    return {"batches": found}


@routes.get("/api/batches/{batch_id}")
def batch(wb: Bench, who: Who, batch_id: str) -> Any:
    wb.store().batch(batch_id, who)
    return batch_status(wb.jobs(), wb.store(), batch_id)


@routes.post("/api/batches/{batch_id}/cancel")
def cancel_batch(wb: Bench, who: Who, batch_id: str) -> Any:
    """Stop a batch (from any server on this data folder); the takes made stay."""
    wb.store().batch(batch_id, who)
    wb.jobs().cancel(batch_id)
    return batch_status(wb.jobs(), wb.store(), batch_id)


@routes.post("/api/batches/{batch_id}/resume")
def resume_batch(wb: Bench, who: Who, batch_id: str) -> Any:
    """Continue an interrupted batch (its server stopped) from its first row without a take."""
    wb.store().batch(batch_id, who)
    wb.service()  # its rows are made with the model: refused while it loads
    wb.jobs().resume(batch_id)
    return batch_status(wb.jobs(), wb.store(), batch_id)


# ------------------------------------------------------------------ tests (owner)


@routes.get("/api/tests")
def tests(wb: Bench, who: Who) -> Any:
    s = wb.store()
    return {"tests": [{"id": t["id"], "kind": t["kind"], "name": listening.owner_name(t), "title": t["title"],
                       "created": t["created"], "items": len(t["spec"]["items"]),
                       "raters": listening_results.progress(s, t["id"]), "closed": bool(t["spec"].get("closed")),
                       **{k: t["spec"].get(k, 0) for k in assignment.SETTINGS}}
                      for t in s.tests(who)]}


@routes.post("/api/tests", status_code=201)
def create_test(wb: Bench, who: Who, spec: NewTest) -> Any:
    s = wb.store()
    if spec.items is not None:
        items = listening.check_items(spec.kind, spec.items, s, who, wb.limits)
    elif spec.conditions is not None:
        items = listening.design(spec.kind, s.visible_takes(who, limit=1_000_000), spec.conditions,
                                 reference=spec.reference, anchor=spec.anchor)
    else:
        raise InvalidInputError("give 'conditions' (take labels) or 'items'", "conditions")
    training = listening.check_training(spec.training, s, who, wb.limits) if spec.training else None
    test_id = listening.create_test(s, spec.kind, items, name=spec.name, title=spec.title,
                                    instructions=spec.instructions,
                                    allow_none=spec.allow_none, limits=wb.limits, owner=who.owner,
                                    training=training, questionnaire=spec.questionnaire,
                                    settings={"items_per_rater": spec.items_per_rater, "max_raters": spec.max_raters})
    return JSONResponse({"id": test_id, "items": len(items), "rate_url": f"/workbench/rate/{test_id}",
                         "results_url": f"/workbench/tests/{test_id}"}, 201)


def _screened(s: TakeStore, test: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]],
                                                           list[dict[str, Any]]]:
    """A test's answer rows, its raters' progress and their screening (:mod:`cosyvoice.workbench.screening`)."""
    rows, progress = listening_results.export_rows(s, test["id"]), listening_results.progress(s, test["id"])
    return rows, progress, screening.screen(rows, progress, listening.SCALES.get(test["kind"]))


@routes.patch("/api/tests/{test_id}")
def change_test(wb: Bench, who: Who, test_id: str, change: TestChange) -> Any:
    """Close a test to new raters (or open it again) and cap its raters; by its owner."""
    changes = change.model_dump(exclude_none=True)
    if change.max_raters is not None:
        changes["max_raters"] = assignment.check_settings({"max_raters": change.max_raters})["max_raters"]
    test = wb.store().update_test(test_id, who, changes)
    return {"id": test_id, "closed": bool(test["spec"].get("closed")), "max_raters": test["spec"].get("max_raters", 0)}


@routes.get("/api/tests/{test_id}/design.json")
def test_design(wb: Bench, who: Who, test_id: str) -> Any:
    """The test's design (kind, texts raters see, settings, items with their takes' labels): a body that
    ``POST /api/tests`` takes back, on a data folder holding the takes (this one, or a copy)."""
    s = wb.store()
    test = s.test(test_id, who)
    labels = s.existing(test_take_ids(test["spec"]))
    design = {"kind": test["kind"], "name": listening.owner_name(test), "title": test["title"],
              "instructions": test["instructions"], "allow_none": bool(test["spec"].get("allow_none")),
              "training": test["spec"].get("training", []), "questionnaire": bool(test["spec"].get("questionnaire")),
              **{k: test["spec"].get(k, 0) for k in assignment.SETTINGS},
              "items": [{**item, "labels": {t: labels[t].label for t in test_take_ids({"items": [item]})
                                            if t in labels}} for item in test["spec"]["items"]]}
    return JSONResponse(design, headers={"Content-Disposition": f'attachment; filename="{test_id}-design.json"'})


@routes.get("/api/tests/{test_id}/results")
def results(wb: Bench, who: Who, test_id: str) -> Any:
    """Progress, each rater's screening, and the statistics with every rater (``summary``) and without those
    screening flagged (``screened_summary``): the page applies the screening when the owner asks."""
    s = wb.store()
    test = s.test(test_id, who)
    rows, progress, screened = _screened(s, test)  # read once: both summaries are of these rows
    return {"id": test_id, "kind": test["kind"], "name": listening.owner_name(test), "title": test["title"],
            "items": len(test["spec"]["items"]), "progress": progress,
            "screening": {"rules": screening.RULES, "raters": screened},
            "summary": listening_results.summary(s, test_id, rows=rows),
            "screened_summary": listening_results.summary(s, test_id, exclude=screening.flagged(screened), rows=rows)}


@routes.get("/api/tests/{test_id}/answers.csv")
def answers_csv(wb: Bench, who: Who, test_id: str) -> Any:
    """One row per answer, with its rater's screening flags and acceptance."""
    rows, _, screened = _screened(wb.store(), wb.store().test(test_id, who))
    return _csv_file(screening.with_flags(rows, screened), (*listening_results.EXPORT_COLUMNS, *screening.COLUMNS),
                     f"{test_id}-answers.csv")


@routes.get("/api/tests/{test_id}/raters.csv")
def raters_csv(wb: Bench, who: Who, test_id: str) -> Any:
    """One row per rater: progress and the end-of-test questionnaire's answers."""
    wb.store().test(test_id, who)
    return _csv_file(listening_results.rater_rows(wb.store(), test_id), listening_results.RATER_COLUMNS,
                     f"{test_id}-raters.csv")


@routes.get("/api/tests/{test_id}/scorecard")
def test_scorecard(wb: Bench, who: Who, test_id: str) -> Any:
    """Objective measures of the test's takes, per take and per condition (computed now, then kept)."""
    takes = wb.test_takes(test_id, who)  # first: another owner's test is refused before models load
    return scorecard(wb.scorer(), takes)


@routes.get("/api/tests/{test_id}/scorecard.csv")
def test_scorecard_csv(wb: Bench, who: Who, test_id: str) -> Any:
    takes = wb.test_takes(test_id, who)
    card = scorecard(wb.scorer(), takes)
    return _csv_file(card["takes"], ["take_id", "condition", *SCORE_METRICS], f"{test_id}-scorecard.csv")


@routes.delete("/api/tests/{test_id}")
def delete_test(wb: Bench, who: Who, test_id: str) -> Any:
    """The caller's own test, with its raters and answers (its takes stay)."""
    return {"deleted": wb.store().delete_test(test_id, who)["id"]}


# ------------------------------------------------------------------ raters


@routes.get("/api/tests/{test_id}")
def test_info(wb: Bench, test_id: str) -> Any:
    """What a rater may see before starting: no take ids."""
    t = wb.store().test(test_id)
    return {"id": t["id"], "kind": t["kind"], "title": t["title"], "instructions": t["instructions"],
            "items": len(t["spec"]["items"]), "allow_none": t["spec"].get("allow_none", False),
            "training": [x["label"] for x in t["spec"].get("training", [])],
            "questionnaire": t["spec"].get("questionnaire", False),
            # the page translates only the wording the server filled in, never the owner's own words
            "standard_title": t["title"] == listening.PUBLIC_TITLE,
            "standard_instructions": t["instructions"] == listening.DEFAULT_INSTRUCTIONS[t["kind"]]}


@routes.get("/api/tests/{test_id}/training/{n}")
def training_audio(wb: Bench, test_id: str, n: int) -> Any:
    """The test's ``n``-th training example (0-based), blind like the items' samples."""
    s = wb.store()
    examples = s.test(test_id)["spec"].get("training", [])
    if not 0 <= n < len(examples):
        raise NotFoundError(f"no training example {n}", "n")
    return _blind_audio(s, s.take(examples[n]["take"]))


@routes.post("/api/tests/{test_id}/raters")
def join(wb: Bench, test_id: str, body: Joining) -> Any:
    rater = listening.join(wb.store(), test_id, body.name)
    return {"rater": rater.id, "name": rater.name, "resume_url": f"/workbench/rate/{test_id}?rater={rater.id}"}


@routes.get("/api/raters/{rater_id}/next")
def next_item(wb: Bench, rater_id: str, view: bool = True) -> Any:
    """The rater's next item; ``view=false`` looks without starting its clock (the page before the first item)."""
    s = wb.store()
    return listening.next_item(s, s.rater(rater_id), view=view)


@routes.post("/api/raters/{rater_id}/events")
def event(wb: Bench, rater_id: str, body: PlayEvent) -> Any:
    s = wb.store()
    listening.record_play(s, s.rater(rater_id), body.position, body.slot, body.event)
    return Response(status_code=204)


@routes.post("/api/raters/{rater_id}/questionnaire")
def questionnaire(wb: Bench, rater_id: str, body: Questionnaire) -> Any:
    s = wb.store()
    return listening.answer_questionnaire(s, s.rater(rater_id), body.model_dump())


@routes.post("/api/raters/{rater_id}/answers")
def submit(wb: Bench, rater_id: str, body: Rating) -> Any:
    s = wb.store()
    listening.submit(s, s.rater(rater_id), body.position, body.answer)
    return listening.next_item(s, s.rater(rater_id))


@routes.get("/api/raters/{rater_id}/audio/{position}/{slot}")
def rater_audio(wb: Bench, rater_id: str, position: int, slot: str) -> Any:
    """A slot's audio, blind: the bytes only, no file name, date or ETag (a take's creation time or a stable tag
    would let a rater tell conditions apart across items), and never cached."""
    s = wb.store()
    return _blind_audio(s, listening.slot_take(s, s.rater(rater_id), position, slot))


def _blind_audio(store: TakeStore, take: Take) -> Response:
    return Response(store.audio_path(take).read_bytes(), media_type="audio/wav", headers={"Cache-Control": "no-store"})
