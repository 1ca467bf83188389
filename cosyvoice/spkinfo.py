"""The official ``spk2info.pt`` (saved speakers) read and written without ever losing an entry.

The official API keeps saved voices in ``{model_dir}/spk2info.pt``: ``torch.save`` of ``{spk_id: {name:
tensor}}``. Our saved voices live in the :class:`~cosyvoice.voices.VoiceLibrary`; :class:`SpeakerFile` imports
the file into it at start-up and exports to it on ``save_spkinfo()``. Rules:

* An entry we can use (a zero-shot entry: prompt mel, speech tokens, speaker embedding, prompt text) is
  converted to a :class:`Voice`. Any other entry (e.g. an SFT speaker ``{'embedding'}`` of CosyVoice 1,
  a malformed copy) is *unusable*: kept exactly as loaded, listed with the reason, and written back.
* A save merges, under an exclusive ``flock`` of ``.spk2info.pt.lock`` beside the file, the library's saved
  voices with what the file holds *now* (another process, e.g. a second ``AutoModel`` on the same model folder,
  may have written speakers since we read it): no entry the file or the library had is dropped. A name that
  holds different voices in the two keeps both (the file's under ``<name> (spk2info.pt)``). Deleting a
  speaker from the file is therefore done by editing the file, never by a save.
* A file that cannot be read at all is never overwritten: the next write first copies it to
  ``spk2info.pt.unreadable-<time>`` and says so.
* Every write replaces the file atomically (temporary file, fsync, rename): a crash leaves the old
  file or the new one.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cosyvoice.errors import CosyVoiceError, InvalidInputError, NotFoundError
from cosyvoice.frontend.audio import AudioSource
from cosyvoice.frontend.frontend import Voice
from cosyvoice.frontend.prompt import PromptFeatures
from cosyvoice.frontend.prompts import SYSTEM_PREFIX, split_prompt
from cosyvoice.system.fs import atomic_write
from cosyvoice.voices import VoiceInfo, VoiceLibrary

logger = logging.getLogger(__name__)

SPKINFO_FILE = "spk2info.pt"
ZERO_SHOT_KEYS = ("prompt_speech_feat", "flow_prompt_speech_token", "flow_embedding")


@dataclass
class SpkInfo:
    """What one read of ``spk2info.pt`` found."""

    path: Path
    voices: dict[str, Voice] = field(default_factory=dict)  # usable entries
    unusable: dict[str, Any] = field(default_factory=dict)  # spk_id -> the entry exactly as loaded
    reasons: dict[str, str] = field(default_factory=dict)  # spk_id -> why it is unusable
    error: str | None = None  # set when the file exists but could not be read at all


def voice_to_official(voice: Voice) -> dict[str, torch.Tensor]:
    """A voice as the official frontend stores a zero-shot speaker."""
    f = voice.features

    def length(t: torch.Tensor) -> torch.Tensor:
        return torch.tensor([t.shape[1]], dtype=torch.int32)

    return {
        "prompt_text": voice.prompt_text, "prompt_text_len": length(voice.prompt_text),
        "llm_prompt_speech_token": f.speech_token, "llm_prompt_speech_token_len": length(f.speech_token),
        "flow_prompt_speech_token": f.speech_token, "flow_prompt_speech_token_len": length(f.speech_token),
        "prompt_speech_feat": f.speech_feat, "prompt_speech_feat_len": length(f.speech_feat),
        "llm_embedding": f.embedding, "flow_embedding": f.embedding,
    }


def voice_from_official(entry: Any) -> Voice:
    """A zero-shot entry as a :class:`Voice`; ``ValueError`` (saying why) for anything else."""
    if not isinstance(entry, dict):
        raise ValueError(f"not a dict of tensors but {type(entry).__name__}")
    missing = [k for k in ZERO_SHOT_KEYS if k not in entry]
    if missing:
        raise ValueError(f"not a CosyVoice2/3 zero-shot entry: it has {sorted(map(str, entry))}, lacks {missing}")
    tensors = {k: entry[k] for k in (*ZERO_SHOT_KEYS, "prompt_text") if k in entry}
    bad = [k for k, v in tensors.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise ValueError(f"{bad} are not tensors")
    feat, token, embedding = (tensors[k] for k in ZERO_SHOT_KEYS)
    if not feat.is_floating_point() or not embedding.is_floating_point():
        raise ValueError("prompt_speech_feat and flow_embedding must be floating point")
    prompt_text = tensors.get("prompt_text", torch.zeros(1, 0, dtype=torch.int32))
    if prompt_text.is_floating_point() or prompt_text.dim() != 2 or prompt_text.shape[0] != 1:
        raise ValueError(f"prompt_text must be integer ids [1, T], got {tuple(prompt_text.shape)} {prompt_text.dtype}")
    try:
        features = PromptFeatures(speech_feat=feat.float().cpu(), speech_token=token.to(torch.int32).cpu(),
                                  embedding=embedding.float().cpu())
    except ValueError as exc:  # InvalidInputError is a ValueError: the shapes are wrong
        raise ValueError(str(exc)) from None
    if feat.shape[1] < 2 * token.shape[1] or token.shape[1] == 0:
        raise ValueError(f"prompt_speech_feat has {feat.shape[1]} frames for {token.shape[1]} speech tokens")
    return Voice(features, prompt_text.to(torch.int32).cpu())


def read_spkinfo(path: str | Path, cleanup: bool = True) -> SpkInfo:
    """Everything in ``path`` (absent: empty), sorted into usable voices and entries kept as they are.

    With ``cleanup`` (only where no other process may be writing: under :func:`spkinfo_lock`, or in tools),
    stale temporary files of an interrupted write are removed. Never raises for the file's content.
    """
    path = Path(path)
    info = SpkInfo(path)
    for leftover in path.parent.glob(f".{path.name}.*.tmp") if cleanup else []:
        leftover.unlink(missing_ok=True)  # an interrupted write; the file itself is intact
    if not path.exists():
        return info
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(raw, dict):
            raise ValueError(f"expected a dict of speakers, found {type(raw).__name__}")
    except Exception as exc:  # whatever torch.load raises for a damaged file: the file is kept, see module doc
        info.error = (f"{path} could not be read ({type(exc).__name__}: {str(exc)[:200]}); its saved voices are "
                      "not available. It is kept as it is; the next save_spkinfo() copies it aside first")
        logger.error("%s", info.error)
        return info
    for name, entry in raw.items():
        try:
            if not isinstance(name, str):
                raise ValueError(f"its id is a {type(name).__name__}, not a string")
            info.voices[name] = voice_from_official(entry)
        except ValueError as exc:
            info.unusable[name] = entry
            info.reasons[name] = str(exc)
            logger.warning("%s: keeping speaker %r unchanged, it cannot be used here: %s", path, name, exc)
    return info


def write_spkinfo(path: str | Path, entries: dict[Any, Any], unreadable: bool = False) -> Path | None:
    """Atomically replace ``path`` with ``entries`` (already in the official format).

    With ``unreadable`` (the file could not be read when loaded) the current file is first copied to a
    new ``<name>.unreadable-<time>`` file, which is returned.
    """
    path = Path(path)
    backup = None
    if unreadable and path.exists():
        backup = path.with_name(f"{path.name}.unreadable-{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns() % 10**9}")
        atomic_write(backup, lambda tmp: shutil.copyfile(path, tmp))
        logger.warning("%s could not be read; it was copied to %s before writing the saved voices", path, backup)
    atomic_write(path, lambda tmp: torch.save(entries, tmp))
    return backup



@contextlib.contextmanager
def spkinfo_lock(path: str | Path) -> Iterator[None]:
    """Exclusive across processes: ``flock`` of ``.<name>.lock`` beside ``path`` (released by the kernel when a
    process dies, even by kill -9). OSError if the folder cannot hold the lock file (e.g. read-only)."""
    path = Path(path)
    fd = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class SpeakerFile:
    """``spk2info.pt`` over a voice library: the official API's saved speakers (see the module's rules)."""

    def __init__(self, path: str | Path, library: VoiceLibrary) -> None:
        self.path, self.library = Path(path), library
        self._lock = threading.Lock()
        self._unusable: dict[Any, Any] = {}  # entries read at start-up that the library cannot hold
        self._reasons: dict[str, str] = {}

    def load(self) -> None:
        """Bring the file's usable voices into the library; keep everything else for write-back."""
        if not self.path.exists():  # nothing to read: leave the model folder untouched (no lock file either)
            return
        try:
            with spkinfo_lock(self.path):
                found = read_spkinfo(self.path)
        except OSError:  # a read-only model folder: read it as it is (writes are atomic renames)
            found = read_spkinfo(self.path, cleanup=False)
        with self._lock:
            self._unusable = dict(found.unusable)
            self._reasons = {str(k): v for k, v in found.reasons.items()}
            if found.error:
                self._reasons[self.path.name] = found.error
        for name, voice in found.voices.items():
            try:
                self._import(name, voice)
            except (CosyVoiceError, OSError) as exc:
                self._keep(name, voice, f"could not be added to the voice library: {exc}")

    def _import(self, name: str, voice: Voice) -> None:
        held = self.named_voice(name)
        if held is not None:
            if not same_voice(held, voice):  # a different library voice has this id: the file's stays usable
                other = free_key(f"{name} (spk2info.pt)", {i.name for i in self.library.named()})
                self._put(other, voice)
                logger.warning("spk2info.pt speaker %r differs from the saved voice of that name; imported as %r",
                               name, other)
            return
        self._put(name, voice)

    def _put(self, name: str, voice: Voice) -> None:
        try:
            holder = self.library.info(self.library.features_id(voice))
        except NotFoundError:
            holder = None
        if holder is not None and holder.name is not None and holder.name != " ".join(name.split()):
            # one voice, one name in the library: never rename a saved voice; the file keeps this entry
            self._keep(name, voice, f"the same voice is saved here as {holder.name!r}; use that name")
            return
        self.library.put(name, voice)

    def _keep(self, name: str, voice: Voice, reason: str) -> None:
        with self._lock:
            self._unusable[name] = voice_to_official(voice)
            self._reasons[name] = reason
        logger.warning("spk2info.pt speaker %r kept in the file only: %s", name, reason)

    def add(self, prompt_text: str, prompt_wav: AudioSource, spk_id: str) -> VoiceInfo:
        """The official ``add_zero_shot_spk``: featurise a prompt once (cached) and name it ``spk_id``; a voice
        holding that id keeps its files, unnamed (the reference overwrites the id)."""
        if not isinstance(spk_id, str) or not spk_id.strip():
            raise InvalidInputError("zero_shot_spk_id must be a non-empty name for the saved voice")
        if not isinstance(prompt_text, str):
            raise InvalidInputError(f"prompt_text must be a string, got {type(prompt_text).__name__}")
        voice_id, _ = self.library.get_or_create(prompt_wav, split_prompt(prompt_text)[1] if prompt_text else "")
        return self.library.assign(spk_id, voice_id, replace_name=True)

    def unusable(self) -> dict[str, str]:
        """Entries of the file this model cannot use, with the reason; they are kept and written back."""
        with self._lock:
            return dict(self._reasons)

    def named_voice(self, name: str) -> Voice | None:
        """The saved (named, not built-in) voice called ``name``."""
        key = " ".join(name.split())
        try:
            info = self.library.info(key)
        except NotFoundError:
            return None
        if info.name != key or info.builtin:
            return None
        return self._official(self.library.get(info.id)[1])

    def _official(self, voice: Voice) -> Voice:
        """A library voice (plain transcript ids) as the official file holds it: after the system prompt."""
        ids, frontend = voice.prompt_text, self.library.frontend
        if not ids.numel() or bool((ids == frontend.tokenizer.end_of_prompt_id).any()):
            return voice
        return Voice(voice.features, torch.cat([frontend.encode(SYSTEM_PREFIX), ids], dim=1))

    def voice(self, spk_id: object) -> Voice:
        """A saved voice by speaker id, or an :class:`InvalidInputError` saying why there is none."""
        if not isinstance(spk_id, str):
            raise InvalidInputError(f"a speaker id must be a string, got {type(spk_id).__name__}")
        voice = self.named_voice(spk_id)
        if voice is not None:
            return voice
        reason = self.unusable().get(spk_id)
        if reason is not None:
            raise InvalidInputError(f"speaker {spk_id!r} of spk2info.pt cannot be used with this model ({reason}); "
                                    "it is kept in the file unchanged")
        known = [i.name for i in self.library.named()]
        raise InvalidInputError(f"unknown speaker id {spk_id!r}; saved voices: {known or 'none'} "
                                "(add one with add_zero_shot_spk)")

    def save(self) -> Path | None:
        """Merge the library's saved voices with the file as it is now and write it atomically (under the
        cross-process lock); returns the backup of an unreadable file it replaced, if any."""
        with self._lock, spkinfo_lock(self.path):
            current = read_spkinfo(self.path)  # another process may have written speakers since we read it
            data: dict[Any, Any] = {}
            voices: dict[Any, Voice] = {}
            for info in self.library.named():
                try:
                    voices[info.name] = self._official(self.library.get(info.id)[1])
                except CosyVoiceError as exc:  # unreadable or deleted meanwhile: the file keeps what it has
                    logger.warning("saved voice %r not written to %s: %s", info.name, self.path.name, exc)
                    continue
                data[info.name] = voice_to_official(voices[info.name])
            for name, voice in current.voices.items():
                if name in voices and same_voice(voices[name], voice):
                    continue
                key = name if name not in data else free_key(f"{name} (spk2info.pt)", data)
                voices[key], data[key] = voice, voice_to_official(voice)
            for name, entry in [*current.unusable.items(), *self._unusable.items()]:
                if any(_same_entry(entry, data[k]) for k in data if k == name or str(k).startswith(f"{name} (")):
                    continue  # written already (e.g. read at start-up and still in the file)
                data[name if name not in data else free_key(f"{name} (unusable)", data)] = entry
            backup = write_spkinfo(self.path, data, unreadable=current.error is not None)
        if backup is not None:
            logger.warning("saved voices written to %s; the unreadable file it replaced is kept as %s", self.path,
                           backup)
        return backup


def same_voice(a: Voice, b: Voice) -> bool:
    ta, tb = {**a.features.tensors(), "t": a.prompt_text}, {**b.features.tensors(), "t": b.prompt_text}
    return all(ta[k].shape == tb[k].shape and torch.equal(ta[k].to(tb[k].dtype), tb[k]) for k in ta)


def _same_entry(a: Any, b: Any) -> bool:
    """Equal raw entries (nested dicts of tensors, as torch.load gives them)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_entry(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return type(a) is type(b) and a == b


def free_key(name: str, taken: Iterable[Any]) -> str:
    """``name``, or ``name 2``, ``name 3``... whichever is not in ``taken``."""
    taken = set(taken)
    key, n = name, 1
    while key in taken:
        n += 1
        key = f"{name} {n}"
    return key
