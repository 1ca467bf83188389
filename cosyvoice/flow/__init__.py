"""Flow matching: speech tokens + prompt mel + speaker vector -> mel spectrogram."""

from cosyvoice.flow.cfm import CausalConditionalCFM, Stopped
from cosyvoice.flow.dit import DiT
from cosyvoice.flow.model import CausalMaskedDiffWithDiT, FlowStream, PendingExtension, PreLookaheadLayer, extend_packed

__all__ = ["CausalConditionalCFM", "CausalMaskedDiffWithDiT", "DiT", "FlowStream", "PendingExtension",
           "PreLookaheadLayer", "Stopped", "extend_packed"]
