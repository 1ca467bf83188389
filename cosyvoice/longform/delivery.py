"""Audiobook delivery as ACX accepts it, and the check of the files delivered.

ACX's submission requirements are about files, not only levels: one MP3 per chapter, 192 kbps constant bit
rate, 44.1 kHz, every file mono (or every file stereo), each at most 120 minutes, 0.5-1 s of room tone at the
head and 1-5 s at the tail, RMS -23 to -18 dB, peak at most -3 dB, noise floor at most -60 dB. A chapter file is
made here from the finished segments (``finishing``), resampled to 44.1 kHz, with a room tone laid under the
whole file (speech synthesis has no room: digital silence between words is what ACX's reviewers reject as
"no room tone"), and tagged with the book's title, author, narrator and cover. :func:`check_mp3` then reads the
file back, frame header by frame header and decoded sample by sample, and says what ACX would refuse.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import shutil
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from cosyvoice.encoding import AudioFormat, write_file
from cosyvoice.errors import ConflictError, InvalidInputError, NotFoundError
from cosyvoice.longform import finishing
from cosyvoice.longform.mix import Mixer
from cosyvoice.longform.store import ProjectStore, Take
from cosyvoice.longform.tags import BookTags, Covers, file_stem, tag_file
from cosyvoice.system.sqlite import require_writable

ACX_SAMPLE_RATE = 44_100
ACX_BIT_RATE = 192_000
ACX_MP3 = AudioFormat("mp3", "audio/mpeg", "mp3", "mp3", "libmp3lame", ACX_BIT_RATE)  # LAME's default is CBR
ACX_MAX_SECONDS = 120 * 60
ACX_HEAD_SECONDS = (0.5, 1.0)  # room tone before the first word
ACX_TAIL_SECONDS = (1.0, 5.0)  # and after the last
HEAD_SECONDS = 0.75  # what a delivery puts there: the middle of each range, away from its edges
TAIL_SECONDS = 2.0
ROOM_TONE_DB = -72.0  # RMS of the room tone under every file: inaudible, far under ACX's -60 dB floor


# ----------------------------------------------------------------------------- chapter files


@dataclass(frozen=True)
class ChapterPlan:
    """One delivered file: its title and the finished segments' audio with the pause after each."""

    title: str
    parts: list[tuple[Callable[[], np.ndarray], float]]  # (finished audio, on demand; seconds of pause after)



def file_name(index: int, title: str) -> str:
    return f"{index:02d}-{file_stem(title)}.mp3"


def chapter_audio(chapter: ChapterPlan, sample_rate: int, margin: float) -> Iterator[np.ndarray]:
    """The chapter at ``sample_rate``, piece by piece: its segments with their pauses, the head's silence made
    HEAD_SECONDS and the tail's TAIL_SECONDS (finishing left ``margin`` at each end of every segment)."""
    last = len(chapter.parts) - 1
    head = round((HEAD_SECONDS - margin) * sample_rate)
    tail = round((TAIL_SECONDS - margin) * sample_rate)
    for i, (audio, pause) in enumerate(chapter.parts):
        x = audio()
        if i == 0:
            x = np.concatenate([np.zeros(max(head, 0), np.float32), x[max(-head, 0):]])
        if i == last:
            x = np.concatenate([x[: len(x) - max(-tail, 0)], np.zeros(max(tail, 0), np.float32)])
        yield x
        if i < last and pause > 0:
            yield np.zeros(round(pause * sample_rate), np.float32)


def delivered(pieces: Iterable[np.ndarray], sample_rate: int, seed: int) -> Iterator[np.ndarray]:
    """``pieces`` resampled to 44.1 kHz with the room tone (seeded noise at ROOM_TONE_DB RMS) under them, and
    kept 0.1 dB under full scale (a resampler's overshoot must not clip)."""
    import soxr

    stream = soxr.ResampleStream(sample_rate, ACX_SAMPLE_RATE, 1, dtype="float32", quality="HQ")
    rng = np.random.default_rng(seed)
    level = np.float32(10 ** (ROOM_TONE_DB / 20))

    def toned(y: np.ndarray) -> np.ndarray:
        return np.clip(y + rng.standard_normal(len(y)).astype(np.float32) * level, -0.989, 0.989)

    for x in pieces:
        y = stream.resample_chunk(np.asarray(x, np.float32))
        if len(y):
            yield toned(y)
    y = stream.resample_chunk(np.zeros(0, np.float32), last=True)
    if len(y):
        yield toned(y)


