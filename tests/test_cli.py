"""The command lines as the README writes them, as real processes: on a clone without the model they run on the
demo model as the web UI does and say so; a missing folder, a bad setting or a bad input ends them with one line
naming it and exit status 2, never a traceback."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cosyvoice import bundle

ROOT = Path(__file__).resolve().parents[1]
MISSING = "pretrained_models/no-such-model"  # a path under the model folder: it looks like owner/name


def run(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` from the repository, as the README shows; voices and takes go under ``tmp_path``."""
    environ = {**os.environ, "COSYVOICE_DATA_DIR": str(tmp_path / "data"), "COSYVOICE_VOICE_DIR":
               str(tmp_path / "voices"), **(env or {})}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=environ, capture_output=True, text=True,
                          timeout=600)


def one_error_line(done: subprocess.CompletedProcess[str], *names: str) -> str:
    """Exit 2 and one ``error:`` line, the last, naming each of ``names``; no traceback."""
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and done.stderr.rstrip().endswith(errors[0]), done.stderr[-3000:]
    assert all(name in errors[0] for name in names), errors[0]
    return errors[0]


@pytest.fixture()
def rows(tmp_path: Path) -> Path:
    path = tmp_path / "rows.csv"
    path.write_text("text,voice,seed\nHi there.,en-allison,3\n", encoding="utf-8")
    return path


@pytest.fixture()
def article(tmp_path: Path) -> Path:
    path = tmp_path / "article.txt"
    path.write_text("Hi there.\n", encoding="utf-8")
    return path


@pytest.fixture()
def without_model() -> None:
    if bundle.DEFAULT_MODEL_DIR.is_dir():
        pytest.skip(f"{bundle.DEFAULT_MODEL_DIR} holds a model here: the demo fallback cannot be seen")


# ----------------------------------------------------------------------------- the demo model, as the web UI


def test_batch_runs_on_the_demo_model_as_the_readme_writes_it(tmp_path: Path, rows: Path, without_model) -> None:
    done = run(tmp_path, "-m", "cosyvoice.tools.batch", str(rows), "--out", str(tmp_path / "takes"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert bundle.DEMO_WARNING in done.stderr  # said, as on the web UI's page and log
    with open(tmp_path / "takes" / "takes.csv", newline="", encoding="utf-8") as f:
        (take,) = csv.DictReader(f)
    assert (tmp_path / "takes" / take["file"]).stat().st_size > 44  # more than a WAV header


def test_longform_runs_on_the_demo_model(tmp_path: Path, article: Path, without_model) -> None:
    done = run(tmp_path, "-m", "cosyvoice.tools.longform", str(article), "--voice", "en-allison", "--out",
               str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert bundle.DEMO_WARNING in done.stderr
    assert (tmp_path / "out" / "article.wav").stat().st_size > 44 and (tmp_path / "out" / "segments.json").is_file()


def test_export_onnx_runs_on_the_demo_model(tmp_path: Path, without_model) -> None:
    done = run(tmp_path, "-m", "cosyvoice.bin.export_onnx", "--out", str(tmp_path / "onnx"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert bundle.DEMO_WARNING in done.stderr and "tolerance:" in done.stdout
    assert (tmp_path / "onnx" / "manifest.json").is_file()


# ----------------------------------------------------------------------------- one line, exit 2


def test_a_missing_model_folder_is_a_missing_folder_with_the_download_hint(tmp_path: Path, rows: Path,
                                                                         article: Path) -> None:
    for args in (["-m", "cosyvoice.tools.batch", str(rows), "--out", str(tmp_path / "takes"), "--model-dir", MISSING],
                 ["-m", "cosyvoice.tools.longform", str(article), "--voice", "en-allison", "--out",
                  str(tmp_path / "out"), "--model-dir", MISSING],
                 ["-m", "cosyvoice.bin.export_onnx", MISSING],
                 ["webui.py", "--model-dir", MISSING]):
        line = one_error_line(run(tmp_path, *args), f"model directory {MISSING} does not exist",
                              f"modelscope download --model {bundle.DEFAULT_MODEL_ID} --local_dir {MISSING}")
        assert "ModelScope id" not in line


@pytest.mark.parametrize(("args", "env", "names"), [
    (["-m", "cosyvoice.server.rest", "--port", "0"], {}, ["port must be in 1..65535, got 0"]),
    (["-m", "cosyvoice.server.rest"], {"COSYVOICE_MAX_SESSIONS": "many"}, ["COSYVOICE_MAX_SESSIONS='many'"]),
    (["-m", "cosyvoice.server.grpc", "--port", "0"], {}, ["port must be in 1..65535, got 0"]),
    (["webui.py"], {"COSYVOICE_RETRY_AFTER_SECONDS": "soon"}, ["COSYVOICE_RETRY_AFTER_SECONDS='soon'"]),
    (["-m", "cosyvoice.server.rest"], {"COSYVOICE_PRECISION": "NaN"}, ["COSYVOICE_PRECISION", "got 'NaN'"]),
    (["-m", "cosyvoice.server.grpc", "--precision", "-1"], {}, ["--precision", "got '-1'"]),
], ids=["rest-port", "rest-env", "grpc-port", "webui-env", "rest-precision", "grpc-precision"])
def test_a_bad_server_setting_is_one_line(tmp_path: Path, args: list[str], env: dict[str, str],
                                          names: list[str]) -> None:
    if "cosyvoice.server.grpc" in args:
        pytest.importorskip("grpc", reason="the gRPC server needs the grpc extra")
    one_error_line(run(tmp_path, *args, env=env), *names)


def test_bad_input_is_one_line(tmp_path: Path, article: Path) -> None:
    one_error_line(run(tmp_path, "-m", "cosyvoice.tools.batch", "no-such-rows.csv", "--out", str(tmp_path / "t")),
                   "no-such-rows.csv", "No such file")
    one_error_line(run(tmp_path, "-m", "cosyvoice.tools.longform", str(article), "--voice", "en-allison",
                       "--format", "wav7", "--out", str(tmp_path / "out")), "unknown audio format 'wav7'")
    one_error_line(run(tmp_path, "-m", "cosyvoice.tools.longform", str(article), "--dialogue", "--speaker", "Alice",
                       "--out", str(tmp_path / "out")), "--speaker 'Alice'", "LABEL=VOICE")
