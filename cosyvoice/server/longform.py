"""Long-form projects over HTTP: a FastAPI router (REST under ``/v1/longform``) and the project page
(``/studio/longform``), mounted on the REST server and on the web UI's own FastAPI app.

A thin adapter over :class:`cosyvoice.longform.LongformStudio`: it parses the wire format, maps the studio's
errors onto HTTP as every server does (:func:`cosyvoice.server.errors.http_error`: 400 naming the field, 404,
409, 503, 500 without internals), and serves take audio. The page is static HTML + JavaScript that calls the
same endpoints, so everything it does is scriptable.

Projects belong to their owner (:mod:`cosyvoice.owners`): the list holds the projects the caller may see (the
server's sharing; admins see all), and every route under a project answers 404 for a project the caller may not
see, as if it did not exist; deleting one is its owner's (or an admin's). A project's takes are also workbench
takes (the studio's one take store), so they can be put in listening tests; deleting the project keeps the takes a
test uses (in the workbench) and says which.

    GET    /v1/longform/voices                                   built-in and saved voices
    GET    /v1/longform/projects                                 the projects, last changed first
    POST   /v1/longform/projects                                 {text, name, kind, voice, speakers, preset, ...}
    POST   /v1/longform/projects/upload                          multipart: file (.txt .md .epub .pdf .docx), ...
    GET    /v1/longform/imports/{i}                              how far the caller's import named import_id=i is
    GET    /v1/longform/projects/{p}                             settings, segment table (status, takes), progress
    PATCH  /v1/longform/projects/{p}                             {name, pauses, preset, margin, retries}
    DELETE /v1/longform/projects/{p}                             the project and its takes (a test's stay)
    PATCH  /v1/longform/projects/{p}/segments/{s}                {text, voice, instruction, speed, pause}
    POST   /v1/longform/projects/{p}/segments/{s}/split          {at: character offset}
    POST   /v1/longform/projects/{p}/segments/{s}/merge          with the next segment
    POST   /v1/longform/projects/{p}/segments/{s}/regenerate     a new take, new seed
    POST   /v1/longform/projects/{p}/segments/{s}/takes/{t}/choose
    GET    /v1/longform/projects/{p}/takes/{t}.wav
    POST   /v1/longform/projects/{p}/generate                    {segments?: [ids]}; default: all without audio
    POST   /v1/longform/projects/{p}/cancel
    GET    /v1/longform/projects/{p}/progress                    {running, total, done, failed, queued, eta, ...}
    POST   /v1/longform/projects/{p}/cover                       multipart: file (JPEG or PNG); DELETE: none

Exports (the mix as a file, the ACX delivery and check: jobs), subtitles and the segment table are
:mod:`cosyvoice.server.longform_files`' routes, in the same router.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, File, Form, Request, UploadFile
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from cosyvoice.context import StudioContext
from cosyvoice.encoding import encode_audio
from cosyvoice.engine import CancelToken
from cosyvoice.errors import ConflictError, InvalidInputError, NotFoundError, PermissionDeniedError
from cosyvoice.jobs import Cancelled
from cosyvoice.longform import LongformStudio, documents
from cosyvoice.longform.store import Segment, Take
from cosyvoice.longform.tags import MAX_COVER_BYTES
from cosyvoice.owners import Caller
from cosyvoice.server.errors import CLIENT_GONE, error_route
from cosyvoice.server.longform_files import files
from cosyvoice.server.routes import RouteTable

logger = logging.getLogger(__name__)

PAGE = Path(__file__).with_name("longform_page.html")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NewProject(_Body):
    text: str
    import_id: str | None = None  # the client's name for this import, to ask how far it is
    name: str = ""
    kind: str = "document"
    voice: str | None = None
    speakers: dict[str, str] | None = None
    pauses: dict[str, float] | None = None
    preset: str | None = "podcast"
    margin: float | None = None
    retries: int | None = None
    steps: int | None = None  # the flow's Euler steps of every take (None: the model's)
    final: str | None = None  # every take's last flow call: "full" (None: the reference's) or "chunked"
    first_hop: int | None = None  # every take's first chunk in speech tokens (None: the reference's)


class ProjectChanges(_Body):
    name: str | None = None
    pauses: dict[str, float] | None = None
    preset: str | None = None
    margin: float | None = None
    retries: int | None = None  # new takes (new seeds) made for a segment whose take sounds wrong
    steps: int | None = None
    final: str | None = None
    first_hop: int | None = None
    title: str | None = None  # the book's title, author and narrator: the tags of its MP3, M4B and ACX files
    author: str | None = None
    narrator: str | None = None


class SegmentChanges(_Body):
    text: str | None = None
    voice: str | None = None
    instruction: str | None = None
    speed: float | None = None
    pause: float | None = None
    default_pause: bool = False  # true: the pause goes back to the project's pause for the segment's break


class SplitAt(_Body):
    at: int


class GenerateBody(_Body):
    segments: list[str] | None = None


IMPORT_ID = re.compile(r"[A-Za-z0-9_-]{8,64}")  # a client's name for its import, to ask how far it is


class Imports:
    """The imports under way, by (owner, the client's import id): how far each is (reading the file, then
    splitting its blocks), so a page can show a large book's progress; an entry lives while its import runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._under_way: dict[tuple[str | None, str], dict[str, Any]] = {}

    @contextlib.contextmanager
    def tracking(self, owner: str | None, import_id: str | None) -> Iterator[Callable[[str, int, int], None]]:
        """A ``report(stage, done, total)`` for one import, readable by :meth:`progress` until the block ends."""
        if import_id is None:
            yield lambda stage, done, total: None
            return
        if not IMPORT_ID.fullmatch(import_id):
            raise InvalidInputError("import_id must be 8 to 64 letters, digits, '-' or '_'", "import_id")
        key = (owner, import_id)

        def report(stage: str, done: int, total: int) -> None:
            with self._lock:
                self._under_way[key] = {"id": import_id, "stage": stage, "done": done, "total": total}

        with self._lock:
            if key in self._under_way:
                raise ConflictError(f"an import {import_id!r} is under way already", "import_id")
        report("reading", 0, 0)
        try:
            yield report
        finally:
            with self._lock:
                self._under_way.pop(key, None)

    def progress(self, owner: str | None, import_id: str) -> dict[str, Any]:
        with self._lock:
            state = self._under_way.get((owner, import_id))
        if state is None:
            raise NotFoundError(f"no import {import_id!r} under way (it has ended, or never began)", "import_id")
        return dict(state)


