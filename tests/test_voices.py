"""The prompt-voice library on the tiny bundle: hits compute nothing, entries persist, stay bounded, and
neither corrupt files nor concurrent callers break it."""

from __future__ import annotations

import json
import logging
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from safetensors.torch import load_file, save_file

from cosyvoice.errors import AlreadyExistsError, InvalidInputError, NotFoundError
from cosyvoice.frontend.prompts import zero_shot_prompt_text
from cosyvoice.voices import IDENTITY_FILES, VoiceLibrary, model_identity

PROMPT = "Hello, this is a short prompt for testing."  # plain: the library keeps no system prompt


class CountingFrontend:
    """The real frontend, counting how often the library asks it for features."""

    def __init__(self, frontend) -> None:
        self.inner, self.limits, self.tokenizer, self.calls = frontend, frontend.limits, frontend.tokenizer, 0
        self._lock = threading.Lock()

    def load_prompt(self, *args, **kwargs):
        return self.inner.load_prompt(*args, **kwargs)

    def voice_from(self, *args, **kwargs):
        return self.inner.voice_from(*args, **kwargs)

    def features(self, *args, **kwargs):
        with self._lock:
            self.calls += 1
        return self.inner.features(*args, **kwargs)


def _tone(hz: float, seconds: float = 1.1, sr: int = 16000) -> tuple[np.ndarray, int]:
    t = np.arange(int(seconds * sr)) / sr
    return (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32), sr


def _library(tts, root: Path, **bounds) -> tuple[VoiceLibrary, CountingFrontend]:
    frontend = CountingFrontend(tts.frontend)
    return VoiceLibrary(root, frontend, model_dir=tts.model_dir, **bounds), frontend


def _entry_files(library: VoiceLibrary) -> set[str]:
    """The entries' file stems (not the folder's hidden lock file)."""
    return {p.stem for p in library.dir.iterdir() if not p.name.startswith(".")}


def _same(a, b) -> bool:
    fa, fb = a.features, b.features
    return (torch.equal(fa.speech_feat, fb.speech_feat) and torch.equal(fa.speech_token, fb.speech_token)
            and torch.equal(fa.embedding, fb.embedding) and torch.equal(a.prompt_text, b.prompt_text))


def test_features_are_computed_once_per_recording_and_text(tts, prompt_wav: Path, tmp_path: Path) -> None:
    library, frontend = _library(tts, tmp_path)
    voice_id, voice = library.get_or_create(prompt_wav, PROMPT)
    assert _same(voice, tts.frontend.voice(PROMPT, prompt_wav))  # exactly what the frontend makes
    again_id, again = library.get_or_create(str(prompt_wav), PROMPT.replace(" ", "  ") + "\n")
    flac = tmp_path / "prompt.flac"  # the same samples in another container
    sf.write(flac, *sf.read(prompt_wav, dtype="int16"), subtype="PCM_16")
    flac_id, _ = library.get_or_create(flac.read_bytes(), PROMPT)
    assert again_id == flac_id == voice_id and _same(again, voice) and frontend.calls == 1
    other_id, _ = library.get_or_create(prompt_wav, "Another transcript.")
    bare_id, bare = library.get_or_create(prompt_wav)
    assert len({voice_id, other_id, bare_id}) == 3 and frontend.calls == 3
    assert bare.prompt_text.shape == (1, 0)


def test_entries_persist_across_instances(tts, prompt_wav: Path, tmp_path: Path) -> None:
    first, _ = _library(tts, tmp_path)
    voice_id, voice = first.get_or_create(prompt_wav, PROMPT)
    first.save("  Alice  ", voice_id)
    second, frontend = _library(tts, tmp_path)
    [info] = second.list()
    assert (info.id, info.name, info.transcript) == (voice_id, "Alice", "Hello, this is a short prompt for testing.")
    for key in ("Alice", voice_id):
        assert _same(second.get(key)[1], voice)
    assert second.get_or_create(prompt_wav, PROMPT)[0] == voice_id and frontend.calls == 0


def test_voices_saved_with_the_system_prompt_are_read_plain_with_their_ids(tts, prompt_wav: Path,
                                                                          tmp_path: Path) -> None:
    """Entries written before the library kept plain transcripts hold the transcript's ids after the system
    prompt: they are read as plain ids (the pipeline adds the prompt), under the ids they always had."""
    library, _ = _library(tts, tmp_path)
    voice_id, voice = library.get_or_create(prompt_wav, PROMPT)
    library.save("Alice", voice_id)
    assert voice.prompt_text.tolist() == [tts.frontend.tokenizer.encode(PROMPT)]
    tensors_path = library.dir / f"{voice_id}.safetensors"
    tensors = load_file(tensors_path)  # rewrite it as an older version stored it
    tensors["prompt_text"] = tts.frontend.encode(zero_shot_prompt_text(PROMPT))
    save_file(tensors, tensors_path)
    again, frontend = _library(tts, tmp_path)
    info, old = again.get("Alice")
    assert info.id == voice_id and _same(old, voice) and frontend.calls == 0
    assert again.get_or_create(prompt_wav, PROMPT)[0] == voice_id and frontend.calls == 0  # ids as before


