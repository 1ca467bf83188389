"""The workbench store: a real SQLite file that survives reopening and a ``kill -9`` in the middle of answers."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import soundfile as sf

from cosyvoice.settings import default_data_dir
from cosyvoice.takes.store import DB_NAME, Answer, TakeStore

REPO = Path(__file__).resolve().parents[1]


def test_default_data_dir_sits_beside_the_voice_folder(tmp_path: Path) -> None:
    assert default_data_dir(environ={}) == Path("pretrained_models/.studio")
    assert default_data_dir(environ={"COSYVOICE_VOICE_DIR": str(tmp_path / "v")}) == tmp_path / ".studio"
    assert default_data_dir(tmp_path / "voices", environ={}) == tmp_path / ".studio"
    assert default_data_dir(environ={"COSYVOICE_DATA_DIR": "/x/y"}) == Path("/x/y")


def test_takes_tests_raters_and_answers_survive_reopening(tmp_path: Path) -> None:
    store = TakeStore(tmp_path)
    pcm = (0.3 * np.sin(np.arange(2400) / 5)).astype(np.float32)
    take = store.add_take(pcm, 24000, {"text": "hi"}, label="sysA", owner="browser:abc")
    test_id = store.add_test("mos", "t", "listen", {"items": [{"takes": [take.id]}]})
    rater = store.add_rater(test_id, "Ann", 7, [{"item": 0, "slots": []}])
    store.add_answer(Answer(test_id, rater.id, 0, 0, {"score": 4}, 3.5, 1, None, 1.0))
    store.close()

    again = TakeStore(tmp_path)
    assert again.take(take.id) == take
    samples, rate = sf.read(again.audio_path(take), dtype="float32")
    assert rate == 24000 and np.array_equal(samples, pcm)  # float32 WAV: the samples exactly as made
    assert sf.info(again.audio_path(take)).subtype == "FLOAT"
    assert [t.id for t in again.takes(owner="browser:abc", any_owner=False)] == [take.id]
    assert again.takes(owner="browser:other", any_owner=False) == []
    assert again.takes(after=take.seq) == []  # incremental history: nothing newer
    assert again.rater(rater.id).seed == 7
    assert [(a.rater, a.answer) for a in again.answers(test_id=test_id)] == [(rater.id, {"score": 4})]
    assert again.path.name == DB_NAME and again._rows("PRAGMA journal_mode")[0][0] == "wal"


WRITER = textwrap.dedent("""
    import sys, time
    from cosyvoice.takes.store import Answer, TakeStore
    store = TakeStore(sys.argv[1])
    test_id = store.add_test("mos", "t", "", {"items": []})
    rater = store.add_rater(test_id, "Ann", 1, [])
    for i in range(100000):
        store.add_answer(Answer(test_id, rater.id, i, i, {"score": i % 5 + 1}, 1.0, 1, None, time.time()))
        print(i, flush=True)  # committed: the parent may kill us from now on
""")


def test_kill_9_mid_answer_loses_at_most_that_answer(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env=env)
    acknowledged = -1
    for line in proc.stdout:  # type: ignore[union-attr]
        acknowledged = int(line)
        if acknowledged >= 40:
            break
    proc.send_signal(signal.SIGKILL)  # in the middle of the next answers' transactions
    proc.wait(timeout=30)
    for line in proc.stdout:  # type: ignore[union-attr]  # lines printed before the kill landed
        acknowledged = int(line)

    con = sqlite3.connect(tmp_path / DB_NAME)
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    con.close()
    answers = TakeStore(tmp_path).answers()
    positions = [a.position for a in answers]
    assert positions == list(range(len(positions)))  # no hole, no torn row
    assert acknowledged + 1 <= len(positions) <= acknowledged + 2  # every acknowledged one, at most one more
    assert all(a.answer == {"score": a.position % 5 + 1} for a in answers)
