"""What a synthesis request is: the one request type every adapter states (:class:`SynthesisRequest`), what it becomes
once checked (:class:`CheckedRequest`, :mod:`cosyvoice.checks`) and resolved (:class:`PreparedRequest`), its modes and
its seed (:func:`draw_seed`). Plain data: the service (:mod:`cosyvoice.service`) does the work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from cosyvoice import pipeline
from cosyvoice.encoding import AudioFormat
from cosyvoice.engine import ChunkSchedule
from cosyvoice.frontend.audio import AudioSource
from cosyvoice.pipeline import Conditioning, Plan

ServiceMode = Literal["zero_shot", "cross_lingual", "instruct", "sft"]
MODES: tuple[str, ...] = ("zero_shot", "cross_lingual", "instruct", "sft")
MODE_ALIASES = {"instruct2": "instruct"}  # the official API's name for CosyVoice3's instruct mode
#: sample rate of a bare float array given as a prompt without one (what the official servers pass)
TENSOR_PROMPT_RATE = 16000
#: drawn seeds lie below this: the largest range a JavaScript number or a spreadsheet cell holds exactly
SEED_DRAWS = 2**53


def draw_seed() -> int:
    """A seed for a request that has none (the one draw of every adapter): from torch's global generator, so
    ``torch.manual_seed`` repeats it."""
    return int(torch.randint(0, SEED_DRAWS, (), dtype=torch.int64))


def mode_label(mode: object) -> str:
    """The mode as metrics label it: a service mode (aliases resolved) or ``unknown``."""
    mode = MODE_ALIASES.get(mode, mode) if isinstance(mode, str) else mode
    return mode if mode in MODES else "unknown"


@dataclass(frozen=True)
class SynthesisRequest:
    """One synthesis request, as every adapter states it (plain user text: no CosyVoice3 markers needed).

    ``mode``: ``zero_shot`` (clone the voice; needs its transcript), ``cross_lingual`` (any language, no
    transcript), ``instruct`` (follow ``instruction``; ``instruct2`` is accepted as an alias) or ``sft``
    (a saved voice alone: zero-shot when the voice has a transcript, else cross-lingual).
    The voice is ``voice`` (a saved voice's id or name) or ``prompt_audio`` (an uploaded recording: file
    bytes, a file-like object, an ``(array, sample_rate)`` pair, a float tensor/array at 16 kHz, or a path the
    adapter has vetted). ``stream`` asks the engine for chunks as they are ready; ``format`` is the output
    ``AudioFormat`` name for adapters that encode (``cosyvoice.encoding.FORMATS``). ``steps``: the flow's Euler
    steps (``settings.FLOW_STEPS_RANGE``; None: the model's): fewer are faster and coarser. ``final`` (``"full"``,
    the reference's last flow call with full attention, or ``"chunked"``) and ``first_hop`` (speech tokens of the
    first chunk) shape the chunk schedule (:class:`~cosyvoice.engine.ChunkSchedule`); a request naming a schedule
    other than the reference's is computed chunk by chunk even when it is delivered whole.
    For the official API's semantics: ``text_frontend`` (normalise the text), ``split_prefixed`` (text carrying
    ``<|endofprompt|>`` is normalised and split like plain text; False keeps it one unnormalised piece, as the
    reference does) and ``prompt_conventions`` (False: transcript, instruction and cross-lingual text come in
    the model's form already and must carry ``<|endofprompt|>``).
    """

    text: str
    mode: str = "zero_shot"
    voice: str | None = None
    prompt_audio: AudioSource | None = None
    transcript: str = ""
    instruction: str = ""
    speed: float = 1.0
    seed: int | None = None
    steps: int | None = None  # the flow's Euler steps (None: the model's, 10 for CosyVoice3)
    final: str | None = None  # the last flow call: "full" (None: the reference's) or "chunked"
    first_hop: int | None = None  # speech tokens of the first chunk (None: the reference's 25, padded)
    stream: bool = True
    format: str = "pcm"
    text_frontend: bool = True
    split_prefixed: bool = True
    prompt_conventions: bool = True


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request with its voice resolved and its pipeline plan made: nothing left to check."""

    mode: str  # the service mode asked for
    plan: Plan
    stream: bool
    speed: float
    format: AudioFormat
    steps: int  # the model's default when the request named none
    schedule: ChunkSchedule  # first hop and last flow call

    @property
    def engine_mode(self) -> pipeline.EngineMode:
        return self.plan.cond.mode

    @property
    def voice_id(self) -> str:
        return self.plan.voice_id

    @property
    def cond(self) -> Conditioning:
        return self.plan.cond

    @property
    def segments(self) -> tuple[str, ...]:
        """The normalised text pieces as the user wrote them, without prompt heads (empty for a text stream)."""
        return self.plan.segments

    @property
    def seed(self) -> int:
        """The request's seed, drawn at validation when it had none."""
        return self.plan.seed


@dataclass(frozen=True)
class CheckedRequest:
    """A request whose plain fields passed every check that needs no audio work (:func:`~cosyvoice.checks.check`)."""

    mode: str
    stream: bool
    speed: float
    seed: int
    format: AudioFormat
    instruction: str
    steps: int
    schedule: ChunkSchedule

