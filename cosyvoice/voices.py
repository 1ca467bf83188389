"""A persistent library of prompt voices, so that a recording is featurised once and then reused.

Featurising a prompt (speech tokenizer, speaker encoder, mel) is the slowest step of a zero-shot request
before the model itself runs, and people upload the same recording again and again. Entries are
content-addressed: the id hashes the decoded samples, their sample rate, the whitespace-normalised prompt
text and the model's identity, so re-encoding a recording to another format still hits, and another model
(other tokenizer or speaker encoder) never reuses features it did not make.

On disk, one folder per model identity holds ``<id>.safetensors`` (the tensors) and ``<id>.json`` (name,
transcript, creation time). The JSON is written last, so an entry exists once its JSON does; its mtime is
the last use. Unnamed entries are a cache: the least recently used go when there are more than
``max_entries`` of them or they take more than ``max_bytes``. Named entries (saved voices) stay until deleted.
Each entry also keeps its prompt recording (16-bit, as decoded) so that a voice can be previewed and exported.

Built-in voices come from a read-only folder of ``<name>.wav`` + ``<name>.txt`` (its transcript), e.g. the
repository's ``assets/voices``; they are listed first, featurised on first use, and cannot be renamed or
deleted. An exported voice is one safetensors file holding the features, the transcript's token ids, the
recording and (as metadata) the name, transcript and model identity; importing it into a library of another
model recomputes the features from the recording, so the file stays portable across model releases.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load, load_file, save, save_file

from cosyvoice.bundle import ONNX_INPUTS, TOKENIZER_FILES
from cosyvoice.encoding import to_pcm16
from cosyvoice.errors import AlreadyExistsError, InvalidInputError, NotFoundError, ResourceLimitError
from cosyvoice.frontend.audio import AudioSource
from cosyvoice.frontend.frontend import CosyVoiceFrontend, Voice
from cosyvoice.frontend.prompt import PromptFeatures
from cosyvoice.frontend.prompts import user_text, zero_shot_prompt_text
from cosyvoice.utils.fs import atomic_write

logger = logging.getLogger(__name__)

MAX_NAME_CHARS = 64
# the repository's built-in voices (a clone's assets/voices; absent from an installed wheel, then none)
BUILTIN_VOICE_DIR = Path(__file__).resolve().parents[1] / "assets" / "voices"
EXPORT_FORMAT = "cosyvoice3-voice/1"  # the metadata tag of an exported voice file
EXPORT_SUFFIX = ".voice.safetensors"
# The files a voice's tensors depend on: the mel settings (yaml), the two ONNX models, the text tokenizer.
IDENTITY_FILES = ("cosyvoice3.yaml", *ONNX_INPUTS, *TOKENIZER_FILES)


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

    @property
    def label(self) -> str:
        """How people see the entry: its name, or the start of its transcript for an unnamed upload."""
        if self.name:
            return self.name
        words = self.transcript if len(self.transcript) <= 40 else self.transcript[:39] + "…"
        return f"recent upload: {words}" if words else "recent upload (no transcript)"


@dataclass
class _Builtin:
    """A built-in voice: its recording on disk, and its voice once featurised."""

    info: VoiceInfo
    wav: Path
    prompt_text: str
    voice: Voice | None = None


class VoiceLibrary:
    """Prompt voices of one model, persisted under ``root``; safe to share between threads."""

    def __init__(self, root: str | Path, frontend: CosyVoiceFrontend, *, model_dir: str | Path,
                 max_entries: int = 64, max_bytes: int = 256 << 20, max_named: int = 256,
                 builtin_dir: str | Path | None = None) -> None:
        self.model_id = model_identity(model_dir)
        self.dir = Path(root) / self.model_id
        self.dir.mkdir(parents=True, exist_ok=True)
        self.frontend = frontend
        self.max_entries, self.max_bytes, self.max_named = max_entries, max_bytes, max_named
        self._lock = threading.RLock()  # guards _index and _computing; features and tensor files: outside it
        self._computing: dict[str, threading.Lock] = {}  # voice id -> lock held while its features are made
        self._index = self._scan()
        self._builtins: dict[str, _Builtin] = {}
        if builtin_dir is not None:
            self.add_builtins(builtin_dir)
        with self._lock:
            self._evict(keep=None)

    # ------------------------------------------------------------------ public API

    def get_or_create(self, prompt_wav: AudioSource, prompt_text: str = "") -> tuple[str, Voice]:
        """The voice of a recording and its prompt text (already in CosyVoice3's form, or ``''``).

        The audio is decoded and validated first (so bad uploads fail with the frontend's message); features
        are computed only on a miss, and once even when several requests bring the same recording at once.
        """
        prompt_text = " ".join(prompt_text.split())  # the cached voice is a function of its id alone
        wav, sample_rate = self.frontend.load_prompt(prompt_wav)
        voice_id = self._voice_id(wav, sample_rate, prompt_text)
        with self._lock:
            computing = self._computing.setdefault(voice_id, threading.Lock())
        try:
            with computing:
                voice = self._load(voice_id)
                if voice is None:
                    voice = self.frontend.voice_from(self.frontend.features(wav, sample_rate), prompt_text)
                    self._store(voice_id, voice, prompt_text, (wav, sample_rate))
        finally:
            with self._lock:
                if self._computing.get(voice_id) is computing:
                    del self._computing[voice_id]
        return voice_id, voice

    def get(self, key: str) -> tuple[VoiceInfo, Voice]:
        """A voice by id or by name; :class:`InvalidInputError` if unknown or unreadable."""
        info = self.info(key)
        if info.builtin:
            return info, self._builtin_voice(info.id)
        voice = self._load(info.id)
        if voice is None:
            kept = f"; its files were kept as {info.id}.*.unreadable in {self.dir}" if info.name else ""
            raise InvalidInputError(f"voice {key!r} could not be read from disk{kept}; upload it again")
        return info, voice

    def info(self, key: str) -> VoiceInfo:
        with self._lock:
            info = self._find(key)
            if info is None:  # perhaps saved since by another process sharing the folder (REST, gRPC, web UI)
                self._refresh()
                info = self._find(key)
            if info is None:
                names = [i.name for i in self._entries() if i.name]
                raise NotFoundError(f"unknown voice {key!r}; saved voices: {', '.join(names) or 'none'}")
            return info

    def _entries(self) -> list[VoiceInfo]:
        return [*(b.info for b in self._builtins.values()), *self._index.values()]

    def _find(self, key: str) -> VoiceInfo | None:
        entries = self._entries()
        return next((i for i in entries if i.id == key), None) or next((i for i in entries if i.name == key), None)

    def _refresh(self) -> None:
        """Follow the folder: entries other processes saved appear, entries they deleted go (call with the lock)."""
        on_disk = self._scan(cleanup=False)
        for voice_id in [v for v in self._index if v not in on_disk]:
            del self._index[voice_id]
        for voice_id, info in on_disk.items():
            self._index.setdefault(voice_id, info)

    def list(self) -> list[VoiceInfo]:
        """Built-in voices, then named voices by name, then cached uploads, most recently used first (the
        folder is re-read, so voices other processes saved are listed too)."""
        with self._lock:
            self._refresh()
            infos = list(self._index.values())
            builtins = [b.info for b in self._builtins.values()]
        named = sorted((i for i in infos if i.name), key=lambda i: i.name.casefold())
        return builtins + named + sorted((i for i in infos if not i.name), key=lambda i: -i.last_used)

    def save(self, name: str, voice_id: str) -> VoiceInfo:
        """Keep ``voice_id`` under ``name`` (renaming it if it had one); named voices are never evicted."""
        name = " ".join(str(name).split())
        if not name or len(name) > MAX_NAME_CHARS:
            raise InvalidInputError(f"a voice name must have 1 to {MAX_NAME_CHARS} characters, got {len(name)}")
        with self._lock:
            info = self.info(voice_id)
            if info.builtin:
                raise InvalidInputError(f"{info.name!r} is a built-in voice; it is always available under its name")
            holder = next((i for i in self._entries() if i.name == name), None)
            if holder is not None and holder.id != info.id:
                raise AlreadyExistsError(f"a voice named {name!r} exists already; delete it or choose another name")
            if info.name is None and sum(i.name is not None for i in self._index.values()) >= self.max_named:
                raise ResourceLimitError(f"{self.max_named} voices are saved already; delete one to save another")
            self._write_meta(replace(info, name=name))  # disk first: a failed write leaves the entry as it was
            info.name = name
            return info

    def rename(self, key: str, new_name: str) -> VoiceInfo:
        """Give a saved voice (by id or name) another name; the same checks as :meth:`save`."""
        info = self.info(key)
        if not info.name:
            raise InvalidInputError("only saved voices can be renamed; save this one under a name first")
        return self.save(new_name, info.id)

    def delete(self, key: str) -> VoiceInfo:
        """Forget a voice (by id or name) and remove its files."""
        with self._lock:
            info = self.info(key)
            if info.builtin:
                raise InvalidInputError(f"{info.name!r} is a built-in voice and cannot be deleted")
            self._remove(info.id)
            return info

    def recording(self, key: str) -> tuple[int, np.ndarray]:
        """(sample rate, int16 samples) of a voice's prompt recording, for previews."""
        info = self.info(key)
        if info.builtin:
            wav, sample_rate = self.frontend.load_prompt(self._builtins[info.id].wav)
            return sample_rate, to_pcm16(wav.reshape(-1))
        try:
            with safe_open(self._paths(info.id)[0], framework="pt") as f:
                if "prompt_audio" not in f.keys():  # noqa: SIM118 (safe_open has no __contains__)
                    raise InvalidInputError(f"voice {info.label!r} was stored without its recording; "
                                            "upload it again to hear it")
                return int(f.get_tensor("prompt_audio_rate")), f.get_tensor("prompt_audio").numpy()
        except (OSError, SafetensorError) as exc:
            raise InvalidInputError(f"voice {info.label!r} could not be read from disk") from exc

    def export(self, key: str) -> tuple[str, bytes]:
        """(file name, bytes): one portable file with the voice's features, transcript and recording."""
        info, voice = self.get(key)
        tensors = {**voice.features.tensors(), "prompt_text": voice.prompt_text}
        try:
            sample_rate, pcm = self.recording(info.id)
            tensors.update(prompt_audio=torch.from_numpy(pcm), prompt_audio_rate=torch.tensor(sample_rate))
        except InvalidInputError:  # e.g. a voice imported from spk2info.pt: features only (this model's)
            pass
        meta = {"format": EXPORT_FORMAT, "name": info.name or "", "transcript": info.transcript,
                "model": self.model_id}
        stem = "".join(c if c.isalnum() or c in "-_" else "_" for c in (info.name or info.id[:8]))
        return stem + EXPORT_SUFFIX, save({k: v.contiguous() for k, v in tensors.items()}, metadata=meta)

    def import_voice(self, data: bytes, name: str | None = None) -> VoiceInfo:
        """Add an exported voice under ``name`` (default: its own). Files of another model are featurised
        again from their recording; a name already taken is refused before anything is stored."""
        try:
            meta = _metadata(data)
            tensors = load(data)
            if meta.get("format") != EXPORT_FORMAT:
                raise ValueError(f"format {meta.get('format')!r}")
            has_audio = "prompt_audio" in tensors
            transcript = str(meta.get("transcript", ""))
        except (SafetensorError, ValueError, KeyError, TypeError) as exc:
            raise InvalidInputError(f"this is not a voice file exported by CosyVoice3 Studio ({exc})") from exc
        name = " ".join(str(name or meta.get("name") or "").split())
        if not name:
            raise InvalidInputError("the voice file has no name; give it one")
        with self._lock:
            if any(i.name == name for i in self.list()):
                raise InvalidInputError(f"a voice named {name!r} exists already; choose another name")
        prompt_text = zero_shot_prompt_text(transcript) if transcript else ""
        audio = None
        if has_audio:
            wav = (tensors["prompt_audio"].to(torch.float32) / 32768.0).reshape(1, -1)
            audio = (wav, int(tensors["prompt_audio_rate"]))
            self.frontend.load_prompt((wav.numpy()[0], audio[1]))  # the same checks an upload gets
        if meta.get("model") == self.model_id:  # same model: the stored features are exactly ours
            try:
                voice = Voice(PromptFeatures.from_tensors(tensors), tensors["prompt_text"].to(torch.int32))
            except KeyError as exc:
                raise InvalidInputError(f"the voice file lacks {exc}") from exc
            if audio is not None:
                voice_id = self._voice_id(audio[0], audio[1], " ".join(prompt_text.split()))
            else:
                voice_id = self._features_id(voice)
            with self._lock:
                known = voice_id in self._index
            if not known:
                self._store(voice_id, voice, prompt_text, audio)
        elif audio is not None:  # another model: featurise the recording anew
            voice_id, _ = self.get_or_create((audio[0].numpy()[0], audio[1]), prompt_text)
        else:
            raise InvalidInputError("this voice file was made by another model and holds no recording to "
                                    "featurise again; export it from a library of this model")
        return self.save(name, voice_id)

    # ------------------------------------------------------------------ the official API's saved voices

    def put(self, name: str, voice: Voice, *, replace_name: bool = False) -> VoiceInfo:
        """Keep a ready voice (e.g. an imported ``spk2info.pt`` entry) under ``name``.

        Its id hashes its tensors, so the same voice is stored once however often it is imported. With
        ``replace_name`` a name held by another voice moves to this one (that voice stays, unnamed), as the
        official ``add_zero_shot_spk`` overwrites a speaker id; without it that is an error.
        """
        voice_id = self._features_id(voice)
        with self._lock:
            known = voice_id in self._index
        if not known:
            ids = voice.prompt_text.reshape(-1).tolist()
            transcript = self.frontend.tokenizer.decode(ids, skip_special_tokens=False) if ids else ""
            self._store(voice_id, voice, transcript)
            with self._lock:
                if voice_id not in self._index:
                    raise OSError(f"voice library: could not write voice {name!r} to {self.dir}")
        return self.assign(name, voice_id, replace_name=replace_name)

    def assign(self, name: str, voice_id: str, *, replace_name: bool = False) -> VoiceInfo:
        """:meth:`save`, and with ``replace_name`` the name is taken from the voice holding it (kept, unnamed)."""
        key = " ".join(str(name).split())
        with self._lock:
            holder = next((i for i in self._index.values() if i.name == key), None)
            if replace_name and holder is not None and holder.id != voice_id:
                self._write_meta(replace(holder, name=None))
                holder.name = None
            return self.save(key, voice_id)

    def named(self) -> list[VoiceInfo]:
        """The saved (named) voices, by name (built-ins are not saved voices: spk2info.pt never holds them)."""
        return [i for i in self.list() if i.name and not i.builtin]

    def _features_id(self, voice: Voice) -> str:
        digest = hashlib.sha256(f"{self.model_id}\0features".encode())
        for name, tensor in sorted({**voice.features.tensors(), "prompt_text": voice.prompt_text}.items()):
            t = tensor.detach().cpu().contiguous()
            digest.update(f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
            digest.update(t.numpy().tobytes())
        return digest.hexdigest()[:32]

    # ------------------------------------------------------------------ storage

    def _voice_id(self, wav: torch.Tensor, sample_rate: int, prompt_text: str) -> str:
        text = prompt_text.encode()
        digest = hashlib.sha256(f"{self.model_id}\0{sample_rate}\0{len(text)}\0".encode() + text)
        digest.update(wav.contiguous().numpy().tobytes())
        return digest.hexdigest()[:32]

    def _paths(self, voice_id: str) -> tuple[Path, Path]:
        return self.dir / f"{voice_id}.safetensors", self.dir / f"{voice_id}.json"

    def _scan(self, cleanup: bool = True) -> dict[str, VoiceInfo]:
        """Index the entries on disk; an unreadable one is skipped with a log line, never fatal. ``cleanup``
        (at start-up only: later, another process may be writing) removes what interrupted writes left."""
        for leftover in [*self.dir.glob(".*.tmp"), *self.dir.glob("*.safetensors")] if cleanup else []:
            if leftover.suffix == ".tmp" or not leftover.with_suffix(".json").exists():
                leftover.unlink(missing_ok=True)  # from a run that stopped while writing
        index: dict[str, VoiceInfo] = {}
        for meta_path in sorted(self.dir.glob("*.json")):
            tensors_path = meta_path.with_suffix(".safetensors")
            try:
                meta = json.loads(meta_path.read_text(encoding="utf-8"))
                stat = meta_path.stat()
                index[meta_path.stem] = VoiceInfo(
                    id=meta_path.stem, name=str(meta["name"]) if meta["name"] else None,
                    transcript=str(meta["transcript"]), created=float(meta["created"]), last_used=stat.st_mtime,
                    nbytes=stat.st_size + tensors_path.stat().st_size)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                logger.warning("voice library: skipping %s (%s: %s)", meta_path, type(exc).__name__, exc)
        return index

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
            info = VoiceInfo(id=f"builtin-{wav.stem}", name=wav.stem, transcript=transcript, created=0.0,
                             last_used=0.0, nbytes=0, builtin=True)
            builtins[info.id] = _Builtin(info, wav, zero_shot_prompt_text(transcript))
        with self._lock:
            self._builtins.update(builtins)

    def _builtin_voice(self, voice_id: str) -> Voice:
        """A built-in's voice, featurised once per process (the shared per-id lock keeps that to one)."""
        entry = self._builtins[voice_id]
        with self._lock:
            computing = self._computing.setdefault(voice_id, threading.Lock())
        with computing:
            if entry.voice is None:
                wav, sample_rate = self.frontend.load_prompt(entry.wav)
                entry.voice = self.frontend.voice_from(self.frontend.features(wav, sample_rate), entry.prompt_text)
        return entry.voice

    def _load(self, voice_id: str) -> Voice | None:
        """The stored voice (marking it used), or None if absent or unreadable. An unreadable cache entry is
        dropped (the upload recreates it); a named voice's files are kept aside as ``*.unreadable``, never deleted."""
        with self._lock:
            info = self._index.get(voice_id)
            if info is None:
                return None
        tensors_path, meta_path = self._paths(voice_id)
        try:
            tensors = load_file(tensors_path)
            voice = Voice(PromptFeatures.from_tensors(tensors), tensors["prompt_text"].to(torch.int32))
        except (OSError, SafetensorError, ValueError, KeyError) as exc:
            with self._lock:
                if not meta_path.exists():  # deleted by another process sharing the folder
                    self._index.pop(voice_id, None)
                elif info.name is None:
                    logger.warning("voice library: dropping unreadable cached voice %s (%s: %s)", voice_id,
                                   type(exc).__name__, exc)
                    self._remove(voice_id)
                else:
                    logger.error("voice library: saved voice %r is unreadable (%s: %s); its files are kept as "
                                 "*.unreadable", info.name, type(exc).__name__, exc)
                    self._index.pop(voice_id, None)
                    for path in (meta_path, tensors_path):  # the JSON first: without it the entry no longer exists
                        with contextlib.suppress(FileNotFoundError):
                            path.rename(path.with_name(path.name + ".unreadable"))
            return None
        try:
            os.utime(meta_path)  # persists the use for eviction order; a read-only library still serves
        except OSError as exc:
            logger.warning("voice library: cannot mark %s as used (%s)", voice_id, exc)
        with self._lock:
            if voice_id in self._index:
                self._index[voice_id].last_used = time.time()
        return voice

    def _store(self, voice_id: str, voice: Voice, prompt_text: str,
               audio: tuple[torch.Tensor, int] | None = None) -> None:
        """Persist a new entry (with its recording, where there is one), then evict; a disk failure only costs
        the caching, not the request."""
        tensors_path, _ = self._paths(voice_id)
        tensors = {**voice.features.tensors(), "prompt_text": voice.prompt_text}
        if audio is not None:
            tensors.update(prompt_audio=torch.from_numpy(to_pcm16(audio[0].reshape(-1))),
                           prompt_audio_rate=torch.tensor(audio[1]))
        now = time.time()
        info = VoiceInfo(voice_id, None, user_text(prompt_text), now, now, 0)
        try:
            atomic_write(tensors_path, lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()}, tmp))
            info.nbytes = tensors_path.stat().st_size + self._write_meta(info)
        except OSError as exc:
            logger.warning("voice library: could not store voice %s in %s (%s)", voice_id, self.dir, exc)
            return
        with self._lock:
            self._index[voice_id] = info
            self._evict(keep=voice_id)

    def _write_meta(self, info: VoiceInfo) -> int:
        data = json.dumps({"name": info.name, "transcript": info.transcript, "created": info.created},
                          ensure_ascii=False).encode()
        atomic_write(self._paths(info.id)[1], lambda tmp: Path(tmp).write_bytes(data))
        return len(data)

    def _evict(self, keep: str | None) -> None:
        """Drop least recently used unnamed entries until both bounds hold (never ``keep``, the newest)."""
        cached = sorted((i for i in self._index.values() if i.name is None and i.id != keep),
                        key=lambda i: i.last_used)
        count = len(cached) + (keep is not None)
        size = sum(i.nbytes for i in cached) + (self._index[keep].nbytes if keep else 0)
        for info in cached:
            if count <= self.max_entries and size <= self.max_bytes:
                break
            self._remove(info.id)
            count, size = count - 1, size - info.nbytes

    def _remove(self, voice_id: str) -> None:
        self._index.pop(voice_id, None)
        for path in self._paths(voice_id)[::-1]:  # the JSON first: without it the entry no longer exists
            path.unlink(missing_ok=True)


def _metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file in memory (its JSON header)."""
    if len(data) < 8:
        raise ValueError("file too short")
    size = int.from_bytes(data[:8], "little")
    if size > len(data) - 8:
        raise ValueError("truncated header")
    header = json.loads(data[8:8 + size])
    return dict(header.get("__metadata__") or {})
