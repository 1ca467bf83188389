"""A persistent library of prompt voices, so that a recording is featurised once and then reused.

Featurising a prompt (speech tokenizer, speaker encoder, mel) is the slowest step of a zero-shot request
before the model itself runs, and people upload the same recording again and again. Entries are
content-addressed: the id hashes the decoded samples, their sample rate, the whitespace-normalised prompt
text and the model's identity, so re-encoding a recording to another format still hits, and another model
(other tokenizer or speaker encoder) never reuses features it did not make.

On disk, one folder per model identity holds ``<id>.safetensors`` (the tensors) and ``<id>.json`` (name,
transcript, creation time, who uploaded it and who saved it). The JSON is written last, so an entry exists once
its JSON does; its mtime is the last use. Unnamed entries are a cache: the least recently used go when there are
more than ``max_entries`` of them or they take more than ``max_bytes``. Named entries (saved voices) stay until
deleted. Each entry also keeps its prompt recording (16-bit, as decoded) so that a voice can be previewed and
exported.

The folder is the truth for every process that shares it (servers, web UI, the Python API): each process's index
is only a cache of it, re-read when the folder changes. Every change (store, name, rename, delete, eviction) is
made under an exclusive ``flock`` of ``<folder>/.lock`` after re-reading the folder, and every file is replaced
atomically. ``flock`` rather than O_EXCL name files: the kernel releases it when a process dies, even by
``kill -9``, so a crash never leaves a stale lock or a stale name claim behind. Hence names are unique across
processes, eviction never deletes a voice another process has named, and a delete removes the voice its key
names now. Names never look like ids (32 hex digits), so a key is never ambiguous.

Ownership: an unnamed upload is visible only to the owners that uploaded it (``owner`` strings, see
:class:`~cosyvoice.settings.VoicePolicy`; ``None`` is a local, unrestricted caller that sees everything). Named
voices are visible to everyone; who may rename, export or delete one is the library's ``policy``.

Caching is optional: when the disk is full or the folder turns read-only, a new upload is used without being
cached (logged once); saving a named voice then fails with :class:`~cosyvoice.errors.StorageError`. A folder
that is read-only from the start (voices baked into an image, a read-only mount) is served read-only: its saved
voices are listed and spoken with, uploads are used uncached, and every change is refused with
:class:`~cosyvoice.errors.ReadOnlyError` naming ``COSYVOICE_VOICE_DIR``. Tensors are
read into memory (never memory-mapped), so deleting a voice frees its space at once.

Built-in voices come from a read-only folder of ``<name>.wav`` + ``<name>.txt`` (its transcript), e.g. the
repository's ``assets/voices``; they are listed first, featurised on first use, and cannot be renamed or
deleted. An exported voice is one safetensors file holding the features, the transcript's token ids, the
recording and (as metadata) the name, transcript and model identity; importing it into a library of another
model recomputes the features from the recording, so the file stays portable across model releases.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from cosyvoice.bundle import ONNX_INPUTS, TOKENIZER_FILES
from cosyvoice.encoding import to_pcm16
from cosyvoice.errors import (
    AlreadyExistsError,
    ConfigError,
    InvalidInputError,
    NotFoundError,
    PermissionDeniedError,
    ReadOnlyError,
    StorageError,
)
from cosyvoice.frontend.audio import AudioSource
from cosyvoice.frontend.frontend import CosyVoiceFrontend, Voice
from cosyvoice.frontend.prompt import PromptFeatures
from cosyvoice.frontend.prompts import transcript_ids, zero_shot_prompt_text
from cosyvoice.settings import VOICE_DIR_SETTING, VoicePolicy
from cosyvoice.utils.fs import atomic_write, unwritable

logger = logging.getLogger(__name__)

MAX_NAME_CHARS = 64
# the repository's built-in voices (a clone's assets/voices; absent from an installed wheel, then none)
BUILTIN_VOICE_DIR = Path(__file__).resolve().parents[1] / "assets" / "voices"
EXPORT_FORMAT = "cosyvoice3-voice/1"  # the metadata tag of an exported voice file
EXPORT_SUFFIX = ".voice.safetensors"
# The files a voice's tensors depend on: the mel settings (yaml), the two ONNX models, the text tokenizer.
IDENTITY_FILES = ("cosyvoice3.yaml", *ONNX_INPUTS, *TOKENIZER_FILES)
LOCK_FILE = ".lock"
BUILTIN_PREFIX = "builtin-"
_ID_SHAPED = re.compile(r"[0-9a-fA-F]{32}")  # what a voice id looks like; names never do
_RACY_NS = 2_000_000_000  # a folder changed this recently may change again within its mtime's granularity


def model_identity(model_dir: str | Path) -> str:
    """A short hash of what a voice's tensors depend on. Each file adds its size and first MiB: cheap at
    start-up for the 1 GB speech tokenizer, yet different for any other model release."""
    digest = hashlib.sha256()
    for name in IDENTITY_FILES:
        path = Path(model_dir) / name
        digest.update(name.encode() + b"\0")
        if path.is_file():
            with open(path, "rb") as f:
                digest.update(f"{path.stat().st_size}\0".encode() + f.read(1 << 20))
    return digest.hexdigest()[:16]


def check_name(name: object) -> str:
    """A voice name, whitespace-normalised; :class:`InvalidInputError` for one that is empty, too long or could
    be mistaken for an id (then a delete by that string could remove another voice)."""
    if not isinstance(name, str):
        raise InvalidInputError(f"a voice name must be text, got {type(name).__name__}", "name")
    name = " ".join(name.split())
    if not name or len(name) > MAX_NAME_CHARS:
        raise InvalidInputError(f"a voice name must have 1 to {MAX_NAME_CHARS} characters, got {len(name)}", "name")
    if _ID_SHAPED.fullmatch(name) or name.startswith(BUILTIN_PREFIX):
        raise InvalidInputError(f"{name!r} looks like a voice id (32 hexadecimal digits, or {BUILTIN_PREFIX}...); "
                                "choose a name people can tell from an id", "name")
    return name


@dataclass
class VoiceInfo:
    """What the library knows of an entry without reading its tensors."""

    id: str
    name: str | None  # None: an unnamed, evictable cache entry
    transcript: str  # the user's words, without CosyVoice3's system prompt ('' for transcript-less voices)
    created: float
    last_used: float
    nbytes: int
    builtin: bool = False  # from the read-only built-in folder: listed first, never renamed or deleted
    owners: tuple[str, ...] = ()  # who uploaded this recording: an unnamed entry is visible to them alone
    creator: str | None = None  # the owner who saved it under its name (None: a local caller, or unknown)

    @property
    def label(self) -> str:
        """How people see the entry: its name, or the start of its transcript for an unnamed upload."""
        if self.name:
            return self.name
        words = self.transcript if len(self.transcript) <= 40 else self.transcript[:39] + "…"
        return f"recent upload: {words}" if words else "recent upload (no transcript)"

    def visible_to(self, owner: str | None) -> bool:
        return owner is None or self.builtin or self.name is not None or owner in self.owners


@dataclass
class _Builtin:
    """A built-in voice: its recording on disk, and its voice once featurised."""

    info: VoiceInfo
    wav: Path
    prompt_text: str
    voice: Voice | None = None


@dataclass
class _Stamp:
    """What identifies one version of an entry's JSON: a rewrite (atomic rename) or a use (utime) changes it."""

    ino: int
    size: int
    ctime_ns: int


