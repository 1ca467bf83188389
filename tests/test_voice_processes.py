"""One voice folder shared by several processes (REST and gRPC servers, the web UI, scripts), as documented:
the folder is the truth for every one of them (issue 12, items 1 and 4). The other processes are real ones
(tests/voice_worker.py), so a per-process lock or index could not pass."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from voice_worker import REPO, Worker, worker_env

from cosyvoice.errors import InvalidInputError, NotFoundError
from cosyvoice.voices import VoiceLibrary


@pytest.fixture
def workers():
    started: list[Worker] = []

    def start(n: int = 1) -> list[Worker]:
        new = [Worker() for _ in range(n)]
        started.extend(new)
        return new

    yield start
    for worker in started:
        worker.close()


def _tone(hz: float, seconds: float = 1.1, sr: int = 16000) -> tuple[np.ndarray, int]:
    t = np.arange(int(seconds * sr)) / sr
    return (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32), sr


def _open(worker: Worker, root: Path, model_dir: str) -> None:
    worker(open="library", root=str(root), model_dir=model_dir)


def test_eviction_never_deletes_a_voice_another_process_named(tts, tmp_path: Path, workers) -> None:
    here = VoiceLibrary(tmp_path, tts.frontend, model_dir=tts.model_dir, max_entries=2)
    upload = here.get_or_create(_tone(110))[0]  # indexed here as an unnamed cache entry
    [other] = workers()
    _open(other, tmp_path, tts.model_dir)
    assert other(call="save", args=["precious", upload])["name"] == "precious"  # e.g. a second server: 201
    for hz in (220, 330, 440):  # more uploads here than the cache holds: the least recently used go
        here.get_or_create(_tone(hz))
    assert here.get("precious")[0].id == upload
    assert other(call="info", args=["precious"])["id"] == upload
    assert sum(i.name is None for i in here.list()) == 2  # the bound still holds for unnamed uploads


def test_renames_and_deletions_in_another_process_are_followed(tts, tmp_path: Path, workers) -> None:
    here = VoiceLibrary(tmp_path, tts.frontend, model_dir=tts.model_dir)
    upload = here.get_or_create(_tone(150))[0]
    [other] = workers()
    _open(other, tmp_path, tts.model_dir)
    other(call="save", args=["first", upload])
    assert here.get("first")[0].id == upload
    other(call="rename", args=["first", "second"])
    with pytest.raises(NotFoundError, match="unknown voice 'first'"):
        here.get("first")
    assert here.info("second").id == upload and [i.name for i in here.list()] == ["second"]
    assert other(call="delete", args=["second"])["id"] == upload
    assert here.list() == []
    with pytest.raises(NotFoundError):
        here.get(upload)
    assert not list(here.dir.glob(f"{upload}.*"))


def test_five_processes_saving_one_name_at_once_have_exactly_one_winner(tts, tmp_path: Path, workers) -> None:
    here = VoiceLibrary(tmp_path, tts.frontend, model_dir=tts.model_dir)
    racers = workers(5)
    for racer in racers:
        racer.send(open="library", root=str(tmp_path), model_dir=tts.model_dir)
    assert all("ok" in racer.answer() for racer in racers)
    for round_, name in enumerate(("Same", "Again", "Third")):
        uploads = [here.get_or_create(_tone(100 + 50 * i + 7 * round_))[0] for i in range(5)]
        for racer, upload in zip(racers, uploads, strict=True):  # all five at once
            racer.send(call="save", args=[name, upload])
        answers = [racer.answer() for racer in racers]
        winners = [a for a in answers if "ok" in a]
        assert len(winners) == 1, answers
        assert {a.get("error") for a in answers if "ok" not in a} == {"AlreadyExistsError"}
        names = [json.loads(p.read_text())["name"] for p in here.dir.glob("*.json")]
        assert names.count(name) == 1 and here.info(name).id == winners[0]["ok"]["id"]
        assert sum(here.info(u).name is None for u in uploads) == 4  # the losers' uploads are untouched


def test_a_name_never_looks_like_an_id(tts, tmp_path: Path) -> None:
    library = VoiceLibrary(tmp_path, tts.frontend, model_dir=tts.model_dir)
    a, b = (library.get_or_create(_tone(hz))[0] for hz in (110, 220))
    for name in (b, b.upper(), "builtin-Narrator"):
        with pytest.raises(InvalidInputError, match="looks like a voice id"):
            library.save(name, a)
    library.save("Ada", a)
    with pytest.raises(InvalidInputError, match="looks like a voice id"):
        library.rename("Ada", b)
    assert library.delete(b).id == b  # the string names b: b goes, Ada stays
    assert [i.id for i in library.list()] == [a]


LOCK_HOLDER = """
import signal, sys
from cosyvoice.voices import VoiceLibrary
library = VoiceLibrary(sys.argv[1], None, model_dir=sys.argv[2])
held = library.folder.exclusive()  # hold the folder lock, as a save in progress does
held.__enter__()
print("held", flush=True)
signal.pause()  # holds it until killed
"""


def test_the_folder_lock_is_real_across_processes_and_freed_by_kill_9(tts, tmp_path: Path) -> None:
    library = VoiceLibrary(tmp_path, tts.frontend, model_dir=tts.model_dir)
    upload = library.get_or_create(_tone(110))[0]
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(tmp_path), tts.model_dir],
                              stdout=subprocess.PIPE, text=True, cwd=REPO, env=worker_env())
    try:
        assert holder.stdout.readline().strip() == "held"
        saved = threading.Thread(target=library.save, args=("waited", upload), daemon=True)
        saved.start()
        saved.join(1.0)
        assert saved.is_alive(), "a save must wait for the other process's lock"
        holder.send_signal(signal.SIGKILL)  # dies holding it: the kernel releases a flock
        saved.join(60)
        assert not saved.is_alive() and library.info("waited").id == upload
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
