"""Voices as recordings and files, and the official API's saved voices, for the voice library: a voice's recording
(previews), one portable file per voice (the features, the transcript's token ids, the recording and, as metadata,
the name, transcript and model identity; importing it into a library of another model featurises the recording
anew), and ready voices (``spk2info.pt`` entries) kept under a name. A base of
:class:`~cosyvoice.voices.VoiceLibrary`, apart to keep that class small.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from cosyvoice.encoding import to_pcm16
from cosyvoice.errors import InvalidInputError, StorageError
from cosyvoice.frontend.frontend import CosyVoiceFrontend, Voice
from cosyvoice.frontend.prompt import PromptFeatures
from cosyvoice.voices.entries import Upload, VoiceInfo, check_name, storage_error
from cosyvoice.voices.folder import VoiceFolder
from cosyvoice.voices.prompts import PromptVoices

EXPORT_FORMAT = "cosyvoice3-voice/1"  # the metadata tag of an exported voice file
EXPORT_SUFFIX = ".voice.safetensors"


class PortableVoices:
    """Recordings, export, import and ready voices over the library's ``folder``, ``prompts`` and its public
    calls."""

    model_id: str
    frontend: CosyVoiceFrontend
    folder: VoiceFolder
    prompts: PromptVoices

    def recording(self, key: str, *, owner: str | None = None) -> tuple[int, np.ndarray]:
        """(sample rate, int16 samples) of a voice's prompt recording, for previews."""
        info = self.info(key, owner=owner)
        if info.builtin:
            wav, sample_rate = self.prompts.builtin_recording(info.id)
            return sample_rate, to_pcm16(wav.reshape(-1))
        tensors = self.folder.tensors(info, key)
        if "prompt_audio" not in tensors:
            raise InvalidInputError(f"voice {info.label!r} was stored without its recording; upload it again to "
                                    "hear it")
        return int(tensors["prompt_audio_rate"]), tensors["prompt_audio"].numpy()

    # ------------------------------------------------------------------ lookups and permissions

    def export(self, key: str, *, owner: str | None = None) -> tuple[str, bytes]:
        """(file name, bytes): one portable file with the voice's features, transcript and recording."""
        info = self.info(key, owner=owner)
        if info.name is not None and not info.builtin:
            self._check_editor(info, owner, "export")
        if info.builtin:
            voice = self.prompts.builtin_voice(info.id)
            tensors = {**voice.features.tensors(), "prompt_text": voice.prompt_text}
            sample_rate, pcm = self.recording(info.id)
            tensors.update(prompt_audio=torch.from_numpy(pcm), prompt_audio_rate=torch.tensor(sample_rate))
        else:  # as stored (without a recording for a voice imported from spk2info.pt: this model's features only)
            tensors = self.folder.tensors(info, key)
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
        prompt_text = " ".join(transcript.split())
        audio = None
        if has_audio:
            wav = (tensors["prompt_audio"].to(torch.float32) / 32768.0).reshape(1, -1)
            audio = (wav.numpy()[0], int(tensors["prompt_audio_rate"]))
        voice = None
        if meta.get("model") == self.model_id:  # same model: the stored features are exactly ours
            try:
                voice = self.prompts.plain(Voice(PromptFeatures.from_tensors(tensors),
                                                 tensors["prompt_text"].to(torch.int32)))
            except KeyError as exc:
                raise InvalidInputError(f"the voice file lacks {exc}") from exc
        elif audio is None:
            raise InvalidInputError("this voice file was made by another model and holds no recording to "
                                    "featurise again; export it from a library of this model")
        if audio is not None:
            upload = self.prompts.decode(audio, prompt_text)  # the same checks an upload gets
        else:
            upload = Upload(self.features_id(voice), torch.zeros(1, 0), 0, prompt_text)
        self._check_unsaved(upload.voice_id)  # before the name: no other name is asked for in vain
        self._check_free(name)
        if voice is None:  # another model: featurise the recording (decoded above) anew
            self.folder.writable()  # before featurising, as a new voice's save
            return self._save_upload(upload, name, owner)
        upload.voice = voice
        return self._name_upload(upload, name, owner)

    def put(self, name: str, voice: Voice, *, replace_name: bool = False) -> VoiceInfo:
        """Keep a ready voice (e.g. an imported ``spk2info.pt`` entry) under ``name``.

        Its id hashes its tensors, so the same voice is stored once however often it is imported. With
        ``replace_name`` a name held by another voice moves to this one (that voice stays, unnamed), as the
        official ``add_zero_shot_spk`` overwrites a speaker id; without it that is an error.
        """
        voice_id, voice = self.features_id(voice), self.prompts.plain(voice)  # the id of the voice as the file holds it
        ids = voice.prompt_text.reshape(-1).tolist()
        transcript = self.frontend.tokenizer.decode(ids, skip_special_tokens=False) if ids else ""
        upload = Upload(voice_id, torch.zeros(1, 0), 0, transcript, voice)
        with self.folder.exclusive():
            if upload.voice_id not in self.folder.index:
                try:
                    self.folder.store(upload, None, None)
                except (OSError, StorageError) as exc:
                    raise storage_error(exc, f"store voice {name!r}") from exc
            return self.assign(name, upload.voice_id, replace_name=replace_name)

    def assign(self, name: str, voice_id: str, *, replace_name: bool = False) -> VoiceInfo:
        """:meth:`save`, and with ``replace_name`` the name is taken from the voice holding it (kept, unnamed)."""
        key = check_name(name)
        with self.folder.exclusive():
            holder = next((i for i in self.folder.index.values() if i.name == key), None)
            if replace_name and holder is not None and holder.id != voice_id:
                try:
                    self.folder.write_meta(replace(holder, name=None, creator=None))
                except (OSError, StorageError) as exc:
                    raise storage_error(exc, f"move the name {key!r}") from exc
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


def _metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file in memory (its JSON header)."""
    if len(data) < 8:
        raise ValueError("file too short")
    size = int.from_bytes(data[:8], "little")
    if size > len(data) - 8:
        raise ValueError("truncated header")
    header = json.loads(data[8:8 + size])
    return dict(header.get("__metadata__") or {})
