"""The Gradio web UI: forms in, service calls out, audio to the browser. No model logic here.

One :class:`Studio` (the engine, the voice library, the live-audio hub) serves every browser session. A
take runs as a Gradio event (so the queue, Stop and the status line are Gradio's), while its audio goes to
the page's Web Audio player over ``app.live`` as it is made. Invalid input becomes a warning toast on the
page (never an error badge over other controls); the named API endpoints raise plain-text errors instead.
"""

from __future__ import annotations

import contextlib
import html
import json
import logging
import queue
import re
import secrets
import shutil
import sqlite3
import tempfile
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import gradio as gr
import numpy as np
from starlette.middleware import Middleware

from app.auth import KeyGate, owner_dependency
from app.i18n import I18N, say, service_detail, t
from app.live import LiveHub, head_html, mount
from cosyvoice.bundle import DEMO_MODEL_DIR
from cosyvoice.context import StudioContext
from cosyvoice.encoding import audio_format, encode_audio, to_pcm16
from cosyvoice.engine import AudioChunk
from cosyvoice.errors import (
    AlreadyExistsError,
    CosyVoiceError,
    InvalidInputError,
    PermissionDeniedError,
    ReadOnlyError,
    ResourceLimitError,
)
from cosyvoice.owners import LOCAL, Caller, Owners
from cosyvoice.server.longform import longform_router
from cosyvoice.server.workbench import rater_route, workbench_router
from cosyvoice.service import SEED_DRAWS, PreparedRequest, SynthesisRequest, SynthesisSession, TTSService, draw_seed
from cosyvoice.settings import FLOW_STEPS_RANGE, SPEED_RANGE, ServerSettings, default_voice_dir
from cosyvoice.takes.provenance import provenance
from cosyvoice.takes.store import Take as StoredTake
from cosyvoice.takes.store import TakeStore
from cosyvoice.tools.make_tiny_bundle import model_dir_or_demo
from cosyvoice.voices import BUILTIN_VOICE_DIR, EXPORT_SUFFIX

logger = logging.getLogger(__name__)

HISTORY_JS = Path(__file__).with_name("history.js")
MODES = ("zero_shot", "cross_lingual", "instruct2")
DOWNLOAD_FORMATS = ("wav", "mp3", "flac", "opus")
MAX_SEED = SEED_DRAWS - 1  # the largest seed a JavaScript number holds exactly
FILE_LIFETIME_SECONDS = 86400  # takes, exports and ZIPs stay downloadable this long (also Gradio's cache)
KEEP_TAKE_TIMES = 1024  # server times of recent takes, for measurements
# Gradio refuses bigger uploads with its own size message; up to this multiple of the service's byte limit the
# file reaches the service, which says what is wrong with it (e.g. a 57 MB WAV: too long, not too big)
UPLOAD_HEADROOM = 2
KEYLESS = Owners()  # how visitors of a server without keys are told apart: their browser, else their page
# the form's tab of each engine mode (a take's provenance names the engine mode: sft takes ran as one of them)
TAB_OF_ENGINE_MODE = {"zero_shot": "zero_shot", "cross_lingual": "cross_lingual", "instruct2": "instruct2"}

try:  # a Hugging Face ZeroGPU Space: the GPU is attached per call to the functions wrapped by spaces.GPU
    import spaces
except ImportError:
    spaces = None


@dataclass
class GpuSession:
    """A synthesis session on ZeroGPU: the chunks are made inside a ``spaces.GPU`` generator (a process that
    holds the GPU) and come back here, where they are published as usual. Same surface as the service's
    session: iterate, ``cancel()`` (the engine stops within one LLM step), ``close()``."""

    prepared: Any
    chunks: Iterator[AudioChunk]
    cancelled: threading.Event = field(default_factory=threading.Event)

    def __iter__(self) -> Iterator[AudioChunk]:
        for chunk in self.chunks:
            if self.cancelled.is_set():
                return
            yield chunk

    def cancel(self) -> None:
        self.cancelled.set()

    def close(self) -> None:
        self.chunks.close()


def _gpu_chunks(service: TTSService, request: SynthesisRequest, owner: str | None) -> Iterator[AudioChunk]:
    with contextlib.closing(service.synthesize(request, owner=owner)) as session:
        yield from session


if spaces is not None:
    _gpu_chunks = spaces.GPU(duration=120)(_gpu_chunks)


# ----------------------------------------------------------------------------- takes


@dataclass
class TakeTimes:
    """Server-side wall-clock times of a take (epoch seconds), kept for measurements and the tests."""

    start: float
    first_chunk: float | None = None
    finished: float | None = None
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (time, samples) per chunk


def owner_of(request: gr.Request | None) -> str | None:
    """Who asks (:mod:`cosyvoice.owners`): the API key's owner when the app has keys (Gradio's ``username``, set by
    :mod:`app.auth`), else this browser (its ``cv-browser`` cookie, which app/history.js sets, so a visitor's takes
    and uploads survive a reload), else this page load; None for direct Python calls (unrestricted)."""
    if request is None:
        return None
    if request.username:
        return request.username
    caller = KEYLESS.identify(cookies=getattr(request, "cookies", None) or {}, session=request.session_hash)
    assert caller is not None, "a server without keys identifies everyone"
    return caller.owner


def is_zh(request: gr.Request | None) -> bool:
    """Whether the browser asks for Chinese first (as Gradio's I18n picks the page's labels)."""
    headers = getattr(request, "headers", None) or {}
    languages = headers.get("accept-language", "")
    return languages.strip().lower().startswith("zh")


def _quoted_name(message: str) -> str:
    """The name quoted in a library message ("a voice named 'X' exists already")."""
    match = re.search(r"named (['\"])(.+?)\1", message)
    return match.group(2) if match else ""


SETTING = re.compile(r"\s*\([^()]*\bCOSYVOICE_[A-Z_]+[^()]*\)|\s*(?:or )?raise COSYVOICE_[A-Z_]+")


def for_visitors(message: str) -> str:
    """A message without the server settings it names: they are the operator's business, not the visitor's."""
    return SETTING.sub("", message)


def _page_message(exc: CosyVoiceError, zh: bool = False) -> str:
    detail = service_detail(for_visitors(str(exc)), zh)
    if isinstance(exc, ResourceLimitError):
        return say(zh, "busy", detail=detail)
    if isinstance(exc, PermissionDeniedError):
        return say(zh, "denied", detail=detail)
    if isinstance(exc, InvalidInputError):
        return say(zh, "invalid", detail=detail)
    return say(zh, "model", detail=detail)


