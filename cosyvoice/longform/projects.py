"""Long-form projects over the service: segment tables, generation jobs, takes, finishing and export.

:class:`LongformStudio` is what the REST router, the page and the CLI call. It synthesises only through
``TTSService.synthesize`` (one request per segment, each with its own recorded seed) and splits text only with
the frontend's splitter, so a segment is read exactly as the table shows it. Segment k's audio depends on its
own text, voice, instruction, speed and seed alone; the mix is the chosen takes with pauses between them, so
regenerating one segment leaves every other sample of the mix as it was (also after finishing, which works on
each segment by itself: ``finishing.finish_segment``).
"""

from __future__ import annotations

import contextlib
import functools
import io
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np

from cosyvoice.encoding import Chapter, file_format, write_file
from cosyvoice.engine import CancelToken, ChunkSchedule
from cosyvoice.errors import InvalidInputError, NotFoundError
from cosyvoice.jobs import Job, JobGone, JobState, Made, Task, release, runner, synthesize
from cosyvoice.llm.model import CosyVoice3LM
from cosyvoice.longform import documents, finishing, script
from cosyvoice.longform.delivery import Deliveries, file_stem, tag_file, tag_text
from cosyvoice.longform.store import Project, ProjectStore, Segment, Take
from cosyvoice.service import SynthesisRequest, TTSService, check_text
from cosyvoice.settings import FLOW_STEPS_RANGE, SPEED_RANGE, env_name
from cosyvoice.system.sqlite import require_writable
from cosyvoice.takes.provenance import provenance

SUSPECT_RETRIES = 0  # a project's default: suspect takes are flagged; a project may ask for new takes (new seeds)
MAX_RETRIES = 5
KIND = "longform"  # the job kind of a project's generation


@dataclass(frozen=True)
class Timeline:
    """Where each segment of a mix sits: (segment, take, start s, end s), in order. The last segment has no
    pause after it, so the mix ends where it ends."""

    sample_rate: int
    rows: list[tuple[Segment, Take, float, float]]
    acx: dict | None = field(default=None, kw_only=True)  # the mix's ACX check (AcxBook.result), once made

    @property
    def seconds(self) -> float:
        return self.rows[-1][3] if self.rows else 0.0

    @property
    def cues(self) -> list[finishing.Cue]:
        return [finishing.Cue(start, end, seg.text.strip()) for seg, _, start, end in self.rows]

    @property
    def chapters(self) -> list[Chapter]:
        """One chapter from each segment that opens one to the next (none when the project has no chapters)."""
        starts = [(seg.chapter, start) for seg, _, start, _ in self.rows if seg.chapter]
        if not starts:
            return []
        if starts[0][1] > 0:
            starts.insert(0, ("Start", 0.0))
        return [Chapter(title, start, starts[i + 1][1] if i + 1 < len(starts) else self.seconds)
                for i, (title, start) in enumerate(starts)]


@dataclass(frozen=True)
class Rendered(Timeline):
    """A timeline with its audio, in memory (tests, short projects; exports stream instead)."""

    audio: np.ndarray


def default_settings(**overrides: object) -> dict:
    settings = {"pauses": dict(script.DEFAULT_PAUSES), "preset": "podcast", "margin": 0.1, "speakers": {},
                "retries": SUSPECT_RETRIES}
    settings.update(overrides)
    return settings


