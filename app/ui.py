"""The Gradio web UI: forms in, engine calls out, audio streamed back to the browser. No model logic here.

One :class:`Studio` (the shared CosyVoice3 engine and the prompt-voice library) serves every browser
session. People type plain text; the CosyVoice3 prompt conventions (``cosyvoice.frontend.prompts``) are
applied here. Errors the package raises on purpose reach the page through :func:`user_errors`.
"""

from __future__ import annotations

import contextlib
import functools
import html
import inspect
import io
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr
import numpy as np
import soundfile as sf

from cosyvoice.bundle import DEFAULT_MODEL_ID, validate_model_dir
from cosyvoice.cli.cosyvoice import CosyVoice3
from cosyvoice.errors import CosyVoiceError, InvalidInputError, ModelBundleError, ResourceLimitError
from cosyvoice.frontend.frontend import Voice
from cosyvoice.frontend.prompts import cross_lingual_text, instruct_text, user_text, zero_shot_prompt_text
from cosyvoice.settings import SPEED_RANGE
from cosyvoice.voices import VoiceLibrary

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DIR = Path("pretrained_models/Fun-CosyVoice3-0.5B")
DEMO_MODEL_DIR = Path("pretrained_models/.tiny-demo")
DEFAULT_VOICE_DIR = Path("pretrained_models/.voices")
DEMO_WARNING = (
    f"DEMO MODE: no model was found at {DEFAULT_MODEL_DIR}, so this UI runs a tiny RANDOMLY INITIALISED model "
    "that produces noise-like audio, not speech. For real speech, download the model with "
    f"`modelscope download --model {DEFAULT_MODEL_ID} --local_dir {DEFAULT_MODEL_DIR}` "
    "(pip install -e '.[download]') and restart, or start with --model-dir DIR."
)
MODES = {"zero_shot": "Zero-shot clone", "cross_lingual": "Cross-lingual", "instruct2": "Instruct"}


# ----------------------------------------------------------------------------- errors: the one mapping


def as_gr_error(exc: CosyVoiceError) -> gr.Error:
    """Our message, escaped (the page renders HTML and messages may quote ``<|endofprompt|>``), under a title."""
    if isinstance(exc, InvalidInputError):
        title = "Please check your input"
    elif isinstance(exc, ResourceLimitError):
        title = "The server is busy"
    else:
        title = "Model problem"
    return gr.Error(html.escape(str(exc)), title=title, print_exception=not isinstance(exc, InvalidInputError))


def warn(message: str) -> None:
    """A non-fatal problem: the request goes on and the page shows a warning."""
    gr.Warning(html.escape(message))


def user_errors(handler: Callable) -> Callable:
    """Wrap a (generator) handler so that every :class:`CosyVoiceError` becomes a ``gr.Error`` on the page."""
    if inspect.isgeneratorfunction(handler):
        @functools.wraps(handler)
        def streaming(*args: Any, **kwargs: Any) -> Iterator:
            try:
                yield from handler(*args, **kwargs)
            except CosyVoiceError as exc:
                raise as_gr_error(exc) from exc
        return streaming

    @functools.wraps(handler)
    def plain(*args: Any, **kwargs: Any) -> Any:
        try:
            return handler(*args, **kwargs)
        except CosyVoiceError as exc:
            raise as_gr_error(exc) from exc
    return plain


# ----------------------------------------------------------------------------- the shared state and handlers


