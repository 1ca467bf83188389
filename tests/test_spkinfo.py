"""Saved voices are never lost: spk2info.pt on top of the voice library (issue 7)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from voice_worker import Worker

from cosyvoice.cli.cosyvoice import CosyVoice3
from cosyvoice.errors import ConfigError, InvalidInputError
from cosyvoice.frontend.prompts import zero_shot_prompt_text
from cosyvoice.settings import Limits
from cosyvoice.spkinfo import SPKINFO_FILE, SpeakerFile, read_spkinfo, voice_to_official
from cosyvoice.voices import VoiceLibrary

PROMPT_TEXT = zero_shot_prompt_text("Hello, this is a short prompt for testing.")
TEXT = "Good morning to you."


@pytest.fixture
def model_dir(tiny_bundle_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny bundle: these tests write its spk2info.pt."""
    return Path(shutil.copytree(tiny_bundle_dir, tmp_path / "model", ignore=shutil.ignore_patterns(SPKINFO_FILE)))


def _open(model_dir: Path, voice_dir: Path) -> CosyVoice3:
    return CosyVoice3(model_dir, device="cpu", limits=Limits(max_sessions=2), voice_dir=voice_dir)


def _same(a, b) -> bool:
    """Equal nested dicts of tensors (what torch.load gives back)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def test_mixed_spk2info_loses_nothing(tts, model_dir: Path, short_prompt_wav: Path, prompt_wav: Path,
                                      tmp_path: Path) -> None:
    zero_shot = voice_to_official(tts.frontend.voice(PROMPT_TEXT, str(short_prompt_wav)))
    corrupt = {**zero_shot, "prompt_speech_feat": torch.zeros(3)}  # a damaged copy of it
    sft = {"embedding": torch.randn(1, 192)}  # a CosyVoice 1 SFT speaker
    original = {"sft": sft, "mine": zero_shot, "mine (copy)": corrupt}
    torch.save(original, model_dir / SPKINFO_FILE)

    api = _open(model_dir, tmp_path / "voices")
    assert api.list_available_spks() == ["mine"]
    assert set(api.unusable_spks()) == {"sft", "mine (copy)"}
    assert "lacks ['prompt_speech_feat'" in api.unusable_spks()["sft"]
    with pytest.raises(InvalidInputError, match=r"'sft' of spk2info\.pt cannot be used"):
        api.inference_sft(TEXT, "sft")
    from_file = torch.cat([o["tts_speech"] for o in api.inference_sft(TEXT, "mine", seed=3)], dim=1)
    direct = torch.cat([o["tts_speech"] for o in tts.inference_zero_shot(TEXT, PROMPT_TEXT, str(short_prompt_wav),
                                                                         seed=3)], dim=1)
    assert torch.equal(from_file, direct)

    assert api.add_zero_shot_spk(PROMPT_TEXT, str(prompt_wav), "new")
    api.save_spkinfo()
    written = torch.load(model_dir / SPKINFO_FILE, weights_only=True)
    assert set(written) == {"sft", "mine", "mine (copy)", "new"}
    assert _same(written["sft"], sft) and _same(written["mine (copy)"], corrupt)  # written back as they were
    assert all(_same(written["mine"][k], v) for k, v in zero_shot.items())
    # the library keeps plain transcripts; the file holds them in the official form, after the system prompt
    assert torch.equal(written["new"]["prompt_text"], tts.frontend.encode(PROMPT_TEXT))

    # the file alone (a fresh voice library) brings every voice back
    again = _open(model_dir, tmp_path / "other-voices")
    assert again.list_available_spks() == ["mine", "new"] and set(again.unusable_spks()) == {"sft", "mine (copy)"}
    again.save_spkinfo()
    assert _same(torch.load(model_dir / SPKINFO_FILE, weights_only=True), written)


def test_a_name_taken_in_the_library_keeps_both_voices(tts, model_dir: Path, short_prompt_wav: Path,
                                                       prompt_wav: Path, tmp_path: Path) -> None:
    api = _open(model_dir, tmp_path / "voices")
    api.add_zero_shot_spk(PROMPT_TEXT, str(prompt_wav), "alice")
    torch.save({"alice": voice_to_official(tts.frontend.voice(PROMPT_TEXT, str(short_prompt_wav)))},
               model_dir / SPKINFO_FILE)  # another alice, e.g. from another machine
    reopened = _open(model_dir, tmp_path / "voices")
    assert reopened.list_available_spks() == ["alice", "alice (spk2info.pt)"]
    assert reopened.spk2info["alice"].features.speech_feat.shape != \
        reopened.spk2info["alice (spk2info.pt)"].features.speech_feat.shape


def test_unreadable_spk2info_is_kept_and_backed_up(model_dir: Path, short_prompt_wav: Path, tmp_path: Path) -> None:
    garbage = b"PK\x03\x04 this is not a torch file" * 10
    (model_dir / SPKINFO_FILE).write_bytes(garbage)
    api = _open(model_dir, tmp_path / "voices")  # starts anyway, and says why its voices are missing
    assert "could not be read" in api.unusable_spks()[SPKINFO_FILE]
    assert (model_dir / SPKINFO_FILE).read_bytes() == garbage  # loading never touches it
    api.add_zero_shot_spk(PROMPT_TEXT, str(short_prompt_wav), "fresh")
    api.save_spkinfo()
    [backup] = model_dir.glob(f"{SPKINFO_FILE}.unreadable-*")
    assert backup.read_bytes() == garbage
    assert list(torch.load(model_dir / SPKINFO_FILE, weights_only=True)) == ["fresh"]
    api.save_spkinfo()  # the new file is ours: no second backup
    assert len(list(model_dir.glob(f"{SPKINFO_FILE}.unreadable-*"))) == 1


WRITER = textwrap.dedent("""
    import sys, torch
    from cosyvoice.spkinfo import write_spkinfo
    path, n = sys.argv[1], 0
    while True:  # alternate two versions; each is ~16 MB so a write takes a while
        n += 1
        print(n, flush=True)
        payload = torch.full((4_000_000,), float(n % 2))
        write_spkinfo(path, {"version": {"n": torch.tensor([n % 2]), "payload": payload}})
