"""gRPC server speaking the official CosyVoice wire format (``cosyvoice.proto``), over the service layer.

``python -m cosyvoice.server.grpc --port 50000 --max_conc 4 --model-dir DIR`` (console script
``cosyvoice-grpc``). The official ``runtime/python/grpc/client.py`` works unchanged: its four request
types arrive with prompt audio as PCM16LE 16 kHz, and ``Response.tts_audio`` messages carry PCM16LE
24 kHz chunks as the engine produces them. The proto's additions (saved voices, instruct2 prompt
audio, seed, speed, stream, final, first_hop) are documented in the .proto and docs/servers.md.

This module only translates: proto messages into a :class:`~cosyvoice.service.SynthesisRequest`, and
service errors into status codes (messages are one line, never a traceback):

* ``INVALID_ARGUMENT`` bad input; the message starts with the proto field, e.g. ``sft_request.tts_text: ...``;
* ``NOT_FOUND`` an unknown saved voice (``spk_id`` / ``voice_id``);
* ``RESOURCE_EXHAUSTED`` busy: every synthesis slot is taken and the wait queue is full (retry later);
* ``UNAVAILABLE`` the model is still loading; ``UNAUTHENTICATED`` API keys are configured and none was sent;
* ``CANCELLED`` is what a client that went away sees; its session is cancelled and its slot freed;
* ``INTERNAL`` the model failed (the message says no more; the server log has the details).

With API keys configured, the Prometheus port (``--metrics-port``) wants the same ``Authorization: Bearer``
key. On SIGTERM the server refuses new calls, gives running streams ``--shutdown-grace-seconds``, then
cancels them (each engine session stops within one LLM step).

The standard health service (``grpc.health.v1.Health``) reports SERVING for ``""`` and
``cosyvoice.CosyVoice`` once the model is loaded, NOT_SERVING while loading and while shutting down;
server reflection lets ``grpcurl`` call it without the .proto file.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import numpy as np
import torch
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cosyvoice.context import load_service
from cosyvoice.encoding import to_pcm16
from cosyvoice.errors import (
    ConfigError,
    CosyVoiceError,
    InvalidInputError,
    NotFoundError,
    ResourceLimitError,
    command_line_errors,
)
from cosyvoice.owners import Owners
from cosyvoice.server.memory import MemoryKeeper
from cosyvoice.server.metrics import ServiceMetrics
from cosyvoice.server.proto import cosyvoice_pb2 as pb
from cosyvoice.server.proto import cosyvoice_pb2_grpc as pb_grpc
from cosyvoice.service import SynthesisRequest, TTSService
from cosyvoice.settings import add_server_arguments, settings_from_args
from cosyvoice.system.signals import wait_in_main_thread

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["CosyVoice"].full_name  # "cosyvoice.CosyVoice"
PROMPT_SAMPLE_RATE = 16000  # the official client sends prompt audio resampled to 16 kHz
DEFAULT_PORT = 50000
DEFAULT_MAX_CONC = 4
SPARE_THREADS = 4  # beyond --max_conc: health checks and "busy" answers never wait for a running stream
MAX_AUDIO_MESSAGE_BYTES = 1 << 20  # ~22 s of audio; gRPC clients refuse messages over 4 MiB by default
INTERNAL_MESSAGE = "synthesis failed; the server log has the details"  # never a path or an exception's text
# a status message travels as trailing metadata, which clients refuse over 16 KiB (the whole call then ends in
# RESOURCE_EXHAUSTED): an error that quotes a huge value is cut, UTF-8 at most 4 bytes a character
MAX_DETAILS_CHARS = 2000


def prompt_audio(data: bytes) -> tuple[np.ndarray, int] | None:
    """Raw PCM16LE mono 16 kHz bytes (the official client's encoding) -> ``(float32 samples, 16000)``;
    ``None`` when empty (the request names a saved voice instead)."""
    if not data:
        return None
    if len(data) % 2:
        raise InvalidInputError(f"must be raw PCM16LE mono {PROMPT_SAMPLE_RATE} Hz samples (an even number of "
                                f"bytes), got {len(data)} bytes", "prompt_audio")
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 2**15, PROMPT_SAMPLE_RATE


# service field -> proto field, per request type: errors name the field the client actually set
_PROTO_FIELDS = {
    "sft_request": {"text": "tts_text", "voice": "spk_id"},
    "zero_shot_request": {"text": "tts_text", "transcript": "prompt_text", "prompt_audio": "prompt_audio",
                          "voice": "voice_id"},
    "cross_lingual_request": {"text": "tts_text", "prompt_audio": "prompt_audio", "voice": "voice_id"},
    "instruct_request": {"text": "tts_text", "voice": "spk_id", "instruction": "instruct_text",
                         "prompt_audio": "prompt_audio"},
}
PAYLOADS = tuple(_PROTO_FIELDS)
_MODES = {"sft_request": "sft", "zero_shot_request": "zero_shot", "cross_lingual_request": "cross_lingual",
          "instruct_request": "instruct"}  # the metrics label of each request type


def synthesis_request(request: pb.Request) -> SynthesisRequest:
    """The service request a proto ``Request`` states. Unset proto3 optionals keep the service defaults,
    except ``stream``, on by default so that audio arrives while the rest is still being generated."""
    kind = request.WhichOneof("RequestPayload")
    if kind is None:
        raise InvalidInputError(f"the request sets none of {', '.join(PAYLOADS)}", "RequestPayload")
    options = {"seed": request.seed if request.HasField("seed") else None,
               "speed": request.speed if request.HasField("speed") else 1.0,
               "stream": request.stream if request.HasField("stream") else True,
               "final": request.final if request.HasField("final") else None,
               "first_hop": request.first_hop if request.HasField("first_hop") else None,
               "steps": request.steps if request.HasField("steps") else None}
    p = getattr(request, kind)
    if kind == "sft_request":
        return SynthesisRequest(p.tts_text, "sft", voice=p.spk_id or None, **options)
    if kind == "zero_shot_request":
        return SynthesisRequest(p.tts_text, "zero_shot", voice=p.voice_id or None,
                                prompt_audio=prompt_audio(p.prompt_audio), transcript=p.prompt_text, **options)
    if kind == "cross_lingual_request":
        return SynthesisRequest(p.tts_text, "cross_lingual", voice=p.voice_id or None,
                                prompt_audio=prompt_audio(p.prompt_audio), **options)
    return SynthesisRequest(p.tts_text, "instruct", voice=p.spk_id or None, prompt_audio=prompt_audio(p.prompt_audio),
                            instruction=p.instruct_text, **options)


def parse_request(data: bytes) -> pb.Request | bytes:
    """A ``Request`` from the wire, or the bytes as they came when they are not one, which ``Inference`` answers
    as INVALID_ARGUMENT (grpc's own deserializer, and any that returns None, is answered INTERNAL)."""
    try:
        return pb.Request.FromString(data)
    except DecodeError:
        return data


def add_servicer(servicer: CosyVoiceServicer, server: grpc.Server) -> None:
    """The generated ``add_CosyVoiceServicer_to_server``, with :func:`parse_request` as the deserializer."""
    handlers = {"Inference": grpc.unary_stream_rpc_method_handler(
        servicer.Inference, request_deserializer=parse_request, response_serializer=pb.Response.SerializeToString)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def audio_messages(pcm: torch.Tensor) -> Iterator[pb.Response]:
    """One chunk's samples as PCM16LE ``Response`` messages (the official scaling); a long non-streamed
    sentence is split so that no message reaches a client's default size limit."""
    data = to_pcm16(pcm).tobytes()
    for start in range(0, len(data), MAX_AUDIO_MESSAGE_BYTES):
        yield pb.Response(tts_audio=data[start:start + MAX_AUDIO_MESSAGE_BYTES])


def status_of(exc: CosyVoiceError, request: pb.Request) -> tuple[grpc.StatusCode, str]:
    """The status code and message for an error; an input error's message starts with the proto field."""
    if isinstance(exc, InvalidInputError):
        code = grpc.StatusCode.NOT_FOUND if isinstance(exc, NotFoundError) else grpc.StatusCode.INVALID_ARGUMENT
        kind = request.WhichOneof("RequestPayload")
        name = _PROTO_FIELDS.get(kind, {}).get(exc.field)
        path = f"{kind}.{name}" if name else exc.field
        return code, _details(f"{path}: {exc}" if path else str(exc))
    if isinstance(exc, ResourceLimitError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, _details(str(exc))
    return grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE


def _details(message: str) -> str:
    return message if len(message) <= MAX_DETAILS_CHARS else message[:MAX_DETAILS_CHARS - 1] + "…"


class CosyVoiceServicer(pb_grpc.CosyVoiceServicer):
    """``Inference`` over a :class:`TTSService`, which :meth:`GrpcServer.serve` hands over once loaded."""

    def __init__(self, owners: Owners) -> None:
        self.service: TTSService | None = None
        self._owners = owners

    def Inference(self, request: pb.Request | bytes, context: grpc.ServicerContext) -> Iterator[pb.Response]:
        owner = self._authorize(context)
        if isinstance(request, bytes):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the message is not a cosyvoice.Request (it cannot "
                                                            "be parsed); see cosyvoice/server/proto/cosyvoice.proto")
        service = self.service
        if service is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry once the health "
                                                       "service reports SERVING")
        try:
            # validated and admitted, or raises
            session = service.synthesize(synthesis_request(request), owner=owner)
        except Exception as exc:
            service.report_failure(_MODES.get(request.WhichOneof("RequestPayload"), "unknown"), exc)
            if not isinstance(exc, CosyVoiceError):
                logger.exception("gRPC Inference failed")
                context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)
            if status_of(exc, request)[0] == grpc.StatusCode.INTERNAL:
                logger.error("gRPC Inference failed", exc_info=exc)
            context.abort(*status_of(exc, request))
        # the client went away (cancel, deadline, dropped connection): the engine stops within one LLM step
        if not context.add_callback(session.cancel):
            session.cancel()
        try:
            with session:  # leaving it (also when grpc drops this generator) frees the engine session
                for chunk in session:
                    yield from audio_messages(chunk.pcm)
        except CosyVoiceError as exc:
            if status_of(exc, request)[0] == grpc.StatusCode.INTERNAL:
                logger.error("gRPC Inference failed", exc_info=exc)
            context.abort(*status_of(exc, request))
        except Exception:
            logger.exception("gRPC Inference failed")
            context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)

    def _authorize(self, context: grpc.ServicerContext) -> str | None:
        """With API keys configured, ``authorization: Bearer <key>`` metadata must carry one of them; returns
        the caller's ``owner`` for the service (:mod:`cosyvoice.owners`)."""
        caller = self._owners.identify(dict(context.invocation_metadata()).get("authorization", ""))
        if caller is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown API key: send metadata "
                                                           "'authorization: Bearer <key>'")
        return caller.owner


