"""The two ONNX networks of a model dir: the S3 speech tokenizer and the CAM++ speaker encoder.

Each wrapper owns one ``onnxruntime.InferenceSession``, created once; ORT sessions are safe to ``run``
from several threads at once, so one instance can serve concurrent requests. Inputs are fed by the
names the model declares (the official frontend does the same), so re-exported models with other
input names or an int64 length input keep working.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch

from cosyvoice.errors import InvalidInputError, ModelBundleError
from cosyvoice.frontend.features import WHISPER_SAMPLE_RATE, kaldi_fbank, whisper_log_mel


def default_providers() -> list[str]:
    """CUDA when both onnxruntime and torch can use it, else CPU."""
    if "CUDAExecutionProvider" in ort.get_available_providers() and torch.cuda.is_available():
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def _open_session(path: Path, providers: list[str] | None, intra_op_threads: int) -> ort.InferenceSession:
    if not path.is_file():
        raise ModelBundleError(f"{path} is missing; a CosyVoice3 model dir ships it next to cosyvoice3.yaml")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = intra_op_threads  # the reference uses 1; more threads may reorder reductions
    try:
        return ort.InferenceSession(str(path), sess_options=options, providers=providers or default_providers())
    except Exception as exc:  # onnxruntime raises its own untyped errors for corrupt or foreign files
        raise ModelBundleError(f"{path.name} is not a loadable ONNX model: {exc}") from exc


def _static_dim(session_input: ort.NodeArg, axis: int, default: int) -> int:
    dim = session_input.shape[axis] if len(session_input.shape) > axis else None
    return dim if isinstance(dim, int) else default


class SpeechTokenizer:
    """Whisper log-mel of 16 kHz audio -> discrete speech tokens (25 per second, ids 0..6560)."""

    FILENAME = "speech_tokenizer_v3.onnx"

    def __init__(self, path: str | Path, *, providers: list[str] | None = None, intra_op_threads: int = 1,
                 max_seconds: float = 30.0) -> None:
        self.session = _open_session(Path(path), providers, intra_op_threads)
        inputs = self.session.get_inputs()
        if len(inputs) != 2:
            raise ModelBundleError(f"{Path(path).name} must take (feats, feats_length), it takes {len(inputs)} inputs")
        self._feats_name, self._length_name = inputs[0].name, inputs[1].name
        self._length_dtype = np.int64 if inputs[1].type == "tensor(int64)" else np.int32
        self.n_mels = _static_dim(inputs[0], 1, 128)
        self.max_seconds = max_seconds

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, **kwargs: Any) -> SpeechTokenizer:
        return cls(Path(model_dir) / cls.FILENAME, **kwargs)

    def __call__(self, wav_16k: torch.Tensor) -> torch.Tensor:
        """Mono 16 kHz audio [1, N] -> token ids [1, T_tok] int32 (on CPU)."""
        seconds = wav_16k.shape[-1] / WHISPER_SAMPLE_RATE
        if seconds > self.max_seconds:
            raise InvalidInputError(f"the speech tokenizer accepts at most {self.max_seconds:g} s of audio, got "
                                    f"{seconds:.2f} s; trim the prompt")
        return self.tokenize_log_mel(whisper_log_mel(wav_16k.reshape(1, -1), n_mels=self.n_mels))

    def tokenize_log_mel(self, log_mel: torch.Tensor) -> torch.Tensor:
        """Whisper log-mel [1, n_mels, T] -> token ids [1, ceil(T/4)] int32."""
        feats = log_mel.detach().to("cpu", torch.float32).numpy()
        length = np.array([feats.shape[2]], dtype=self._length_dtype)
        tokens = self.session.run(None, {self._feats_name: feats, self._length_name: length})[0]
        return torch.from_numpy(np.ascontiguousarray(tokens.reshape(1, -1), dtype=np.int32))


class CampPlus:
    """CAM++ speaker encoder: mean-normalised Kaldi fbank of 16 kHz audio -> a 192-dim (unnormalised) embedding."""

    FILENAME = "campplus.onnx"

    def __init__(self, path: str | Path, *, providers: list[str] | None = None, intra_op_threads: int = 1) -> None:
        self.session = _open_session(Path(path), providers, intra_op_threads)
        inputs = self.session.get_inputs()
        self._input_name = inputs[0].name
        self.num_mel_bins = _static_dim(inputs[0], 2, 80)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, **kwargs: Any) -> CampPlus:
        return cls(Path(model_dir) / cls.FILENAME, **kwargs)

    def __call__(self, wav_16k: torch.Tensor) -> torch.Tensor:
        """Mono 16 kHz audio [1, N] -> embedding [1, D] float32 (on CPU)."""
        fbank = kaldi_fbank(wav_16k.reshape(1, -1), num_mel_bins=self.num_mel_bins, sample_rate=WHISPER_SAMPLE_RATE)
        if fbank.shape[0] == 0:
            raise InvalidInputError("the prompt audio is shorter than one 25 ms analysis frame")
        return self.embed_fbank(fbank - fbank.mean(dim=0, keepdim=True))

    def embed_fbank(self, features: torch.Tensor) -> torch.Tensor:
        """Mean-normalised fbank [T, num_mel_bins] -> embedding [1, D]."""
        feats = features.detach().to("cpu", torch.float32).numpy()[None]
        embedding = self.session.run(None, {self._input_name: feats})[0]
        return torch.from_numpy(np.ascontiguousarray(embedding.reshape(1, -1), dtype=np.float32))
