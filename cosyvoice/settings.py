"""Limits and runtime settings, in one object, configurable by environment variables.

Every adapter (API, UI, servers) reads limits from here, so a deployment changes a bound
in one place (``COSYVOICE_MAX_TEXT_CHARS=20000``) rather than in each entry point.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from cosyvoice.backends.precision import check_name
from cosyvoice.errors import ConfigError, InvalidInputError
from cosyvoice.owners import SHARING, Owners, key_owner

DEFAULT_VOICE_DIR = "pretrained_models/.voices"  # the voice library's folder (COSYVOICE_VOICE_DIR overrides it)
VOICE_DIR_SETTING = "COSYVOICE_VOICE_DIR"  # named in errors about the voice folder (--voice-dir on the servers)
DATA_DIR_SETTING = "COSYVOICE_DATA_DIR"  # named in errors about the data folder (takes, tests, projects)
STORE_BUSY_SETTING = "COSYVOICE_STORE_BUSY_SECONDS"  # how long a write waits on another process's database lock
CSV_FIELD_LIMIT = 131072  # the longest field Python's csv reader accepts by default (csv.field_size_limit())
SPEED_RANGE = (0.5, 2.0)  # speed factors: the mel is stretched linearly before the vocoder (streamed: per chunk)
# a request's flow Euler steps (``steps``; the model's default is its yaml's n_timesteps, 10 for CosyVoice3): fewer
# are faster and coarser, F5-TTS's speed/quality knob; each step costs one DiT call per chunk and its flow cache
FLOW_STEPS_RANGE = (1, 32)
# how a stream's last flow call runs (``final``): "full" recomputes the whole utterance with full attention, as the
# reference does; "chunked" keeps the chunk-causal mask and computes the new frames only (cost per second constant
# in length; the last chunk sounds different from the reference's, so it is a choice, never a default)
FINAL_CALLS = ("full", "chunked")
# a stream's first chunk in speech tokens (``first_hop``): fewer tokens before the first flow call, so the first
# sound comes sooner; the top is the reference's hop (25 tokens, one 50-frame flow chunk), the bottom one token
FIRST_HOP_RANGE = (1, 25)
TOKENIZER_MAX_SECONDS = 30.0  # speech_tokenizer_v3 refuses longer audio
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
VOICE_EDITORS = ("anyone", "creator", "admin")  # who may rename, export or delete a saved voice


def env_name(setting: str) -> str:
    """The environment variable of a :class:`Limits` or :class:`ServerSettings` field, as errors name it."""
    return f"COSYVOICE_{setting.upper()}"


def default_voice_dir(environ: dict[str, str] | None = None) -> Path:
    """Where saved voices live unless a caller says otherwise: ``COSYVOICE_VOICE_DIR`` or ``DEFAULT_VOICE_DIR``."""
    env = os.environ if environ is None else environ
    return Path(env.get(VOICE_DIR_SETTING) or DEFAULT_VOICE_DIR)


def default_data_dir(voice_dir: str | Path | None = None, environ: dict[str, str] | None = None) -> Path:
    """Where the workbench keeps its database and takes: ``COSYVOICE_DATA_DIR``, else ``.studio`` beside the voice
    folder (``voice_dir``, default :func:`default_voice_dir`), so voices and takes move together."""
    env = os.environ if environ is None else environ
    if env.get(DATA_DIR_SETTING):
        return Path(env[DATA_DIR_SETTING])
    return Path(voice_dir if voice_dir is not None else default_voice_dir(env)).parent / ".studio"


@dataclass(frozen=True)
class VoicePolicy:
    """Who may rename, export or delete a saved (named) voice; everyone may list and speak with it.

    ``editors``: ``anyone``; ``creator`` (the owner who saved it, :mod:`cosyvoice.owners`); or ``admin`` only.
    Holders of an admin key and in-process callers (owner ``None``: the Python API, the CLIs) always may; a
    voice saved before creators were recorded (creator ``None``) only they. Unsaved uploads belong to their
    uploader whatever the policy; built-in voices are read-only.
    """

    editors: str = "creator"
    admin_owners: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.editors not in VOICE_EDITORS:
            raise ConfigError(f"COSYVOICE_VOICE_EDITORS must be one of {', '.join(VOICE_EDITORS)}, "
                              f"got {self.editors!r}")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, *, editors: str | None = None,
                 admin_keys: tuple[str, ...] | None = None) -> VoicePolicy:
        """``COSYVOICE_VOICE_EDITORS`` and ``COSYVOICE_ADMIN_KEYS`` (explicit arguments win). Unset editors:
        ``creator``, with keys and without (where each browser is its own visitor, cosyvoice.owners)."""
        env = os.environ if environ is None else environ
        if admin_keys is None:
            admin_keys = tuple(k.strip() for k in env.get("COSYVOICE_ADMIN_KEYS", "").split(",") if k.strip())
        editors = editors or env.get("COSYVOICE_VOICE_EDITORS", "").strip().lower() or "creator"
        return cls(editors, frozenset(key_owner(k) for k in admin_keys))

    def may_edit(self, owner: str | None, creator: str | None) -> bool:
        """Whether ``owner`` may rename, export or delete a saved voice that ``creator`` saved."""
        if owner is None or owner in self.admin_owners or self.editors == "anyone":
            return True
        return self.editors == "creator" and creator == owner


def parse_precision(name: str) -> torch.dtype:
    """``"fp32" | "bf16" | "fp16"`` -> the torch dtype the LLM and flow run in."""
    if name not in PRECISIONS:
        raise InvalidInputError(f"dtype must be one of {sorted(PRECISIONS)}, got {name!r}")
    return PRECISIONS[name]


def prompt_cache_from_env(environ: dict[str, str] | None = None) -> bool:
    """``COSYVOICE_PROMPT_CACHE``: ``on`` (the default) keeps each voice's flow prefix across requests
    (:mod:`cosyvoice.flow.prompt_cache`; bounded by ``Limits.prompt_cache_mb`` / ``prompt_cache_disk_mb``), ``off``
    recomputes it for every request (the benchmark's ablation)."""
    env = os.environ if environ is None else environ
    value = (env.get("COSYVOICE_PROMPT_CACHE") or "on").strip().lower()
    if value not in ("on", "off"):
        raise ConfigError(f"COSYVOICE_PROMPT_CACHE must be on or off, got {value!r}")
    return value == "on"


def backend_from_env(environ: dict[str, str] | None = None) -> str:
    """``COSYVOICE_BACKEND``: the flow estimator and vocoder backend (auto, torch, onnxruntime, tensorrt;
    see :mod:`cosyvoice.backends`); ``auto`` when unset."""
    env = os.environ if environ is None else environ
    return env.get("COSYVOICE_BACKEND") or "auto"


def store_busy_seconds(environ: dict[str, str] | None = None) -> float:
    """``COSYVOICE_STORE_BUSY_SECONDS`` (default 30): how long a write to a data-folder database waits while
    another process holds its lock, before it is refused as busy (nothing changed)."""
    env = os.environ if environ is None else environ
    raw = env.get(STORE_BUSY_SETTING) or "30"
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds <= 3600:
        raise ConfigError(f"{STORE_BUSY_SETTING}={raw!r} must be a number of seconds in (0, 3600]")
    return seconds


def precision_from_env(environ: dict[str, str] | None = None) -> str:
    """``COSYVOICE_PRECISION``: what the LLM and the DiT compute in on a CPU (fp32, bf16, int8, auto; see
    :mod:`cosyvoice.backends.precision`); ``fp32`` (bit-equal to the golden fixtures) when unset."""
    env = os.environ if environ is None else environ
    return precision_setting(env.get("COSYVOICE_PRECISION") or "fp32")


def precision_setting(name: str) -> str:
    """A precision a deployment names (``COSYVOICE_PRECISION`` or ``--precision``), refused at start, naming the
    setting, rather than when the model loads (a server would start, then fail in the background)."""
    try:
        return check_name(name)
    except ConfigError as exc:
        raise ConfigError(f"COSYVOICE_PRECISION (--precision): {exc}") from None


@dataclass(frozen=True)
class Limits:
    """Request bounds. ``from_env`` reads ``COSYVOICE_<FIELD>`` overrides (e.g. ``COSYVOICE_MAX_SESSIONS``)."""

    max_text_chars: int = 5000  # one request's text, before splitting into sentences
    min_prompt_seconds: float = 1.0
    max_prompt_seconds: float = TOKENIZER_MAX_SECONDS
    min_prompt_sample_rate: int = 16000
    max_prompt_bytes: int = 50 * 1024 * 1024  # an encoded upload, before decoding
    # checked from the header before decoding: with max_prompt_seconds they bound a decode's memory to
    # max_prompt_sample_rate * (max_prompt_seconds + 1) float32 samples (24 MB) + the encoded input
    # (frontend/audio.py; a 255-channel Ogg of 0.3 MB would otherwise decode to gigabytes)
    max_prompt_channels: int = 8
    max_prompt_sample_rate: int = 192000
    max_sessions: int = 8  # concurrently synthesising requests on one engine
    max_queued_requests: int = 32  # requests waiting for a session slot; beyond this a request is "busy" at once
    queue_timeout_seconds: float = 30.0  # wait this long for a free session slot, then "busy"
    max_cached_voices: int = 64  # unnamed prompt voices kept by the voice library (named ones stay)
    max_cached_voice_bytes: int = 256 * 1024 * 1024
    max_named_voices: int = 256
    max_llm_positions: int = 4096  # KV-cache positions per session row (prompt + speech tokens), allocated once
    # all streams' incremental flow caches together; each stream is sure of flow_cache_mb / max_sessions, borrows
    # what the others leave, and recomputes (the reference's path) where it finds no room (docs/architecture.md,
    # "Memory"); None: half of the memory free on the engine's device when it starts, at most 32768
    # (cosyvoice/engine/memory.py)
    flow_cache_mb: float | None = None
    # each voice's flow prefix (the prompt's DiT keys/values at every Euler step, cosyvoice/flow/prompt_cache.py),
    # kept across requests in memory and in the voice folder (0: not on disk); 3.6 MB per prompt frame in fp32 at
    # the released size with 10 steps (half in bf16), so ~360 MB for a 3 s prompt (its first 100 frames)
    prompt_cache_mb: float = 1024.0
    prompt_cache_disk_mb: float = 4096.0
    # hold a session's LLM back while its first streamed chunk is computed (cosyvoice.engine.Engine's
    # first_chunk_priority), so that chunk has every core; None: on a CPU (first audio 6.4 -> 4.9 s on two cores,
    # docs/perf.md, 2026-12-06, 12:20), off on a GPU, which runs both stages at once anyway
    first_chunk_priority: bool | None = None
    # audible first sound: a streamed request's leading silence is sent only from this many ms before its first
    # audible sample (cosyvoice/engine/silence.py; nothing audible is ever removed); 0: off
    trim_leading_silence_ms: float = 40.0
    # the workbench's inputs: a batch file's rows (kept with its job, for resuming) and the characters of any one
    # of its fields; a listening test's title and instructions (every rater's page carries them)
    max_batch_rows: int = 10000
    max_batch_field_chars: int = 65536
    max_test_title_chars: int = 200
    max_test_instructions_chars: int = 5000
    max_test_items: int = 2000  # a listening test's items: every rater's plan holds them all
    job_workers: int = 1  # long jobs (batches, long-form renders) running at once per process (cosyvoice.jobs)
    # a long-form project's book (cosyvoice/longform/documents.py): the file as uploaded; an archive's (EPUB,
    # DOCX) members, of which only text is inflated (images never), each and all together, and each XML member's
    # nesting; a PDF's pages (and any one of its streams, inflated: max_import_member_bytes); then the text read
    # from any source (a paste too): its characters and its longest run without a space or punctuation
    max_import_bytes: int = 50 * 1024 * 1024
    max_import_members: int = 10000
    max_import_member_bytes: int = 32 * 1024 * 1024
    max_import_inflated_bytes: int = 96 * 1024 * 1024
    max_import_xml_depth: int = 200  # below libxml2's own 256, so the error names this limit
    max_import_pages: int = 5000
    max_import_chars: int = 5_000_000  # War and Peace is 3.2 million
    max_import_run_chars: int = 1000
    # a project's name, its segment table, and a dialogue script's turns and distinct speakers
    max_project_name_chars: int = 200
    max_project_segments: int = 50000
    max_dialogue_turns: int = 10000
    max_dialogue_speakers: int = 100

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or isinstance(value, bool):  # a bound is a number; an on/off setting has no sign
                continue
            if value < 0 or (value == 0 and f.name not in ("queue_timeout_seconds", "max_queued_requests",
                                                            "trim_leading_silence_ms", "prompt_cache_disk_mb")):
                raise ConfigError(f"limit {f.name} must be positive, got {value}")
        if self.min_prompt_seconds > self.max_prompt_seconds:
            raise ConfigError("min_prompt_seconds must not exceed max_prompt_seconds")
        if self.max_prompt_seconds > TOKENIZER_MAX_SECONDS:
            raise ConfigError(f"max_prompt_seconds={self.max_prompt_seconds:g}: the speech tokenizer accepts at most "
                              f"{TOKENIZER_MAX_SECONDS:g} s of prompt audio")
        if self.max_batch_field_chars > CSV_FIELD_LIMIT:
            raise ConfigError(f"max_batch_field_chars={self.max_batch_field_chars}: the CSV reader accepts fields of "
                              f"at most {CSV_FIELD_LIMIT} characters")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: float) -> Limits:
        """Defaults, then ``COSYVOICE_*`` environment variables, then explicit keyword overrides."""
        return replace(cls(**_env_values(cls, environ)), **overrides)


