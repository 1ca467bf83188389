"""Incremental HiFT for one streamed utterance: each call vocodes a bounded window, not the whole mel.

The reference re-runs the vocoder over the whole accumulated mel for every chunk and emits the samples
after the previous chunk's end, so its cost grows quadratically with the utterance. The vocoder is
causal apart from known look-aheads at the *end* of its input (F0 predictor, ``conv_pre``, the withheld
last frame, the ISTFT overlap), which a window ending where the whole mel ends sees identically. Only
the window's *start* differs, and its effect fades after a receptive field computed from the layers
(:func:`decode_left_context`). Two things are global and are carried explicitly: SineGen2's phase (a
cumulative sum from frame 0) and the noise buffer, indexed by absolute sample.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyvoice.hifigan import f0_predictor as f0p
from cosyvoice.hifigan.generator import CausalHiFTGenerator, ResBlock

SAFETY_FRAMES = 2  # extra mel frames of left context beyond the computed receptive field
ONEDNN_MIN_NUMEL = 20480  # torch's CPU heuristic: a conv1d input with more elements than this runs in oneDNN


def _resblock_reach(block: ResBlock) -> int:
    """Past frames a residual block reads: ``(kernel - 1) * dilation`` per causal conv, chained."""
    return sum((conv.kernel_size[0] - 1) * conv.dilation[0] for conv in (*block.convs1, *block.convs2))


def f0_left_context(hift: CausalHiFTGenerator) -> int:
    """Mel frames before an F0 frame that it depends on: the predictor's causal convs (after the first,
    look-ahead one) each read ``(kernel - 1) * dilation`` past frames; 4 x 2 = 8 for CosyVoice3."""
    convs = [m for m in hift.f0_predictor.condnet if isinstance(m, nn.Conv1d)]
    return sum((conv.kernel_size[0] - 1) * conv.dilation[0] for conv in convs[1:])


def decode_left_context(hift: CausalHiFTGenerator) -> int:
    """Mel frames of left context after which :meth:`CausalHiFTGenerator.decode` of a window equals the
    full computation (given the exact mel and excitation from the window start on).

    Derivation: track ``g``, the number of leading positions of each intermediate signal that may differ
    because the window starts late (zero/reflect padding, or reading before the start). A causal layer
    reading ``r`` past positions turns ``g`` into ``g + r`` (also from ``g = 0``: its padding is wrong);
    nearest upsampling by ``u`` into ``g * u``; a stride-``r`` conv reading ``r - 1`` past inputs into
    ``ceil((g + r - 1) / r)``. Starting values: ``conv_pre`` reads only present and future frames, so
    ``g = 0`` at mel rate; the centred source STFT's first ``ceil(n_fft / 2 / hop)`` frames read reflect
    padding. Per stage ``i``: upsample (rate ``u_i``, kernel ``k_i``: ``g * u_i + k_i - 1``), on the last
    stage the 1-frame reflect pad (``+1``), then the source branch (downsample, ``+`` its ResBlock's
    reach) is added (``max``), then the averaged ResBlocks (``+`` the largest reach,
    ``sum((k - 1) * (d + 1))`` over its dilations). ``conv_post`` adds ``kernel - 1``; the ISTFT's sample
    ``n`` mixes frames down to ``(n - n_fft / 2 + 1) / hop``, so ``hop * g + n_fft`` samples suffice.
    For the released config (rates 8/5/3, kernels 16/11/7, ResBlocks up to kernel 11 with dilations
    1/3/5) this is 3433 STFT frames = 13748 samples, 29 mel frames, plus :data:`SAFETY_FRAMES`.
    """
    stft_edge = -(-(hift.n_fft // 2) // hift.hop)
    g = 0
    per_stage = len(hift.resblocks) // len(hift.ups)
    for i, up in enumerate(hift.ups):
        g = g * up.rate + up.kernel_size[0] - 1
        if i == len(hift.ups) - 1:
            g += 1
        rate = hift.source_downs[i].stride[0]
        source = -(-(stft_edge + rate - 1) // rate) + _resblock_reach(hift.source_resblocks[i])
        g = max(g, source) + max(_resblock_reach(b) for b in hift.resblocks[i * per_stage:(i + 1) * per_stage])
    g += hift.conv_post.kernel_size[0] - 1
    samples = hift.hop * g + hift.n_fft
    return -(-samples // hift.upsample_scale) + SAFETY_FRAMES


def min_window_frames(hift: CausalHiFTGenerator) -> int:
    """Fewest mel frames for which every float32 conv of :meth:`CausalHiFTGenerator.decode` runs in oneDNN.

    torch picks a CPU conv1d's kernel by input size (oneDNN above :data:`ONEDNN_MIN_NUMEL` elements,
    im2col + GEMM below), and the two round differently; the vocoder amplifies such 1-ulp differences
    to ~1e-5 (released weights) or ~1e-3 (random tiny weights). The full computation over a long
    utterance uses oneDNN, so a window must be at least this wide unless it is the whole utterance.
    Conv inputs per mel frame: ``conv_pre`` in_channels; stage ``i`` channels x its frames per mel frame;
    the source branch and ``conv_post`` at the STFT rate.
    """
    rate, per_frame = 1, [hift.conv_pre.in_channels]
    for i, up in enumerate(hift.ups):
        rate *= up.rate
        per_frame += [up.in_channels * rate, up.out_channels * rate]
        per_frame.append(hift.source_downs[i].in_channels * hift.upsample_scale // hift.hop)
    per_frame.append(hift.conv_post.in_channels * hift.upsample_scale // hift.hop)
    return max(ONEDNN_MIN_NUMEL // n + 1 for n in per_frame)


class HiFTStream:
    """The samples the reference emits per streamed chunk, computed from a bounded mel window.

    Call :meth:`inference` with each chunk's *new* mel frames (``finalize=False``, then one
    ``finalize=True``); it returns what ``hift.inference(all frames so far, finalize)[0]`` holds after
    the samples already returned. Per call the vocoder sees at most ``f0_left_context +
    decode_left_context`` frames before the first new sample (at least :func:`min_window_frames`) plus
    the new frames, so the cost no longer grows with the utterance. The phase carry reproduces the
    reference's float32 cumsum bit for bit on CPU (torch accumulates it in float64 there); with the
    oneDNN minimum width the CPU output equals the full computation exactly in our tests.
    Not thread-safe: one stream per utterance.
    """

    def __init__(self, hift: CausalHiFTGenerator) -> None:
        self.hift = hift
        self.context = decode_left_context(hift)
        self.f0_context = f0_left_context(hift)
        self.min_window = min_window_frames(hift)
        self._mel: Tensor | None = None  # the retained tail of the utterance's mel
        self._mel_start = 0  # absolute index of self._mel's first frame
        self._emitted = 0  # samples returned so far
        self._phase_frame = 0  # absolute frame where the next window's decode starts
        self._phase_sum: Tensor | None = None  # float64 sum of per-frame cycles over [0, _phase_frame)
        self._finalized = False

    @property
    def frames(self) -> int:
        """Mel frames received so far."""
        return 0 if self._mel is None else self._mel_start + self._mel.shape[2]

    @torch.inference_mode()
    def inference(self, mel: Tensor, finalize: bool) -> Tensor:
        """New mel frames ``[B, 80, n]`` -> the newly final waveform samples ``[B, N]``."""
        hift = self.hift
        if self._finalized:
            raise RuntimeError("this HiFTStream was finalised; start a new one for a new utterance")
        if mel.dim() != 3 or mel.shape[1] != hift.cfg.in_channels:
            raise RuntimeError(
                f"vocoder input must be a mel of shape [B, {hift.cfg.in_channels}, T], got {list(mel.shape)}")
        self._mel = mel if self._mel is None else torch.cat([self._mel, mel], dim=2)
        total = self.frames
        if total < hift.min_frames(finalize):
            raise RuntimeError(
                f"vocoder needs at least {hift.min_frames(finalize)} mel frames with finalize={finalize}, got {total}")
        scale = hift.upsample_scale
        start = self._phase_frame  # decode window start; F0 needs f0_context more frames before it
        window = self._mel[:, :, max(0, start - self.f0_context) - self._mel_start:]
        f0 = hift.f0_predictor(window, finalize=finalize).to(window)
        f0 = f0[:, f0.shape[1] - (total - start - (0 if finalize else f0p.LOOKAHEAD)):]
        f0_per_sample = F.interpolate(f0[:, None], scale_factor=scale, mode="nearest").transpose(1, 2)
        source, phase_sums = hift.m_source(f0_per_sample, start, self._phase_sum)
        source = source.transpose(1, 2)
        mel_end = window.shape[2] - (0 if finalize else f0p.LOOKAHEAD)
        wav = hift.decode(window[:, :, mel_end - f0.shape[1]:mel_end], source, finalize)
        out = wav[:, self._emitted - start * scale:]

        self._emitted += out.shape[1]
        self._finalized = finalize
        # The next window starts where both its left context and its oneDNN minimum width are met for any
        # next call (its vocoder input ends no earlier than this one's, at frame start + f0.shape[1]).
        needed = min(self._emitted // scale - self.context, start + f0.shape[1] - self.min_window)
        self._phase_frame = max(start, needed)
        self._phase_sum = phase_sums[:, self._phase_frame - start]
        keep_from = max(0, self._phase_frame - self.f0_context)
        self._mel, self._mel_start = self._mel[:, :, keep_from - self._mel_start:], keep_from
        return out
