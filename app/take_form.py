"""A take as the page's form (or the named API) asks for it, turned into the service's request and started through
the take recorder; the service checks every field, this says the page's own words where it has better ones."""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from app.files import uploaded
from app.i18n import say
from app.recorder import TakeRecorder, TakeSession
from app.visitor import is_zh, owner_of, warn, whole
from cosyvoice.errors import InvalidInputError
from cosyvoice.service import SEED_DRAWS, SynthesisRequest

DOWNLOAD_FORMATS = ("wav", "mp3", "flac", "opus")
MAX_SEED = SEED_DRAWS - 1  # the largest seed a JavaScript number holds exactly


@dataclass(frozen=True)
class TakeForm:
    """The form's fields as Gradio hands them (``seed`` -1 or None: random; ``steps``, ``final`` and
    ``first_hop``: the flow's steps and the chunk schedule, None: the model's and the reference's)."""

    mode: str
    text: str
    prompt: str | None
    transcript: str
    instruction: str
    voice: str | None
    seed: float | None
    speed: float
    stream: bool
    format: str = "wav"
    steps: float | None = None
    final: str | None = None
    first_hop: float | None = None

    def request(self, zh: bool) -> SynthesisRequest:
        """The service's request: an upload only without a picked voice, a negative seed drawn by the service."""
        seed = None if self.seed is None else int(self.seed)
        if seed is not None and seed > MAX_SEED:  # the page's number field holds no larger integer exactly
            raise InvalidInputError(say(zh, "seed_range", high=MAX_SEED), "seed")
        return SynthesisRequest(
            text=self.text, mode=self.mode, voice=self.voice or None,
            prompt_audio=None if self.voice else uploaded(self.prompt, zh), transcript=self.transcript or "",
            instruction=self.instruction or "", speed=float(self.speed),
            seed=None if seed is None or seed < 0 else seed, steps=whole(self.steps), final=self.final or None,
            first_hop=whole(self.first_hop), stream=bool(self.stream), format=self.format)


@dataclass(frozen=True)
class Started:
    """A take the service accepted: its session (``session.prepared.seed``: the seed every take shows, to reproduce
    it), the request, and its voice as the page names it."""

    session: TakeSession
    synthesis: SynthesisRequest
    voice: str


def start_take(recorder: TakeRecorder, form: TakeForm, request: gr.Request | None) -> Started:
    """Validate and start ``form``'s take as ``request``'s visitor asks it (their voices)."""
    owner, zh = owner_of(request), is_zh(request)
    synthesis = form.request(zh)
    try:
        session = recorder.start(synthesis, owner)
    except InvalidInputError as exc:
        if exc.field == "voice" and not form.voice and not synthesis.prompt_audio:  # say it in the page's words
            limits = recorder.service.limits
            message = say(zh, "need_voice", low=limits.min_prompt_seconds, high=limits.max_prompt_seconds)
            raise InvalidInputError(message, "voice") from exc
        raise
    if form.stream and not session.prepared.stream:
        warn(say(zh, "speed_not_streamed"))
    voice = (recorder.service.get_voice(session.prepared.voice_id, owner=owner).label if form.voice
             else say(zh, "uploaded_recording"))
    return Started(session, synthesis, voice)