def warn(message: str) -> None:
    """A warning toast on the page (HTML-escaped: messages may quote ``<|endofprompt|>``)."""
    gr.Warning(html.escape(message))


def _whole(value: float | None) -> int | float | None:
    """A Gradio number as the integer it stands for; anything else goes to the service, which refuses it by name."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# ----------------------------------------------------------------------------- the shared state and handlers


@dataclass
class Studio:
    """What all browser sessions share: the process's context (the service: engine + voice library; the take store
    that keeps every take, the history of each browser; who visitors are and what they see) and one live-audio
    hub."""

    context: StudioContext
    demo: bool = False
    live: LiveHub = field(default_factory=LiveHub)
    times: dict[str, TakeTimes] = field(default_factory=dict)
    _running: dict[str, tuple[SynthesisSession | GpuSession, queue.Queue]] = field(default_factory=dict)
    _stopped_early: set[str] = field(default_factory=set)  # Stop clicked while the take was still queued
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _files: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="cosyvoice-takes-")))
    service: TTSService = field(init=False)

    def __post_init__(self) -> None:
        self.service = self.context.service()

    @property
    def store(self) -> TakeStore:
        """The take store (the workbench pages serve the same)."""
        return self.context.takes

    @property
    def owners(self) -> Owners:
        return self.context.owners

    def _folder(self) -> Path:
        """A new folder for files handed to the page; those older than a day go (as Gradio's own cache)."""
        cutoff = time.time() - FILE_LIFETIME_SECONDS
        for old in self._files.iterdir():
            if old.stat().st_mtime < cutoff:
                shutil.rmtree(old, ignore_errors=True)
        return Path(tempfile.mkdtemp(dir=self._files))

    # ------------------------------------------------------------------ voices (all through the service)

    def voice_choices(self, owner: str | None, zh: bool = False, uploads: bool = True) -> list[tuple[str, str]]:
        """Dropdown (label, voice id) pairs: built-ins, saved voices by name, then this visitor's own uploads."""
        return [(say(zh, "builtin", label=i.label) if i.builtin else i.label, i.id)
                for i in self.service.list_voices(owner=owner, include_uploads=uploads)]

    def voice_dropdown(self, selected: str | None = None, request: gr.Request | None = None) -> dict:
        choices = self.voice_choices(owner_of(request), is_zh(request))
        return gr.update(choices=choices, value=selected if selected in {v for _, v in choices} else None)

    def visitor_voices(self, request: gr.Request | None = None) -> dict:
        """The page load's list for this visitor, leaving the selection alone: a voice picked from the page's
        first list while this answer was on its way (a slow server) stays picked."""
        return gr.update(choices=self.voice_choices(owner_of(request), is_zh(request)))

    @staticmethod
    def _upload(path: str | None, zh: bool = False) -> str | None:
        """A recording Gradio stored for this page; a vanished file gets a message without its server path."""
        if path and not Path(path).is_file():
            raise InvalidInputError(say(zh, "expired"))
        return path or None

    def check_upload(self, path: str | None, request: gr.Request | None = None) -> Any:
        """Check a prompt as soon as it is uploaded or recorded (the service decodes it, from the header on):
        a bad one is removed with a message."""
        if not path:
            return gr.skip()
        zh = is_zh(request)
        try:
            self.service.check_prompt(self._upload(path, zh))
        except CosyVoiceError as exc:
            warn(say(zh, "unusable", detail=for_visitors(str(exc))))
            return None
        return gr.skip()

    def preview(self, key: str | None, request: gr.Request | None = None) -> Any:
        if not key:
            return None
        try:
            return self.service.voice_recording(key, owner=owner_of(request))
        except CosyVoiceError as exc:
            warn(_page_message(exc, is_zh(request)))
            return None

    def save_voice(self, name: str, prompt: str | None, transcript: str, request: gr.Request | None = None) -> dict:
        """Save the uploaded recording (with the transcript, if typed); the dropdown picks it."""
        zh = is_zh(request)
        try:
            if not prompt:
                raise InvalidInputError(say(zh, "need_prompt"))
            if not (name or "").strip():
                raise InvalidInputError(say(zh, "need_name"))
            info = self.service.create_voice(name, self._upload(prompt, zh), transcript or "",
                                             owner=owner_of(request))
        except CosyVoiceError as exc:
            warn(_page_message(exc, zh))
            return gr.skip()
        gr.Info(html.escape(say(zh, "saved" if info.transcript else "saved_no_transcript", name=info.name)))
        return self.voice_dropdown(info.id, request)

    def rename_voice(self, key: str | None, new_name: str, request: gr.Request | None = None) -> dict:
        zh = is_zh(request)
        try:
            if not key:
                raise InvalidInputError(say(zh, "pick_rename"))
            info = self.service.rename_voice(key, new_name or "", owner=owner_of(request))
        except CosyVoiceError as exc:
            warn(_page_message(exc, zh))
            return gr.skip()
        gr.Info(html.escape(say(zh, "renamed", name=info.name)))
        return self.voice_dropdown(info.id, request)

    def export_voice(self, key: str | None, request: gr.Request | None = None) -> Any:
        zh = is_zh(request)
        try:
            if not key:
                raise InvalidInputError(say(zh, "pick_export"))
            name, data = self.service.export_voice(key, owner=owner_of(request))
        except CosyVoiceError as exc:
            warn(_page_message(exc, zh))
            return gr.skip()
        path = Path(self._folder()) / name
        path.write_bytes(data)
        return str(path)

    def import_voice(self, path: str | None, name: str = "", request: gr.Request | None = None) -> tuple:
        """Import an exported voice file: (dropdown, the file input, the "import as" name, its Import button).

        A name that is taken keeps the file and shows a field for another name (never a dead end)."""
        hidden = gr.update(visible=False, value="")
        if not path:
            return gr.skip(), gr.skip(), hidden, gr.update(visible=False)
        zh = is_zh(request)
        try:
            if not str(path).endswith(EXPORT_SUFFIX.split(".")[-1]):
                raise InvalidInputError(say(zh, "not_voice_file", suffix=EXPORT_SUFFIX))
            info = self.service.import_voice(Path(path).read_bytes(), (name or "").strip() or None,
                                             owner=owner_of(request))
        except AlreadyExistsError as exc:
            if exc.field != "name":  # the voice itself is saved already (under another name)
                warn(_page_message(exc, zh))
                return gr.skip(), None, hidden, gr.update(visible=False)
            warn(say(zh, "name_taken", name=(name or "").strip() or _quoted_name(str(exc))))
            return gr.skip(), gr.skip(), gr.update(visible=True), gr.update(visible=True)
        except CosyVoiceError as exc:
            warn(_page_message(exc, zh))
            return gr.skip(), None, hidden, gr.update(visible=False)
        gr.Info(html.escape(say(zh, "imported", name=info.name)))
        return self.voice_dropdown(info.id, request), None, hidden, gr.update(visible=False)

    def ask_delete(self, key: str | None, request: gr.Request | None = None) -> tuple:
        """First step of Delete: show the confirmation row naming the voice."""
        zh = is_zh(request)
        try:
            if not key:
                raise InvalidInputError(say(zh, "pick_delete"))
            info = self.service.deletable_voice(key, owner=owner_of(request))
        except CosyVoiceError as exc:
            warn(_page_message(exc, zh))
            return gr.skip(), gr.skip()
        return gr.update(visible=True), say(zh, "ask_delete", name=html.escape(info.label))

    def delete_voice(self, key: str | None, request: gr.Request | None = None) -> tuple:
        zh = is_zh(request)
        try:
            if not key:
                raise InvalidInputError(say(zh, "pick_delete"))
            info = self.service.delete_voice(key, owner=owner_of(request))
        except CosyVoiceError as exc:
            warn(_page_message(exc, zh))
            return gr.skip(), gr.update(visible=False), None
        gr.Info(html.escape(say(zh, "deleted", name=info.label)))
        return self.voice_dropdown(None, request), gr.update(visible=False), None

    # ------------------------------------------------------------------ synthesis

    def _start(self, mode: str, text: str, prompt: str | None, transcript: str, instruction: str,
               voice_key: str | None, seed: int | None, speed: float, stream: bool, fmt: str = "wav",
               request: gr.Request | None = None, steps: int | None = None, final: str | None = None,
               first_hop: int | None = None) -> tuple[SynthesisSession | GpuSession, SynthesisRequest, str]:
        """Validate and start a request through the service: (session, the request, voice description).
        ``final`` and ``first_hop``: the chunk schedule (None: the reference's), checked by the service.

        A take without a seed gets the service's (``session.seed``), which every take shows to reproduce it."""
        owner, zh = owner_of(request), is_zh(request)
        if seed is not None and seed > MAX_SEED:  # the page's number field holds no larger integer exactly
            raise InvalidInputError(say(zh, "seed_range", high=MAX_SEED), "seed")
        prompt = None if voice_key else self._upload(prompt, zh)
        synthesis = SynthesisRequest(
            text=text, mode=mode, voice=voice_key or None, prompt_audio=prompt,
            transcript=transcript or "", instruction=instruction or "", speed=float(speed),
            seed=None if seed is None or seed < 0 else int(seed), steps=steps, final=final or None,
            first_hop=first_hop, stream=bool(stream), format=fmt)
        try:
            if spaces is None:
                session = self.service.synthesize(synthesis, owner=owner)
            else:  # errors before any GPU time; the GPU process then finds the voice in the library's cache
                prepared = self.service.prepare(synthesis)
                synthesis = replace(synthesis, seed=prepared.seed)  # one draw: the GPU process uses it
                session = GpuSession(prepared, _gpu_chunks(self.service, synthesis, owner))
        except InvalidInputError as exc:
            if exc.field == "voice" and not voice_key and not prompt:  # say it in the page's words
                limits = self.service.limits
                message = say(zh, "need_voice", low=limits.min_prompt_seconds, high=limits.max_prompt_seconds)
                raise InvalidInputError(message, "voice") from exc
            raise
        if stream and not session.prepared.stream:
            warn(say(zh, "speed_not_streamed"))
        voice = (self.service.get_voice(session.prepared.voice_id, owner=owner).label if voice_key
                 else say(zh, "uploaded_recording"))
        return session, synthesis, voice

    def _pump(self, session: SynthesisSession | GpuSession, take_id: str, events: queue.Queue) -> None:
        """Run one take in its own thread: chunks to the live channel and to the Gradio handler. A cancelled
        session's engine work stops within one LLM step (closing it frees the slot), whether or not Gradio
        still reads ``events``."""
        times = self.times[take_id]
        channel = self.live.channel(take_id)
        try:
            with contextlib.closing(session):
                for chunk in session:
                    now = time.time()
                    times.first_chunk = times.first_chunk or now
                    times.chunks.append((now, chunk.pcm.numel()))
                    channel.put(to_pcm16(chunk.pcm).tobytes())
                    events.put(("chunk", chunk.pcm.numpy()))
            events.put(("done", None))
        except BaseException as exc:  # handed to the handler, which reports it
            events.put(("error", exc))
        finally:
            times.finished = time.time()
            self.live.finish(take_id)
            with self._lock:
                self._running.pop(take_id, None)

    def _run(self, take_id: str, session: SynthesisSession | GpuSession) -> Iterator[tuple[str, Any]]:
        """Events of one take: ("chunk", float samples) ..., then ("done" | "stopped" | "error", detail)."""
        events: queue.Queue = queue.Queue()
        with self._lock:
            stopped = take_id in self._stopped_early  # Stop came while the request was being prepared
            self._stopped_early.discard(take_id)
            if not stopped:
                self._running[take_id] = (session, events)
        if stopped:
            session.close()
            self.times[take_id].finished = time.time()
            self.live.finish(take_id)
            yield "stopped", None
            return
        threading.Thread(target=self._pump, args=(session, take_id, events), daemon=True,
                         name=f"take-{take_id[:8]}").start()
        finished = False
        try:
            while True:
                kind, detail = events.get()
                finished = kind != "chunk"  # the caller stops reading after the last event
                yield kind, detail
                if finished:
                    return
        finally:
            if not finished:  # Gradio dropped the handler (a closed tab): stop the work too
                logger.info("take %s: the page went away; stopping it", take_id[:8])
                session.cancel()

    def stop(self, take_id: str) -> None:
        """Stop a take: its handler ends at once (keeping what was made) and the engine's work at its next
        chunk; a take still waiting in the queue will not start."""
        with self._lock:
            running = self._running.get(take_id)
            if running is None:
                times = self.times.get(take_id)
                if take_id and (times is None or times.finished is None):  # queued or being prepared
                    self._stopped_early.add(take_id)
                return
        session, events = running
        session.cancel()
        events.put(("stopped", None))

    @staticmethod
    def begin() -> tuple:
        """The Generate click, at once (not queued): lock Generate, unlock Stop, also while the take waits."""
        return gr.update(interactive=False), gr.update(interactive=True)

    def history(self, request: gr.Request | None) -> list[dict]:
        """The takes of this browser (:func:`history_owner`), newest first, as the page and the ZIP describe them."""
        owner = owner_of(request)
        takes = self.store.takes(owner=owner, any_owner=False, single=True, limit=1_000_000)
        return [self._entry(number, take) for number, take in reversed(list(enumerate(takes, 1)))]

    def _entry(self, number: int, take: StoredTake) -> dict:
        p = take.provenance
        settings = p.get("settings", {})
        return {"number": number, "id": take.id, "file": str(self.store.audio_path(take)), "text": p.get("text", ""),
                "voice": p.get("voice_label") or p.get("voice") or p.get("voice_id", ""),
                "mode": p.get("form_mode") or p.get("mode", ""), "seed": p.get("seed"), "speed": p.get("speed", 1.0),
                "stream": bool(settings.get("stream")), "format": settings.get("format", "wav"),
                "seconds": round(take.seconds, 3), "first_audio": p.get("timings", {}).get("first_chunk_seconds"),
                "wall": p.get("timings", {}).get("synthesis_seconds"), "stopped": bool(p.get("stopped")),
                "created": take.created, "provenance": p}

    def generate(self, take_id: str, mode: str, text: str, prompt: str | None, transcript: str, instruction: str,
                 voice_key: str | None, seed: float | None, speed: float, stream: bool, fmt: str,
                 request: gr.Request | None = None, steps: float | None = None, final: str | None = None,
                 first_hop: float | None = None) -> Iterator[tuple]:
        """The page's Generate: yields (status, download, number of takes, generate button, stop button). Gradio
        puts ``request`` in its place and the form's inputs around it, so the advanced settings (``steps``,
        ``final``, ``first_hop``: the last inputs) come last."""
        take_id = take_id or secrets.token_hex(8)
        with self._lock:
            self.times[take_id] = TakeTimes(start=time.time())
            while len(self.times) > KEEP_TAKE_TIMES:  # the oldest go first (dicts keep insertion order)
                del self.times[next(iter(self.times))]
        idle, zh = self.idle(), is_zh(request)
        with self._lock:
            stopped_early = take_id in self._stopped_early
            self._stopped_early.discard(take_id)
        if stopped_early:
            self.times[take_id].finished = time.time()
            self.live.finish(take_id)
            yield say(zh, "stopped_before"), gr.skip(), gr.skip(), *idle
            return
        try:
            session, synthesis, voice = self._start(mode, text, prompt, transcript, instruction, voice_key,
                                                    None if seed is None else int(seed), speed, stream, fmt, request,
                                                    _whole(steps), final, _whole(first_hop))
        except CosyVoiceError as exc:
            self.times[take_id].finished = time.time()
            with self._lock:
                self._stopped_early.discard(take_id)
            self.live.finish(take_id)
            warn(_page_message(exc, zh))
            yield "", gr.skip(), gr.skip(), *idle
            return
        prepared = session.prepared
        used_seed = prepared.seed
        pieces: list[np.ndarray] = []
        start = time.perf_counter()
        first_audio = None
        outcome, detail = "done", None
        for outcome, detail in self._run(take_id, session):
            if outcome != "chunk":
                break
            first_audio = first_audio if first_audio is not None else time.perf_counter() - start
            pieces.append(detail)
            made = sum(p.size for p in pieces) / self.service.sample_rate
            yield say(zh, "generating", seconds=made, seed=used_seed), gr.skip(), gr.skip(), gr.skip(), gr.skip()
        wall = time.perf_counter() - start
        if outcome == "error":
            if isinstance(detail, CosyVoiceError):
                warn(_page_message(detail, zh))
            else:
                logger.error("take %s failed", take_id, exc_info=detail)
                warn(say(zh, "failed"))
            if not pieces:
                yield "", gr.skip(), gr.skip(), *idle
                return
        if not pieces:
            yield say(zh, "stopped" if outcome == "stopped" else "no_audio"), gr.skip(), gr.skip(), *idle
            return
        samples = np.concatenate(pieces)
        stopped = outcome != "done"
        owner = owner_of(request)
        timings = {"synthesis_seconds": wall, "first_chunk_seconds": first_audio}
        download_format = audio_format(fmt if fmt in DOWNLOAD_FORMATS else "wav").name
        try:
            kept = self._keep(samples, synthesis, prepared, timings, download_format, owner, form_mode=mode,
                              voice_label=voice, **({"stopped": True} if stopped else {}))
            number = self.store.count_takes(owner, upto=kept.seq)
        except ReadOnlyError:  # a read-only data folder (said once in the log at start): downloadable below
            warn(say(zh, "not_kept_read_only"))
            number = None
        except (OSError, sqlite3.Error) as exc:  # e.g. a full disk: the take is still downloadable below
            logger.error("take %s could not be kept in the history: %s", take_id, exc)
            warn(say(zh, "not_kept"))
            number = None
        download = self._download(number, samples, download_format, used_seed)
        # what was heard, and when, is the player's to say (the line above): the server only knows what it made
        status = (say(zh, "take_done", number=number or "?", seconds=samples.size / self.service.sample_rate, wall=wall)
                  + say(zh, "seed_voice", seed=used_seed, voice=voice)
                  + (say(zh, "stopped_mark") if stopped else ""))
        yield status, gr.update(value=str(download), visible=True), gr.skip() if number is None else number, *idle

    def _keep(self, samples: np.ndarray, synthesis: SynthesisRequest, prepared: PreparedRequest,
              timings: dict[str, float | None], fmt: str, owner: str | None, **form: Any) -> StoredTake:
        """Store a take with a batch take's provenance, its download format ``fmt``, and what the page's form
        said (``form``)."""
        record = provenance(self.service, synthesis, prepared, samples.size, timings)
        record["settings"]["format"] = fmt
        record.update(form)
        return self.store.add_take(samples, self.service.sample_rate, record, owner=owner)

    def _download(self, number: int | None, samples: np.ndarray, fmt: str, seed: int) -> Path:
        """A take encoded in its download format, under a name that says what it is (its number in the history,
        when it is in the history)."""
        audio = audio_format(fmt)
        path = self._folder() / f"take-{'' if number is None else f'{number}-'}seed{seed}.{audio.extension}"
        path.write_bytes(encode_audio(samples, audio, self.service.sample_rate))
        return path

    def history_zip(self, request: gr.Request | None = None) -> str | None:
        """This browser's takes as one ZIP, made when asked for: every take in the format it was made for, plus
        takes.json (text, voice, mode, seed, settings, and each take's whole provenance)."""
        history = self.history(request)
        if not history:
            return None
        path = self._folder() / f"cosyvoice-takes-{len(history)}.zip"
        described = []
        with zipfile.ZipFile(path, "w") as archive:
            for entry in history:
                take = self.store.take(entry["id"])
                audio = audio_format(entry["format"])
                name = f"take-{entry['number']}-seed{entry['seed']}.{audio.extension}"
                archive.writestr(name, encode_audio(self.store.read_audio(take), audio, take.sample_rate))
                described.append({**entry, "file": name})
            archive.writestr("takes.json", json.dumps(described, ensure_ascii=False, indent=2))
        return str(path)

    def open_take(self, take_id: str, request: gr.Request | None = None) -> tuple:
        """"Use these settings" on any take in the store (this browser's, a batch's, the API's): its text, mode,
        instruction, voice, seed, speed, flow steps, chunk schedule and streaming go back in the form, to reproduce
        or vary it. Returns (text, mode, tabs, instruction, voice, seed, speed, steps, stream, final, first_hop)."""
        zh = is_zh(request)
        skip = (gr.skip(),) * 11
        try:
            take = self.store.take(take_id or "", self.caller(request))
        except CosyVoiceError as exc:
            warn(_page_message(exc, zh))
            return skip
        p = take.provenance
        tab = TAB_OF_ENGINE_MODE.get(p.get("engine_mode", ""), "zero_shot")
        voice: Any = gr.skip()
        if p.get("voice_id") in {key for _, key in self.voice_choices(owner_of(request), zh)}:
            voice = gr.update(value=p["voice_id"])
        else:  # an unsaved upload of another visitor, or a voice deleted since
            warn(say(zh, "voice_gone"))
        return (p.get("text", ""), tab, gr.Tabs(selected=tab), p.get("instruction", ""), voice, p.get("seed", -1),
                p.get("speed", 1.0), p.get("steps") or self.service.default_steps,
                bool(p.get("settings", {}).get("stream")), p.get("final") or "full", p.get("first_hop"))

    def caller(self, request: gr.Request | None) -> Caller:
        """The visitor as :mod:`cosyvoice.owners` sees it (direct Python calls: the local, unrestricted caller)."""
        owner = owner_of(request)
        return LOCAL if owner is None else self.owners.of(owner)

    def stop_clicked(self, take_id: str) -> tuple:
        self.stop(take_id)
        return self.idle()

    @staticmethod
    def idle() -> tuple:
        """Generate unlocked, Stop locked: after every take, however it ended (even by a bug)."""
        return gr.update(interactive=True), gr.update(interactive=False)

    # ------------------------------------------------------------------ the named API

    def api_synthesize(self, text: str, mode: str | None = None, voice: str | None = None,
                       prompt_audio: str | None = None, prompt_text: str | None = None,
                       instruction: str | None = None, seed: float | None = None, speed: float | None = None,
                       format: str | None = None, steps: float | None = None,
                       request: gr.Request | None = None, final: str | None = None,
                       first_hop: float | None = None) -> str:
        """One whole take as a file (``format``: wav, mp3, flac or opus); plain-text errors.

        ``mode``: zero_shot (default), cross_lingual or instruct2; ``voice``: a voice's name or id, looked up at
        call time, else ``prompt_audio`` (+ ``prompt_text``, its transcript, for zero_shot); ``seed`` -1 or
        None: random; ``steps``: the flow's Euler steps (None: the model's); ``final`` (full or chunked) and
        ``first_hop`` (speech tokens of the first chunk): the chunk schedule (None: the reference's)."""
        try:
            if (format or "wav") not in DOWNLOAD_FORMATS:
                raise InvalidInputError(f"format must be one of {', '.join(DOWNLOAD_FORMATS)}, got {format!r}")
            session, synthesis, voice_label = self._start(
                mode or "zero_shot", text, prompt_audio, prompt_text or "", instruction or "", voice or None,
                None if seed is None else int(seed), 1.0 if speed is None else float(speed), False, format or "wav",
                request, _whole(steps), final, _whole(first_hop))
            audio, prepared = session.prepared.format, session.prepared
            started = time.perf_counter()
            with contextlib.closing(session):
                pieces = [c.pcm.numpy() for c in session]
        except CosyVoiceError as exc:
            raise gr.Error(_page_message(exc), print_exception=False) from exc
        samples = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
        timings = {"synthesis_seconds": time.perf_counter() - started, "first_chunk_seconds": None}
        try:  # the page's "All takes" lists it: an API take can be opened, replayed and reproduced there
            self._keep(samples, synthesis, prepared, timings, audio.name,
                       owner_of(request), form_mode=mode or "zero_shot",
                       voice_label=voice_label)
        except (OSError, sqlite3.Error) as exc:
            logger.error("an API take could not be kept: %s", exc)
        path = self._folder() / f"cosyvoice-seed{prepared.seed}.{audio.extension}"
        path.write_bytes(encode_audio(samples, audio, self.service.sample_rate))
        return str(path)

    def api_voices(self, request: gr.Request | None = None) -> list[dict]:
        """Every saved voice (built-ins first): id, name, transcript, built-in."""
        return [{"id": i.id, "name": i.name, "transcript": i.transcript, "builtin": i.builtin}
                for i in self.service.list_voices(owner=owner_of(request))]

    def api_save_voice(self, name: str, prompt_audio: str, prompt_text: str | None = None,
                       request: gr.Request | None = None) -> dict:
        """Featurise a recording (with its transcript, for zero-shot) and keep it under ``name``."""
        try:
            if not prompt_audio:
                raise InvalidInputError("prompt_audio is required")
            info = self.service.create_voice(name or "", self._upload(prompt_audio), prompt_text or "",
                                             owner=owner_of(request))
        except CosyVoiceError as exc:
            raise gr.Error(_page_message(exc), print_exception=False) from exc
        return {"id": info.id, "name": info.name, "transcript": info.transcript}


# ----------------------------------------------------------------------------- page

CSS = """
#live-player { display:flex; align-items:center; gap:8px; min-height:24px; font-size:14px; }
#live-player .live-dot { width:10px; height:10px; border-radius:50%; background:#9ca3af; }
#live-player[data-state=playing] .live-dot { background:#16a34a; }
#live-player[data-state=waiting] .live-dot { background:#f59e0b; }
#live-player[data-state=failed] { color:#b91c1c; font-weight:600; }  /* the cause, where the status is read */
#live-player[data-state=failed] .live-dot { background:#b91c1c; flex:none; }
#queue-place { font-size:14px; color:#b45309; font-weight:600; }
#queue-eta { font-size:13px; color:#b45309; }
#status { min-height:40px; }
#status > .wrap { display:none !important; }  /* Gradio's progress ("queue: 2/2"): player.js says the place */
.cv-hidden { display:none !important; }
#take-history .history-views { display:flex; gap:8px; margin-bottom:8px; }
#take-history .history-view { padding:4px 10px; border:1px solid #d1d5db; border-radius:6px; background:none; }
#take-history .history-view[aria-pressed=true] { background:#e5e7eb; font-weight:600; }
#take-history .take { border-top:1px solid #e5e7eb; padding:10px 0; }
#take-history .take-text { margin:6px 0; color:#374151; }
#take-history audio { width:100%; max-width:560px; display:block; }
#take-history .take-actions { display:flex; gap:12px; align-items:center; margin-top:6px; }
#take-history .take-actions button { padding:2px 10px; border:1px solid #d1d5db; border-radius:6px; background:none;
                                    font-size:13px; font-weight:normal; }
#take-history .history-error { color:#b91c1c; }
#demo-banner { background:#b91c1c; color:#fff; padding:12px 16px; border-radius:8px; font-weight:600; }
#demo-banner p, #demo-banner code { color:#fff; }
#demo-banner code { background:rgba(0, 0, 0, 0.25); }  /* room for the queue position while a take waits */
#char-counter { font-size:13px; color:#6b7280; margin-top:-8px; }
#char-counter-text.over { color:#b91c1c; font-weight:600; }
/* toasts at the top centre: never over the voice controls (save, manage) on the right or Generate */
.toast-wrap { top:16px !important; bottom:auto !important; left:50% !important; right:auto !important;
              transform:translateX(-50%); max-width:min(480px, calc(100vw - 32px)); }
#mic-message { color:#b91c1c; font-size:14px; padding:6px 10px; }
/* narrow screens stack the columns: the voice picker comes first, above the text and Generate */
@media (max-width: 768px) { #voice-column { order:-1; } }
/* a phone: narrower margins and tabs, so the three modes stand side by side instead of two behind "⋯" (Gradio
   measures its hidden copy of the tab buttons, which this rule narrows too) */
@media (max-width: 480px) {
  .gradio-container .main.app { padding-left:10px !important; padding-right:10px !important; }
  .tabs .tab-container button { padding-left:10px !important; padding-right:10px !important; }
}
body, .gradio-container { font-family: ui-sans-serif, system-ui, "Noto Sans", "Noto Sans CJK SC",
                          "Noto Sans CJK JP", sans-serif; }
"""

DOWNLOAD_JS = """(file) => {
  if (!file || !file.url) return;
  const link = document.createElement("a");
  link.href = file.url;
  link.download = file.orig_name || "takes.zip";
  document.body.appendChild(link);
  link.click();
  link.remove();
}"""

COUNTER_JS = """(text) => {
  const limit = %d, n = [...(text || "")].length, zh = (navigator.language || "").startsWith("zh");
  const fmt = (x) => x.toLocaleString("en-US");
  const over = n > limit;
  const msg = over
    ? (zh ? `超出 ${fmt(limit)} 字的上限 ${fmt(n - limit)} 字：请缩短或分段生成。`
          : `${fmt(n)} / ${fmt(limit)} characters: over the limit by ${fmt(n - limit)}. Shorten the text or split it.`)
    : `${fmt(n)} / ${fmt(limit)}` + (zh ? " 字" : " characters");
  return `<div id="char-counter-text" class="${over ? "over" : ""}" data-over="${over}">${msg}</div>`;
}"""


def build_ui(studio: Studio) -> gr.Blocks:
    limits = studio.service.limits
    rate = studio.service.sample_rate
    with gr.Blocks(title="CosyVoice3 Studio", analytics_enabled=False,
                   delete_cache=(3600, FILE_LIFETIME_SECONDS)) as page:
        if studio.demo:
            gr.Markdown(t("demo_banner"), elem_id="demo-banner")
        gr.Markdown("# CosyVoice3 Studio")
        gr.Markdown(t("intro"))
        gr.Markdown(t("more_tools"), elem_id="more-tools")  # the studio's other pages, served on this app
        gr.Textbox(studio.service.precision.label, label=t("precision"), interactive=False, max_lines=1,
                   info=studio.service.precision.summary or None,  # auto's measurements behind its choice
                   elem_id="precision")  # auto's choice is the server's; people comparing takes need to know it
        # no gr.State: it would make every tab hold a heartbeat connection, and browsers allow only six per
        # server; three waiting tabs would then starve each other's clicks (the takes are kept by the Studio)
        mode = gr.Textbox("zero_shot", visible=False, elem_id="mode")
        take_id = gr.Textbox(visible=False, elem_id="take-id")
        takes_count = gr.Number(0, visible=False, elem_id="takes-count")
        with gr.Row():
            with gr.Column(scale=3):
                text = gr.Textbox(label=t("text"), placeholder=t("text_placeholder"), lines=5, elem_id="text")
                counter = gr.HTML(elem_id="char-counter")
                with gr.Tabs() as tabs:
                    with gr.Tab(t("zero_shot"), id="zero_shot", elem_id="tab-zero-shot") as zero_shot_tab:
                        transcript = gr.Textbox(label=t("transcript"), lines=2, info=t("transcript_info"),
                                                elem_id="transcript")
                    with gr.Tab(t("cross_lingual"), id="cross_lingual",
                                elem_id="tab-cross-lingual") as cross_lingual_tab:
                        gr.Markdown(t("cross_lingual_note"))
                    with gr.Tab(t("instruct2"), id="instruct2", elem_id="tab-instruct") as instruct_tab:
                        instruction = gr.Textbox(label=t("instruction"), placeholder="Speak slowly and calmly.",
                                                 elem_id="instruction")
                with gr.Row():
                    stream = gr.Checkbox(True, label=t("stream"), elem_id="stream")
                    speed = gr.Slider(*SPEED_RANGE, 1.0, step=0.05, label=t("speed"), elem_id="speed")
                with gr.Row():
                    seed = gr.Number(-1, label=t("seed"), precision=0, elem_id="seed")  # range: _start's words
                    dice = gr.Button(t("dice"), size="sm", elem_id="dice")
                    fmt = gr.Dropdown([(f.upper(), f) for f in DOWNLOAD_FORMATS], value="wav", label=t("format"),
                                      elem_id="format")
                with gr.Accordion(t("advanced"), open=False, elem_id="advanced"):
                    steps = gr.Slider(*FLOW_STEPS_RANGE, studio.service.default_steps, step=1,
                                      label=t("steps"), info=t("steps_info"), elem_id="steps")
                    with gr.Row():  # the chunk schedule, for blind A/B tests of its speed against the reference's
                        final = gr.Radio([(t("final_full"), "full"), (t("final_chunked"), "chunked")], value="full",
                                         label=t("final"), info=t("final_info"), elem_id="final")
                        first_hop = gr.Number(None, precision=0, label=t("first_hop"), info=t("first_hop_info"),
                                              elem_id="first-hop")  # out of range: the service says so by name
                with gr.Row():
                    generate = gr.Button(t("generate"), variant="primary", elem_id="generate")
                    stop = gr.Button(t("stop"), variant="stop", interactive=False, elem_id="stop")
                gr.HTML('<div id="live-player" data-state="idle"><span class="live-dot"></span>'
                        '<span class="live-text"></span></div>'
                        '<div id="queue-place" role="status" aria-live="polite" hidden></div>')
                status = gr.Markdown(elem_id="status")
                download = gr.File(label=t("download"), interactive=False, visible=False, elem_id="download")
            with gr.Column(scale=2, elem_id="voice-column"):
                voice = gr.Dropdown(label=t("voice"), choices=studio.voice_choices(None, uploads=False), value=None,
                                    info=t("voice_info"), elem_id="voice")
                preview = gr.Audio(label=t("preview"), interactive=False, elem_id="preview")
                # no Download or Share buttons: their links name the server's temporary path of the upload
                prompt = gr.Audio(label=t("prompt"), sources=["upload", "microphone"], type="filepath",
                                  elem_id="prompt", buttons=[])
                with gr.Row():
                    save_as = gr.Textbox(label=t("save_as"), placeholder=t("save_placeholder"), elem_id="save-as",
                                         scale=3)
                    save = gr.Button(t("save"), size="sm", elem_id="save", scale=1)
                with gr.Accordion(t("manage"), open=False, elem_id="manage"):
                    with gr.Row():
                        new_name = gr.Textbox(label=t("rename_to"), elem_id="new-name", scale=3)
                        rename = gr.Button(t("rename"), size="sm", elem_id="rename", scale=1)
                    with gr.Row():
                        export = gr.Button(t("export"), size="sm", elem_id="export")
                        delete = gr.Button(t("delete"), size="sm", variant="stop", elem_id="delete")
                    with gr.Row(visible=False, elem_id="confirm-row") as confirm_row:
                        confirm_text = gr.Markdown()
                        confirm = gr.Button(t("confirm_delete"), size="sm", variant="stop", elem_id="confirm-delete")
                        cancel = gr.Button(t("cancel"), size="sm", elem_id="cancel-delete")
                    exported = gr.File(label=t("export_file"), interactive=False, visible=False, elem_id="exported")
                    imported = gr.File(label=t("import"), file_count="single", type="filepath", height=120,
                                       elem_id="import")
                    with gr.Row():
                        import_name = gr.Textbox(label=t("import_as"), visible=False, elem_id="import-name", scale=3)
                        import_again = gr.Button(t("import_again"), size="sm", visible=False, elem_id="import-again",
                                                 scale=1)
        with gr.Row():
            gr.Markdown(t("history"), elem_id="history-heading")
            takes_zip = gr.Button(t("download_all"), size="sm", elem_id="download-all", elem_classes="cv-hidden")
        zip_file = gr.File(visible=False, elem_id="takes-zip")
        # the history is the workbench store's, drawn by app/history.js: it fetches only takes it has not shown
        # (no earlier take's audio is fetched again) and plays each from the store when asked
        gr.HTML('<div id="take-history" data-state="loading"></div>', elem_id="history-panel")
        opened = gr.Textbox(visible=False, elem_id="opened-take")
        open_take = gr.Button(elem_id="open-take", elem_classes="cv-hidden")  # clicked by history.js
        _api(studio, limits.max_sessions)  # first, so that the endpoints get their names unsuffixed
        # -------- wiring: the page's events are private; the API is the named endpoints of _api
        private = {"api_visibility": "private"}
        # history.js shows the ZIP button once this browser has takes (a load event here would queue behind takes)
        takes_count.change(None, None, None, js="() => window.cvHistory.refresh()", **private)
        page.load(None, None, None, js="() => window.cvHistory.start()", **private)
        open_take.click(studio.open_take, opened,
                        [text, mode, tabs, instruction, voice, seed, speed, steps, stream, final, first_hop],
                        js="() => [window.cvHistory.opening]", show_progress="hidden", **private)
        takes_zip.click(studio.history_zip, None, zip_file, show_progress="hidden", **private).then(
            None, zip_file, None, js=DOWNLOAD_JS, **private)
        for tab, name in ((zero_shot_tab, "zero_shot"), (cross_lingual_tab, "cross_lingual"),
                          (instruct_tab, "instruct2")):
            tab.select(lambda name=name: name, None, mode, queue=False, **private)
        text.change(None, text, counter, js=COUNTER_JS % limits.max_text_chars, **private)
        page.load(None, text, counter, js=COUNTER_JS % limits.max_text_chars, **private)
        dice.click(draw_seed, None, seed, queue=False, **private)

        # one click, two events: the buttons change at once, and the take joins the queue straight away (its
        # place in the queue is the click's: first come, first served); the take id comes from the player
        generate.click(studio.begin, None, [generate, stop], queue=False, show_progress="hidden", **private)
        # a waiting take's place is said in words by player.js (cvQueue) from Gradio's own queue messages: Gradio's
        # progress ("queue: 2/2 | 0.6s") is hidden, and nothing covers the other controls
        running = generate.click(
            studio.generate,
            [take_id, mode, text, prompt, transcript, instruction, voice, seed, speed, stream, fmt, steps, final,
             first_hop],
            [status, download, takes_count, generate, stop], concurrency_limit=limits.max_sessions,
            concurrency_id="synthesis", show_progress="hidden",
            js=f"(...inputs) => [window.cvStudio.begin({rate}), ...inputs.slice(1)]", **private)
        running.then(studio.idle, None, [generate, stop], queue=False, show_progress="hidden", **private)
        stop.click(studio.stop_clicked, take_id, [generate, stop], queue=False, show_progress="hidden",
                   js="() => [window.cvStudio.stop()]", **private)

        # toasts travel on the queue's stream: handlers that may warn are queued (the default)
        prompt.upload(studio.check_upload, prompt, prompt, show_progress="hidden", **private)
        prompt.stop_recording(studio.check_upload, prompt, prompt, show_progress="hidden", **private)
        prompt.upload(lambda: (None, None), None, [voice, preview], queue=False, **private)
        voice.select(lambda: None, None, prompt, queue=False, **private)  # a picked voice replaces the recording
        voice.change(studio.preview, voice, preview, show_progress="hidden", **private)
        save.click(studio.save_voice, [save_as, prompt, transcript], voice, show_progress="hidden", **private)
        rename.click(studio.rename_voice, [voice, new_name], voice, show_progress="hidden", **private)
        export.click(studio.export_voice, voice, exported, show_progress="hidden", **private)
        exported.change(lambda path: gr.update(visible=bool(path)), exported, exported, queue=False, **private)
        import_outputs = [voice, imported, import_name, import_again]
        imported.upload(studio.import_voice, imported, import_outputs, show_progress="hidden", **private)
        import_again.click(studio.import_voice, [imported, import_name], import_outputs, show_progress="hidden",
                           **private)
        delete.click(studio.ask_delete, voice, [confirm_row, confirm_text], show_progress="hidden", **private)
        confirm.click(studio.delete_voice, voice, [voice, confirm_row, preview], show_progress="hidden", **private)
        cancel.click(lambda: gr.update(visible=False), None, confirm_row, queue=False, **private)
        page.load(studio.visitor_voices, None, voice, queue=False, show_progress="hidden", **private)
    return page


def _api(studio: Studio, max_sessions: int) -> None:
    """Named endpoints for gradio_client: components never shown, one button per endpoint."""
    with gr.Group(visible=False):
        text = gr.Textbox(label="text")
        mode = gr.Dropdown(list(MODES), value="zero_shot", label="mode")
        voice = gr.Textbox(label="voice", info="a voice name or id, looked up at call time ('' to use prompt_audio)")
        prompt_audio = gr.Audio(type="filepath", label="prompt_audio")
        prompt_text = gr.Textbox(label="prompt_text", info="the transcript of prompt_audio (zero_shot)")
        instruction = gr.Textbox(label="instruction", info="instruct2 only")
        seed = gr.Number(-1, precision=0, label="seed", info="-1: random")
        speed = gr.Number(1.0, label="speed")
        fmt = gr.Dropdown(list(DOWNLOAD_FORMATS), value="wav", label="format")
        steps = gr.Number(None, precision=0, label="steps", info="the flow's Euler steps (empty: the model's)")
        final = gr.Dropdown(["full", "chunked"], value=None, label="final",
                            info="the last flow call: full (the reference) or chunked (empty: the reference's)")
        first_hop = gr.Number(None, precision=0, label="first_hop",
                              info="speech tokens of the first chunk (empty: the reference's)")
        result = gr.File(label="audio")
        name = gr.Textbox(label="name")
        voices = gr.JSON(label="voices")
        saved = gr.JSON(label="voice")
        run, list_voices, save = gr.Button(), gr.Button(), gr.Button()
    run.click(studio.api_synthesize,
              [text, mode, voice, prompt_audio, prompt_text, instruction, seed, speed, fmt, steps, final, first_hop],
              result, api_name="synthesize", concurrency_limit=max_sessions, concurrency_id="synthesis")
    list_voices.click(studio.api_voices, None, voices, api_name="voices", queue=False)
    save.click(studio.api_save_voice, [name, prompt_audio, prompt_text], saved, api_name="save_voice")


# ----------------------------------------------------------------------------- start-up


def load_studio(model_dir: str | Path | None = None, *, voice_dir: str | Path | None = None,
                demo_dir: str | Path = DEMO_MODEL_DIR, builtin_dir: str | Path | None = BUILTIN_VOICE_DIR,
                device: str | None = None, precision: str | None = None,
                settings: ServerSettings | None = None) -> Studio:
    """The engine and voice library to serve, in the process's one :class:`StudioContext` (``settings``: who
    visitors are and who may edit saved voices; default the environment's).

    An explicit ``model_dir`` (a folder or a ModelScope id) must load. Without one, the repository's default
    folder is used if present; otherwise the demo model in ``demo_dir``
    (:func:`cosyvoice.tools.make_tiny_bundle.model_dir_or_demo`, as the command lines do), said loudly in the log
    and on the page. Voices are kept in ``voice_dir``, by
    default the servers' folder (:func:`cosyvoice.settings.default_voice_dir`): one library for all of them.
    """
    model_dir, demo = model_dir_or_demo(model_dir, demo_dir)
    settings = replace(settings or ServerSettings.from_env(), voice_dir=str(voice_dir or default_voice_dir()))
    service = TTSService.load(model_dir, settings.voice_dir, device=device, precision=precision,
                              policy=settings.voice_policy(), builtin_dir=builtin_dir)
    return Studio(StudioContext(settings, service=service), demo=demo)


def launch(studio: Studio, *, host: str = "127.0.0.1", port: int = 8000, block: bool = True) -> gr.Blocks:
    """Serve the page and the live-audio route (``block=False`` returns at once, the server in a thread).

    The studio's context says who callers are (:mod:`cosyvoice.owners`). With keys nothing answers without one of
    them (:mod:`app.auth`): not the page, its events, its files, the live audio or the named API; only a listening
    test's rater pages."""
    owners = studio.owners
    page = build_ui(studio)
    page.queue(default_concurrency_limit=studio.service.limits.max_sessions)
    gate = {} if not owners.keyed else {
        "auth_dependency": owner_dependency(owners),
        "app_kwargs": {"middleware": [Middleware(KeyGate, owners=owners, public=rater_route)]}}
    page.launch(server_name=host, server_port=port, prevent_thread_lock=True, show_error=False, ssr_mode=False,
                max_file_size=UPLOAD_HEADROOM * studio.service.limits.max_prompt_bytes, quiet=not block, i18n=I18N,
                css=CSS, head=head_html() + f"<script>\n{HISTORY_JS.read_text(encoding='utf-8')}\n</script>",
                theme=gr.themes.Default(font=["ui-sans-serif", "system-ui", "Noto Sans CJK SC", "sans-serif"]),
                allowed_paths=[str(studio._files)], **gate)
    mount(page.app, studio.live, studio.service.sample_rate)
    # the workbench (the take history's store too) and long-form projects, over the studio's context
    page.app.include_router(longform_router(studio.context))
    page.app.include_router(workbench_router(studio.context))
    if block:
        page.block_thread()
    return page


