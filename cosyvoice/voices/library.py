"""THE voice library (:class:`VoiceLibrary`): prompt voices of one model, persisted in a folder shared by every
process (:mod:`cosyvoice.voices.folder`), featurised once per recording (:mod:`cosyvoice.voices.prompts`), kept and
shared as files (:mod:`cosyvoice.voices.portable`). See :mod:`cosyvoice.voices` for what it promises.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import replace
from pathlib import Path

import torch

from cosyvoice.errors import (
    AlreadyExistsError,
    InvalidInputError,
    NotFoundError,
    StorageError,
)
from cosyvoice.frontend.audio import AudioSource
from cosyvoice.frontend.frontend import CosyVoiceFrontend, Voice
from cosyvoice.frontend.prompt import PromptFeatures
from cosyvoice.settings import VoicePolicy
from cosyvoice.voices.entries import Upload, VoiceInfo, check_name, model_identity, os_error, storage_error
from cosyvoice.voices.folder import VoiceFolder
from cosyvoice.voices.portable import PortableVoices
from cosyvoice.voices.prompts import PromptVoices
from cosyvoice.voices.rules import VoiceRules

logger = logging.getLogger(__name__)


class VoiceLibrary(PortableVoices, VoiceRules):
    """Prompt voices of one model, persisted under ``root``; safe to share between threads and processes.

    A folder this process may not write is served read-only (:attr:`read_only` says why); one it cannot use
    otherwise raises :class:`~cosyvoice.errors.ConfigError` (:class:`~cosyvoice.voices.folder.VoiceFolder`).
    """

    def __init__(self, root: str | Path, frontend: CosyVoiceFrontend, *, model_dir: str | Path,
                 max_entries: int = 64, max_bytes: int = 256 << 20, max_named: int = 256,
                 builtin_dir: str | Path | None = None, policy: VoicePolicy | None = None) -> None:
        self.model_id = model_identity(model_dir)
        self.frontend = frontend
        self.max_named = max_named
        self.policy = policy if policy is not None else VoicePolicy.from_env()
        self.folder = VoiceFolder(root, self.model_id, max_entries=max_entries, max_bytes=max_bytes)
        self.prompts = PromptVoices(frontend, self.model_id)
        self._store_failure: int | None = None  # errno of the last failed caching, logged once
        if builtin_dir is not None:
            self.add_builtins(builtin_dir)

    @property
    def dir(self) -> Path:
        """The folder of this model's voices (``<root>/<model identity>``)."""
        return self.folder.dir

    @property
    def read_only(self) -> str | None:
        """Why nothing can be saved (the folder's setting named), or None."""
        return self.folder.read_only

    def add_builtins(self, folder: str | Path) -> None:
        """Offer the ``<name>.wav`` + ``<name>.txt`` pairs of ``folder`` as built-in voices (featurised on first
        use); a recording without a transcript is skipped with a log line, a missing folder adds none."""
        self.prompts.add_builtins(folder)

    # ------------------------------------------------------------------ public API

    def get_or_create(self, prompt_wav: AudioSource, prompt_text: str = "", *,
                      owner: str | None = None) -> tuple[str, Voice]:
        """The voice of a recording and its plain transcript (without CosyVoice3's system prompt, which the
        pipeline adds; ``''`` for none), cached for
        ``owner`` (the cache entry is visible to its uploaders alone until someone saves it under a name).

        The audio is decoded and validated first (so bad uploads fail with the frontend's message); features
        are computed only on a miss, and once even when several requests bring the same recording at once.
        A full disk costs only the caching, not the request.
        """
        upload = self.prompts.decode(prompt_wav, prompt_text)
        with self.prompts.featurising(upload.voice_id):
            self._load_or_featurise(upload)
            assert upload.voice is not None
            with self.folder.lock:
                if self._index_serves(upload.voice_id, owner) or self.read_only:  # a hit, or nowhere to cache it
                    return upload.voice_id, upload.voice
            try:
                with self.folder.exclusive():
                    info = self.folder.index.get(upload.voice_id)
                    if info is None:
                        self.folder.store(upload, None, owner)
                        self._store_failure = None
                    elif owner is not None and owner not in info.owners and info.name is None:
                        self.folder.write_meta(replace(info, owners=(*info.owners, owner)))
            except (OSError, StorageError) as exc:
                self._caching_failed(upload.voice_id, os_error(exc))
        return upload.voice_id, upload.voice

    def _index_serves(self, voice_id: str, owner: str | None) -> bool:
        info = self.folder.index.get(voice_id)
        return info is not None and (owner is None or info.name is not None or owner in info.owners)

    def create(self, name: str, prompt_wav: AudioSource, prompt_text: str = "", *,
               owner: str | None = None) -> VoiceInfo:
        """Save a recording and its plain transcript under ``name`` in one step (featurised unless cached). A
        taken name, or this recording + text saved already under another name, is refused
        (:class:`AlreadyExistsError`)."""
        name = check_name(name)
        self.folder.writable()  # before featurising: a refusal or a taken name fails fast
        self._check_free(name)
        return self._save_upload(self.prompts.decode(prompt_wav, prompt_text), name, owner)

    def _save_upload(self, upload: Upload, name: str, owner: str | None) -> VoiceInfo:
        """A decoded recording featurised (unless cached) and saved under ``name``."""
        with self.prompts.featurising(upload.voice_id):
            self._load_or_featurise(upload)
            return self._name_upload(upload, name, owner)

    def get(self, key: str, *, owner: str | None = None) -> tuple[VoiceInfo, Voice]:
        """A voice by id or by name; :class:`NotFoundError` if unknown, :class:`InvalidInputError` if unreadable."""
        info = self.info(key, owner=owner)
        if info.builtin:
            return info, self.prompts.builtin_voice(info.id)
        return info, self._read(info, key)

    def info(self, key: str, *, owner: str | None = None) -> VoiceInfo:
        """The entry ``key`` (an id, else a name) as the folder has it now, if ``owner`` may see it."""
        with self.folder.lock:
            self.folder.sync()
            info = self._find(key, owner)
            if info is None:
                names = [i.name for i in self._entries() if i.name]
                raise NotFoundError(f"unknown voice {key!r}; saved voices: {', '.join(names) or 'none'}")
            return replace(info)

    def list(self, *, owner: str | None = None) -> list[VoiceInfo]:
        """Built-in voices, then named voices by name, then the uploads ``owner`` may see, most recently used
        first (the folder is re-read, so voices other processes saved, renamed or deleted are followed)."""
        with self.folder.lock:
            self.folder.sync()
            infos = [replace(i) for i in self.folder.index.values() if i.visible_to(owner)]
            builtins = [replace(b) for b in self.prompts.builtins()]
        named = sorted((i for i in infos if i.name), key=lambda i: i.name.casefold())
        return builtins + named + sorted((i for i in infos if not i.name), key=lambda i: -i.last_used)

    def save(self, name: str, voice_id: str, *, owner: str | None = None) -> VoiceInfo:
        """Keep the entry ``voice_id`` under ``name`` (renaming it if it had one, which the policy must allow
        ``owner``); named voices are never evicted and are visible to everyone."""
        name = check_name(name)
        with self.folder.exclusive():
            info = self._held(voice_id, owner)
            if info.builtin:
                raise InvalidInputError(f"{info.name!r} is a built-in voice; it is always available under its name")
            if info.name is not None and info.name != name:
                self._check_editor(info, owner, "rename")
            return self._write_name(info, name, owner)

    def rename(self, key: str, new_name: str, *, owner: str | None = None) -> VoiceInfo:
        """Give a saved voice (by id or name) another name; the same checks as :meth:`save`."""
        new_name = check_name(new_name)
        with self.folder.exclusive():
            info = self._held(key, owner)
            if info.builtin:
                raise InvalidInputError(f"{info.name!r} is a built-in voice; it cannot be renamed")
            if not info.name:
                raise InvalidInputError("only saved voices can be renamed; save this one under a name first")
            self._check_editor(info, owner, "rename")
            return self._write_name(info, new_name, owner)

    def delete(self, key: str, *, owner: str | None = None) -> VoiceInfo:
        """Forget a voice (by id or name, resolved against the folder as it is now) and remove its files. An
        unsaved upload that others uploaded too is only forgotten for ``owner``: theirs stays."""
        with self.folder.exclusive():
            info = self._held(key, owner)
            self._check_deletable(info, owner)
            others = tuple(o for o in info.owners if o != owner)
            try:
                if info.name is None and owner is not None and others:
                    self.folder.write_meta(replace(info, owners=others))
                else:
                    self.folder.remove(info.id)
            except (OSError, StorageError) as exc:
                raise storage_error(exc, "delete this voice") from exc
            return replace(info)

    def _find(self, key: str, owner: str | None) -> VoiceInfo | None:
        """By id first, then by name (names never look like ids); entries ``owner`` may not see are not found."""
        entries = [i for i in self._entries() if i.visible_to(owner)]
        return next((i for i in entries if i.id == key), None) or next((i for i in entries if i.name == key), None)

    def _held(self, key: str, owner: str | None) -> VoiceInfo:
        """Under the folder lock: the index entry ``key`` as the folder has it now (not a copy)."""
        assert self.folder.held
        info = self._find(key, owner)
        if info is None:
            return self.info(key, owner=owner)  # raises NotFoundError with the names
        return info

    # ------------------------------------------------------------------ entries

    def _load_or_featurise(self, upload: Upload) -> None:
        with self.folder.lock:
            self.folder.sync()
            info = self.folder.index.get(upload.voice_id)
        if upload.voice is None and info is not None:
            with contextlib.suppress(InvalidInputError, NotFoundError):  # unreadable or gone: made anew below
                upload.voice = self._read(info, upload.voice_id)
        if upload.voice is None:
            upload.voice = self.prompts.featurise(upload.wav, upload.sample_rate, upload.prompt_text)

    def _name_upload(self, upload: Upload, name: str, owner: str | None) -> VoiceInfo:
        """Store (if new) and name an upload in one step under the folder lock."""
        with self.folder.exclusive():
            info = self.folder.index.get(upload.voice_id)
            if info is not None and info.name is not None and info.name != name:
                raise AlreadyExistsError(f"this voice is saved already as {info.name!r}")
            if info is None:
                try:
                    info = self.folder.store(upload, name, owner)
                except (OSError, StorageError) as exc:
                    raise storage_error(exc, f"save the voice {name!r}") from exc
                return replace(info)
            return self._write_name(info, name, owner)

    def _read(self, info: VoiceInfo, key: str) -> Voice:
        tensors = self.folder.tensors(info, key)
        try:
            voice = self.prompts.plain(Voice(PromptFeatures.from_tensors(tensors),
                                             tensors["prompt_text"].to(torch.int32)))
        except (KeyError, ValueError) as exc:
            raise InvalidInputError(f"voice {key!r} is incomplete on disk ({exc}); upload it again") from exc
        try:
            os.utime(self.folder.paths(info.id)[1])  # persists the use for eviction order
        except OSError as exc:
            logger.debug("voice library: cannot mark %s as used (%s)", info.id, exc)
        with self.folder.lock:
            if info.id in self.folder.index:
                self.folder.index[info.id].last_used = time.time()
        return voice

    def _write_name(self, info: VoiceInfo, name: str, owner: str | None) -> VoiceInfo:
        """Name the entry ``info`` (under the folder lock, index fresh): unique, bounded, written atomically."""
        assert self.folder.held
        if info.name == name:
            return replace(info)
        holder = next((i for i in self._entries() if i.name == name), None)
        if holder is not None and holder.id != info.id:
            raise AlreadyExistsError(f"a voice named {name!r} exists already; delete it or choose another name",
                                     "name")
        if info.name is None and sum(i.name is not None for i in self.folder.index.values()) >= self.max_named:
            # a full library is the user's to fix (not a transient overload): a 400, not a 503
            raise InvalidInputError(f"{self.max_named} voices are saved already; delete one to save another", "name")
        creator = info.creator if info.name is not None else owner
        try:
            self.folder.write_meta(replace(info, name=name, owners=(), creator=creator))
        except (OSError, StorageError) as exc:
            raise storage_error(exc, f"save the voice {name!r}") from exc
        return replace(self.folder.index[info.id])

    def _caching_failed(self, voice_id: str, exc: OSError) -> None:
        """A cache write failed: the request goes on without caching; logged once per kind of failure."""
        if exc.errno != self._store_failure:
            logger.warning("voice library: uploads are used without caching them in %s (%s); the first was %s",
                           self.dir, exc.strerror or exc, voice_id)
        self._store_failure = exc.errno
