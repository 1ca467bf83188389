"""Who a caller is: the one place that turns a request into an owner, and decides what that owner may see.

Every adapter asks here (the REST gate and routers, the web UI's gate and handlers, gRPC, the metrics port), so a
key is parsed and checked once, the same way everywhere. Owner strings, as stored with every object (voice,
take, batch, listening test, long-form project):

* ``key:<sha256[:12]>``: a holder of an API key (never the key itself);
* ``browser:<32 hex>``: a browser on a server without keys, by its ``cv-browser`` cookie (a random id the pages
  keep for ten years, app/history.js), so a visitor's work survives a reload and is the same in every tab;
* ``session:<id>``: a web UI page without that cookie (its one page load);
* ``anonymous``: any other caller of a server without keys (e.g. ``curl`` without the cookie): one shared owner;
* ``None``: an in-process caller (the Python API, the CLIs), who may do everything. Rows stored before owners
  existed carry no owner either: they count as this local owner's, so admins, in-process callers and ``team``
  sharing see them, and a ``private`` server's visitors do not.

What a caller sees is the server's ``sharing`` (``COSYVOICE_SHARING``): ``private`` (each caller only their own
work, also without keys, so a public Space shows each visitor only theirs), ``team`` (every caller sees and uses
every object, as one team), or ``auto`` (the servers' default): ``private``, except that on a server without keys
that only this machine reaches (bound to a loopback address: a laptop's ``127.0.0.1``) every caller also sees and
deletes this machine's own work, the local owner's and ``anonymous``'s (the batch CLI's takes, a keyless
``curl``'s), since whoever can reach such a server can read its data folder anyway. Browsers stay apart from
each other there too. (A proxy that serves a loopback-bound server to others must set ``private``.)
Holders of an admin key (``COSYVOICE_ADMIN_KEYS``) see everything. Deleting stays with an
object's owner and the admins whatever the sharing. Saved voices are visible to everyone; who may change them is
the voice library's own rule (:class:`cosyvoice.settings.VoicePolicy`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import secrets
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from cosyvoice.errors import ConfigError

SHARING = ("auto", "private", "team")
BROWSER_COOKIE = "cv-browser"  # the browser identity (app/history.js makes it; pages without it get one)
BROWSER_ID = re.compile(r"[0-9a-f]{32}")
SESSION_COOKIE = "cosyvoice-session"  # the web UI's sign-in (app/auth.py), an opaque token for a key's owner
ANONYMOUS = "anonymous"
MAX_SESSIONS = 10000  # sign-ins remembered; the oldest are forgotten first (they sign in again)
BROWSER_COOKIE_SECONDS = 10 * 365 * 86400

# (method, path as routed) -> whether a request passes a key gate without a key (a listening test's rater pages);
# the features that have such routes hand their predicate to the gates, so the gates import no feature
PublicRoute = Callable[[str, str], bool]


PageT = TypeVar("PageT", bound=Any)


class Connection(Protocol):
    """What a caller is read from: a Starlette request or WebSocket, a Gradio request."""

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def cookies(self) -> Mapping[str, str]: ...


def key_owner(api_key: str) -> str:
    """The owner of what an API-key client makes: ``key:`` + 12 hex digits of the key's sha256 (never the key)."""
    return "key:" + hashlib.sha256(api_key.encode()).hexdigest()[:12]


def bearer(authorization: str) -> str:
    """The token of an ``Authorization: Bearer TOKEN`` header value ('' for any other scheme)."""
    return authorization[7:].strip() if authorization[:7].lower() == "bearer " else ""


def no_public_route(method: str, path: str) -> bool:
    """A gate's default: every route needs a key."""
    return False


@dataclass(frozen=True)
class Caller:
    """One caller: its owner string and what the server lets it see."""

    owner: str | None
    admin: bool = False  # an admin key's holder, or an in-process caller: sees and may delete everything
    team: bool = False  # COSYVOICE_SHARING=team: sees (and uses) everyone's objects
    local: bool = False  # on a keyless server only this machine reaches: also this machine's own work (MACHINE)

    @property
    def sees_all(self) -> bool:
        return self.admin or self.team

    @property
    def seen_owners(self) -> tuple[str | None, ...]:
        """The owners whose objects this caller sees unless it sees all: its own, and on a local server the
        machine's."""
        return (self.owner, *MACHINE) if self.local else (self.owner,)

    def sees(self, owner: str | None) -> bool:
        """Whether this caller may see (read, play, export, use) an object ``owner`` made."""
        return self.sees_all or self.owns(owner)

    def owns(self, owner: str | None) -> bool:
        """Whether this caller may delete an object ``owner`` made: its owner and the admins, whatever the sharing
        (on a local server, the machine's objects are every caller's)."""
        return self.admin or (owner is not None and owner == self.owner) or (self.local and owner in MACHINE)