""")


def test_kill_9_during_a_save_leaves_the_old_or_the_new_file(tmp_path: Path) -> None:
    path = tmp_path / SPKINFO_FILE
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    rng = random.Random(0)
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    interrupted = attempts = 0
    while attempts < 4 or (interrupted < 2 and attempts < 16):  # on a loaded machine some kills miss a write
        attempts += 1
        proc = subprocess.Popen([sys.executable, str(script), str(path)], stdout=subprocess.PIPE, text=True,
                                cwd=repo, env=env)
        try:
            for _ in range(rng.randrange(2, 5)):
                assert proc.stdout.readline(), "the writer died"
            time.sleep(rng.uniform(0.0, 0.08))  # somewhere inside a write
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc.stdout.close()
        interrupted += bool(list(tmp_path.glob(f".{SPKINFO_FILE}.*.tmp")))  # killed inside a write
        found = read_spkinfo(path)  # also removes the interrupted write's temporary file
        assert found.error is None, found.error
        entry = found.unusable["version"]
        n = int(entry["n"])
        assert torch.equal(entry["payload"], torch.full((4_000_000,), float(n)))
        assert not list(tmp_path.glob(f".{SPKINFO_FILE}.*.tmp"))
    assert interrupted >= 2, "the kills should land inside writes"


def test_an_unusable_voice_folder_stops_the_model_with_a_clear_message(model_dir: Path, tmp_path: Path) -> None:
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the voice folder should be")
    with pytest.raises(ConfigError, match=rf"cannot use the voice folder {blocked / 'voices'} .*COSYVOICE_VOICE_DIR"):
        _open(model_dir, blocked / "voices")  # never a temporary library whose saved voices vanish at exit


def test_two_processes_saving_speakers_keep_each_others(model_dir: Path, short_prompt_wav: Path, prompt_wav: Path,
                                                        tmp_path: Path) -> None:
    """Two AutoModels on one model folder (each with its own voice folder), in two processes: each one's
    save_spkinfo() keeps the speakers the other wrote since it started."""
    first, second = Worker(), Worker()
    try:
        for n, worker in enumerate((first, second)):
            worker.send(open="api", model_dir=str(model_dir), voice_dir=str(tmp_path / f"voices-{n}"))
        assert first.answer()["ok"] and second.answer()["ok"]  # both read spk2info.pt before anyone saved
        first(on="api", call="add_zero_shot_spk", args=[PROMPT_TEXT, str(short_prompt_wav), "one"])
        first(on="api", call="save_spkinfo")
        second(on="api", call="add_zero_shot_spk", args=[PROMPT_TEXT, str(prompt_wav), "two"])
        second(on="api", call="save_spkinfo")
        assert set(torch.load(model_dir / SPKINFO_FILE, weights_only=True)) == {"one", "two"}
        first(on="api", call="save_spkinfo")  # its library never had "two": the file keeps it all the same
        written = torch.load(model_dir / SPKINFO_FILE, weights_only=True)
        assert set(written) == {"one", "two"}
        assert written["two"]["prompt_speech_feat"].shape[1] > written["one"]["prompt_speech_feat"].shape[1]
    finally:
        first.close()
        second.close()


def test_a_save_merges_with_the_file_as_it_is_now_and_never_renames(tts, tmp_path: Path, short_prompt_wav: Path,
                                                                    prompt_wav: Path) -> None:
    path = tmp_path / SPKINFO_FILE
    libraries = [VoiceLibrary(tmp_path / name, tts.frontend, model_dir=tts.model_dir) for name in "abc"]
    first, second, third = (SpeakerFile(path, library) for library in libraries)
    first.load()
    second.load()
    short, long = (tts.frontend.voice(PROMPT_TEXT, str(wav)) for wav in (short_prompt_wav, prompt_wav))
    libraries[0].put("alice", short)
    first.save()
    libraries[1].put("alice", long)  # another "alice", saved by another program on the same model folder
    second.save()
    written = torch.load(path, weights_only=True)
    assert set(written) == {"alice", "alice (spk2info.pt)"}  # both kept
    assert all(_same(written["alice"][k], v) for k, v in voice_to_official(long).items())
    assert all(_same(written["alice (spk2info.pt)"][k], v) for k, v in voice_to_official(short).items())
    second.save()
    assert set(torch.load(path, weights_only=True)) == {"alice", "alice (spk2info.pt)"}  # stable
    libraries[1].rename("alice", "bob")
    second.save()  # the old name stays in the file: a save never drops an entry
    assert set(torch.load(path, weights_only=True)) == {"alice", "alice (spk2info.pt)", "bob"}

    third.load()  # "alice" and "bob" hold one voice: the library keeps its one name, the file both
    named = {i.name for i in libraries[2].named()}
    [kept] = named - {"alice (spk2info.pt)"}
    [alias] = third.unusable()
    assert len(named) == 2 and {kept, alias} == {"alice", "bob"}
    assert f"saved here as {kept!r}" in third.unusable()[alias]
    third.save()
    assert set(torch.load(path, weights_only=True)) == {"alice", "alice (spk2info.pt)", "bob"}


def test_a_damaged_library_voice_leaves_its_copy_in_the_file(tts, tmp_path: Path, short_prompt_wav: Path) -> None:
    path = tmp_path / SPKINFO_FILE
    library = VoiceLibrary(tmp_path / "voices", tts.frontend, model_dir=tts.model_dir)
    speakers = SpeakerFile(path, library)
    speakers.load()
    speakers.add(PROMPT_TEXT, str(short_prompt_wav), "alice")
    speakers.save()
    saved = torch.load(path, weights_only=True)
    (library.dir / f"{library.info('alice').id}.safetensors").write_bytes(b"\0" * 10)  # damaged on disk
    speakers.save()  # the library cannot read it: the file keeps the copy it has
    assert _same(torch.load(path, weights_only=True), saved)
