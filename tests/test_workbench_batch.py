"""Batch takes through the real CLI on the tiny bundle: provenance, bad rows, bit-identical re-runs, and a file of
several precisions run on a model per precision."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import soundfile as sf

from cosyvoice.bundle import bundle_digest
from cosyvoice.service import TTSService
from cosyvoice.settings import Limits
from cosyvoice.takes.store import TakeStore
from cosyvoice.voices import BUILTIN_VOICE_DIR, VoiceLibrary

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


def run_cli(tmp: Path, name: str, text: str, bundle: Path, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    (tmp / name).write_text(text, encoding="utf-8")
    out = tmp / f"out-{name}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "COSYVOICE_DATA_DIR": str(tmp / "data")}
    proc = subprocess.run([sys.executable, "-m", "cosyvoice.tools.batch", str(tmp / name), "--out", str(out),
                           "--model-dir", str(bundle), "--voice-dir", str(tmp / "voices"), "--device", "cpu", *extra],
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
    stored = TakeStore(tmp_path / "data").takes()
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


# ----------------------------------------------------------------------------- a precision column

PRECISION_ROWS = """text,voice,seed,precision,label
Hello there.,en-allison,11,fp32,fp32
Hello there.,en-allison,11,int8,int8
Good morning to you.,en-allison,5,,fp32
Good morning to you.,en-allison,5,int8,int8
"""


def test_batch_cli_runs_each_precision_on_a_model_of_its_own(tmp_path: Path, tiny_bundle_dir: Path) -> None:
    """fp32 against the fast path, for a blind A/B test: the same rows at each precision (empty: ``--precision``),
    grouped, one model loaded per group, each take recording what ran."""
    from cosyvoice.workbench.listening import design

    proc, out = run_cli(tmp_path, "paths.csv", PRECISION_ROWS, tiny_bundle_dir, "--precision", "fp32")
    assert proc.returncode == 0, proc.stderr
    log = proc.stderr
    loads = [line for line in log.splitlines() if line.startswith("loading the model")]
    assert loads == ["loading the model at precision fp32 (2 of the 4 rows)",
                     "loading the model at precision int8 (2 of the 4 rows)"]
    # one group after the other, in the file's order within each
    assert log.index(loads[0]) < log.index("[1/4] row 1 done") < log.index("[2/4] row 3 done") < log.index(loads[1])
    assert log.index(loads[1]) < log.index("[3/4] row 2 done") < log.index("[4/4] row 4 done")

    with open(out / "takes.csv", encoding="utf-8") as f:
        takes = {int(t["row"]): t for t in csv.DictReader(f)}
    assert sorted(takes) == [1, 2, 3, 4]
    for row, path in ((1, "fp32"), (3, "fp32"), (2, "int8"), (4, "int8")):
        assert takes[row]["precision"] == f"{path} (LLM {path}, flow {path}, vocoder fp32; {path})"
    for fp32, int8 in ((1, 2), (3, 4)):  # the same text and seed, made on two paths
        assert takes[fp32]["seed"] == takes[int8]["seed"]
        assert (out / takes[fp32]["file"]).read_bytes() != (out / takes[int8]["file"]).read_bytes()

    stored = TakeStore(tmp_path / "data").takes()
    assert [(t.row, t.label, t.provenance["precision"].split()[0]) for t in stored] == [
        (1, "fp32", "fp32"), (3, "fp32", "fp32"), (2, "int8", "int8"), (4, "int8", "int8")]
    items = design("ab", stored, ["fp32", "int8"])  # what the workbench's A/B test of the two labels pairs
    by_id = {t.id: t for t in stored}
    assert sorted((by_id[a].row, by_id[b].row) for a, b in (i["takes"] for i in items)) == [(1, 2), (3, 4)]


def test_batch_cli_refuses_an_unknown_precision_in_one_line(tmp_path: Path, tiny_bundle_dir: Path) -> None:
    proc, out = run_cli(tmp_path, "fp8.csv", "text,voice,precision\nHi.,en-allison,fp32\nHi.,en-allison,fp8\n",
                        tiny_bundle_dir)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "loading" not in proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.stderr.rstrip().endswith(line)
    assert line.endswith("fp8.csv: row 2: precision must be one of auto, fp32, bf16, int8 (empty: the run's own), "
                         "got 'fp8'")
    assert not out.exists()


def test_a_served_batch_makes_no_take_at_another_precision(tts, tmp_path: Path) -> None:
    """A server runs one model: a row naming another precision (a batch queued elsewhere and resumed here) fails
    with what it asked for and what runs; rows naming the running one, or none, are made."""
    from cosyvoice.workbench.batch import parse_rows, run_batch

    library = VoiceLibrary(tmp_path / "voices", tts.frontend, model_dir=tts.model_dir, builtin_dir=BUILTIN_VOICE_DIR)
    service = TTSService(tts.model, library, Limits(max_sessions=2))
    plan = service.model.plan
    assert (plan.llm, plan.flow) == ("fp32", "fp32")
    store = TakeStore(tmp_path / "data")
    rows = parse_rows("text,voice,seed,precision\nHello there.,en-allison,11,fp32\nHello there.,en-allison,11,int8\n"
                      "Hello there.,en-allison,11,\n")
    result = run_batch(service, store, rows)
    assert [t.row for t in result.takes] == [1, 3]
    assert all(t.provenance["precision"] == plan.label for t in result.takes)
    (error,) = result.errors
    assert (error.row, error.field) == (2, "precision")
    assert error.message.startswith(f"precision int8 was asked for, but this server runs {plan.label}; ")
    assert "python -m cosyvoice.tools.batch" in error.message
    store.close()


def test_one_model_at_a_time_releases_the_one_before(tiny_bundle_dir: Path, tmp_path: Path) -> None:
    """The batch CLI's models: the loaded one serves every precision it runs; another closes it and lets it go
    before loading, so a file of several precisions holds one model's memory."""
    from cosyvoice.tools.batch import OneModel

    loaded: list[str] = []
    before: list[weakref.ref] = []  # the first model's service, engine and LLM

    def load(precision: str) -> TTSService:
        assert all(ref() is None for ref in before), "a model loads while the one before is still held"
        loaded.append(precision)
        return TTSService.load(tiny_bundle_dir, tmp_path / "voices", device="cpu", backend="torch",
                               precision=precision)

    models = OneModel(load, load("fp32"))
    try:
        first = models("fp32")
        before += [weakref.ref(first), weakref.ref(first.model.engine), weakref.ref(first.model.engine.llm)]
        del first
        int8 = models("int8")  # load() found the fp32 model gone: its threads ended, nothing holds its weights
        assert models("int8") is int8 and int8.model.plan.llm == "int8" and loaded == ["fp32", "int8"]
    finally:
        models.close()
