"""Batch generation with provenance: rows of a CSV or JSONL -> takes in the store, each with how it was made.

A row has ``text``, a voice (``voice``: a saved voice's id or name, built-ins included; or ``prompt_audio`` +
``prompt_text``), and optionally ``mode``, ``instruction``, ``seed``, ``speed``, ``steps`` (the flow's Euler steps;
empty: the model's), ``final`` and ``first_hop`` (the chunk schedule: ``full`` or ``chunked`` last flow call, speech
tokens of the first chunk; empty: the reference's), ``precision`` (what the LLM and the DiT compute in, one of
:data:`~cosyvoice.backends.precision.CHOICES`; empty: what runs) and ``label`` (the condition / system the take
belongs to). Every row goes through :meth:`TTSService.synthesize`, like any other request; a row without a seed
gets the one the service draws, stored, so re-running the row with its stored seed gives the same samples. A bad
row (unknown voice, empty text, a bad speed) is reported with its row number and field, and the other rows still
run. A batch is a job of :mod:`cosyvoice.jobs` (progress, ETA, cancel, resume after a crash).

A server runs one model, so its batches may name only the precision it runs (:func:`check_precisions`); the batch
CLI runs a file naming several on one model per precision (:func:`by_precision`), so fp32 and a fast path make
takes of the same rows for a blind listening test.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cosyvoice.backends.precision import CHOICES as PRECISION_CHOICES
from cosyvoice.bundle import bundle_digest
from cosyvoice.engine import CancelToken
from cosyvoice.errors import InvalidInputError
from cosyvoice.jobs import Job, JobRunner, JobState, Kind, Task, release, runner, synthesize
from cosyvoice.service import SynthesisRequest, TTSService
from cosyvoice.settings import Limits, env_name
from cosyvoice.takes.provenance import keep_take, software_version
from cosyvoice.takes.store import Take, TakeStore

COLUMNS = ("text", "voice", "prompt_audio", "prompt_text", "mode", "instruction", "seed", "speed", "steps", "final",
           "first_hop", "precision", "label")
KIND = "batch"  # the job kind of batches
Services = Callable[[str], TTSService]  # a row's precision ("": what runs) -> the service that makes the row


@dataclass(frozen=True)
class Row:
    """One input row, as written (``number`` counts data rows from 1, as people number them)."""

    number: int
    values: dict[str, str]


@dataclass(frozen=True)
class RowError:
    row: int
    field: str | None
    message: str

    def json(self) -> dict[str, Any]:
        return {"row": self.row, "field": self.field, "message": self.message}

    def __str__(self) -> str:
        return f"row {self.row}" + (f" ({self.field})" if self.field else "") + f": {self.message}"


@dataclass(frozen=True)
class Progress:
    """After each row: counts, time, the ETA at the measured rate, and the row's error if it failed."""

    done: int
    failed: int
    total: int
    elapsed: float
    eta_seconds: float | None
    row: int
    error: str | None = None


@dataclass
class BatchResult:
    batch_id: str
    state: JobState
    error: str | None  # why the batch stopped (e.g. a full disk), beside the rows' own errors
    takes: list[Take] = field(default_factory=list)
    errors: list[RowError] = field(default_factory=list)


def parse_rows(data: str | bytes, name: str = "", limits: Limits | None = None) -> list[Row]:
    """Rows of a CSV (header line first) or JSONL (one object per line) file; JSONL when ``name`` ends in
    ``.jsonl``/``.ndjson`` or the first non-blank character is ``{``. Unknown columns are refused by name; the
    row count and each field's length are bounded by ``limits`` (default: the environment's)."""
    limits = limits or Limits.from_env()
    text = _utf8(data, "the file")
    if name.lower().endswith((".jsonl", ".ndjson")) or text.lstrip().startswith("{"):
        records: list[object] = []
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                records.append(_json(line, f"line {i}"))
        return _rows(records, limits, "line")
    return _rows(_csv_records(text, limits), limits, "row")


def body_rows(body: bytes, content_type: str, limits: Limits | None = None) -> list[Row]:
    """A batch's HTTP body: JSON ``{"rows": [{...}, ...]}`` (``content_type`` application/json), else the CSV
    or JSONL file itself."""
    if not content_type.startswith("application/json"):
        return parse_rows(body, "", limits)
    value = _json(_utf8(body, "the body"), "the body") if body.strip() else None
    rows = value.get("rows") if isinstance(value, dict) else None
    if not isinstance(rows, list):
        raise InvalidInputError('send {"rows": [...]}, or the CSV/JSONL file as the body', "rows")
    return _rows(rows, limits or Limits.from_env(), "row")


def _utf8(data: str | bytes, what: str) -> str:
    """Text without a byte-order mark; bytes that are not UTF-8 are refused saying where."""
    if isinstance(data, str):
        return data.lstrip("\ufeff")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InvalidInputError(f"{what} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
                                f"{exc.start}); save it as UTF-8", "input") from exc