class LongformStudio:
    """The projects of ``store`` (``longform.sqlite3`` + the take store's audio), synthesised through ``service``."""

    def __init__(self, service: TTSService, store: ProjectStore) -> None:
        self.service = service
        self.store = store
        self.sample_rate = service.sample_rate
        self.jobs = runner(self.store.root, service.limits.job_workers)
        self.jobs.register(KIND, self._tasks)
        self.delivery = Deliveries(self)

    def close(self) -> None:
        """Stop this process's generation jobs (done takes stay) and close the store."""
        release(self.jobs)
        self.store.close()

    # ------------------------------------------------------------------ creating

    def split(self, text: str) -> list[str]:
        """The frontend's split of one paragraph: normalised pieces, as the model reads them."""
        return self.service.split_text(text)

    def create(self, name: str, text: str, *, voice: str | None = None, kind: str = "document",
               speakers: dict[str, str] | None = None, chapters: list[tuple[str | None, str]] | None = None,
               owner: str | None = None, cancel: CancelToken | None = None,
               progress: Callable[[int, int], None] | None = None, **settings: object) -> Project:
        """A project from a document (``voice`` reads it all) or a dialogue script (``speakers`` maps each
        label to a voice), belonging to ``owner`` (:mod:`cosyvoice.owners`), whose voices (an unsaved upload is
        its uploader's alone) are the only ones it may name. ``chapters`` (title, text) come from an EPUB, DOCX or
        PDF; ``settings`` override the defaults (``pauses``, ``preset``, ``margin``, ``retries``, ``steps``: the
        flow's Euler steps of every take, None: the model's; ``final`` and ``first_hop``: the chunk schedule of
        every take, None: the reference's). Bounded by the service's ``Limits``
        (``max_import_*``, ``max_project_segments``, ``max_dialogue_*``); ``cancel`` stops it (:class:`Cancelled`)
        before anything is stored; ``progress(blocks split, blocks)`` hears how far the splitting is."""
        limits = self.service.limits
        if kind not in ("document", "dialogue"):
            raise InvalidInputError(f"kind must be 'document' or 'dialogue', got {kind!r}", "kind")
        if not isinstance(text, str) or not text.strip():
            raise InvalidInputError("the project has no text; paste some or upload a file", "text")
        documents.check_text(text, limits)
        name = self._name(name) or "Untitled"
        settings = self._settings(default_settings(), settings)
        if kind == "dialogue":
            blocks = script.dialogue_blocks(text, limits)
            if speakers is not None and not isinstance(speakers, dict):
                raise InvalidInputError("speakers must map each label to a voice", "speakers")
            if len(speakers or {}) > limits.max_dialogue_speakers:
                raise InvalidInputError(f"speakers maps more than {limits.max_dialogue_speakers:,} labels "
                                        f"({env_name('max_dialogue_speakers')})", "speakers")
            mapping = {k.strip(): self._voice_id(v, "speakers", owner) for k, v in (speakers or {}).items()}
            missing = sorted({b.speaker for b in blocks} - set(mapping))
            if missing and voice is None:
                raise InvalidInputError(f"map every speaker to a voice; no voice for {', '.join(missing)}",
                                        "speakers")
            fallback = self._voice_id(voice, "voice", owner) if missing else None
            mapping |= dict.fromkeys(missing, fallback)
            settings["speakers"] = mapping
            settings["unmapped_speakers"] = missing  # they read with ``voice``: the page says so
        else:
            blocks = script.document_blocks(text, chapters)
            settings["voice"] = self._voice_id(voice, "voice", owner)
        rows = []
        for d in script.segment_drafts(blocks, self.split, limits, cancel, progress):
            rows.append({"text": d.text, "voice": settings["speakers"][d.speaker] if d.speaker else
                         settings["voice"], "instruction": d.instruction, "brk": d.brk, "pause": d.pause,
                         "chapter": d.chapter, "speaker": d.speaker})
        return self.store.add_project(name, kind, text, settings, rows, owner)

    def _name(self, name: object) -> str:
        """A project's name on one line, within ``Limits.max_project_name_chars``."""
        name = " ".join(str(name or "").split())
        bound = self.service.limits.max_project_name_chars
        if len(name) > bound:
            raise InvalidInputError(f"the name has {len(name):,} characters; at most {bound} "
                                    f"({env_name('max_project_name_chars')})", "name")
        return name

    def _voice_id(self, voice: object, field_name: str, owner: str | None) -> str:
        """The id of the voice ``voice`` names, if ``owner`` may use it (another's unsaved upload: not found)."""
        if not isinstance(voice, str) or not voice.strip():
            raise InvalidInputError("choose a voice (a saved or built-in voice's name or id)", field_name)
        try:
            return self.service.get_voice(voice.strip(), owner=owner).id
        except NotFoundError as exc:
            raise NotFoundError(f"no voice {voice.strip()!r}; save it first or choose another", field_name) from exc

    @staticmethod
    def _settings(base: dict, changes: dict) -> dict:
        """``base`` with ``changes`` applied, each checked (errors name the setting)."""
        out = dict(base)
        for key, value in changes.items():
            if key == "pauses":
                if not isinstance(value, dict):
                    raise InvalidInputError("pauses must map breaks to seconds", "pauses")
                pauses = dict(out["pauses"])
                for brk, seconds in value.items():
                    if brk not in script.DEFAULT_PAUSES:
                        raise InvalidInputError(f"unknown break {brk!r}; use {', '.join(script.DEFAULT_PAUSES)}",
                                                "pauses")
                    pauses[brk] = _seconds(seconds, f"pauses.{brk}")
                out["pauses"] = pauses
            elif key == "preset":
                if value not in (*finishing.PRESET_NAMES, None, "none"):
                    raise InvalidInputError(f"unknown loudness preset {value!r}; use "
                                            f"{', '.join(finishing.PRESET_NAMES)} or none", "preset")
                out["preset"] = None if value == "none" else value
            elif key == "margin":
                out["margin"] = _seconds(value, "margin", 2.0)
            elif key == "retries":
                if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_RETRIES:
                    raise InvalidInputError(f"retries must be a whole number of new takes in 0..{MAX_RETRIES}",
                                            "retries")
                out["retries"] = value
            elif key == "steps":
                lo, hi = FLOW_STEPS_RANGE
                if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                          or not lo <= value <= hi):
                    raise InvalidInputError(f"steps must be a whole number from {lo} to {hi}", "steps")
                out["steps"] = value
            elif key in ("final", "first_hop"):  # the chunk schedule of every take, checked as a request's is
                ChunkSchedule.checked(**{key: value})
                out[key] = value
            elif key in ("title", "author", "narrator"):  # the book's, in the tags of its exports
                out[key] = tag_text(value, key)
            else:
                raise InvalidInputError(f"unknown setting {key!r}", key)
        return out

    # ------------------------------------------------------------------ reading

    def project(self, project_id: str) -> Project:
        return self.store.project(project_id)

    def projects(self) -> list[Project]:
        return self.store.projects()

    def segments(self, project_id: str) -> list[Segment]:
        self.store.project(project_id)
        return self.store.segments(project_id)

    def current_take(self, segment: Segment, takes: dict[str, list[Take]]) -> Take | None:
        """The segment's chosen take if it still says what the segment says."""
        chosen = next((t for t in takes.get(segment.id, []) if t.id == segment.chosen_take), None)
        return chosen if chosen is not None and chosen.matches(segment) else None

    def status(self, segment: Segment, takes: dict[str, list[Take]], queued: dict[str, str]) -> str:
        """done | running | queued | failed | pending (``queued``: :meth:`_queued`)."""
        if segment.id in queued:
            return queued[segment.id]
        if self.current_take(segment, takes) is not None:
            return "done"
        return "failed" if segment.state == "failed" else "pending"

    def _queued(self, project_id: str) -> dict[str, str]:
        """Segments the project's active jobs will still make: segment id -> running | queued."""
        out: dict[str, str] = {}
        for job in self.jobs.jobs(project_id, active=True):
            for sid, _ in job.params["segments"][job.position:]:
                out.setdefault(sid, "running" if sid == job.current else "queued")
        return out

    def table(self, project_id: str) -> list[tuple[Segment, list[Take], str]]:
        """The segment table: each segment with its takes (oldest first) and its status."""
        segments = self.segments(project_id)
        takes = self.store.takes(project_id)
        queued = self._queued(project_id)
        return [(s, takes.get(s.id, []), self.status(s, takes, queued)) for s in segments]

    def progress(self, project_id: str) -> dict:
        """The generation's progress, from the job runner's database (so any process on the data folder sees
        it): counts, the segment being made, elapsed seconds, an ETA (at the characters per second measured so
        far), and the last job's state and error."""
        segments = self.segments(project_id)
        takes = self.store.takes(project_id)
        jobs = self.jobs.jobs(project_id)
        active = [j for j in jobs if j.state.active]
        queued = self._queued(project_id)
        states = [self.status(s, takes, queued) for s in segments]
        etas = [j.eta_seconds for j in active]
        running = next((j for j in active if j.state is JobState.RUNNING), None)
        return {"running": bool(active), "total": len(segments), "done": states.count("done"),
                "failed": states.count("failed"), "queued": states.count("queued") + states.count("running"),
                "current": running.current if running else None,
                "elapsed": round(time.time() - min(j.started or j.created for j in active), 1) if active else None,
                "eta": None if not active or None in etas else round(sum(etas), 1),
                "state": jobs[-1].state.value if jobs else None, "error": jobs[-1].error if jobs else None}

    # ------------------------------------------------------------------ editing

    def edit_segment(self, project_id: str, segment_id: str, *, owner: str | None = None,
                     **changes: object) -> Segment:
        """Change a segment's text (normalised and checked here), voice (one ``owner`` may use), instruction,
        speed or pause."""
        segment = self.store.segment(project_id, segment_id)
        updates: dict[str, object] = {}
        for key, value in changes.items():
            if key == "text":
                updates["text"] = self._one_segment(value)
            elif key == "voice":
                updates["voice"] = self._voice_id(value, "voice", owner)
            elif key == "instruction":
                if not isinstance(value, str):
                    raise InvalidInputError("instruction must be text", "instruction")
                if value.strip():
                    check_text(value, self.service.limits, "instruction")
                updates["instruction"] = value.strip()
            elif key == "speed":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not \
                        SPEED_RANGE[0] <= value <= SPEED_RANGE[1]:
                    raise InvalidInputError(f"speed must be a number in {SPEED_RANGE[0]}..{SPEED_RANGE[1]}", "speed")
                updates["speed"] = float(value)
            elif key == "pause":
                updates["pause"] = None if value is None else _seconds(value, "pause")
            else:
                raise InvalidInputError(f"a segment has no field {key!r}", key)
        self._not_running(segment)
        return self.store.update_segment(segment, **updates)

    def _one_segment(self, text: object) -> str:
        if not isinstance(text, str):
            raise InvalidInputError("text must be a string", "text")
        check_text(text, self.service.limits)
        pieces = self.split(" ".join(text.split()))
        if not pieces:
            raise InvalidInputError("this text has nothing to speak (only punctuation?)", "text")
        return "".join(pieces)

    def split_segment(self, project_id: str, segment_id: str, at: int) -> list[Segment]:
        """Two segments from one, cut before character ``at``; its takes stay with the first half."""
        segment = self.store.segment(project_id, segment_id)
        self._not_running(segment)
        if not isinstance(at, int) or isinstance(at, bool) or not 0 < at < len(segment.text):
            raise InvalidInputError(f"split position must be inside the text (1..{len(segment.text) - 1})", "at")
        first, second = self._one_segment(segment.text[:at]), self._one_segment(segment.text[at:])
        base = {"voice": segment.voice, "instruction": segment.instruction, "speed": segment.speed,
                "speaker": segment.speaker}
        rows = [base | {"id": segment.id, "text": first, "brk": "sentence", "chapter": segment.chapter,
                        "chosen_take": segment.chosen_take},
                base | {"text": second, "brk": segment.brk, "pause": segment.pause}]
        return self.store.replace_segments(project_id, [segment], segment.position, rows)

    def merge_segments(self, project_id: str, segment_id: str) -> Segment:
        """The segment joined with the next one (same voice and instruction); both's takes are kept."""
        segments = self.store.segments(project_id)
        index = next((i for i, s in enumerate(segments) if s.id == segment_id), None)
        if index is None:
            raise NotFoundError(f"no segment {segment_id!r} in this project", "segment")
        if index + 1 >= len(segments):
            raise InvalidInputError("the last segment has no next segment to merge with", "segment")
        a, b = segments[index], segments[index + 1]
        for s in (a, b):
            self._not_running(s)
        if (a.voice, a.instruction, a.speaker) != (b.voice, b.instruction, b.speaker):
            raise InvalidInputError("only segments with the same voice and instruction can be merged", "segment")
        joiner = "" if a.text.endswith(" ") or b.text.startswith(" ") else " "
        row = {"id": a.id, "text": a.text + joiner + b.text, "voice": a.voice, "instruction": a.instruction,
               "speed": a.speed, "brk": b.brk, "pause": b.pause, "chapter": a.chapter, "speaker": a.speaker,
               "chosen_take": a.chosen_take}
        return self.store.replace_segments(project_id, [a, b], a.position, [row], takes_to={b.id: 0})[0]

    def choose_take(self, project_id: str, segment_id: str, take_id: str) -> Segment:
        """Mark one of the segment's takes as the one used; the segment takes that take's text and settings."""
        segment = self.store.segment(project_id, segment_id)
        take = self.store.take(project_id, take_id)
        if take.segment_id != segment.id:
            raise InvalidInputError("that take belongs to another segment", "take")
        self._not_running(segment)
        return self.store.update_segment(segment, chosen_take=take.id, text=take.text, voice=take.voice,
                                         instruction=take.instruction, speed=take.speed)

    def update_settings(self, project_id: str, name: str | None = None, **settings: object) -> Project:
        project = self.store.project(project_id)
        changes: dict[str, object] = {"settings": self._settings(project.settings, settings)}
        if name is not None:
            changes["name"] = self._name(name) or project.name
        return self.store.update_project(project_id, **changes)

    def delete(self, project_id: str) -> tuple[Project, dict[str, list[str]]]:
        """Delete a project, its segments and its takes, except those listening tests use (they stay in the
        workbench; returned: take id -> the tests). Its jobs are cancelled first; one that another process runs
        ends there cleanly (its take is refused, its file removed)."""
        for job in self.jobs.jobs(project_id, active=True):
            self.jobs.cancel(job.id)
            self.jobs.wait(job.id)
        deleted = self.store.delete_project(project_id)
        self.delivery.remove(project_id)  # its ACX delivery and cover
        return deleted

    def _not_running(self, segment: Segment) -> None:
        if segment.id in self._queued(segment.project_id):
            raise InvalidInputError("this segment is being generated; wait for it or stop the job", "segment")

    # ------------------------------------------------------------------ generating

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
            order = [s.id for s in segments if self.current_take(s, takes) is None]
        queued = self._queued(project_id)
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
        for job in self.jobs.jobs(project_id, active=True):
            self.jobs.cancel(job.id)
        return self.progress(project_id)

    def wait(self, project_id: str, timeout: float | None = None) -> dict:
        """Block until the project's jobs in this process end (tests, the CLI)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for job in self.jobs.jobs(project_id, active=True):
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
        if not new_take and self.current_take(segment, self.store.takes(project_id)) is not None:
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
            record = provenance(self.service, request, made.prepared, made.pcm.size, made.timings)
            try:
                take = self.store.add_take(segment, made.pcm, self.sample_rate, record, flags=flags,
                                           seconds_to_make=made.seconds, choose=not flags)
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
        flags = finishing.check_take(made.pcm, self.sample_rate, segment.text, segment.speed)
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

    # ------------------------------------------------------------------ finishing and export

    def plan(self, project_id: str) -> tuple[list[tuple[Segment, Take, float]], finishing.Finish]:
        """(segment, its current take, seconds of pause after it) in order, and the project's finishing;
        refused while any segment has no current take."""
        project = self.store.project(project_id)
        segments = self.store.segments(project_id)
        takes = self.store.takes(project_id)
        chosen = [self.current_take(s, takes) for s in segments]
        missing = [i + 1 for i, t in enumerate(chosen) if t is None]
        if missing:
            listed = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
            raise InvalidInputError(f"{len(missing)} segment(s) have no audio yet ({listed}); generate them first",
                                    "segments")
        pauses = project.settings["pauses"]
        plan = [(s, t, 0.0 if i == len(segments) - 1 else s.pause if s.pause is not None else pauses.get(s.brk, 0.0))
                for i, (s, t) in enumerate(zip(segments, chosen, strict=True))]
        return plan, finishing.Finish(project.settings.get("preset"), project.settings.get("margin", 0.1))

    def _pieces(self, project_id: str, finished: bool, rows: list, level: bool = True) -> Iterator[np.ndarray]:
        """The mix piece by piece (a segment, then its pause), one segment in memory at a time; ``rows`` gets
        each segment's place as it is reached. ``level=False`` skips the loudness step (lengths only). The plan
        is checked now, before anything is written ("no audio yet" is an answer, not a half-written file)."""
        plan, finish = self.plan(project_id)
        if not level:
            finish = finishing.Finish(None, finish.margin)
        return self._mix(plan, finish, finished, rows)

    def _mix(self, plan: list[tuple[Segment, Take, float]], finish: finishing.Finish, finished: bool,
             rows: list) -> Iterator[np.ndarray]:
        sr, at = self.sample_rate, 0
        for segment, take, pause in plan:
            audio = self.store.take_audio(take)
            if finished:
                audio = finishing.finish_segment(audio, take.sample_rate, finish)
            rows.append((segment, take, at / sr, (at + len(audio)) / sr))
            gap = round(pause * sr)
            yield audio
            if gap:
                yield np.zeros(gap, np.float32)
            at += len(audio) + gap

    def render(self, project_id: str, finished: bool = True) -> Rendered:
        """The project's mix in memory: chosen takes in order with their pauses; ``finished`` trims and levels
        each segment by the project's settings first. Refused while any segment has no current take."""
        rows: list = []
        pieces = list(self._pieces(project_id, finished, rows))
        return Rendered(self.sample_rate, rows, np.concatenate(pieces).astype(np.float32))

    def timeline(self, project_id: str, finished: bool = True) -> Timeline:
        """The mix's timings without making it (finishing changes lengths by trimming only)."""
        rows: list = []
        for _ in self._pieces(project_id, finished, rows, level=False):
            pass
        return Timeline(self.sample_rate, rows)

    def export_to(self, out: BinaryIO, project_id: str, fmt: str = "wav", finished: bool = True) -> Timeline:
        """Write the mix into the seekable file ``out`` in ``fmt`` (wav, mp3, flac, opus, m4b, mp4; the MP4
        formats carry the chapters; MP3 and MP4 the book's title, author, narrator and cover), one segment at a
        time; the timeline carries the mix's ACX check."""
        audio_fmt = file_format(fmt)
        rows: list = []
        meters = AcxBook(self.sample_rate, self._has_chapters(project_id))
        start = out.tell()
        write_file(out, meters.measure(self._pieces(project_id, finished, rows), rows), audio_fmt,
                   self.sample_rate, lambda: Timeline(self.sample_rate, rows).chapters)
        if audio_fmt.name in ("mp3", "m4b", "mp4") and start == 0:  # a file of its own: tagged as the book
            tag_file(out, audio_fmt.name, self.delivery.tags(project_id))
        return Timeline(self.sample_rate, rows, acx=meters.result())

    def acx(self, project_id: str) -> dict:
        """The finished mix checked against ACX's requirements, per chapter (as the export's chapters) and for the
        whole book, without writing a file."""
        rows: list = []
        meters = AcxBook(self.sample_rate, self._has_chapters(project_id))
        for _ in meters.measure(self._pieces(project_id, True, rows), rows):
            pass
        return meters.result()

    def _has_chapters(self, project_id: str) -> bool:
        return any(segment.chapter for segment in self.store.segments(project_id))

    def export(self, project_id: str, fmt: str = "wav", finished: bool = True) -> tuple[str, bytes, Timeline]:
        """(file name, bytes, timeline) of the mix in ``fmt``, in memory."""
        buffer = io.BytesIO()
        timeline = self.export_to(buffer, project_id, fmt, finished)
        return self.file_name(project_id, fmt), buffer.getvalue(), timeline

    def file_name(self, project_id: str, fmt: str) -> str:
        return f"{file_stem(self.store.project(project_id).name)}.{file_format(fmt).extension}"

    def segments_json(self, project_id: str, timeline: Timeline) -> dict:
        """The table of an export: per segment its text, start/end seconds, seed, take and voice."""
        project = self.store.project(project_id)
        return {"project": project.id, "name": project.name, "sample_rate": timeline.sample_rate,
                "duration": round(timeline.seconds, 3),
                "preset": project.settings.get("preset"),
                **({"acx": timeline.acx} if timeline.acx is not None else {}),
                "segments": [{"index": i, "id": s.id, "text": s.text, "start": round(a, 3), "end": round(b, 3),
                              "seed": t.seed, "take": t.id, "voice": t.voice, "voice_id": t.voice_id,
                              "speaker": s.speaker, "instruction": s.instruction, "chapter": s.chapter,
                              "flags": t.flags}
                             for i, (s, t, a, b) in enumerate(timeline.rows)],
                "chapters": [{"title": c.title, "start": round(c.start, 3), "end": round(c.end, 3)}
                             for c in timeline.chapters]}

    def subtitles(self, project_id: str, kind: str = "srt", finished: bool = True) -> str:
        if kind not in ("srt", "vtt"):
            raise InvalidInputError(f"subtitles are srt or vtt, not {kind!r}", "format")
        cues = self.timeline(project_id, finished).cues
        return finishing.srt(cues) if kind == "srt" else finishing.vtt(cues)


