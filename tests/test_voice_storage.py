"""The voice folder's storage failing under the library (issue 12, items 3 and 5; issue 20, item 11): a read-only
folder is served read-only (its voices usable, changes refused naming the setting), one the server cannot use
otherwise stops start-up with a clear message; a full disk costs only the caching of uploads; deleting frees space
at once.

Real file systems where root can mount them (a read-only bind mount, a 256 KiB tmpfs); where it cannot, the
same failure is raised at the write call (the test says which in its output)."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from cosyvoice.errors import ConfigError, ReadOnlyError, StorageError
from cosyvoice.service import SynthesisRequest, TTSService
from cosyvoice.settings import Limits
from cosyvoice.voices import VoiceLibrary

TRANSCRIPT = "Hello, this is a short prompt for testing."


def _mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


@contextlib.contextmanager
def read_only_mount(folder: Path) -> Iterator[bool]:
    """``folder`` bound read-only onto itself (root ignores permission bits, not a read-only mount); yields
    False, changing nothing, where this process may not mount."""
    if not _mount("--bind", str(folder), str(folder)):
        yield False
        return
    try:
        yield _mount("-o", "remount,ro,bind", str(folder))
    finally:
        _umount(folder)


@contextlib.contextmanager
def read_only(folder: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """``folder`` made read-only: a read-only bind mount, else the EROFS the kernel would give, raised at the
    library's writes. Yields how."""
    with read_only_mount(folder) as mounted:
        if mounted:
            yield "read-only bind mount"
            return
    inside = str(folder.resolve())

    def refuse(real: Callable) -> Callable:
        def call(path, *args, **kwargs):
            if os.fspath(path).startswith(inside):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
            return real(path, *args, **kwargs)
        return call

    monkeypatch.setattr(os, "open", refuse(os.open))
    monkeypatch.setattr(os, "unlink", refuse(os.unlink))
    yield "EROFS simulated at the write call (mount not permitted here)"


def test_a_read_only_folder_is_served_read_only_naming_the_setting(tiny_bundle_dir: Path, tmp_path: Path,
                                                                    short_prompt_wav: Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture) -> None:
    root = tmp_path / "voices"
    library = VoiceLibrary(root, None, model_dir=tiny_bundle_dir)
    leftover = library.dir / ".0123.safetensors.77.1.tmp"
    leftover.write_bytes(b"left by an interrupted save")
    with read_only(root, monkeypatch) as how:
        with capsys.disabled():
            print(f"\n[{how}]", end=" ")
        for start in (lambda: VoiceLibrary(root, None, model_dir=tiny_bundle_dir),  # the library
                      lambda: TTSService.load(tiny_bundle_dir, root, device="cpu",  # a server's start-up
                                              limits=Limits(max_sessions=1)).voices):
            served = start()
            assert served.read_only and "COSYVOICE_VOICE_DIR" in served.read_only and str(root) not in served.read_only
            assert served.list() == []
            with pytest.raises(ReadOnlyError, match="COSYVOICE_VOICE_DIR"):
                served.create("Ann", short_prompt_wav, "")
        assert leftover.exists()  # nothing removed, nothing written
    # a folder it cannot use otherwise (a file where the folder should be) still stops start-up, naming both
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ConfigError, match=rf"cannot use the voice folder {tmp_path / 'file'}.*COSYVOICE_VOICE_DIR"):
        VoiceLibrary(tmp_path / "file", None, model_dir=tiny_bundle_dir)


@dataclass
class SmallDisk:
    root: Path
    how: str
    fill: Callable[[], None]  # take all free space
    empty: Callable[[], None]  # give it back
    free: Callable[[], int] | None  # free bytes (None where simulated)


@pytest.fixture
def small_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SmallDisk]:
    """A 256 KiB tmpfs for the voice folder (or ENOSPC raised at the library's writes where root cannot mount)."""
    root = tmp_path / "small"
    root.mkdir()
    filler = root / "filler"
    if _mount("-t", "tmpfs", "-o", "size=256k", "tmpfs", str(root)):
        def fill() -> None:
            with contextlib.suppress(OSError), open(filler, "ab", buffering=0) as f:
                while True:
                    f.write(b"\0" * 1024)

        def free() -> int:
            st = os.statvfs(root)
            return st.f_bavail * st.f_frsize

        try:
            yield SmallDisk(root, "256 KiB tmpfs", fill, lambda: filler.unlink(), free)
        finally:
            _umount(root)
        return
    import cosyvoice.voices.folder as voices

    full = []
    real = voices.atomic_write

    def write(path, fn) -> None:
        if full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(path, fn)

    monkeypatch.setattr(voices, "atomic_write", write)
    yield SmallDisk(root, "ENOSPC simulated at the write call (mount not permitted here)", lambda: full.append(1),
                    full.clear, None)