@dataclass
class Studio:
    """What all browser sessions share: one engine, one voice library."""

    tts: CosyVoice3
    voices: VoiceLibrary
    demo: bool = False

    def voice_choices(self) -> list[tuple[str, str]]:
        """Dropdown (label, voice id) pairs: saved voices by name, then recent uploads."""
        def label(name: str | None, transcript: str, voice_id: str) -> str:
            words = transcript if len(transcript) <= 40 else transcript[:39] + "…"
            return name or f"recent upload {voice_id[:6]}: {words or '(no transcript)'}"
        return [(label(i.name, i.transcript, i.id), i.id) for i in self.voices.list()]

    def refresh_voices(self, selected: str | None = None) -> gr.Dropdown:
        choices = self.voice_choices()
        return gr.Dropdown(choices=choices, value=selected if selected in {v for _, v in choices} else None)

    @user_errors
    def generate(self, mode: str, text: str, prompt_audio: str | None, transcript: str, instruction: str,
                 saved_voice: str | None, save_as: str, seed: float | None, speed: float,
                 stream: bool) -> Iterator[tuple]:
        """Yield (player chunk, full WAV, voice dropdown, status): WAV chunks while synthesising, then the rest."""
        self.tts.frontend.check_text(text)
        instruction = self._instruction(mode, instruction or "")  # checked before any audio work
        if stream and speed != 1.0:
            warn("speed applies only without streaming; streaming at normal speed")
        voice_id, voice, source = self._voice(mode, prompt_audio, transcript or "", saved_voice)
        if save_as and save_as.strip():
            try:
                self.voices.save(save_as, voice_id)
            except CosyVoiceError as exc:
                warn(f"the voice was not saved: {exc}")
        chunks = self.tts.synthesize(mode, cross_lingual_text(text) if mode == "cross_lingual" else text,
                                     voice=voice, instruct_text=instruction, split_prefixed=True, stream=bool(stream),
                                     speed=1.0 if stream else float(speed),
                                     seed=None if seed is None or seed < 0 else int(seed))
        pieces: list[np.ndarray] = []
        start = time.perf_counter()
        first_audio = 0.0
        with contextlib.closing(chunks):
            for chunk in chunks:
                pcm = chunk.int16()
                if not pcm.size:
                    continue
                first_audio = first_audio or time.perf_counter() - start
                yield _wav_bytes(pcm, chunk.sample_rate), None if not pieces else gr.skip(), gr.skip(), gr.skip()
                pieces.append(pcm)
        wall = time.perf_counter() - start
        full = np.concatenate(pieces) if pieces else np.zeros(0, np.int16)
        seconds = full.size / self.tts.sample_rate
        status = (f"{seconds:.1f} s of audio in {wall:.1f} s (first audio after {first_audio:.2f} s, "
                  f"{len(pieces)} chunks) · voice: {source}" if pieces else "the model produced no audio")
        yield (gr.skip(), (self.tts.sample_rate, full) if pieces else None, self.refresh_voices(saved_voice),
               status)

    def _voice(self, mode: str, prompt_audio: str | None, transcript: str,
               saved_voice: str | None) -> tuple[str, Voice, str]:
        """(voice id, voice, description): the saved voice if one is picked, else the recording (cached)."""
        if saved_voice:
            info, voice = self.voices.get(saved_voice)  # synthesize() refuses it for zero-shot if it lacks a transcript
            label = repr(info.name) if info.name else f"recent upload {info.id[:6]}"
            return info.id, voice, f"saved voice {label}"
        if not prompt_audio:
            limits = self.tts.limits
            raise InvalidInputError(f"upload or record a prompt voice ({limits.min_prompt_seconds:g} to "
                                    f"{limits.max_prompt_seconds:g} s of speech), or pick a saved voice")
        prompt_text = ""
        if mode == "zero_shot":
            if not user_text(transcript):
                raise InvalidInputError("zero-shot cloning needs the transcript of the prompt recording: type what "
                                        "is said in it, or use the cross-lingual tab, which needs none")
            self.tts.frontend.check_text(transcript, "the transcript")
            prompt_text = zero_shot_prompt_text(transcript)
        voice_id, voice = self.voices.get_or_create(prompt_audio, prompt_text)
        return voice_id, voice, "the uploaded recording"

    @staticmethod
    def _instruction(mode: str, instruction: str) -> str:
        if mode != "instruct2":
            return ""
        if not user_text(instruction):
            raise InvalidInputError("instruct mode needs an instruction, e.g. 'Speak slowly and calmly.'")
        return instruct_text(instruction)

    @user_errors
    def delete_voice(self, saved_voice: str | None) -> gr.Dropdown:
        if not saved_voice:
            raise InvalidInputError("pick a saved voice to delete")
        info = self.voices.delete(saved_voice)
        gr.Info(html.escape(f"deleted voice {info.name or info.id[:6]}"))
        return self.refresh_voices()


