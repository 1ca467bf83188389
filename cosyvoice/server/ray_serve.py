"""Ray Serve deployment: CosyVoice3 replicas (one per GPU, or CPU replicas) behind Serve's HTTP proxy.

Each replica owns one :class:`~cosyvoice.service.TTSService` (the model on its device and the voice library);
this module only translates JSON bodies into service requests and the audio into MP3 through
:mod:`cosyvoice.encoding`. Routes (POST, JSON; answer ``audio/mpeg``)::

    /v1/model/cosyvoice/tts            a voice speaks: instruction -> instruct, voice_type -> its saved voice
                                       (zero-shot if it has a transcript), reference_text -> zero-shot,
                                       else cross-lingual
    /v1/model/cosyvoice/zero_shot      clone reference_audio (+ reference_text) or voice_type
    /v1/model/cosyvoice/cross_lingual  any language in the voice of reference_audio or voice_type
    /v1/model/cosyvoice/instruct       follow instruction, in the voice of reference_audio or voice_type
    /v1/model/cosyvoice/healthcheck    GET: the replica's status (JSON)

Body fields: ``text``, ``voice_type`` (a saved or built-in voice, by id or name), ``reference_audio``
(base64 of an audio file: WAV, FLAC, MP3, ...), ``reference_text``, ``instruction``, ``speed``, ``seed``,
``stream`` (true: MP3 frames are sent chunk by chunk as the model speaks). Featurised reference audio is
cached by the voice library, so a client that sends the same recording again skips the featurisation.

Run it with ``serve run cosyvoice.server.ray_serve:app_builder model_dir=DIR`` or deploy
``cosyvoice/server/ray_serve.yaml`` (``serve deploy``); :class:`ServeArgs` lists the arguments.
"""

# no "from __future__ import annotations": FastAPI must see the real types through serve.ingress
import base64
import binascii
import json
import logging
from dataclasses import asdict, fields

import ray
import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict
from ray import serve

from cosyvoice.encoding import audio_format, encode_audio
from cosyvoice.errors import CosyVoiceError, InvalidInputError
from cosyvoice.server.rest import HttpError, audio_stream, http_error, wire_fields
from cosyvoice.service import SynthesisRequest, TTSService
from cosyvoice.settings import Limits, ServerSettings

logger = logging.getLogger(__name__)

ROUTE_PREFIX = "/v1/model/cosyvoice"
MP3 = audio_format("mp3")
BODY_FIELDS = ("text", "voice_type", "reference_audio", "reference_text", "instruction", "speed", "seed", "stream")
# service field -> body field, so that errors name what the client sent
RAY_FIELDS = {"voice": "voice_type", "prompt_audio": "reference_audio", "transcript": "reference_text"}
_ROUTE_MODES = {"zero_shot": "zero_shot", "cross_lingual": "cross_lingual", "instruct": "instruct"}

api = FastAPI(title="CosyVoice3 on Ray Serve", docs_url=None, redoc_url=None)


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


def synthesis_request(route: str, body: object) -> SynthesisRequest:
    """A JSON body of ``route`` -> the service request (the service validates values and types)."""
    if not isinstance(body, dict):
        raise InvalidInputError("the body must be a JSON object", "body")
    unknown = sorted(set(body) - set(BODY_FIELDS))
    if unknown:
        raise InvalidInputError(f"unknown field(s) {', '.join(unknown)}; use {', '.join(BODY_FIELDS)}", unknown[0])
    audio = body.get("reference_audio")
    if audio is not None:
        if not isinstance(audio, str):
            raise InvalidInputError("reference_audio must be a base64 string of an audio file", "reference_audio")
        try:
            audio = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise InvalidInputError(f"reference_audio is not valid base64 ({exc})", "reference_audio") from exc
    voice = body.get("voice_type")
    text, instruction = body.get("text", ""), body.get("instruction") or ""
    if route == "tts":
        mode = ("instruct" if instruction else "sft" if voice is not None and audio is None
                else "zero_shot" if body.get("reference_text") else "cross_lingual")
    else:
        mode = _ROUTE_MODES[route]
    return SynthesisRequest(text, mode, voice=voice, prompt_audio=audio, transcript=body.get("reference_text") or "",
                            instruction=instruction, speed=body.get("speed", 1.0), seed=body.get("seed"),
                            stream=body.get("stream", False), format=MP3.name)


