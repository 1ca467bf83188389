"""Causal HiFT vocoder of CosyVoice3 (``CausalHiFTGenerator`` in the official code).

Mel ``[B, 80, T]`` -> waveform ``[B, T * 480]`` at 24 kHz:

1. F0 per mel frame (float64 predictor, :mod:`cosyvoice.hifigan.f0_predictor`), held for
   480 samples, turned into a harmonic excitation (:mod:`cosyvoice.hifigan.source`).
2. The mel goes through a look-ahead ``conv_pre`` and three upsampling stages (nearest
   upsampling + causal conv). At each stage the excitation's STFT, downsampled to the
   stage's rate, is added, and three Snake-activated residual blocks are averaged.
3. ``conv_post`` predicts log-magnitude and phase of a 16-point STFT (hop 4); the inverse
   STFT gives the waveform, clipped to ``+-audio_limit``.

Streaming (``finalize=False``): the last 3 mel frames only serve the F0 predictor's
look-ahead, the next 4 from the end only ``conv_pre``'s, and the last 480 samples (still
influenced by the missing future) are dropped. A later call on the grown mel reproduces
the emitted samples, because every random input is a fixed buffer read from sample 0.

Weight norm uses ``torch.nn.utils.parametrizations.weight_norm`` so the state dict keys are
those of ``hift.pt`` (``X.parametrizations.weight.original0`` = g, ``original1`` = v).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from cosyvoice.config import HiFTConfig
from cosyvoice.hifigan import f0_predictor as f0p
from cosyvoice.hifigan.source import NoiseSource, SourceModuleHnNSF
from cosyvoice.rng import SineGenRecipe, sinegen_rand_ini, sinegen_sine_waves

_POST_KERNEL = 7
_SNAKE_EPS = 1e-9


def rename_hift_key(key: str) -> str:
    """Map a ``hift.pt`` key to ours: drop every ``generator.`` (HiFiGAN training checkpoints, as the official
    loader does) and turn legacy ``weight_g`` / ``weight_v`` weight-norm names into the parametrization ones."""
    key = key.replace("generator.", "")
    for legacy, current in ((".weight_g", ".parametrizations.weight.original0"),
                            (".weight_v", ".parametrizations.weight.original1")):
        if key.endswith(legacy):
            return key[: -len(legacy)] + current
    return key


class CausalConv1d(nn.Conv1d):
    """Stride-1 convolution, zero-padded on the left so that output length == input length."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1) -> None:
        super().__init__(in_channels, out_channels, kernel_size, dilation=dilation)
        self.left_pad = (kernel_size - 1) * dilation

    def forward(self, x: torch.Tensor, padded: bool = False) -> torch.Tensor:
        """``padded``: ``x`` already starts with the ``left_pad`` zeros (:class:`Snake` writes them)."""
        return super().forward(x if padded else F.pad(x, (self.left_pad, 0)))


class LookAheadConv1d(nn.Conv1d):
    """Convolution seeing ``kernel_size - 1`` future frames: zero-padded on the right when the input is final,
    unpadded (so the last frames are context only and the output is shorter) while streaming."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int) -> None:
        super().__init__(in_channels, out_channels, kernel_size)
        self.look_ahead = kernel_size - 1

    def forward(self, x: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        return super().forward(F.pad(x, (0, self.look_ahead)) if finalize else x)


class CausalUpsampleConv1d(nn.Conv1d):
    """Nearest-neighbour upsampling by ``rate`` followed by a causal convolution (instead of a transposed conv)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, rate: int) -> None:
        super().__init__(in_channels, out_channels, kernel_size)
        self.rate = rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(x, scale_factor=self.rate, mode="nearest")
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))


class CausalDownsampleConv1d(nn.Conv1d):
    """Strided convolution (kernel ``2 * rate``) left-padded by ``rate - 1``: one output per ``rate`` inputs."""

    def __init__(self, in_channels: int, out_channels: int, rate: int) -> None:
        super().__init__(in_channels, out_channels, 2 * rate, stride=rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (self.stride[0] - 1, 0)))