LOCAL = Caller(None, admin=True)  # the Python API and the CLIs
MACHINE = (None, ANONYMOUS)  # the owners of a machine's own work: its CLIs, and keyless clients without a cookie


def loopback(host: str) -> bool:
    """Whether a server bound to ``host`` is reached from this machine only (``127.0.0.1``, ``::1``,
    ``localhost``); ``0.0.0.0`` and any other address serve other machines."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


class Owners:
    """A server's keys, admin keys and sharing, and the web UI's sign-in sessions."""

    def __init__(self, api_keys: tuple[str, ...] = (), admin_keys: tuple[str, ...] = (),
                 sharing: str = "private", host: str = "") -> None:
        """``host``: the address the server is bound to (``auto`` sharing reads it)."""
        if sharing not in SHARING:
            raise ConfigError(f"COSYVOICE_SHARING must be one of {', '.join(SHARING)}, got {sharing!r}")
        self._keys = tuple(k.encode() for k in (*api_keys, *admin_keys))  # admin keys are API keys too
        self.local = sharing == "auto" and not self._keys and loopback(host)
        self.sharing = "team" if sharing == "team" else "private"  # what auto is, but for the machine's own work
        self.admin_owners = frozenset(key_owner(k) for k in admin_keys)
        self._sessions: dict[str, str] = {}  # sign-in cookie value -> owner
        self._lock = threading.Lock()

    @property
    def keyed(self) -> bool:
        """Whether callers need a key (else everyone may call, as a browser or anonymously)."""
        return bool(self._keys)

    def key(self, token: str) -> str | None:
        """The owner of ``token`` if it is one of the keys (compared in constant time), else None."""
        if token and any(hmac.compare_digest(token.encode(), k) for k in self._keys):
            return key_owner(token)
        return None

    def sign_in(self, key: str) -> str | None:
        """A new sign-in cookie value for a valid key (the web UI's sign-in page), else None."""
        owner = self.key(key)
        if owner is None:
            return None
        token = secrets.token_urlsafe(32)
        with self._lock:
            self._sessions[token] = owner
            while len(self._sessions) > MAX_SESSIONS:
                del self._sessions[next(iter(self._sessions))]
        return token

    def identify(self, authorization: str = "", cookies: Mapping[str, str] | None = None, *, api_key: str = "",
                 session: str | None = None) -> Caller | None:
        """The caller of a request with this ``Authorization`` header value and these cookies (``api_key``: a
        WebSocket's ``?api_key=``; ``session``: a web UI page load's id). None: a server with keys, and no valid
        key or sign-in."""
        cookies = cookies or {}
        if self.keyed:
            token = bearer(authorization) or api_key
            if token:
                owner = self.key(token)
            else:
                with self._lock:
                    owner = self._sessions.get(cookies.get(SESSION_COOKIE, ""))
            return None if owner is None else self.of(owner)
        browser = cookies.get(BROWSER_COOKIE, "")
        if BROWSER_ID.fullmatch(browser):
            return self.of(f"browser:{browser}")
        return self.of(f"session:{session}" if session else ANONYMOUS)

    def caller(self, conn: Connection, *, api_key: str = "") -> Caller | None:
        """:meth:`identify` of a Starlette connection (or anything with ``headers`` and ``cookies``)."""
        return self.identify(conn.headers.get("authorization", ""), conn.cookies, api_key=api_key)

    def behind_gate(self, conn: Connection) -> Caller:
        """The caller of a request that a key gate let through as a key holder's (a router's owner routes)."""
        caller = self.caller(conn)
        assert caller is not None, "the API-key gate lets only key holders reach an owner's routes"
        return caller

    def of(self, owner: str) -> Caller:
        """The caller whose owner string is ``owner`` (one a gate has identified)."""
        return Caller(owner, admin=owner in self.admin_owners, team=self.sharing == "team", local=self.local)

    def introduce(self, conn: Connection, page: PageT) -> PageT:
        """``page`` (a Starlette response), giving a browser that has no identity one on a server without keys,
        so what it makes is its own from its first request. Readable by the pages' scripts, as history.js's."""
        if not self.keyed and not BROWSER_ID.fullmatch(conn.cookies.get(BROWSER_COOKIE, "")):
            page.headers.append("set-cookie", f"{BROWSER_COOKIE}={secrets.token_hex(16)}; Path=/; "
                                              f"Max-Age={BROWSER_COOKIE_SECONDS}; SameSite=Lax")
        return page
