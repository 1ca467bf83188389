"""Low-latency playback: a take's PCM goes from the synthesis thread straight to the browser's Web Audio player.

Gradio's streamed ``gr.Audio`` re-encodes chunks into HLS segments, which adds about a second before the
first sound and stalls at early segment edges. Here the Gradio event still runs the request (queue, Stop,
status, the finished file), but it also publishes each chunk's 16-bit samples to a :class:`LiveHub`
channel named by a take id the browser chose. The page's player (``player.js``) reads that channel over
the WebSocket ``/studio/live/{take_id}`` and schedules every piece back to back on an ``AudioContext``, so
sound starts as soon as the first chunk arrives and continues sample-exactly.

The first message is JSON ``{"sample_rate": N}``; then one binary message per chunk (PCM16 little-endian
mono); the socket closes normally (1000) when the take ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, WebSocket, WebSocketDisconnect

logger = logging.getLogger(__name__)

TAKE_ID = re.compile(r"^[A-Za-z0-9-]{8,64}$")
PLAYER_JS = Path(__file__).with_name("player.js")
_END = None


class LiveChannel:
    """One take's audio: written by a worker thread, read by one asyncio response (either may come first)."""

    def __init__(self) -> None:
        self.created = time.monotonic()
        self._lock = threading.Lock()
        self._pending: list[bytes | None] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[bytes | None] | None = None
        self.closed = False

    def put(self, data: bytes | None) -> None:
        """Hand bytes (``None``: the end) to the reader, waking its event loop; never blocks the producer."""
        with self._lock:
            if data is _END:
                self.closed = True
            if self._queue is None:
                self._pending.append(data)
                return
            loop, queue = self._loop, self._queue
        with contextlib.suppress(RuntimeError):  # the server's loop is gone (shutting down): nobody listens
            loop.call_soon_threadsafe(queue.put_nowait, data)

    async def read(self) -> AsyncIterator[bytes]:
        with self._lock:
            self._loop, self._queue = asyncio.get_running_loop(), asyncio.Queue()
            for data in self._pending:
                self._queue.put_nowait(data)
            self._pending.clear()
        while (data := await self._queue.get()) is not _END:
            yield data


class LiveHub:
    """Channels by take id. A channel whose reader never came (or whose writer never started) expires."""

    def __init__(self, ttl_seconds: float = 600.0) -> None:
        self.ttl = ttl_seconds
        self._lock = threading.Lock()
        self._channels: dict[str, LiveChannel] = {}

    def channel(self, take_id: str) -> LiveChannel:
        with self._lock:
            now = time.monotonic()
            for key in [k for k, c in self._channels.items() if now - c.created > self.ttl]:
                self._channels.pop(key).put(_END)
            return self._channels.setdefault(take_id, LiveChannel())

    def finish(self, take_id: str) -> None:
        """End a take's stream (also when it failed or was stopped); a reader arriving later sees the end."""
        self.channel(take_id).put(_END)


def mount(app: FastAPI, hub: LiveHub, sample_rate: int) -> None:
    """Add the WebSocket ``/studio/live/{take_id}`` to the Gradio app's FastAPI.

    A WebSocket, not a streamed GET: browsers allow six HTTP/1.1 connections per server across all tabs, and
    every open tab already holds Gradio's event stream, so streamed GETs of waiting tabs would starve the
    others' clicks (a Stop that never arrives). WebSockets have a pool of their own."""

    async def live(websocket: WebSocket, take_id: str) -> None:
        if not TAKE_ID.match(take_id):
            await websocket.close(code=1008, reason="unknown take")
            return
        await websocket.accept()
        await websocket.send_text(json.dumps({"sample_rate": sample_rate}))

        async def forward() -> None:
            async for data in hub.channel(take_id).read():
                await websocket.send_bytes(data)
            await websocket.close()

        async def gone() -> None:  # the page went away (or closed the socket): stop forwarding
            while (await websocket.receive())["type"] != "websocket.disconnect":
                pass

        tasks = [asyncio.ensure_future(forward()), asyncio.ensure_future(gone())]
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        for task in done:
            with contextlib.suppress(WebSocketDisconnect, RuntimeError):  # the socket closed under us
                task.result()

    app.add_api_websocket_route("/studio/live/{take_id}", live)
    if not websockets_served():
        logger.error("live playback is off: this Python lacks the websockets package, so the server answers the "
                     "page's WebSocket with 404 (install the web UI with scripts/webui.sh, or pip install -e '.[ui]')")


def websockets_served() -> bool:
    """Whether Gradio's server (uvicorn) accepts WebSockets in this Python: only with the websockets (or wsproto)
    package installed; without one it answers every WebSocket with 404."""
    from uvicorn.protocols.websockets.auto import AutoWebSocketsProtocol

    return AutoWebSocketsProtocol is not None


def head_html() -> str:
    """The player script for ``launch(head=...)``, told whether this server can serve its WebSocket at all (so
    that the page names the cause instead of a bare failure)."""
    served = json.dumps({"websockets": websockets_served()})
    return f"<script>\nwindow.cvLive = {served};\n{PLAYER_JS.read_text(encoding='utf-8')}\n</script>"
