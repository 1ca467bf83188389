"""Audible first sound: trim the model's leading silence to a short pre-roll before the first audio is sent.

CosyVoice3 often starts an utterance with a few hundred milliseconds of near-silence, so a client hears the first
sound long after the first packet arrives. :class:`LeadingSilenceTrim` holds back leading samples until the first
audible one and then sends it with only ``pre_roll_ms`` of what came before (so the onset keeps its natural
attack). The rule, whatever the chunking: the output is ``x[max(0, onset - pre_roll):]`` where ``onset`` is the
index of the first sample with ``|x| >= threshold`` (the end of the take if there is none), so no sample at or
above the threshold is ever removed, and nothing after the onset is touched.
"""

from __future__ import annotations

import torch


class LeadingSilenceTrim:
    """Per-request trimmer: ``push(pcm, final) -> pcm`` for consecutive chunks of one take.

    ``threshold``: the amplitude below which a sample counts as silent (default 10**(-54/20) ~ 0.002, -54 dBFS,
    below the quietest speech onsets and above the model's silence floor). ``pre_roll_ms``: silence kept before
    the onset. Holds at most ``pre_roll`` samples while waiting for the onset.
    """

    def __init__(self, sample_rate: int, pre_roll_ms: float = 40.0, threshold: float = 10 ** (-54 / 20)) -> None:
        assert sample_rate > 0 and pre_roll_ms >= 0 and threshold > 0
        self.pre_roll = round(sample_rate * pre_roll_ms / 1000)
        self.threshold = threshold
        self._held = torch.zeros(0)  # the last pre_roll silent samples seen before the onset
        self._onset_seen = False
        self.trimmed = 0  # samples removed so far (for the caller's sample offsets)

    @property
    def waiting(self) -> bool:
        """Whether the onset has not been seen yet (pushed audio may still be held back)."""
        return not self._onset_seen

    def push(self, pcm: torch.Tensor, final: bool = False) -> torch.Tensor:
        """The part of ``pcm`` to send now. Before the onset, silent samples are held (the last ``pre_roll`` of
        them) and nothing is sent, unless ``final``: then the held pre-roll is sent (a silent take ends as
        ``pre_roll`` samples of its own silence)."""
        if self._onset_seen:
            return pcm
        x = torch.cat((self._held, pcm.reshape(-1).to(self._held.dtype)))
        loud = (x.abs() >= self.threshold).nonzero()
        if loud.numel():
            self._onset_seen = True
            start = max(0, int(loud[0, 0]) - self.pre_roll)
        else:
            start = max(0, x.numel() - self.pre_roll)
        self.trimmed += start
        kept = x[start:]
        if self._onset_seen or final:
            self._held = torch.zeros(0)
            self._onset_seen = True
            return kept
        self._held = kept
        return x[:0]
