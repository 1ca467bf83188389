"""The listening-test workbench over HTTP: a FastAPI router (REST API + the rater and owner pages).

Mounted by the REST server (``create_app``) and by the web UI's Gradio app, so both serve the same store:

* pages: ``/workbench/`` (owner: takes, batches, tests), ``/workbench/tests/{id}`` (owner: progress, results,
  plots, export), ``/workbench/rate/{id}`` (the link raters get);
* API under ``/workbench/api``: takes (incremental with ``?after=``), batches (jobs of :mod:`cosyvoice.jobs`:
  progress, ETA, per-row errors, ``/cancel``, ``/resume`` of an interrupted one), tests,
  raters, play events, answers, results, ``answers.csv`` and ``takes.csv``.

Raters reach their samples through ``/workbench/api/raters/{rater}/audio/{position}/{slot}``, which names no
take, so a page never reveals which system it plays. Errors have the REST server's JSON shape.

Behind API keys, a rater needs only the link: :func:`rater_route` names what a rater's page reaches, and both
gates (the REST server's and the web UI's) let exactly that through without a key. The link's test id and the
rater id the page then holds are the only secrets, so they are drawn with 128 random bits.
"""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.routing import compile_path

from cosyvoice.errors import InvalidInputError
from cosyvoice.jobs import JobRunner, runner
from cosyvoice.server.errors import error_route
from cosyvoice.service import TTSService
from cosyvoice.settings import Limits, key_owner
from cosyvoice.workbench import listening
from cosyvoice.workbench.batch import KIND as BATCH_KIND
from cosyvoice.workbench.batch import (
    TAKES_CSV_COLUMNS,
    batch_kind,
    batch_status,
    parse_rows,
    submit_batch,
    takes_csv_rows,
    write_csv,
)
from cosyvoice.workbench.scorecard import Scorer, scorecard
from cosyvoice.workbench.store import SCORE_METRICS, WorkbenchStore

STATIC = Path(__file__).resolve().parents[1] / "workbench" / "static"
PAGES = {"owner": "owner.html", "results": "results.html", "rate": "rate.html"}
ASSETS = {"workbench.css": "text/css", "common.js": "text/javascript", "i18n.js": "text/javascript"}
# What a rater with only a test's link reaches (method, route under /workbench): the rate page and what it loads,
# the test's rater view (no take ids), joining, and the rater's own items, events, answers and audio. Not the owner
# and results pages, results, exports, scorecards, takes, batches, nor the list or creation of tests.
RATER_ROUTES = (("GET", "/rate/{test_id}"), *(("GET", f"/static/{name}") for name in ASSETS),
                ("GET", "/api/tests/{test_id}"), ("POST", "/api/tests/{test_id}/raters"),
                ("GET", "/api/raters/{rater_id}/next"), ("POST", "/api/raters/{rater_id}/events"),
                ("POST", "/api/raters/{rater_id}/answers"), ("GET", "/api/raters/{rater_id}/audio/{position}/{slot}"))
_RATER_PATTERNS = tuple((method, compile_path("/workbench" + route)[0]) for method, route in RATER_ROUTES)


def rater_route(method: str, path: str) -> bool:
    """Whether a request may pass an API-key gate without a key: it is one a rater's page makes (``path`` as the
    app routes it, after any proxy's ``root_path``; matched as the router matches it, no trailing newline)."""
    return any(method == m and pattern.fullmatch(path) for m, pattern in _RATER_PATTERNS)


def request_owner(request: Request) -> str | None:
    """The service's owner string of an API-key client (``key:<sha256[:12]>``); None without a key."""
    auth = request.headers.get("authorization", "")
    token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    return key_owner(token) if token else None


