"""Saved voices over REST: ``POST /v1/voices`` (multipart), ``GET /v1/voices[/{voice}]``,
``DELETE /v1/voices/{voice}``. Each call names its ``owner`` (from the API key) to the service, which decides
what that client may see and change."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import JSONResponse

from cosyvoice.server.common import request_owner, service_of
from cosyvoice.voices import VoiceInfo

router = APIRouter(tags=["voices"])


def voice_json(info: VoiceInfo) -> dict[str, Any]:
    return {"id": info.id, "object": "voice", "name": info.name, "transcript": info.transcript,
            "created": int(info.created)}


@router.post("/v1/voices", status_code=201)
async def create_voice(http: Request, name: Annotated[str, Form()], audio: Annotated[UploadFile, File()],
                       transcript: Annotated[str, Form()] = "") -> JSONResponse:
    data = await audio.read()
    service, owner = service_of(http), request_owner(http)
    info = await asyncio.to_thread(lambda: service.create_voice(name, data, transcript, owner=owner))
    return JSONResponse(voice_json(info), 201)


@router.get("/v1/voices")
async def list_voices(http: Request) -> JSONResponse:
    voices = service_of(http).list_voices(owner=request_owner(http))
    return JSONResponse({"object": "list", "data": [voice_json(v) for v in voices]})


@router.get("/v1/voices/{voice}")
async def get_voice(http: Request, voice: str) -> JSONResponse:
    return JSONResponse(voice_json(service_of(http).get_voice(voice, owner=request_owner(http))))


@router.delete("/v1/voices/{voice}")
async def delete_voice(http: Request, voice: str) -> JSONResponse:
    service, owner = service_of(http), request_owner(http)
    info = await asyncio.to_thread(lambda: service.delete_voice(voice, owner=owner))
    return JSONResponse({**voice_json(info), "deleted": True})
