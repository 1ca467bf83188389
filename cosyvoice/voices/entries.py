"""What the voice library keeps of a voice, without its tensors: :class:`VoiceInfo`, its name rules
(:func:`check_name`), the model identity its features belong to, and the records the library's parts hand each other.
"""

from __future__ import annotations

import errno
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cosyvoice.bundle import ONNX_INPUTS, TOKENIZER_FILES
from cosyvoice.errors import InvalidInputError, StorageError
from cosyvoice.frontend.frontend import Voice

MAX_NAME_CHARS = 64
# the repository's built-in voices (a clone's assets/voices; absent from an installed wheel, then none)
BUILTIN_VOICE_DIR = Path(__file__).resolve().parents[2] / "assets" / "voices"
# The files a voice's tensors depend on: the mel settings (yaml), the two ONNX models, the text tokenizer.
IDENTITY_FILES = ("cosyvoice3.yaml", *ONNX_INPUTS, *TOKENIZER_FILES)
BUILTIN_PREFIX = "builtin-"
ID_SHAPED = re.compile(r"[0-9a-fA-F]{32}")  # what a voice id looks like; names never do


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
    if ID_SHAPED.fullmatch(name) or name.startswith(BUILTIN_PREFIX):
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
class Builtin:
    """A built-in voice: its recording on disk, and its voice once featurised."""

    info: VoiceInfo
    wav: Path
    prompt_text: str
    voice: Voice | None = None


@dataclass
class Stamp:
    """What identifies one version of an entry's JSON: a rewrite (atomic rename) or a use (utime) changes it."""

    ino: int
    size: int
    ctime_ns: int


@dataclass
class Upload:
    """A decoded upload: its samples, rate and id, and its voice once loaded or featurised."""

    voice_id: str
    wav: torch.Tensor
    sample_rate: int
    prompt_text: str
    voice: Voice | None = field(default=None, repr=False)


def os_error(exc: OSError | StorageError) -> OSError:
    """The OSError behind a failed write (a StorageError made by :func:`storage_error` carries it)."""
    return exc if isinstance(exc, OSError) else exc.__cause__ if isinstance(exc.__cause__, OSError) else OSError(exc)


def storage_error(failed: OSError | StorageError, action: str) -> StorageError:
    """A failed write as users may read it: what could not be done and why, without the server's paths."""
    exc = os_error(failed)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        why = "the server's disk for voices is full; delete voices you no longer need, or ask its operator"
    elif exc.errno == errno.EROFS:
        why = "the server's voice folder has become read-only; ask its operator"
    else:
        why = f"the server could not write it ({exc.strerror or type(exc).__name__})"
    return StorageError(f"could not {action}: {why}")
