"""End-to-end smoke parity: ``e2e_smoke.json`` (golden README §1, §10.4).

The reference ran every mode, streamed and not, on the tiny bundle with the golden prompt. Its sampling is
random, so its audio is no parity target; what must agree is what does not depend on the draws: each mode
runs through the official API, the output rate, finite audio within the vocoder's clip level, whole mel
frames per chunk, and the streamed chunk schedule (the sizes of the non-final chunks both runs emitted).
"""

from __future__ import annotations

import tempfile

import torch

from cosyvoice.config import load_config
from cosyvoice.frontend.prompts import cross_lingual_text, instruct_text, zero_shot_prompt_text
from cosyvoice.tools.parity.common import Golden, Result, compare_exact
from cosyvoice.tools.parity.frontend import prompt_wav_path

FILE = "e2e_smoke.json"
COMPONENT = "e2e"
TEXT = "This is a test of every mode."  # 10 tokens: up to 200 speech tokens, 4 streamed chunks
TRANSCRIPT = "Hello, this is a short prompt for testing."  # prompt_24k.wav (golden README §3)


def _run(tts, mode: str, stream: bool, prompt: str) -> list[torch.Tensor]:
    calls = {
        "zero_shot": lambda: tts.inference_zero_shot(TEXT, zero_shot_prompt_text(TRANSCRIPT), prompt, stream=stream,
                                                     seed=0),
        "cross_lingual": lambda: tts.inference_cross_lingual(cross_lingual_text(TEXT), prompt, stream=stream, seed=0),
        "instruct2": lambda: tts.inference_instruct2(TEXT, instruct_text("Speak slowly."), prompt, stream=stream,
                                                     seed=0),
    }
    return [out["tts_speech"].reshape(-1) for out in calls[mode]()]


def check(golden: Golden) -> list[Result]:
    from cosyvoice.cli.cosyvoice import CosyVoice3  # the official API, as the reference's smoke run used it

    smoke = golden.json(FILE)
    hift = load_config(golden.bundle_dir).hift
    prompt = str(prompt_wav_path(golden))
    results = []
    with tempfile.TemporaryDirectory(prefix="cosyvoice-parity-voices-") as voices:
        tts = CosyVoice3(golden.bundle_dir, device="cpu", voice_dir=voices)
        results.append(compare_exact(COMPONENT, "sample_rate", tts.sample_rate, smoke["sample_rate"]))
        for run in smoke["runs"]:
            name = f"{run['mode']}{' stream' if run['stream'] else ''}"
            chunks = _run(tts, run["mode"], run["stream"], prompt)
            speech = torch.cat(chunks)
            peak = float(speech.abs().max()) if speech.numel() else 0.0
            ok = bool(speech.numel()) and bool(torch.isfinite(speech).all()) and peak <= hift.audio_limit
            results.append(Result(COMPONENT, f"{name}: audio", peak, 0.0, hift.audio_limit, ok,
                                  f"{speech.numel()} samples, finite, peak within the vocoder's clip level"))
            results.append(compare_exact(COMPONENT, f"{name}: whole mel frames", speech.numel() % hift.upsample_scale,
                                         0))
            if run["stream"]:
                ours, theirs = [c.numel() for c in chunks[:-1]], run["chunk_samples"][:-1]
                n = min(len(ours), len(theirs))
                results.append(compare_exact(COMPONENT, f"{name}: first {n} chunk sizes", ours[:n], theirs[:n]))
            else:
                results.append(compare_exact(COMPONENT, f"{name}: chunk count", len(chunks), run["n_chunks"]))
    return results
