"""The voice column's Gradio handlers: the voice picker, a prompt's upload check and preview, and saving, renaming,
exporting, importing and deleting saved voices, all through the service's voice calls (its rules say who may)."""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

import gradio as gr

from app.files import PageFiles, uploaded
from app.i18n import say
from app.visitor import for_visitors, inform, is_zh, owner_of, page_message, warn
from cosyvoice.errors import AlreadyExistsError, CosyVoiceError, InvalidInputError
from cosyvoice.service import TTSService
from cosyvoice.voices import EXPORT_SUFFIX


def quoted_name(message: str) -> str:
    """The name quoted in a library message ("a voice named 'X' exists already")."""
    match = re.search(r"named (['\"])(.+?)\1", message)
    return match.group(2) if match else ""


class VoiceHandlers:
    """The voice column of the page over ``service``; files it hands out (an exported voice) go to ``files``.
    Invalid input and refusals are warning toasts; a handler that fails leaves the page as it was."""

    def __init__(self, service: TTSService, files: PageFiles) -> None:
        self.service = service
        self.files = files

    def voice_choices(self, owner: str | None, zh: bool = False, uploads: bool = True) -> list[tuple[str, str]]:
        """Dropdown (label, voice id) pairs: built-ins, saved voices by name, then this visitor's own uploads."""
        return [(say(zh, "builtin", label=i.label) if i.builtin else i.label, i.id)
                for i in self.service.list_voices(owner=owner, include_uploads=uploads)]

    def voice_dropdown(self, selected: str | None = None, request: gr.Request | None = None) -> dict:
        choices = self.voice_choices(owner_of(request), is_zh(request))
        return gr.update(choices=choices, value=selected if selected in {v for _, v in choices} else None)

    def visitor_voices(self, request: gr.Request | None = None) -> dict:
        """The page load's list for this visitor, leaving the selection alone: a voice picked from the page's
        first list while this answer was on its way (a slow server) stays picked."""
        return gr.update(choices=self.voice_choices(owner_of(request), is_zh(request)))

    def check_upload(self, path: str | None, request: gr.Request | None = None) -> Any:
        """Check a prompt as soon as it is uploaded or recorded (the service decodes it, from the header on):
        a bad one is removed with a message."""
        if not path:
            return gr.skip()
        zh = is_zh(request)
        try:
            self.service.check_prompt(uploaded(path, zh))
        except CosyVoiceError as exc:
            warn(say(zh, "unusable", detail=for_visitors(str(exc))))
            return None
        return gr.skip()

    def preview(self, key: str | None, request: gr.Request | None = None) -> Any:
        if not key:
            return None
        try:
            return self.service.voice_recording(key, owner=owner_of(request))
        except CosyVoiceError as exc:
            warn(page_message(exc, is_zh(request)))
            return None

    def save_voice(self, name: str, prompt: str | None, transcript: str, request: gr.Request | None = None) -> dict:
        """Save the uploaded recording (with the transcript, if typed); the dropdown picks it."""
        zh = is_zh(request)
        try:
            if not prompt:
                raise InvalidInputError(say(zh, "need_prompt"))
            if not (name or "").strip():
                raise InvalidInputError(say(zh, "need_name"))
            info = self.service.create_voice(name, uploaded(prompt, zh), transcript or "",
                                             owner=owner_of(request))
        except CosyVoiceError as exc:
            warn(page_message(exc, zh))
            return gr.skip()
        inform(say(zh, "saved" if info.transcript else "saved_no_transcript", name=info.name))
        return self.voice_dropdown(info.id, request)

    def rename_voice(self, key: str | None, new_name: str, request: gr.Request | None = None) -> dict:
        zh = is_zh(request)
        try:
            if not key:
                raise InvalidInputError(say(zh, "pick_rename"))
            info = self.service.rename_voice(key, new_name or "", owner=owner_of(request))
        except CosyVoiceError as exc:
            warn(page_message(exc, zh))
            return gr.skip()
        inform(say(zh, "renamed", name=info.name))
        return self.voice_dropdown(info.id, request)

    def export_voice(self, key: str | None, request: gr.Request | None = None) -> Any:
        zh = is_zh(request)
        try:
            if not key:
                raise InvalidInputError(say(zh, "pick_export"))
            name, data = self.service.export_voice(key, owner=owner_of(request))
        except CosyVoiceError as exc:
            warn(page_message(exc, zh))
            return gr.skip()
        path = self.files.folder() / name
        path.write_bytes(data)
        return str(path)

    def import_voice(self, path: str | None, name: str = "", request: gr.Request | None = None) -> tuple:
        """Import an exported voice file: (dropdown, the file input, the "import as" name, its Import button).

        A name that is taken keeps the file and shows a field for another name (never a dead end)."""
        hidden = gr.update(visible=False, value="")
        if not path:
            return gr.skip(), gr.skip(), hidden, gr.update(visible=False)
        zh = is_zh(request)
        try:
            if not str(path).endswith(EXPORT_SUFFIX.split(".")[-1]):
                raise InvalidInputError(say(zh, "not_voice_file", suffix=EXPORT_SUFFIX))
            info = self.service.import_voice(Path(path).read_bytes(), (name or "").strip() or None,
                                             owner=owner_of(request))
        except AlreadyExistsError as exc:
            if exc.field != "name":  # the voice itself is saved already (under another name)
                warn(page_message(exc, zh))
                return gr.skip(), None, hidden, gr.update(visible=False)
            warn(say(zh, "name_taken", name=(name or "").strip() or quoted_name(str(exc))))
            return gr.skip(), gr.skip(), gr.update(visible=True), gr.update(visible=True)
        except CosyVoiceError as exc:
            warn(page_message(exc, zh))
            return gr.skip(), None, hidden, gr.update(visible=False)
        inform(say(zh, "imported", name=info.name))
        return self.voice_dropdown(info.id, request), None, hidden, gr.update(visible=False)

    def ask_delete(self, key: str | None, request: gr.Request | None = None) -> tuple:
        """First step of Delete: show the confirmation row naming the voice."""
        zh = is_zh(request)
        try:
            if not key:
                raise InvalidInputError(say(zh, "pick_delete"))
            info = self.service.deletable_voice(key, owner=owner_of(request))
        except CosyVoiceError as exc:
            warn(page_message(exc, zh))
            return gr.skip(), gr.skip()
        return gr.update(visible=True), say(zh, "ask_delete", name=html.escape(info.label))

    def delete_voice(self, key: str | None, request: gr.Request | None = None) -> tuple:
        zh = is_zh(request)
        try:
            if not key:
                raise InvalidInputError(say(zh, "pick_delete"))
            info = self.service.delete_voice(key, owner=owner_of(request))
        except CosyVoiceError as exc:
            warn(page_message(exc, zh))
            return gr.skip(), gr.update(visible=False), None
        inform(say(zh, "deleted", name=info.label))
        return self.voice_dropdown(None, request), gr.update(visible=False), None
