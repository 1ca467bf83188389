"""One exception hierarchy for the whole project.

Adapters (UI, REST, gRPC) map these to user-facing messages once; nothing else
should need to catch bare ``Exception``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


class CosyVoiceError(Exception):
    """Base class of every error this package raises on purpose."""


class ModelBundleError(CosyVoiceError):
    """A model directory is missing a file, or a file is malformed."""


class ConfigError(ModelBundleError):
    """``cosyvoice3.yaml`` (or the tokenizer's config.json) is malformed or inconsistent."""


class WeightsError(ModelBundleError):
    """A checkpoint does not match the network it is loaded into."""


class InvalidInputError(CosyVoiceError, ValueError):
    """A request's text, audio or options are unusable; the message says why.

    ``field`` names the request field at fault (``"text"``, ``"voice"``, ...) where it is known, so adapters
    can point at it (a JSON ``field``, a form control); the service layer sets it.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self) -> tuple:  # keeps ``field`` across processes (Ray Serve replicas)
        return type(self), (str(self), self.field)


class NotFoundError(InvalidInputError):
    """A named thing (a saved voice) does not exist."""


class ConflictError(InvalidInputError):
    """The request conflicts with what is stored (e.g. a take a listening test uses cannot be deleted)."""


class AlreadyExistsError(ConflictError):
    """A name is taken (a saved voice); delete the holder or choose another name."""


class ResourceLimitError(CosyVoiceError):
    """A configured limit (sessions, lengths) stops the request; retry later or shorten it."""


class CancelledByShutdown(ResourceLimitError):
    """The server shut down while the request ran and cancelled it: its audio is cut short, so it is no answer."""

    def __init__(self) -> None:
        super().__init__("shutting down: this request was cancelled; retry on another server")

    def __reduce__(self) -> tuple:
        return type(self), ()


class StorageError(ResourceLimitError):
    """The server cannot write what was asked (disk full, folder read-only): nothing was saved, nothing lost."""


class ModelNotReady(CosyVoiceError):
    """Requests that arrive while the model is still loading (or failed to load)."""


class PermissionDeniedError(CosyVoiceError):
    """The caller may not do this to this thing (e.g. rename, export or delete another user's saved voice)."""


class ReadOnlyError(PermissionDeniedError):
    """The server serves a folder read-only (voices baked into an image, a read-only mount): what it holds can be
    used, nothing can be saved there; the message names the folder's setting."""


@contextlib.contextmanager
def command_line_errors() -> Iterator[None]:
    """A command line's body: one of our errors (a bad setting, input file or model folder) ends it with one
    line naming the problem and exit status 2, as argparse does for a bad flag, never with a traceback."""
    try:
        yield
    except CosyVoiceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
