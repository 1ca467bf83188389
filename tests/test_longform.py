"""Long-form projects on the tiny bundle: the segment table is the frontend's split, regenerating one segment
leaves every other sample bit-identical (raw and finished), subtitles sit on the exported audio, loudness hits
its target, projects survive a restart, dialogues speak each line in its mapped voice; REST and the CLI."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import av
import numpy as np
import pyloudnorm
import pytest
import soundfile as sf

from cosyvoice.context import StudioContext
from cosyvoice.encoding import encode_audio, to_pcm16
from cosyvoice.errors import InvalidInputError, NotFoundError
from cosyvoice.jobs import JobState
from cosyvoice.longform import LongformStudio, documents, finishing, script
from cosyvoice.service import TTSService
from cosyvoice.settings import Limits, default_data_dir
from cosyvoice.voices import VoiceLibrary

SR = 24000
ROOT = Path(__file__).resolve().parents[1]
# short paragraphs: the random tiny model speaks until its length limit, which grows with the text
SHORT = "# Opening\n\nHi there.\n\nGood day. [pause:1.5s] See you.\n\n# Closing\n\nBye now.\n\nThe end."
SENTENCES = ["The committee met on March 3, 2021, to review 14 proposals.",
             "Each proposal was read aloud twice, and the members took careful notes!",
             "Was the budget of $2.5 million enough for every project?",
             "Nobody knew; the chair said only that the decision would come later.",
             "Outside, the rain kept falling on the old stone steps of the hall.",
             "By noon the room smelled of coffee, paper and wet umbrellas."]


def voiced(path: Path, f0: float, seconds: float = 1.5, sr: int = 16000) -> Path:
    """A vowel-like prompt recording at pitch ``f0``: different pitches make different voices."""
    t = np.arange(int(seconds * sr)) / sr
    phase = 2 * np.pi * np.cumsum(f0 + 20 * np.sin(2 * np.pi * 0.8 * t)) / sr
    wave = sum(np.sin(k * phase) / k for k in range(1, 10)) * 0.5 * (1 - np.cos(2 * np.pi * 3 * t))
    sf.write(path, (0.3 * wave).astype(np.float32), sr, subtype="PCM_16")
    return path


@pytest.fixture(scope="module")
def service(tts, tmp_path_factory: pytest.TempPathFactory) -> TTSService:
    folder = tmp_path_factory.mktemp("longform-voices")
    svc = TTSService(tts.model, VoiceLibrary(folder, tts.frontend, model_dir=tts.model_dir),
                     Limits(max_sessions=4, queue_timeout_seconds=60))
    for name, f0 in (("Alice", 220.0), ("Bob", 110.0), ("Carol", 180.0)):
        svc.create_voice(name, voiced(folder / f"{name}.wav", f0), f"Hello, I am {name}.")
    return svc


@pytest.fixture()
def studio(service: TTSService, tmp_path: Path):
    context = StudioContext(service=service, data_dir=tmp_path / "data")
    yield context.studio()
    context.close()


@pytest.fixture(scope="module")
def made(service: TTSService, tmp_path_factory: pytest.TempPathFactory):
    """A generated project (studio, project id), shared by the tests that only read it."""
    context = StudioContext(service=service, data_dir=tmp_path_factory.mktemp("made"))
    s = context.studio()
    project = s.editor.create("Made", SHORT, voice="Alice")
    s.renders.generate(project.id)
    assert s.renders.wait(project.id, 300)["done"] == 7
    yield s, project.id
    context.close()


def three_thousand_characters() -> str:
    text, i = "", 0
    while len(text) < 3000:
        text += SENTENCES[i % len(SENTENCES)] + " "
        i += 1
    return text.strip()


# ----------------------------------------------------------------------------- the segment table


def test_a_3000_character_text_becomes_the_frontends_split(studio: LongformStudio, tts) -> None:
    text = three_thousand_characters()
    assert len(text) >= 3000
    project = studio.editor.create("Long", text, voice="Alice")
    table = [s.text for s in studio.segments(project.id)]
    assert table == tts.frontend.text.split(text)  # exactly what the service will read, normalised
    assert len(table) > 10 and "third of march, twenty twenty one" in table[0] and "fourteen proposals" in table[0]
    assert [s.brk for s in studio.segments(project.id)] == ["sentence"] * (len(table) - 1) + ["end"]


def test_paragraphs_chapters_and_pause_tags_map_to_breaks(studio: LongformStudio, tts) -> None:
    project = studio.editor.create("Breaks", SHORT, voice="Alice")
    rows = [(s.text, s.brk, s.pause, s.chapter) for s in studio.segments(project.id)]
    assert rows == [("Opening.", "paragraph", None, "Opening"), ("Hi there.", "paragraph", None, None),
                    ("Good day.", "tag", 1.5, None), ("See you.", "chapter", None, None),
                    ("Closing.", "paragraph", None, "Closing"), ("Bye now.", "paragraph", None, None),
                    ("The end.", "end", None, None)]
    pauses = studio.project(project.id).settings["pauses"]
    assert pauses["chapter"] > pauses["paragraph"] > pauses["sentence"]
    chinese = "今天天气很好，我们去公园散步吧。公园里有很多人，有的在跑步，有的在下棋。"
    project = studio.editor.create("Chinese", chinese * 3, voice="Alice")
    assert [s.text for s in studio.segments(project.id)] == tts.frontend.text.split(chinese * 3)
    paragraph = "A first sentence here. " * 12
    project = studio.editor.create("Para", f"{paragraph}\n\n{paragraph}", voice="Alice")
    expected = tts.frontend.text.split(paragraph.strip()) * 2
    assert [s.text for s in studio.segments(project.id)] == expected


def test_split_merge_and_edits_keep_every_take(studio: LongformStudio) -> None:
    project = studio.editor.create("Edit", "Hi there. Good day.\n\nBye now.", voice="Alice")
    first = studio.segments(project.id)[0]
    assert first.text == "Hi there. Good day."
    studio.renders.generate(project.id, [first.id])
    studio.renders.wait(project.id, 120)
    take = studio.store.takes(project.id)[first.id][0]
    a, b = studio.editor.split_segment(project.id, first.id, first.text.index("Good"))
    assert (a.text, b.text, a.id) == ("Hi there.", "Good day.", first.id)
    assert [s.text for s in studio.segments(project.id)] == ["Hi there.", "Good day.", "Bye now."]
    assert studio.store.takes(project.id)[a.id] == [take]  # kept, but no longer current
    assert [st for _, _, st in studio.renders.table(project.id)] == ["pending"] * 3
    merged = studio.editor.merge_segments(project.id, a.id)
    assert merged.text == "Hi there. Good day." and len(studio.segments(project.id)) == 2
    assert next(st for _, _, st in studio.renders.table(project.id)) == "done"  # the old take matches again
    edited = studio.editor.edit_segment(project.id, merged.id, text="It costs 5 dollars.", speed=1.5, voice="Bob")
    assert edited.text == "It costs five dollars." and edited.speed == 1.5  # normalised as it will be read
    assert edited.voice == studio.service.get_voice("Bob").id
    with pytest.raises(InvalidInputError) as err:
        studio.editor.edit_segment(project.id, merged.id, speed=7)
    assert err.value.field == "speed"
    with pytest.raises(NotFoundError) as err:
        studio.editor.edit_segment(project.id, merged.id, voice="Nobody")
    assert err.value.field == "voice"
    with pytest.raises(InvalidInputError) as err:
        studio.editor.split_segment(project.id, merged.id, 0)
    assert err.value.field == "at"
    with pytest.raises(InvalidInputError) as err:
        studio.editor.edit_segment(project.id, merged.id, text="?!")
    assert err.value.field == "text"
    last = studio.segments(project.id)[-1]
    with pytest.raises(InvalidInputError, match="last segment"):
        studio.editor.merge_segments(project.id, last.id)
    assert studio.store.takes(project.id)[merged.id] == [take]


# ----------------------------------------------------------------------------- generation and regeneration


def _slices(rendered) -> list[np.ndarray]:
    return [rendered.audio[round(a * SR):round(b * SR)] for _, _, a, b in rendered.rows]


def test_regenerating_one_segment_changes_only_its_samples(made) -> None:
    studio, pid = made
    before_raw, before_fin = studio.mixer.render(pid, finished=False), studio.mixer.render(pid)
    k = 2
    target = studio.segments(pid)[k]
    old_take = before_raw.rows[k][1]
    studio.renders.regenerate(pid, target.id)
    studio.renders.wait(pid, 120)
    after_raw, after_fin = studio.mixer.render(pid, finished=False), studio.mixer.render(pid)
    takes = studio.store.takes(pid)[target.id]
    assert len(takes) == 2 and takes[0].id == old_take.id  # the old take is kept
    assert after_raw.rows[k][1].id == takes[1].id and takes[1].seed != old_take.seed
    for before, after in ((before_raw, after_raw), (before_fin, after_fin)):
        old, new = _slices(before), _slices(after)
        for i in range(len(old)):
            if i == k:
                assert not np.array_equal(old[i], new[i])
            else:
                assert np.array_equal(old[i], new[i]), f"segment {i} changed"
        # and the silence between segments is the same length as before
        gaps = [(b2 - a1) for (_, _, _, a1), (_, _, b2, _) in zip(before.rows, before.rows[1:], strict=False)]
        gaps2 = [(b2 - a1) for (_, _, _, a1), (_, _, b2, _) in zip(after.rows, after.rows[1:], strict=False)]
        assert gaps == pytest.approx(gaps2, abs=1e-9)  # seconds from sample counts: equal up to float rounding
    # choosing the old take back restores the old mix exactly
    studio.editor.choose_take(pid, target.id, old_take.id)
    assert np.array_equal(studio.mixer.render(pid, finished=False).audio, before_raw.audio)
    assert np.array_equal(studio.mixer.render(pid).audio, before_fin.audio)


def test_progress_statuses_and_the_automatic_check(made) -> None:
    studio, pid = made
    progress = studio.renders.progress(pid)
    assert progress | {"elapsed": None} == {"running": False, "total": 7, "done": 7, "failed": 0, "queued": 0,
                                            "current": None, "elapsed": None, "eta": None, "state": "done",
                                            "error": None}
    for _, takes, status in studio.renders.table(pid):
        assert status == "done"
        # the random tiny model speaks noise at full scale, mostly until its length limit
        assert any(f.startswith("clipping") for f in takes[-1].flags)
    assert any(f.startswith("too long") for _, takes, _ in studio.renders.table(pid) for f in takes[-1].flags)
    quiet = np.concatenate([np.zeros(SR), 0.1 * np.sin(np.arange(SR) / 5), np.zeros(3 * SR)]).astype(np.float32)
    flags = finishing.check_take(quiet, SR, "Hi.")
    assert any("too long" in f for f in flags) and not any("clipping" in f for f in flags)
    assert finishing.check_take(np.zeros(SR, np.float32), SR, "Hello there.") == ["silent"]


def test_generation_reports_eta_and_can_be_cancelled(studio: LongformStudio) -> None:
    project = studio.editor.create("Cancel", "\n\n".join(["Hi there."] * 6), voice="Alice")
    studio.renders.generate(project.id)
    seen = [studio.renders.progress(project.id)]
    while seen[-1]["done"] < 2:
        assert seen[-1]["running"]
        time.sleep(0.05)
        seen.append(studio.renders.progress(project.id))
    assert seen[-1]["running"] and seen[-1]["eta"] > 0 and seen[-1]["elapsed"] > 0
    assert seen[0]["queued"] == 6 and seen[0]["done"] == 0
    studio.renders.cancel(project.id)
    progress = studio.renders.wait(project.id, 60)
    assert not progress["running"] and 2 <= progress["done"] < 6 and progress["queued"] == 0
    assert {st for _, _, st in studio.renders.table(project.id)} == {"done", "pending"}
    studio.renders.generate(project.id)  # resumes: only the segments without audio
    assert studio.renders.wait(project.id, 300)["done"] == 6


def test_a_busy_service_is_waited_for_in_order_and_a_cancel_ends_the_wait(service: TTSService,
                                                                         tmp_path: Path) -> None:
    from cosyvoice.service import SynthesisRequest

    one = TTSService(service.model, service.voices, Limits(max_sessions=1, max_queued_requests=0,
                                                           queue_timeout_seconds=0.2))
    reasons: list[str | None] = []
    one.add_listener(lambda outcome: reasons.append(outcome.reason))
    context = StudioContext(service=one, data_dir=tmp_path)
    studio = context.studio()
    try:
        project = studio.editor.create("Busy", "Hi there.", voice="Alice")
        holder = one.synthesize(SynthesisRequest("Hi.", "sft", voice="Alice", seed=1))  # takes the only slot
        studio.renders.generate(project.id)
        time.sleep(1.0)  # past the queue's timeout and bound: the job waits in the admission queue, no refusal
        assert one.queued_requests == 1 and studio.renders.progress(project.id)["running"]
        holder.close()
        assert studio.renders.wait(project.id, 120)["done"] == 1
        assert reasons == ["cancelled", None]  # the holder, then the segment: never "busy"
        holder = one.synthesize(SynthesisRequest("Hi.", "sft", voice="Alice", seed=1))
        studio.renders.regenerate(project.id, studio.segments(project.id)[0].id)
        time.sleep(0.5)
        studio.renders.cancel(project.id)  # ends the wait in the queue; nothing is made, nothing fails
        progress = studio.renders.wait(project.id, 60)
        holder.close()
        assert one.queued_requests == 0 and progress["state"] == "cancelled" and progress["done"] == 1
        segment = studio.segments(project.id)[0]
        assert segment.state == "idle" and len(studio.store.takes(project.id)[segment.id]) == 1
    finally:
        context.close()


# ----------------------------------------------------------------------------- finishing and export


def _cue_times(text: str) -> list[tuple[float, float]]:
    stamp = r"(\d+):(\d+):(\d+)[,.](\d+)"
    out = []
    for m in re.finditer(stamp + " --> " + stamp, text):
        g = [int(x) for x in m.groups()]
        out.append((g[0] * 3600 + g[1] * 60 + g[2] + g[3] / 1000, g[4] * 3600 + g[5] * 60 + g[6] + g[7] / 1000))
    return out


def test_subtitles_match_the_segments_in_the_exported_audio(made) -> None:
    studio, pid = made
    name, data, rendered = studio.mixer.export(pid, "wav")
    exported, rate = sf.read(io.BytesIO(data), dtype="int16")
    assert rate == SR and name == "Made.wav"
    project = studio.project(pid)
    finish = finishing.Finish(project.settings["preset"], project.settings["margin"])
    srt_cues, vtt_cues = _cue_times(studio.mixer.subtitles(pid, "srt")), _cue_times(studio.mixer.subtitles(pid, "vtt"))
    assert srt_cues == vtt_cues and len(srt_cues) == len(rendered.rows) == 7
    for (segment, take, _, _), (start, end) in zip(rendered.rows, srt_cues, strict=True):
        own = to_pcm16(finishing.finish_segment(studio.store.take_audio(take), SR, finish))
        guess = round(start * SR)
        found = [p for p in range(max(0, guess - 240), guess + 241) if np.array_equal(exported[p:p + len(own)], own)]
        assert found, f"segment {segment.position} is not within 10 ms of its cue"
        assert abs(found[0] / SR - start) <= 0.010 and abs((found[0] + len(own)) / SR - end) <= 0.010
    assert "Hi there." in studio.mixer.subtitles(pid, "srt") and studio.mixer.subtitles(pid, "vtt").startswith("WEBVTT")


@pytest.mark.parametrize("preset", ["podcast", "broadcast"])
def test_exported_loudness_is_within_half_a_lu_of_the_target(made, preset: str) -> None:
    studio, pid = made
    studio.editor.update_settings(pid, preset=preset)
    try:
        _, data, _ = studio.mixer.export(pid, "flac")
        audio, rate = sf.read(io.BytesIO(data), dtype="float64")
        target, ceiling = finishing.PRESETS[preset]
        assert abs(pyloudnorm.Meter(rate).integrated_loudness(audio) - target) <= 0.5
        assert finishing.true_peak_db(audio, rate) <= ceiling + 0.1
        raw, _ = sf.read(io.BytesIO(studio.mixer.export(pid, "flac", finished=False)[1]), dtype="float64")
        assert abs(pyloudnorm.Meter(rate).integrated_loudness(raw) - target) > 3  # finishing did the work
    finally:
        studio.editor.update_settings(pid, preset="podcast")


def test_trimming_sets_the_silence_at_each_end_to_the_margin() -> None:
    tone = 0.3 * np.sin(np.arange(SR) / 4)
    x = np.concatenate([np.zeros(int(0.8 * SR)), tone, np.zeros(int(0.05 * SR))]).astype(np.float32)
    y = finishing.trim(x, SR, 0.1)
    voiced = np.flatnonzero(np.abs(y) > 0)
    assert voiced[0] == pytest.approx(0.1 * SR, abs=2) and len(y) - voiced[-1] - 1 == pytest.approx(0.1 * SR, abs=2)
    assert np.array_equal(y[int(0.1 * SR): int(0.1 * SR) + 100], x[int(0.8 * SR): int(0.8 * SR) + 100])


def test_normalising_reaches_the_target_unless_the_true_peak_would_pass_the_ceiling() -> None:
    t = np.arange(3 * SR) / SR
    quiet = (0.02 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    loud = finishing.normalise(quiet, SR, -16.0, -1.0)
    assert finishing.loudness(loud, SR) == pytest.approx(-16.0, abs=0.05)
    assert np.allclose(loud[1:100] / quiet[1:100], loud[1] / quiet[1])  # a plain gain
    clicks = np.zeros(3 * SR, np.float32)
    clicks[::SR // 2] = 0.5  # loudness far below the target, peaks high: the ceiling wins
    capped = finishing.normalise(clicks, SR, -16.0, -1.0)
    assert finishing.true_peak_db(capped, SR) == pytest.approx(-1.0, abs=0.01)
    assert finishing.loudness(capped, SR) < -16.0
    short = finishing.normalise(quiet[: SR // 10], SR, -23.0, -1.0)  # shorter than a gating block
    assert finishing.loudness(short, SR) == pytest.approx(-23.0, abs=0.1)
    assert np.array_equal(finishing.normalise(np.zeros(SR, np.float32), SR, -16.0, -1.0), np.zeros(SR))


def test_every_export_format_decodes_and_m4b_has_the_chapters(made) -> None:
    studio, pid = made
    rendered = studio.mixer.render(pid)
    seconds = len(rendered.audio) / SR
    # the export streams segment by segment; it equals the mix made in memory, and so do the timings
    assert studio.mixer.export(pid, "wav")[1] == encode_audio(rendered.audio, "wav", SR)
    assert studio.mixer.timeline(pid).rows == rendered.rows and rendered.seconds == pytest.approx(seconds)
    for fmt in ("mp3", "flac", "opus", "m4b", "mp4"):
        name, data, _ = studio.mixer.export(pid, fmt)
        assert name.endswith("." + fmt)
        with av.open(io.BytesIO(data)) as container:
            decoded = sum(frame.samples for frame in container.decode(audio=0)) / container.streams.audio[0].rate
            chapters = container.chapters()
        assert abs(decoded - seconds) < 0.1, fmt
        if fmt in ("m4b", "mp4"):
            titles = [c["metadata"]["title"] for c in chapters]
            assert titles == ["Opening", "Closing"]
            closing = next(start for seg, _, start, _ in rendered.rows if seg.chapter == "Closing")
            assert abs(chapters[1]["start"] / 1000 - closing) < 0.002
    with pytest.raises(InvalidInputError) as err:
        studio.mixer.export(pid, "xyz")
    assert err.value.field == "format"


def test_export_names_the_segments_without_audio(studio: LongformStudio) -> None:
    project = studio.editor.create("Empty", "Hi.\n\nBye.", voice="Alice")
    with pytest.raises(InvalidInputError, match=r"2 segment\(s\) have no audio yet \(1, 2\)"):
        studio.mixer.export(project.id, "wav")


# ----------------------------------------------------------------------------- persistence


def test_a_project_survives_a_restart(service: TTSService, tmp_path: Path) -> None:
    context = StudioContext(service=service, data_dir=tmp_path)
    first = context.studio()
    project = first.editor.create("Kept", "Hi there.\n\nBye now.", voice="Alice")
    first.renders.generate(project.id)
    first.renders.wait(project.id, 120)
    before = first.mixer.render(project.id)
    table = [(s, t) for s, t, _ in first.renders.table(project.id)]
    context.close()
    context = StudioContext(service=service, data_dir=tmp_path)  # a new process would see the same files
    again = context.studio()
    try:
        assert [p.id for p in again.projects()] == [project.id]
        assert [(s, t) for s, t, _ in again.renders.table(project.id)] == table
        assert np.array_equal(again.mixer.render(project.id).audio, before.audio)
        assert (tmp_path / "longform.sqlite3").is_file()
    finally:
        context.close()


def test_an_export_waits_for_the_projects_render_and_can_be_cancelled(studio: LongformStudio) -> None:
    """An export is a job of the project: asked for while the project's takes are being made again, it stays
    queued behind that render (it never mixes a take being replaced), and a cancel ends it without a file."""
    pid = studio.editor.create("Queued", SHORT, voice="Alice").id
    studio.renders.generate(pid)
    assert studio.renders.wait(pid, 300)["done"] == 7
    studio.renders.generate(pid, [s.id for s in studio.segments(pid)], new_take=True)  # seconds of work
    try:
        job = studio.exports.submit(pid, "audio", "mp3")
        assert studio.exports.job(pid, job.id).state is JobState.QUEUED
        assert studio.renders.progress(pid)["running"]  # the export is not counted as the project's render
        cancelled = studio.exports.cancel(pid, job.id)
        assert cancelled.state is JobState.CANCELLED and studio.exports.status(cancelled)["file"] is None
        with pytest.raises(NotFoundError):
            studio.exports.file(cancelled)
    finally:
        studio.renders.wait(pid, 300)
    assert not list(studio.exports.folder.rglob(f"{job.id}.*"))


def test_an_export_whose_process_died_is_interrupted_after_restart(service: TTSService, tmp_path: Path) -> None:
    """An export job is one of the data folder's jobs: one left running by a process that died is ``interrupted``
    to the next process (no file is offered from it), and asking again makes the export anew."""
    import sqlite3

    context = StudioContext(service=service, data_dir=tmp_path)
    studio = context.studio()
    project = studio.editor.create("Cut", "Hi there.", voice="Alice")
    studio.renders.generate(project.id)
    assert studio.renders.wait(project.id, 120)["done"] == 1
    job = studio.exports.run(project.id, "audio", "wav")
    context.close()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    with contextlib.closing(sqlite3.connect(tmp_path / "jobs.sqlite3")) as db, db:  # as a killed server leaves it
        db.execute("UPDATE jobs SET state='running', finished=NULL, pid=? WHERE id=?", (int(gone.stdout), job.id))
    context = StudioContext(service=service, data_dir=tmp_path)
    try:
        exports = context.studio().exports
        status = exports.status(exports.job(project.id, job.id))
        assert (status["state"], status["result"], status["file"]) == ("interrupted", None, None), status
        with pytest.raises(NotFoundError):
            exports.file(exports.job(project.id, job.id))
        again = exports.run(project.id, "audio", "wav")
        assert exports.file(again).path.stat().st_size > 44
        kept = sorted(p.name for p in exports.folder.joinpath(project.id).iterdir())
        assert kept == [f"{again.id}.json", f"{again.id}.wav"]  # the interrupted one's files replaced
    finally:
        context.close()


def test_a_segment_left_running_by_a_crash_is_pending_after_restart(service: TTSService, tmp_path: Path) -> None:
    context = StudioContext(service=service, data_dir=tmp_path)
    first = context.studio()
    project = first.editor.create("Crash", "Hi there.", voice="Alice")
    first.store.set_state(first.segments(project.id)[0], "running")
    context.close()
    context = StudioContext(service=service, data_dir=tmp_path)
    try:
        assert [(s.state, st) for s, _, st in context.studio().renders.table(project.id)] == [("idle", "pending")]
    finally:
        context.close()


def test_default_data_dir_follows_the_environment() -> None:
    assert default_data_dir(environ={"COSYVOICE_DATA_DIR": "/x/y"}) == Path("/x/y")
    assert default_data_dir(environ={"COSYVOICE_VOICE_DIR": "/v/voices"}) == Path("/v/.studio")


# ----------------------------------------------------------------------------- dialogue

DIALOGUE = """# Scene one
Alice: Hi Bob.
Bob: Hi Alice. [pause:0.4s] Where is Carol?
Carol (whispering): Right here.
Alice: Oh!
"""


def test_a_three_speaker_dialogue_speaks_each_line_in_its_voice(studio: LongformStudio, tmp_path: Path) -> None:
    ids = {name: studio.service.get_voice(name).id for name in ("Alice", "Bob", "Carol")}
    project = studio.editor.create("Talk", DIALOGUE, kind="dialogue", speakers={"Alice": "Alice", "Bob": "Bob",
                                                                       "Carol": ids["Carol"]})
    studio.renders.generate(project.id)
    assert studio.renders.wait(project.id, 300)["done"] == 5
    _name, _, rendered = studio.mixer.export(project.id, "wav", finished=False)
    table = studio.mixer.segments_json(project.id, rendered)
    lines = [(s["speaker"], s["text"], s["voice_id"], s["instruction"]) for s in table["segments"]]
    assert lines == [("Alice", "Hi Bob.", ids["Alice"], ""), ("Bob", "Hi Alice.", ids["Bob"], ""),
                     ("Bob", "Where is Carol?", ids["Bob"], ""),
                     ("Carol", "Right here.", ids["Carol"], "whispering"), ("Alice", "Oh!", ids["Alice"], "")]
    assert table["chapters"][0]["title"] == "Scene one"
    gaps = [round(b["start"] - a["end"], 3) for a, b in zip(table["segments"], table["segments"][1:], strict=False)]
    assert gaps == pytest.approx([0.5, 0.4, 0.5, 0.5], abs=0.002)  # turn pauses, and the tag inside Bob's turn
    for s in table["segments"]:
        assert isinstance(s["seed"], int) and s["take"] and s["end"] > s["start"]


def test_dialogue_errors_name_the_line_and_the_speaker(studio: LongformStudio) -> None:
    with pytest.raises(InvalidInputError, match="line 1 has no speaker label") as err:
        studio.editor.create("Bad", "just text\nAlice: hi", kind="dialogue", speakers={"Alice": "Alice"})
    assert err.value.field == "script"
    with pytest.raises(InvalidInputError, match="no voice for Bob") as err:
        studio.editor.create("Bad", "Alice: hi\nBob: hello", kind="dialogue", speakers={"Alice": "Alice"})
    assert err.value.field == "speakers"


def test_a_pause_tag_mid_sentence_ends_its_segment_with_a_comma_the_model_reads(studio: LongformStudio) -> None:
    project = studio.editor.create("Mid", "He stopped [pause:1.5s] and then spoke.\n\n他停了一下 [pause:500ms] "
                                   "然后说话。\n\nDone. [pause:1s] Yes.", voice="Alice")
    rows = [(s.text, s.brk, s.pause) for s in studio.segments(project.id)]
    assert rows == [("He stopped,", "tag", 1.5), ("and then spoke.", "paragraph", None), ("他停了一下，", "tag", 0.5),
                    ("然后说话。", "paragraph", None), ("Done.", "tag", 1.0), ("Yes.", "end", None)]
    studio.renders.generate(project.id)
    assert studio.renders.wait(project.id, 300)["done"] == len(rows)
    spoken = [studio.store.take_store.take(s.chosen_take).provenance["segments"] for s in studio.segments(project.id)]
    assert [p[0] for p in spoken] == [text for text, _, _ in rows]  # no full stop added after a comma


def test_speakers_left_unmapped_read_with_the_projects_voice_and_are_named(studio: LongformStudio) -> None:
    alice, bob = (studio.service.get_voice(name).id for name in ("Alice", "Bob"))
    project = studio.editor.create("Mixed", "Alice: hi\nBob: hello\nCarol: hey", kind="dialogue",
                                   speakers={"Alice": "Alice"}, voice="Bob")
    assert project.settings["unmapped_speakers"] == ["Bob", "Carol"]
    assert [(s.speaker, s.voice) for s in studio.segments(project.id)] == [("Alice", alice), ("Bob", bob),
                                                                          ("Carol", bob)]
    mapped = studio.editor.create("Mapped", "Alice: hi", kind="dialogue", speakers={"Alice": "Alice"})
    assert mapped.settings["unmapped_speakers"] == []


def test_script_parsing_of_labels_continuations_and_tags() -> None:
    blocks = script.dialogue_blocks("Alice [cheerful]: Hello\nthere.\n\nDr. Bob: Yes. [pause:250ms]\n")
    assert [(b.speaker, b.instruction, b.text.strip(), b.brk, b.pause) for b in blocks] == [
        ("Alice", "cheerful", "Hello there.", "turn", None), ("Dr. Bob", "", "Yes.", "tag", 0.25),
        ("Dr. Bob", "", "", "end", None)]
    long_line = script.dialogue_blocks("Alice: Listen.\nThen the old man said to her: go home.")
    assert [b.text for b in long_line] == ["Listen. Then the old man said to her: go home."]  # not a label
    with pytest.raises(InvalidInputError, match="longer than"):
        script.document_blocks("Hi [pause:99s] there")


def test_an_epub_becomes_chapters(tmp_path: Path) -> None:
    from ebooklib import epub

    book = epub.EpubBook()
    book.set_identifier("id1")
    book.set_title("Book")
    book.set_language("en")
    items = []
    for i, title in enumerate(("First light", "Second wind"), 1):
        item = epub.EpubHtml(title=title, file_name=f"c{i}.xhtml", lang="en")
        item.content = f"<html><body><h1>{title}</h1><p>Paragraph one of {i}.</p><p>Paragraph two.</p></body></html>"
        book.add_item(item)
        items.append(item)
    book.toc = items
    book.add_item(epub.EpubNcx())
    book.add_item(epub.EpubNav())
    book.spine = items
    path = tmp_path / "book.epub"
    epub.write_epub(str(path), book)
    text, chapters = documents.read_document("book.epub", path.read_bytes())
    assert [title for title, _ in chapters] == ["First light", "Second wind"]
    blocks = script.document_blocks(text, chapters)
    assert [(b.text, b.chapter, b.brk) for b in blocks] == [
        ("First light", "First light", "paragraph"), ("Paragraph one of 1.", None, "paragraph"),
        ("Paragraph two.", None, "chapter"), ("Second wind", "Second wind", "paragraph"),
        ("Paragraph one of 2.", None, "paragraph"), ("Paragraph two.", None, "end")]
    with pytest.raises(InvalidInputError) as err:
        documents.read_document("book.pdf", b"%PDF")
    assert err.value.field == "file"


# ----------------------------------------------------------------------------- REST


def test_rest_endpoints_create_generate_regenerate_and_export(service: TTSService, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from fastapi.testclient import TestClient

    from cosyvoice.server.rest import create_app
    from cosyvoice.settings import ServerSettings

    monkeypatch.setenv("COSYVOICE_DATA_DIR", str(tmp_path))
    with TestClient(create_app(ServerSettings(), service)) as client:
        assert client.get("/studio/longform").text.startswith("<!doctype html>")
        voices = client.get("/v1/longform/voices").json()
        assert {v["name"] for v in voices} >= {"Alice", "Bob", "Carol"}
        r = client.post("/v1/longform/projects", json={"name": "Web", "text": "Hi there.\n\nBye now.",
                                                        "voice": "Alice"})
        assert r.status_code == 201, r.text
        project = r.json()
        assert [s["text"] for s in project["segments"]] == ["Hi there.", "Bye now."]
        pid, sid = project["id"], project["segments"][1]["id"]
        _refused_by_field(client, pid, sid)
        assert client.post(f"/v1/longform/projects/{pid}/generate").status_code == 200
        wait_idle(client, pid)
        first = client.get(f"/v1/longform/projects/{pid}/segments.json").json()
        assert client.post(f"/v1/longform/projects/{pid}/segments/{sid}/regenerate").status_code == 200
        wait_idle(client, pid)
        second = client.get(f"/v1/longform/projects/{pid}/segments.json").json()
        assert first["segments"][0] == second["segments"][0]
        assert first["segments"][1]["take"] != second["segments"][1]["take"]
        detail = client.get(f"/v1/longform/projects/{pid}").json()
        assert [len(s["takes"]) for s in detail["segments"]] == [1, 2]
        r = client.get(f"/v1/longform/projects/{pid}/export", params={"format": "mp3"})
        assert r.status_code == 200 and r.headers["content-type"] == "audio/mpeg"
        assert r.headers["content-disposition"].startswith('attachment; filename="Web.mp3"')
        take = detail["segments"][0]["take"]
        wav = client.get(f"/v1/longform/projects/{pid}/takes/{take}.wav")
        assert wav.status_code == 200 and wav.content[:4] == b"RIFF"
        srt = client.get(f"/v1/longform/projects/{pid}/subtitles.srt")
        assert srt.status_code == 200 and "Bye now." in srt.text
        assert client.get("/v1/longform/projects/nope").status_code == 404
        _an_upload_is_a_project_and_a_pdf_is_refused(client)
        browser = dict(client.cookies)  # the page gave this browser its identity: the projects are its own
    assert set(browser) == {"cv-browser"}
    # a restarted server (a new app on the same data folder) still has the project, for the same browser
    with TestClient(create_app(ServerSettings(), service), cookies=browser) as client:
        assert [p["id"] for p in client.get("/v1/longform/projects").json()] == [pid]
        again = client.get(f"/v1/longform/projects/{pid}/segments.json").json()
        assert again == second
        assert client.delete(f"/v1/longform/projects/{pid}").status_code == 200
        assert client.get("/v1/longform/projects").json() == []


def _refused_by_field(client, pid: str, sid: str) -> None:
    """What the REST API refuses before any audio exists, each answer naming the field (or saying why)."""
    r = client.post("/v1/longform/projects", json={"text": "Hi.", "voice": "Nobody"})
    assert r.status_code == 404 and r.json()["error"]["field"] == "voice"
    r = client.patch(f"/v1/longform/projects/{pid}/segments/{sid}", json={"speed": 9})
    assert r.status_code == 400 and r.json()["error"]["field"] == "speed"
    r = client.patch(f"/v1/longform/projects/{pid}/segments/{sid}", json={"speed": "fast"})
    assert r.status_code == 400 and r.json()["error"]["field"] == "speed"
    r = client.get(f"/v1/longform/projects/{pid}/export")
    assert r.status_code == 400 and "no audio yet" in r.json()["error"]["message"]


def _an_upload_is_a_project_and_a_pdf_is_refused(client) -> None:
    """A Markdown upload becomes a project named after the file, its headings chapters; a PDF is refused by
    field. The uploaded project is deleted again, leaving the caller's projects as they were."""
    r = client.post("/v1/longform/projects/upload", data={"voice": "Alice"},
                    files={"file": ("notes.md", b"# Part one\n\nHi.\n\n# Part two\n\nBye.", "text/markdown")})
    assert r.status_code == 201, r.text
    uploaded = r.json()
    assert uploaded["name"] == "notes"
    assert [(s["text"], s["chapter"]) for s in uploaded["segments"]] == [
        ("Part one.", "Part one"), ("Hi.", None), ("Part two.", "Part two"), ("Bye.", None)]
    r = client.post("/v1/longform/projects/upload", data={"voice": "Alice"},
                    files={"file": ("notes.pdf", b"%PDF-1.4", "application/pdf")})
    assert r.status_code == 400 and r.json()["error"]["field"] == "file"
    assert client.delete(f"/v1/longform/projects/{uploaded['id']}").status_code == 200


