"""Recordings into voices, for the voice library: an upload decoded (through the frontend's bounded decoder) and
named by its content (:meth:`PromptVoices.decode`), featurised by the frontend once even when several requests bring
the same recording at once (:meth:`PromptVoices.featurising`), transcripts kept plain, and the built-in voices of a
read-only folder of ``<name>.wav`` + ``<name>.txt``, featurised on first use.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from cosyvoice.frontend.audio import AudioSource
from cosyvoice.frontend.frontend import CosyVoiceFrontend, Voice
from cosyvoice.frontend.prompts import transcript_ids, zero_shot_prompt_text
from cosyvoice.voices.entries import BUILTIN_PREFIX, Builtin, Upload, VoiceInfo

logger = logging.getLogger(__name__)


class PromptVoices:
    """The frontend's featurising of ``model_id``'s voices, once per recording; and the built-in voices."""

    def __init__(self, frontend: CosyVoiceFrontend, model_id: str) -> None:
        self.frontend, self.model_id = frontend, model_id
        self._lock = threading.Lock()
        self._computing: dict[str, threading.Lock] = {}  # voice id -> lock held while its features are made
        self._builtins: dict[str, Builtin] = {}

    def decode(self, prompt_wav: AudioSource, prompt_text: str) -> Upload:
        """A recording decoded and checked, with its plain, whitespace-normalised transcript and content id."""
        prompt_text = " ".join(prompt_text.split())  # the cached voice is a function of its id alone
        wav, sample_rate = self.frontend.load_prompt(prompt_wav)
        return Upload(self.voice_id(wav, sample_rate, prompt_text), wav, sample_rate, prompt_text)

    @contextlib.contextmanager
    def featurising(self, voice_id: str) -> Iterator[None]:
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

    def featurise(self, wav: torch.Tensor, sample_rate: int, prompt_text: str) -> Voice:
        """The voice of a decoded recording and its plain transcript (the frontend's features)."""
        return self.frontend.voice_from(self.frontend.features(wav, sample_rate), prompt_text)

    def voice_id(self, wav: torch.Tensor, sample_rate: int, prompt_text: str) -> str:
        # hashed in the prefixed form the library stored before it kept plain transcripts: same ids as then
        text = (zero_shot_prompt_text(prompt_text) if prompt_text else "").encode()
        digest = hashlib.sha256(f"{self.model_id}\0{sample_rate}\0{len(text)}\0".encode() + text)
        digest.update(wav.contiguous().numpy().tobytes())
        return digest.hexdigest()[:32]

    def plain(self, voice: Voice) -> Voice:
        """``voice`` with its plain transcript ids: entries saved before the library kept plain transcripts, older
        exports and ``spk2info.pt`` hold them after the system prompt, which the pipeline adds itself."""
        ids = voice.prompt_text.reshape(-1).tolist()
        plain = transcript_ids(ids, self.frontend.tokenizer.end_of_prompt_id)
        if len(plain) == len(ids):
            return voice
        return Voice(voice.features, torch.tensor([plain], dtype=torch.int32).reshape(1, -1))

    # ------------------------------------------------------------------ built-in voices

    def add_builtins(self, folder: str | Path) -> None:
        """Offer the ``<name>.wav`` + ``<name>.txt`` pairs of ``folder`` as built-in voices (featurised on first
        use); a recording without a transcript is skipped with a log line, a missing folder adds none."""
        folder = Path(folder)
        builtins: dict[str, Builtin] = {}
        for wav in sorted(folder.glob("*.wav")) if folder.is_dir() else []:
            transcript_path = wav.with_suffix(".txt")
            if not transcript_path.is_file():
                logger.warning("voice library: built-in %s has no transcript (%s); skipped", wav, transcript_path.name)
                continue
            transcript = " ".join(transcript_path.read_text(encoding="utf-8").split())
            info = VoiceInfo(id=f"{BUILTIN_PREFIX}{wav.stem}", name=wav.stem, transcript=transcript, created=0.0,
                             last_used=0.0, nbytes=0, builtin=True)
            builtins[info.id] = Builtin(info, wav, transcript)
        with self._lock:
            self._builtins.update(builtins)

    def builtins(self) -> list[VoiceInfo]:
        """The built-in voices' entries, in their folder's order."""
        with self._lock:
            return [b.info for b in self._builtins.values()]

    def builtin_recording(self, voice_id: str) -> tuple[torch.Tensor, int]:
        """A built-in's recording as decoded (samples, sample rate)."""
        return self.frontend.load_prompt(self._builtins[voice_id].wav)

    def builtin_voice(self, voice_id: str) -> Voice:
        """A built-in's voice, featurised once per process (the shared per-id lock keeps that to one)."""
        entry = self._builtins[voice_id]
        with self.featurising(voice_id):
            if entry.voice is None:
                wav, sample_rate = self.frontend.load_prompt(entry.wav)
                entry.voice = self.featurise(wav, sample_rate, entry.prompt_text)
        return entry.voice
