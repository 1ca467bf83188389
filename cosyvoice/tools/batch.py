"""Batch takes from a CSV or JSONL file: ``python -m cosyvoice.tools.batch INPUT --out DIR [--model-dir DIR]``.

Writes one WAV per good row and ``takes.csv`` (one row per take: its id and provenance) into ``--out``; the takes
are also kept in the workbench store (``--data-dir``, default ``COSYVOICE_DATA_DIR`` or ``.studio`` beside the
voice folder), so the web page and listening tests can use them. Progress and an ETA go to stderr; a bad row
is reported with its number and the rest still run (exit status 2 then).

A ``precision`` column runs the same rows on several paths (fp32 against a fast path, for a blind A/B test): the
rows are grouped by precision (empty: ``--precision``), each group on a model loaded at it, one model at a time
(:class:`OneModel`). The ETA counts the loads between groups as they happen.
"""

from __future__ import annotations

import argparse
import gc
import logging
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from cosyvoice.backends.precision import CHOICES as PRECISION_CHOICES
from cosyvoice.backends.precision import check_name
from cosyvoice.bundle import MODEL_IN_REPO
from cosyvoice.context import StudioContext
from cosyvoice.errors import CosyVoiceError, InvalidInputError, command_line_errors
from cosyvoice.service import TTSService
from cosyvoice.settings import default_data_dir, default_voice_dir, precision_from_env
from cosyvoice.takes.export import TAKES_CSV_COLUMNS, takes_csv_rows, write_csv
from cosyvoice.takes.store import TakeStore
from cosyvoice.tools.make_tiny_bundle import model_dir_or_demo
from cosyvoice.voices import BUILTIN_VOICE_DIR
from cosyvoice.workbench.batch import (
    Progress,
    Row,
    by_precision,
    parse_rows,
    run_batch,
)


class OneModel:
    """The batch's service for a row's precision, one model at a time: the loaded one serves while the rows ask
    for what it runs, else it is closed and released before the next loads, so the run holds one model's memory
    however many precisions the file names. A precision whose model cannot load fails its rows with the reason
    (loaded once, not once per row)."""

    def __init__(self, load: Callable[[str], TTSService], first: TTSService) -> None:
        self._load = load
        self._service: TTSService | None = first
        self._refused: dict[str, str] = {}

    def __call__(self, precision: str) -> TTSService:
        if self._service is not None and self._service.precision.runs(precision):
            return self._service
        if precision in self._refused:
            raise InvalidInputError(self._refused[precision], "precision")
        self.close()
        try:
            self._service = self._load(precision)
        except CosyVoiceError as exc:
            self._refused[precision] = f"the model cannot be loaded at precision {precision}: {exc}"
            raise InvalidInputError(self._refused[precision], "precision") from exc
        return self._service

    def close(self) -> None:
        if self._service is not None:
            self._service.close()
            self._service = None
            gc.collect()  # the model's tensors go before the next model's arrive


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cosyvoice.tools.batch", description=__doc__.split("\n\n")[0])
    parser.add_argument("input", type=Path, help="a .csv (header: text,voice,...) or .jsonl file")
    parser.add_argument("--out", type=Path, required=True, help="folder for the WAV files and takes.csv")
    parser.add_argument("--model-dir", help=f"model folder or ModelScope id (default: {MODEL_IN_REPO} of this "
                                            "repository, else the demo model, as the web UI)")
    parser.add_argument("--voice-dir", type=Path, default=None, help="the voice library (COSYVOICE_VOICE_DIR)")
    parser.add_argument("--data-dir", type=Path, default=None, help="the workbench store (COSYVOICE_DATA_DIR)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--precision", default=None, choices=PRECISION_CHOICES,
                        help="what the LLM and the DiT compute in on a CPU for rows with an empty precision (default "
                             "COSYVOICE_PRECISION, else fp32); rows naming another run on a model loaded at it")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    with command_line_errors():
        return run(args)


def run(args: argparse.Namespace) -> int:
    try:
        rows = parse_rows(args.input.read_bytes(), args.input.name)
    except OSError as exc:
        raise InvalidInputError(f"{args.input}: {exc.strerror or exc}", "input") from exc
    except InvalidInputError as exc:
        raise InvalidInputError(f"{args.input}: {exc}", "input") from exc
    rows = by_precision(rows, check_name(args.precision or precision_from_env()))

    voice_dir = args.voice_dir or default_voice_dir()
    model_dir = model_dir_or_demo(args.model_dir)[0]
    groups = [r.values["precision"] for r in rows]

    def load(precision: str) -> TTSService:
        print(f"loading the model at precision {precision} ({groups.count(precision)} of the {len(rows)} rows)",
              file=sys.stderr, flush=True)
        return TTSService.load(model_dir, voice_dir, device=args.device, precision=precision,
                               builtin_dir=BUILTIN_VOICE_DIR)

    models = OneModel(load, load(groups[0]))  # before the run: a bad model folder is one error line, not each row's
    try:
        return _run(args, rows, models, voice_dir)
    finally:
        models.close()


def _run(args: argparse.Namespace, rows: list[Row], models: OneModel, voice_dir: Path) -> int:
    context = StudioContext(data_dir=args.data_dir or default_data_dir(voice_dir))  # its rows' models: ``models``
    try:
        return _made(args, rows, models, context.takes)
    finally:
        context.close()


def _made(args: argparse.Namespace, rows: list[Row], models: OneModel, store: TakeStore) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.input.resolve().parent

    def resolve_audio(path: str) -> Path:
        target = (base / path).resolve()
        if not target.is_file():
            raise InvalidInputError(f"no audio file {path!r} (paths are relative to the input file)", "prompt_audio")
        return target

    def report(p: Progress) -> None:
        what = f"row {p.row} FAILED: {p.error}" if p.error else f"row {p.row} done"
        eta = f"ETA {p.eta_seconds:.0f} s" if p.eta_seconds else "done" if p.eta_seconds == 0 else "ETA unknown"
        print(f"[{p.done + p.failed}/{p.total}] {what}; {p.elapsed:.1f} s elapsed, {eta}", file=sys.stderr, flush=True)

    try:
        result = run_batch(models, store, rows, source=str(args.input), resolve_audio=resolve_audio,
                           on_progress=report)
    except InvalidInputError as exc:
        print(f"error: {args.input}: {exc}", file=sys.stderr)
        return 1
    files = {}
    for take in result.takes:
        files[take.id] = f"row{take.row:03d}-{take.id}.wav"
        shutil.copyfile(store.audio_path(take), args.out / files[take.id])
    write_csv(args.out / "takes.csv", takes_csv_rows(result.takes, files), TAKES_CSV_COLUMNS)
    print(f"{len(result.takes)} takes in {args.out} (batch {result.batch_id}, store {store.root})", file=sys.stderr)
    for error in result.errors:
        print(f"error: {error}", file=sys.stderr)
    if result.error:
        print(f"error: the batch stopped: {result.error}", file=sys.stderr)
        return 1
    return 2 if result.errors else 0


if __name__ == "__main__":
    sys.exit(main())
