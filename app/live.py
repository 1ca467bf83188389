"""Low-latency playback: a take's PCM goes from the synthesis thread straight to the browser's Web Audio player.

Gradio's streamed ``gr.Audio`` re-encodes chunks into HLS segments, which adds about a second before the
first sound and stalls at early segment edges. Here the Gradio event still runs the request (queue, Stop,
status, the finished file), but it also publishes each chunk's 16-bit samples to a :class:`LiveHub`
channel named by a take id the browser chose. The page's player (``player.js``) reads that channel with
one streamed ``fetch`` of ``GET /studio/live/{take_id}`` and schedules every piece back to back on an
``AudioContext``, so sound starts as soon as the first chunk arrives and continues sample-exactly.

The body is raw PCM16 little-endian mono at ``X-Sample-Rate``; it ends when the take ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse

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
    """Add ``GET /studio/live/{take_id}`` to the Gradio app's FastAPI."""

    async def live(take_id: str) -> StreamingResponse:
        if not TAKE_ID.match(take_id):
            raise HTTPException(404, "unknown take")
        channel = hub.channel(take_id)
        return StreamingResponse(channel.read(), media_type="application/octet-stream",
                                 headers={"X-Sample-Rate": str(sample_rate), "Cache-Control": "no-store",
                                          "X-Accel-Buffering": "no"})

    app.add_api_route("/studio/live/{take_id}", live, methods=["GET"], include_in_schema=False)


def head_html() -> str:
    """The player script for ``launch(head=...)``."""
    return f"<script>\n{PLAYER_JS.read_text(encoding='utf-8')}\n</script>"
