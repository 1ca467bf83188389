"""The bridge contract for a server written in another language that embeds this interpreter: the Rust
``cosyvoice-server`` (``rust/bridge-server``, PyO3). It serves HTTP, ``/health`` and its own Prometheus
metrics; everything that decides an answer is here, so both servers answer alike: the same settings and flags
(:func:`cosyvoice.settings.add_server_arguments`), body parsing and error mapping, prompt audio rules, owners,
and the service's validation, admission, cancellation and encoding.

Calls block (run them on a worker thread, never an event loop). Each answer is an :class:`Answer`: status,
headers, body, and the request's metrics labels.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import time
from typing import Any, NamedTuple

import torch
from pydantic import ValidationError
from starlette.middleware.cors import CORSMiddleware

from cosyvoice.context import StudioContext, load_service
from cosyvoice.encoding import audio_format
from cosyvoice.engine import CancelToken
from cosyvoice.errors import CancelledByShutdown
from cosyvoice.server.bridge import BRIDGE_FIELDS, BridgeSynthesis, contract_request
from cosyvoice.server.common import (
    ServerState,
    cors_options,
    encoded_whole,
    too_large,
    wire_fields,
)
from cosyvoice.server.errors import HttpError, http_error, invalid_body, log_error, undecodable_body
from cosyvoice.server.http_limits import check_json_shape, json_content, slow_body, too_deep
from cosyvoice.server.memory import MemoryKeeper
from cosyvoice.server.operations import readiness
from cosyvoice.server.voices_api import voice_json
from cosyvoice.service import failure_reason, mode_label
from cosyvoice.settings import ServerSettings, add_server_arguments, settings_from_args

logger = logging.getLogger(__name__)

# the bridge contract's address, where neither a flag nor COSYVOICE_HOST/COSYVOICE_PORT says otherwise
CONTRACT_ADDRESS = {"COSYVOICE_HOST": "0.0.0.0", "COSYVOICE_PORT": "3000"}


# the HTTP front's bounds (rust/http-front), as the settings name them
HTTP_FIELDS = ("header_timeout_seconds", "body_timeout_seconds", "body_min_bytes_per_second",
               "keep_alive_timeout_seconds", "max_connections", "max_json_depth")


class Answer(NamedTuple):
    """One HTTP answer, and what the metrics count of it (``reason`` is ``None`` for a success)."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes
    mode: str = "unknown"
    reason: str | None = None
    audio_seconds: float = 0.0


def _json(body: object, status: int, headers: dict[str, str] | None = None) -> Answer:
    response_headers = [("content-type", "application/json"), *(headers or {}).items()]
    return Answer(status, response_headers, json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode())


def _error_answer(error: HttpError) -> Answer:
    response = error.response()
    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in response.raw_headers
               if k != b"content-length"]
    return Answer(error.status, headers, bytes(response.body))


def parse_body(raw: bytes, content_type: str | None, settings: ServerSettings) -> BridgeSynthesis:
    """A ``POST /synthesize`` body, refused as the REST server refuses it (:func:`invalid_body`, and
    :func:`~cosyvoice.server.http_limits.check_json_shape` before ``json.loads`` recurses into a deep one or
    builds millions of values)."""
    if not raw:
        raise invalid_body([{"type": "missing", "loc": ("body",), "msg": "Field required"}])
    body: object = raw
    if json_content(content_type):
        check_json_shape(raw, settings.max_json_depth, settings.max_json_values)
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise invalid_body([{"type": "json_invalid", "ctx": {"error": exc.msg}}]) from exc
        except UnicodeDecodeError as exc:  # as the REST server answers a body it cannot decode
            raise undecodable_body(exc) from exc
    try:
        return BridgeSynthesis.model_validate(body, from_attributes=True)
    except ValidationError as exc:
        raise invalid_body(exc.errors()) from exc


