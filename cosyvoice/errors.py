"""One exception hierarchy for the whole project.

Adapters (UI, REST, gRPC) map these to user-facing messages once; nothing else
should need to catch bare ``Exception``.
"""


class CosyVoiceError(Exception):
    """Base class of every error this package raises on purpose."""


class ModelBundleError(CosyVoiceError):
    """A model directory is missing a file, or a file is malformed."""


class ConfigError(ModelBundleError):
    """``cosyvoice3.yaml`` (or the tokenizer's config.json) is malformed or inconsistent."""


class WeightsError(ModelBundleError):
    """A checkpoint does not match the network it is loaded into."""


class InvalidInputError(CosyVoiceError, ValueError):
    """A request's text, audio or options are unusable; the message says why."""


class ResourceLimitError(CosyVoiceError):
    """A configured limit (sessions, lengths) stops the request; retry later or shorten it."""