class Mount:
    """One mount's studio (the process's :class:`StudioContext`'s, there once the model is loaded), who its callers
    are, and the imports under way."""

    def __init__(self, context: StudioContext) -> None:
        self.studio, self.owners = context.studio, context.owners
        self.imports = Imports()


def longform_router(context: StudioContext) -> APIRouter:
    """The routes below over the process's ``context`` (its long-form studio and owners), mountable on any app (the
    REST server's, the web UI's)."""
    owners, studio = context.owners, context.studio

    def visible_project(request: Request) -> None:
        """Every route under ``{project_id}``: another owner's project is not found (unless shared)."""
        project_id = request.path_params.get("project_id")
        if project_id is not None and not owners.behind_gate(request).sees(studio().project(project_id).owner):
            raise NotFoundError(f"no project {project_id!r}", "project")

    router = APIRouter(dependencies=[Depends(visible_project)])
    mount, route_class = Mount(context), error_route(context.settings)
    router.include_router(routes.install(mount, route_class=route_class))
    router.include_router(files.install(mount, route_class=route_class))
    return router


routes = RouteTable("longform")
This = Annotated[Mount, Depends(routes.state)]


def _studio(mount: This) -> LongformStudio:
    """The mount's studio (:class:`ModelNotReady` while the model loads)."""
    return mount.studio()


def _caller(mount: This, request: Request) -> Caller:
    return mount.owners.behind_gate(request)


Studio = Annotated[LongformStudio, Depends(_studio)]
Who = Annotated[Caller, Depends(_caller)]

# ------------------------------------------------------------------ the page


@routes.get("/studio/longform", include_in_schema=False)
def page(mount: This, request: Request) -> HTMLResponse:
    return mount.owners.introduce(request, HTMLResponse(PAGE.read_text(encoding="utf-8")))


# ------------------------------------------------------------------ projects


@routes.get("/v1/longform/voices")
def voices(s: Studio) -> JSONResponse:
    """Voices a segment can use: built-in and saved ones."""
    return JSONResponse([{"id": v.id, "name": v.name, "builtin": v.builtin} for v in s.service.list_voices()])


@routes.get("/v1/longform/projects")
def projects(s: Studio, who: Who) -> JSONResponse:
    return JSONResponse([{"id": p.id, "name": p.name, "kind": p.kind, "created": p.created, "updated": p.updated}
                         for p in s.projects() if who.sees(p.owner)])


