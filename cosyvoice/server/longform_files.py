"""Long-form's files over HTTP: a project's exports as jobs, the ACX check and delivery, subtitles and the segment
table. Routes of :func:`cosyvoice.server.longform.longform_router`, which answers 404 for a project the caller may
not see before any of them runs.

An export (the mix as an audio file, the ACX delivery, the ACX check of the mix) is a job of the data folder's
runner (:mod:`cosyvoice.longform.exports`): post one, poll it, fetch its file. Its state and error are the page's
to show, and a finished export's file stays there for a later download, after a restart too.

    POST   /v1/longform/projects/{p}/exports             {what: audio|acx|check, format, finished} -> 202, the job
    GET    /v1/longform/projects/{p}/exports             the project's exports, oldest first
    GET    /v1/longform/projects/{p}/exports/{j}         {id, what, format, state, error, result, file}
    GET    /v1/longform/projects/{p}/exports/{j}/file    the finished file (an ACX delivery's ZIP while current)
    POST   /v1/longform/projects/{p}/exports/{j}/cancel

The endpoints that answered with the file or the check itself before exports were jobs still do: each runs the
same job and waits for it (so it also waits for the project's render and for a free job worker, ``job_workers``).

    GET    /v1/longform/projects/{p}/export?format=wav&finished=true   wav mp3 flac opus m4b mp4
    GET    /v1/longform/projects/{p}/acx                 the finished mix against ACX, per chapter and book
    POST   /v1/longform/projects/{p}/acx/delivery        make ACX's files (an MP3 a chapter) and check them
    GET    /v1/longform/projects/{p}/acx/delivery        the last delivery's check (``current``: still valid)
    GET    /v1/longform/projects/{p}/acx/delivery.zip    its files (409 once the project changed)

Subtitles and the segment table only time the mix (no levelling, no encoding) and are answered in the request:

    GET    /v1/longform/projects/{p}/subtitles.srt | subtitles.vtt | segments.json
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, BinaryIO
from urllib.parse import quote

from fastapi import Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from cosyvoice.jobs import Job
from cosyvoice.longform import LongformStudio
from cosyvoice.owners import Caller
from cosyvoice.server.routes import RouteTable
from cosyvoice.system.fs import disk_full

files = RouteTable("longform")  # the long-form mount's state, as the project routes' table names it


def _studio(request: Request) -> LongformStudio:
    """The mount's studio (:class:`ModelNotReady` while the model loads)."""
    return files.state(request).studio()


def _caller(request: Request) -> Caller:
    return files.state(request).owners.behind_gate(request)


Studio = Annotated[LongformStudio, Depends(_studio)]
Who = Annotated[Caller, Depends(_caller)]


class ExportBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    what: str = "audio"
    format: str = "wav"
    finished: bool = True  # trimmed and levelled by the project's settings (the mix as a file only)


# ------------------------------------------------------------------ exports as jobs


@files.post("/v1/longform/projects/{project_id}/exports", status_code=202)
def submit_export(s: Studio, who: Who, project_id: str, body: ExportBody) -> JSONResponse:
    """An export queued as a job; refused at once where it cannot be made (a segment without audio: 400)."""
    job = s.exports.submit(project_id, body.what, body.format, body.finished, owner=who.owner)
    return JSONResponse(s.exports.status(job), 202)


@files.get("/v1/longform/projects/{project_id}/exports")
def list_exports(s: Studio, project_id: str) -> JSONResponse:
    return JSONResponse([s.exports.status(job) for job in s.exports.of(project_id)])


@files.get("/v1/longform/projects/{project_id}/exports/{job_id}")
def get_export(s: Studio, project_id: str, job_id: str) -> JSONResponse:
    return JSONResponse(s.exports.status(s.exports.job(project_id, job_id)))


@files.get("/v1/longform/projects/{project_id}/exports/{job_id}/file")
def export_file(s: Studio, project_id: str, job_id: str) -> Response:
    return _file(s, s.exports.job(project_id, job_id))


