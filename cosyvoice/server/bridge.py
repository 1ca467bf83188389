"""The bridge contract (``POST /synthesize``, ``GET /speakers``): JSON in, one complete WAV out.

The contract's rules, kept as its seed document states them: ``prompt_audio`` is required; the instruction is
``instruct or speaker or "Speak naturally in English."`` (``speaker`` is an instruction here, not a saved
voice); with neither ``instruct`` nor ``speaker`` but a ``prompt_text``, the recording is cloned zero-shot.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from cosyvoice.errors import InvalidInputError
from cosyvoice.server.common import (
    audio_argument,
    request_owner,
    server_state,
    service_of,
    while_connected,
    whole_file,
    wire_fields,
)
from cosyvoice.server.voices_api import voice_json
from cosyvoice.service import SynthesisRequest
from cosyvoice.settings import ServerSettings

router = APIRouter(tags=["bridge"])

DEFAULT_INSTRUCTION = "Speak naturally in English."  # the contract's instruction when none is given
PROMPT_AUDIO_REQUIRED = "prompt_audio is required for CosyVoice3 synthesis"  # the contract's exact message
BRIDGE_FIELDS = {"transcript": "prompt_text", "instruction": "instruct", "voice": "speaker"}


class BridgeSynthesis(BaseModel):
    """The bridge server's ``POST /synthesize`` body."""

    model_config = ConfigDict(extra="ignore")
    text: str
    prompt_audio: str | None = None  # base64 (optionally a data: URL) or a path under the allowed folder
    prompt_text: str | None = None
    instruct: str | None = None
    speaker: str | None = None  # an instruction when ``instruct`` is not given (the contract's fallback)
    speed: float = 1.0
    seed: int | None = None  # negative: random
    steps: int | None = None  # our extension: the flow's Euler steps (None: the model's)
    final: str | None = None  # our extension: the last flow call, "full" (None: the reference's) or "chunked"
    first_hop: int | None = None  # our extension: speech tokens of the first chunk (None: the reference's)


def bridge_request(body: BridgeSynthesis, audio: object) -> SynthesisRequest:
    """The contract's mode and instruction for ``body``."""
    instruction = (body.instruct or "").strip() or (body.speaker or "").strip()
    if not instruction and body.prompt_text and body.prompt_text.strip():
        mode = "zero_shot"
    else:
        mode, instruction = "instruct", instruction or DEFAULT_INSTRUCTION
    seed = body.seed if body.seed is None or body.seed >= 0 else None
    return SynthesisRequest(body.text, mode, prompt_audio=audio, transcript=body.prompt_text or "",
                            instruction=instruction if mode == "instruct" else "", speed=body.speed, seed=seed,
                            steps=body.steps, final=body.final, first_hop=body.first_hop, stream=False, format="wav")


def contract_request(body: BridgeSynthesis, settings: ServerSettings) -> SynthesisRequest:
    """``body`` as a service request, or the contract's 400 (``prompt_audio`` is required)."""
    if not body.prompt_audio:
        raise InvalidInputError(PROMPT_AUDIO_REQUIRED, "prompt_audio")
    return bridge_request(body, audio_argument(body.prompt_audio, settings, "prompt_audio"))


@router.post("/synthesize")
async def synthesize(http: Request, body: BridgeSynthesis) -> Response:
    """A complete WAV; ``X-Audio-Duration`` is its length in seconds. A client that leaves cancels it."""
    with wire_fields(BRIDGE_FIELDS):
        request = contract_request(body, server_state(http).settings)
        session = await while_connected(http.receive, service_of(http).asynthesize(request, owner=request_owner(http)))
    return await whole_file(session, "wav", http.receive)


@router.get("/speakers")
async def speakers(http: Request) -> JSONResponse:
    voices = service_of(http).list_voices(owner=request_owner(http))
    return JSONResponse({"speakers": [voice_json(v) for v in voices]})