def _json(text: str, what: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInputError(f"{what} is not JSON: {exc.msg} (at character {exc.pos + 1})", "input") from exc
    except RecursionError:  # a JSONL line (no body bound sees it) nested thousands deep; a row never nests
        raise InvalidInputError(f"{what} nests JSON too deeply; a row is one object of plain values",
                                "input") from None


def _csv_records(text: str, limits: Limits) -> list[object]:
    """A CSV's rows as dicts by its header; at most one more row than the limit is read."""
    reader = csv.DictReader(io.StringIO(text))
    records: list[object] = []
    try:
        for record in reader:
            records.append({k: v for k, v in record.items() if k is not None})
            if len(records) > limits.max_batch_rows:
                break
    except csv.Error as exc:
        if "field larger than field limit" in str(exc):
            raise _field_too_long(len(records) + 1, "row", limits) from exc
        raise InvalidInputError(f"the CSV cannot be read at line {reader.line_num}: {exc}", "input") from exc
    if reader.fieldnames is None:
        raise InvalidInputError("the input is empty; its first line names the columns (text, voice, ...)", "input")
    return records


def _field_too_long(number: int, unit: str, limits: Limits) -> InvalidInputError:
    return InvalidInputError(f"{unit} {number}: a field is longer than {limits.max_batch_field_chars} characters "
                             f"({env_name('max_batch_field_chars')})", "input")


def _rows(records: list[object], limits: Limits, unit: str) -> list[Row]:
    """Records (one dict per row, ``unit`` numbering them for people: line or row) -> rows, every bound checked."""
    if len(records) > limits.max_batch_rows:
        raise InvalidInputError(f"the input has more than {limits.max_batch_rows} rows "
                                f"({env_name('max_batch_rows')}); split it into several batches", "input")
    for i, record in enumerate(records, 1):
        if not isinstance(record, dict):
            raise InvalidInputError(f"{unit} {i} must be a JSON object", "input")
        if any(len(v) > limits.max_batch_field_chars for v in map(str, record.values())):
            raise _field_too_long(i, unit, limits)
    unknown = sorted({str(k) for r in records for k in r} - set(COLUMNS))
    if unknown:
        raise InvalidInputError(f"unknown column(s) {', '.join(unknown)}; use {', '.join(COLUMNS)}", "input")
    if not records:
        raise InvalidInputError("the input has no rows", "input")
    rows = [Row(i, {k: "" if v is None else str(v).strip() for k, v in r.items()}) for i, r in enumerate(records, 1)]
    for row in rows:
        if row.values.get("precision", "") not in ("", *PRECISION_CHOICES):
            raise InvalidInputError(f"{unit} {row.number}: precision must be one of "
                                    f"{', '.join(PRECISION_CHOICES)} (empty: the run's own), got "
                                    f"{row.values['precision']!r}", "precision")
    return rows


def by_precision(rows: list[Row], default: str) -> list[Row]:
    """``rows`` grouped by precision for the batch CLI, which loads one model per group: an empty precision is
    ``default`` (written into the row, so the job says what each row asked for), the groups in the order the
    file first names them, the file's order within each."""
    named = [Row(r.number, {**r.values, "precision": r.values.get("precision") or default}) for r in rows]
    order = {name: i for i, name in enumerate(dict.fromkeys(r.values["precision"] for r in named))}
    return sorted(named, key=lambda r: order[r.values["precision"]])


def check_precision(service: TTSService, precision: str) -> None:
    """A row asking for another precision than ``service`` runs is refused: a server runs one model, and a take
    is never made at another precision than its row names."""
    plan = service.precision
    if precision and not plan.runs(precision):
        raise InvalidInputError(f"precision {precision} was asked for, but this server runs {plan.label}; a server "
                                "runs one model: run a file of several precisions with the batch CLI (python -m "
                                "cosyvoice.tools.batch), which loads a model per precision", "precision")


def check_precisions(service: TTSService, rows: list[Row]) -> None:
    """Before a server queues ``rows``: the first whose precision ``service`` does not run is refused by number."""
    for row in rows:
        try:
            check_precision(service, row.values.get("precision", ""))
        except InvalidInputError as exc:
            raise InvalidInputError(f"row {row.number}: {exc}", exc.field) from None


def serving(service: TTSService) -> Services:
    """A server's one model as the :data:`Services` of its batches: rows naming another precision fail (a batch
    queued elsewhere and resumed here, say), the others run on ``service``."""
    def services(precision: str) -> TTSService:
        check_precision(service, precision)
        return service

    return services


def row_request(row: Row, resolve_audio: Callable[[str], Path] | None) -> SynthesisRequest:
    """A row as a service request (the service draws a seed if the row has none); errors name the row's column."""
    v = row.values
    mode = v.get("mode") or ("instruct" if v.get("instruction") else "sft" if v.get("voice") else
                             "zero_shot" if v.get("prompt_text") else "cross_lingual")
    try:
        seed = int(v["seed"]) if v.get("seed") else None
    except ValueError as exc:
        raise InvalidInputError(f"seed must be a whole number, got {v['seed']!r}", "seed") from exc
    try:
        speed = float(v["speed"]) if v.get("speed") else 1.0
    except ValueError as exc:
        raise InvalidInputError(f"speed must be a number, got {v['speed']!r}", "speed") from exc
    try:
        steps = int(v["steps"]) if v.get("steps") else None
    except ValueError as exc:
        raise InvalidInputError(f"steps must be a whole number, got {v['steps']!r}", "steps") from exc
    try:
        first_hop = int(v["first_hop"]) if v.get("first_hop") else None
    except ValueError as exc:
        raise InvalidInputError(f"first_hop must be a whole number of speech tokens, got {v['first_hop']!r}",
                                "first_hop") from exc
    audio = None
    if v.get("prompt_audio"):
        if resolve_audio is None:
            raise InvalidInputError("prompt_audio paths are not accepted here; save the voice and name it in "
                                    "'voice'", "prompt_audio")
        audio = resolve_audio(v["prompt_audio"])
    return SynthesisRequest(text=v.get("text", ""), mode=mode, voice=v.get("voice") or None, prompt_audio=audio,
                            transcript=v.get("prompt_text", ""), instruction=v.get("instruction", ""), speed=speed,
                            seed=seed, steps=steps, final=v.get("final") or None, first_hop=first_hop, stream=False,
                            format="wav")


def submit_batch(jobs: JobRunner, store: TakeStore, rows: list[Row], *, source: str = "",
                 owner: str | None = None, listener: Callable[[Job, str, str | None], None] | None = None) -> str:
    """Queue ``rows`` (from :func:`parse_rows`, which bounds their number) as one job of the runner (its id is
    the batch's)."""
    batch_id = store.start_batch(source, len(rows), owner)
    jobs.submit(KIND, batch_id, {"rows": [[r.number, r.values] for r in rows]}, total=len(rows), units=len(rows),
                owner=owner, job_id=batch_id, listener=listener)
    return batch_id


def batch_kind(service: TTSService | Services, store: TakeStore,
               resolve_audio: Callable[[str], Path] | None = None) -> Kind:
    """How a batch job's rows become tasks, for :meth:`JobRunner.register`, each made by the service of its
    precision (one service: :func:`serving`). A row whose take is in the store already (made just before a
    crash) is not made again."""
    services = serving(service) if isinstance(service, TTSService) else service

    def tasks(job: Job) -> Iterator[Task]:
        rows = [Row(number, values) for number, values in job.params["rows"]]
        made = {t.row for t in store.takes(batch=job.id, limit=len(rows) + 1)}
        software = software_version()
        for row in rows:
            run = _kept if row.number in made else functools.partial(
                _run_row, services, store, row, job.id, job.owner, resolve_audio, software)
            yield Task(str(row.number), 1.0, run)

    return tasks


def batch_status(jobs: JobRunner, store: TakeStore, batch_id: str) -> dict[str, Any]:
    """A batch as its page polls it: its record, its job's state, counts and ETA, and each failed row."""
    job = jobs.job(batch_id)
    errors = [RowError(int(e["item"]), e["field"], e["message"]).json() for e in jobs.errors(batch_id)]
    return {**store.batch(batch_id), "state": job.state.value, "done": job.done, "failed": job.failed,
            "eta_seconds": job.eta_seconds, "error": job.error, "finished": job.finished, "errors": errors}


def run_batch(service: TTSService | Services, store: TakeStore, rows: list[Row], *, source: str = "",
              owner: str | None = None, resolve_audio: Callable[[str], Path] | None = None,
              on_progress: Callable[[Progress], None] | None = None) -> BatchResult:
    """Run a batch in this process to its end (the CLI): the job runner of the store's folder makes each row,
    one after another in the order of ``rows``, storing each take as soon as it is made."""
    limits = service.limits if isinstance(service, TTSService) else Limits.from_env()
    jobs = runner(store.root, limits.job_workers)
    try:
        jobs.register(KIND, batch_kind(service, store, resolve_audio))
        started = time.perf_counter()

        def listener(job: Job, item: str, error: str | None) -> None:
            if on_progress is not None:
                on_progress(Progress(job.done, job.failed, job.total, time.perf_counter() - started,
                                     job.eta_seconds, int(item), error))

        batch_id = submit_batch(jobs, store, rows, source=source,
                                owner=owner, listener=listener)
        job = jobs.wait(batch_id)
        errors = [RowError(int(e["item"]), e["field"], e["message"]) for e in jobs.errors(batch_id, len(rows))]
    finally:
        release(jobs)
    return BatchResult(batch_id, job.state, job.error, store.takes(batch=batch_id, limit=len(rows) + 1), errors)


def _kept(token: CancelToken) -> None:
    """A row whose take exists already: nothing to make."""


def _run_row(services: Services, store: TakeStore, row: Row, batch_id: str, owner: str | None,
             resolve_audio: Callable[[str], Path] | None, software: str, token: CancelToken) -> Take:
    request = row_request(row, resolve_audio)
    service = services(row.values.get("precision", ""))
    model_id = bundle_digest(service.model_dir)
    made = synthesize(service, request, token, owner)  # the batch's owner's voices
    return keep_take(store, service, request, made.prepared, made.pcm, made.timings, model_id=model_id,
                     software=software, label=row.values.get("label", ""), owner=owner, batch=batch_id, row=row.number)


