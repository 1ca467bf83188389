"""Who a page's visitor is and how the page speaks to them: the owner a Gradio request stands for, the page's
language, and a service error as a warning toast in the visitor's words (never the operator's settings)."""

from __future__ import annotations

import html
import re

import gradio as gr

from app.i18n import say, service_detail
from cosyvoice.errors import CosyVoiceError, InvalidInputError, PermissionDeniedError, ResourceLimitError
from cosyvoice.owners import LOCAL, Caller, Owners

KEYLESS = Owners()  # how visitors of a server without keys are told apart: their browser, else their page
SETTING = re.compile(r"\s*\([^()]*\bCOSYVOICE_[A-Z_]+[^()]*\)|\s*(?:or )?raise COSYVOICE_[A-Z_]+")


def owner_of(request: gr.Request | None) -> str | None:
    """Who asks (:mod:`cosyvoice.owners`): the API key's owner when the app has keys (Gradio's ``username``, set by
    :mod:`app.auth`), else this browser (its ``cv-browser`` cookie, which app/history.js sets, so a visitor's takes
    and uploads survive a reload), else this page load; None for direct Python calls (unrestricted)."""
    if request is None:
        return None
    if request.username:
        return request.username
    caller = KEYLESS.identify(cookies=getattr(request, "cookies", None) or {}, session=request.session_hash)
    assert caller is not None, "a server without keys identifies everyone"
    return caller.owner


def caller_of(owners: Owners, request: gr.Request | None) -> Caller:
    """The visitor as :mod:`cosyvoice.owners` sees it (direct Python calls: the local, unrestricted caller)."""
    owner = owner_of(request)
    return LOCAL if owner is None else owners.of(owner)


def is_zh(request: gr.Request | None) -> bool:
    """Whether the browser asks for Chinese first (as Gradio's I18n picks the page's labels)."""
    headers = getattr(request, "headers", None) or {}
    languages = headers.get("accept-language", "")
    return languages.strip().lower().startswith("zh")


def for_visitors(message: str) -> str:
    """A message without the server settings it names: they are the operator's business, not the visitor's."""
    return SETTING.sub("", message)


def page_message(exc: CosyVoiceError, zh: bool = False) -> str:
    """A service error in the page's words, by its kind (busy, denied, invalid input, anything else)."""
    detail = service_detail(for_visitors(str(exc)), zh)
    if isinstance(exc, ResourceLimitError):
        return say(zh, "busy", detail=detail)
    if isinstance(exc, PermissionDeniedError):
        return say(zh, "denied", detail=detail)
    if isinstance(exc, InvalidInputError):
        return say(zh, "invalid", detail=detail)
    return say(zh, "model", detail=detail)


def warn(message: str) -> None:
    """A warning toast on the page (HTML-escaped: messages may quote ``<|endofprompt|>``)."""
    gr.Warning(html.escape(message))


def inform(message: str) -> None:
    """An information toast on the page (HTML-escaped, as :func:`warn`)."""
    gr.Info(html.escape(message))


def whole(value: float | None) -> int | float | None:
    """A Gradio number as the integer it stands for; anything else goes to the service, which refuses it by name."""
    return int(value) if isinstance(value, float) and value.is_integer() else value