def test_exports_are_jobs_whose_files_outlive_a_restart(service: TTSService, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from fastapi.testclient import TestClient

    from cosyvoice.server.rest import create_app
    from cosyvoice.settings import ServerSettings

    monkeypatch.setenv("COSYVOICE_DATA_DIR", str(tmp_path))
    with TestClient(create_app(ServerSettings(), service)) as client:
        pid = client.post("/v1/longform/projects", json={"name": "Jobs", "text": "Hi there.\n\nBye now.",
                                                         "voice": "Alice"}).json()["id"]
        exports = f"/v1/longform/projects/{pid}/exports"
        r = client.post(exports, json={"format": "flac"})
        assert r.status_code == 400 and "no audio yet" in r.json()["error"]["message"]  # said now, no job made
        assert client.get(exports).json() == []
        assert client.post(f"/v1/longform/projects/{pid}/generate").status_code == 200
        wait_idle(client, pid)
        for body, field in (({"what": "nope"}, "what"), ({"format": "xyz"}, "format")):
            r = client.post(exports, json=body)
            assert r.status_code == 400 and r.json()["error"]["field"] == field, r.text
        r = client.post(exports, json={"format": "flac"})
        assert r.status_code == 202 and r.json()["state"] in ("queued", "running", "done"), r.text
        first = wait_export(client, exports, r.json()["id"])
        assert first["file"] == "Jobs.flac" and len(first["result"]["segments"]) == 2 and "acx" in first["result"]
        audio = client.get(f"{exports}/{first['id']}/file")
        assert audio.status_code == 200 and audio.headers["content-type"] == "audio/flac"
        samples, rate = sf.read(io.BytesIO(audio.content))
        assert abs(len(samples) / rate - first["result"]["duration"]) < 0.01
        second = wait_export(client, exports, client.post(exports, json={"format": "flac"}).json()["id"])
        assert client.get(f"{exports}/{first['id']}/file").status_code == 404  # the newer export stands for it
        check = wait_export(client, exports, client.post(exports, json={"what": "check"}).json()["id"])
        assert check["file"] is None and "book" in check["result"]
        delivery = wait_export(client, exports, client.post(exports, json={"what": "acx"}).json()["id"])
        zipped = client.get(f"{exports}/{delivery['id']}/file")
        assert zipped.status_code == 200 and zipped.content[:2] == b"PK"
        assert [j["id"] for j in client.get(exports).json()] == [first["id"], second["id"], check["id"],
                                                                 delivery["id"]]
        generation = client.get(f"/v1/longform/projects/{pid}/progress").json()
        assert generation["state"] == "done" and not generation["running"]  # exports are not the render's jobs
        browser = dict(client.cookies)
    with TestClient(create_app(ServerSettings(), service), cookies=browser) as client:
        again = client.get(f"{exports}/{second['id']}/file")
        assert again.status_code == 200
        assert np.array_equal(sf.read(io.BytesIO(again.content))[0], samples)  # the same takes, the same mix
        assert client.delete(f"/v1/longform/projects/{pid}").status_code == 200
    assert not list(tmp_path.rglob(f"{second['id']}.*"))


def wait_export(client, exports: str, job_id: str, timeout: float = 120.0) -> dict:
    """The export job once it ended, as its endpoint answers; it must have ended done."""
    deadline = time.monotonic() + timeout
    while (job := client.get(f"{exports}/{job_id}").json())["state"] in ("queued", "running"):
        assert time.monotonic() < deadline, job
        time.sleep(0.05)
    assert job["state"] == "done" and job["error"] is None, job
    return job


def wait_idle(client, pid: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while client.get(f"/v1/longform/projects/{pid}/progress").json()["running"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)


# ----------------------------------------------------------------------------- CLI


def test_cli_writes_audio_segments_json_and_subtitles(service: TTSService, tiny_bundle_dir: Path,
                                                      tmp_path: Path) -> None:
    source = tmp_path / "article.md"
    source.write_text("# Title\n\nHi there.\n\nBye now.\n", encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=str(ROOT), COSYVOICE_DATA_DIR=str(tmp_path / "data"))
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "cosyvoice.tools.longform", str(source), "--voice", "Alice",
                             "--out", str(out), "--model-dir", str(tiny_bundle_dir), "--voice-dir",
                             str(service.voices.dir.parent), "--device", "cpu"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    table = json.loads((out / "segments.json").read_text())
    assert [s["text"] for s in table["segments"]] == ["Title.", "Hi there.", "Bye now."]
    alice = service.get_voice("Alice").id
    for s in table["segments"]:
        assert {"text", "start", "end", "seed", "take", "voice_id"} <= set(s) and s["voice_id"] == alice
    audio, rate = sf.read(out / "article.wav")
    assert abs(len(audio) / rate - table["duration"]) < 0.01
    assert _cue_times((out / "subtitles.srt").read_text()) == [(s["start"], s["end"]) for s in table["segments"]]
    assert (out / "subtitles.vtt").read_text().startswith("WEBVTT")
    bad = subprocess.run([sys.executable, "-m", "cosyvoice.tools.longform", str(source), "--voice", "Nobody",
                          "--out", str(out), "--model-dir", str(tiny_bundle_dir), "--voice-dir",
                          str(service.voices.dir.parent), "--device", "cpu"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "no voice 'Nobody'" in bad.stderr and "Traceback" not in bad.stderr


def test_the_chunk_schedule_is_a_project_setting_every_take_records(studio: LongformStudio) -> None:
    """``final`` and ``first_hop`` are checked as a request's are, reach each segment's render and are in each
    take's provenance (so a listening test of a chapter can use them as conditions)."""
    for field, bad in (("final", "half"), ("first_hop", 0), ("first_hop", "6")):
        with pytest.raises(InvalidInputError) as caught:
            studio.editor.create("Bad", "Hi there.", voice="Alice", **{field: bad})
        assert caught.value.field == field
    project = studio.editor.create("Chunked", "Hi there.", voice="Alice", final="chunked", first_hop=6)
    assert (project.settings["final"], project.settings["first_hop"]) == ("chunked", 6)
    studio.renders.generate(project.id)
    assert studio.renders.wait(project.id, 300)["done"] == 1
    [takes] = studio.store.takes(project.id).values()
    made = studio.store.take_store.take(takes[0].id).provenance
    assert (made["final"], made["first_hop"]) == ("chunked", 6)
    changed = studio.editor.update_settings(project.id, final="full", first_hop=None)
    assert (changed.settings["final"], changed.settings["first_hop"]) == ("full", None)
