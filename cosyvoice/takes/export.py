"""Takes and answers as spreadsheets: the takes' flat rows (id and provenance) and the one CSV writer every export
of the studio goes through, whose cells a spreadsheet never runs as formulas."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cosyvoice.takes.store import Take

TAKES_CSV_COLUMNS = ("take_id", "row", "label", "file", "text", "normalised_text", "mode", "voice", "voice_id",
                     "prompt_text", "instruction", "seed", "speed", "steps", "final", "first_hop",
                     "precision", "model_id", "software",
                     "sample_rate", "audio_seconds", "synthesis_seconds", "first_chunk_seconds", "created")


def takes_csv_rows(takes: Iterable[Take], files: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """One flat row per take (``TAKES_CSV_COLUMNS``): its id and provenance."""
    out = []
    for t in takes:
        p = t.provenance
        timings = p.get("timings", {})
        out.append({
            "take_id": t.id, "row": t.row, "label": t.label, "file": (files or {}).get(t.id, t.audio),
            "normalised_text": " | ".join(p.get("segments", [])), "sample_rate": t.sample_rate,
            "audio_seconds": timings.get("audio_seconds", round(t.seconds, 4)), "created": round(t.created, 3),
            **{k: p.get(k, "") for k in ("text", "mode", "voice", "voice_id", "prompt_text", "instruction", "seed",
                                         "speed", "steps", "final", "first_hop", "precision", "model_id",
                                         "software")},
            **{k: timings.get(k, "") for k in ("synthesis_seconds", "first_chunk_seconds")}})
    return out


FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")  # what makes a spreadsheet read a cell as a formula


def spreadsheet_safe(value: object) -> object:
    """A cell a spreadsheet shows as text: text starting like a formula (``=HYPERLINK(...)``, ``+cmd|...``) gets
    a leading quote, so a label, text or rater name someone typed is never run by whoever opens the export.
    Numbers stay numbers (a negative score is not a formula)."""
    return "'" + value if isinstance(value, str) and value.startswith(FORMULA_STARTS) else value


def write_csv(path: Path | io.StringIO, rows: list[dict[str, Any]], columns: Iterable[str]) -> None:
    """A CSV with a header (a StringIO for HTTP answers, a path for the CLI); every CSV the studio writes goes
    through here, its cells made :func:`spreadsheet_safe`."""
    def write(f: Any) -> None:
        writer = csv.DictWriter(f, fieldnames=list(columns))
        writer.writeheader()
        writer.writerows({k: spreadsheet_safe(v) for k, v in row.items()} for row in rows)

    if isinstance(path, io.StringIO):
        write(path)
    else:
        with open(path, "w", newline="", encoding="utf-8") as f:
            write(f)
