"""The studio page's Gradio handlers over one take recorder: Generate and Stop, the take history and its ZIP, "Use
these settings" (the voice column's handlers are :class:`~app.voices.VoiceHandlers`, the named API's
:class:`~app.api.NamedApi`). Invalid input becomes a warning toast on the page, never an error badge over other
controls."""

from __future__ import annotations

import logging
import queue
import secrets
import sqlite3
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr
import numpy as np

from app.api import NamedApi
from app.files import PageFiles
from app.i18n import say
from app.live import LiveHub
from app.recorder import TakeRecorder, TakeSession, TakeTimes
from app.take_form import DOWNLOAD_FORMATS, Started, TakeForm, start_take
from app.take_history import TakeHistory
from app.visitor import caller_of, is_zh, owner_of, page_message, warn
from app.voices import VoiceHandlers
from cosyvoice.context import StudioContext
from cosyvoice.encoding import audio_format, encode_audio
from cosyvoice.errors import CosyVoiceError, ReadOnlyError
from cosyvoice.owners import Owners
from cosyvoice.takes.store import TakeStore

logger = logging.getLogger("app.ui")  # the web UI logs under one name, which operators and tests filter on

# the form's tab of each engine mode (a take's provenance names the engine mode: sft takes ran as one of them)
TAB_OF_ENGINE_MODE = {"zero_shot": "zero_shot", "cross_lingual": "cross_lingual", "instruct2": "instruct2"}


@dataclass
class Heard:
    """What a take made before it ended (``outcome``: done, stopped or error, with its ``detail``)."""

    pieces: list[np.ndarray]
    outcome: str
    detail: Any
    timings: dict[str, float | None]


