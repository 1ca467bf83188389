"""Conditional flow matching: integrate the DiT's velocity field from fixed noise to a mel.

Inference only. The ODE dx/dt = v(x, t) runs from t=0 (noise) to t=1 (mel) with
explicit Euler steps on a cosine-warped time grid (small steps near t=0, large near 1).
Every step evaluates the estimator once on a batch of two copies of x, one with the
conditions and one with them zeroed, and extrapolates away from the unconditional
velocity (classifier-free guidance): v = (1 + w) v_cond - w v_uncond.

The start noise is not sampled: the reference slices a fixed buffer (``cosyvoice.rng``),
so the same inputs always give the same mel and a streaming call that extends an
utterance sees the same noise at every frame it shares with an earlier call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from cosyvoice.config import CFMConfig, DiTConfig
from cosyvoice.errors import ResourceLimitError
from cosyvoice.flow.dit import DiT
from cosyvoice.rng import cfm_noise

# velocity(x_in [2B, C, N], t_in [2B], step index) -> [2B, C, N]; rows B.. are the unconditional batch
Velocity = Callable[[Tensor, Tensor, int], Tensor]


def time_grid(n_steps: int, scheduler: str, device: torch.device, dtype: torch.dtype) -> Tensor:
    """``n_steps + 1`` times from 0 to 1; ``cosine`` warps them as 1 - cos(pi/2 * u)."""
    grid = torch.linspace(0, 1, n_steps + 1, device=device, dtype=dtype)
    if scheduler == "cosine":
        grid = 1 - torch.cos(grid * 0.5 * torch.pi)
    return grid


def guidance_batch(mu: Tensor, spks: Tensor, cond: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Stack the conditions over zeros: rows 0..B-1 conditioned, rows B..2B-1 unconditional."""
    return (torch.cat((mu, torch.zeros_like(mu))), torch.cat((spks, torch.zeros_like(spks))),
            torch.cat((cond, torch.zeros_like(cond))))


class Stopped(Exception):
    """The caller's ``stop()`` said so before an Euler step: nobody wants this mel any more."""


def solve_euler_cfg(velocity: Velocity, z: Tensor, t_grid: Tensor, cfg_rate: float,
                    stop: Callable[[], bool] | None = None) -> Tensor:
    """Euler-integrate from ``z`` over ``t_grid`` with classifier-free guidance of strength ``cfg_rate``;
    ``stop`` is polled before each step (True raises :class:`Stopped`)."""
    x = z
    t = t_grid[0]
    dt = t_grid[1] - t_grid[0]
    n_steps = t_grid.shape[0] - 1
    for step in range(n_steps):
        if stop is not None and stop():
            raise Stopped
        v = velocity(torch.cat((x, x)), t.expand(2 * x.shape[0]), step)
        v_cond, v_uncond = v.chunk(2)
        x = x + dt * ((1.0 + cfg_rate) * v_cond - cfg_rate * v_uncond)
        # The reference advances t by dt and derives the next dt from that running t, not from the grid.
        t = t + dt
        if step + 1 < n_steps:
            dt = t_grid[step + 2] - t
    return x


class CausalConditionalCFM(nn.Module):
    """The flow decoder: a :class:`DiT` estimator (``decoder.estimator.*`` in flow.pt) and the fixed start noise."""

    def __init__(self, dit: DiTConfig, cfm: CFMConfig, noise: Tensor | None = None) -> None:
        super().__init__()
        self.estimator = DiT(dit)
        self.cfg_rate = cfm.inference_cfg_rate
        self.n_timesteps = cfm.n_timesteps
        self.t_scheduler = cfm.t_scheduler
        self.mel_dim = dit.mel_dim
        noise = cfm_noise() if noise is None else noise
        # not in flow.pt; on the given noise's device, so a module built on the meta device (weights.load_module)
        # still holds its values
        self.register_buffer("noise", torch.empty(1, dit.mel_dim, 0, device=noise.device), persistent=False)
        self.set_noise(noise)

    def set_noise(self, noise: Tensor) -> None:
        """Replace the start-noise buffer [1, mel_dim, L]; frame i of every utterance starts from column i."""
        if noise.ndim != 3 or noise.shape[0] != 1 or noise.shape[1] != self.mel_dim:
            raise RuntimeError(f"CFM noise must be [1, {self.mel_dim}, L], got {list(noise.shape)}")
        self.noise = noise.to(device=self.noise.device, dtype=torch.float32)

    def start_noise(self, start: int, stop: int, like: Tensor) -> Tensor:
        """Noise columns ``start .. stop-1`` for a batch shaped like ``like`` [B, C, *] (every row the same)."""
        if stop > self.noise.shape[2]:
            raise ResourceLimitError(
                f"the flow's fixed noise covers {self.noise.shape[2]} mel frames; this utterance needs {stop}: "
                f"synthesise shorter segments")
        z = self.noise[:, :, start:stop].to(device=like.device, dtype=like.dtype)
        return z.expand(like.shape[0], -1, -1)

    def time_grid(self, like: Tensor, n_steps: int | None = None) -> Tensor:
        """The grid of ``n_steps`` Euler steps (None: the model's ``n_timesteps``, the yaml's)."""
        return time_grid(n_steps or self.n_timesteps, self.t_scheduler, like.device, like.dtype)

    def forward(self, mu: Tensor, spks: Tensor, cond: Tensor, streaming: bool = False,
                n_steps: int | None = None, stop: Callable[[], bool] | None = None) -> Tensor:
        """Mel [B, mel_dim, N] for token features ``mu`` [B, C, N], speaker ``spks`` [B, S], prompt mel ``cond``;
        ``n_steps`` Euler steps (None: the model's): fewer are faster and coarser (F5-TTS's speed/quality knob);
        ``stop``: see :func:`solve_euler_cfg`."""
        z = self.start_noise(0, mu.shape[2], mu)
        mu_in, spks_in, cond_in = guidance_batch(mu, spks, cond)

        def velocity(x_in: Tensor, t_in: Tensor, step: int) -> Tensor:
            return self.estimator(x_in, mu_in, t_in, spks_in, cond_in, streaming=streaming)

        return solve_euler_cfg(velocity, z, self.time_grid(mu, n_steps), self.cfg_rate, stop)