@routes.post("/v1/longform/projects", status_code=201)
async def create(mount: This, s: Studio, who: Who, body: NewProject, request: Request) -> Response:
    """A project from pasted text: split in a worker that stops if the client goes away (``import_id``: a name
    for it, to ask ``GET /v1/longform/imports/{import_id}`` how far it is)."""
    options = {k: v for k, v in (("pauses", body.pauses), ("margin", body.margin), ("retries", body.retries),
                                 ("steps", body.steps), ("final", body.final), ("first_hop", body.first_hop))
               if v is not None}

    def make(cancel: CancelToken, report: Callable[[str, int, int], None]) -> dict[str, Any]:
        project = s.editor.create(body.name, body.text, voice=body.voice, kind=body.kind, speakers=body.speakers,
                                  preset=body.preset, owner=who.owner, cancel=cancel,
                           progress=lambda done, total: report("splitting", done, total), **options)
        return detail(s, project.id)

    with mount.imports.tracking(who.owner, body.import_id) as report:
        return await _while_connected(request, lambda cancel: make(cancel, report))


@routes.post("/v1/longform/projects/upload", status_code=201)
async def upload(mount: This, s: Studio, who: Who, request: Request, file: Annotated[UploadFile, File()],
                 name: Annotated[str, Form()] = "", voice: Annotated[str | None, Form()] = None,
                 kind: Annotated[str, Form()] = "document", speakers: Annotated[str, Form()] = "",
                 preset: Annotated[str, Form()] = "podcast",
                 import_id: Annotated[str | None, Form()] = None) -> Response:
    """A project from a .txt, .md, .epub, .pdf or .docx file (``speakers``: JSON object for dialogue scripts),
    read and split within the service's import limits in a worker that stops if the client goes away
    (``import_id``: as for a pasted text)."""
    limits = s.service.limits
    data = await file.read(limits.max_import_bytes + 1)  # one byte over: read_document names the limit
    filename = file.filename or "upload.txt"
    try:
        mapping = json.loads(speakers) if speakers.strip() else None
    except (ValueError, RecursionError) as exc:  # a form field: no body bound sees inside it
        raise InvalidInputError("speakers must be a JSON object of label -> voice", "speakers") from exc

    def make(cancel: CancelToken, report: Callable[[str, int, int], None]) -> dict[str, Any]:
        text, chapters = documents.read_document(filename, data, limits, cancel)
        project = s.editor.create(name or Path(filename).stem, text, voice=voice, kind=kind, speakers=mapping,
                                  chapters=chapters, preset=preset, owner=who.owner, cancel=cancel,
                                  progress=lambda done, total: report("splitting", done, total))
        return detail(s, project.id)

    with mount.imports.tracking(who.owner, import_id) as report:
        return await _while_connected(request, lambda cancel: make(cancel, report))


@routes.get("/v1/longform/imports/{import_id}")
def import_progress(mount: This, who: Who, import_id: str) -> JSONResponse:
    """How far the caller's import ``import_id`` is: ``{id, stage: reading|splitting, done, total}`` (blocks)."""
    return JSONResponse(mount.imports.progress(who.owner, import_id))


async def _while_connected(request: Request, make: Callable[[CancelToken], dict[str, Any]]) -> Response:
    """``make`` a project in a worker thread (a book takes seconds to split), cancelled the moment the client
    disconnects: the worker stops at its next page, chapter or paragraph and stores nothing."""
    cancel = CancelToken()
    work = asyncio.ensure_future(asyncio.to_thread(make, cancel))
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not work.done():
        cancel.cancel()
        with contextlib.suppress(Cancelled):
            await work
        logger.info("%s: the client went away; the import stopped", request.url.path)
        return Response(status_code=CLIENT_GONE)
    return JSONResponse(work.result(), 201)


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


@routes.get("/v1/longform/projects/{project_id}")
def get_project(s: Studio, project_id: str) -> JSONResponse:
    return JSONResponse(detail(s, project_id))


@routes.patch("/v1/longform/projects/{project_id}")
def change_project(s: Studio, project_id: str, body: ProjectChanges) -> JSONResponse:
    s.editor.update_settings(project_id, **body.model_dump(exclude_unset=True))
    return JSONResponse(detail(s, project_id))


@routes.delete("/v1/longform/projects/{project_id}")
def delete_project(s: Studio, who: Who, project_id: str) -> JSONResponse:
    if not who.owns(s.project(project_id).owner):
        raise PermissionDeniedError("only the project's owner (or an admin) may delete it")
    project, kept = s.delete(project_id)
    return JSONResponse({"deleted": project.id, "name": project.name,
                         "kept_takes": [{"take": take, "tests": tests} for take, tests in kept.items()]})


# ------------------------------------------------------------------ segments


@routes.patch("/v1/longform/projects/{project_id}/segments/{segment_id}")
def change_segment(s: Studio, who: Who, project_id: str, segment_id: str, body: SegmentChanges) -> JSONResponse:
    changes = body.model_dump(exclude_unset=True)
    if changes.pop("default_pause", False):
        changes["pause"] = None
    s.editor.edit_segment(project_id, segment_id, owner=who.owner, **changes)
    return JSONResponse(detail(s, project_id))


