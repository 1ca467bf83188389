"""An objective scorecard beside the ratings: measures of each take that need no listener, on the CPU, with
models already on this machine (nothing is downloaded).

* duration and level (RMS and peak in dBFS: a plain level, not a perceptual loudness in LUFS);
* speaker similarity to the take's prompt recording (cosine of speaker embeddings) from the bundle's own
  CAM++ (``campplus.onnx``) and, when the ``resemblyzer`` package is installed (it ships its encoder's
  weights), from that independent encoder;
* DNSMOS P.835 (SIG, BAK, OVRL) from the ONNX model the ``speechmos`` package ships, run here with
  onnxruntime (speechmos' own code needs librosa only for the P.808 score, which is left out).

With the demo (random) bundle the takes are noise and these numbers mean nothing.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import logging
import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import soxr
import torch

from cosyvoice.frontend.onnx_models import CampPlus
from cosyvoice.takes.store import SCORE_METRICS as METRICS
from cosyvoice.takes.store import Take, TakeStore
from cosyvoice.workbench import stats
from cosyvoice.workbench.listening import condition

logger = logging.getLogger(__name__)

NOTE = ("Objective measures, no listener: duration, level (RMS/peak dBFS), speaker similarity to the prompt "
        "(cosine; CAM++ from the model bundle, Resemblyzer if installed) and DNSMOS P.835 (1-5). With the demo "
        "model these numbers mean nothing.")
DNSMOS_RATE = 16000
DNSMOS_SECONDS = 9.01  # the model's fixed input length
# DNSMOS P.835's calibration polynomials (non-personalised), as published with the model (Microsoft DNS
# Challenge, and speechmos' copy of it): raw SIG/BAK/OVRL -> MOS
_DNSMOS_POLY = {"sig": (-0.08397278, 1.22083953, 0.0052439), "bak": (-0.13166888, 1.60915514, -0.39604546),
                "ovrl": (-0.06766283, 1.11546468, 0.04602535)}

Recording = Callable[[str], tuple[int, np.ndarray]]  # voice id -> (sample rate, samples) of its prompt


def available_encoders() -> dict[str, bool]:
    """Which optional packaged models work here (the ``scorecard`` extra installs them)."""
    return {"resemblyzer": _resemblyzer() is not None, "speechmos": importlib.util.find_spec("speechmos") is not None}


def _resemblyzer() -> Any:
    """The resemblyzer module, or None: absent, or its ``webrtcvad`` dependency unusable (the sdist's module
    imports ``pkg_resources``, which setuptools 81 removed; ``webrtcvad-wheels`` provides a working one)."""
    if importlib.util.find_spec("resemblyzer") is None:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # it imports scipy.ndimage.morphology
            import resemblyzer
    except ImportError as exc:
        logger.warning("scorecard: resemblyzer is installed but cannot be imported (%s); skipped", exc)
        return None
    return resemblyzer


class Scorer:
    """Holds the models once; ``score(take)`` measures one take."""

    def __init__(self, store: TakeStore, model_dir: str | Path, recording: Recording) -> None:
        self.store, self.recording = store, recording
        self.campplus = CampPlus.from_model_dir(model_dir)
        module = _resemblyzer()
        self.resemblyzer = None if module is None else module.VoiceEncoder("cpu", verbose=False)
        self._preprocess = None if module is None else module.preprocess_wav
        self.dnsmos = None
        if importlib.util.find_spec("speechmos") is not None:
            import onnxruntime as ort

            path = importlib.resources.files("speechmos") / "dnsmos_models" / "sig_bak_ovr.onnx"
            options = ort.SessionOptions()
            options.intra_op_num_threads = 1  # beside the engine's threads; many windows, each small
            self.dnsmos = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self._prompts: dict[str, dict[str, np.ndarray]] = {}

    def score(self, take: Take) -> dict[str, float | None]:
        pcm, rate = self.store.read_audio(take), take.sample_rate
        x16 = _resample(pcm, rate, DNSMOS_RATE)
        rms = float(np.sqrt(np.mean(pcm.astype(np.float64) ** 2))) if pcm.size else 0.0
        out: dict[str, float | None] = {  # a None is "not measurable here" (no voice, model not installed)
            "seconds": pcm.size / rate, "rms_dbfs": _db(rms), "peak_dbfs": _db(float(np.abs(pcm).max(initial=0.0))),
            "sim_campplus": None, "sim_resemblyzer": None, "dnsmos_sig": None, "dnsmos_bak": None,
            "dnsmos_ovrl": None}
        prompt = self._prompt(take.provenance.get("voice_id"))
        if prompt is not None and x16.size >= 400:
            out["sim_campplus"] = _cosine(self._campplus(x16), prompt["campplus"])
            if self.resemblyzer is not None:
                out["sim_resemblyzer"] = _cosine(self._resemblyzer(x16), prompt["resemblyzer"])
        if self.dnsmos is not None and x16.size:
            out["dnsmos_sig"], out["dnsmos_bak"], out["dnsmos_ovrl"] = self._dnsmos(x16)
        return out

    def _prompt(self, voice_id: object) -> dict[str, np.ndarray] | None:
        """The prompt recording's embeddings (once per voice); None for a take with no known voice."""
        if not isinstance(voice_id, str) or not voice_id:
            return None
        if voice_id not in self._prompts:
            try:
                rate, samples = self.recording(voice_id)
            except Exception as exc:  # a deleted voice: similarity is then unknown, the rest still scores
                logger.info("scorecard: no recording for voice %s (%s)", voice_id, exc)
                return None
            x = samples.astype(np.float32) / (32768.0 if samples.dtype == np.int16 else 1.0)
            x16 = _resample(x.reshape(-1), rate, DNSMOS_RATE)
            self._prompts[voice_id] = {"campplus": self._campplus(x16)}
            if self.resemblyzer is not None:
                self._prompts[voice_id]["resemblyzer"] = self._resemblyzer(x16)
        return self._prompts[voice_id]

    def _campplus(self, x16: np.ndarray) -> np.ndarray:
        return self.campplus(torch.from_numpy(x16)[None]).numpy().reshape(-1)

    def _resemblyzer(self, x16: np.ndarray) -> np.ndarray:
        wav = self._preprocess(x16, source_sr=DNSMOS_RATE)  # type: ignore[misc]  # its own VAD trim and level
        return self.resemblyzer.embed_utterance(wav if wav.size else x16)  # type: ignore[union-attr]

    def _dnsmos(self, x16: np.ndarray) -> tuple[float, float, float]:
        """Mean over 9.01 s windows hopped by 1 s (a short take is repeated to fill one), as DNSMOS does."""
        need = int(DNSMOS_SECONDS * DNSMOS_RATE)
        audio = x16
        while audio.size < need:
            audio = np.concatenate([audio, x16])
        hops = int(math.floor(audio.size / DNSMOS_RATE) - DNSMOS_SECONDS) + 1
        name = self.dnsmos.get_inputs()[0].name  # type: ignore[union-attr]
        raw = np.array([self.dnsmos.run(None, {name: audio[i * DNSMOS_RATE:i * DNSMOS_RATE + need][None]})[0][0]  # type: ignore[union-attr]
                        for i in range(max(1, hops))])
        sig, bak, ovrl = raw.mean(axis=0)
        return (float(np.polyval(_DNSMOS_POLY["sig"], sig)), float(np.polyval(_DNSMOS_POLY["bak"], bak)),
                float(np.polyval(_DNSMOS_POLY["ovrl"], ovrl)))


