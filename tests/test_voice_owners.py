"""Whose voice is it (issue 12, item 17, library and service side): an unsaved upload is its uploader's alone;
saved voices are everyone's to use, and ``COSYVOICE_VOICE_EDITORS`` says who may rename, export or delete them."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from cosyvoice.errors import ConfigError, InvalidInputError, NotFoundError, PermissionDeniedError
from cosyvoice.service import SynthesisRequest, TTSService
from cosyvoice.settings import ServerSettings, VoicePolicy, key_owner
from cosyvoice.voices import VoiceLibrary

TRANSCRIPT = "Hello, this is a short prompt for testing."
ALICE, BOB, ADMIN = key_owner("alice-key"), "browser:bob-session", key_owner("admin-key")


def _tone(hz: float, seconds: float = 1.1, sr: int = 16000) -> tuple[np.ndarray, int]:
    t = np.arange(int(seconds * sr)) / sr
    return (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32), sr


def _service(tts, root: Path, editors: str) -> TTSService:
    policy = VoicePolicy(editors, frozenset({ADMIN}))
    return TTSService(tts.model, VoiceLibrary(root, tts.frontend, model_dir=tts.model_dir, policy=policy))


def test_an_unsaved_upload_is_its_uploaders_alone(tts, tmp_path: Path) -> None:
    service = _service(tts, tmp_path, "anyone")
    library = service.voices
    upload, _ = library.get_or_create(_tone(110), owner=ALICE)
    assert [i.id for i in service.list_voices(owner=ALICE, include_uploads=True)] == [upload]
    assert service.list_voices(owner=ALICE) == []  # named voices only unless asked
    assert service.list_voices(owner=BOB, include_uploads=True) == []
    for action in (lambda: service.get_voice(upload, owner=BOB), lambda: service.voice_recording(upload, owner=BOB),
                   lambda: service.export_voice(upload, owner=BOB), lambda: service.delete_voice(upload, owner=BOB),
                   lambda: library.save("Bob's now", upload, owner=BOB),
                   lambda: service._voice("cross_lingual", SynthesisRequest("Hi.", "cross_lingual", voice=upload), "",
                                          owner=BOB)):
        with pytest.raises(NotFoundError, match=f"unknown voice '{upload}'"):  # as if it did not exist
            action()
    assert service.voice_recording(upload, owner=ALICE)[0] == 16000
    assert service.export_voice(upload, owner=ALICE)[0].endswith(".voice.safetensors")
    assert service.get_voice(upload).id == upload  # a local caller (the Python API) sees everything

    assert library.get_or_create(_tone(110), owner=BOB)[0] == upload  # Bob brings the same recording: his too
    assert [i.id for i in service.list_voices(owner=BOB, include_uploads=True)] == [upload]
    assert service.delete_voice(upload, owner=BOB).id == upload  # gone for Bob; Alice's stays
    assert service.list_voices(owner=BOB, include_uploads=True) == []
    assert [i.id for i in service.list_voices(owner=ALICE, include_uploads=True)] == [upload]
    service.delete_voice(upload, owner=ALICE)
    assert service.list_voices(include_uploads=True) == [] and not list(library.dir.glob(f"{upload}.*"))


@pytest.mark.parametrize("editors", ["anyone", "creator", "admin"])
def test_who_may_rename_export_and_delete_a_saved_voice(tts, tmp_path: Path, short_prompt_wav: Path,
                                                        editors: str) -> None:
    service = _service(tts, tmp_path, editors)
    saved = service.create_voice("Ada", short_prompt_wav.read_bytes(), TRANSCRIPT, owner=ALICE)
    assert saved.creator == ALICE and saved.owners == ()
    for owner in (ALICE, BOB, ADMIN, None):  # everyone may see and use a saved voice
        assert [i.name for i in service.list_voices(owner=owner)] == ["Ada"]
        assert service.get_voice("Ada", owner=owner).id == saved.id
        assert service.voice_recording("Ada", owner=owner)[1].size > 0
    may = {"anyone": {ALICE, BOB, ADMIN, None}, "creator": {ALICE, ADMIN, None}, "admin": {ADMIN, None}}[editors]
    for owner in (ALICE, BOB, ADMIN, None):
        actions = {"rename": lambda o=owner: service.rename_voice("Ada", "Ada 2", owner=o),
                   "export": lambda o=owner: service.export_voice("Ada", owner=o)}
        for action, call in actions.items():
            if owner in may:
                call()
                if action == "rename":
                    service.rename_voice("Ada 2", "Ada", owner=owner)
            else:
                with pytest.raises(PermissionDeniedError, match=f"you may not {action} the voice 'Ada'"):
                    call()
    refused = [o for o in (BOB, ALICE) if o not in may]
    for owner in refused:
        with pytest.raises(PermissionDeniedError, match="may not delete"):
            service.delete_voice("Ada", owner=owner)
    assert service.get_voice("Ada").creator == ALICE  # a rename keeps who saved it
    deleter = BOB if BOB in may else ALICE if ALICE in may else ADMIN
    assert service.delete_voice("Ada", owner=deleter).id == saved.id


def test_built_in_voices_are_read_only_for_everyone(tts, tmp_path: Path, prompt_wav: Path) -> None:
    builtin = tmp_path / "builtin"
    builtin.mkdir()
    shutil.copyfile(prompt_wav, builtin / "Narrator.wav")
    (builtin / "Narrator.txt").write_text(TRANSCRIPT)
    service = _service(tts, tmp_path / "voices", "anyone")
    service.voices.add_builtins(builtin)
    assert [i.name for i in service.list_voices(owner=BOB)] == ["Narrator"]
    for owner in (BOB, ADMIN, None):
        with pytest.raises(InvalidInputError, match="built-in"):
            service.delete_voice("Narrator", owner=owner)
        with pytest.raises(InvalidInputError, match="built-in"):
            service.rename_voice("Narrator", "Mine", owner=owner)
    name, data = service.export_voice("Narrator", owner=BOB)  # copying it is fine: the copy is the importer's
    assert name == "Narrator.voice.safetensors"
    copy = service.import_voice(data, "My narrator", owner=BOB)
    assert copy.creator == BOB and not copy.builtin


def test_the_policy_setting() -> None:
    # every visitor is told apart, with keys and without (cosyvoice.owners): saved voices are their creators'
    assert VoicePolicy.from_env({}).editors == "creator"
    assert VoicePolicy.from_env({"COSYVOICE_VOICE_EDITORS": "anyone"}).editors == "anyone"
    policy = VoicePolicy.from_env({"COSYVOICE_VOICE_EDITORS": "admin", "COSYVOICE_ADMIN_KEYS": "admin-key"})
    assert policy.editors == "admin" and policy.admin_owners == {ADMIN}
    assert ADMIN.startswith("key:") and len(ADMIN) == 16 and "admin-key" not in ADMIN
    with pytest.raises(ConfigError, match="COSYVOICE_VOICE_EDITORS must be one of anyone, creator, admin"):
        VoicePolicy.from_env({"COSYVOICE_VOICE_EDITORS": "everybody"})
    settings = ServerSettings.from_env({"COSYVOICE_API_KEYS": "k", "COSYVOICE_ADMIN_KEYS": "admin-key"})
    assert settings.voice_policy() == VoicePolicy("creator", frozenset({ADMIN}))
    with pytest.raises(ConfigError, match="voice_editors"):
        ServerSettings(voice_editors="nobody")
