"""The render job of a long-form project: a job of :mod:`cosyvoice.jobs` (kind :data:`KIND`) that makes one take per
segment through ``TTSService.synthesize`` (each with its own recorded seed), flags takes that sound wrong and makes
them again with new seeds where the project asks; and the segment table's state and progress read from the jobs.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator

from cosyvoice.engine import CancelToken
from cosyvoice.errors import InvalidInputError, NotFoundError
from cosyvoice.jobs import Job, JobGone, JobRunner, JobState, Made, Task, synthesize
from cosyvoice.llm.model import CosyVoice3LM
from cosyvoice.longform import finishing
from cosyvoice.longform.store import ProjectStore, Segment, Take, current_take
from cosyvoice.service import SynthesisRequest, TTSService
from cosyvoice.system.sqlite import require_writable
from cosyvoice.takes.provenance import keep_take
from cosyvoice.takes.store import Take as StoredTake
from cosyvoice.takes.store import TakeStore

SUSPECT_RETRIES = 0  # a project's default: suspect takes are flagged; a project may ask for new takes (new seeds)
KIND = "longform"  # the job kind of a project's generation


class Renders:
    """The generation jobs of ``store``'s projects on ``jobs``, synthesised through ``service``."""

    def __init__(self, service: TTSService, store: ProjectStore, jobs: JobRunner) -> None:
        self.service = service
        self.store = store
        self.jobs = jobs
        jobs.register(KIND, self._tasks)

    def segments(self, project_id: str) -> list[Segment]:
        self.store.project(project_id)
        return self.store.segments(project_id)

    def active(self, project_id: str) -> list[Job]:
        """The project's generation jobs queued or running (its exports are jobs of their own kind)."""
        return [j for j in self.jobs.jobs(project_id, active=True) if j.kind == KIND]

    def status(self, segment: Segment, takes: dict[str, list[Take]], queued: dict[str, str]) -> str:
        """done | running | queued | failed | pending (``queued``: :meth:`queued`)."""
        if segment.id in queued:
            return queued[segment.id]
        if current_take(segment, takes) is not None:
            return "done"
        return "failed" if segment.state == "failed" else "pending"

    def queued(self, project_id: str) -> dict[str, str]:
        """Segments the project's active jobs will still make: segment id -> running | queued."""
        out: dict[str, str] = {}
        for job in self.active(project_id):
            for sid, _ in job.params["segments"][job.position:]:
                out.setdefault(sid, "running" if sid == job.current else "queued")
        return out

    def table(self, project_id: str) -> list[tuple[Segment, list[Take], str]]:
        """The segment table: each segment with its takes (oldest first) and its status."""
        segments = self.segments(project_id)
        takes = self.store.takes(project_id)
        queued = self.queued(project_id)
        return [(s, takes.get(s.id, []), self.status(s, takes, queued)) for s in segments]

    def progress(self, project_id: str) -> dict:
        """The generation's progress, from the job runner's database (so any process on the data folder sees
        it): counts, the segment being made, elapsed seconds, an ETA (at the characters per second measured so
        far), and the last job's state and error."""
        segments = self.segments(project_id)
        takes = self.store.takes(project_id)
        jobs = [j for j in self.jobs.jobs(project_id) if j.kind == KIND]
        active = [j for j in jobs if j.state.active]
        queued = self.queued(project_id)
        states = [self.status(s, takes, queued) for s in segments]
        etas = [j.eta_seconds for j in active]
        running = next((j for j in active if j.state is JobState.RUNNING), None)
        return {"running": bool(active), "total": len(segments), "done": states.count("done"),
                "failed": states.count("failed"), "queued": states.count("queued") + states.count("running"),
                "current": running.current if running else None,
                "elapsed": round(time.time() - min(j.started or j.created for j in active), 1) if active else None,
                "eta": None if not active or None in etas else round(sum(etas), 1),
                "state": jobs[-1].state.value if jobs else None, "error": jobs[-1].error if jobs else None}

    def generate(self, project_id: str, segment_ids: list[str] | None = None, *, new_take: bool = False) -> dict:
        """Queue segments (default: every segment without a current take) for synthesis in a background job;
        ``new_take`` makes a new take (new seed) even where one is current: "regenerate". Returns progress."""
        require_writable(self.store.read_only)  # refused now, not in the job
        segments = self.segments(project_id)
        known = {s.id for s in segments}
        if segment_ids is not None:
            if len(segment_ids) > len(known):  # a body may list each segment once at most
                raise InvalidInputError(f"segments lists {len(segment_ids):,} ids; the project has {len(known):,} "
                                        "segments", "segments")
            unknown = [sid for sid in segment_ids if sid not in known]
            if unknown:
                raise NotFoundError(f"no segment {unknown[0]!r} in this project", "segments")
            wanted = set(segment_ids)
            order = [s.id for s in segments if s.id in wanted]
        else:
            takes = self.store.takes(project_id)
            order = [s.id for s in segments if current_take(s, takes) is None]
        queued = self.queued(project_id)
        order = [sid for sid in order if sid not in queued]
        if order:
            texts = {s.id: len(s.text) for s in segments}
            self.jobs.submit(KIND, project_id, {"segments": [[sid, texts[sid]] for sid in order], "new_take": new_take},
                             total=len(order), units=sum(texts[sid] for sid in order))
        return self.progress(project_id)

    def regenerate(self, project_id: str, segment_id: str) -> dict:
        """A new take of one segment with a new seed; it becomes the chosen take (the old ones are kept)."""
        return self.generate(project_id, [segment_id], new_take=True)

    def cancel(self, project_id: str) -> dict:
        """Stop the project's jobs (from any process on the data folder): the segment being made is dropped,
        the rest not made; takes made stay."""
        self.store.project(project_id)
        for job in self.active(project_id):
            self.jobs.cancel(job.id)
        return self.progress(project_id)

    def wait(self, project_id: str, timeout: float | None = None) -> dict:
        """Block until the project's jobs in this process end (tests, the CLI)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for job in self.active(project_id):
            self.jobs.wait(job.id, None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self.progress(project_id)

    def _tasks(self, job: Job) -> Iterator[Task]:
        """A generation job's tasks: one take per segment (the job kind :data:`KIND`)."""
        for sid, chars in job.params["segments"]:
            yield Task(sid, chars, functools.partial(self._make_take, job.subject, sid, job.params["new_take"]),
                       functools.partial(self._failed, job.subject, sid))

    def _failed(self, project_id: str, segment_id: str, message: str) -> None:
        with contextlib.suppress(NotFoundError):
            self.store.set_state(self.store.segment(project_id, segment_id), "failed", message)

    def _make_take(self, project_id: str, segment_id: str, new_take: bool, token: CancelToken) -> None:
        """One take of a segment as it is now (skipped where merged away, or already current unless
        ``new_take``); a project deleted meanwhile ends the job (:class:`JobGone`)."""
        try:
            segment = self.store.segment(project_id, segment_id)
        except NotFoundError:
            self._exists(project_id)
            return  # merged away meanwhile
        if not new_take and current_take(segment, self.store.takes(project_id)) is not None:
            return
        settings = self.store.project(project_id).settings
        retries, steps = settings.get("retries", SUSPECT_RETRIES), settings.get("steps")
        schedule = {"final": settings.get("final"), "first_hop": settings.get("first_hop")}
        made_takes: list[Take] = []
        for _ in range(1 + retries):  # a suspect take is made again with a new seed, every take kept
            # a segment that ends on a comma (cut by a pause tag mid-sentence) is already the splitter's output:
            # read as it is, so the frontend adds no full stop after the comma
            request = SynthesisRequest(segment.text, "instruct" if segment.instruction else "sft",
                                       voice=segment.voice, instruction=segment.instruction, speed=segment.speed,
                                       stream=False, steps=steps, text_frontend=not segment.text.endswith(("，", ",")),
                                       **schedule)  # the service draws the seed
            made = synthesize(self.service, request, token)
            flags = self._suspect(segment, made)
            keep = functools.partial(_keep, self.service, request, made)
            try:
                take = self.store.add_take(segment, keep, flags=flags, seconds_to_make=made.seconds,
                                           choose=not flags)
            except NotFoundError:
                self._exists(project_id)
                raise
            if not flags:
                return
            made_takes.append(take)
        # every attempt sounded wrong: all are kept, and the one with the fewest reasons is used
        best = min(made_takes, key=lambda t: len(t.flags))
        self.store.update_segment(self.store.segment(project_id, segment_id), chosen_take=best.id, state="idle",
                                  error=None)

    def _suspect(self, segment: Segment, made: Made) -> list[str]:
        """Why a take needs listening to (empty: none): the automatic check of its audio, and per text segment its
        speech tokens looping or at the model's length bounds for the text."""
        flags = finishing.check_take(made.pcm, self.service.sample_rate, segment.text, segment.speed)
        for text, tokens in zip(made.prepared.segments, made.speech_tokens, strict=False):
            n_text = made.prepared.plan.head.shape[1] + self.service.count_text_tokens(text)  # as the LLM counts
            reason = (finishing.token_bounds(len(tokens), CosyVoice3LM.length_limits(n_text), n_text)
                      or finishing.token_loop(tokens))
            if reason:
                flags.append(reason)
        return flags

    def _exists(self, project_id: str) -> None:
        try:
            self.store.project(project_id)
        except NotFoundError as exc:
            raise JobGone(f"the project {project_id} was deleted") from exc


def _keep(service: TTSService, request: SynthesisRequest, made: Made, takes: TakeStore, **where) -> StoredTake:
    """A segment's take kept as every take is (:func:`keep_take`); ``where``: the project's part of its record."""
    return keep_take(takes, service, request, made.prepared, made.pcm, made.timings, **where)
