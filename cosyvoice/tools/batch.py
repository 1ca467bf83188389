"""Batch takes from a CSV or JSONL file: ``python -m cosyvoice.tools.batch INPUT --out DIR [--model-dir DIR]``.

Writes one WAV per good row and ``takes.csv`` (one row per take: its id and provenance) into ``--out``; the takes
are also kept in the workbench store (``--data-dir``, default ``COSYVOICE_DATA_DIR`` or ``.studio`` beside the
voice folder), so the web page and listening tests can use them. Progress and an ETA go to stderr; a bad row
is reported with its number and the rest still run (exit status 2 then).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from pathlib import Path

from cosyvoice.bundle import MODEL_IN_REPO
from cosyvoice.errors import InvalidInputError, command_line_errors
from cosyvoice.settings import default_data_dir, default_voice_dir
from cosyvoice.tools.make_tiny_bundle import model_dir_or_demo
from cosyvoice.voices import BUILTIN_VOICE_DIR
from cosyvoice.workbench.batch import TAKES_CSV_COLUMNS, Progress, parse_rows, run_batch, takes_csv_rows, write_csv
from cosyvoice.workbench.store import WorkbenchStore


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cosyvoice.tools.batch", description=__doc__.split("\n\n")[0])
    parser.add_argument("input", type=Path, help="a .csv (header: text,voice,...) or .jsonl file")
    parser.add_argument("--out", type=Path, required=True, help="folder for the WAV files and takes.csv")
    parser.add_argument("--model-dir", help=f"model folder or ModelScope id (default: {MODEL_IN_REPO} of this "
                                            "repository, else the demo model, as the web UI)")
    parser.add_argument("--voice-dir", type=Path, default=None, help="the voice library (COSYVOICE_VOICE_DIR)")
    parser.add_argument("--data-dir", type=Path, default=None, help="the workbench store (COSYVOICE_DATA_DIR)")
    parser.add_argument("--device", default=None)
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
    from cosyvoice.service import TTSService  # heavy: after the input is known to be readable

    voice_dir = args.voice_dir or default_voice_dir()
    service = TTSService.load(model_dir_or_demo(args.model_dir)[0], voice_dir, device=args.device)
    service.voices.add_builtins(BUILTIN_VOICE_DIR)
    store = WorkbenchStore(args.data_dir or default_data_dir(voice_dir))
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
        result = run_batch(service, store, rows, source=str(args.input), resolve_audio=resolve_audio,
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