def _prompt(path: Path, gain: float) -> bytes:
    """The prompt recording at another level: another upload, the same speech."""
    samples, rate = sf.read(path, dtype="float32")
    out = path.with_name(f"gain-{gain}.wav")
    sf.write(out, samples * gain, rate, subtype="PCM_16")
    return out.read_bytes()


def test_a_full_disk_costs_only_the_caching_and_a_delete_frees_space(
        tts, small_disk: SmallDisk, short_prompt_wav: Path, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture) -> None:
    with capsys.disabled():
        print(f"\n[{small_disk.how}]", end=" ")
    library = VoiceLibrary(small_disk.root, tts.frontend, model_dir=tts.model_dir)
    service = TTSService(tts.model, library, Limits(max_sessions=2))
    saved = service.create_voice("Kept", short_prompt_wav.read_bytes(), TRANSCRIPT)

    small_disk.fill()
    with caplog.at_level(logging.WARNING, logger="cosyvoice.voices"):
        for gain in (0.9, 0.8):  # two new uploads: synthesis goes on, uncached; the failure is logged once
            request = SynthesisRequest("Good morning.", "zero_shot", prompt_audio=_prompt(short_prompt_wav, gain),
                                       transcript=TRANSCRIPT, seed=1, stream=False)
            with service.synthesize(request) as session:
                assert sum(chunk.pcm.numel() for chunk in session) > 0
    assert caplog.text.count("without caching") == 1
    assert [i.name for i in service.list_voices(include_uploads=True)] == ["Kept"]
    with pytest.raises(StorageError, match="disk for voices is full") as refused:
        service.create_voice("New", _prompt(short_prompt_wav, 0.7), TRANSCRIPT)
    assert str(small_disk.root) not in str(refused.value) and "/" not in str(refused.value)
    kept = sorted(p.suffix for p in library.dir.iterdir() if p.is_file() and not p.name.startswith("."))
    assert kept == [".json", ".safetensors"]  # (the voices' flow prefixes have a folder of their own)

    small_disk.empty()
    _, voice = library.get("Kept")  # in use (e.g. by a running request) while it is deleted
    if small_disk.free is not None:
        before = small_disk.free()
        service.delete_voice("Kept")
        assert small_disk.free() - before >= saved.nbytes * 0.9  # the space is back at once
    else:
        service.delete_voice("Kept")
    assert voice.features.speech_feat.shape[1] > 0
    uploaded, _ = library.get_or_create(_prompt(short_prompt_wav, 0.6), TRANSCRIPT)
    assert library.info(uploaded).name is None  # caching works again once there is room


def test_deleting_frees_space_while_the_voice_is_held(tts, tmp_path: Path) -> None:
    """No mapping of a voice's file outlives the read: a deleted file is not kept open (its space not held)."""
    library = VoiceLibrary(tmp_path, tts.frontend, model_dir=tts.model_dir)
    voice_id, _ = library.get_or_create(_tone())
    library.save("Held", voice_id)
    held = [library.get("Held")[1], library.recording("Held"), library.export("Held")]
    path = library.dir / f"{voice_id}.safetensors"
    library.delete("Held")
    mapped = [line for line in Path("/proc/self/maps").read_text().splitlines() if str(path) in line]
    assert mapped == [] and held


def _tone(hz: float = 220, seconds: float = 1.1, sr: int = 16000) -> tuple[np.ndarray, int]:
    t = np.arange(int(seconds * sr)) / sr
    return (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32), sr


def test_a_folder_turned_read_only_while_serving_costs_only_caching(tts, tmp_path: Path, short_prompt_wav: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "voices"
    service = TTSService(tts.model, VoiceLibrary(root, tts.frontend, model_dir=tts.model_dir), Limits(max_sessions=2))
    saved = service.create_voice("Before", short_prompt_wav.read_bytes(), TRANSCRIPT)
    with read_only(root, monkeypatch):  # e.g. the disk was remounted read-only after an error
        request = SynthesisRequest("Good morning.", "zero_shot", prompt_audio=_prompt(short_prompt_wav, 0.5),
                                   transcript=TRANSCRIPT, seed=1, stream=False)
        with service.synthesize(request) as session:
            assert sum(chunk.pcm.numel() for chunk in session) > 0
        with pytest.raises(StorageError, match="voice folder has become read-only") as refused:
            service.create_voice("After", _prompt(short_prompt_wav, 0.4), TRANSCRIPT)
        assert "/" not in str(refused.value)
        with pytest.raises(StorageError, match="read-only"):
            service.delete_voice("Before")
        assert service.get_voice("Before").id == saved.id  # still listed and usable
        request = SynthesisRequest("Good morning.", "zero_shot", voice="Before", seed=1, stream=False)
        with service.synthesize(request) as session:
            assert sum(chunk.pcm.numel() for chunk in session) > 0