@routes.post("/v1/longform/projects/{project_id}/segments/{segment_id}/split")
def split(s: Studio, project_id: str, segment_id: str, body: SplitAt) -> JSONResponse:
    s.editor.split_segment(project_id, segment_id, body.at)
    return JSONResponse(detail(s, project_id))


@routes.post("/v1/longform/projects/{project_id}/segments/{segment_id}/merge")
def merge(s: Studio, project_id: str, segment_id: str) -> JSONResponse:
    s.editor.merge_segments(project_id, segment_id)
    return JSONResponse(detail(s, project_id))


@routes.post("/v1/longform/projects/{project_id}/segments/{segment_id}/regenerate")
def regenerate(s: Studio, project_id: str, segment_id: str) -> JSONResponse:
    return JSONResponse(s.renders.regenerate(project_id, segment_id))


@routes.post("/v1/longform/projects/{project_id}/segments/{segment_id}/takes/{take_id}/choose")
def choose(s: Studio, project_id: str, segment_id: str, take_id: str) -> JSONResponse:
    s.editor.choose_take(project_id, segment_id, take_id)
    return JSONResponse(detail(s, project_id))


@routes.get("/v1/longform/projects/{project_id}/takes/{take_id}.wav")
def take_audio(s: Studio, project_id: str, take_id: str) -> Response:
    take = s.store.take(project_id, take_id)
    return Response(encode_audio(s.store.take_audio(take), "wav", take.sample_rate), media_type="audio/wav")


# ------------------------------------------------------------------ generation


@routes.post("/v1/longform/projects/{project_id}/generate")
def generate(s: Studio, project_id: str, body: GenerateBody | None = None) -> JSONResponse:
    return JSONResponse(s.renders.generate(project_id, body.segments if body else None))


@routes.post("/v1/longform/projects/{project_id}/cancel")
def cancel(s: Studio, project_id: str) -> JSONResponse:
    return JSONResponse(s.renders.cancel(project_id))


@routes.get("/v1/longform/projects/{project_id}/progress")
def progress(s: Studio, project_id: str) -> JSONResponse:
    return JSONResponse(s.renders.progress(project_id))


# ------------------------------------------------------------------ the book's cover


@routes.post("/v1/longform/projects/{project_id}/cover")
def set_cover(s: Studio, project_id: str, file: Annotated[UploadFile, File()]) -> JSONResponse:
    """The book's cover (JPEG or PNG), embedded in its MP3, M4B and ACX files."""
    data = file.file.read(MAX_COVER_BYTES + 1)
    s.covers.set_cover(project_id, data)
    return JSONResponse(detail(s, project_id))


@routes.delete("/v1/longform/projects/{project_id}/cover")
def delete_cover(s: Studio, project_id: str) -> JSONResponse:
    s.covers.set_cover(project_id, None)
    return JSONResponse(detail(s, project_id))


def detail(studio: LongformStudio, project_id: str) -> dict[str, Any]:
    """A project as the page shows it: settings, every segment with its status and takes, the progress."""
    project = studio.project(project_id)
    table = studio.renders.table(project_id)
    names = {v.id: v.name for v in studio.service.list_voices()}
    pauses = project.settings["pauses"]
    return {"id": project.id, "name": project.name, "kind": project.kind, "settings": project.settings,
            "sample_rate": studio.sample_rate, "progress": studio.renders.progress(project_id),
            "cover": studio.covers.has_cover(project_id),
            "segments": [_segment(s, takes, status, names, pauses, last=i == len(table) - 1)
                         for i, (s, takes, status) in enumerate(table)]}


def _segment(s: Segment, takes: list[Take], status: str, names: dict[str, str], pauses: dict[str, float],
             last: bool) -> dict[str, Any]:
    current = next((t for t in takes if t.id == s.chosen_take and t.matches(s)), None)
    return {"id": s.id, "index": s.position, "text": s.text, "voice": s.voice, "voice_name": names.get(s.voice),
            "instruction": s.instruction, "speed": s.speed, "break": s.brk, "pause": s.pause,
            "pause_seconds": 0.0 if last else s.pause if s.pause is not None else pauses.get(s.brk, 0.0),
            "chapter": s.chapter, "speaker": s.speaker, "status": status, "error": s.error,
            "take": current.id if current else None, "flags": current.flags if current else [],
            "seconds": round(current.samples / current.sample_rate, 2) if current else None,
            "takes": [{"id": t.id, "seed": t.seed, "flags": t.flags, "current": t.matches(s),
                       "chosen": t.id == s.chosen_take, "seconds": round(t.samples / t.sample_rate, 2),
                       "created": t.created} for t in takes]}
