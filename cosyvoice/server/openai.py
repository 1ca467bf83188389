"""OpenAI speech (``POST /v1/audio/speech``) and ``GET /v1/models``, as the OpenAI SDKs call them."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from cosyvoice.errors import InvalidInputError
from cosyvoice.server.common import (
    SessionStream,
    audio_stream,
    request_owner,
    service_of,
    while_connected,
    wire_fields,
)
from cosyvoice.service import SynthesisRequest

router = APIRouter(tags=["openai"])

OPENAI_FIELDS = {"text": "input", "instruction": "instructions", "format": "response_format"}


class OpenAISpeech(BaseModel):
    """OpenAI's ``POST /v1/audio/speech`` body (unknown fields are ignored, as OpenAI clients add new ones)."""

    model_config = ConfigDict(extra="ignore")
    model: str = "cosyvoice3"  # any value: there is one model per server
    input: str
    voice: str | dict[str, str]  # a saved voice's id or name, or OpenAI's {"id": ...} form
    instructions: str | None = None
    response_format: str = "mp3"
    speed: float = 1.0
    stream_format: str = "audio"  # "audio" or "sse"
    seed: int | None = None  # our extension
    steps: int | None = None  # our extension: the flow's Euler steps (None: the model's)
    final: str | None = None  # our extension: the last flow call, "full" (None: the reference's) or "chunked"
    first_hop: int | None = None  # our extension: speech tokens of the first chunk (None: the reference's)


@router.post("/v1/audio/speech")
async def speech(http: Request, body: OpenAISpeech) -> SessionStream:
    """Audio in ``response_format``, streamed as it is produced (``stream_format: sse`` for events); FLAC, whose
    header needs the total length, arrives whole when the audio ends."""
    with wire_fields(OPENAI_FIELDS):
        voice = body.voice.get("id", "") if isinstance(body.voice, dict) else body.voice
        if body.stream_format not in ("audio", "sse"):
            raise InvalidInputError("stream_format must be 'audio' or 'sse'", "stream_format")
        instructed = bool(body.instructions and body.instructions.strip())
        request = SynthesisRequest(body.input, "instruct" if instructed else "sft", voice=voice,
                                   instruction=body.instructions or "", speed=body.speed, seed=body.seed,
                                   steps=body.steps, final=body.final, first_hop=body.first_hop, stream=True,
                                   format=body.response_format)
        session = await while_connected(http.receive, service_of(http).asynthesize(request, owner=request_owner(http)))
    return audio_stream(session, session.prepared.format, sse=body.stream_format == "sse")


@router.get("/v1/models")
async def models(http: Request) -> JSONResponse:
    model_id = Path(service_of(http).model_dir).name  # the folder's name: never a server path
    return JSONResponse({"object": "list", "data": [
        {"id": model_id, "object": "model", "created": 0, "owned_by": "cosyvoice"}]})