def test_model_identity_follows_the_model_files(tiny_bundle_dir: Path, tmp_path: Path) -> None:
    for name in IDENTITY_FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tiny_bundle_dir / name, tmp_path / name)
    assert model_identity(tmp_path) == model_identity(tiny_bundle_dir)
    (tmp_path / "cosyvoice3.yaml").write_text((tmp_path / "cosyvoice3.yaml").read_text() + "\n# edited\n")
    assert model_identity(tmp_path) != model_identity(tiny_bundle_dir)


def test_least_recently_used_uploads_are_evicted_and_named_voices_kept(tts, tmp_path: Path) -> None:
    library, _ = _library(tts, tmp_path, max_entries=2)
    a, b, c = (library.get_or_create(_tone(hz))[0] for hz in (110, 220, 330))
    assert [i.id for i in library.list()] == [c, b] and not library.dir.joinpath(f"{a}.json").exists()
    library.save("kept", b)
    library.get_or_create(_tone(440))  # evicted below
    library.get(c)  # used: now more recent than that upload
    e = library.get_or_create(_tone(550))[0]
    assert [i.id for i in library.list()] == [b, e, c]  # named first, then uploads by recency
    assert _entry_files(library) == {b, c, e}

    tiny, _ = _library(tts, tmp_path / "bytes", max_bytes=1)  # every entry is over the bound: the newest stays
    ids = [tiny.get_or_create(_tone(hz))[0] for hz in (110, 220)]
    assert [i.id for i in tiny.list()] == ids[1:]


def test_names_are_unique_bounded_and_deletable(tts, tmp_path: Path) -> None:
    library, _ = _library(tts, tmp_path, max_named=1)
    a, b = (library.get_or_create(_tone(hz))[0] for hz in (110, 220))
    library.save("a", a)
    with pytest.raises(InvalidInputError, match="exists already"):
        library.save("a", b)
    with pytest.raises(InvalidInputError, match="delete one"):  # the user's to fix: not a "busy"
        library.save("b", b)
    with pytest.raises(InvalidInputError, match="1 to 64 characters"):
        library.save("   ", a)
    with pytest.raises(InvalidInputError, match="unknown voice 'nobody'; saved voices: a"):
        library.get("nobody")
    library.save("renamed", a)
    assert library.delete("renamed").id == a and not (library.dir / f"{a}.json").exists()
    assert [i.id for i in library.list()] == [b]


