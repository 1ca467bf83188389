"""Our errors on HTTP, the one mapping every HTTP adapter uses (the REST routers, the WebSocket, Ray Serve, and
the workbench and long-form routers the web UI mounts too): a JSON body ``{"error": {message, type, field,
param}}``, never a traceback. Light on purpose (no metrics, no torch), so any app can mount those routers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from cosyvoice.errors import (
    ConflictError,
    CosyVoiceError,
    InvalidInputError,
    ModelNotReady,
    NotFoundError,
    PermissionDeniedError,
    ResourceLimitError,
    StorageError,
)
from cosyvoice.settings import ServerSettings

CLIENT_GONE = 499  # nginx's "client closed request": logged, never seen by the client

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HttpError:
    status: int
    type: str
    message: str
    field: str | None = None
    headers: dict[str, str] | None = None

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "field": self.field, "param": self.field}}
        return JSONResponse(body, self.status, headers=self.headers)


def http_error(exc: BaseException, settings: ServerSettings | None = None) -> HttpError:
    """The HTTP form of any exception. Only input and limit errors say what happened (their messages are
    written for users); a model failure's message may hold server paths or internals, so it stays in the log.
    ``settings`` gives a busy answer's Retry-After (default: the default settings')."""
    busy = {"Retry-After": str((settings or ServerSettings()).retry_after_seconds)}
    if isinstance(exc, HTTPException) and exc.status_code == 413:
        return HttpError(413, "payload_too_large", str(exc.detail))
    if isinstance(exc, NotFoundError):
        return HttpError(404, "not_found", str(exc), exc.field)
    if isinstance(exc, ConflictError):
        return HttpError(409, "conflict", str(exc), exc.field)
    if isinstance(exc, InvalidInputError):
        return HttpError(400, "invalid_request_error", str(exc), exc.field)
    if isinstance(exc, ModelNotReady):
        return HttpError(503, "loading", str(exc), None, busy)
    if isinstance(exc, StorageError):  # nothing was saved; retrying will not help until space is freed
        return HttpError(507, "insufficient_storage", str(exc))
    if isinstance(exc, ResourceLimitError):
        return HttpError(503, "busy", str(exc), None, busy)
    if isinstance(exc, PermissionDeniedError):
        return HttpError(403, "permission_denied", str(exc))
    if isinstance(exc, CosyVoiceError):
        return HttpError(500, "model_error", "synthesis failed; the server log has the details")
    return HttpError(500, "internal_error", "internal error; the server log has the details")


def invalid_body(errors: Sequence[Mapping[str, Any]]) -> InvalidInputError:
    """The user's error for pydantic's (or FastAPI's) validation ``errors`` of a request: its first error,
    naming the field at fault."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return InvalidInputError(f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
    loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path")]
    name = ".".join(loc) or None
    message = f"{name}: {first.get('msg', 'invalid')}" if name else str(first.get("msg", "invalid request"))
    return InvalidInputError(message, name)


def invalid_request(exc: Exception) -> InvalidInputError | None:
    """A request FastAPI could not decode or validate, as our input error naming the problem (a body that is not
    JSON, or not UTF-8, a form it cannot parse: no field) or the field (a value of the wrong type); None for
    other exceptions."""
    if isinstance(exc, RequestValidationError):
        return invalid_body(exc.errors())
    if isinstance(exc, HTTPException) and exc.status_code == 400 and exc.__cause__ is not None:
        cause = exc.__cause__  # FastAPI's "There was an error parsing the body", without saying what
        if isinstance(cause, UnicodeDecodeError):
            return undecodable_body(cause)
        return InvalidInputError(f"the body cannot be read: {cause}")
    return None


def undecodable_body(cause: UnicodeDecodeError) -> InvalidInputError:
    """A body that is not UTF-8 text, naming the first byte that is not."""
    return InvalidInputError(f"the body is not UTF-8 text (byte {cause.object[cause.start]:#04x} at offset "
                             f"{cause.start})")


def log_error(error: HttpError, exc: BaseException, where: str) -> None:
    if error.status in (503, 507):  # busy, loading, a full disk: declared answers, not failures to trace
        logger.info("%s: %s (%d)", where, error.type, error.status)
    elif error.status >= 500:
        logger.error("%s failed", where, exc_info=exc)


def error_route(settings: ServerSettings | None = None) -> type[APIRoute]:
    """A route class that answers its own errors through :func:`http_error`, for routers mounted on apps
    without our exception handlers (the web UI's Gradio app mounts the workbench and long-form routers)."""

    class ErrorRoute(APIRoute):
        def get_route_handler(self) -> Callable:
            handler = super().get_route_handler()

            async def handle(request: Request) -> Response:
                try:
                    return await handler(request)
                except (RequestValidationError, HTTPException) as exc:
                    invalid = invalid_request(exc)
                    if invalid is None:
                        raise
                    return http_error(invalid, settings).response()
                except Exception as exc:
                    error = http_error(exc, settings)
                    log_error(error, exc, f"{request.method} {request.url.path}")
                    return error.response()

            return handle

    return ErrorRoute
