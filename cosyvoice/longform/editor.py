"""Editing long-form projects: a project made from a document or a dialogue script, its settings, and its segment
table (text, voice, instruction, speed, pause; split, merge, the take used). Every value is checked with the
service's own checks (:mod:`cosyvoice.checks`) and split with the frontend's splitter, so a segment is read exactly
as the table shows it; a segment the render job is making is not changed under it.
"""

from __future__ import annotations

from collections.abc import Callable

from cosyvoice.checks import check_speed, check_steps, check_text
from cosyvoice.engine import CancelToken, ChunkSchedule
from cosyvoice.errors import InvalidInputError, NotFoundError
from cosyvoice.longform import documents, finishing, script
from cosyvoice.longform.rendering import SUSPECT_RETRIES, Renders
from cosyvoice.longform.store import Project, ProjectStore, Segment
from cosyvoice.longform.tags import tag_text
from cosyvoice.service import TTSService
from cosyvoice.settings import env_name

MAX_RETRIES = 5


def default_settings(**overrides: object) -> dict:
    settings = {"pauses": dict(script.DEFAULT_PAUSES), "preset": "podcast", "margin": 0.1, "speakers": {},
                "retries": SUSPECT_RETRIES}
    settings.update(overrides)
    return settings



class ProjectEditor:
    """Makes and edits ``store``'s projects with ``service``'s checks, splitter and voices; ``renders`` says which
    segments are being made."""

    def __init__(self, service: TTSService, store: ProjectStore, renders: Renders) -> None:
        self.service = service
        self.store = store
        self.renders = renders

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
        settings = checked_settings(default_settings(), settings)
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
                updates["speed"] = check_speed(value)
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
        changes: dict[str, object] = {"settings": checked_settings(project.settings, settings)}
        if name is not None:
            changes["name"] = self._name(name) or project.name
        return self.store.update_project(project_id, **changes)

    def _not_running(self, segment: Segment) -> None:
        if segment.id in self.renders.queued(segment.project_id):
            raise InvalidInputError("this segment is being generated; wait for it or stop the job", "segment")


def checked_settings(base: dict, changes: dict) -> dict:
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
            out["steps"] = check_steps(value, None)
        elif key in ("final", "first_hop"):  # the chunk schedule of every take, checked as a request's is
            ChunkSchedule.checked(**{key: value})
            out[key] = value
        elif key in ("title", "author", "narrator"):  # the book's, in the tags of its exports
            out[key] = tag_text(value, key)
        else:
            raise InvalidInputError(f"unknown setting {key!r}", key)
    return out


def _seconds(value: object, field_name: str, limit: float = script.MAX_PAUSE_SECONDS) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= limit:
        raise InvalidInputError(f"{field_name} must be a number of seconds in 0..{limit:g}", field_name)
    return float(value)

