"""The folder of one model's voices: the truth for every process that shares it (servers, web UI, the Python API).

Each process's :attr:`VoiceFolder.index` is only a cache of it, re-read when the folder changes. Every change is made
under an exclusive ``flock`` of ``<folder>/.lock`` (:meth:`VoiceFolder.exclusive`) after re-reading the folder, and
every file is replaced atomically; ``flock`` rather than O_EXCL name files: the kernel releases it when a process
dies, even by ``kill -9``. Unnamed entries are a cache, bounded by :meth:`VoiceFolder.evict` (least recently used
first); named ones stay until deleted. See :mod:`cosyvoice.voices` for the layout.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from cosyvoice.encoding import to_pcm16
from cosyvoice.errors import ConfigError, InvalidInputError, NotFoundError, ReadOnlyError, StorageError
from cosyvoice.settings import VOICE_DIR_SETTING
from cosyvoice.system.fs import atomic_write, unwritable
from cosyvoice.voices.entries import ID_SHAPED, Stamp, Upload, VoiceInfo, os_error, storage_error

logger = logging.getLogger(__name__)

LOCK_FILE = ".lock"
_RACY_NS = 2_000_000_000  # a folder changed this recently may change again within its mtime's granularity


class VoiceFolder:
    """The entries of ``<root>/<model_id>``: their index, read from the folder, and every write to it; unnamed
    entries bounded by ``max_entries`` and ``max_bytes``. A read-only folder (or one this process may not write)
    is served read-only (:attr:`read_only` says why); a folder it cannot use otherwise (not a folder, holding
    leftovers it cannot remove) raises :class:`ConfigError` naming the folder and the setting to change."""

    def __init__(self, root: str | Path, model_id: str, *, max_entries: int, max_bytes: int) -> None:
        self.dir = Path(root) / model_id
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.lock = threading.RLock()  # guards the index and the folder lock's depth
        self.index: dict[str, VoiceInfo] = {}
        self._stamps: dict[str, Stamp] = {}
        self._dir_mtime: int | None = None  # the folder's mtime at the last scan; None: scan next time
        self._flock_fd: int | None = None
        self._flock_depth = 0
        self.read_only: str | None = None  # why nothing can be saved (the folder's setting named), or None
        try:
            denied = unwritable(self.dir)
            if denied is None:
                with self.exclusive():
                    self._cleanup()
                    self.evict(keep=None)
        except (OSError, StorageError) as exc:
            cause = os_error(exc)
            raise ConfigError(
                f"cannot use the voice folder {root} ({cause.strerror or cause}); set {VOICE_DIR_SETTING} "
                "(voice_dir= in Python, --voice-dir for the servers) to a folder the server can write") from exc
        if denied is not None:
            self.read_only = (f"the server's voice folder is read-only ({VOICE_DIR_SETTING}): its saved voices can "
                              "be used, but voices cannot be saved, renamed, imported or deleted")
            logger.warning("voice library: %s is not writable (%s); its saved voices are served read-only (set %s "
                           "to a folder the server can write to save voices)", root, denied.strerror,
                           VOICE_DIR_SETTING)

    @property
    def held(self) -> bool:
        """Whether this thread holds the folder lock (:meth:`exclusive`)."""
        return self._flock_depth > 0

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """This thread alone in this process, this process alone on the folder, with the index re-read from it.

        Reentrant. ``flock`` of ``<folder>/.lock``: released by the kernel if the process dies, even by kill -9.
        """
        self.writable()
        with self.lock:
            if self._flock_depth == 0:
                try:
                    fd = os.open(self.dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
                except (OSError, StorageError) as exc:  # e.g. the folder was remounted read-only after start-up
                    raise storage_error(exc, "change the voice library") from exc
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                except BaseException:
                    os.close(fd)
                    raise
                self._flock_fd = fd
            self._flock_depth += 1
            try:
                if self._flock_depth == 1:
                    self.sync(force=True)  # other processes' changes, seen before any decision
                yield
            finally:
                self._flock_depth -= 1
                if self._flock_depth == 0:
                    fd, self._flock_fd = self._flock_fd, None
                    os.close(fd)  # closing releases the flock

    def sync(self, force: bool = False) -> None:
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
            stamp = Stamp(st.st_ino, st.st_size, st.st_ctime_ns)
            info = self.index.get(voice_id)
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
                self.index.pop(voice_id, None)
                continue
            self.index[voice_id] = info
            self._stamps[voice_id] = stamp
        for voice_id in [v for v in self.index if v not in seen]:
            del self.index[voice_id]
        for voice_id in [v for v in self._stamps if v not in seen]:
            del self._stamps[voice_id]

    def _read_meta(self, voice_id: str, mtime: float) -> VoiceInfo:
        tensors_path, meta_path = self.paths(voice_id)
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if meta["name"] and ID_SHAPED.fullmatch(str(meta["name"])):
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

    def writable(self) -> None:
        if self.read_only:
            raise ReadOnlyError(self.read_only)

    def paths(self, voice_id: str) -> tuple[Path, Path]:
        return self.dir / f"{voice_id}.safetensors", self.dir / f"{voice_id}.json"

    def tensors(self, info: VoiceInfo, key: str) -> dict[str, torch.Tensor]:
        """An entry's tensors, read into memory (no mapping: deleting the voice frees its space at once).

        An unreadable cache entry is dropped (the upload recreates it); a named voice's files are kept aside as
        ``*.unreadable``, never deleted. Errors name the voice, never a server path.
        """
        tensors_path, meta_path = self.paths(info.id)
        try:
            return load(tensors_path.read_bytes())
        except (OSError, SafetensorError, ValueError) as exc:
            failure = exc
        if self.read_only:  # nothing can be dropped or set aside
            raise InvalidInputError(f"voice {key!r} could not be read from disk") from failure
        with self.exclusive():
            now = self.index.get(info.id)
            if now is None or not meta_path.exists():  # deleted by another process sharing the folder
                raise NotFoundError(f"voice {key!r} was deleted") from failure
            kept = ""
            try:
                if now.name is None:
                    logger.warning("voice library: dropping unreadable cached voice %s (%s: %s)", info.id,
                                   type(failure).__name__, failure)
                    self.remove(info.id)
                else:
                    logger.error("voice library: saved voice %r is unreadable (%s: %s); its files are kept as "
                                 "%s.*.unreadable in %s", now.name, type(failure).__name__, failure, info.id, self.dir)
                    for path in (meta_path, tensors_path):  # the JSON first: without it the entry no longer exists
                        with contextlib.suppress(FileNotFoundError):
                            path.rename(path.with_name(path.name + ".unreadable"))
                    self.index.pop(info.id, None)
                    kept = "; its files were kept aside for the server's operator"
            except OSError as exc:
                logger.error("voice library: cannot set aside the unreadable voice %s (%s)", info.id, exc)
            raise InvalidInputError(f"voice {key!r} could not be read from disk{kept}; upload it again") from failure

    def store(self, upload: Upload, name: str | None, owner: str | None) -> VoiceInfo:
        """Write a new entry (with its recording, where there is one), then evict; under the folder lock. A
        failed write leaves no partial entry and raises the OSError."""
        assert self.held and upload.voice is not None
        voice = upload.voice
        tensors = {**voice.features.tensors(), "prompt_text": voice.prompt_text}
        if upload.wav.numel():
            tensors.update(prompt_audio=torch.from_numpy(to_pcm16(upload.wav.reshape(-1))),
                           prompt_audio_rate=torch.tensor(upload.sample_rate))
        data = save({k: v.contiguous() for k, v in tensors.items()})
        now = time.time()
        info = VoiceInfo(upload.voice_id, name, upload.prompt_text, now, now, 0,
                         owners=() if owner is None or name else (owner,), creator=owner if name else None)
        tensors_path, _ = self.paths(upload.voice_id)
        try:
            atomic_write(tensors_path, lambda tmp: Path(tmp).write_bytes(data))
            self.write_meta(info)
        except OSError:
            tensors_path.unlink(missing_ok=True)  # no JSON: not an entry; its space is given back
            raise
        info = self.index[upload.voice_id]
        self.evict(keep=upload.voice_id)
        return info

    def write_meta(self, info: VoiceInfo) -> None:
        """Replace an entry's JSON atomically and index it as written (under the folder lock)."""
        assert self.held
        data = json.dumps({"name": info.name, "transcript": info.transcript, "created": info.created,
                           "owners": list(info.owners), "creator": info.creator}, ensure_ascii=False).encode()
        tensors_path, meta_path = self.paths(info.id)
        atomic_write(meta_path, lambda tmp: Path(tmp).write_bytes(data))
        st = meta_path.stat()
        self.index[info.id] = replace(info, nbytes=len(data) + tensors_path.stat().st_size)
        self._stamps[info.id] = Stamp(st.st_ino, st.st_size, st.st_ctime_ns)

    def evict(self, keep: str | None) -> None:
        """Drop least recently used unnamed entries until both bounds hold (never ``keep``, the newest). Under
        the folder lock, after a re-read: an entry another process has named is never touched."""
        assert self.held
        cached = sorted((i for i in self.index.values() if i.name is None and i.id != keep),
                        key=lambda i: i.last_used)
        count = len(cached) + (keep is not None)
        size = sum(i.nbytes for i in cached) + (self.index[keep].nbytes if keep else 0)
        for info in cached:
            if count <= self.max_entries and size <= self.max_bytes:
                break
            try:
                self.remove(info.id)
            except OSError as exc:
                logger.warning("voice library: cannot evict %s (%s)", info.id, exc)
                return
            count, size = count - 1, size - info.nbytes

    def remove(self, voice_id: str) -> None:
        assert self.held
        for path in self.paths(voice_id)[::-1]:  # the JSON first: without it the entry no longer exists
            path.unlink(missing_ok=True)
        self.index.pop(voice_id, None)
        self._stamps.pop(voice_id, None)