class Studio(VoiceHandlers):
    """What all browser sessions share: the process's context (the service: engine + voice library; the take store
    that keeps every take, the history of each browser; who visitors are and what they see), the take recorder
    with its live-audio hub, and the files handed to the page. Its methods are the page's handlers, the voice
    column's inherited from :class:`~app.voices.VoiceHandlers`; ``api`` serves the named endpoints."""

    def __init__(self, context: StudioContext, demo: bool = False) -> None:
        super().__init__(context.service(), PageFiles())
        self.context = context
        self.demo = demo
        self.recorder = TakeRecorder(self.service, context.takes, LiveHub())
        self.past_takes = TakeHistory(context.takes)
        self.api = NamedApi(self.recorder, self.files)

    @property
    def store(self) -> TakeStore:
        """The take store (the workbench pages serve the same)."""
        return self.context.takes

    @property
    def owners(self) -> Owners:
        return self.context.owners

    @property
    def live(self) -> LiveHub:
        """Where the page's player reads a take's audio as it is made (the recorder publishes it)."""
        return self.recorder.live

    @property
    def times(self) -> dict[str, TakeTimes]:
        """Server times of recent takes, by take id, for measurements."""
        return self.recorder.times

    @property
    def _running(self) -> dict[str, tuple[TakeSession, queue.Queue]]:
        """The takes running now (the recorder's), by take id."""
        return self.recorder.running

    @property
    def _stopped_early(self) -> set[str]:
        """Takes stopped while they waited, which will not start (the recorder's)."""
        return self.recorder.stopped_early

    @property
    def _files(self) -> Path:
        """The folder Gradio may serve files from (``launch`` allows it, nothing else)."""
        return self.files.root

    # ------------------------------------------------------------------ Generate and Stop

    @staticmethod
    def begin() -> tuple:
        """The Generate click, at once (not queued): lock Generate, unlock Stop, also while the take waits."""
        return gr.update(interactive=False), gr.update(interactive=True)

    @staticmethod
    def idle() -> tuple:
        """Generate unlocked, Stop locked: after every take, however it ended (even by a bug)."""
        return gr.update(interactive=True), gr.update(interactive=False)

    def stop(self, take_id: str) -> None:
        """Stop a take: its handler ends at once (keeping what was made) and the engine's work at its next
        chunk; a take still waiting in the queue will not start."""
        self.recorder.stop(take_id)

    def stop_clicked(self, take_id: str) -> tuple:
        self.stop(take_id)
        return self.idle()

    def generate(self, take_id: str, mode: str, text: str, prompt: str | None, transcript: str, instruction: str,
                 voice_key: str | None, seed: float | None, speed: float, stream: bool, fmt: str,
                 request: gr.Request | None = None, steps: float | None = None, final: str | None = None,
                 first_hop: float | None = None) -> Iterator[tuple]:
        """The page's Generate: yields (status, download, number of takes, generate button, stop button). Gradio
        puts ``request`` in its place and the form's inputs around it, so the advanced settings (``steps``,
        ``final``, ``first_hop``: the last inputs) come last."""
        take_id = take_id or secrets.token_hex(8)
        idle, zh = self.idle(), is_zh(request)
        if self.recorder.open(take_id):
            yield say(zh, "stopped_before"), gr.skip(), gr.skip(), *idle
            return
        form = TakeForm(mode, text, prompt, transcript, instruction, voice_key, seed, speed, stream, fmt, steps,
                        final, first_hop)
        try:
            started = start_take(self.recorder, form, request)
        except CosyVoiceError as exc:
            self.recorder.abandon(take_id)
            warn(page_message(exc, zh))
            yield "", gr.skip(), gr.skip(), *idle
            return
        heard = yield from self._hear(take_id, started, zh)
        if heard.outcome == "error":
            self._report(take_id, heard.detail, zh)
        if not heard.pieces:
            said = "" if heard.outcome == "error" else say(zh, "stopped" if heard.outcome == "stopped" else "no_audio")
            yield said, gr.skip(), gr.skip(), *idle
            return
        yield *self._finish(take_id, started, heard, form, request), *idle

    def _hear(self, take_id: str, started: Started, zh: bool) -> Generator[tuple, None, Heard]:
        """Run the take, saying on the status line how much is made; returns what was made and how it ended."""
        pieces: list[np.ndarray] = []
        start = time.perf_counter()
        first_audio = None
        outcome, detail = "done", None
        for outcome, detail in self.recorder.run(take_id, started.session):
            if outcome != "chunk":
                break
            first_audio = first_audio if first_audio is not None else time.perf_counter() - start
            pieces.append(detail)
            made = sum(p.size for p in pieces) / self.service.sample_rate
            seed = started.session.prepared.seed
            yield say(zh, "generating", seconds=made, seed=seed), gr.skip(), gr.skip(), gr.skip(), gr.skip()
        timings = {"synthesis_seconds": time.perf_counter() - start, "first_chunk_seconds": first_audio}
        return Heard(pieces, outcome, detail, timings)

    @staticmethod
    def _report(take_id: str, error: BaseException, zh: bool) -> None:
        """A take that failed, told the page (a service error in its words; anything else in the log)."""
        if isinstance(error, CosyVoiceError):
            warn(page_message(error, zh))
        else:
            logger.error("take %s failed", take_id, exc_info=error)
            warn(say(zh, "failed"))

    def _finish(self, take_id: str, started: Started, heard: Heard, form: TakeForm,
                request: gr.Request | None) -> tuple:
        """Keep what was made in the history and hand it out for download: (status, download, number of takes)."""
        zh, owner, prepared = is_zh(request), owner_of(request), started.session.prepared
        samples = np.concatenate(heard.pieces)
        stopped = heard.outcome != "done"
        download_format = audio_format(form.format if form.format in DOWNLOAD_FORMATS else "wav").name
        try:
            kept = self.recorder.keep(samples, started.synthesis, prepared, heard.timings, download_format, owner,
                                      form_mode=form.mode, voice_label=started.voice,
                                      **({"stopped": True} if stopped else {}))
            number = self.store.count_takes(owner, upto=kept.seq)
        except ReadOnlyError:  # a read-only data folder (said once in the log at start): downloadable below
            warn(say(zh, "not_kept_read_only"))
            number = None
        except (OSError, sqlite3.Error) as exc:  # e.g. a full disk: the take is still downloadable below
            logger.error("take %s could not be kept in the history: %s", take_id, exc)
            warn(say(zh, "not_kept"))
            number = None
        download = self._download(number, samples, download_format, prepared.seed)
        # what was heard, and when, is the player's to say (the line above): the server only knows what it made
        wall = heard.timings["synthesis_seconds"]
        status = (say(zh, "take_done", number=number or "?", seconds=samples.size / self.service.sample_rate, wall=wall)
                  + say(zh, "seed_voice", seed=prepared.seed, voice=started.voice)
                  + (say(zh, "stopped_mark") if stopped else ""))
        return status, gr.update(value=str(download), visible=True), gr.skip() if number is None else number

    def _download(self, number: int | None, samples: np.ndarray, fmt: str, seed: int) -> Path:
        """A take encoded in its download format, under a name that says what it is (its number in the history,
        when it is in the history)."""
        audio = audio_format(fmt)
        path = self.files.folder() / f"take-{'' if number is None else f'{number}-'}seed{seed}.{audio.extension}"
        path.write_bytes(encode_audio(samples, audio, self.service.sample_rate))
        return path

    # ------------------------------------------------------------------ the history

    def history(self, request: gr.Request | None) -> list[dict]:
        """The takes of this browser, newest first, as the page and the ZIP describe them."""
        return self.past_takes.entries(owner_of(request))

    def history_zip(self, request: gr.Request | None = None) -> str | None:
        """This browser's takes as one ZIP, made when asked for."""
        return self.past_takes.zip(owner_of(request), self.files)

    def open_take(self, take_id: str, request: gr.Request | None = None) -> tuple:
        """"Use these settings" on any take in the store (this browser's, a batch's, the API's): its text, mode,
        instruction, voice, seed, speed, flow steps, chunk schedule and streaming go back in the form, to reproduce
        or vary it. Returns (text, mode, tabs, instruction, voice, seed, speed, steps, stream, final, first_hop)."""
        zh = is_zh(request)
        try:
            take = self.store.take(take_id or "", caller_of(self.owners, request))
        except CosyVoiceError as exc:
            warn(page_message(exc, zh))
            return (gr.skip(),) * 11
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
