"""The REST server: the official FastAPI endpoints, the bridge contract, OpenAI speech, voices, WebSocket.

    python -m cosyvoice.server.rest --model-dir DIR_OR_ID [--host 127.0.0.1] [--port 50000]

One router per API family, each in its own module and testable alone: :mod:`~cosyvoice.server.official`,
:mod:`~cosyvoice.server.bridge`, :mod:`~cosyvoice.server.openai`, :mod:`~cosyvoice.server.voices_api`,
:mod:`~cosyvoice.server.websocket`, :mod:`~cosyvoice.server.operations`. They are thin adapters over
:class:`cosyvoice.service.TTSService`; what they share (the error mapping, keys, body limit, audio out) is
:mod:`cosyvoice.server.common`. :func:`create_app` only assembles them. Settings (API keys, CORS, body size,
...) come from :class:`cosyvoice.settings.ServerSettings`; endpoints and examples are in ``docs/servers.md``.

On SIGTERM (or Ctrl-C) the server stops accepting, lets running requests finish for
``shutdown_grace_seconds`` (new ones get 503), then cancels what still runs and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import uvicorn
from fastapi import APIRouter, FastAPI

from cosyvoice.context import StudioContext, load_service
from cosyvoice.errors import command_line_errors
from cosyvoice.server import bridge, official, openai, operations, voices_api, websocket
from cosyvoice.server.common import (
    ApiKeys,
    BodyLimit,
    ServerState,
    add_cors,
    install_error_handlers,
)
from cosyvoice.server.http_limits import BodyGuard, uvicorn_options
from cosyvoice.server.longform import longform_router
from cosyvoice.server.memory import MemoryKeeper
from cosyvoice.server.workbench import rater_route, workbench_router
from cosyvoice.service import TTSService
from cosyvoice.settings import Limits, ServerSettings, add_server_arguments, settings_from_args

logger = logging.getLogger(__name__)

ROUTERS = (operations.router, official.router, bridge.router, openai.router, voices_api.router, websocket.router)


def create_app(settings: ServerSettings | None = None, service: TTSService | None = None,
               loader: Callable[[], TTSService] | None = None, routers: Sequence[APIRouter] = ROUTERS,
               limits: Limits | None = None) -> FastAPI:
    """The REST app over a ready ``service``, or one that ``loader`` makes in the background after start-up
    (``/health`` answers at once, ``/ready`` once the model is loaded); ``routers`` are the API families
    served (Ray Serve replicas serve their own), behind the one error mapping, API keys, body limit and CORS.
    ``limits`` bound the workbench's inputs (default: the service's, else the environment's). It builds the
    process's :class:`~cosyvoice.context.StudioContext` (the take, project and job stores) once, here."""
    # the process's one context: its stores beside the voices, open from the start; the service once loaded
    state = ServerState(StudioContext(settings, service=service, limits=limits))

    def load() -> None:
        try:
            state.install(loader())
            logger.info("model loaded; serving")
        except BaseException as exc:  # the server keeps answering: /ready and requests say it failed
            logger.exception("loading the model failed")
            state.context.load_error = f"{type(exc).__name__}: {exc}"

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if state.loaded is None and loader is not None:
            threading.Thread(target=load, daemon=True, name="cosyvoice-load").start()
        yield

    app = FastAPI(title="CosyVoice3 Studio", lifespan=lifespan)
    app.state.server = state
    if service is not None:
        state.metrics.attach(service)
    install_error_handlers(app)
    for router in routers:
        app.include_router(router)
    app.include_router(workbench_router(state.context))  # /workbench
    app.include_router(longform_router(state.context))  # /v1/longform
    # middleware, outermost last
    app.add_middleware(BodyGuard, settings=state.settings)  # body timeouts, JSON nesting: inside the body bound
    app.add_middleware(BodyLimit, max_bytes=state.settings.max_body_bytes)
    if state.owners.keyed:  # a rater's pages pass with the test's link alone
        app.add_middleware(ApiKeys, owners=state.owners, public=rater_route)
    add_cors(app, state.settings)
    return app


class DrainingServer(uvicorn.Server):
    """uvicorn whose shutdown drains the service: running requests get ``grace`` seconds, then are cancelled
    (uvicorn alone waits for open streams without limit)."""

    def __init__(self, config: uvicorn.Config, state: ServerState, grace: float) -> None:
        super().__init__(config)
        self.state, self.grace = state, grace

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        drain = None
        if self.state.loaded is not None:
            logger.info("shutting down: running requests may finish within %g s", self.grace)
            drain = asyncio.create_task(self.state.loaded.drain(self.grace))
        await super().shutdown(sockets)
        if drain is not None:
            await drain


def serve(app: FastAPI, settings: ServerSettings, log_level: str = "info") -> None:
    """Run ``app`` until SIGTERM/SIGINT, then drain for ``settings.shutdown_grace_seconds``."""
    grace = settings.shutdown_grace_seconds
    # uvicorn's own bound is a backstop a little past the drain (which cancels every session at ``grace``)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level,
                            timeout_graceful_shutdown=max(1, round(grace + 5)), **uvicorn_options(settings))
    with MemoryKeeper(lambda: app.state.server.loaded):
        DrainingServer(config, app.state.server, grace).run()


# ----------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="CosyVoice3 REST server (official, bridge, OpenAI, WebSocket)")
    add_server_arguments(parser)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    with command_line_errors():
        settings, limits = settings_from_args(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(create_app(settings, loader=lambda: _load(settings, limits), limits=limits), settings, args.log_level)


def _load(settings: ServerSettings, limits: Limits) -> TTSService:
    started = time.perf_counter()
    service = load_service(settings, limits)
    logger.info("loaded %s in %.1f s", settings.model_dir, time.perf_counter() - started)
    return service


if __name__ == "__main__":
    main()