def write_chapter(out: BinaryIO, chapter: ChapterPlan, sample_rate: int, margin: float, tags: BookTags,
                  track: tuple[int, int]) -> None:
    """One chapter as ACX's MP3 into the seekable ``out``, tagged."""
    write_file(out, delivered(chapter_audio(chapter, sample_rate, margin), sample_rate, track[0]), ACX_MP3,
               ACX_SAMPLE_RATE)
    tag_file(out, "mp3", tags, chapter.title, track)


# ----------------------------------------------------------------------------- the check of a delivered file

LAYER3_KBPS = {1: (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),  # MPEG-1
               2: (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160)}  # MPEG-2 and 2.5
RATES = {3: (44_100, 48_000, 32_000), 2: (22_050, 24_000, 16_000), 0: (11_025, 12_000, 8_000)}  # by version bits


@dataclass(frozen=True)
class Mp3Frames:
    """What the frame headers of an MP3 say: its Layer III frames' bit rates, sample rates and channels."""

    frames: int
    bit_rates: frozenset[int]
    sample_rates: frozenset[int]
    channels: frozenset[int]


def read_frames(data: bytes) -> Mp3Frames:
    """Walk the MP3's frames from after its ID3v2 tag to the end (an ID3v1 tag at the end is skipped). The
    first frame of a LAME/FFmpeg file is its Xing or Info frame (no audio): it is not counted. Bytes that are
    not a Layer III frame header are stepped over one by one."""
    pos = 0
    if data[:3] == b"ID3" and len(data) >= 10:
        size = int.from_bytes(bytes(b & 0x7F for b in data[6:10]), "big")
        pos = 10 + size + (10 if data[5] & 0x10 else 0)
    end = len(data) - (128 if data[-128:-125] == b"TAG" else 0)
    frames = 0
    rates: set[int] = set()
    srs: set[int] = set()
    chans: set[int] = set()
    first = True
    while pos + 4 <= end:
        h = int.from_bytes(data[pos:pos + 4], "big")
        version, layer = (h >> 19) & 3, (h >> 17) & 3
        bitrate_index, rate_index = (h >> 12) & 15, (h >> 10) & 3
        if h >> 21 != 0x7FF or version == 1 or layer != 1 or bitrate_index in (0, 15) or rate_index == 3:
            pos += 1
            continue
        kbps, sr = LAYER3_KBPS[1 if version == 3 else 2][bitrate_index], RATES[version][rate_index]
        channels = 1 if (h >> 6) & 3 == 3 else 2
        per_frame = 144_000 if version == 3 else 72_000  # an MPEG-2 frame holds half the samples
        side = (17 if channels == 1 else 32) if version == 3 else (9 if channels == 1 else 17)
        info = data[pos + 4 + side: pos + 8 + side] in (b"Xing", b"Info")
        if not (first and info):
            frames += 1
            rates.add(kbps * 1000)
            srs.add(sr)
            chans.add(channels)
        first = False
        pos += per_frame * kbps // sr + ((h >> 9) & 1)
    return Mp3Frames(frames, frozenset(rates), frozenset(srs), frozenset(chans))


