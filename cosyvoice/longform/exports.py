"""A project's exports as jobs of :mod:`cosyvoice.jobs` (kind :data:`KIND`): the mix as one audio file, the ACX
delivery (an MP3 a chapter, each checked as delivered) and the ACX check of the finished mix. Each is the heavy
pass over every take of a book, so it runs in the job runner like a render: its state and error are in
``jobs.sqlite3`` for any process on the data folder, a server that stops while one runs leaves it
``interrupted``, and what it made stays in ``longform/exports/<project>/<job>.*`` (the file and its result, the
segment table or the check) until a newer export of the same kind replaces it or the project is deleted.

An export is of the project's subject, so it waits for the project's render to end and never reads a take
being replaced. Whether the project can be exported at all (every segment has audio) is checked when it is asked
for, so "no audio yet" is an answer, not a failed job.
"""

from __future__ import annotations

import functools
import json
import shutil
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cosyvoice.encoding import file_format
from cosyvoice.engine import CancelToken
from cosyvoice.errors import ConflictError, InvalidInputError, NotFoundError, ResourceLimitError
from cosyvoice.jobs import Cancelled, Job, JobRunner, JobState, Task
from cosyvoice.longform.delivery import Deliveries
from cosyvoice.longform.mix import Mixer
from cosyvoice.longform.store import ProjectStore
from cosyvoice.system.fs import atomic_write
from cosyvoice.system.sqlite import require_writable

KIND = "longform-export"  # the job kind of a project's exports
WHAT = ("audio", "acx", "check")  # the mix as a file, the ACX delivery, the ACX check of the mix


@dataclass(frozen=True)
class ExportFile:
    """A finished export's file: its download name, where it lies and its media type."""

    name: str
    path: Path
    media_type: str


