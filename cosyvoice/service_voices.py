"""The service's voices: saved voices and uploads as adapters ask for them, each error naming its request field, and
the voice a request speaks with. The base of :class:`cosyvoice.service.TTSService`, apart so that the service class
holds synthesis alone; THE voice library (:class:`~cosyvoice.voices.VoiceLibrary`) keeps them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

from cosyvoice import pipeline
from cosyvoice.admission import Admission
from cosyvoice.checks import check_text, field_named
from cosyvoice.errors import InvalidInputError
from cosyvoice.frontend.audio import AudioSource
from cosyvoice.frontend.frontend import Voice
from cosyvoice.pipeline import Model
from cosyvoice.request import SynthesisRequest
from cosyvoice.settings import Limits
from cosyvoice.voices import VoiceInfo, VoiceLibrary, check_name


class ServiceVoices:
    """Voice requests over the service's ``voices``, bounded by its ``limits``; decoding an upload takes a slot of
    its ``_admission`` and its ``model``'s frontend."""

    voices: VoiceLibrary
    limits: Limits
    model: Model
    _admission: Admission

    @property
    def voices_read_only(self) -> str | None:
        """Why no voice can be saved (the voice folder's setting named), or None."""
        return self.voices.read_only

    @contextlib.contextmanager
    def _slot(self) -> Iterator[None]:
        """Decoding and featurising an upload is model work: it holds an admission slot as a synthesis does, so
        uploads cannot exhaust memory beside the requests the service admitted."""
        self._admission.acquire()
        try:
            yield
        finally:
            self._admission.release()
    # ``owner`` (HELPERS "owner"): who asks; None is a local, unrestricted caller. Unsaved uploads are their
    # owner's alone; saved voices are everyone's to use, and the library's policy says who may edit them
    # (PermissionDeniedError otherwise). Entries an owner may not see are reported as not found.

    def create_voice(self, name: str, audio: AudioSource, transcript: str = "", *,
                     owner: str | None = None) -> VoiceInfo:
        """Save a recording (and its transcript: optional, zero-shot cloning needs it) under ``name``.

        A taken name, or a recording + transcript already saved under another name, is refused
        (:class:`AlreadyExistsError`): creating never renames or replaces what a user saved.
        """
        with field_named("name"):
            if not isinstance(name, str) or not name.strip():
                raise InvalidInputError("a voice needs a name")
            name = check_name(name)
        plain = ""
        if isinstance(transcript, str) and transcript.strip():
            with field_named("transcript"):
                check_text(transcript, self.limits, "transcript")
            plain = pipeline.plain_transcript(transcript)
        with self._slot(), field_named("audio"):  # the library names "name" in its errors about the name
            return self.voices.create(name, audio, plain, owner=owner)

    def list_voices(self, *, owner: str | None = None, include_uploads: bool = False) -> list[VoiceInfo]:
        """Built-in voices, then saved voices by name; with ``include_uploads`` also ``owner``'s own unsaved
        uploads, most recent first."""
        return [i for i in self.voices.list(owner=owner) if include_uploads or i.name]

    def get_voice(self, key: str, *, owner: str | None = None) -> VoiceInfo:
        """A voice by id or name; :class:`NotFoundError` (field ``voice``) if there is none ``owner`` may see."""
        with field_named("voice"):
            return self.voices.info(key, owner=owner)

    def rename_voice(self, key: str, new_name: str, *, owner: str | None = None) -> VoiceInfo:
        """Give a saved voice another name (unique; never one that looks like an id)."""
        with field_named("voice"):
            return self.voices.rename(key, new_name, owner=owner)

    def delete_voice(self, key: str, *, owner: str | None = None) -> VoiceInfo:
        """:class:`NotFoundError` if there is none; a built-in voice cannot be deleted (:class:`InvalidInputError`)."""
        with field_named("voice"):
            return self.voices.delete(key, owner=owner)

    def deletable_voice(self, key: str, *, owner: str | None = None) -> VoiceInfo:
        """The voice :meth:`delete_voice` would delete for ``owner``, or the error it would give (a page asks
        "delete it?" only of what it may delete)."""
        with field_named("voice"):
            return self.voices.deletable(key, owner=owner)

    def export_voice(self, key: str, *, owner: str | None = None) -> tuple[str, bytes]:
        """(file name, bytes) of one portable voice file: features, transcript and recording."""
        with field_named("voice"):
            return self.voices.export(key, owner=owner)

    def import_voice(self, data: bytes, name: str | None = None, *, owner: str | None = None) -> VoiceInfo:
        """Save an exported voice file under ``name`` (default: the name inside it)."""
        with self._slot(), field_named("file"):
            return self.voices.import_voice(data, name, owner=owner)

    def voice_recording(self, key: str, *, owner: str | None = None) -> tuple[int, np.ndarray]:
        """(sample rate, int16 samples) of a voice's prompt recording, for previews."""
        with field_named("voice"):
            return self.voices.recording(key, owner=owner)

    def check_prompt(self, audio: AudioSource) -> float:
        """Decode and check a prompt recording as synthesis will (the web UI checks uploads as they arrive):
        its length in seconds, or :class:`InvalidInputError` (field ``prompt_audio``) saying why it is unusable."""
        with self._slot(), field_named("prompt_audio"):
            wav, sample_rate = self.model.frontend.load_prompt(audio)
        return wav.shape[-1] / sample_rate


    def _voice(self, mode: str, request: SynthesisRequest, transcript: str,
               owner: str | None = None) -> tuple[str, Voice]:
        """(voice id, voice): a saved voice (looked up now), else the uploaded recording with its plain
        ``transcript`` (the pipeline's, without the system prompt; through the library, cached for ``owner``; a
        full disk only skips the caching)."""
        saved, audio = request.voice, request.prompt_audio
        if saved is not None and audio is not None:
            raise InvalidInputError("give a saved voice or a prompt recording, not both", "voice")
        if saved is not None:
            if not isinstance(saved, str) or not saved.strip():
                raise InvalidInputError("voice must be a saved voice's id or name", "voice")
            with field_named("voice"):
                info, voice = self.voices.get(saved, owner=owner)
            if mode == "zero_shot" and not voice.prompt_text.numel():
                raise InvalidInputError(f"voice {saved!r} has no transcript, which zero-shot cloning needs; use "
                                        "cross_lingual or instruct mode with it, or save it again with its "
                                        "transcript", "voice")
            return info.id, voice
        if mode == "sft":
            raise InvalidInputError("sft mode speaks with a saved voice: give its id or name", "voice")
        if audio is None:
            raise InvalidInputError(f"{mode} needs a voice: a saved voice's id or name, or a prompt recording",
                                    "voice")
        if mode == "zero_shot":
            with field_named("transcript"):
                if not isinstance(request.transcript, str) or not request.transcript.strip():
                    raise InvalidInputError("zero-shot cloning needs the transcript of the prompt recording; or "
                                            "use cross_lingual mode, which needs none")
                check_text(request.transcript, self.limits, "transcript")
                if not transcript:
                    raise InvalidInputError("the transcript has only the system prompt; give the words of the "
                                            "prompt recording after it")
        with field_named("prompt_audio"):
            return self.voices.get_or_create(audio, transcript if mode == "zero_shot" else "", owner=owner)
