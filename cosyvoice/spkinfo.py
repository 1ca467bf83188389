"""The official ``spk2info.pt`` (saved speakers) read and written without ever losing an entry.

The official API keeps saved voices in ``{model_dir}/spk2info.pt``: ``torch.save`` of ``{spk_id: {name:
tensor}}``. Our saved voices live in the :class:`~cosyvoice.voices.VoiceLibrary`; this file is imported
from at start-up and exported to on ``save_spkinfo()``. Rules:

* An entry we can use (a zero-shot entry: prompt mel, speech tokens, speaker embedding, prompt text) is
  converted to a :class:`Voice`. Any other entry (e.g. an SFT speaker ``{'embedding'}`` of CosyVoice 1,
  a malformed copy) is *unusable*: kept exactly as loaded, listed with the reason, and written back.
* A file that cannot be read at all is never overwritten: the next write first copies it to
  ``spk2info.pt.unreadable-<time>`` and says so.
* Every write replaces the file atomically (temporary file, fsync, rename): a crash leaves the old
  file or the new one.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cosyvoice.frontend.frontend import Voice
from cosyvoice.frontend.prompt import PromptFeatures
from cosyvoice.utils.fs import atomic_write, temp_path

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


def read_spkinfo(path: str | Path) -> SpkInfo:
    """Everything in ``path`` (absent: empty), sorted into usable voices and entries kept as they are.

    Stale temporary files of an interrupted write are removed. Never raises for the file's content.
    """
    path = Path(path)
    info = SpkInfo(path)
    for leftover in path.parent.glob(f".{path.name}.*.tmp"):
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


__all__ = ["SPKINFO_FILE", "SpkInfo", "read_spkinfo", "temp_path", "voice_from_official", "voice_to_official",
           "write_spkinfo"]
