"""Ray Serve deployment: CosyVoice3 replicas (one per GPU, or CPU replicas) behind Serve's HTTP proxy.

Each replica owns one :class:`~cosyvoice.service.TTSService` (the model on its device and the voice library)
and serves :data:`router` through the REST server's app (:func:`cosyvoice.server.rest.create_app`: the same
error mapping, body limit, API keys and CORS), built in the replica from its settings. Routes (answer
``audio/mpeg``)::

    POST /v1/model/cosyvoice/tts            a voice speaks: instruction -> instruct, voice_type -> its saved
                                            voice (zero-shot if it has a transcript), reference_text ->
                                            zero-shot, else cross-lingual
    POST /v1/model/cosyvoice/zero_shot      clone reference_audio (+ reference_text) or voice_type
    POST /v1/model/cosyvoice/cross_lingual  any language in the voice of reference_audio or voice_type
    POST /v1/model/cosyvoice/instruct       follow instruction, in the voice of reference_audio or voice_type
    GET|POST /v1/model/cosyvoice/healthcheck  {"status": "healthy"}

Bodies are JSON, or forms (multipart/form-data with ``reference_audio`` as a file). Fields: ``text``, ``voice_type``
(a saved or built-in voice, by id or name; optional: ``default_voice``, whose alias is ``"qwen"``, speaks when
neither it nor ``reference_audio`` is given), ``reference_audio`` (base64 of an audio file, a path inside
``allowed_audio_dir``, or the uploaded file), ``reference_text``, ``instruction``, ``speed``, ``seed``,
``steps`` (the flow's Euler steps), ``final`` and ``first_hop`` (the chunk schedule), ``stream`` (true: MP3 frames
are sent chunk by chunk as the model speaks).

Run it with ``serve run cosyvoice.server.ray_serve:app_builder model_dir=DIR`` or deploy
``cosyvoice/server/ray_serve.yaml`` (``serve deploy``); :class:`ServeArgs` lists the arguments.
"""

from __future__ import annotations

import json
import logging
from dataclasses import fields, replace
from typing import Any

import ray
import torch
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict
from ray import serve
from starlette.datastructures import UploadFile

from cosyvoice.context import load_service
from cosyvoice.encoding import audio_format
from cosyvoice.errors import InvalidInputError
from cosyvoice.server.common import (
    audio_argument,
    audio_stream,
    request_owner,
    server_state,
    service_of,
    while_connected,
    whole_file,
    wire_fields,
)
from cosyvoice.service import SynthesisRequest
from cosyvoice.settings import Limits, ServerSettings
from cosyvoice.voices import BUILTIN_VOICE_DIR

logger = logging.getLogger(__name__)

ROUTE_PREFIX = "/v1/model/cosyvoice"
MP3 = audio_format("mp3")
BODY_FIELDS = ("text", "voice_type", "reference_audio", "reference_text", "instruction", "speed", "seed", "steps",
               "final", "first_hop", "stream")
DEFAULT_VOICE_ALIAS = "qwen"  # the Ray seed contract's name for its default voice
# service field -> body field, so that errors name what the client sent
RAY_FIELDS = {"voice": "voice_type", "prompt_audio": "reference_audio", "transcript": "reference_text"}
_ROUTE_MODES = {"zero_shot": "zero_shot", "cross_lingual": "cross_lingual", "instruct": "instruct"}

router = APIRouter(prefix=ROUTE_PREFIX, tags=["ray"])