class BodyTooLarge(InvalidInputError):
    """A request body over ``max_body_bytes``: 413, as from the REST server."""


async def _read_json(request: Request, max_bytes: int) -> object:
    """The JSON body, refused once it grows past ``max_bytes`` (while reading, not after)."""
    declared = request.headers.get("content-length")
    too_large = f"request body larger than {max_bytes} bytes (COSYVOICE_MAX_BODY_BYTES / max_body_bytes)"
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge(too_large)
    data = bytearray()
    async for part in request.stream():
        data += part
        if len(data) > max_bytes:
            raise BodyTooLarge(too_large)
    try:
        return json.loads(data)
    except ValueError as exc:
        raise InvalidInputError(f"the body is not valid JSON ({exc})", "body") from exc


# Serve pickles the class when it is decorated: whatever its methods call must be defined above it.
@serve.deployment(name="CosyVoice3", health_check_period_s=10, graceful_shutdown_timeout_s=30)
@serve.ingress(api)
class CosyVoiceDeployment:
    """One replica: the model on this replica's device (its GPU, else CPU) and the voice library."""

    def __init__(self, model_dir: str, voice_dir: str, device: str | None = None,
                 limits: dict[str, int | float] | None = None, max_body_bytes: int | None = None) -> None:
        self.settings = ServerSettings.from_env()
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")  # CPU fallback without a GPU
        self.limits = Limits.from_env(**(limits or {}))
        self.max_body_bytes = max_body_bytes or self.settings.max_body_bytes
        self.service = TTSService.load(model_dir, voice_dir, device=self.device, limits=self.limits)
        logger.info("CosyVoice3 replica ready on %s (%s)", self.device, model_dir)

    def check_health(self) -> None:
        """Ray's replica health check: the engine must still answer (a replica that raises is replaced)."""
        _ = self.service.active_sessions

    @api.get(f"{ROUTE_PREFIX}/healthcheck")
    async def healthcheck(self) -> dict:
        status = self.service.status()
        return {"status": "ok", "device": self.device, "replica": serve.get_replica_context().replica_id.unique_id,
                **asdict(status)}

    @api.post(f"{ROUTE_PREFIX}/tts")
    async def tts(self, request: Request) -> Response:
        return await self._speak("tts", request)

    @api.post(f"{ROUTE_PREFIX}/zero_shot")
    async def zero_shot(self, request: Request) -> Response:
        return await self._speak("zero_shot", request)

    @api.post(f"{ROUTE_PREFIX}/cross_lingual")
    async def cross_lingual(self, request: Request) -> Response:
        return await self._speak("cross_lingual", request)

    @api.post(f"{ROUTE_PREFIX}/instruct")
    async def instruct(self, request: Request) -> Response:
        return await self._speak("instruct", request)

    async def _speak(self, route: str, request: Request) -> Response:
        """Errors answer as the REST server's do (one JSON shape, busy 503 with Retry-After); a streamed answer
        is cancelled when the client goes away."""
        try:
            synthesis = synthesis_request(route, await _read_json(request, self.max_body_bytes))
        except BodyTooLarge as exc:
            return HttpError(413, "payload_too_large", str(exc)).response()
        except CosyVoiceError as exc:
            return http_error(exc, self.settings).response()
        try:
            with wire_fields(RAY_FIELDS):
                session = await self.service.asynthesize(synthesis)  # validated and admitted, or raises
                if session.prepared.stream:
                    return audio_stream(session, MP3.name)
                try:
                    pcm = [chunk.pcm async for chunk in session]
                finally:
                    await session.aclose()
        except CosyVoiceError as exc:
            error = http_error(exc, self.settings)
            if error.status >= 500:
                logger.error("%s failed: %s", route, exc)
            return error.response()
        audio = encode_audio(torch.cat(pcm) if pcm else torch.zeros(0), MP3, session.sample_rate)
        return Response(audio, media_type=MP3.content_type)


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
        dict(args.limits), args.max_body_bytes)
