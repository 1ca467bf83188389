"""Batch takes through the real CLI on the tiny bundle: provenance, bad rows, and bit-identical re-runs."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import soundfile as sf

from cosyvoice.bundle import bundle_digest
from cosyvoice.workbench.store import WorkbenchStore

REPO = Path(__file__).resolve().parents[1]
ROWS = """text,voice,prompt_audio,prompt_text,mode,instruction,seed,speed,label
Hello there.,en-allison,,,,,11,,sysA
Hello there.,fr-june,,,cross_lingual,,,1.2,sysB
Good morning to you.,,prompt.wav,A short test prompt.,zero_shot,,,,sysA
Good morning to you.,nobody,,,,,,,sysB
It is sunny today.,it-carlo,,,instruct,Speak calmly.,5,,sysA
,en-allison,,,,,,,sysB
It is sunny today.,en-allison,,,cross_lingual,,,0.8,sysB
The end.,ru-ivrvoice,,,,,3,,sysA
"""


def run_cli(tmp: Path, name: str, text: str, bundle: Path) -> tuple[subprocess.CompletedProcess, Path]:
    (tmp / name).write_text(text, encoding="utf-8")
    out = tmp / f"out-{name}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "COSYVOICE_DATA_DIR": str(tmp / "data")}
    proc = subprocess.run([sys.executable, "-m", "cosyvoice.tools.batch", str(tmp / name), "--out", str(out),
                           "--model-dir", str(bundle), "--voice-dir", str(tmp / "voices"), "--device", "cpu"],
                          capture_output=True, text=True, env=env, timeout=600)
    return proc, out


def test_batch_cli_writes_takes_with_provenance_and_reports_bad_rows(tmp_path: Path, tiny_bundle_dir: Path,
                                                                     short_prompt_wav: Path) -> None:
    shutil.copyfile(short_prompt_wav, tmp_path / "prompt.wav")
    proc, out = run_cli(tmp_path, "batch.csv", ROWS, tiny_bundle_dir)
    assert proc.returncode == 2, proc.stderr  # some rows failed, the rest ran
    assert "row 4 (voice): unknown voice 'nobody'" in proc.stderr
    assert "row 6 (text): text is empty" in proc.stderr
    assert "[8/8]" in proc.stderr and "ETA" in proc.stderr

    with open(out / "takes.csv", encoding="utf-8") as f:
        takes = list(csv.DictReader(f))
    assert [int(t["row"]) for t in takes] == [1, 2, 3, 5, 7, 8]
    model_id = bundle_digest(tiny_bundle_dir)
    for t in takes:
        samples, rate = sf.read(out / t["file"], dtype="int16")
        assert rate == int(t["sample_rate"]) == 24000 and len(samples) / rate == float(t["audio_seconds"]) > 0
        assert t["model_id"] == model_id and t["software"].startswith("cosyvoice3-studio")
        assert 0 <= int(t["seed"]) < 2**53 and t["voice_id"] and float(t["synthesis_seconds"]) > 0
    by_row = {int(t["row"]): t for t in takes}
    assert (by_row[1]["seed"], by_row[1]["mode"], by_row[1]["voice_id"]) == ("11", "sft", "builtin-en-allison")
    assert by_row[2]["mode"] == "cross_lingual" and float(by_row[2]["speed"]) == 1.2
    assert by_row[3]["prompt_text"] == "A short test prompt." and len(by_row[3]["voice_id"]) > 16
    assert (by_row[5]["instruction"], by_row[5]["mode"]) == ("Speak calmly.", "instruct")
    assert by_row[8]["normalised_text"] == "The end."
    # the same takes are in the store, for the page and the listening tests
    stored = WorkbenchStore(tmp_path / "data").takes()
    assert [s.id for s in stored] == [t["take_id"] for t in takes]
    assert stored[0].provenance["segments"] == ["Hello there."] and stored[0].label == "sysA"

    # re-running a row with its stored seed gives the same samples, bit for bit
    row = by_row[2]
    again = (f"text,voice,mode,seed,speed\n{row['text']},{row['voice']},{row['mode']},{row['seed']},"
             f"{row['speed']}\n")
    proc, out2 = run_cli(tmp_path, "again.csv", again, tiny_bundle_dir)
    assert proc.returncode == 0, proc.stderr
    with open(out2 / "takes.csv", encoding="utf-8") as f:
        (rerun,) = list(csv.DictReader(f))
    assert rerun["seed"] == row["seed"] and rerun["take_id"] != row["take_id"]
    assert (out2 / rerun["file"]).read_bytes() == (out / row["file"]).read_bytes()


def test_batch_cli_refuses_unknown_columns(tmp_path: Path, tiny_bundle_dir: Path) -> None:
    proc, _ = run_cli(tmp_path, "bad.csv", "text,colour\nhi,red\n", tiny_bundle_dir)
    assert proc.returncode == 2 and "unknown column(s) colour" in proc.stderr and "Traceback" not in proc.stderr


def test_rows_from_csv_and_jsonl_read_the_same() -> None:
    from cosyvoice.errors import InvalidInputError
    from cosyvoice.workbench.batch import parse_rows, row_request

    csv_rows = parse_rows("\ufefftext,voice,seed,speed,label\nHi.,Ann,7,1.5,sysA\n")
    jsonl_rows = parse_rows(b'{"text": "Hi.", "voice": "Ann", "seed": 7, "speed": 1.5, "label": "sysA"}\n\n')
    assert csv_rows == jsonl_rows
    request = row_request(csv_rows[0], None)
    assert (request.text, request.voice, request.mode, request.seed, request.speed) == ("Hi.", "Ann", "sft", 7, 1.5)
    drawn = row_request(parse_rows("text,voice\nHi.,Ann\n")[0], None)
    assert drawn.seed is None  # the service draws it (the one draw of every adapter); the take records it
    with pytest.raises(InvalidInputError, match="line 2 is not JSON"):
        parse_rows('{"text": "a"}\n{oops\n')
    with pytest.raises(InvalidInputError, match="seed must be a whole number"):
        row_request(parse_rows("text,seed\nHi.,x\n")[0], None)
    with pytest.raises(InvalidInputError, match="prompt_audio paths are not accepted here"):
        row_request(parse_rows("text,prompt_audio\nHi.,/etc/passwd\n")[0], None)
