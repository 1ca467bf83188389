"""HiFTStream: the reference's streamed vocoder samples from a bounded window, on long utterances."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cosyvoice.bundle import validate_model_dir
from cosyvoice.hifigan import CausalHiFTGenerator, HiFTStream
from cosyvoice.hifigan.f0_predictor import LOOKAHEAD
from cosyvoice.tools.parity import hift as hift_parity
from cosyvoice.tools.parity.common import Golden

CHUNKS = (54, 100, 200, 200, 200, 200, 150)  # the engine's mel chunk sizes (hops of 27, 50, 100+ tokens)


def _mel(frames: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, 80, frames, generator=gen) * 1.5 - 5.0


def _reference(vocoder: CausalHiFTGenerator, mel: torch.Tensor) -> torch.Tensor:
    """What the engine emitted before HiFTStream: the whole growing mel per chunk, samples after the last end."""
    pieces, offset, end = [], 0, 0
    for i, n in enumerate(CHUNKS):
        end += n
        speech, _ = vocoder.inference(mel[:, :, :end], finalize=i == len(CHUNKS) - 1)
        pieces.append(speech[:, offset:])
        offset = speech.shape[1]
    return torch.cat(pieces, dim=1)


def _streamed(vocoder: CausalHiFTGenerator, mel: torch.Tensor) -> torch.Tensor:
    stream, pieces, end = HiFTStream(vocoder), [], 0
    for i, n in enumerate(CHUNKS):
        pieces.append(stream.inference(mel[:, :, end:end + n], finalize=i == len(CHUNKS) - 1))
        end += n
    return torch.cat(pieces, dim=1)


@pytest.fixture(scope="module")
def tiny_vocoder(tiny_bundle_dir: Path) -> CausalHiFTGenerator:
    return validate_model_dir(tiny_bundle_dir).load_hift(torch.device("cpu"))


@pytest.mark.parametrize("seed", [0, 1])
def test_stream_equals_full_recompute_tiny(tiny_vocoder: CausalHiFTGenerator, seed: int) -> None:
    mel = _mel(sum(CHUNKS), seed)
    ref, ours = _reference(tiny_vocoder, mel), _streamed(tiny_vocoder, mel)
    assert ours.shape == ref.shape == (1, sum(CHUNKS) * tiny_vocoder.upsample_scale)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def test_stream_equals_full_recompute_golden(golden: Golden) -> None:
    vocoder, _ = hift_parity.build_vocoder(golden)
    mel = _mel(sum(CHUNKS), 2)
    ref, ours = _reference(vocoder, mel), _streamed(vocoder, mel)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("frames", [600, 2400])
def test_window_is_bounded(tiny_vocoder: CausalHiFTGenerator, monkeypatch: pytest.MonkeyPatch, frames: int) -> None:
    widths: list[int] = []
    decode = tiny_vocoder.decode

    def recording(mel: torch.Tensor, source: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        widths.append(mel.shape[2])
        return decode(mel, source, finalize)

    monkeypatch.setattr(tiny_vocoder, "decode", recording)
    stream, mel, chunk = HiFTStream(tiny_vocoder), _mel(frames, 3), 200
    for end in range(chunk, frames + 1, chunk):
        stream.inference(mel[:, :, end - chunk:end], finalize=end == frames)
    # the window starts at the left context before the first new sample or min_window before the previous end
    bound = max(stream.min_window + LOOKAHEAD, stream.context + LOOKAHEAD + tiny_vocoder.cfg.conv_pre_look_right + 1)
    bound += chunk
    assert len(widths) == frames // chunk and max(widths) <= bound
    assert bound < 600  # independent of the utterance length


def test_stream_rejects_misuse(tiny_vocoder: CausalHiFTGenerator) -> None:
    stream = HiFTStream(tiny_vocoder)
    with pytest.raises(RuntimeError, match="at least"):
        stream.inference(_mel(5, 0), finalize=False)
    stream.inference(_mel(20, 0), finalize=True)
    with pytest.raises(RuntimeError, match="finalised"):
        stream.inference(_mel(20, 0), finalize=True)
