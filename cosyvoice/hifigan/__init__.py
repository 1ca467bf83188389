"""CosyVoice3's causal HiFT vocoder: mel -> 24 kHz waveform."""

from cosyvoice.hifigan.generator import CausalHiFTGenerator, rename_hift_key

__all__ = ["CausalHiFTGenerator", "rename_hift_key"]
