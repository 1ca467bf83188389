"""Limits and runtime settings, in one object, configurable by environment variables.

Every adapter (API, UI, servers) reads limits from here, so a deployment changes a bound
in one place (``COSYVOICE_MAX_TEXT_CHARS=20000``) rather than in each entry point.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

import torch

from cosyvoice.errors import ConfigError, InvalidInputError

SPEED_RANGE = (0.5, 2.0)  # non-streaming speed factors: the mel is stretched linearly before the vocoder
TOKENIZER_MAX_SECONDS = 30.0  # speech_tokenizer_v3 refuses longer audio
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_precision(name: str) -> torch.dtype:
    """``"fp32" | "bf16" | "fp16"`` -> the torch dtype the LLM and flow run in."""
    if name not in PRECISIONS:
        raise InvalidInputError(f"dtype must be one of {sorted(PRECISIONS)}, got {name!r}")
    return PRECISIONS[name]


@dataclass(frozen=True)
class Limits:
    """Request bounds. ``from_env`` reads ``COSYVOICE_<FIELD>`` overrides (e.g. ``COSYVOICE_MAX_SESSIONS``)."""

    max_text_chars: int = 5000  # one request's text, before splitting into sentences
    min_prompt_seconds: float = 1.0
    max_prompt_seconds: float = TOKENIZER_MAX_SECONDS
    min_prompt_sample_rate: int = 16000
    max_prompt_bytes: int = 50 * 1024 * 1024  # an encoded upload, before decoding
    max_sessions: int = 8  # concurrently synthesising requests on one engine
    queue_timeout_seconds: float = 30.0  # wait this long for a free session slot, then "busy"
    max_cached_voices: int = 64  # unnamed prompt voices kept by the voice library (named ones stay)
    max_cached_voice_bytes: int = 256 * 1024 * 1024
    max_named_voices: int = 256
    max_llm_positions: int = 4096  # KV-cache positions per session row (prompt + speech tokens), allocated once
    # all streams' incremental flow caches together; each stream gets flow_cache_mb / max_sessions and
    # recomputes (the reference's path) beyond it (docs/architecture.md, "Memory")
    flow_cache_mb: float = 32768.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value < 0 or (value == 0 and f.name not in ("queue_timeout_seconds",)):
                raise ConfigError(f"limit {f.name} must be positive, got {value}")
        if self.min_prompt_seconds > self.max_prompt_seconds:
            raise ConfigError("min_prompt_seconds must not exceed max_prompt_seconds")
        if self.max_prompt_seconds > TOKENIZER_MAX_SECONDS:
            raise ConfigError(f"max_prompt_seconds={self.max_prompt_seconds:g}: the speech tokenizer accepts at most "
                              f"{TOKENIZER_MAX_SECONDS:g} s of prompt audio")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: float) -> Limits:
        """Defaults, then ``COSYVOICE_*`` environment variables, then explicit keyword overrides."""
        env = os.environ if environ is None else environ
        values: dict[str, float] = {}
        for f in fields(cls):
            raw = env.get(f"COSYVOICE_{f.name.upper()}")
            if raw is None:
                continue
            kind = int if f.type in ("int", int) else float
            try:
                values[f.name] = kind(raw)
            except ValueError as exc:
                raise ConfigError(f"COSYVOICE_{f.name.upper()}={raw!r} is not a valid {kind.__name__}") from exc
        return replace(cls(**values), **overrides)