@dataclass(frozen=True)
class ServerSettings:
    """How a server is deployed (REST, gRPC, Ray Serve); request bounds stay in :class:`Limits`.

    ``from_env`` reads ``COSYVOICE_<FIELD>`` (``COSYVOICE_MODEL_DIR``, ``COSYVOICE_API_KEYS=k1,k2``,
    ``COSYVOICE_CORS_ORIGINS=https://a.example,https://b.example``, ...); :func:`add_server_arguments` adds the
    same as command-line flags, which win over the environment.
    """

    model_dir: str = "pretrained_models/Fun-CosyVoice3-0.5B"  # a folder or a ModelScope id
    host: str = "127.0.0.1"  # 0.0.0.0 serves other machines too
    port: int = 50000
    device: str | None = None  # cpu, cuda, cuda:1; None: CUDA when available
    precision: str | None = None  # fp32, bf16, int8, auto (CPU; cosyvoice.backends.precision); None: fp32
    voice_dir: str = DEFAULT_VOICE_DIR  # the voice library, shared with the web UI
    api_keys: tuple[str, ...] = ()  # Bearer tokens accepted; empty: no authentication
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call; empty: none (CORS closed)
    max_body_bytes: int = 72 * 1024 * 1024  # one request body: a max-size prompt upload, base64-encoded, fits
    allowed_audio_dir: str | None = None  # prompt audio given as a server path must lie under it; None: refused
    retry_after_seconds: int = 5  # the Retry-After of a "busy" answer
    stream_idle_seconds: float = 60.0  # a WebSocket text stream without new text (not white space) this long is ended
    stream_start_seconds: float = 10.0  # a WebSocket that sends no start message within this is closed
    shutdown_grace_seconds: float = 30.0  # on SIGTERM: running requests may finish this long, then are cancelled
    # what a slow or hostile client may hold (cosyvoice/server/http_limits.py, rust/http-front; docs/servers.md)
    header_timeout_seconds: float = 10.0  # a request's head must be complete this long after the connection opens
    body_timeout_seconds: float = 10.0  # a request body silent this long is cut (408)
    body_min_bytes_per_second: int = 1024  # ... and so is one averaging less once read that long (0: no minimum)
    keep_alive_timeout_seconds: float = 5.0  # an idle keep-alive connection is closed after this
    max_connections: int = 512  # connections served at once; beyond, 503
    max_json_depth: int = 64  # a JSON body nesting arrays/objects deeper is refused (400) before it is parsed
    # ... and one holding more values (array items, object members): a batch's 10,000 rows of 13 columns fit
    max_json_values: int = 200_000
    default_voice: str = "en-allison"  # Ray Serve's voice when a body names none (or "qwen", the contract's alias)
    voice_editors: str = ""  # who may rename/export/delete saved voices (anyone|creator|admin; "": VoicePolicy's)
    admin_keys: tuple[str, ...] = ()  # keys whose holders see and edit everything (also accepted as API keys)
    # who sees stored objects: private (owner + admins) | team (everyone) | auto: private, but a keyless server on
    # loopback also shows this machine's own work (the batch CLI's takes; cosyvoice.owners)
    sharing: str = "auto"

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"port must be in 1..65535, got {self.port}")
        if self.precision is not None:
            precision_setting(self.precision)
        if (self.max_body_bytes <= 0 or self.retry_after_seconds < 0 or self.stream_idle_seconds <= 0
                or self.stream_start_seconds <= 0 or self.shutdown_grace_seconds < 0):
            raise ConfigError("max_body_bytes, stream_idle_seconds and stream_start_seconds must be positive, "
                              "retry_after_seconds and shutdown_grace_seconds not negative")
        if (min(self.header_timeout_seconds, self.body_timeout_seconds, self.keep_alive_timeout_seconds) <= 0
                or self.max_connections <= 0 or min(self.max_json_depth, self.max_json_values) <= 0
                or self.body_min_bytes_per_second < 0):
            raise ConfigError("the HTTP timeouts, max_connections, max_json_depth and max_json_values must be "
                              "positive, body_min_bytes_per_second not negative")
        if self.voice_editors and self.voice_editors not in VOICE_EDITORS:
            raise ConfigError(f"voice_editors must be one of {', '.join(VOICE_EDITORS)}, got {self.voice_editors!r}")
        if self.sharing not in SHARING:
            raise ConfigError(f"sharing must be one of {', '.join(SHARING)}, got {self.sharing!r}")
        if "*" in self.cors_origins and self.api_keys:
            raise ConfigError("CORS origin '*' with API keys would let any web page use a visitor's key; "
                              "list the allowed origins instead")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: object) -> ServerSettings:
        """Defaults, then ``COSYVOICE_*`` environment variables, then explicit keyword overrides."""
        return replace(cls(**_env_values(cls, environ)), **overrides)

    def voice_policy(self) -> VoicePolicy:
        """The voice library's :class:`VoicePolicy` of these settings (``library.policy = ...``)."""
        return VoicePolicy.from_env({}, editors=self.voice_editors or None, admin_keys=self.admin_keys)

    def owners(self, host: str | None = None) -> Owners:
        """Who callers are under these settings (:mod:`cosyvoice.owners`), on a server bound to ``host`` (default
        :attr:`host`; the web UI has its own)."""
        return Owners(self.api_keys, self.admin_keys, self.sharing, host=self.host if host is None else host)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags for every :class:`ServerSettings` and :class:`Limits` field (``--model-dir``, ``--api-key`` (repeat
    it), ``--cors-origin``, ``--max-sessions``, ...); unset flags keep the environment's value."""
    for f in fields(ServerSettings):
        many = f.type == "tuple[str, ...]"
        flag = "--" + (f.name[:-1] if many else f.name).replace("_", "-")
        aliases = ["--model_dir"] if f.name == "model_dir" else []  # the official servers' spelling
        parser.add_argument(flag, *aliases, dest=f"server_{f.name}", action="append" if many else "store",
                            type=None if many else _KINDS.get(f.type, str), default=None, metavar=f.name.upper(),
                            help=f"(env {env_name(f.name)}; default {f.default!r})")
    for f in fields(Limits):
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f"limits_{f.name}", type=_KINDS[f.type],
                            default=None, metavar=f.name.upper(),
                            help=f"(env {env_name(f.name)}; default {f.default!r})")


