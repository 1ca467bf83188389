"""API keys for the web UI: with ``COSYVOICE_API_KEYS`` set, nothing of the app answers without one, but a
listening test's rater pages.

Gradio's own ``login_check`` guards only some of its routes (``/gradio_api/stream/...``, ``/heartbeat``,
``/cancel`` and others have none), so the gate is an ASGI middleware in front of the whole app: every
request carries a key (``Authorization: Bearer KEY``, as REST clients and ``gradio_client(headers=...)``
send it) or the session cookie of the small sign-in page this middleware serves itself at
``/studio/login``. Keys and sign-ins are :class:`cosyvoice.owners.Owners`'. Raters need only their link: what
their page reaches (the ``public`` predicate the app hands over, the workbench's) passes without a key. Gradio
learns who is calling through ``auth_dependency`` (:func:`owner_dependency`), so ``gr.Request.username`` is the
caller's owner string (``key:<sha256[:12]>``) in every event.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from urllib.parse import parse_qs

from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Receive, Scope, Send

from cosyvoice.owners import SESSION_COOKIE, Owners, PublicRoute, no_public_route

LOGIN_PATH = "/studio/login"
# Gradio's launch() calls this on itself without credentials; it only starts the queue, once, and says so
OPEN_PATHS = ("/gradio_api/startup-events",)
MAX_FORM_BYTES = 4096


LOGIN_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>CosyVoice3 Studio</title>
<style>body{{font-family:ui-sans-serif,system-ui,"Noto Sans CJK SC",sans-serif;max-width:420px;margin:12vh auto;
padding:0 16px;color:#111827}} input{{width:100%;box-sizing:border-box;padding:10px;margin:8px 0;font-size:16px}}
button{{padding:10px 18px;font-size:16px}} .error{{color:#b91c1c}}</style></head>
<body><h1>CosyVoice3 Studio</h1>
<p>This server needs an API key. 此服务器需要 API 密钥。</p>{error}
<form method="post" action="login"><label for="key">API key / API 密钥</label>
<input id="key" name="key" type="password" autocomplete="current-password" autofocus required>
<button type="submit">Sign in / 登录</button></form></body></html>"""


def owner_dependency(owners: Owners) -> Callable[[HTTPConnection], str | None]:
    """Gradio's ``auth_dependency``: the caller's owner string, or None without a valid key or sign-in."""

    def owner(conn: HTTPConnection) -> str | None:
        caller = owners.caller(conn)
        return None if caller is None else caller.owner

    return owner


class KeyGate:
    """ASGI middleware: refuse every HTTP and WebSocket request without a valid key (but a rater's); serve the
    sign-in page."""

    def __init__(self, app: ASGIApp, owners: Owners, public: PublicRoute = no_public_route) -> None:
        assert owners.keyed, "a gate without keys would lock everyone out"
        self.app, self.owners, self.public = app, owners, public

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        conn = HTTPConnection(scope)
        path = scope["path"].removeprefix(scope.get("root_path", ""))  # as routed behind a proxy's path prefix
        if scope["type"] == "http" and path.rstrip("/") == LOGIN_PATH:
            return await self._login(scope, receive, send)
        if (path in OPEN_PATHS or (scope["type"] == "http" and self.public(scope["method"], path))
                or self.owners.caller(conn) is not None):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008, "reason": "missing or wrong API key"})
        if scope["method"] == "GET" and "text/html" in conn.headers.get("accept", ""):
            return await _respond(send, 303, b"", [(b"location", _relative(path, LOGIN_PATH).encode())])
        await _respond(send, 401, b'{"detail": "missing or wrong API key: send \'Authorization: Bearer KEY\'"}',
                       [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")])

    async def _login(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "POST":
            return await _page(send, 200, "")
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if len(body) > MAX_FORM_BYTES:
                return await _page(send, 413, "The form is too large.")
            if not message.get("more_body"):
                break
        key = (parse_qs(body.decode("utf-8", "replace")).get("key") or [""])[0].strip()
        token = self.owners.sign_in(key)
        if token is None:
            return await _page(send, 401, "Wrong API key. 密钥不正确。")
        secure = "; Secure" if scope.get("scheme") == "https" else ""
        cookie = f"{SESSION_COOKIE}={token}; Path=/; HttpOnly; SameSite=Lax{secure}"
        await _respond(send, 303, b"", [(b"location", b"../"), (b"set-cookie", cookie.encode())])


def _relative(path: str, target: str) -> str:
    """``target`` relative to ``path``, so the redirect works under a proxy's path prefix too."""
    depth = path.count("/") - 1
    return ("../" * depth or "./") + target.lstrip("/")


async def _page(send: Send, status: int, error: str) -> None:
    message = f'<p class="error" role="alert">{html.escape(error)}</p>' if error else ""
    await _respond(send, status, LOGIN_PAGE.format(error=message).encode(),
                   [(b"content-type", b"text/html; charset=utf-8"), (b"cache-control", b"no-store")])


async def _respond(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