class EmbeddedBridge:
    """The service behind one embedding server: built from the server's command line, loaded once."""

    def __init__(self, argv: list[str]) -> None:
        parser = argparse.ArgumentParser(prog="cosyvoice-server",
                                         description="CosyVoice3 bridge server (the contract's routes, in Rust)")
        add_server_arguments(parser)
        parser.add_argument("--log-level", default="info")
        args = parser.parse_args(argv)
        settings, self.limits = settings_from_args(args, {**CONTRACT_ADDRESS, **os.environ})
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.state = ServerState(StudioContext(settings, limits=self.limits))  # the process's one context
        # few malloc arenas and a trim when idle, as the REST server: each request runs on a thread of its own
        self._memory = contextlib.ExitStack()
        self._memory.enter_context(MemoryKeeper(lambda: self.state.loaded))

    @property
    def settings(self) -> ServerSettings:
        return self.state.settings

    def config(self) -> str:
        """What the embedding server enforces itself, as JSON: where to listen, the keys, the body bound, the
        drain's grace, CORS (starlette's own header values, so both servers send the same) and the answers
        it gives without asking Python (401, 413, 404, 405)."""
        s = self.settings
        refusals = {
            "unauthorized": HttpError(401, "unauthorized", "missing or wrong API key: send 'Authorization: Bearer KEY'",
                                      headers={"WWW-Authenticate": "Bearer"}),
            "payload_too_large": http_error(too_large(s.max_body_bytes), s),
            "not_found": HttpError(404, "not_found", "Not Found"),
            "method_not_allowed": HttpError(405, "method_not_allowed", "Method Not Allowed"),
            "request_timeout": slow_body(s),
            "json_too_deep": http_error(too_deep(s.max_json_depth), s),
            "over_capacity": HttpError(503, "busy", "the server has too many connections open; retry shortly",
                                       headers={"Retry-After": str(s.retry_after_seconds)}),
        }
        return json.dumps({
            "host": s.host, "port": s.port, "api_keys": [*s.api_keys, *s.admin_keys],
            "max_body_bytes": s.max_body_bytes,
            "shutdown_grace_seconds": s.shutdown_grace_seconds, "model_dir": s.model_dir, "cors": _cors(s),
            "http": {name: getattr(s, name) for name in HTTP_FIELDS},
            "refusals": {name: _answer_json(_error_answer(error)) for name, error in refusals.items()},
        })

    def load(self) -> str | None:
        """Load the model (minutes for a real one): ``None``, or the failure (logged) as key holders see it."""
        started = time.perf_counter()
        s = self.settings
        try:
            self.state.install(load_service(s, self.limits))
        except BaseException as exc:  # the server keeps answering: /health, /ready and requests say it failed
            logger.exception("loading the model failed")
            self.state.context.load_error = f"{type(exc).__name__}: {exc}"
            return self.state.context.load_error
        logger.info("loaded %s in %.1f s; serving", s.model_dir, time.perf_counter() - started)
        return None

    def synthesize(self, raw: bytes, content_type: str | None, authorization: str, cancel: CancelToken) -> Answer:
        """``POST /synthesize``: a complete WAV, or the REST server's error. ``cancel`` (the client left, or
        the server drains) stops the engine within one LLM step and frees the slot."""
        started, mode = time.perf_counter(), "unknown"
        try:
            body = parse_body(raw, content_type, self.settings)
            with wire_fields(BRIDGE_FIELDS):
                request = contract_request(body, self.settings)
                mode = mode_label(request.mode)
                service = self.state.service()
                with service.synthesize(request, cancel=cancel, owner=self._owner(authorization)) as session:
                    pieces = [chunk.pcm for chunk in session]
            # the Rust front cancelled its token (the client left, or its connection closed at shutdown): no
            # whole answer, and nobody hears it; the service's own drain raises from the session instead
            if cancel.cancelled:  # the session counted it
                cancelled = CancelledByShutdown()
                cancelled._outcome_reported = True
                raise cancelled
            pcm = torch.cat(pieces) if pieces else torch.zeros(0)
            encoded, headers = encoded_whole(pcm, audio_format("wav"), session.sample_rate)
            return Answer(200, [("content-type", "audio/wav"), *headers.items()], encoded, mode, None,
                          pcm.numel() / session.sample_rate)
        except Exception as exc:
            if self.state.loaded is not None:
                self.state.loaded.report_failure(mode, exc, started)
            error = http_error(exc, self.settings)
            log_error(error, exc, "POST /synthesize")
            answer = _error_answer(error)
            return answer._replace(mode=mode, reason="cancelled" if cancel.cancelled else failure_reason(exc))

    def speakers(self, authorization: str) -> Answer:
        """``GET /speakers``: the saved voices this caller sees."""
        try:
            voices = self.state.service().list_voices(owner=self._owner(authorization))
        except Exception as exc:
            error = http_error(exc, self.settings)
            log_error(error, exc, "GET /speakers")
            return _error_answer(error)
        return _json({"speakers": [voice_json(v) for v in voices]}, 200)

    def ready(self, authorization: str) -> Answer:
        """``GET /ready``: as the REST server answers it."""
        holder = self.state.owners.keyed and self.state.owners.identify(authorization) is not None
        body, status = readiness(self.state, not self.state.owners.keyed or holder, holder)
        return _json(body, status)

    def drain(self, grace_seconds: float) -> None:
        """Shutting down: refuse new requests, let running ones finish for ``grace_seconds``, cancel the rest."""
        if self.state.loaded is not None:
            asyncio.run(self.state.loaded.drain(grace_seconds))
        self._memory.close()

    def _owner(self, authorization: str) -> str | None:
        """Who calls (:mod:`cosyvoice.owners`; the Rust server has refused a wrong key already)."""
        caller = self.state.owners.identify(authorization)
        return None if caller is None else caller.owner


def _answer_json(answer: Answer) -> dict[str, Any]:
    return {"status": answer.status, "headers": answer.headers, "body": answer.body.decode()}


def _cors(settings: ServerSettings) -> dict[str, Any] | None:
    """The CORS policy as the values starlette's middleware computes from :func:`cors_options`."""
    options = cors_options(settings)
    if options is None:
        return None
    cors = CORSMiddleware(None, **options)
    return {"allow_origins": list(cors.allow_origins), "allow_all_origins": cors.allow_all_origins,
            "allow_credentials": cors.allow_credentials, "allow_methods": list(cors.allow_methods),
            "allow_all_headers": cors.allow_all_headers, "allow_headers": list(cors.allow_headers),
            "preflight_explicit_allow_origin": cors.preflight_explicit_allow_origin,
            "allow_private_network": cors.allow_private_network,
            "simple_headers": cors.simple_headers, "preflight_headers": cors.preflight_headers}