class ServeArgs(BaseModel):
    """``serve run ... key=value`` / the config file's ``args``; unset values come from ``COSYVOICE_*``."""

    model_config = ConfigDict(extra="forbid")

    model_dir: str | None = None  # a model folder or ModelScope id (default: COSYVOICE_MODEL_DIR / settings)
    voice_dir: str | None = None  # the voice library; share it with the REST server and the web UI
    device: str | None = None  # None: the replica's GPU if Ray gave it one, else CPU
    num_gpus: float | None = None  # per replica; None: 1 where the cluster has GPUs, else 0 (CPU replicas)
    num_cpus: float = 1.0  # per replica
    num_replicas: int | None = None  # a fixed count; None: autoscale between min_replicas and max_replicas
    min_replicas: int = 1
    max_replicas: int | None = None  # None: one per GPU in the cluster (1 without GPUs)
    limits: dict[str, int | float] = {}  # Limits overrides per replica, e.g. {"max_sessions": 8}
    max_body_bytes: int | None = None  # one request body (base64 audio included)
    default_voice: str | None = None  # spoken when a body names no voice (COSYVOICE_DEFAULT_VOICE)
    allowed_audio_dir: str | None = None  # reference_audio given as a path must lie in it
    cors_origins: list[str] | None = None  # browser origins allowed to call (COSYVOICE_CORS_ORIGINS)

    def settings(self) -> dict[str, Any]:
        """The :class:`ServerSettings` overrides these arguments make."""
        given = {"max_body_bytes": self.max_body_bytes, "default_voice": self.default_voice,
                 "allowed_audio_dir": self.allowed_audio_dir,
                 "cors_origins": None if self.cors_origins is None else tuple(self.cors_origins)}
        return {k: v for k, v in given.items() if v is not None}


def synthesis_request(route: str, body: object, settings: ServerSettings) -> SynthesisRequest:
    """A body of ``route`` -> the service request (the service validates values and types)."""
    if not isinstance(body, dict):
        raise InvalidInputError("the body must be a JSON object", "body")
    unknown = sorted(set(body) - set(BODY_FIELDS))
    if unknown:
        raise InvalidInputError(f"unknown field(s) {', '.join(unknown)}; use {', '.join(BODY_FIELDS)}", unknown[0])
    audio = body.get("reference_audio")
    if audio is not None and not isinstance(audio, bytes):  # an uploaded file arrives as bytes
        audio = audio_argument(audio, settings, "reference_audio")
    voice = body.get("voice_type")
    if voice == DEFAULT_VOICE_ALIAS or (voice is None and audio is None):
        voice = settings.default_voice
    text, instruction = body.get("text", ""), body.get("instruction") or ""
    if route == "tts":
        mode = ("instruct" if instruction else "sft" if audio is None
                else "zero_shot" if body.get("reference_text") else "cross_lingual")
    else:
        mode = _ROUTE_MODES[route]
    return SynthesisRequest(text, mode, voice=voice, prompt_audio=audio, transcript=body.get("reference_text") or "",
                            instruction=instruction, speed=body.get("speed", 1.0), seed=body.get("seed"),
                            steps=body.get("steps"), final=body.get("final"), first_hop=body.get("first_hop"),
                            stream=body.get("stream", False), format=MP3.name)


async def read_body(http: Request) -> dict[str, Any]:
    """A JSON body, or a form (multipart with ``reference_audio`` as a file, or url-encoded; numbers and booleans
    as text). The app's body limit bounds them while they are read."""
    if http.headers.get("content-type", "").startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        form = await http.form(max_files=1, max_fields=len(BODY_FIELDS))
        return {key: await value.read() if isinstance(value, UploadFile) else _form_value(key, value)
                for key, value in form.multi_items()}
    try:
        return json.loads(await http.body())
    except (ValueError, RecursionError) as exc:  # RecursionError: a body not sent as JSON, so not screened as JSON
        raise InvalidInputError(f"the body is not valid JSON ({exc})", "body") from exc


def _form_value(name: str, value: str) -> object:
    """A form field's text as the JSON value it stands for."""
    try:
        if name == "speed":
            return float(value)
        if name in ("seed", "steps", "first_hop"):
            return int(value)
    except ValueError as exc:
        raise InvalidInputError(f"{name} must be a number, got {value!r}", name) from exc
    if name == "stream":
        if value.lower() not in ("true", "false", "1", "0"):
            raise InvalidInputError(f"stream must be true or false, got {value!r}", name)
        return value.lower() in ("true", "1")
    return value


async def _speak(route: str, http: Request) -> Response:
    """Streamed (cancelled when the client goes away) or collected then encoded whole."""
    request = synthesis_request(route, await read_body(http), server_state(http).settings)  # names body fields
    with wire_fields(RAY_FIELDS):
        session = await while_connected(http.receive,
                                        service_of(http).asynthesize(request, owner=request_owner(http)))
    if session.prepared.stream:
        return audio_stream(session, MP3)
    return await whole_file(session, MP3, http.receive)