def settings_from_args(args: argparse.Namespace,
                       environ: dict[str, str] | None = None) -> tuple[ServerSettings, Limits]:
    """The settings and limits of :func:`add_server_arguments`' flags over the environment's."""
    def given(prefix: str, cls: type) -> dict[str, object]:
        values = {f.name: getattr(args, prefix + f.name, None) for f in fields(cls)}
        return {k: tuple(v) if isinstance(v, list) else v for k, v in values.items() if v is not None}

    return (ServerSettings.from_env(environ, **given("server_", ServerSettings)),
            Limits.from_env(environ, **given("limits_", Limits)))


def flag(raw: str) -> bool:
    """An on/off setting as written in the environment or on the command line."""
    value = raw.strip().lower()
    if value in ("on", "true", "yes", "1"):
        return True
    if value in ("off", "false", "no", "0"):
        return False
    raise ValueError(f"{raw!r} is not on or off")


_KINDS: dict[str, type] = {"int": int, "float": float, "float | None": float, "str": str, "str | None": str,
                           "bool": flag, "bool | None": flag}


def _env_values(cls: type, environ: dict[str, str] | None) -> dict[str, object]:
    """The ``COSYVOICE_<FIELD>`` values set for ``cls``'s fields, parsed by their type (lists comma-separated)."""
    env = os.environ if environ is None else environ
    values: dict[str, object] = {}
    for f in fields(cls):
        name = env_name(f.name)
        raw = env.get(name)
        if raw is None:
            continue
        if f.type == "tuple[str, ...]":
            values[f.name] = tuple(part.strip() for part in raw.split(",") if part.strip())
            continue
        kind = _KINDS[f.type]
        try:
            values[f.name] = kind(raw)
        except ValueError as exc:
            raise ConfigError(f"{name}={raw!r} is not a valid {kind.__name__}") from exc
    return values
