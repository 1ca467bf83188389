"""Operations: ``GET /health`` (liveness), ``GET /ready`` (readiness and load), ``GET /metrics`` (Prometheus).

A server whose voice or data folder is read-only is ready (synthesis works, saved voices included); ``/ready``
lists those folders under ``read_only`` with what that means (saves refused), naming each folder's setting.

The probes answer without an API key, but say no more than their status to a caller without one on a server
with keys: the model's folder and a load failure's message (which may name server paths) are for key holders
(and the log) only; the load counters are shown where no keys are configured.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from cosyvoice.server.common import ServerState, key_holder, server_state

router = APIRouter(tags=["operations"])


def _may_see_details(http: Request) -> bool:
    return not server_state(http).owners.keyed or key_holder(http)


@router.get("/health")
async def health(http: Request) -> JSONResponse:
    """Liveness: the process serves (503 only when the model failed to load)."""
    state = server_state(http)
    if state.context.load_error:
        body = {"status": "failed", "error": state.context.load_error if key_holder(http) else "see the server log"}
        return JSONResponse(body, 503)
    return JSONResponse({"status": "ok"})


@router.get("/ready")
async def ready(http: Request) -> JSONResponse:
    """Readiness: the model is loaded; with the current load, what each stage computes in (precision: auto's
    choice and its measurements) and, for a key holder, the model folder."""
    body, status = readiness(server_state(http), _may_see_details(http), key_holder(http))
    return JSONResponse(body, status)


def readiness(state: ServerState, details: bool, holder: bool) -> tuple[dict[str, object], int]:
    """``/ready``'s body and status: the load counters and precision if ``details``, the model folder and a load
    failure's message only for a key ``holder``."""
    if state.loaded is None:
        body: dict[str, object] = {"status": "failed" if state.context.load_error else "loading"}
        if state.context.load_error:
            body["error"] = state.context.load_error if holder else "see the server log"
        return body, 503
    body = {"status": "ready"}
    if state.read_only():  # served, but what users make cannot be kept there
        body["read_only"] = state.read_only()
    if details:
        s = state.loaded.status()
        body |= {"sample_rate": s.sample_rate, "active_sessions": s.active_sessions,
                 "queued_requests": s.queued_requests, "max_sessions": s.max_sessions,
                 "max_queued_requests": s.max_queued_requests, "saved_voices": s.saved_voices,
                 "precision": s.precision}
        if holder:
            body["model_dir"] = str(s.model_dir)
    return body, 200


@router.get("/metrics")
async def prometheus(http: Request) -> Response:
    metrics = server_state(http).metrics
    return Response(metrics.exposition(), media_type=metrics.content_type)