@router.api_route("/healthcheck", methods=["GET", "POST"])
async def healthcheck() -> dict[str, str]:
    return {"status": "healthy"}


@router.post("/tts")
async def tts(http: Request) -> Response:
    return await _speak("tts", http)


@router.post("/zero_shot")
async def zero_shot(http: Request) -> Response:
    return await _speak("zero_shot", http)


@router.post("/cross_lingual")
async def cross_lingual(http: Request) -> Response:
    return await _speak("cross_lingual", http)


@router.post("/instruct")
async def instruct(http: Request) -> Response:
    return await _speak("instruct", http)


# Serve pickles the class when it is decorated: whatever its methods call must be defined above it.
@serve.deployment(name="CosyVoice3", health_check_period_s=10, graceful_shutdown_timeout_s=30)
@serve.ingress()
class CosyVoiceDeployment:
    """One replica: the model on this replica's device (its GPU, else CPU), the voice library (with the
    built-in voices, so that a default voice exists) and the app serving :data:`router`."""

    def __init__(self, model_dir: str, voice_dir: str, device: str | None = None,
                 limits: dict[str, int | float] | None = None, settings: dict[str, Any] | None = None) -> None:
        # the voice folder also places the data folder (long-form, workbench, jobs): one for every replica
        self.settings = ServerSettings.from_env(**{"voice_dir": voice_dir, **(settings or {})})
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")  # CPU fallback without a GPU
        self.limits = Limits.from_env(**(limits or {}))
        self.service = load_service(replace(self.settings, model_dir=model_dir, device=self.device), self.limits,
                                    builtin_dir=BUILTIN_VOICE_DIR)
        logger.info("CosyVoice3 replica ready on %s (%s)", self.device, model_dir)

    def __serve_build_asgi_app__(self) -> FastAPI:
        from cosyvoice.server.rest import create_app

        return create_app(self.settings, self.service, routers=(router,))

    def check_health(self) -> None:
        """Ray's replica health check: the engine must still answer (a replica that raises is replaced)."""
        _ = self.service.active_sessions


def _cluster_gpus() -> float:
    """GPUs Ray can schedule (the builder runs connected to the cluster), else this machine's."""
    if ray.is_initialized():
        return float(ray.cluster_resources().get("GPU", 0))
    return float(torch.cuda.device_count())


def deployment_options(args: ServeArgs, cluster_gpus: float) -> dict:
    """Serve options of the deployment: GPUs per replica, replica count or autoscaling, requests per replica."""
    num_gpus = args.num_gpus if args.num_gpus is not None else (1.0 if cluster_gpus else 0.0)
    limits = Limits.from_env(**args.limits)
    options: dict = {
        "ray_actor_options": {"num_gpus": num_gpus, "num_cpus": args.num_cpus},
        # the service admits max_sessions at once and queues max_queued_requests more, then answers 503
        "max_ongoing_requests": limits.max_sessions + limits.max_queued_requests,
    }
    if args.num_replicas is not None:
        options["num_replicas"] = args.num_replicas
    else:
        per_gpu = int(cluster_gpus // num_gpus) if num_gpus else 1  # one replica per GPU
        options["autoscaling_config"] = {
            "min_replicas": args.min_replicas,
            "max_replicas": max(args.min_replicas, args.max_replicas or per_gpu),
            "target_ongoing_requests": limits.max_sessions,  # scale out when replicas are saturated
        }
    return options


def app_builder(args: ServeArgs | dict | None = None) -> serve.Application:
    """The application for ``serve run`` / ``serve deploy``: replicas sized from ``args`` and the cluster."""
    args = args if isinstance(args, ServeArgs) else ServeArgs(**(args or {}))
    bad = set(args.limits) - {f.name for f in fields(Limits)}
    if bad:
        raise ValueError(f"unknown limit(s) {', '.join(sorted(bad))}; see cosyvoice.settings.Limits")
    settings = ServerSettings.from_env()
    return CosyVoiceDeployment.options(**deployment_options(args, _cluster_gpus())).bind(
        args.model_dir or settings.model_dir, args.voice_dir or settings.voice_dir, args.device,
        dict(args.limits), args.settings())