@dataclass(frozen=True)
class FileReport:
    """One delivered file against ACX's requirements."""

    name: str
    frames: Mp3Frames
    levels: finishing.AcxReport
    head_seconds: float
    tail_seconds: float
    tags: dict[str, str]
    silent: bool = False  # nothing louder than the room tone from end to end: no speech at all

    @property
    def problems(self) -> list[str]:
        f = self.frames
        found = []
        if not f.frames:
            found.append("not an MP3 (no Layer III frames)")
        else:
            if f.bit_rates != {ACX_BIT_RATE}:
                rates = ", ".join(f"{r // 1000}" for r in sorted(f.bit_rates))
                found.append(f"bit rate {rates} kbps; ACX wants 192 kbps constant (CBR)")
            if f.sample_rates != {ACX_SAMPLE_RATE}:
                found.append(f"sample rate {', '.join(map(str, sorted(f.sample_rates)))} Hz; ACX wants 44100 Hz")
            if f.channels != {1}:
                found.append("not mono")
        if self.levels.seconds > ACX_MAX_SECONDS:
            found.append(f"{self.levels.seconds / 60:.1f} minutes long; ACX takes at most 120 minutes a file")
        (head_lo, head_hi), (tail_lo, tail_hi) = ACX_HEAD_SECONDS, ACX_TAIL_SECONDS
        if self.silent:  # then head and tail are the whole file: one problem, said as it is
            found.append("no speech: nothing louder than room tone from start to end")
        else:
            if not head_lo <= self.head_seconds <= head_hi:
                found.append(f"{self.head_seconds:.2f} s of room tone at the head; ACX wants {head_lo:g}-{head_hi:g} s")
            if not tail_lo <= self.tail_seconds <= tail_hi:
                found.append(f"{self.tail_seconds:.2f} s of room tone at the tail; ACX wants {tail_lo:g}-{tail_hi:g} s")
        return found + self.levels.problems

    @property
    def passed(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict:
        f = self.frames
        return {"file": self.name, **self.levels.as_dict(), "problems": self.problems, "passed": self.passed,
                "format": "MP3" if f.frames else None,
                "bit_rate": max(f.bit_rates) if len(f.bit_rates) == 1 else None,
                "constant_bit_rate": len(f.bit_rates) == 1,
                "sample_rate": max(f.sample_rates) if len(f.sample_rates) == 1 else None,
                "channels": max(f.channels) if len(f.channels) == 1 else None,
                "head_seconds": round(self.head_seconds, 3), "tail_seconds": round(self.tail_seconds, 3),
                "tags": self.tags}


def check_mp3(name: str, file: BinaryIO) -> FileReport:
    """Read a delivered MP3 back as ACX would: its frame headers (format, bit rate, CBR, rate, channels), its
    decoded samples (length, RMS, peak, noise floor, room tone at each end) and its tags (FFmpeg's reader)."""
    import av

    file.seek(0)
    frames = read_frames(file.read())
    file.seek(0)
    with av.open(file, mode="r", format="mp3") as container:
        tags = {k.lower(): v for k, v in container.metadata.items()}
        if any(s.disposition & av.stream.Disposition.attached_pic for s in container.streams.video):
            tags["cover"] = "yes"
        stream = container.streams.audio[0]
        rate = stream.codec_context.sample_rate
        meter, ends = finishing.AcxMeter(rate), _QuietEnds(rate)
        for frame in container.decode(stream):
            x = frame.to_ndarray().astype(np.float32)
            x = x.mean(axis=0) if x.ndim == 2 and x.shape[0] > 1 else x.reshape(-1)
            meter.feed(x)
            ends.feed(x)
    file.seek(0, io.SEEK_END)
    head, tail = ends.result()
    return FileReport(name, frames, meter.report(), head, tail, tags, silent=ends.first is None)


class _QuietEnds:
    """Seconds of quiet (10 ms frames under finishing.SILENCE_DB) before the first and after the last sound."""

    def __init__(self, sample_rate: int) -> None:
        self.sample_rate = sample_rate
        self.n = max(1, int(sample_rate * finishing.FRAME_SECONDS))
        self.rest = np.zeros(0, np.float32)
        self.frames = 0
        self.first: int | None = None
        self.last = -1

    def feed(self, x: np.ndarray) -> None:
        buffer = np.concatenate([self.rest, x])
        whole = len(buffer) // self.n * self.n
        loud = np.flatnonzero(finishing.frame_db(buffer[:whole], self.sample_rate) > finishing.SILENCE_DB)
        if len(loud):
            if self.first is None:
                self.first = self.frames + int(loud[0])
            self.last = self.frames + int(loud[-1])
        self.frames += whole // self.n
        self.rest = buffer[whole:]

    def result(self) -> tuple[float, float]:
        frames = self.frames + (1 if len(self.rest) else 0)
        seconds = finishing.FRAME_SECONDS
        if self.first is None:
            return frames * seconds, frames * seconds
        tail = (self.frames - 1 - self.last) * seconds + len(self.rest) / self.sample_rate
        return self.first * seconds, max(tail, 0.0)


def book_result(files: list[FileReport]) -> dict:
    """The delivery's check: every file's report, and whether ACX would take the set (all files pass)."""
    return {"passed": bool(files) and all(f.passed for f in files), "files": [f.as_dict() for f in files],
            "requirements": {"format": "MP3", "bit_rate": ACX_BIT_RATE, "constant_bit_rate": True,
                             "sample_rate": ACX_SAMPLE_RATE, "channels": 1, "max_minutes": ACX_MAX_SECONDS // 60,
                             "head_seconds": list(ACX_HEAD_SECONDS), "tail_seconds": list(ACX_TAIL_SECONDS),
                             "rms_db": list(finishing.ACX_RMS_DB), "peak_db": finishing.ACX_PEAK_DB,
                             "noise_floor_db": finishing.ACX_NOISE_FLOOR_DB}}


# ----------------------------------------------------------------------------- a project's delivery


class Deliveries:
    """Projects' ACX deliveries in the data folder: ``longform/delivery/<project>.zip`` (a chapter MP3 per file)
    with its check beside it (``.json``), kept until the project changes (a delivery of takes, settings or tags
    no longer the project's is refused, not served); made from ``mixer``'s plan, tagged from ``covers``."""

    def __init__(self, store: ProjectStore, mixer: Mixer, covers: Covers) -> None:
        self.store = store
        self.mixer = mixer
        self.covers = covers
        self.folder = store.audio_root / "delivery"

    def _key(self, project_id: str, plan: list, finish: finishing.Finish, tags: BookTags) -> str:
        """What the delivery is made of: the takes, pauses, chapters, finishing and tags."""
        parts = [[t.id, round(pause, 3), s.chapter] for s, t, pause in plan]
        cover = hashlib.sha256(tags.cover).hexdigest() if tags.cover else None
        made_of = [parts, finish.preset, finish.margin, tags.title, tags.author, tags.narrator, cover]
        return hashlib.sha256(json.dumps(made_of).encode()).hexdigest()[:16]

    def make(self, project_id: str) -> dict:
        """Make the project's delivery (one MP3 per chapter), check every file as delivered, keep both; the
        check is returned. Refused while a segment has no take (nothing is written then)."""
        require_writable(self.store.read_only)
        _remove_orphans(self.folder)
        plan, finish = self.mixer.plan(project_id)
        tags = self.covers.tags(project_id)
        chapters = _chapters(plan, tags.title, self.store.take_audio, finish)
        self.folder.mkdir(parents=True, exist_ok=True)
        reports = []
        sr = self.mixer.sample_rate

        def write(archive: BinaryIO) -> None:
            with zipfile.ZipFile(archive, "w", zipfile.ZIP_STORED) as z:
                for i, chapter in enumerate(chapters, 1):
                    with tempfile.TemporaryFile(dir=self.folder) as mp3:
                        write_chapter(mp3, chapter, sr, finish.margin, tags, (i, len(chapters)))
                        name = file_name(i, chapter.title)
                        reports.append(check_mp3(name, mp3))
                        mp3.seek(0)
                        with z.open(name, "w", force_zip64=True) as entry:
                            shutil.copyfileobj(mp3, entry, 1 << 20)

        _replace(self.folder / f"{project_id}.zip", write)
        result = book_result(reports) | {"key": self._key(project_id, plan, finish, tags), "made": time.time(),
                                         "download": f"{file_stem(tags.title)}-ACX.zip"}
        _replace(self.folder / f"{project_id}.json", lambda f: f.write(json.dumps(result).encode()))
        return result | {"current": True}

    def report(self, project_id: str) -> dict:
        """The last delivery's check, with ``current``: whether it is still of the project as it is."""
        path = self.folder / f"{project_id}.json"
        self.store.project(project_id)
        if not path.exists():
            raise NotFoundError("no ACX delivery made yet; press Master to ACX or Check", "delivery")
        result = json.loads(path.read_text(encoding="utf-8"))
        try:
            plan, finish = self.mixer.plan(project_id)
        except InvalidInputError:
            return result | {"current": False}
        return result | {"current": result["key"] == self._key(project_id, plan, finish, self.covers.tags(project_id))}

    def archive(self, project_id: str) -> tuple[str, Path]:
        """(download name, path) of the delivery's ZIP; refused when the project changed since it was made."""
        result = self.report(project_id)
        if not result["current"]:
            raise ConflictError("the project changed since its ACX delivery was made; make it again", "delivery")
        return result["download"], self.folder / f"{project_id}.zip"

    def remove(self, project_id: str) -> None:
        for path in (self.folder / f"{project_id}.zip", self.folder / f"{project_id}.json"):
            path.unlink(missing_ok=True)


def _chapters(plan: list, title: str, take_audio: Callable, finish: finishing.Finish) -> list[ChapterPlan]:
    """The plan cut into files: a new file at each segment that opens a chapter ("Start" before the first
    heading); a book without headings is one file named after the book."""
    chapters: list[ChapterPlan] = []
    for segment, take, pause in plan:
        if segment.chapter or not chapters:
            heading = segment.chapter or ("Start" if any(s.chapter for s, _, _ in plan) else title)
            chapters.append(ChapterPlan(heading, []))
        audio = functools.partial(_finished, take_audio, take, finish)
        chapters[-1].parts.append((audio, pause))
    return chapters


def _finished(take_audio: Callable, take: Take, finish: finishing.Finish) -> np.ndarray:
    return finishing.finish_segment(take_audio(take), take.sample_rate, finish)


def _remove_orphans(folder: Path) -> None:
    """The part files (:func:`_replace`) of processes that died writing them (``kill -9``, a power cut): their
    process no longer runs. The data folder's SQLite databases are one host's already (WAL), so a pid is."""
    for part in folder.glob(".*.part"):
        pid = part.name.rsplit(".", 3)[1]
        if pid.isdigit() and not _running(int(pid)):
            part.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it runs
        pass
    return True


def _replace(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """``path`` written whole or not at all: a crash leaves the old file (or none), never half of one."""
    part = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.part")
    try:
        with open(part, "wb") as f:
            write(f)
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
