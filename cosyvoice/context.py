"""The composition root: what one process serves, built once by its entry point (the REST app's ``create_app``,
the web UI's ``load_studio``, the batch and long-form command lines, the gRPC server, a Ray Serve replica) and
handed to its adapters: FastAPI routers get it as their mount's state (``Depends``), the others as a constructor
argument. Nothing below an entry point opens a store of its own, so a process holds one take store, one project
store over it and one job runner per data folder.

The stores open when the context is made (a read-only data folder is served read-only, see
:mod:`cosyvoice.system.sqlite`); the model may load later (the REST server answers ``/health`` while it loads), so the
service, the long-form studio (its editor, its render and export jobs) and the batches' job kind arrive together in
:meth:`StudioContext.install`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from cosyvoice.errors import ModelNotReady
from cosyvoice.jobs import JobRunner, release, runner
from cosyvoice.longform import LongformStudio, ProjectStore
from cosyvoice.owners import Owners
from cosyvoice.service import TTSService
from cosyvoice.settings import Limits, ServerSettings, default_data_dir
from cosyvoice.takes.store import TakeStore
from cosyvoice.workbench.batch import KIND as BATCH_KIND
from cosyvoice.workbench.batch import batch_kind
from cosyvoice.workbench.scorecard import Scorer


class StudioContext:
    """The settings, who callers are (``owners``, default the settings'), input ``limits`` (default the service's,
    else the environment's), the stores in ``data_dir`` (default beside the voice folder), timed by ``clock`` (the
    wall clock; tests move their own), and, once installed, the service and what needs it."""

    def __init__(self, settings: ServerSettings | None = None, *, service: TTSService | None = None,
                 limits: Limits | None = None, owners: Owners | None = None, data_dir: str | Path | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.settings = settings or ServerSettings.from_env()
        self.limits = limits or (service.limits if service is not None else Limits.from_env())
        self.owners = owners if owners is not None else self.settings.owners()
        self.data_dir = Path(data_dir) if data_dir is not None else default_data_dir(self.settings.voice_dir)
        self.takes = TakeStore(self.data_dir, clock)
        self.projects = ProjectStore(self.takes)
        self.jobs: JobRunner = runner(self.data_dir, self.limits.job_workers, clock)
        self.loaded: TTSService | None = None
        self.load_error: str | None = None  # the log has it in full; only key holders see it in /health and /ready
        self.longform: LongformStudio | None = None
        self._scorer: Scorer | None = None
        self._scorer_lock = threading.Lock()
        if service is not None:
            self.install(service)

    def install(self, service: TTSService) -> None:
        """Serve ``service``: long-form projects and batches are made with it from now on."""
        self.jobs.register(BATCH_KIND, batch_kind(service, self.takes))
        self.longform = LongformStudio(service, self.projects, self.jobs)
        self.loaded = service

    def service(self) -> TTSService:
        """The loaded service; :class:`ModelNotReady` while the model loads (or after its load failed)."""
        if self.loaded is None:
            raise ModelNotReady("the model failed to load; the server log says why" if self.load_error else
                                "the model is still loading; retry shortly")
        return self.loaded

    def studio(self) -> LongformStudio:
        """The long-form studio over the project store (:class:`ModelNotReady` while the model loads)."""
        self.service()
        assert self.longform is not None  # installed with the service
        return self.longform

    def scorer(self) -> Scorer:
        """The scorecard's measuring models, loaded by the first scorecard asked for: optional and large (CAM++,
        and Resemblyzer and DNSMOS where installed), so a process that never scores never loads them."""
        with self._scorer_lock:
            if self._scorer is None:
                svc = self.service()
                self._scorer = Scorer(self.takes, svc.model_dir, svc.voice_recording)
            return self._scorer

    def close(self) -> None:
        """Stop this process's jobs (done work stays) and close the stores."""
        release(self.jobs)
        self.projects.close()
        self.takes.close()


def load_service(settings: ServerSettings, limits: Limits, *, builtin_dir: str | Path | None = None) -> TTSService:
    """The service a server's ``settings`` name (model, voice folder, device, precision, who may edit saved
    voices), bounded by ``limits``; ``builtin_dir``: built-in voices (``<name>.wav`` + ``<name>.txt``)."""
    return TTSService.load(settings.model_dir, settings.voice_dir, device=settings.device, limits=limits,
                           precision=settings.precision, policy=settings.voice_policy(), builtin_dir=builtin_dir)