@files.post("/v1/longform/projects/{project_id}/exports/{job_id}/cancel")
def cancel_export(s: Studio, project_id: str, job_id: str) -> JSONResponse:
    return JSONResponse(s.exports.status(s.exports.cancel(project_id, job_id)))


def _file(s: LongformStudio, job: Job) -> StreamingResponse:
    """A done export's file as a download; the mix's says whether it meets ACX (``X-ACX-Check``)."""
    found = s.exports.file(job)
    headers = {**_attachment(found.name), "Content-Length": str(found.path.stat().st_size)}
    result = s.exports.result(job) or {}
    if "acx" in result:
        headers["X-ACX-Check"] = "pass" if result["acx"]["passed"] else "fail"
    return StreamingResponse(_read(found.path.open("rb")), media_type=found.media_type, headers=headers)


def _run(s: LongformStudio, who: Caller, project_id: str, what: str, fmt: str = "wav", finished: bool = True) -> Job:
    """An export made while the request waits (a full disk: 507)."""
    try:
        return s.exports.run(project_id, what, fmt, finished, owner=who.owner)
    except OSError as exc:
        raise disk_full(exc) or exc from exc


# ------------------------------------------------------------------ the answers of before exports were jobs


@files.get("/v1/longform/projects/{project_id}/export")
def export(s: Studio, who: Who, project_id: str, format: str = "wav", finished: bool = True) -> Response:
    """The mix as a file download (wav, mp3, flac, opus, m4b, mp4), made by an export job."""
    return _file(s, _run(s, who, project_id, "audio", format, finished))


@files.get("/v1/longform/projects/{project_id}/acx")
def acx(s: Studio, who: Who, project_id: str) -> JSONResponse:
    """The finished mix against ACX's requirements (RMS, peak, noise floor), per chapter and for the book."""
    return JSONResponse(s.exports.result(_run(s, who, project_id, "check")))


@files.post("/v1/longform/projects/{project_id}/acx/delivery")
def make_delivery(s: Studio, who: Who, project_id: str) -> JSONResponse:
    """ACX's delivery made (one MP3 a chapter: 192 kbps CBR, 44.1 kHz, mono, room tone at each end) and every
    file checked as delivered: format, bit rate, rate, channels, length, room tone and levels."""
    return JSONResponse(s.exports.result(_run(s, who, project_id, "acx")))


@files.get("/v1/longform/projects/{project_id}/acx/delivery")
def delivery_report(s: Studio, project_id: str) -> JSONResponse:
    return JSONResponse(s.delivery.report(project_id))


@files.get("/v1/longform/projects/{project_id}/acx/delivery.zip")
def delivery_zip(s: Studio, project_id: str) -> Response:
    name, path = s.delivery.archive(project_id)
    return StreamingResponse(_read(path.open("rb")), media_type="application/zip",
                             headers={**_attachment(name), "Content-Length": str(path.stat().st_size)})


@files.get("/v1/longform/projects/{project_id}/subtitles.{kind}")
def subtitles(s: Studio, project_id: str, kind: str, finished: bool = True) -> Response:
    text = s.mixer.subtitles(project_id, kind, finished)
    media = "text/vtt" if kind == "vtt" else "application/x-subrip"
    name = f"{s.project(project_id).name or 'subtitles'}.{kind}"
    return Response(text, media_type=f"{media}; charset=utf-8", headers=_attachment(name))


@files.get("/v1/longform/projects/{project_id}/segments.json")
def segments_json(s: Studio, project_id: str, finished: bool = True) -> JSONResponse:
    return JSONResponse(s.mixer.segments_json(project_id, s.mixer.timeline(project_id, finished)))


def _read(file: BinaryIO, size: int = 1 << 20) -> Iterator[bytes]:
    with file:
        while chunk := file.read(size):
            yield chunk


def _attachment(name: str) -> dict[str, str]:
    ascii_name = "".join(ch if 32 <= ord(ch) < 127 and ch not in '"\\' else "_" for ch in name)
    return {"Content-Disposition": f"attachment; filename=\"{ascii_name}\"; filename*=UTF-8''{quote(name)}"}