class Snake(nn.Module):
    """``x + sin(alpha * x)^2 / alpha`` with a learned per-channel frequency ``alpha`` (linear scale)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor, left_pad: int = 0) -> torch.Tensor:
        """The activation after ``left_pad`` zeros: the next causal convolution's padding, written here instead of
        copied by ``F.pad`` (the convolution sees the same tensor; ~4% of the vocoder)."""
        alpha = self.alpha[None, :, None]
        if torch.is_grad_enabled() or torch.jit.is_tracing():  # ``out=`` is neither differentiable nor traced
            wave = torch.sin(x * alpha)
            return F.pad(wave * wave * (1.0 / (alpha + _SNAKE_EPS)) + x, (left_pad, 0))
        out = x.new_empty(*x.shape[:-1], left_pad + x.shape[-1])
        out[..., :left_pad] = 0
        # in place: the same operations, without four more activation-sized tensors
        wave = torch.mul(x, alpha, out=out[..., left_pad:]).sin_()
        wave.mul_(wave).mul_(1.0 / (alpha + _SNAKE_EPS)).add_(x)
        return out


class ResBlock(nn.Module):
    """Per dilation: Snake -> dilated causal conv -> Snake -> causal conv, added back to the input."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(weight_norm(CausalConv1d(channels, channels, kernel_size, d)) for d in dilations)
        self.convs2 = nn.ModuleList(weight_norm(CausalConv1d(channels, channels, kernel_size)) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layers = zip(self.activations1, self.convs1, self.activations2, self.convs2, strict=True)
        for act1, conv1, act2, conv2 in layers:
            x = conv2(act2(conv1(act1(x, conv1.left_pad), padded=True), conv2.left_pad), padded=True) + x
        return x


class CausalHiFTGenerator(nn.Module):
    """The vocoder. ``sinegen_recipe`` picks the replayed noise buffers (default: derived from ``cfg`` with the
    released flow dims); :meth:`set_sinegen_noise` injects others."""

    def __init__(self, cfg: HiFTConfig, sinegen_recipe: SineGenRecipe | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.upsample_scale = cfg.upsample_scale
        self.n_fft = cfg.istft_n_fft
        self.hop = cfg.istft_hop_len
        self.num_kernels = len(cfg.resblock_kernel_sizes)
        base = cfg.base_channels

        self.m_source = SourceModuleHnNSF(cfg.sampling_rate, self.upsample_scale, cfg.nb_harmonics, cfg.nsf_alpha,
                                          cfg.nsf_sigma, cfg.nsf_voiced_threshold)
        self.conv_pre = weight_norm(LookAheadConv1d(cfg.in_channels, base, cfg.conv_pre_look_right + 1))
        self.ups = nn.ModuleList(
            weight_norm(CausalUpsampleConv1d(base // 2**i, base // 2 ** (i + 1), k, u))
            for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes, strict=True)))

        # The excitation's STFT enters every stage; stage i runs at prod(upsample_rates[:i + 1]) STFT frames per
        # mel frame, so it is downsampled by the product of the remaining rates.
        spec_channels = self.n_fft + 2
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        sources = zip(range(len(cfg.upsample_rates)), cfg.source_resblock_kernel_sizes,
                      cfg.source_resblock_dilation_sizes, strict=False)  # the reference's zip truncates too
        for i, k, d in sources:
            ch = base // 2 ** (i + 1)
            rate = math.prod(cfg.upsample_rates[i + 1:])
            self.source_downs.append(CausalConv1d(spec_channels, ch, 1) if rate == 1
                                     else CausalDownsampleConv1d(spec_channels, ch, rate))
            self.source_resblocks.append(ResBlock(ch, k, d))

        self.resblocks = nn.ModuleList(
            ResBlock(base // 2 ** (i + 1), k, d)
            for i in range(len(self.ups))
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes, strict=False))
        self.conv_post = weight_norm(CausalConv1d(base // 2 ** len(self.ups), spec_channels, _POST_KERNEL))
        self.f0_predictor = f0p.CausalConvF0Predictor(cfg.f0_predictor)
        # periodic Hann computed in float64 then rounded, which equals scipy's get_window('hann', n, fftbins=True)
        self._window = torch.hann_window(self.n_fft, periodic=True, dtype=torch.float64).to(torch.float32)

        # an accelerated replacement of decode_window (mel, source) -> wav; None runs the modules here
        self.runner: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        recipe = sinegen_recipe or SineGenRecipe.from_hift_config(cfg)
        self.set_sinegen_noise(sinegen_rand_ini(recipe), functools.partial(sinegen_sine_waves, recipe))

    def set_sinegen_noise(self, rand_ini: torch.Tensor, sine_waves: torch.Tensor | NoiseSource) -> None:
        """Replace SineGen2's fixed buffers: ``rand_ini [1, H]``, ``sine_waves [1, N, H]`` or ``n -> prefix``."""
        self.m_source.l_sin_gen.set_noise(rand_ini, sine_waves)

    def fold_weight_norm(self) -> None:
        """Bake ``g * v / ||v||`` into plain weights (same output, less work per call). The state dict then has
        ``X.weight`` keys, so load checkpoints first. The F0 predictor keeps its parametrization (its weights are
        evaluated in float64) and holds those float64 weights beside it."""
        for name, module in self.named_modules():
            if not name.startswith("f0_predictor") and parametrize.is_parametrized(module, "weight"):
                parametrize.remove_parametrizations(module, "weight")
        self.f0_predictor.fold_weight_norm()

    def min_frames(self, finalize: bool) -> int:
        """Shortest mel that :meth:`inference` accepts (look-ahead frames produce no output when streaming)."""
        return 1 if finalize else f0p.LOOKAHEAD + self.cfg.conv_pre_look_right + 1

    def source_stft(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Real and imaginary STFT of the excitation ``[B, N]`` -> ``[B, n_fft/2 + 1, N/hop + 1]`` each."""
        spec = torch.stft(source, self.n_fft, self.hop, self.n_fft, window=self._window.to(source),
                          return_complex=True)
        spec = torch.view_as_real(spec)
        return spec[..., 0], spec[..., 1]

    def istft(self, real: torch.Tensor, imag: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`source_stft` (``[B, n_fft/2 + 1, F]`` each -> ``[B, hop * (F - 1)]``)."""
        return torch.istft(torch.complex(real, imag), self.n_fft, self.hop, self.n_fft,
                           window=self._window.to(real))

    def decode(self, mel: torch.Tensor, source: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """Mel ``[B, 80, T]`` + excitation ``[B, 1, N]`` -> waveform ``[B, samples]``.

        ``runner`` (an accelerated backend, :mod:`cosyvoice.backends`) replaces :meth:`decode_window`, the
        part without branches on ``finalize``.
        """
        if finalize:
            mel = F.pad(mel, (0, self.conv_pre.look_ahead))  # zeros stand in for conv_pre's future frames
        wav = (self.runner or self.decode_window)(mel, source)
        if not finalize:
            wav = wav[:, : wav.shape[-1] - self.upsample_scale]  # the last frame still depends on future frames
        return wav

    def decode_window(self, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """Mel ``[B, 80, T + look-ahead]`` (conv_pre's future frames included) + excitation ``[B, 1, N]``
        -> the clipped waveform of the first T frames ``[B, T * upsample_scale]``."""
        s_re, s_im = self.source_stft(source.squeeze(1))
        x = self.conv_pre(mel, finalize=False)
        # STFT frames beyond conv_pre's output belong to its look-ahead frames (streaming): drop them
        keep = x.shape[-1] * math.prod(self.cfg.upsample_rates) + 1
        s_spec = torch.cat([s_re[..., :keep], s_im[..., :keep]], dim=1)

        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, self.cfg.lrelu_slope))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")  # one extra frame: STFT frames = samples / hop + 1
            x = x + self.source_resblocks[i](self.source_downs[i](s_spec))
            blocks = self.resblocks[i * self.num_kernels:(i + 1) * self.num_kernels]
            xs = blocks[0](x)
            for block in blocks[1:]:
                xs = xs + block(x)
            x = xs / self.num_kernels

        x = self.conv_post(F.leaky_relu(x))  # reference quirk: torch's default slope 0.01 here, not lrelu_slope
        n_bins = self.n_fft // 2 + 1
        magnitude = torch.clip(torch.exp(x[:, :n_bins]), max=1e2)
        phase = torch.sin(x[:, n_bins:])  # reference quirk: sin() of the predicted phase
        wav = self.istft(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        return torch.clamp(wav, -self.cfg.audio_limit, self.cfg.audio_limit)

    @torch.inference_mode()
    def inference(self, speech_feat: torch.Tensor, finalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Mel ``[B, 80, T]`` -> ``(speech [B, N], source [B, 1, N_source])``.

        ``finalize=True``: N = T * 480. ``finalize=False``: the last 3 + ``conv_pre_look_right`` frames are look-ahead
        and one more frame's samples are withheld, so N = (T - 8) * 480 for the released config.
        """
        if speech_feat.dim() != 3 or speech_feat.shape[1] != self.cfg.in_channels:
            raise RuntimeError(
                f"vocoder input must be a mel of shape [B, {self.cfg.in_channels}, T], got {list(speech_feat.shape)}")
        if speech_feat.shape[2] < self.min_frames(finalize):
            raise RuntimeError(
                f"vocoder needs at least {self.min_frames(finalize)} mel frames with finalize={finalize}, "
                f"got {speech_feat.shape[2]}")
        f0 = self.f0_predictor(speech_feat, finalize=finalize).to(speech_feat)
        f0_per_sample = F.interpolate(f0[:, None], scale_factor=self.upsample_scale, mode="nearest").transpose(1, 2)
        source = self.m_source(f0_per_sample)[0].transpose(1, 2)
        mel = speech_feat if finalize else speech_feat[:, :, : speech_feat.shape[2] - f0p.LOOKAHEAD]
        return self.decode(mel, source, finalize), source
