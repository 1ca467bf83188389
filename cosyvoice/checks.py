"""The checks of a request's plain fields, at the edge and only here: each failure an
:class:`~cosyvoice.errors.InvalidInputError` naming the field at fault (``field``), before any audio work or any
wait for a slot. Code below the service asserts its invariants instead of checking again.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from cosyvoice import pipeline
from cosyvoice.encoding import FORMATS, AudioFormat
from cosyvoice.engine import ChunkSchedule
from cosyvoice.errors import InvalidInputError
from cosyvoice.request import MODES, CheckedRequest, SynthesisRequest, draw_seed, mode_label
from cosyvoice.settings import FLOW_STEPS_RANGE, SPEED_RANGE, Limits


def check_text(text: object, limits: Limits, what: str = "text") -> str:
    """Plain text a user typed (text to speak, a transcript, an instruction): a non-empty string within
    ``Limits.max_text_chars``. The one text check: nothing below the service checks it again."""
    if not isinstance(text, str):
        raise InvalidInputError(f"{what} must be a string, got {type(text).__name__}")
    if not text.strip():
        raise InvalidInputError(f"{what} is empty; type something to say")
    if len(text) > limits.max_text_chars:
        raise InvalidInputError(
            f"{what} has {len(text)} characters; at most {limits.max_text_chars} are allowed per request "
            "(COSYVOICE_MAX_TEXT_CHARS); split it into several requests")
    return text


@contextlib.contextmanager
def field_named(name: str) -> Iterator[None]:
    """Name ``name`` as the field of an :class:`InvalidInputError` raised inside, unless it names one."""
    try:
        yield
    except InvalidInputError as exc:
        if exc.field is None:
            exc.field = name
        raise


def allowed_path(path: str, root: str | Path | None, field: str = "prompt_audio") -> Path:
    """``path`` if it names a file under ``root`` (symlinks resolved), for adapters that accept server paths;
    with no ``root`` configured, paths are refused."""
    if root is None:
        raise InvalidInputError("this server accepts no file paths; send the audio itself (base64 or upload), "
                                "or start it with an allowed folder (COSYVOICE_ALLOWED_AUDIO_DIR)", field)
    base = Path(root).resolve()
    target = (base / path).resolve()
    if not target.is_relative_to(base):
        raise InvalidInputError(f"the path {path!r} lies outside the allowed audio folder", field)
    if not target.is_file():
        raise InvalidInputError(f"no audio file {path!r} in the allowed audio folder", field)
    return target


def check(request: SynthesisRequest, limits: Limits, default_steps: int, has_text: bool = True) -> CheckedRequest:
    """Every check of ``request`` that needs no audio work (``has_text=False``: the text arrives later, as a stream);
    ``default_steps``: the flow's steps of a request that names none."""
    mode = _mode(request.mode)
    with field_named("text"):
        if has_text:
            check_text(request.text, limits)
    stream, speed, seed = _options(request)
    fmt = _format(request.format)
    return CheckedRequest(mode, stream, speed, seed, fmt, _instruction(mode, request.instruction, limits),
                          check_steps(request.steps, default_steps),
                          ChunkSchedule.checked(request.final, request.first_hop))


def _mode(mode: object) -> str:
    label = mode_label(mode)
    if label == "unknown":
        raise InvalidInputError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}", "mode")
    return label


def _options(request: SynthesisRequest) -> tuple[bool, float, int]:
    """(stream, speed, seed); a missing seed is drawn from torch's global generator (``torch.manual_seed``
    makes an unseeded request repeatable, as the official API promises)."""
    if not isinstance(request.stream, bool):
        raise InvalidInputError(f"stream must be true or false, got {request.stream!r}", "stream")
    seed = request.seed
    if isinstance(seed, numbers.Integral) and not isinstance(seed, bool):
        seed = int(seed)  # numpy integers from adapters
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)
                             or not 0 <= seed < pipeline.SEED_SPACE):  # any seed the engine takes
        raise InvalidInputError(f"seed must be an integer in [0, 2**63), got {request.seed!r}", "seed")
    return request.stream, check_speed(request.speed), draw_seed() if seed is None else seed


def check_speed(value: object) -> float:
    """A speed in ``SPEED_RANGE``: any real scalar (int, float, numpy, or a one-element array or tensor)."""
    lo, hi = SPEED_RANGE
    speed = value
    if (isinstance(speed, torch.Tensor) and speed.numel() == 1 and not speed.is_complex()) or (
            isinstance(speed, np.ndarray) and speed.size == 1):
        speed = speed.item()
    if not isinstance(speed, numbers.Real) or isinstance(speed, bool) or not lo <= float(speed) <= hi:
        raise InvalidInputError(f"speed must be between {lo:g} and {hi:g}, got {value!r}", "speed")
    return float(speed)


def _format(name: object) -> AudioFormat:
    """The output format called ``name`` (case-insensitive), one of the encoder's :data:`FORMATS`."""
    fmt = FORMATS.get(name.lower()) if isinstance(name, str) else None
    if fmt is None:
        raise InvalidInputError(f"unknown audio format {name!r}; use one of {', '.join(FORMATS)}", "format")
    return fmt


def check_steps(steps: object, default: int | None) -> int | None:
    """The flow's Euler steps: an integer in ``FLOW_STEPS_RANGE``, or ``default`` (the model's) for None."""
    if steps is None:
        return default
    lo, hi = FLOW_STEPS_RANGE
    if isinstance(steps, numbers.Integral) and not isinstance(steps, bool):
        steps = int(steps)  # numpy integers from adapters
    if not isinstance(steps, int) or isinstance(steps, bool) or not lo <= steps <= hi:
        raise InvalidInputError(f"steps must be an integer from {lo} to {hi}, got {steps!r}", "steps")
    return steps


def _instruction(mode: str, instruction: object, limits: Limits) -> str:
    """The instruction as the user wrote it (the pipeline wraps it where its token ids are made)."""
    if mode != "instruct":
        return ""
    with field_named("instruction"):
        if not isinstance(instruction, str) or not instruction.strip():
            raise InvalidInputError("instruct mode needs an instruction, e.g. 'Speak slowly and calmly.'")
        return check_text(instruction, limits, "instruction")
