"""Parity of the vocoder (``hift.safetensors``) and of the replayed random buffers (``real_config_rng.*``).

The vocoder gets the stored ``rand_ini`` and our replayed ``sine_waves``; the replayed
buffers are checked separately, bit for bit, against the stored heads and sha256 hashes.
"""

from __future__ import annotations

import json

import torch

from cosyvoice.config import load_config
from cosyvoice.hifigan import CausalHiFTGenerator, rename_hift_key
from cosyvoice.rng import (
    SINE_WAVES_SAMPLES,
    SineGenRecipe,
    cfm_noise,
    sine_waves_sha256,
    sinegen_rand_ini,
    sinegen_sine_waves,
    tensor_sha256,
)
from cosyvoice.tools.parity.common import Golden, Result, compare, compare_exact
from cosyvoice.tools.parity.tolerances import HIFT_AUDIO_ATOL, HIFT_F0_CUDA_ATOL, HIFT_F0_RTOL
from cosyvoice.weights import load_weights

HIFT_FILE = "hift.safetensors"
REAL_RNG_FILE = "real_config_rng.safetensors"
REAL_RNG_JSON = "real_config_rng.json"
REAL_MODEL_RECIPE = SineGenRecipe(cond_channels=512)  # Fun-CosyVoice3-0.5B: only the f0 predictor width differs


def _buffer_checks(golden: Golden, recipe: SineGenRecipe, n_used: int) -> list[Result]:
    arrays = golden.arrays(HIFT_FILE)
    rand_ini = sinegen_rand_ini(recipe)
    head = arrays["sinegen_sine_waves_head"]
    return [
        compare_exact("rng", "sinegen_rand_ini", rand_ini.numpy(), arrays["sinegen_rand_ini"]),
        compare_exact("rng", "sinegen_rand_ini_sha256", tensor_sha256(rand_ini),
                      golden.scalar(HIFT_FILE, "sinegen_rand_ini_sha256")),
        compare_exact("rng", "sinegen_sine_waves_head", sinegen_sine_waves(recipe, head.shape[0])[0].numpy(), head),
        compare_exact("rng", "sinegen_sine_waves_sha256_used", tensor_sha256(sinegen_sine_waves(recipe, n_used)),
                      golden.scalar(HIFT_FILE, "sinegen_sine_waves_sha256_used")),
        compare_exact("rng", "sinegen_sine_waves_sha256_full", sine_waves_sha256(recipe),
                      golden.scalar(HIFT_FILE, "sinegen_sine_waves_sha256_full")),
    ]


def _real_config_checks(golden: Golden) -> list[Result]:
    """Buffers of the released config. Hashing the full 259 MB sine buffer takes ~0.6 s, so it is always done."""
    arrays = golden.arrays(REAL_RNG_FILE)
    hashes = json.loads((golden.root / REAL_RNG_JSON).read_text(encoding="utf-8"))["sha256_float32"]
    recipe = REAL_MODEL_RECIPE
    noise = cfm_noise()
    head = arrays["sine_waves_head"]
    noise_head = arrays["rand_noise_head"]
    results = [
        compare_exact("rng", "real/rand_ini", sinegen_rand_ini(recipe).numpy(), arrays["rand_ini"]),
        compare_exact("rng", "real/sine_waves_head", sinegen_sine_waves(recipe, head.shape[0])[0].numpy(), head),
        compare_exact("rng", "real/rand_noise_head", noise[..., : noise_head.shape[-1]].numpy(), noise_head),
    ]
    for key, expected in sorted(hashes.items()):
        if key.startswith("rand_noise_full"):
            ours = tensor_sha256(noise)
        elif key.startswith("rand_ini"):
            ours = tensor_sha256(sinegen_rand_ini(recipe))
        elif key.startswith("sine_waves_full"):
            ours = sine_waves_sha256(recipe, SINE_WAVES_SAMPLES)
        elif key.startswith("sine_waves_first_"):
            ours = sine_waves_sha256(recipe, int(key.removeprefix("sine_waves_first_").split("_")[0]))
        else:
            continue
        results.append(compare_exact("rng", f"real/sha256 {key}", ours, expected))
    return results


def build_vocoder(golden: Golden) -> tuple[CausalHiFTGenerator, SineGenRecipe]:
    """The bundle's vocoder with hift.pt loaded, the stored ``rand_ini`` and our replayed ``sine_waves``."""
    cfg = load_config(golden.bundle_dir)
    recipe = SineGenRecipe.from_config(cfg)
    model = CausalHiFTGenerator(cfg.hift, recipe)
    load_weights(model, golden.bundle_dir / "hift.pt", rename=rename_hift_key)
    stored_rand_ini = torch.from_numpy(golden.arrays(HIFT_FILE)["sinegen_rand_ini"])
    model.set_sinegen_noise(stored_rand_ini, lambda n: sinegen_sine_waves(recipe, n))
    return model.eval(), recipe


def check(golden: Golden, device: str | torch.device = "cpu") -> list[Result]:
    model, recipe = build_vocoder(golden)
    model = model.to(device)
    f0_atol = HIFT_F0_CUDA_ATOL if torch.device(device).type == "cuda" else 0.0
    arrays = golden.arrays(HIFT_FILE)
    mel = torch.from_numpy(arrays["mel"]).to(device)
    results = _buffer_checks(golden, recipe, mel.shape[-1] * model.upsample_scale)

    with torch.inference_mode():
        f0 = model.f0_predictor(mel, finalize=True)
    speech, source = model.inference(mel, finalize=True)
    s_re, s_im = model.source_stft(source.squeeze(1))
    head = arrays["full_stft_re_head"].shape[-1]
    results += [
        compare("hift", "full_f0", f0, arrays["full_f0"], atol=f0_atol, rtol=HIFT_F0_RTOL),
        compare("hift", "full_source", source.transpose(1, 2), arrays["full_source"], HIFT_AUDIO_ATOL),
        compare_exact("hift", "full_stft_frames", s_re.shape[-1], golden.scalar(HIFT_FILE, "full_stft_frames")),
        compare("hift", "full_stft_re_head", s_re[..., :head], arrays["full_stft_re_head"], HIFT_AUDIO_ATOL),
        compare("hift", "full_stft_im_head", s_im[..., :head], arrays["full_stft_im_head"], HIFT_AUDIO_ATOL),
        compare("hift", "full_speech", speech, arrays["full_speech"], HIFT_AUDIO_ATOL),
    ]

    for i, call in enumerate(golden.scalar(HIFT_FILE, "stream_calls")):
        prefix, finalize = mel[:, :, : call["mel_prefix"]], bool(call["finalize"])
        with torch.inference_mode():
            f0 = model.f0_predictor(prefix, finalize=finalize)
        raw, _ = model.inference(prefix, finalize=finalize)
        results += [
            compare("hift", f"stream{i}_f0", f0, arrays[f"stream{i}_f0"], atol=f0_atol, rtol=HIFT_F0_RTOL),
            compare("hift", f"stream{i}_raw_speech", raw, arrays[f"stream{i}_raw_speech"], HIFT_AUDIO_ATOL),
            compare_exact("hift", f"stream{i}_raw_len", raw.shape[-1], call["raw_len"]),
        ]

    if golden.has(REAL_RNG_FILE) and golden.has(REAL_RNG_JSON):
        results += _real_config_checks(golden)
    return results
