"""Long-form projects over the service: the owners of a project's work, wired once over one project store and the
data folder's job runner.

:class:`LongformStudio` is what the REST router, the page and the CLI hold: ``editor`` makes and edits projects
(:mod:`~cosyvoice.longform.editor`), ``renders`` makes their takes as jobs (:mod:`~cosyvoice.longform.rendering`),
``mixer`` mixes the chosen takes (:mod:`~cosyvoice.longform.mix`), ``covers`` and ``delivery`` keep the book's
cover and its ACX delivery, and ``exports`` makes the files as jobs (:mod:`~cosyvoice.longform.exports`). Segment
k's audio depends on its own text, voice, instruction, speed and seed alone; the mix is the chosen takes with pauses
between them, so regenerating one segment leaves every other sample of the mix as it was (also after finishing,
which works on each segment by itself: ``finishing.finish_segment``).
"""

from __future__ import annotations

from cosyvoice.jobs import JobRunner
from cosyvoice.longform.delivery import Deliveries
from cosyvoice.longform.editor import ProjectEditor
from cosyvoice.longform.exports import Exports
from cosyvoice.longform.mix import Mixer
from cosyvoice.longform.rendering import Renders
from cosyvoice.longform.store import Project, ProjectStore, Segment
from cosyvoice.longform.tags import Covers
from cosyvoice.service import TTSService


class LongformStudio:
    """The projects of ``store`` (``longform.sqlite3`` + the take store's audio), synthesised through ``service``,
    their renders and exports jobs of ``jobs`` (the data folder's runner, which the caller owns and closes)."""

    def __init__(self, service: TTSService, store: ProjectStore, jobs: JobRunner) -> None:
        self.service = service
        self.store = store
        self.sample_rate = service.sample_rate
        self.jobs = jobs
        self.renders = Renders(service, store, jobs)
        self.editor = ProjectEditor(service, store, self.renders)
        self.covers = Covers(store)
        self.mixer = Mixer(store, service.sample_rate, self.covers)
        self.delivery = Deliveries(store, self.mixer, self.covers)
        self.exports = Exports(store, self.mixer, self.delivery, jobs)

    def project(self, project_id: str) -> Project:
        return self.store.project(project_id)

    def projects(self) -> list[Project]:
        return self.store.projects()

    def segments(self, project_id: str) -> list[Segment]:
        return self.renders.segments(project_id)

    def delete(self, project_id: str) -> tuple[Project, dict[str, list[str]]]:
        """Delete a project, its segments and its takes, except those listening tests use (they stay in the
        workbench; returned: take id -> the tests), its delivery, cover and exports. Its jobs (renders and
        exports) are cancelled first; one that another process runs ends there cleanly (its take is refused, its
        file removed)."""
        for job in self.jobs.jobs(project_id, active=True):
            self.jobs.cancel(job.id)
            self.jobs.wait(job.id)
        deleted = self.store.delete_project(project_id)
        self.delivery.remove(project_id)
        self.covers.remove(project_id)
        self.exports.remove(project_id)
        return deleted