class Exports:
    """The exports of ``store``'s projects, made by ``mixer`` and ``deliveries`` as jobs on ``jobs``."""

    def __init__(self, store: ProjectStore, mixer: Mixer, deliveries: Deliveries, jobs: JobRunner) -> None:
        self.store = store
        self.mixer = mixer
        self.deliveries = deliveries
        self.jobs = jobs
        self.folder = store.audio_root / "exports"
        self._lock = threading.Lock()
        self._waited: dict[str, BaseException | None] = {}  # jobs a caller waits for -> what their export raised
        jobs.register(KIND, self._tasks)

    def submit(self, project_id: str, what: str = "audio", fmt: str = "wav", finished: bool = True, *,
               owner: str | None = None, job_id: str | None = None) -> Job:
        """Queue an export of the project as it is now; refused at once where it cannot be made (an unknown
        format, a segment without audio, a read-only data folder)."""
        if what not in WHAT:
            raise InvalidInputError(f"an export is one of {', '.join(WHAT)}, not {what!r}", "what")
        fmt = file_format(fmt).name
        require_writable(self.store.read_only)
        plan, _ = self.mixer.plan(project_id)
        audio = what == "audio"
        params = {"what": what, "format": fmt if audio else None, "finished": finished if audio else True}
        return self.jobs.submit(KIND, project_id, params, total=1, units=sum(len(s.text) for s, _, _ in plan),
                                owner=owner, job_id=job_id)

    def run(self, project_id: str, what: str = "audio", fmt: str = "wav", finished: bool = True, *,
            owner: str | None = None) -> Job:
        """An export made while the caller waits (the endpoints that answered with the file itself before exports
        were jobs): its job, done; what the export raised is raised here as it was."""
        job_id = f"job-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self._waited[job_id] = None
        try:
            self.submit(project_id, what, fmt, finished, owner=owner, job_id=job_id)
            job = self.jobs.wait(job_id)
        finally:
            with self._lock:
                error = self._waited.pop(job_id)
        if error is not None:
            raise error
        if job.state is JobState.CANCELLED:
            raise ConflictError("the export was stopped (the project was deleted, or the export cancelled)", "export")
        if job.state is not JobState.DONE:
            raise ResourceLimitError(job.error or "the export did not finish; ask again")
        return job

    # ------------------------------------------------------------------ reading

    def job(self, project_id: str, job_id: str) -> Job:
        """The project's export ``job_id`` (another project's job, or a render: not found)."""
        job = self.jobs.job(job_id)
        if job.kind != KIND or job.subject != project_id:
            raise NotFoundError(f"no export {job_id!r} of this project", "export")
        return job

    def of(self, project_id: str) -> list[Job]:
        """The project's exports, oldest first."""
        return [j for j in self.jobs.jobs(project_id) if j.kind == KIND]

    def status(self, job: Job) -> dict:
        """An export as the page shows it: what it is, its state, why it failed, and its result once done."""
        errors = self.jobs.errors(job.id, 1)
        result = self.result(job) if job.state is JobState.DONE else None
        return {"id": job.id, "project": job.subject, **job.params, "state": job.state.value,
                "error": job.error or (errors[0]["message"] if errors else None), "created": job.created,
                "started": job.started, "ended": job.finished, "result": result,
                "file": result.get("download") if result and job.params["what"] != "check" else None}

    def result(self, job: Job) -> dict | None:
        """What a done export made (its segment table, its check), or None once a newer export replaced it."""
        path = self._path(job, "json")
        return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None

    def file(self, job: Job) -> ExportFile:
        """The file a done export made (the ACX delivery: while it is still the project's)."""
        result = self.result(job)
        if job.state is not JobState.DONE or result is None or job.params["what"] == "check":
            raise NotFoundError("this export has no file (not done, replaced by a newer one, or a check)", "export")
        if job.params["what"] == "acx":
            name, path = self.deliveries.archive(job.subject)
            return ExportFile(name, path, "application/zip")
        fmt = file_format(job.params["format"])
        return ExportFile(result["download"], self._path(job, fmt.extension), fmt.content_type)

    def cancel(self, project_id: str, job_id: str) -> Job:
        return self.jobs.cancel(self.job(project_id, job_id).id)

    def remove(self, project_id: str) -> None:
        """Every export file of a deleted project."""
        shutil.rmtree(self.folder / project_id, ignore_errors=True)

    # ------------------------------------------------------------------ the job

    def _tasks(self, job: Job) -> Iterator[Task]:
        yield Task(job.params["what"], job.units_total, functools.partial(self._make, job))

    def _make(self, job: Job, token: CancelToken) -> None:
        try:
            (self.folder / job.subject).mkdir(parents=True, exist_ok=True)
            if job.params["what"] == "audio":
                result = self._audio(job, token)
            elif job.params["what"] == "acx":
                result = self.deliveries.make(job.subject)
            else:
                result = self.mixer.acx(job.subject, token)
            atomic_write(self._path(job, "json"), lambda tmp: Path(tmp).write_text(json.dumps(result)))
            self._replaced(job)
        except Cancelled:  # stopped: the waiting caller reads the job's state
            raise
        except Exception as exc:
            with self._lock:
                if job.id in self._waited:
                    self._waited[job.id] = exc
            raise

    def _audio(self, job: Job, token: CancelToken) -> dict:
        fmt = file_format(job.params["format"])

        def write(tmp: str) -> None:
            with open(tmp, "w+b") as out:  # read back too: the tags are written into it
                timelines.append(self.mixer.export_to(out, job.subject, fmt.name, job.params["finished"], token))

        timelines: list = []
        atomic_write(self._path(job, fmt.extension), write)
        table = self.mixer.segments_json(job.subject, timelines[0])
        return table | {"download": self.mixer.file_name(job.subject, fmt.name)}

    def _replaced(self, job: Job) -> None:
        """The files of the project's earlier exports of the same kind (and format): a newer one stands for them."""
        for other in self.of(job.subject):
            if other.id != job.id and other.params == job.params:
                for path in (self.folder / job.subject).glob(f"{other.id}.*"):
                    path.unlink(missing_ok=True)

    def _path(self, job: Job, extension: str) -> Path:
        return self.folder / job.subject / f"{job.id}.{extension}"
