"""Causal F0 predictor of the CosyVoice3 vocoder (``CausalConvRNNF0Predictor`` in the official code).

Five weight-normed convolutions with ELU, then a linear head whose absolute value is the
pitch in Hz. The first convolution looks ``LOOKAHEAD`` mel frames into the future; the
other four are causal. The pitch is integrated into a phase over the whole utterance, so
tiny errors become audible drift: the reference evaluates this network in float64, and
so do we, without changing the dtype of the stored parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from cosyvoice.config import F0PredictorConfig

LOOKAHEAD = 3  # right padding of the first (kernel 4) convolution
_CAUSAL_KERNEL = 3
_N_CAUSAL_CONVS = 4


def _weight_norm_fp64(conv: nn.Conv1d) -> torch.Tensor:
    """``g * v / ||v||`` evaluated in float64, as the reference gets after moving the module to float64."""
    params = conv.parametrizations.weight
    return torch._weight_norm(params.original1.to(torch.float64), params.original0.to(torch.float64), 0)


class CausalConvF0Predictor(nn.Module):
    """Mel ``[B, in_channels, T]`` -> F0 in Hz ``[B, T]`` (``[B, T - 3]`` when not finalised), float64."""

    def __init__(self, cfg: F0PredictorConfig) -> None:
        super().__init__()
        channels = cfg.cond_channels
        layers: list[nn.Module] = [weight_norm(nn.Conv1d(cfg.in_channels, channels, LOOKAHEAD + 1)), nn.ELU()]
        for _ in range(_N_CAUSAL_CONVS):
            layers += [weight_norm(nn.Conv1d(channels, channels, _CAUSAL_KERNEL)), nn.ELU()]
        self.condnet = nn.Sequential(*layers)  # ELUs at the odd indices keep the official key numbering
        self.classifier = nn.Linear(channels, cfg.num_class)
        self._folded: list[str] = []

    def fold_weight_norm(self) -> None:
        """Evaluate each convolution's float64 weight once, as :meth:`forward` otherwise does per call (bit-equal;
        ~7% of a one-second vocoder chunk). Kept as buffers outside the state dict, which stays the checkpoint's;
        fold again after loading other weights."""
        convs = [m for m in self.condnet if isinstance(m, nn.Conv1d)]
        self._folded = [f"weight64_{i}" for i in range(len(convs))]
        for name, conv in zip(self._folded, convs, strict=True):
            self.register_buffer(name, _weight_norm_fp64(conv), persistent=False)

    def forward(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """With ``finalize=False`` the last ``LOOKAHEAD`` frames are look-ahead context only (no output)."""
        x = mel.to(torch.float64)
        convs = [m for m in self.condnet if isinstance(m, nn.Conv1d)]
        for i, conv in enumerate(convs):
            if i > 0:
                x = F.pad(x, (_CAUSAL_KERNEL - 1, 0))
            elif finalize:
                x = F.pad(x, (0, LOOKAHEAD))  # zeros stand in for future frames (streaming: the real ones do)
            weight = getattr(self, self._folded[i]) if self._folded else _weight_norm_fp64(conv)
            x = F.elu(F.conv1d(x, weight, conv.bias.to(torch.float64)))
        head = F.linear(x.transpose(1, 2), self.classifier.weight.to(torch.float64),
                        self.classifier.bias.to(torch.float64))
        return torch.abs(head.squeeze(-1))
