"""The voice library's rules, asked before anything changes: who may edit or delete a voice, a name that is
taken, a voice that is saved already. A base of :class:`~cosyvoice.voices.library.VoiceLibrary` (its ``folder``,
``prompts``, ``policy`` and ``info``), apart to keep that class small.
"""

from __future__ import annotations

from cosyvoice.errors import AlreadyExistsError, InvalidInputError, PermissionDeniedError
from cosyvoice.settings import VoicePolicy
from cosyvoice.voices.entries import VoiceInfo
from cosyvoice.voices.folder import VoiceFolder
from cosyvoice.voices.prompts import PromptVoices


class VoiceRules:
    """What the library refuses, and why, in the words its callers show."""

    folder: VoiceFolder
    prompts: PromptVoices
    policy: VoicePolicy

    def deletable(self, key: str, *, owner: str | None = None) -> VoiceInfo:
        """The voice ``owner`` would delete, or the error :meth:`delete` would give: asked before a page asks
        "delete it?", so nobody confirms what will be refused."""
        info = self.info(key, owner=owner)
        self._check_deletable(info, owner)
        return info

    def _check_deletable(self, info: VoiceInfo, owner: str | None) -> None:
        if info.builtin:
            raise InvalidInputError(f"{info.name!r} is a built-in voice and cannot be deleted")
        if info.name is not None:
            self._check_editor(info, owner, "delete")

    def _entries(self) -> list[VoiceInfo]:
        return [*self.prompts.builtins(), *self.folder.index.values()]

    def _check_editor(self, info: VoiceInfo, owner: str | None, action: str) -> None:
        if not self.policy.may_edit(owner, info.creator):
            who = {"creator": "the one who saved it", "admin": "an administrator"}[self.policy.editors]
            raise PermissionDeniedError(f"you may not {action} the voice {info.name!r}: only {who} may")

    def _check_free(self, name: str) -> None:
        with self.folder.lock:
            self.folder.sync()
            holder = next((i for i in self._entries() if i.name == name), None)
        if holder is not None:
            raise AlreadyExistsError(f"a voice named {name!r} exists already; delete it or choose another name",
                                     "name")

    def _check_unsaved(self, voice_id: str) -> None:
        """A voice saved already is refused as such, whatever name it is offered under (never "choose another
        name" first, which no name could satisfy)."""
        with self.folder.lock:
            self.folder.sync()
            saved = self.folder.index.get(voice_id)
        if saved is not None and saved.name is not None:
            raise AlreadyExistsError(f"this voice is saved already as {saved.name!r}")
