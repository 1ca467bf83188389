"""Repetition-aware sampling (VALL-E 2) of speech tokens, as the official ``ras_sampling``.

Pure functions of (scores, decoded history, generator): no global RNG, no mutation of the
caller's scores, so concurrent requests with their own ``torch.Generator`` are reproducible.
Draws use ``torch.multinomial`` on the generator's device (the scores are moved there).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from cosyvoice.config import SamplingConfig


def nucleus_candidates(scores: torch.Tensor, top_p: float, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The nucleus the official sampler draws from: (token ids [n], their probabilities [n]).

    softmax, stable sort by descending probability, then keep the next token while the running
    sum of the kept probabilities is below ``top_p`` and fewer than ``top_k`` are kept: the token
    that crosses ``top_p`` is included. Probabilities are not renormalised (multinomial does not
    need it).
    """
    probs, ids = scores.softmax(dim=0).sort(descending=True, stable=True)
    head = probs[:top_k].detach().float().cpu().numpy()
    # the reference adds float32 scalars one at a time; numpy's float32 cumsum does the same
    # (torch.cumsum on CPU would accumulate in double), and the comparison happens in float32
    before = np.concatenate(([np.float32(0.0)], np.cumsum(head[:-1], dtype=np.float32)))
    n = int(np.count_nonzero(before < np.float32(top_p)))
    return ids[:n], probs[:n]


def ras_sample(scores: torch.Tensor, decoded: Sequence[int], generator: torch.Generator,
               cfg: SamplingConfig) -> int:
    """Draw one token from log-probs ``scores`` [V] given the tokens ``decoded`` so far.

    First a nucleus draw; if that token already occurs at least ``win_size * tau_r`` times among
    the last ``win_size`` decoded tokens, it is banned and the token is drawn from the softmax over
    all remaining tokens instead, which breaks repetition loops.
    """
    scores = scores.to(generator.device)
    ids, probs = nucleus_candidates(scores, cfg.top_p, cfg.top_k)
    token = int(ids[torch.multinomial(probs, 1, replacement=True, generator=generator)].item())
    if list(decoded[-cfg.win_size:]).count(token) >= cfg.win_size * cfg.tau_r:
        banned = scores.clone()
        banned[token] = -float("inf")
        token = int(torch.multinomial(banned.softmax(dim=0), 1, replacement=True, generator=generator).item())
    return token
