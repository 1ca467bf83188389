"""Narrate a long text (or a dialogue script) into one finished file with subtitles and a segment table.

    python -m cosyvoice.tools.longform INPUT --voice NAME --out DIR [--model-dir DIR]
    python -m cosyvoice.tools.longform SCRIPT --dialogue --speaker Alice=VoiceA --speaker Bob=VoiceB --out DIR

INPUT is a .txt, .md, .epub, .pdf or .docx file (``-`` reads standard input). NAME is a saved or built-in
voice's name or id.
DIR receives the audio (``<name>.<format>``), ``segments.json`` (per segment: text, start/end seconds, seed,
take id, voice id) and ``subtitles.srt`` / ``subtitles.vtt``. The run is a project in the data folder
(``COSYVOICE_DATA_DIR``), so the web page can reopen it to fix single segments.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from cosyvoice.bundle import MODEL_IN_REPO
from cosyvoice.context import StudioContext
from cosyvoice.encoding import file_format
from cosyvoice.errors import InvalidInputError, command_line_errors
from cosyvoice.longform.documents import read_document
from cosyvoice.longform.finishing import PRESETS, srt, vtt
from cosyvoice.service import TTSService
from cosyvoice.settings import DEFAULT_VOICE_DIR, default_data_dir, default_voice_dir
from cosyvoice.tools.make_tiny_bundle import model_dir_or_demo
from cosyvoice.voices import BUILTIN_VOICE_DIR


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cosyvoice.tools.longform", description=__doc__.split("\n\n")[0])
    parser.add_argument("input", help=".txt, .md, .epub, .pdf or .docx file, or - for standard input")
    parser.add_argument("--voice", help="the narrator: a saved or built-in voice's name or id")
    parser.add_argument("--out", required=True, type=Path, help="folder for the audio, segments.json, subtitles")
    parser.add_argument("--model-dir", help=f"model folder or ModelScope id (default: {MODEL_IN_REPO} of this "
                                            "repository, else the demo model, as the web UI)")
    parser.add_argument("--voice-dir", default=str(default_voice_dir()), help=f"default {DEFAULT_VOICE_DIR}")
    parser.add_argument("--builtin-dir", default=str(BUILTIN_VOICE_DIR),
                        help="the built-in voices (NAME.wav + NAME.txt; default: the repository's assets/voices)")
    parser.add_argument("--data-dir", type=Path, help="where projects are kept (default: COSYVOICE_DATA_DIR)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dialogue", action="store_true", help="INPUT is a script of 'Name: line' turns")
    parser.add_argument("--speaker", action="append", default=[], metavar="LABEL=VOICE",
                        help="dialogue: the voice of a speaker label (repeat it)")
    parser.add_argument("--format", default="wav", help="wav, mp3, flac, opus, m4b or mp4 (default wav)")
    parser.add_argument("--preset", default="podcast", choices=[*PRESETS, "none"], help="loudness target")
    parser.add_argument("--name", help="project name (default: the input's file name)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    with command_line_errors():
        return run(args)


def run(args: argparse.Namespace) -> int:
    file_format(args.format)  # a wrong --format is said before the model loads, not after the narration
    if args.input == "-":
        text, chapters, stem = sys.stdin.read(), None, "stdin"
    else:
        path = Path(args.input)
        if not path.is_file():
            raise InvalidInputError(f"no file {args.input}", "input")
        text, chapters = read_document(path.name, path.read_bytes())
        stem = path.stem
    speakers = {}
    for item in args.speaker:
        label, sep, voice = item.partition("=")
        if not sep or not label.strip() or not voice.strip():
            raise InvalidInputError(f"--speaker {item!r}: write it as LABEL=VOICE", "speaker")
        speakers[label.strip()] = voice.strip()
    service = TTSService.load(model_dir_or_demo(args.model_dir)[0], args.voice_dir, device=args.device,
                              builtin_dir=args.builtin_dir)
    context = StudioContext(service=service, data_dir=args.data_dir or default_data_dir())
    studio = context.studio()
    try:
        project = studio.editor.create(args.name or stem, text, voice=args.voice, speakers=speakers, chapters=chapters,
                                       kind="dialogue" if args.dialogue else "document", preset=args.preset)
        segments = studio.segments(project.id)
        print(f"project {project.id}: {len(segments)} segments", file=sys.stderr)
        if unmapped := project.settings.get("unmapped_speakers"):
            print(f"note: no --speaker for {', '.join(unmapped)}: they read with --voice {args.voice}", file=sys.stderr)
        studio.renders.generate(project.id)
        while (progress := studio.renders.wait(project.id, timeout=2.0))["running"]:
            eta = "" if progress["eta"] is None else f", about {progress['eta']:.0f} s left"
            print(f"  {progress['done']}/{progress['total']} done{eta}", file=sys.stderr)
        if progress["failed"]:
            failed = [s for s, _, status in studio.renders.table(project.id) if status == "failed"]
            for s in failed:
                print(f"  segment {s.position + 1} failed: {s.error}", file=sys.stderr)
            print(f"error: {len(failed)} segment(s) failed; the project {project.id} keeps what was made",
                  file=sys.stderr)
            return 1
        started = time.perf_counter()
        name = studio.mixer.file_name(project.id, args.format)
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / name, "wb") as out:
            timeline = studio.mixer.export_to(out, project.id, args.format)
        table = studio.mixer.segments_json(project.id, timeline)
        (args.out / "segments.json").write_text(json.dumps(table, indent=2, ensure_ascii=False), encoding="utf-8")
        (args.out / "subtitles.srt").write_text(srt(timeline.cues), encoding="utf-8")
        (args.out / "subtitles.vtt").write_text(vtt(timeline.cues), encoding="utf-8")
        print(f"wrote {args.out / name} ({table['duration']:.1f} s, finished in "
              f"{time.perf_counter() - started:.1f} s), segments.json, subtitles.srt, subtitles.vtt", file=sys.stderr)
        return 0
    finally:
        context.close()


if __name__ == "__main__":
    sys.exit(main())
