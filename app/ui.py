"""The Gradio web UI's start-up: the process's one :class:`StudioContext` loaded, the studio page served with the
live-audio route and the workbench and long-form routers over the same context. No model logic here: the page's
handlers are :class:`app.studio.Studio`, its layout :mod:`app.layout`.

One :class:`Studio` (the service, the voice library, the take recorder with its live-audio hub) serves every browser
session. A take runs as a Gradio event (so the queue, Stop and the status line are Gradio's), while its audio goes to
the page's Web Audio player over ``app.live`` as it is made. Invalid input becomes a warning toast on the page
(never an error badge over other controls); the named API endpoints raise plain-text errors instead.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from pathlib import Path

import gradio as gr
from starlette.middleware import Middleware

from app.auth import KeyGate, owner_dependency
from app.i18n import I18N
from app.layout import CSS, build_ui
from app.live import head_html, mount
from app.studio import Studio
from app.take_form import DOWNLOAD_FORMATS
from cosyvoice.bundle import DEMO_MODEL_DIR
from cosyvoice.context import StudioContext
from cosyvoice.encoding import to_pcm16
from cosyvoice.server.longform import longform_router
from cosyvoice.server.workbench import rater_route, workbench_router
from cosyvoice.service import TTSService
from cosyvoice.settings import ServerSettings, default_voice_dir
from cosyvoice.system.signals import wait_in_main_thread
from cosyvoice.tools.make_tiny_bundle import model_dir_or_demo
from cosyvoice.voices import BUILTIN_VOICE_DIR

logger = logging.getLogger("app.ui")  # the web UI logs under one name, which operators and tests filter on

# what webui.py and the tests take from here: the start-up, the page, its download formats and the encoder
__all__ = ["BUILTIN_VOICE_DIR", "DEMO_MODEL_DIR", "DOWNLOAD_FORMATS", "Studio", "build_ui", "launch", "load_studio",
           "to_pcm16"]

HISTORY_JS = Path(__file__).with_name("history.js")
# Gradio refuses bigger uploads with its own size message; up to this multiple of the service's byte limit the
# file reaches the service, which says what is wrong with it (e.g. a 57 MB WAV: too long, not too big)
UPLOAD_HEADROOM = 2


def load_studio(model_dir: str | Path | None = None, *, voice_dir: str | Path | None = None,
                demo_dir: str | Path = DEMO_MODEL_DIR, builtin_dir: str | Path | None = BUILTIN_VOICE_DIR,
                device: str | None = None, precision: str | None = None,
                settings: ServerSettings | None = None) -> Studio:
    """The engine and voice library to serve, in the process's one :class:`StudioContext` (``settings``: who
    visitors are and who may edit saved voices; default the environment's).

    An explicit ``model_dir`` (a folder or a ModelScope id) must load. Without one, the repository's default
    folder is used if present; otherwise the demo model in ``demo_dir``
    (:func:`cosyvoice.tools.make_tiny_bundle.model_dir_or_demo`, as the command lines do), said loudly in the log
    and on the page. Voices are kept in ``voice_dir``, by
    default the servers' folder (:func:`cosyvoice.settings.default_voice_dir`): one library for all of them.
    """
    model_dir, demo = model_dir_or_demo(model_dir, demo_dir)
    settings = replace(settings or ServerSettings.from_env(), voice_dir=str(voice_dir or default_voice_dir()))
    service = TTSService.load(model_dir, settings.voice_dir, device=device, precision=precision,
                              policy=settings.voice_policy(), builtin_dir=builtin_dir)
    return Studio(StudioContext(settings, service=service), demo=demo)


def launch(studio: Studio, *, host: str = "127.0.0.1", port: int = 8000, block: bool = True) -> gr.Blocks:
    """Serve the page and the live-audio route (``block=False`` returns at once, the server in a thread).

    The studio's context says who callers are (:mod:`cosyvoice.owners`). With keys nothing answers without one of
    them (:mod:`app.auth`): not the page, its events, its files, the live audio or the named API; only a listening
    test's rater pages."""
    owners = studio.owners
    page = build_ui(studio)
    page.queue(default_concurrency_limit=studio.service.limits.max_sessions)
    gate = {} if not owners.keyed else {
        "auth_dependency": owner_dependency(owners),
        "app_kwargs": {"middleware": [Middleware(KeyGate, owners=owners, public=rater_route)]}}
    page.launch(server_name=host, server_port=port, prevent_thread_lock=True, show_error=False, ssr_mode=False,
                max_file_size=UPLOAD_HEADROOM * studio.service.limits.max_prompt_bytes, quiet=not block, i18n=I18N,
                css=CSS, head=head_html() + f"<script>\n{HISTORY_JS.read_text(encoding='utf-8')}\n</script>",
                theme=gr.themes.Default(font=["ui-sans-serif", "system-ui", "Noto Sans CJK SC", "sans-serif"]),
                allowed_paths=[str(studio.files.root)], **gate)
    mount(page.app, studio.live, studio.service.sample_rate)
    # the workbench (the take history's store too) and long-form projects, over the studio's context
    page.app.include_router(longform_router(studio.context))
    page.app.include_router(workbench_router(studio.context))
    if block:
        _serve_until_stopped(page, studio)
    return page


def _serve_until_stopped(page: gr.Blocks, studio: Studio) -> None:
    """Serve until Ctrl-C or SIGTERM, then drain the service while the page still answers: running takes and
    jobs' requests may finish for the settings' grace (a take that finishes is kept; new ones are told the server
    is shutting down), the rest are cancelled. The page closes once the engine computes for nobody, then the
    context (its jobs end interrupted, resumable at the next start; the stores close): a process that exits while
    the engine's threads still compute can crash in its native libraries' teardown."""
    try:
        wait_in_main_thread()
    except KeyboardInterrupt:
        grace = studio.context.settings.shutdown_grace_seconds
        logger.info("shutting down: running takes and jobs may finish within %g s", grace)
        asyncio.run(studio.service.drain(grace))
    page.close()
    studio.context.close()