def workbench_router(data_dir: str | Path, service: Callable[[], TTSService]) -> APIRouter:
    """The routes over the store in ``data_dir`` (opened on first use) and the service ``service()`` returns
    (called only for batches, so rating works while a model loads)."""
    router = APIRouter(prefix="/workbench", include_in_schema=True, tags=["workbench"], route_class=error_route())
    lock = threading.RLock()  # scorer() opens the store while holding it
    opened: dict[str, WorkbenchStore] = {}

    def store() -> WorkbenchStore:
        with lock:
            if "store" not in opened:
                opened["store"] = WorkbenchStore(data_dir)
            return opened["store"]

    def jobs(svc: TTSService | None = None) -> JobRunner:
        """The job runner of the data folder (shared with long-form in this process)."""
        with lock:
            if "jobs" not in opened:
                opened["jobs"] = runner(data_dir, (svc.limits if svc is not None else Limits.from_env()).job_workers)
            return opened["jobs"]

    def batch_jobs(svc: TTSService) -> JobRunner:
        """The runner, knowing how to make batch rows with ``svc``."""
        found = jobs(svc)
        found.register(BATCH_KIND, batch_kind(svc, store()))
        return found

    async def body(request: Request) -> dict[str, Any]:
        try:
            value = json.loads(await request.body() or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InvalidInputError("the body must be JSON", "body") from exc
        if not isinstance(value, dict):
            raise InvalidInputError("the body must be a JSON object", "body")
        return value

    # -------------------------------------------------------------- pages

    def page(name: str) -> HTMLResponse:
        return HTMLResponse((STATIC / PAGES[name]).read_text(encoding="utf-8"),
                            headers={"Cache-Control": "no-store"})

    @router.get("/static/{name}", include_in_schema=False)
    def asset(name: str) -> Response:
        if name not in ASSETS:
            return Response(status_code=404)
        return Response((STATIC / name).read_bytes(), media_type=ASSETS[name])

    @router.get("/", include_in_schema=False)
    def owner_page() -> HTMLResponse:
        return page("owner")

    @router.get("/tests/{test_id}", include_in_schema=False)
    def results_page(test_id: str) -> HTMLResponse:
        return page("results")

    @router.get("/rate/{test_id}", include_in_schema=False)
    def rate_page(test_id: str) -> HTMLResponse:
        return page("rate")

    # -------------------------------------------------------------- takes and batches

    @router.get("/api/takes")
    def takes(request: Request, after: int = 0, batch: str | None = None, mine: bool = False,
              browser: str | None = None, limit: int = 500) -> Any:
        """Takes made after ``after`` (a seq): a page asks only for what is new. ``mine``: only the API key's;
        ``browser``: only one browser's (the web UI stores its takes with owner ``browser:<id>``, the id a random
        one the page keeps in its local storage, so the history survives a reload)."""
        owner = f"browser:{browser}" if browser else request_owner(request)
        items = store().takes(owner=owner, any_owner=not (mine or browser), after=after, batch=batch,
                              limit=max(1, min(limit, 5000)))
        return {"takes": [t.json() for t in items], "last": items[-1].seq if items else after}

    @router.get("/api/takes.csv")
    def takes_csv(batch: str | None = None) -> Response:
        out = io.StringIO()
        write_csv(out, takes_csv_rows(store().takes(batch=batch, limit=1_000_000)), TAKES_CSV_COLUMNS)
        return Response(out.getvalue(), media_type="text/csv",
                        headers={"Content-Disposition": 'attachment; filename="takes.csv"'})

    @router.get("/api/takes/{take_id}/audio")
    def take_audio(take_id: str) -> Any:
        take = store().take(take_id)
        return FileResponse(store().audio_path(take), media_type="audio/wav", filename=f"{take.id}.wav")

    @router.post("/api/batches", status_code=202)
    async def start_batch(request: Request) -> Any:
        """A CSV or JSONL body (or JSON ``{"rows": [...]}``): the batch runs as a job; poll its id."""
        raw = await request.body()
        owner = request_owner(request)
        data: str | bytes = raw
        if request.headers.get("content-type", "").startswith("application/json"):
            rows = json.loads(raw or b"{}").get("rows") if raw.strip().startswith(b"{") else None
            if not isinstance(rows, list):
                raise InvalidInputError("send {\"rows\": [...]}, or the CSV/JSONL file as the body", "rows")
            data = "\n".join(json.dumps(r) for r in rows)
        parsed = parse_rows(data, "input.jsonl" if isinstance(data, str) else "")
        svc = service()
        batch_id = submit_batch(batch_jobs(svc), store(), parsed, max_rows=svc.limits.max_batch_rows, source="http",
                                owner=owner)
        return JSONResponse({"id": batch_id, "rows": len(parsed)}, 202)

    @router.get("/api/batches/{batch_id}")
    def batch(batch_id: str) -> Any:
        return batch_status(jobs(), store(), batch_id)

    @router.post("/api/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str) -> Any:
        """Stop a batch (from any server on this data folder); the takes made stay."""
        store().batch(batch_id)
        jobs().cancel(batch_id)
        return batch_status(jobs(), store(), batch_id)

    @router.post("/api/batches/{batch_id}/resume")
    def resume_batch(batch_id: str) -> Any:
        """Continue an interrupted batch (its server stopped) from its first row without a take."""
        store().batch(batch_id)
        batch_jobs(service()).resume(batch_id)
        return batch_status(jobs(), store(), batch_id)

    # -------------------------------------------------------------- tests (owner)

    @router.get("/api/tests")
    def tests() -> Any:
        s = store()
        return {"tests": [{"id": t["id"], "kind": t["kind"], "title": t["title"], "created": t["created"],
                           "items": len(t["spec"]["items"]), "raters": listening.progress(s, t["id"])}
                          for t in s.tests()]}

    @router.post("/api/tests", status_code=201)
    async def create_test(request: Request) -> Any:
        """``{kind, title?, instructions?, allow_none?}`` with ``items`` (explicit take ids) or ``conditions``
        (take labels; items are designed text by text) plus ``reference`` / ``anchor`` labels."""
        spec = await body(request)
        s, kind = store(), spec.get("kind")
        if "items" in spec:
            items = listening.check_items(kind, spec["items"], s)
        else:
            conditions = spec.get("conditions")
            if not isinstance(conditions, list) or not all(isinstance(c, str) for c in conditions):
                raise InvalidInputError("give 'conditions' (take labels) or 'items'", "conditions")
            items = listening.design(kind, s.takes(limit=1_000_000), conditions, reference=spec.get("reference"),
                                     anchor=spec.get("anchor"))
        test_id = listening.create_test(s, kind, items, title=spec.get("title", ""),
                                        instructions=spec.get("instructions", ""),
                                        allow_none=spec.get("allow_none", False))
        return JSONResponse({"id": test_id, "items": len(items), "rate_url": f"/workbench/rate/{test_id}",
                             "results_url": f"/workbench/tests/{test_id}"}, 201)

    @router.get("/api/tests/{test_id}/results")
    def results(test_id: str) -> Any:
        s = store()
        test = s.test(test_id)
        return {"id": test_id, "kind": test["kind"], "title": test["title"], "items": len(test["spec"]["items"]),
                "progress": listening.progress(s, test_id), "summary": listening.summary(s, test_id)}

    @router.get("/api/tests/{test_id}/answers.csv")
    def answers_csv(test_id: str) -> Any:
        out = io.StringIO()
        write_csv(out, listening.export_rows(store(), test_id), listening.EXPORT_COLUMNS)
        return Response(out.getvalue(), media_type="text/csv",
                        headers={"Content-Disposition": f'attachment; filename="{test_id}-answers.csv"'})

    def test_takes(test_id: str) -> list:
        s = store()
        items = s.test(test_id)["spec"]["items"]
        ids = dict.fromkeys(t for it in items for t in [*it["takes"], *(it[k] for k in ("reference", "anchor")
                                                                        if it.get(k))])
        return [s.take(t) for t in ids]

    def scorer() -> Scorer:
        """The scorecard's models, loaded once (the bundle's CAM++; packaged encoders where installed)."""
        with lock:
            if "scorer" not in opened:
                svc = service()
                opened["scorer"] = Scorer(store(), svc.status().model_dir, svc.voices.recording)
            return opened["scorer"]

    @router.get("/api/tests/{test_id}/scorecard")
    def test_scorecard(test_id: str) -> Any:
        """Objective measures of the test's takes, per take and per condition (computed now, then kept)."""
        return scorecard(scorer(), test_takes(test_id))

    @router.get("/api/tests/{test_id}/scorecard.csv")
    def test_scorecard_csv(test_id: str) -> Any:
        card = scorecard(scorer(), test_takes(test_id))
        out = io.StringIO()
        write_csv(out, card["takes"], ["take_id", "condition", *SCORE_METRICS])
        return Response(out.getvalue(), media_type="text/csv",
                        headers={"Content-Disposition": f'attachment; filename="{test_id}-scorecard.csv"'})

    # -------------------------------------------------------------- raters

    @router.get("/api/tests/{test_id}")
    def test_info(test_id: str) -> Any:
        """What a rater may see before starting: no take ids."""
        t = store().test(test_id)
        return {"id": t["id"], "kind": t["kind"], "title": t["title"], "instructions": t["instructions"],
                "items": len(t["spec"]["items"]), "allow_none": t["spec"].get("allow_none", False)}

    @router.post("/api/tests/{test_id}/raters")
    async def join(test_id: str, request: Request) -> Any:
        name = (await body(request)).get("name")
        rater, resumed = listening.join(store(), test_id, name)
        return {"rater": rater.id, "name": rater.name, "resumed": resumed,
                "resume_url": f"/workbench/rate/{test_id}?rater={rater.id}"}

    @router.get("/api/raters/{rater_id}/next")
    def next_item(rater_id: str) -> Any:
        return listening.next_item(store(), store().rater(rater_id))

    @router.post("/api/raters/{rater_id}/events")
    async def event(rater_id: str, request: Request) -> Any:
        data = await body(request)
        listening.record_play(store(), store().rater(rater_id), data.get("position"), data.get("slot"),
                              data.get("event"))
        return Response(status_code=204)

    @router.post("/api/raters/{rater_id}/answers")
    async def submit(rater_id: str, request: Request) -> Any:
        data = await body(request)
        s = store()
        listening.submit(s, s.rater(rater_id), data.get("position"), data.get("answer"))
        return listening.next_item(s, s.rater(rater_id))

    @router.get("/api/raters/{rater_id}/audio/{position}/{slot}")
    def rater_audio(rater_id: str, position: int, slot: str) -> Any:
        s = store()
        entry = listening.entry_at(s.rater(rater_id), position)
        take_id = next((x["take"] for x in entry["slots"] if x["slot"] == slot), None)
        if take_id is None:
            raise InvalidInputError(f"no sample {slot!r} in this item", "slot")
        return FileResponse(s.audio_path(s.take(take_id)), media_type="audio/wav",
                            headers={"Cache-Control": "no-store"})  # no file name: it would name the take

    return router
