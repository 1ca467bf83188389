"""The leading-silence trim never removes a non-silent sample, whatever the chunking (synthetic speech-like takes)."""

from __future__ import annotations

import math

import pytest
import torch

from cosyvoice.engine.silence import LeadingSilenceTrim

SR = 24000
THRESHOLD = 10 ** (-54 / 20)


def _speech(seconds: float, g: torch.Generator, level: float = 0.3) -> torch.Tensor:
    """Voiced syllables: harmonics of a gliding F0 under a raised-cosine envelope, plus breath noise."""
    t = torch.arange(int(seconds * SR)) / SR
    f0 = 110 + 40 * torch.rand(1, generator=g) + 20 * torch.sin(2 * math.pi * 0.7 * t)
    phase = 2 * math.pi * torch.cumsum(f0, 0) / SR
    voiced = sum(torch.sin(k * phase) / k for k in range(1, 10))
    envelope = 0.5 * (1 - torch.cos(2 * math.pi * 3 * t))
    return level * envelope * voiced + 0.01 * level * torch.randn(t.shape, generator=g)


def _silence(seconds: float, g: torch.Generator, floor: float = 0.3 * THRESHOLD) -> torch.Tensor:
    """The model's leading near-silence: low noise that stays below the threshold."""
    return (torch.rand(int(seconds * SR), generator=g) * 2 - 1) * floor


def _push_in_chunks(trim: LeadingSilenceTrim, x: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, list]:
    out, sizes, i = [], [], 0
    while i < x.numel():
        n = int(torch.randint(1, 9000, (1,), generator=g))
        piece = trim.push(x[i:i + n], final=i + n >= x.numel())
        out.append(piece)
        sizes.append(piece.numel())
        i += n
    return torch.cat(out), sizes


def _expected(x: torch.Tensor, pre_roll: int) -> torch.Tensor:
    loud = (x.abs() >= THRESHOLD).nonzero()
    onset = int(loud[0, 0]) if loud.numel() else x.numel()
    return x[max(0, onset - pre_roll):]


@pytest.mark.parametrize("seed", range(12))
def test_trim_keeps_every_non_silent_sample_for_any_chunking(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    lead = float(torch.rand(1, generator=g)) * 1.2
    x = torch.cat((_silence(lead, g), _speech(0.8, g), _silence(0.2, g), _speech(0.5, g)))
    trim = LeadingSilenceTrim(SR, pre_roll_ms=40, threshold=THRESHOLD)
    y, _ = _push_in_chunks(trim, x, g)
    assert torch.equal(y, _expected(x, trim.pre_roll))
    assert trim.trimmed == x.numel() - y.numel()
    # every sample at or above the threshold is sent, and the output is an unchanged suffix of the take
    assert int((y.abs() >= THRESHOLD).sum()) == int((x.abs() >= THRESHOLD).sum())
    assert torch.equal(x[x.numel() - y.numel():], y)
    # the lead is gone but for the pre-roll (the envelope starts at 0, so the onset is a little into the speech)
    assert trim.trimmed >= int(lead * SR) - trim.pre_roll


def test_a_noise_burst_in_the_lead_counts_as_sound() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.cat((_silence(0.3, g), torch.tensor([0.0, 0.05, -0.04, 0.0]), _silence(0.3, g), _speech(0.3, g)))
    trim = LeadingSilenceTrim(SR, pre_roll_ms=20, threshold=THRESHOLD)
    y, _ = _push_in_chunks(trim, x, g)
    burst = int(0.3 * SR) + 1
    assert torch.equal(y, x[burst - trim.pre_roll:]) and y[trim.pre_roll] == 0.05


def test_a_low_level_onset_is_kept_from_its_first_audible_sample() -> None:
    """A fade-in rising from the silence floor through the threshold: nothing from the first sample at the
    threshold on is removed, and the quiet rise before it is kept for the pre-roll."""
    g = torch.Generator().manual_seed(1)
    rise = torch.linspace(0, 4 * THRESHOLD, int(0.5 * SR)) * torch.sign(torch.randn(int(0.5 * SR), generator=g))
    x = torch.cat((torch.zeros(int(0.4 * SR)), rise, _speech(0.3, g, level=0.01)))
    trim = LeadingSilenceTrim(SR, pre_roll_ms=40, threshold=THRESHOLD)
    y, _ = _push_in_chunks(trim, x, g)
    first_loud = int((x.abs() >= THRESHOLD).nonzero()[0, 0])
    assert int(0.4 * SR) < first_loud < int(0.9 * SR)
    assert torch.equal(y, x[first_loud - trim.pre_roll:])


def test_an_all_silent_take_ends_as_its_pre_roll_and_sends_nothing_before_the_end() -> None:
    g = torch.Generator().manual_seed(2)
    x = _silence(1.0, g)
    trim = LeadingSilenceTrim(SR, pre_roll_ms=40, threshold=THRESHOLD)
    y, sizes = _push_in_chunks(trim, x, g)
    assert all(n == 0 for n in sizes[:-1]) and sizes[-1] == trim.pre_roll
    assert torch.equal(y, x[-trim.pre_roll:]) and trim.trimmed == x.numel() - trim.pre_roll


def test_after_the_onset_chunks_pass_unchanged() -> None:
    g = torch.Generator().manual_seed(3)
    trim = LeadingSilenceTrim(SR, pre_roll_ms=40, threshold=THRESHOLD)
    lead, speech = _silence(0.5, g), _speech(0.2, g)
    assert trim.push(lead).numel() == 0 and trim.waiting
    first = trim.push(speech)
    assert not trim.waiting and torch.equal(first, _expected(torch.cat((lead, speech)), trim.pre_roll))
    later = _speech(0.2, g)
    assert trim.push(later) is later  # passed through untouched
    assert trim.push(torch.zeros(0), final=True).numel() == 0


def test_the_engine_option_trims_streamed_requests_only(tts, short_prompt_wav) -> None:
    from cosyvoice.engine import Engine
    from cosyvoice.settings import Limits

    e = tts.engine
    voice = tts.frontend.voice("You are a helpful assistant.<|endofprompt|>Hello there.", short_prompt_wav)
    inp = tts.frontend.model_input("", voice)
    tokens = torch.randint(0, e.config.flow.vocab_size, (150,), generator=torch.Generator().manual_seed(0))
    plain = Engine(e.config, e.llm, e.flow, e.hift, e.device, Limits())
    trimming = Engine(e.config, e.llm, e.flow, e.hift, e.device, Limits(), trim_leading_silence_ms=40)
    for stream in (True, False):
        a, b = list(plain.vocode(tokens, inp, stream=stream)), list(trimming.vocode(tokens, inp, stream=stream))
        x, y = torch.cat([c.pcm for c in a]), torch.cat([c.pcm for c in b])
        pre_roll = round(e.sample_rate * 0.04)
        assert torch.equal(y, _expected(x, pre_roll) if stream else x)
        assert [(c.index, c.token_end) for c in a] == [(c.index, c.token_end) for c in b]
        assert [c.sample_offset for c in b] == [sum(d.pcm.numel() for d in b[:i]) for i in range(len(b))]
    plain.close()
    trimming.close()
