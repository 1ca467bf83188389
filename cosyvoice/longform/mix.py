"""A project's mix and what is made of it: the chosen takes in order with their pauses, finished segment by
segment, written as one audio file (with chapters and the book's tags), measured against ACX, timed for subtitles
and the segment table of an export. Everything here streams: one segment's audio is in memory at a time.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np

from cosyvoice.encoding import Chapter, file_format, write_file
from cosyvoice.engine import CancelToken
from cosyvoice.errors import InvalidInputError
from cosyvoice.jobs import Cancelled
from cosyvoice.longform import finishing
from cosyvoice.longform.store import ProjectStore, Segment, Take, current_take
from cosyvoice.longform.tags import Covers, file_stem, tag_file


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



class Mixer:
    """The mixes of ``store``'s projects at ``sample_rate``, tagged from ``covers``."""

    def __init__(self, store: ProjectStore, sample_rate: int, covers: Covers) -> None:
        self.store = store
        self.sample_rate = sample_rate
        self.covers = covers

    def plan(self, project_id: str) -> tuple[list[tuple[Segment, Take, float]], finishing.Finish]:
        """(segment, its current take, seconds of pause after it) in order, and the project's finishing;
        refused while any segment has no current take."""
        project = self.store.project(project_id)
        segments = self.store.segments(project_id)
        takes = self.store.takes(project_id)
        chosen = [current_take(s, takes) for s in segments]
        missing = [i + 1 for i, t in enumerate(chosen) if t is None]
        if missing:
            listed = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
            raise InvalidInputError(f"{len(missing)} segment(s) have no audio yet ({listed}); generate them first",
                                    "segments")
        pauses = project.settings["pauses"]
        plan = [(s, t, 0.0 if i == len(segments) - 1 else s.pause if s.pause is not None else pauses.get(s.brk, 0.0))
                for i, (s, t) in enumerate(zip(segments, chosen, strict=True))]
        return plan, finishing.Finish(project.settings.get("preset"), project.settings.get("margin", 0.1))

    def _pieces(self, project_id: str, finished: bool, rows: list, level: bool = True,
                cancel: CancelToken | None = None) -> Iterator[np.ndarray]:
        """The mix piece by piece (a segment, then its pause), one segment in memory at a time; ``rows`` gets
        each segment's place as it is reached. ``level=False`` skips the loudness step (lengths only). The plan
        is checked now, before anything is written ("no audio yet" is an answer, not a half-written file); ``cancel``
        stops it between segments (:class:`~cosyvoice.jobs.Cancelled`)."""
        plan, finish = self.plan(project_id)
        if not level:
            finish = finishing.Finish(None, finish.margin)
        return self._mix(plan, finish, finished, rows, cancel)

    def _mix(self, plan: list[tuple[Segment, Take, float]], finish: finishing.Finish, finished: bool,
             rows: list, cancel: CancelToken | None) -> Iterator[np.ndarray]:
        sr, at = self.sample_rate, 0
        for segment, take, pause in plan:
            if cancel is not None and cancel.cancelled:
                raise Cancelled
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

    def export_to(self, out: BinaryIO, project_id: str, fmt: str = "wav", finished: bool = True,
                  cancel: CancelToken | None = None) -> Timeline:
        """Write the mix into the seekable file ``out`` in ``fmt`` (wav, mp3, flac, opus, m4b, mp4; the MP4
        formats carry the chapters; MP3 and MP4 the book's title, author, narrator and cover), one segment at a
        time; the timeline carries the mix's ACX check."""
        audio_fmt = file_format(fmt)
        rows: list = []
        meters = AcxBook(self.sample_rate, self._has_chapters(project_id))
        start = out.tell()
        write_file(out, meters.measure(self._pieces(project_id, finished, rows, cancel=cancel), rows), audio_fmt,
                   self.sample_rate, lambda: Timeline(self.sample_rate, rows).chapters)
        if audio_fmt.name in ("mp3", "m4b", "mp4") and start == 0:  # a file of its own: tagged as the book
            tag_file(out, audio_fmt.name, self.covers.tags(project_id))
        return Timeline(self.sample_rate, rows, acx=meters.result())

    def acx(self, project_id: str, cancel: CancelToken | None = None) -> dict:
        """The finished mix checked against ACX's requirements, per chapter (as the export's chapters) and for the
        whole book, without writing a file."""
        rows: list = []
        meters = AcxBook(self.sample_rate, self._has_chapters(project_id))
        for _ in meters.measure(self._pieces(project_id, True, rows, cancel=cancel), rows):
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
