"""CosyVoice3's causal HiFT vocoder: mel -> 24 kHz waveform."""

from cosyvoice.hifigan.generator import CausalHiFTGenerator, rename_hift_key
from cosyvoice.hifigan.stream import HiFTStream

__all__ = ["CausalHiFTGenerator", "HiFTStream", "rename_hift_key"]