def test_corrupt_files_are_skipped_with_a_log_line(tts, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    library, _ = _library(tts, tmp_path)
    good, broken_meta, broken_tensors = (library.get_or_create(_tone(hz))[0] for hz in (110, 220, 330))
    (library.dir / f"{broken_meta}.json").write_text("{not json")
    (library.dir / f"{broken_tensors}.safetensors").write_bytes(b"\x00" * 10)
    (library.dir / "orphan.safetensors").write_bytes(b"left by a crash")
    with caplog.at_level(logging.WARNING, logger="cosyvoice.voices"):
        reopened, frontend = _library(tts, tmp_path)
        assert {i.id for i in reopened.list()} == {good, broken_tensors}
        with pytest.raises(InvalidInputError, match="could not be read"):
            reopened.get(broken_tensors)
        assert reopened.get_or_create(_tone(330))[0] == broken_tensors and frontend.calls == 1  # recomputed
    assert f"skipping {library.dir / broken_meta}.json" in caplog.text
    assert f"dropping unreadable cached voice {broken_tensors}" in caplog.text
    assert not (library.dir / "orphan.safetensors").exists()


def test_concurrent_callers_share_one_computation(tts, tmp_path: Path) -> None:
    library, frontend = _library(tts, tmp_path, max_entries=3)
    with ThreadPoolExecutor(8) as pool:
        same = list(pool.map(lambda _: library.get_or_create(_tone(110))[0], range(8)))
        assert len(set(same)) == 1 and frontend.calls == 1
        distinct = list(pool.map(lambda hz: library.get_or_create(_tone(hz))[0], (220, 330, 440, 550, 660, 770)))
    assert len(set(distinct)) == 6 and frontend.calls == 7
    kept = {i.id for i in library.list()}
    assert len(kept) == 3 and _entry_files(library) == kept


def test_rename_preview_export_import(tts, prompt_wav: Path, tmp_path: Path) -> None:
    library, _ = _library(tts, tmp_path / "a")
    voice_id, voice = library.get_or_create(prompt_wav, PROMPT)
    with pytest.raises(InvalidInputError, match="only saved voices can be renamed"):
        library.rename(voice_id, "x")
    library.save("Alice", voice_id)
    assert library.rename("Alice", "Alice B").name == "Alice B" and library.get("Alice B")[0].id == voice_id
    rate, pcm = library.recording("Alice B")
    original, original_rate = sf.read(prompt_wav, dtype="int16")
    assert rate == original_rate and pcm.dtype == np.int16 and np.abs(pcm.astype(int) - original).max() <= 1

    file_name, data = library.export("Alice B")
    assert file_name == "Alice_B.voice.safetensors"
    for name in (None, "Another name"):  # the voice is there: said at once, whatever name it is offered under
        with pytest.raises(AlreadyExistsError, match="saved already as 'Alice B'") as refused:
            library.import_voice(data, name=name)
        assert refused.value.field != "name"
    same_model, frontend = _library(tts, tmp_path / "b")
    info = same_model.import_voice(data)
    assert (info.name, info.transcript) == ("Alice B", "Hello, this is a short prompt for testing.")
    assert _same(same_model.get("Alice B")[1], voice) and frontend.calls == 0  # features travelled with the file
    with pytest.raises(InvalidInputError, match="saved already as 'Alice B'"):  # never renames a saved voice
        same_model.import_voice(data, name="Copy")
    other_model, frontend = _library(tts, tmp_path / "c")
    other_model.model_id = "another-release"  # a library of another model: features are made anew
    assert other_model.import_voice(data).name == "Alice B" and frontend.calls == 1
    imported = other_model.get("Alice B")[1]  # from the 16-bit recording in the file, with the same transcript
    assert torch.equal(imported.prompt_text, voice.prompt_text)
    assert imported.features.speech_feat.shape == voice.features.speech_feat.shape
    with pytest.raises(InvalidInputError, match="not a voice file"):
        same_model.import_voice(b"RIFF....WAVEfmt " + bytes(64))


def test_builtin_voices_are_listed_first_and_read_only(tts, prompt_wav: Path, tmp_path: Path) -> None:
    builtin = tmp_path / "builtin"
    builtin.mkdir()
    shutil.copyfile(prompt_wav, builtin / "Narrator.wav")
    (builtin / "Narrator.txt").write_text("Hello, this is a short prompt for testing.\n")
    shutil.copyfile(prompt_wav, builtin / "NoTranscript.wav")
    library, frontend = _library(tts, tmp_path / "lib")
    library = VoiceLibrary(tmp_path / "lib", frontend, model_dir=tts.model_dir, builtin_dir=builtin)
    saved_id, _ = library.get_or_create(_tone(220))
    library.save("Aaron", saved_id)
    assert [(i.name, i.builtin) for i in library.list()] == [("Narrator", True), ("Aaron", False)]
    info, voice = library.get("Narrator")
    assert _same(voice, tts.frontend.voice(PROMPT, prompt_wav)) and frontend.calls == 2  # on first use
    assert library.get(info.id)[1] is voice and frontend.calls == 2  # once
    for action in (lambda: library.delete("Narrator"), lambda: library.rename("Narrator", "x"),
                   lambda: library.save("Narrator", saved_id)):
        with pytest.raises(InvalidInputError, match=r"built-in|exists already"):
            action()
    assert library.recording("Narrator")[0] == 24000


def test_an_unreadable_saved_voice_is_kept_aside_never_deleted(tts, tmp_path: Path) -> None:
    library, _ = _library(tts, tmp_path)
    voice_id = library.get_or_create(_tone(150))[0]
    library.save("precious", voice_id)
    damaged = b"\x00" * 10
    (library.dir / f"{voice_id}.safetensors").write_bytes(damaged)
    with pytest.raises(InvalidInputError, match="could not be read from disk; its files were kept aside") as error:
        library.get("precious")
    assert str(tmp_path) not in str(error.value) and "/" not in str(error.value)  # no server path
    assert (library.dir / f"{voice_id}.safetensors.unreadable").read_bytes() == damaged  # what it says is true
    assert json.loads((library.dir / f"{voice_id}.json.unreadable").read_text())["name"] == "precious"
    assert "precious" not in {i.name for i in library.list()}


def test_a_voice_deleted_meanwhile_is_not_found_never_said_to_be_kept(tts, tmp_path: Path) -> None:
    library, _ = _library(tts, tmp_path)
    voice_id = library.get_or_create(_tone(160))[0]
    library.save("gone", voice_id)
    info = library.info("gone")
    (library.dir / f"{voice_id}.json").unlink()  # another process deletes it between lookup and read
    (library.dir / f"{voice_id}.safetensors").unlink()
    with pytest.raises(NotFoundError, match="voice 'gone' was deleted") as error:
        library._read(info, "gone")
    assert "kept" not in str(error.value) and "/" not in str(error.value)
    assert not list(library.dir.glob("*.unreadable"))


def test_voices_saved_or_deleted_by_another_process_are_followed(tts, tmp_path: Path) -> None:
    server, _ = _library(tts, tmp_path)  # e.g. the gRPC server, started first
    web, _ = _library(tts, tmp_path)  # e.g. the web UI over the same folder
    voice_id = web.get_or_create(_tone(175))[0]
    web.save("later", voice_id)
    assert server.get("later")[0].id == voice_id  # looked up at call time, not at start-up
    assert "later" in {i.name for i in server.list()}
    web.delete("later")
    assert "later" not in {i.name for i in server.list()}
    with pytest.raises(InvalidInputError, match="unknown voice 'later'"):
        server.get("later")