def scorecard(scorer: Scorer, takes: Sequence[Take]) -> dict[str, Any]:
    """Per take and per condition (mean with a 95% t-interval of each measure); the per-take scores are kept in
    the store, so ``answers.csv`` carries them beside the ratings."""
    per_take = [{"take_id": t.id, "condition": condition(t), **scorer.score(t)} for t in takes]
    scorer.store.put_scores({r["take_id"]: {m: r[m] for m in METRICS} for r in per_take})
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in per_take:
        groups[row["condition"]].append(row)
    conditions = []
    for name, rows in sorted(groups.items()):
        entry: dict[str, Any] = {"condition": name, "n": len(rows)}
        for metric in METRICS:
            values = [r[metric] for r in rows if r[metric] is not None and math.isfinite(r[metric])]
            if values:
                ci = stats.mean_ci(values)
                entry[metric], entry[f"{metric}_low"], entry[f"{metric}_high"] = (_finite(ci.estimate),
                                                                                  _finite(ci.low), _finite(ci.high))
            else:
                entry[metric] = None
        conditions.append(entry)
    encoders = available_encoders()
    return {"note": NOTE, "takes": per_take, "conditions": conditions,
            "columns": ["condition", "n", *METRICS], "encoders": {"campplus": True, **encoders}}


def _resample(x: np.ndarray, rate: int, target: int) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    return x if rate == target else soxr.resample(x, rate, target).astype(np.float32)


def _db(value: float) -> float | None:
    """dBFS; None for digital silence (JSON has no -inf)."""
    return 20.0 * math.log10(value) if value > 0 else None


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-12))