@dataclass
class _Upload:
    """A decoded upload: its samples, rate and id, and its voice once loaded or featurised."""

    voice_id: str
    wav: torch.Tensor
    sample_rate: int
    prompt_text: str
    voice: Voice | None = field(default=None, repr=False)


class VoiceLibrary:
    """Prompt voices of one model, persisted under ``root``; safe to share between threads and processes.

    A read-only folder (or one this process may not write) is served read-only (:attr:`read_only` says why);
    a folder it cannot use otherwise (not a folder, holding leftovers it cannot remove) raises
    :class:`ConfigError` naming the folder and the setting to change: never a silent temporary library.
    """

    def __init__(self, root: str | Path, frontend: CosyVoiceFrontend, *, model_dir: str | Path,
                 max_entries: int = 64, max_bytes: int = 256 << 20, max_named: int = 256,
                 builtin_dir: str | Path | None = None, policy: VoicePolicy | None = None) -> None:
        self.model_id = model_identity(model_dir)
        self.dir = Path(root) / self.model_id
        self.frontend = frontend
        self.max_entries, self.max_bytes, self.max_named = max_entries, max_bytes, max_named
        self.policy = policy if policy is not None else VoicePolicy.from_env()
        self._lock = threading.RLock()  # guards the index and the folder lock's depth; features: outside it
        self._computing: dict[str, threading.Lock] = {}  # voice id -> lock held while its features are made
        self._index: dict[str, VoiceInfo] = {}
        self._stamps: dict[str, _Stamp] = {}
        self._dir_mtime: int | None = None  # the folder's mtime at the last scan; None: scan next time
        self._flock_fd: int | None = None
        self._flock_depth = 0
        self._store_failure: int | None = None  # errno of the last failed caching, logged once
        self._builtins: dict[str, _Builtin] = {}
        self.read_only: str | None = None  # why nothing can be saved (the folder's setting named), or None
        try:
            denied = unwritable(self.dir)
            if denied is None:
                with self._exclusive():
                    self._cleanup()
                    self._evict(keep=None)
        except (OSError, StorageError) as exc:
            cause = _os_error(exc)
            raise ConfigError(
                f"cannot use the voice folder {root} ({cause.strerror or cause}); set {VOICE_DIR_SETTING} "
                "(voice_dir= in Python, --voice-dir for the servers) to a folder the server can write") from exc
        if denied is not None:
            self.read_only = (f"the server's voice folder is read-only ({VOICE_DIR_SETTING}): its saved voices can "
                              "be used, but voices cannot be saved, renamed, imported or deleted")
            logger.warning("voice library: %s is not writable (%s); its saved voices are served read-only (set %s "
                           "to a folder the server can write to save voices)", root, denied.strerror,
                           VOICE_DIR_SETTING)
        if builtin_dir is not None:
            self.add_builtins(builtin_dir)

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
        upload = self._decode(prompt_wav, prompt_text)
        with self._featurising(upload.voice_id):
            self._load_or_featurise(upload)
            assert upload.voice is not None
            with self._lock:
                if self._index_serves(upload.voice_id, owner) or self.read_only:  # a hit, or nowhere to cache it
                    return upload.voice_id, upload.voice
            try:
                with self._exclusive():
                    info = self._index.get(upload.voice_id)
                    if info is None:
                        self._store(upload, None, owner)
                        self._store_failure = None
                    elif owner is not None and owner not in info.owners and info.name is None:
                        self._write_meta(replace(info, owners=(*info.owners, owner)))
            except (OSError, StorageError) as exc:
                self._caching_failed(upload.voice_id, _os_error(exc))
        return upload.voice_id, upload.voice

    def _index_serves(self, voice_id: str, owner: str | None) -> bool:
        info = self._index.get(voice_id)
        return info is not None and (owner is None or info.name is not None or owner in info.owners)

    def create(self, name: str, prompt_wav: AudioSource, prompt_text: str = "", *,
               owner: str | None = None) -> VoiceInfo:
        """Save a recording and its plain transcript under ``name`` in one step (featurised unless cached). A
        taken name, or this recording + text saved already under another name, is refused
        (:class:`AlreadyExistsError`)."""
        name = check_name(name)
        self._writable()  # before featurising: a refusal or a taken name fails fast
        self._check_free(name)
        upload = self._decode(prompt_wav, prompt_text)
        with self._featurising(upload.voice_id):
            self._load_or_featurise(upload)
            return self._name_upload(upload, name, owner)

    def get(self, key: str, *, owner: str | None = None) -> tuple[VoiceInfo, Voice]:
        """A voice by id or by name; :class:`NotFoundError` if unknown, :class:`InvalidInputError` if unreadable."""
        info = self.info(key, owner=owner)
        if info.builtin:
            return info, self._builtin_voice(info.id)
        return info, self._read(info, key)

    def info(self, key: str, *, owner: str | None = None) -> VoiceInfo:
        """The entry ``key`` (an id, else a name) as the folder has it now, if ``owner`` may see it."""
        with self._lock:
            self._sync()
            info = self._find(key, owner)
            if info is None:
                names = [i.name for i in self._entries() if i.name]
                raise NotFoundError(f"unknown voice {key!r}; saved voices: {', '.join(names) or 'none'}")
            return replace(info)

    def list(self, *, owner: str | None = None) -> list[VoiceInfo]:
        """Built-in voices, then named voices by name, then the uploads ``owner`` may see, most recently used
        first (the folder is re-read, so voices other processes saved, renamed or deleted are followed)."""
        with self._lock:
            self._sync()
            infos = [replace(i) for i in self._index.values() if i.visible_to(owner)]
            builtins = [replace(b.info) for b in self._builtins.values()]
        named = sorted((i for i in infos if i.name), key=lambda i: i.name.casefold())
        return builtins + named + sorted((i for i in infos if not i.name), key=lambda i: -i.last_used)

    def save(self, name: str, voice_id: str, *, owner: str | None = None) -> VoiceInfo:
        """Keep the entry ``voice_id`` under ``name`` (renaming it if it had one, which the policy must allow
        ``owner``); named voices are never evicted and are visible to everyone."""
        name = check_name(name)
        with self._exclusive():
            info = self._held(voice_id, owner)
            if info.builtin:
                raise InvalidInputError(f"{info.name!r} is a built-in voice; it is always available under its name")
            if info.name is not None and info.name != name:
                self._check_editor(info, owner, "rename")
            return self._write_name(info, name, owner)

    def rename(self, key: str, new_name: str, *, owner: str | None = None) -> VoiceInfo:
        """Give a saved voice (by id or name) another name; the same checks as :meth:`save`."""
        new_name = check_name(new_name)
        with self._exclusive():
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
        with self._exclusive():
            info = self._held(key, owner)
            if info.builtin:
                raise InvalidInputError(f"{info.name!r} is a built-in voice and cannot be deleted")
            if info.name is not None:
                self._check_editor(info, owner, "delete")
            others = tuple(o for o in info.owners if o != owner)
            try:
                if info.name is None and owner is not None and others:
                    self._write_meta(replace(info, owners=others))
                else:
                    self._remove(info.id)
            except (OSError, StorageError) as exc:
                raise _storage_error(exc, "delete this voice") from exc
            return replace(info)

    def recording(self, key: str, *, owner: str | None = None) -> tuple[int, np.ndarray]:
        """(sample rate, int16 samples) of a voice's prompt recording, for previews."""
        info = self.info(key, owner=owner)
        if info.builtin:
            wav, sample_rate = self.frontend.load_prompt(self._builtins[info.id].wav)
            return sample_rate, to_pcm16(wav.reshape(-1))
        tensors = self._tensors(info, key)
        if "prompt_audio" not in tensors:
            raise InvalidInputError(f"voice {info.label!r} was stored without its recording; upload it again to "
                                    "hear it")
        return int(tensors["prompt_audio_rate"]), tensors["prompt_audio"].numpy()

    def export(self, key: str, *, owner: str | None = None) -> tuple[str, bytes]:
        """(file name, bytes): one portable file with the voice's features, transcript and recording."""
        info = self.info(key, owner=owner)
        if info.name is not None and not info.builtin:
            self._check_editor(info, owner, "export")
        if info.builtin:
            voice = self._builtin_voice(info.id)
            tensors = {**voice.features.tensors(), "prompt_text": voice.prompt_text}
            sample_rate, pcm = self.recording(info.id)
            tensors.update(prompt_audio=torch.from_numpy(pcm), prompt_audio_rate=torch.tensor(sample_rate))
        else:  # as stored (without a recording for a voice imported from spk2info.pt: this model's features only)
            tensors = self._tensors(info, key)
        meta = {"format": EXPORT_FORMAT, "name": info.name or "", "transcript": info.transcript,
                "model": self.model_id}
        stem = "".join(c if c.isalnum() or c in "-_" else "_" for c in (info.name or info.id[:8]))
        return stem + EXPORT_SUFFIX, save({k: v.contiguous() for k, v in tensors.items()}, metadata=meta)

    def import_voice(self, data: bytes, name: str | None = None, *, owner: str | None = None) -> VoiceInfo:
        """Add an exported voice under ``name`` (default: its own). Files of another model are featurised
        again from their recording; a name already taken, or a voice saved already under another name, is
        refused before anything is stored."""
        try:
            meta = _metadata(data)
            tensors = load(data)
            if meta.get("format") != EXPORT_FORMAT:
                raise ValueError(f"format {meta.get('format')!r}")
            has_audio = "prompt_audio" in tensors
            transcript = str(meta.get("transcript", ""))
        except (SafetensorError, ValueError, KeyError, TypeError) as exc:
            raise InvalidInputError(f"this is not a voice file exported by CosyVoice3 Studio ({exc})") from exc
        if not " ".join(str(name or meta.get("name") or "").split()):
            raise InvalidInputError("the voice file has no name; give it one")
        name = check_name(str(name or meta.get("name")))
        self._check_free(name)
        prompt_text = " ".join(transcript.split())
        audio = None
        if has_audio:
            wav = (tensors["prompt_audio"].to(torch.float32) / 32768.0).reshape(1, -1)
            audio = (wav.numpy()[0], int(tensors["prompt_audio_rate"]))
        if meta.get("model") != self.model_id:  # another model: featurise the recording anew
            if audio is None:
                raise InvalidInputError("this voice file was made by another model and holds no recording to "
                                        "featurise again; export it from a library of this model")
            return self.create(name, audio, prompt_text, owner=owner)
        try:  # same model: the stored features are exactly ours
            voice = self._plain(Voice(PromptFeatures.from_tensors(tensors), tensors["prompt_text"].to(torch.int32)))
        except KeyError as exc:
            raise InvalidInputError(f"the voice file lacks {exc}") from exc
        if audio is not None:
            upload = self._decode(audio, prompt_text)  # the same checks an upload gets
        else:
            upload = _Upload(self.features_id(voice), torch.zeros(1, 0), 0, prompt_text)
        upload.voice = voice
        return self._name_upload(upload, name, owner)

    # ------------------------------------------------------------------ the official API's saved voices

    def put(self, name: str, voice: Voice, *, replace_name: bool = False) -> VoiceInfo:
        """Keep a ready voice (e.g. an imported ``spk2info.pt`` entry) under ``name``.

        Its id hashes its tensors, so the same voice is stored once however often it is imported. With
        ``replace_name`` a name held by another voice moves to this one (that voice stays, unnamed), as the
        official ``add_zero_shot_spk`` overwrites a speaker id; without it that is an error.
        """
        voice_id, voice = self.features_id(voice), self._plain(voice)  # the id of the voice as the file holds it
        ids = voice.prompt_text.reshape(-1).tolist()
        transcript = self.frontend.tokenizer.decode(ids, skip_special_tokens=False) if ids else ""
        upload = _Upload(voice_id, torch.zeros(1, 0), 0, transcript, voice)
        with self._exclusive():
            if upload.voice_id not in self._index:
                try:
                    self._store(upload, None, None)
                except (OSError, StorageError) as exc:
                    raise _storage_error(exc, f"store voice {name!r}") from exc
            return self.assign(name, upload.voice_id, replace_name=replace_name)

    def assign(self, name: str, voice_id: str, *, replace_name: bool = False) -> VoiceInfo:
        """:meth:`save`, and with ``replace_name`` the name is taken from the voice holding it (kept, unnamed)."""
        key = check_name(name)
        with self._exclusive():
            holder = next((i for i in self._index.values() if i.name == key), None)
            if replace_name and holder is not None and holder.id != voice_id:
                try:
                    self._write_meta(replace(holder, name=None, creator=None))
                except (OSError, StorageError) as exc:
                    raise _storage_error(exc, f"move the name {key!r}") from exc
            return self.save(key, voice_id)

    def named(self) -> list[VoiceInfo]:
        """The saved (named) voices, by name (built-ins are not saved voices: spk2info.pt never holds them)."""
        return [i for i in self.list() if i.name and not i.builtin]

    def features_id(self, voice: Voice) -> str:
        """The id of a ready voice (e.g. from spk2info.pt): a hash of its tensors."""
        digest = hashlib.sha256(f"{self.model_id}\0features".encode())
        for name, tensor in sorted({**voice.features.tensors(), "prompt_text": voice.prompt_text}.items()):
            t = tensor.detach().cpu().contiguous()
            digest.update(f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
            digest.update(t.numpy().tobytes())
        return digest.hexdigest()[:32]

    # ------------------------------------------------------------------ lookups and permissions

    def _entries(self) -> list[VoiceInfo]:
        return [*(b.info for b in self._builtins.values()), *self._index.values()]

    def _find(self, key: str, owner: str | None) -> VoiceInfo | None:
        """By id first, then by name (names never look like ids); entries ``owner`` may not see are not found."""
        entries = [i for i in self._entries() if i.visible_to(owner)]
        return next((i for i in entries if i.id == key), None) or next((i for i in entries if i.name == key), None)

    def _held(self, key: str, owner: str | None) -> VoiceInfo:
        """Under the folder lock: the index entry ``key`` as the folder has it now (not a copy)."""
        assert self._flock_depth > 0
        info = self._find(key, owner)
        if info is None:
            return self.info(key, owner=owner)  # raises NotFoundError with the names
        return info

    def _check_editor(self, info: VoiceInfo, owner: str | None, action: str) -> None:
        if not self.policy.may_edit(owner, info.creator):
            who = {"creator": "the one who saved it", "admin": "an administrator"}[self.policy.editors]
            raise PermissionDeniedError(f"you may not {action} the voice {info.name!r}: only {who} may")

    def _check_free(self, name: str) -> None:
        with self._lock:
            self._sync()
            holder = next((i for i in self._entries() if i.name == name), None)
        if holder is not None:
            raise AlreadyExistsError(f"a voice named {name!r} exists already; delete it or choose another name",
                                     "name")

    # ------------------------------------------------------------------ features

    def _decode(self, prompt_wav: AudioSource, prompt_text: str) -> _Upload:
        prompt_text = " ".join(prompt_text.split())  # the cached voice is a function of its id alone
        wav, sample_rate = self.frontend.load_prompt(prompt_wav)
        return _Upload(self._voice_id(wav, sample_rate, prompt_text), wav, sample_rate, prompt_text)

    @contextlib.contextmanager
    def _featurising(self, voice_id: str) -> Iterator[None]:
        """Held while one upload's features are loaded or made: concurrent callers of the same recording wait."""
        with self._lock:
            computing = self._computing.setdefault(voice_id, threading.Lock())
        try:
            with computing:
                yield
        finally:
            with self._lock:
                if self._computing.get(voice_id) is computing:
                    del self._computing[voice_id]

    def _load_or_featurise(self, upload: _Upload) -> None:
        with self._lock:
            self._sync()
            info = self._index.get(upload.voice_id)
        if upload.voice is None and info is not None:
            with contextlib.suppress(InvalidInputError, NotFoundError):  # unreadable or gone: made anew below
                upload.voice = self._read(info, upload.voice_id)
        if upload.voice is None:
            upload.voice = self.frontend.voice_from(self.frontend.features(upload.wav, upload.sample_rate),
                                                    upload.prompt_text)

    def _name_upload(self, upload: _Upload, name: str, owner: str | None) -> VoiceInfo:
        """Store (if new) and name an upload in one step under the folder lock."""
        with self._exclusive():
            info = self._index.get(upload.voice_id)
            if info is not None and info.name is not None and info.name != name:
                raise AlreadyExistsError(f"this voice is saved already as {info.name!r}")
            if info is None:
                try:
                    info = self._store(upload, name, owner)
                except (OSError, StorageError) as exc:
                    raise _storage_error(exc, f"save the voice {name!r}") from exc
                return replace(info)
            return self._write_name(info, name, owner)

    # ------------------------------------------------------------------ the folder

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """This thread alone in this process, this process alone on the folder, with the index re-read from it.

        Reentrant. ``flock`` of ``<folder>/.lock``: released by the kernel if the process dies, even by kill -9.
        """
        self._writable()
        with self._lock:
            if self._flock_depth == 0:
                try:
                    fd = os.open(self.dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
                except (OSError, StorageError) as exc:  # e.g. the folder was remounted read-only after start-up
                    raise _storage_error(exc, "change the voice library") from exc
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                except BaseException:
                    os.close(fd)
                    raise
                self._flock_fd = fd
            self._flock_depth += 1
            try:
                if self._flock_depth == 1:
                    self._sync(force=True)  # other processes' changes, seen before any decision
                yield
            finally:
                self._flock_depth -= 1
                if self._flock_depth == 0:
                    fd, self._flock_fd = self._flock_fd, None
                    os.close(fd)  # closing releases the flock

    def _sync(self, force: bool = False) -> None:
        """Re-read the folder if it changed since the last scan (any create, rename or delete in it changes its
        mtime; a scan within the mtime's granularity of a change is repeated next time). Call with the lock."""
        try:
            mtime = os.stat(self.dir).st_mtime_ns
        except OSError:
            mtime = None
        if not force and mtime is not None and mtime == self._dir_mtime:
            return
        started = time.time_ns()
        self._scan()
        self._dir_mtime = None if mtime is None or started - mtime < _RACY_NS else mtime

    def _scan(self) -> None:
        """Make the index what the folder holds: new entries appear, renamed ones change, deleted ones go. An
        unreadable JSON is skipped with a log line, never fatal (call with the lock)."""
        seen: set[str] = set()
        try:
            listing = list(os.scandir(self.dir))
        except OSError as exc:
            if not (self.read_only and isinstance(exc, FileNotFoundError)):  # read-only: there may be none
                logger.warning("voice library: cannot read its folder (%s)", exc)
            return
        for entry in listing:
            if entry.name.startswith(".") or not entry.name.endswith(".json"):
                continue
            voice_id = entry.name[:-len(".json")]
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            seen.add(voice_id)
            stamp = _Stamp(st.st_ino, st.st_size, st.st_ctime_ns)
            info = self._index.get(voice_id)
            if info is not None and self._stamps.get(voice_id) == stamp:
                continue
            try:
                info = self._read_meta(voice_id, st.st_mtime)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                if not os.path.exists(entry.path):  # deleted meanwhile by another process
                    seen.discard(voice_id)
                    continue
                if self._stamps.get(voice_id) != stamp:
                    logger.warning("voice library: skipping %s (%s: %s)", entry.path, type(exc).__name__, exc)
                self._stamps[voice_id] = stamp
                self._index.pop(voice_id, None)
                continue
            self._index[voice_id] = info
            self._stamps[voice_id] = stamp
        for voice_id in [v for v in self._index if v not in seen]:
            del self._index[voice_id]
        for voice_id in [v for v in self._stamps if v not in seen]:
            del self._stamps[voice_id]

    def _read_meta(self, voice_id: str, mtime: float) -> VoiceInfo:
        tensors_path, meta_path = self._paths(voice_id)
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if meta["name"] and _ID_SHAPED.fullmatch(str(meta["name"])):
            logger.warning("voice library: voice %s is named like an id (%r); use it by its id", voice_id,
                           meta["name"])
        return VoiceInfo(
            id=voice_id, name=str(meta["name"]) if meta["name"] else None, transcript=str(meta["transcript"]),
            created=float(meta["created"]), last_used=mtime,
            nbytes=meta_path.stat().st_size + tensors_path.stat().st_size,
            owners=tuple(str(o) for o in meta.get("owners") or ()), creator=meta.get("creator"))

    def _cleanup(self) -> None:
        """Remove what interrupted writes left (under the folder lock, so no live writer is mid-way); a leftover
        that cannot be removed means a folder this server cannot write: an OSError, which stops start-up."""
        for leftover in [*self.dir.glob(".*.tmp"), *self.dir.glob("*.safetensors")]:
            if leftover.suffix == ".tmp" or not leftover.with_suffix(".json").exists():
                leftover.unlink(missing_ok=True)

    def _writable(self) -> None:
        if self.read_only:
            raise ReadOnlyError(self.read_only)

    def _paths(self, voice_id: str) -> tuple[Path, Path]:
        return self.dir / f"{voice_id}.safetensors", self.dir / f"{voice_id}.json"

    def _voice_id(self, wav: torch.Tensor, sample_rate: int, prompt_text: str) -> str:
        # hashed in the prefixed form the library stored before it kept plain transcripts: same ids as then
        text = (zero_shot_prompt_text(prompt_text) if prompt_text else "").encode()
        digest = hashlib.sha256(f"{self.model_id}\0{sample_rate}\0{len(text)}\0".encode() + text)
        digest.update(wav.contiguous().numpy().tobytes())
        return digest.hexdigest()[:32]

    def _tensors(self, info: VoiceInfo, key: str) -> dict[str, torch.Tensor]:
        """An entry's tensors, read into memory (no mapping: deleting the voice frees its space at once).

        An unreadable cache entry is dropped (the upload recreates it); a named voice's files are kept aside as
        ``*.unreadable``, never deleted. Errors name the voice, never a server path.
        """
        tensors_path, meta_path = self._paths(info.id)
        try:
            return load(tensors_path.read_bytes())
        except (OSError, SafetensorError, ValueError) as exc:
            failure = exc
        if self.read_only:  # nothing can be dropped or set aside
            raise InvalidInputError(f"voice {key!r} could not be read from disk") from failure
        with self._exclusive():
            now = self._index.get(info.id)
            if now is None or not meta_path.exists():  # deleted by another process sharing the folder
                raise NotFoundError(f"voice {key!r} was deleted") from failure
            kept = ""
            try:
                if now.name is None:
                    logger.warning("voice library: dropping unreadable cached voice %s (%s: %s)", info.id,
                                   type(failure).__name__, failure)
                    self._remove(info.id)
                else:
                    logger.error("voice library: saved voice %r is unreadable (%s: %s); its files are kept as "
                                 "%s.*.unreadable in %s", now.name, type(failure).__name__, failure, info.id, self.dir)
                    for path in (meta_path, tensors_path):  # the JSON first: without it the entry no longer exists
                        with contextlib.suppress(FileNotFoundError):
                            path.rename(path.with_name(path.name + ".unreadable"))
                    self._index.pop(info.id, None)
                    kept = "; its files were kept aside for the server's operator"
            except OSError as exc:
                logger.error("voice library: cannot set aside the unreadable voice %s (%s)", info.id, exc)
            raise InvalidInputError(f"voice {key!r} could not be read from disk{kept}; upload it again") from failure

    def _read(self, info: VoiceInfo, key: str) -> Voice:
        tensors = self._tensors(info, key)
        try:
            voice = self._plain(Voice(PromptFeatures.from_tensors(tensors), tensors["prompt_text"].to(torch.int32)))
        except (KeyError, ValueError) as exc:
            raise InvalidInputError(f"voice {key!r} is incomplete on disk ({exc}); upload it again") from exc
        try:
            os.utime(self._paths(info.id)[1])  # persists the use for eviction order
        except OSError as exc:
            logger.debug("voice library: cannot mark %s as used (%s)", info.id, exc)
        with self._lock:
            if info.id in self._index:
                self._index[info.id].last_used = time.time()
        return voice

    def _plain(self, voice: Voice) -> Voice:
        """``voice`` with its plain transcript ids: entries saved before the library kept plain transcripts, older
        exports and ``spk2info.pt`` hold them after the system prompt, which the pipeline adds itself."""
        ids = voice.prompt_text.reshape(-1).tolist()
        plain = transcript_ids(ids, self.frontend.tokenizer.end_of_prompt_id)
        if len(plain) == len(ids):
            return voice
        return Voice(voice.features, torch.tensor([plain], dtype=torch.int32).reshape(1, -1))

    def _store(self, upload: _Upload, name: str | None, owner: str | None) -> VoiceInfo:
        """Write a new entry (with its recording, where there is one), then evict; under the folder lock. A
        failed write leaves no partial entry and raises the OSError."""
        assert self._flock_depth > 0 and upload.voice is not None
        voice = upload.voice
        tensors = {**voice.features.tensors(), "prompt_text": voice.prompt_text}
        if upload.wav.numel():
            tensors.update(prompt_audio=torch.from_numpy(to_pcm16(upload.wav.reshape(-1))),
                           prompt_audio_rate=torch.tensor(upload.sample_rate))
        data = save({k: v.contiguous() for k, v in tensors.items()})
        now = time.time()
        info = VoiceInfo(upload.voice_id, name, upload.prompt_text, now, now, 0,
                         owners=() if owner is None or name else (owner,), creator=owner if name else None)
        tensors_path, _ = self._paths(upload.voice_id)
        try:
            atomic_write(tensors_path, lambda tmp: Path(tmp).write_bytes(data))
            self._write_meta(info)
        except OSError:
            tensors_path.unlink(missing_ok=True)  # no JSON: not an entry; its space is given back
            raise
        info = self._index[upload.voice_id]
        self._evict(keep=upload.voice_id)
        return info

    def _write_name(self, info: VoiceInfo, name: str, owner: str | None) -> VoiceInfo:
        """Name the entry ``info`` (under the folder lock, index fresh): unique, bounded, written atomically."""
        assert self._flock_depth > 0
        if info.name == name:
            return replace(info)
        holder = next((i for i in self._entries() if i.name == name), None)
        if holder is not None and holder.id != info.id:
            raise AlreadyExistsError(f"a voice named {name!r} exists already; delete it or choose another name",
                                     "name")
        if info.name is None and sum(i.name is not None for i in self._index.values()) >= self.max_named:
            # a full library is the user's to fix (not a transient overload): a 400, not a 503
            raise InvalidInputError(f"{self.max_named} voices are saved already; delete one to save another", "name")
        creator = info.creator if info.name is not None else owner
        try:
            self._write_meta(replace(info, name=name, owners=(), creator=creator))
        except (OSError, StorageError) as exc:
            raise _storage_error(exc, f"save the voice {name!r}") from exc
        return replace(self._index[info.id])

    def _write_meta(self, info: VoiceInfo) -> None:
        """Replace an entry's JSON atomically and index it as written (under the folder lock)."""
        assert self._flock_depth > 0
        data = json.dumps({"name": info.name, "transcript": info.transcript, "created": info.created,
                           "owners": list(info.owners), "creator": info.creator}, ensure_ascii=False).encode()
        tensors_path, meta_path = self._paths(info.id)
        atomic_write(meta_path, lambda tmp: Path(tmp).write_bytes(data))
        st = meta_path.stat()
        self._index[info.id] = replace(info, nbytes=len(data) + tensors_path.stat().st_size)
        self._stamps[info.id] = _Stamp(st.st_ino, st.st_size, st.st_ctime_ns)

    def _caching_failed(self, voice_id: str, exc: OSError) -> None:
        """A cache write failed: the request goes on without caching; logged once per kind of failure."""
        if exc.errno != self._store_failure:
            logger.warning("voice library: uploads are used without caching them in %s (%s); the first was %s",
                           self.dir, exc.strerror or exc, voice_id)
        self._store_failure = exc.errno

    def _evict(self, keep: str | None) -> None:
        """Drop least recently used unnamed entries until both bounds hold (never ``keep``, the newest). Under
        the folder lock, after a re-read: an entry another process has named is never touched."""
        assert self._flock_depth > 0
        cached = sorted((i for i in self._index.values() if i.name is None and i.id != keep),
                        key=lambda i: i.last_used)
        count = len(cached) + (keep is not None)
        size = sum(i.nbytes for i in cached) + (self._index[keep].nbytes if keep else 0)
        for info in cached:
            if count <= self.max_entries and size <= self.max_bytes:
                break
            try:
                self._remove(info.id)
            except OSError as exc:
                logger.warning("voice library: cannot evict %s (%s)", info.id, exc)
                return
            count, size = count - 1, size - info.nbytes

    def _remove(self, voice_id: str) -> None:
        assert self._flock_depth > 0
        for path in self._paths(voice_id)[::-1]:  # the JSON first: without it the entry no longer exists
            path.unlink(missing_ok=True)
        self._index.pop(voice_id, None)
        self._stamps.pop(voice_id, None)

    # ------------------------------------------------------------------ built-in voices

    def add_builtins(self, folder: str | Path) -> None:
        """Offer the ``<name>.wav`` + ``<name>.txt`` pairs of ``folder`` as built-in voices (featurised on first
        use); a recording without a transcript is skipped with a log line, a missing folder adds none."""
        folder = Path(folder)
        builtins: dict[str, _Builtin] = {}
        for wav in sorted(folder.glob("*.wav")) if folder.is_dir() else []:
            transcript_path = wav.with_suffix(".txt")
            if not transcript_path.is_file():
                logger.warning("voice library: built-in %s has no transcript (%s); skipped", wav, transcript_path.name)
                continue
            transcript = " ".join(transcript_path.read_text(encoding="utf-8").split())
            info = VoiceInfo(id=f"{BUILTIN_PREFIX}{wav.stem}", name=wav.stem, transcript=transcript, created=0.0,
                             last_used=0.0, nbytes=0, builtin=True)
            builtins[info.id] = _Builtin(info, wav, transcript)
        with self._lock:
            self._builtins.update(builtins)

    def _builtin_voice(self, voice_id: str) -> Voice:
        """A built-in's voice, featurised once per process (the shared per-id lock keeps that to one)."""
        entry = self._builtins[voice_id]
        with self._featurising(voice_id):
            if entry.voice is None:
                wav, sample_rate = self.frontend.load_prompt(entry.wav)
                entry.voice = self.frontend.voice_from(self.frontend.features(wav, sample_rate), entry.prompt_text)
        return entry.voice


def _os_error(exc: OSError | StorageError) -> OSError:
    """The OSError behind a failed write (a StorageError made by :func:`_storage_error` carries it)."""
    return exc if isinstance(exc, OSError) else exc.__cause__ if isinstance(exc.__cause__, OSError) else OSError(exc)


def _storage_error(failed: OSError | StorageError, action: str) -> StorageError:
    """A failed write as users may read it: what could not be done and why, without the server's paths."""
    exc = _os_error(failed)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        why = "the server's disk for voices is full; delete voices you no longer need, or ask its operator"
    elif exc.errno == errno.EROFS:
        why = "the server's voice folder has become read-only; ask its operator"
    else:
        why = f"the server could not write it ({exc.strerror or type(exc).__name__})"
    return StorageError(f"could not {action}: {why}")


def _metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file in memory (its JSON header)."""
    if len(data) < 8:
        raise ValueError("file too short")
    size = int.from_bytes(data[:8], "little")
    if size > len(data) - 8:
        raise ValueError("truncated header")
    header = json.loads(data[8:8 + size])
    return dict(header.get("__metadata__") or {})
