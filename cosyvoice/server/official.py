"""The official CosyVoice FastAPI server's endpoints (``runtime/python/fastapi``): form fields in, raw PCM16LE
24 kHz out, streamed as the engine produces it. Its ``client.py`` works unchanged (GET with a form body).

Our additions are optional form fields the official client never sends: ``seed``, ``steps``, ``final`` and
``first_hop`` (the flow's schedule), so a script on the official wire format can make A/B takes too."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, File, Form, Request, UploadFile

from cosyvoice.server.common import (
    SessionStream,
    audio_stream,
    request_owner,
    service_of,
    while_connected,
    wire_fields,
)
from cosyvoice.service import SynthesisRequest

router = APIRouter(tags=["official"])

FormText = Annotated[str, Form()]
FormFile = Annotated[UploadFile, File()]
# service field -> wire field, so that an error names the field the client actually sent
OFFICIAL_FIELDS = {"text": "tts_text", "transcript": "prompt_text", "prompt_audio": "prompt_wav",
                   "instruction": "instruct_text", "voice": "spk_id"}


def _extensions(seed: Annotated[int | None, Form()] = None, steps: Annotated[int | None, Form()] = None,
                final: Annotated[str | None, Form()] = None,
                first_hop: Annotated[int | None, Form()] = None) -> dict[str, Any]:
    """Our optional fields, as ``SynthesisRequest`` keywords; the service checks their values."""
    return {"seed": seed, "steps": steps, "final": final, "first_hop": first_hop}


Extensions = Annotated[dict[str, Any], Depends(_extensions)]


async def _speak(http: Request, request: SynthesisRequest) -> SessionStream:
    with wire_fields(OFFICIAL_FIELDS):
        session = await while_connected(http.receive, service_of(http).asynthesize(request, owner=request_owner(http)))
    return audio_stream(session, "pcm")


@router.api_route("/inference_sft", methods=["GET", "POST"])
async def inference_sft(http: Request, tts_text: FormText, spk_id: FormText, ours: Extensions) -> SessionStream:
    return await _speak(http, SynthesisRequest(tts_text, "sft", voice=spk_id, format="pcm", **ours))


@router.api_route("/inference_zero_shot", methods=["GET", "POST"])
async def inference_zero_shot(http: Request, tts_text: FormText, prompt_text: FormText,
                              prompt_wav: FormFile, ours: Extensions) -> SessionStream:
    return await _speak(http, SynthesisRequest(tts_text, "zero_shot", prompt_audio=await prompt_wav.read(),
                                               transcript=prompt_text, format="pcm", **ours))


@router.api_route("/inference_cross_lingual", methods=["GET", "POST"])
async def inference_cross_lingual(http: Request, tts_text: FormText, prompt_wav: FormFile,
                                  ours: Extensions) -> SessionStream:
    return await _speak(http, SynthesisRequest(tts_text, "cross_lingual", prompt_audio=await prompt_wav.read(),
                                               format="pcm", **ours))


@router.api_route("/inference_instruct", methods=["GET", "POST"])
async def inference_instruct(http: Request, tts_text: FormText, spk_id: FormText,
                             instruct_text: FormText, ours: Extensions) -> SessionStream:
    return await _speak(http, SynthesisRequest(tts_text, "instruct", voice=spk_id, instruction=instruct_text,
                                               format="pcm", **ours))


@router.api_route("/inference_instruct2", methods=["GET", "POST"])
async def inference_instruct2(http: Request, tts_text: FormText, instruct_text: FormText,
                              prompt_wav: FormFile, ours: Extensions) -> SessionStream:
    return await _speak(http, SynthesisRequest(tts_text, "instruct", prompt_audio=await prompt_wav.read(),
                                               instruction=instruct_text, format="pcm", **ours))
