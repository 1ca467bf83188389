"""Frontend: prompt audio decoding, features, ONNX tokenizer/speaker encoder (text side: ``frontend.text``)."""

from cosyvoice.frontend.audio import decode_audio, downmix, load_prompt_audio, resample, validate_prompt
from cosyvoice.frontend.features import MelParams, kaldi_fbank, prompt_mel, whisper_log_mel
from cosyvoice.frontend.onnx_models import CampPlus, SpeechTokenizer
from cosyvoice.frontend.prompt import PromptFeatures, extract_prompt_features

__all__ = [
    "CampPlus",
    "MelParams",
    "PromptFeatures",
    "SpeechTokenizer",
    "decode_audio",
    "downmix",
    "extract_prompt_features",
    "kaldi_fbank",
    "load_prompt_audio",
    "prompt_mel",
    "resample",
    "validate_prompt",
    "whisper_log_mel",
]
