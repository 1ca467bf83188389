"""Finishing long-form segments: silence trimmed to a margin, loudness per segment, subtitles, take checks,
and the audiobook platforms' (ACX) check with the mastering that meets it.

Everything here is a pure function of ONE segment's take (and the project's settings), never of its
neighbours: regenerating one segment leaves every other segment's finished samples bit-identical, and the
mix is only their concatenation with silence between. Loudness is measured with pyloudnorm (ITU-R BS.1770-4
K-weighting and gating); true peak is the 4x-oversampled peak BS.1770 describes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SILENCE_DB = -45.0  # a 10 ms frame quieter than this (RMS, dBFS) is silence for trimming and checks
FRAME_SECONDS = 0.01
PRESETS = {  # name -> (integrated loudness target in LUFS, true-peak ceiling in dBTP)
    "podcast": (-16.0, -1.0),
    "broadcast": (-23.0, -1.0),  # EBU R128
}
ACX_PRESET = "acx"  # mastered per segment to ACX's levels (master_acx) instead of to a loudness
PRESET_NAMES = (*PRESETS, ACX_PRESET)
LOUDNESS_BLOCK_SECONDS = 0.4  # BS.1770's gating block: shorter audio is measured repeated to that length


@dataclass(frozen=True)
class Finish:
    """How each segment is finished: ``preset`` None keeps the level; ``margin`` seconds of silence at each end."""

    preset: str | None = "podcast"
    margin: float = 0.1

    @property
    def target(self) -> tuple[float, float] | None:
        return PRESETS[self.preset] if self.preset else None


def frame_db(x: np.ndarray, sample_rate: int) -> np.ndarray:
    """RMS level of consecutive 10 ms frames, in dBFS."""
    n = max(1, int(sample_rate * FRAME_SECONDS))
    frames = x[: len(x) // n * n].reshape(-1, n).astype(np.float64)
    rms = np.sqrt(np.mean(frames ** 2, axis=1)) if frames.size else np.zeros(0)
    return 20 * np.log10(np.maximum(rms, 1e-10))


def trim(x: np.ndarray, sample_rate: int, margin: float) -> np.ndarray:
    """``x`` with its leading and trailing silence made exactly ``margin`` seconds (cut, or padded with zeros)."""
    levels = frame_db(x, sample_rate)
    voiced = np.flatnonzero(levels > SILENCE_DB)
    pad = round(margin * sample_rate)
    if voiced.size == 0:
        return np.zeros(2 * pad, np.float32)
    n = max(1, int(sample_rate * FRAME_SECONDS))
    first, last = voiced[0] * n, min(len(x), (voiced[-1] + 1) * n)
    if voiced[-1] == len(levels) - 1:
        last = len(x)  # the partial frame at the end belongs to the sound
    return np.concatenate([np.zeros(pad, np.float32), x[first:last].astype(np.float32), np.zeros(pad, np.float32)])


def loudness(x: np.ndarray, sample_rate: int) -> float:
    """Integrated loudness (LUFS) by BS.1770; audio shorter than one gating block is measured repeated."""
    import pyloudnorm

    block = math.ceil(LOUDNESS_BLOCK_SECONDS * sample_rate)
    if 0 < len(x) < block:
        x = np.tile(x, math.ceil(block / len(x)))
    if len(x) == 0:
        return float("-inf")
    return float(pyloudnorm.Meter(sample_rate).integrated_loudness(x.astype(np.float64)))


def true_peak_db(x: np.ndarray, sample_rate: int) -> float:
    """The 4x-oversampled peak (BS.1770 Annex 2), in dBTP; soxr's interpolator stands in for the Annex's FIR
    (7x faster than scipy's polyphase filter, within 0.1 dB of it on speech)."""
    import soxr

    if len(x) == 0:
        return float("-inf")
    upsampled = soxr.resample(x.astype(np.float32), sample_rate, 4 * sample_rate)
    peak = max(float(np.max(np.abs(upsampled))), float(np.max(np.abs(x))))
    return 20 * math.log10(max(peak, 1e-10))


def normalise(x: np.ndarray, sample_rate: int, target_lufs: float, ceiling_dbtp: float) -> np.ndarray:
    """``x`` at ``target_lufs``, turned down further if its true peak would pass ``ceiling_dbtp`` (a plain gain:
    no limiter colours the voice). Silence is returned unchanged."""
    level = loudness(x, sample_rate)
    if not math.isfinite(level):
        return x.astype(np.float32)
    gain_db = target_lufs - level
    gain_db = min(gain_db, ceiling_dbtp - true_peak_db(x, sample_rate))
    return (x.astype(np.float64) * 10 ** (gain_db / 20)).astype(np.float32)


def finish_segment(x: np.ndarray, sample_rate: int, finish: Finish) -> np.ndarray:
    """One take finished: trimmed to the margin, then at the preset's loudness (if any)."""
    y = trim(x, sample_rate, finish.margin)
    if finish.preset == ACX_PRESET:
        return master_acx(y, sample_rate)
    if finish.target is not None:
        y = normalise(y, sample_rate, *finish.target)
    return y


# ----------------------------------------------------------------------------- ACX (audiobook platforms)

ACX_RMS_DB = (-23.0, -18.0)  # ACX's submission requirements: RMS level of the whole file
ACX_PEAK_DB = -3.0  # sample peak
ACX_NOISE_FLOOR_DB = -60.0  # RMS of the quietest half second
ACX_NOISE_WINDOW = 0.5
# Mastering aims inside the bounds with room to spare: a chapter's pauses between segments pull its RMS about
# 1 dB below its segments' level, so segments are set to -19.5 dB RMS and peaks limited to -3.5 dB.
MASTER_RMS_DB = -19.5
MASTER_PEAK_DB = -3.5
GATE_FLOOR_DB = -65.0  # where noise between words is put (ACX's floor is -60 dB)
LIMITER_BLOCK_SECONDS = 0.0025
LIMITER_RELEASE_DB_PER_SECOND = 60.0


def _db(value: float) -> float:
    return 20 * math.log10(value) if value > 0 else float("-inf")


@dataclass(frozen=True)
class AcxReport:
    """One file's measurements against ACX's requirements."""

    seconds: float
    rms_db: float
    peak_db: float
    noise_floor_db: float

    @property
    def problems(self) -> list[str]:
        low, high = ACX_RMS_DB
        found = []
        if self.rms_db == float("-inf"):
            found.append(f"silent: every sample is zero; ACX wants RMS {low:g} to {high:g} dB")
        elif not low <= self.rms_db <= high:
            found.append(f"RMS {self.rms_db:.1f} dB is outside {low:g} to {high:g} dB")
        if self.peak_db > ACX_PEAK_DB:
            found.append(f"peak {self.peak_db:.1f} dB is above {ACX_PEAK_DB:g} dB")
        if self.noise_floor_db > ACX_NOISE_FLOOR_DB:
            found.append(f"noise floor {self.noise_floor_db:.1f} dB is above {ACX_NOISE_FLOOR_DB:g} dB")
        return found

    @property
    def passed(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict:
        def number(value: float) -> float | None:  # JSON has no -inf: digital silence is reported as null
            return round(value, 2) if math.isfinite(value) else None

        return {"seconds": round(self.seconds, 3), "rms_db": number(self.rms_db), "peak_db": number(self.peak_db),
                "noise_floor_db": number(self.noise_floor_db), "passed": self.passed, "problems": self.problems}


class AcxMeter:
    """ACX's three measurements over audio fed piece by piece (a book is never held in memory): RMS of every
    sample, the sample peak, and the noise floor as the RMS of the quietest half-second window (hop 50 ms), as
    ACX's own check measures it: a pause of digital silence has no floor at all (-inf, reported as null)."""

    def __init__(self, sample_rate: int) -> None:
        self.sample_rate = sample_rate
        self.window = round(ACX_NOISE_WINDOW * sample_rate)
        self.hop = max(1, self.window // 10)
        self.count = 0
        self.sum_squares = 0.0
        self.peak = 0.0
        self.quietest = float("inf")
        self._tail = np.zeros(0, np.float64)

    def feed(self, x: np.ndarray) -> None:
        x = np.asarray(x, np.float64)
        if not len(x):
            return
        self.count += len(x)
        self.sum_squares += float(np.dot(x, x))
        self.peak = max(self.peak, float(np.max(np.abs(x))))
        buffer = np.concatenate([self._tail, x])
        starts = np.arange(0, len(buffer) - self.window + 1, self.hop)
        if len(starts):
            sums = np.concatenate([[0.0], np.cumsum(buffer ** 2)])
            energy = np.maximum(sums[starts + self.window] - sums[starts], 0.0)  # cumsum rounding
            self.quietest = min(self.quietest, float(np.min(energy)) / self.window)
            self._tail = buffer[starts[-1] + self.hop:]
        else:
            self._tail = buffer

    def report(self) -> AcxReport:
        rms = math.sqrt(self.sum_squares / self.count) if self.count else 0.0
        floor = math.sqrt(self.quietest) if math.isfinite(self.quietest) else 0.0
        return AcxReport(self.count / self.sample_rate, _db(rms), _db(self.peak), _db(floor))


def acx_check(x: np.ndarray, sample_rate: int) -> AcxReport:
    meter = AcxMeter(sample_rate)
    meter.feed(x)
    return meter.report()


def limit_peaks(x: np.ndarray, sample_rate: int, ceiling_db: float) -> np.ndarray:
    """``x`` with no sample above ``ceiling_db``: a look-ahead peak limiter. The gain of each 2.5 ms block is the
    lowest its neighbours need, drops at once and recovers at 60 dB/s, and is interpolated between block
    centres, so it is never above what any sample needs and never steps audibly."""
    ceiling = 10 ** (ceiling_db / 20)
    n = max(1, round(LIMITER_BLOCK_SECONDS * sample_rate))
    blocks = math.ceil(len(x) / n)
    if blocks == 0:
        return x.astype(np.float32)
    padded = np.zeros(blocks * n, np.float64)
    padded[: len(x)] = np.abs(x)
    need = np.minimum(1.0, ceiling / np.maximum(padded.reshape(blocks, n).max(axis=1), 1e-12))
    near = np.minimum(need, np.minimum(np.r_[need[1:], 1.0], np.r_[1.0, need[:-1]]))
    step = 10 ** (LIMITER_RELEASE_DB_PER_SECOND * n / sample_rate / 20)
    gain = near.copy()
    for b in range(1, blocks):
        gain[b] = min(near[b], gain[b - 1] * step)
    centres = (np.arange(blocks) + 0.5) * n
    y = x.astype(np.float64) * np.interp(np.arange(len(x)), centres, gain)
    return np.clip(y, -ceiling, ceiling).astype(np.float32)


def gate_noise(x: np.ndarray, sample_rate: int, floor_db: float = GATE_FLOOR_DB) -> np.ndarray:
    """``x`` with the frames that are only noise turned down to ``floor_db``: a 10 ms frame is noise when it is
    within 6 dB of the quietest tenth of the audible frames and 20 dB under the loudest tenth (speech's level);
    the gain moves between frame centres, so it never clicks. Digital silence stays as it is."""
    levels = frame_db(x, sample_rate)
    audible = levels > -150
    if not audible.any():
        return x.astype(np.float32)
    quiet, loud = np.percentile(levels[audible], [10, 90])
    threshold = min(quiet + 6.0, loud - 20.0)
    cut = np.where(levels < threshold, np.minimum(0.0, floor_db - levels), 0.0)
    n = max(1, int(sample_rate * FRAME_SECONDS))
    centres = (np.arange(len(levels)) + 0.5) * n
    return (x.astype(np.float64) * 10 ** (np.interp(np.arange(len(x)), centres, cut) / 20)).astype(np.float32)


def master_acx(x: np.ndarray, sample_rate: int, rms_db: float = MASTER_RMS_DB,
               peak_db: float = MASTER_PEAK_DB) -> np.ndarray:
    """``x`` at ``rms_db`` RMS with peaks limited to ``peak_db`` and its quiet frames gated: what ACX asks of a
    file, per segment (a chapter of such segments measures about 1 dB lower for its pauses). Limiting lowers the
    RMS a little, so gain and limiter are applied three times. Silence is returned unchanged."""
    y = x.astype(np.float32)
    for _ in range(3):
        rms = float(np.sqrt(np.mean(y.astype(np.float64) ** 2))) if len(y) else 0.0
        if rms <= 0:
            return y
        y = limit_peaks(y * np.float32(10 ** ((rms_db - _db(rms)) / 20)), sample_rate, peak_db)
    return gate_noise(y, sample_rate)


# ----------------------------------------------------------------------------- automatic check

CJK = ((0x3040, 0x30FF), (0x3400, 0x9FFF), (0xAC00, 0xD7AF))


def expected_seconds(text: str, speed: float = 1.0) -> float:
    """A rough reading time: ~14 Latin letters or ~4.5 CJK characters a second (speech at speed 1)."""
    cjk = sum(1 for ch in text if any(a <= ord(ch) <= b for a, b in CJK))
    letters = sum(1 for ch in text if ch.isalnum()) - cjk
    return (letters / 14.0 + cjk / 4.5) / speed


def check_take(x: np.ndarray, sample_rate: int, text: str, speed: float = 1.0) -> list[str]:
    """Reasons to listen again: far too long or short for the text, long silences, clipping. Empty: fine."""
    flags = []
    seconds = len(x) / sample_rate
    expected = expected_seconds(text, speed)
    if seconds > 2.5 * expected + 1.0:
        flags.append(f"too long: {seconds:.1f} s for about {expected:.1f} s of text")
    elif seconds < 0.4 * expected - 0.3:
        flags.append(f"too short: {seconds:.1f} s for about {expected:.1f} s of text")
    levels = frame_db(x, sample_rate)
    voiced = levels > SILENCE_DB
    if not voiced.any():
        flags.append("silent")
    else:
        runs = _longest_run(~voiced[np.argmax(voiced): len(voiced) - np.argmax(voiced[::-1])]) * FRAME_SECONDS
        lead = np.argmax(voiced) * FRAME_SECONDS
        if runs > 2.0:
            flags.append(f"a {runs:.1f} s silence inside")
        if lead > 1.0:
            flags.append(f"{lead:.1f} s of silence before the speech")
    clipped = float(np.mean(np.abs(x) >= 0.99)) if len(x) else 0.0
    if clipped > 0.001:
        flags.append(f"clipping: {100 * clipped:.1f}% of samples at full scale")
    return flags


LOOP_MIN_REPEATS = 3  # a stretch of speech tokens that repeats its first `period` tokens this often ...
LOOP_MIN_TOKENS = 75  # ... over at least this many tokens (3 s at 25 tokens/s) is the LLM looping
LOOP_MAX_PERIOD = 100


def token_loop(tokens: list[int] | tuple[int, ...], token_rate: float = 25.0) -> str | None:
    """Why a take's speech tokens look like the LLM looping (the same stretch said over and over), or None.
    Sampled speech never repeats a stretch of tokens exactly, let alone three times in a row."""
    t = np.asarray(tokens, np.int64)
    for period in range(1, min(LOOP_MAX_PERIOD, len(t) // LOOP_MIN_REPEATS) + 1):
        same = np.r_[False, t[period:] == t[:-period], False]
        edges = np.flatnonzero(np.diff(same.astype(np.int8)))
        for start, stop in zip(edges[::2], edges[1::2], strict=True):
            span = stop - start + period  # tokens covered by the repetition
            if span >= LOOP_MIN_TOKENS and span >= LOOP_MIN_REPEATS * period:
                return (f"the speech loops: {period} token(s) said {span / period:.0f} times "
                        f"from {start / token_rate:.1f} s")
    return None


def token_bounds(n_tokens: int, limits: tuple[int, int], n_text_tokens: int) -> str | None:
    """Why a take's length is at what the model allows for its text (``limits``: the LLM's (min_len, max_len)
    speech tokens), or None: the LLM stops at max_len only when it never found the end, and at min_len when it
    was held from ending."""
    shortest, longest = limits
    if n_tokens >= longest:
        return f"ran to the model's length limit ({n_tokens} speech tokens for {n_text_tokens} text tokens)"
    if n_tokens <= shortest:
        return f"stopped at the model's shortest length ({n_tokens} speech tokens for {n_text_tokens} text tokens)"
    return None


def _longest_run(mask: np.ndarray) -> int:
    best = run = 0
    for value in mask:
        run = run + 1 if value else 0
        best = max(best, run)
    return best


# ----------------------------------------------------------------------------- subtitles


@dataclass(frozen=True)
class Cue:
    start: float
    end: float
    text: str


def _wrap(text: str, width: int = 42) -> str:
    """Subtitle lines of at most ``width`` characters, broken at spaces (CJK text is broken anywhere)."""
    words, lines, line = text.split(), [], ""
    if len(words) <= 1:
        return "\n".join(text.strip()[i:i + width] for i in range(0, len(text.strip()), width))
    for word in words:
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return "\n".join([*lines, line])


def _stamp(seconds: float, sep: str) -> str:
    millis = round(seconds * 1000)
    h, rest = divmod(millis, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, ms = divmod(rest, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def srt(cues: list[Cue]) -> str:
    return "".join(f"{i}\n{_stamp(c.start, ',')} --> {_stamp(c.end, ',')}\n{_wrap(c.text)}\n\n"
                   for i, c in enumerate(cues, 1))


def vtt(cues: list[Cue]) -> str:
    return "WEBVTT\n\n" + "".join(f"{i}\n{_stamp(c.start, '.')} --> {_stamp(c.end, '.')}\n{_wrap(c.text)}\n\n"
                                  for i, c in enumerate(cues, 1))
