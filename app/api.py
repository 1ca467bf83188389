"""The studio's named Gradio API (for ``gradio_client``): one whole take as a file, the voices, saving a voice.
Errors are plain text (``gr.Error``), not toasts; an API take is kept in the take store as a page's take is."""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import time

import gradio as gr
import numpy as np

from app.files import PageFiles, uploaded
from app.recorder import TakeRecorder
from app.take_form import DOWNLOAD_FORMATS, TakeForm, start_take
from app.visitor import owner_of, page_message
from cosyvoice.encoding import encode_audio
from cosyvoice.errors import CosyVoiceError, InvalidInputError

logger = logging.getLogger("app.ui")  # the web UI logs under one name, which operators and tests filter on

class NamedApi:
    """The endpoints ``synthesize``, ``voices`` and ``save_voice`` over the studio's take recorder; files they hand
    out go to ``files``."""

    def __init__(self, recorder: TakeRecorder, files: PageFiles) -> None:
        self.recorder = recorder
        self.service = recorder.service
        self.files = files

    def synthesize(self, text: str, mode: str | None = None, voice: str | None = None, prompt_audio: str | None = None,
                   prompt_text: str | None = None, instruction: str | None = None, seed: float | None = None,
                   speed: float | None = None, format: str | None = None, steps: float | None = None,
                   request: gr.Request | None = None, final: str | None = None,
                   first_hop: float | None = None) -> str:
        """One whole take as a file (``format``: wav, mp3, flac or opus); plain-text errors.

        ``mode``: zero_shot (default), cross_lingual or instruct2; ``voice``: a voice's name or id, looked up at
        call time, else ``prompt_audio`` (+ ``prompt_text``, its transcript, for zero_shot); ``seed`` -1 or
        None: random; ``steps``: the flow's Euler steps (None: the model's); ``final`` (full or chunked) and
        ``first_hop`` (speech tokens of the first chunk): the chunk schedule (None: the reference's)."""
        form = TakeForm(mode or "zero_shot", text, prompt_audio, prompt_text or "", instruction or "", voice or None,
                        seed, 1.0 if speed is None else float(speed), False, format or "wav", steps, final, first_hop)
        try:
            if form.format not in DOWNLOAD_FORMATS:
                raise InvalidInputError(f"format must be one of {', '.join(DOWNLOAD_FORMATS)}, got {format!r}")
            started = start_take(self.recorder, form, request)
            prepared = started.session.prepared
            began = time.perf_counter()
            with contextlib.closing(started.session):
                pieces = [c.pcm.numpy() for c in started.session]
        except CosyVoiceError as exc:
            raise gr.Error(page_message(exc), print_exception=False) from exc
        samples = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
        timings = {"synthesis_seconds": time.perf_counter() - began, "first_chunk_seconds": None}
        try:  # the page's "All takes" lists it: an API take can be opened, replayed and reproduced there
            self.recorder.keep(samples, started.synthesis, prepared, timings, prepared.format.name, owner_of(request),
                               form_mode=form.mode, voice_label=started.voice)
        except (OSError, sqlite3.Error) as exc:
            logger.error("an API take could not be kept: %s", exc)
        path = self.files.folder() / f"cosyvoice-seed{prepared.seed}.{prepared.format.extension}"
        path.write_bytes(encode_audio(samples, prepared.format, self.service.sample_rate))
        return str(path)

    def voices(self, request: gr.Request | None = None) -> list[dict]:
        """Every saved voice (built-ins first): id, name, transcript, built-in."""
        return [{"id": i.id, "name": i.name, "transcript": i.transcript, "builtin": i.builtin}
                for i in self.service.list_voices(owner=owner_of(request))]

    def save_voice(self, name: str, prompt_audio: str, prompt_text: str | None = None,
                   request: gr.Request | None = None) -> dict:
        """Featurise a recording (with its transcript, for zero-shot) and keep it under ``name``."""
        try:
            if not prompt_audio:
                raise InvalidInputError("prompt_audio is required")
            info = self.service.create_voice(name or "", uploaded(prompt_audio), prompt_text or "",
                                             owner=owner_of(request))
        except CosyVoiceError as exc:
            raise gr.Error(page_message(exc), print_exception=False) from exc
        return {"id": info.id, "name": info.name, "transcript": info.transcript}