class AcxBook:
    """ACX meters over a mix as it is made: one for the book, one per chapter as ``Timeline.chapters`` cuts them
    (a "Start" chapter before the first heading)."""

    def __init__(self, sample_rate: int, chapters: bool) -> None:
        self.sample_rate = sample_rate
        self.book = finishing.AcxMeter(sample_rate)
        self.chapters: list[tuple[str, finishing.AcxMeter]] = []
        self._by_chapter = chapters

    def measure(self, pieces: Iterator[np.ndarray], rows: list) -> Iterator[np.ndarray]:
        """``pieces`` passed on, measured; ``rows`` is the list ``_pieces`` appends each segment's place to."""
        seen = 0
        for piece in pieces:
            if len(rows) > seen:  # a segment's audio (a pause does not add a row)
                seen = len(rows)
                title = rows[-1][0].chapter
                if self._by_chapter and (title or not self.chapters):
                    self.chapters.append((title or "Start", finishing.AcxMeter(self.sample_rate)))
            self.book.feed(piece)
            if self.chapters:
                self.chapters[-1][1].feed(piece)
            yield piece

    def result(self) -> dict:
        book = self.book.report()
        chapters = [{"title": title, **meter.report().as_dict()} for title, meter in self.chapters]
        return {"passed": book.passed and all(c["passed"] for c in chapters), "book": book.as_dict(),
                "chapters": chapters,
                "requirements": {"rms_db": list(finishing.ACX_RMS_DB), "peak_db": finishing.ACX_PEAK_DB,
                                 "noise_floor_db": finishing.ACX_NOISE_FLOOR_DB}}


def _seconds(value: object, field_name: str, limit: float = script.MAX_PAUSE_SECONDS) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= limit:
        raise InvalidInputError(f"{field_name} must be a number of seconds in 0..{limit:g}", field_name)
    return float(value)