class GrpcServer:
    """A started gRPC server: ``CosyVoice`` + health (NOT_SERVING until :meth:`serve` gets the service) +
    reflection (so ``grpcurl`` needs no .proto file)."""

    def __init__(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *, max_streams: int = DEFAULT_MAX_CONC,
                 owners: Owners | None = None) -> None:
        self.owners = owners if owners is not None else Owners()
        # every admitted or queued stream holds a thread; beyond them gRPC refuses at once (RESOURCE_EXHAUSTED)
        workers = max_streams + SPARE_THREADS
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cosyvoice-grpc"),
                                  maximum_concurrent_rpcs=workers)
        self.servicer = CosyVoiceServicer(self.owners)
        add_servicer(self.servicer, self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            self.port = self.server.add_insecure_port(f"{host}:{port}")
        except RuntimeError as exc:
            raise ConfigError(f"cannot listen on {host}:{port} ({exc}); is another server using the port?") from exc
        self.address = f"{host}:{self.port}"
        self._metrics_server = None
        before = set(threading.enumerate())
        self.server.start()
        # grpc's serving thread (a daemon), which :meth:`stop` joins
        self._serving = [t for t in threading.enumerate() if t not in before and t.daemon]

    def serve(self, service: TTSService) -> None:
        """Start answering with ``service``; health turns SERVING."""
        self.servicer.service = service
        self._set_health(health_pb2.HealthCheckResponse.SERVING)

    def stop(self, grace: float | None = 10.0) -> None:
        """Health turns NOT_SERVING at once; running streams get ``grace`` seconds, then are cancelled; returns once
        the engine has let go of them (:meth:`TTSService.settle`)."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()
        # the serving thread signals the stop, then still frees grpc's objects in C++: a process exiting meanwhile
        # ends it there, inside a noexcept frame, and aborts ("terminate called without an active exception")
        for thread in self._serving:
            thread.join(timeout=10)
        if self.servicer.service is not None:
            self.servicer.service.settle()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()

    def serve_metrics(self, host: str, port: int) -> int:
        """Prometheus metrics of the service (the REST server's families) on ``http://host:port/metrics``, behind
        the server's API keys when it has some; call after :meth:`serve`. Returns the port."""
        assert self.servicer.service is not None, "serve() first"
        metrics = ServiceMetrics()
        metrics.attach(self.servicer.service)
        self._metrics_server = ThreadingHTTPServer((host, port), _metrics_handler(metrics, self.owners))
        self._metrics_server.daemon_threads = True
        threading.Thread(target=self._metrics_server.serve_forever, daemon=True, name="cosyvoice-metrics").start()
        return self._metrics_server.server_port

    def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)


def _metrics_handler(metrics: ServiceMetrics, owners: Owners) -> type[BaseHTTPRequestHandler]:
    """``GET /metrics`` (``Authorization: Bearer KEY`` on a server with keys), nothing else."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] != "/metrics":
                self._answer(404, b"not found\n", "text/plain")
            elif owners.keyed and owners.identify(self.headers.get("Authorization", "")) is None:
                self._answer(401, b"missing or wrong API key: send 'Authorization: Bearer KEY'\n", "text/plain",
                             {"WWW-Authenticate": "Bearer"})
            else:
                self._answer(200, metrics.exposition(), metrics.content_type)

        def _answer(self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for name, value in {"Content-Type": content_type, "Content-Length": str(len(body)),
                                **(headers or {})}.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # scrapes every few seconds would flood the log

    return Handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cosyvoice-grpc", description=__doc__.splitlines()[0])
    add_server_arguments(parser)
    parser.add_argument("--max_conc", "--max-conc", type=int, default=None,
                        help=f"concurrent synthesis streams, the official server's flag (default {DEFAULT_MAX_CONC}; "
                             "overrides --max-sessions)")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics on http://HOST:PORT/metrics (default: off)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with command_line_errors():
        settings, limits = settings_from_args(args)
        max_conc = args.max_conc
        if max_conc is None and args.limits_max_sessions is None and "COSYVOICE_MAX_SESSIONS" not in os.environ:
            max_conc = DEFAULT_MAX_CONC
        if max_conc is not None:
            limits = replace(limits, max_sessions=max_conc)
        server = GrpcServer(settings.host, settings.port, max_streams=limits.max_sessions + limits.max_queued_requests,
                            owners=settings.owners())
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    logger.info("gRPC listening on %s; loading %s", server.address, settings.model_dir)
    try:
        server.serve(load_service(settings, limits))
    except CosyVoiceError as exc:
        logger.error("cannot load the model: %s", exc)
        server.stop(0)
        return 2
    logger.info("serving %s on %s (%d concurrent streams)", SERVICE_NAME, server.address, limits.max_sessions)
    if args.metrics_port is not None:
        port = server.serve_metrics(settings.host, args.metrics_port)
        logger.info("metrics on http://%s:%d/metrics", settings.host, port)
    with MemoryKeeper(lambda: server.servicer.service):
        wait_in_main_thread(stopped)
    logger.info("shutting down: running streams may finish within %g s", settings.shutdown_grace_seconds)
    server.stop(settings.shutdown_grace_seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
