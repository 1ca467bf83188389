"""Harmonic excitation of the vocoder: causal SineGen2 and the neural-source-filter merge.

The source is a sum of ``nb_harmonics + 1`` sines at multiples of F0 plus noise. For
streaming, the causal variant takes its randomness from two fixed buffers (initial phases
``rand_ini`` and a uniform noise buffer read from sample 0 on every call), so a longer call
reproduces the samples of a shorter one. The phase is accumulated per mel frame in
float32 and reaches 1e4-1e5 rad on long inputs, so the exact order of the float32 ops below
is what makes us match the reference to ~1e-5 instead of ~1e-2 (golden README section 9).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice.errors import ResourceLimitError

NoiseSource = Callable[[int], torch.Tensor]
"""``n_samples -> [1, n_samples, n_harmonics]``: the first ``n_samples`` of the fixed uniform noise."""


def _prefix_of(buffer: torch.Tensor) -> NoiseSource:
    def take(n_samples: int) -> torch.Tensor:
        if n_samples > buffer.shape[1]:
            raise ResourceLimitError(
                f"the injected SineGen noise buffer has {buffer.shape[1]} samples, {n_samples} are needed")
        return buffer[:, :n_samples]

    return take


class CausalSineGen(nn.Module):
    """F0 ``[B, N, 1]`` (Hz, per sample, constant within a frame) -> harmonics ``[B, N, nb_harmonics + 1]``."""

    def __init__(self, sampling_rate: int, upsample_scale: int, nb_harmonics: int, sine_amp: float,
                 noise_std: float, voiced_threshold: float) -> None:
        super().__init__()
        self.sampling_rate = sampling_rate
        self.upsample_scale = upsample_scale
        self.n_harmonics = nb_harmonics + 1
        self.sine_amp = sine_amp
        self.noise_std = noise_std
        self.voiced_threshold = voiced_threshold
        self.rand_ini: torch.Tensor | None = None
        self._noise: NoiseSource | None = None

    def set_noise(self, rand_ini: torch.Tensor, sine_waves: torch.Tensor | NoiseSource) -> None:
        """Install the fixed buffers: ``rand_ini [1, H]`` and the uniform noise (a tensor or a prefix function)."""
        if tuple(rand_ini.shape) != (1, self.n_harmonics):
            raise RuntimeError(f"rand_ini must have shape [1, {self.n_harmonics}], got {list(rand_ini.shape)}")
        if isinstance(sine_waves, torch.Tensor):
            if sine_waves.dim() != 3 or sine_waves.shape[0] != 1 or sine_waves.shape[2] != self.n_harmonics:
                raise RuntimeError(
                    f"sine_waves must have shape [1, N, {self.n_harmonics}], got {list(sine_waves.shape)}")
            sine_waves = _prefix_of(sine_waves)
        self.rand_ini = rand_ini
        self._noise = sine_waves

    def forward(self, f0: torch.Tensor, first_frame: int = 0,
                phase_carry: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Harmonics + noise ``[B, N, H]`` for per-sample F0 ``[B, N, 1]``, and the running phase sums.

        ``first_frame``/``phase_carry`` let a stream continue an utterance: the F0 starts at mel frame
        ``first_frame`` and ``phase_carry [B, H]`` (float64) is the sum of per-frame cycles before it. The
        second output ``[B, frames + 1, H]`` holds those sums at every frame boundary of this call (float64).
        The reference accumulates in a float32 ``cumsum``, which torch computes in float64 on the CPU, so
        a float64 sum rounded to float32 gives the same phases bit for bit there.
        """
        if self.rand_ini is None or self._noise is None:
            raise RuntimeError("CausalSineGen has no noise buffers: call set_noise() first")
        harmonic_numbers = torch.arange(1, self.n_harmonics + 1, dtype=f0.dtype, device=f0.device)
        cycles = (f0 * harmonic_numbers / self.sampling_rate) % 1  # cycles per sample, integer part dropped
        if first_frame == 0:
            cycles[:, 0, :] = cycles[:, 0, :] + self.rand_ini.to(cycles)  # initial phase, at the first sample

        # Integrate per frame (linear down-sampling of a per-frame constant), then hold each frame's
        # phase for all of its samples: the reference's causal variant upsamples with 'nearest'.
        per_frame = F.interpolate(cycles.transpose(1, 2), scale_factor=1 / self.upsample_scale,
                                  mode="linear").transpose(1, 2)
        if phase_carry is None:
            phase_carry = per_frame.new_zeros(per_frame.shape[0], per_frame.shape[2], dtype=torch.float64)
        sums = torch.cat([phase_carry[:, None], per_frame.double()], dim=1).cumsum(dim=1)
        phase = sums[:, 1:].to(per_frame.dtype) * 2 * math.pi
        phase = F.interpolate(phase.transpose(1, 2) * self.upsample_scale, scale_factor=self.upsample_scale,
                              mode="nearest").transpose(1, 2)
        sines = torch.sin(phase) * self.sine_amp

        voiced = (f0 > self.voiced_threshold).to(f0.dtype)
        noise_amp = voiced * self.noise_std + (1 - voiced) * self.sine_amp / 3
        first = first_frame * self.upsample_scale  # the noise buffer is indexed from the utterance's sample 0
        noise = noise_amp * self._noise(first + f0.shape[1])[:, first:].to(sines)
        return sines * voiced + noise, sums


class SourceModuleHnNSF(nn.Module):
    """Harmonics merged into one excitation channel: ``tanh(l_linear(sines))``, ``[B, N, 1]``."""

    def __init__(self, sampling_rate: int, upsample_scale: int, nb_harmonics: int, sine_amp: float,
                 noise_std: float, voiced_threshold: float) -> None:
        super().__init__()
        self.l_sin_gen = CausalSineGen(sampling_rate, upsample_scale, nb_harmonics, sine_amp, noise_std,
                                       voiced_threshold)
        self.l_linear = nn.Linear(nb_harmonics + 1, 1)

    def forward(self, f0: torch.Tensor, first_frame: int = 0,
                phase_carry: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Excitation ``[B, N, 1]`` and the sine generator's running phase sums (see :class:`CausalSineGen`)."""
        harmonics, sums = self.l_sin_gen(f0, first_frame, phase_carry)
        return torch.tanh(self.l_linear(harmonics)), sums