def _wav_bytes(pcm: np.ndarray, sample_rate: int) -> bytes:
    """One streamed piece as a 16-bit WAV, the form Gradio's stream encoder reads without a subprocess."""
    buffer = io.BytesIO()
    sf.write(buffer, pcm, sample_rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


# ----------------------------------------------------------------------------- page


def build_ui(studio: Studio) -> gr.Blocks:
    limits = studio.tts.limits
    with gr.Blocks(title="CosyVoice3 Studio", analytics_enabled=False, delete_cache=(3600, 3600)) as page:
        if studio.demo:
            gr.HTML(f'<div id="demo-banner" style="background:#b91c1c;color:#fff;padding:12px 16px;'
                    f'border-radius:8px;font-weight:600">{html.escape(DEMO_WARNING)}</div>')
        gr.Markdown("# CosyVoice3 Studio\nFun-CosyVoice3-0.5B text-to-speech: clone a voice from a short "
                    "recording, speak it in another language, or steer it with an instruction.")
        mode = gr.State("zero_shot")
        with gr.Row():
            with gr.Column(scale=3):
                text = gr.Textbox(label="Text to speak", lines=5, max_length=limits.max_text_chars)
                with gr.Tabs():
                    with gr.Tab(MODES["zero_shot"]) as zero_shot_tab:
                        transcript = gr.Textbox(label="Transcript of the prompt recording", lines=2,
                                                info="exactly what is said in the recording")
                    with gr.Tab(MODES["cross_lingual"]) as cross_lingual_tab:
                        gr.Markdown("Speaks the text, in any language, with the recorded voice; no transcript "
                                    "needed. Tags such as `[breath]` or `[laughter]` work here.")
                    with gr.Tab(MODES["instruct2"]) as instruct_tab:
                        instruction = gr.Textbox(label="Instruction", placeholder="Speak slowly and calmly.")
                for tab, name in ((zero_shot_tab, "zero_shot"), (cross_lingual_tab, "cross_lingual"),
                                  (instruct_tab, "instruct2")):
                    tab.select(lambda name=name: name, None, mode)
            with gr.Column(scale=2):
                saved = gr.Dropdown(label="Saved voice", choices=studio.voice_choices(), value=None,
                                    info="a picked voice is used instead of the recording below")
                delete = gr.Button("Delete this voice", size="sm")
                prompt = gr.Audio(label=f"Prompt recording ({limits.min_prompt_seconds:g} to "
                                        f"{limits.max_prompt_seconds:g} s)",
                                  sources=["upload", "microphone"], type="filepath")
                save_as = gr.Textbox(label="Save this voice as", placeholder="optional name")
        with gr.Row():
            stream = gr.Checkbox(True, label="Stream")
            speed = gr.Slider(*SPEED_RANGE, 1.0, step=0.05, label="Speed (without streaming)", interactive=False)
            seed = gr.Number(-1, label="Seed (-1: random)", precision=0, minimum=-1)
        generate = gr.Button("Generate", variant="primary")
        player = gr.Audio(label="Playing", streaming=True, autoplay=True, interactive=False)
        full = gr.Audio(label="Full audio (WAV)", type="numpy", format="wav", interactive=False)
        status = gr.Markdown()

        generate.click(studio.generate, [mode, text, prompt, transcript, instruction, saved, save_as, seed, speed,
                                         stream], [player, full, saved, status],
                       concurrency_limit=limits.max_sessions)
        stream.change(lambda on: gr.Slider(interactive=not on), stream, speed)
        prompt.upload(lambda: None, None, saved)  # a new recording replaces the picked voice ...
        prompt.stop_recording(lambda: None, None, saved)
        saved.input(lambda: None, None, prompt)  # ... and a picked voice replaces the recording
        delete.click(studio.delete_voice, saved, saved)
        page.load(studio.refresh_voices, saved, saved)
    return page


# ----------------------------------------------------------------------------- start-up


def load_studio(model_dir: str | Path | None = None, *, voice_dir: str | Path = DEFAULT_VOICE_DIR,
                demo_dir: str | Path = DEMO_MODEL_DIR, device: str | None = None) -> Studio:
    """The engine and voice library to serve.

    An explicit ``model_dir`` (a folder or a ModelScope id) must load. Without one, the default folder is
    used if present; otherwise a tiny random model is generated (once) into ``demo_dir`` so the UI still
    starts, and that is said loudly in the log and on the page.
    """
    demo = model_dir is None and not DEFAULT_MODEL_DIR.is_dir()
    if demo:
        logger.warning("\n%s\n%s\n%s", "!" * 100, DEMO_WARNING, "!" * 100)
        try:
            validate_model_dir(demo_dir)
        except ModelBundleError:
            from cosyvoice.tools.make_tiny_bundle import make_tiny_bundle

            logger.info("writing the demo model to %s", demo_dir)
            make_tiny_bundle(demo_dir, seed=0)
        model_dir = demo_dir
    tts = CosyVoice3(model_dir or DEFAULT_MODEL_DIR, device=device)
    limits = tts.limits
    library = VoiceLibrary(voice_dir, tts.frontend, model_dir=tts.model_dir, max_entries=limits.max_cached_voices,
                           max_bytes=limits.max_cached_voice_bytes, max_named=limits.max_named_voices)
    return Studio(tts, library, demo=demo)


def launch(studio: Studio, *, host: str = "127.0.0.1", port: int = 8000, block: bool = True) -> gr.Blocks:
    """Serve the page (``block=False`` returns at once, the server running in a thread)."""
    page = build_ui(studio)
    page.launch(server_name=host, server_port=port, prevent_thread_lock=not block, show_error=True, ssr_mode=False,
                max_file_size=studio.tts.limits.max_prompt_bytes, quiet=not block)
    return page
