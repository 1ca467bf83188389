"""Speech-token language model of CosyVoice3 (Qwen2 backbone, KV-cache decoding, ras sampling)."""

from cosyvoice.llm.model import ENDOFPROMPT_ID, SILENT_TOKENS, CosyVoice3LM
from cosyvoice.llm.qwen2 import KVCache, Qwen2Backbone
from cosyvoice.llm.sampling import SeededSampler, nucleus_candidates, nucleus_rows, ras_sample_rows

__all__ = ["ENDOFPROMPT_ID", "SILENT_TOKENS", "CosyVoice3LM", "KVCache", "Qwen2Backbone", "SeededSampler",
           "nucleus_candidates", "nucleus_rows", "ras_sample_rows"]
