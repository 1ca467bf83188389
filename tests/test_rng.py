"""The official fixed random buffers, replayed bit-exactly without touching torch's global RNG."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from cosyvoice import rng
from cosyvoice.config import load_config
from cosyvoice.errors import ResourceLimitError
from cosyvoice.tools.parity.common import Golden


def test_recipe_follows_the_bundle_config(golden: Golden) -> None:
    cfg = load_config(golden.bundle_dir)
    recipe = rng.SineGenRecipe.from_config(cfg)
    assert recipe.cond_channels == cfg.hift.f0_predictor.cond_channels
    assert recipe.flow_vocab_size == cfg.flow.vocab_size
    assert recipe.n_harmonics == cfg.hift.nb_harmonics + 1
    assert rng.SineGenRecipe.from_hift_config(cfg.hift) == recipe  # the tiny bundle keeps the released flow dims


def test_sinegen_buffers_match_the_golden(golden: Golden) -> None:
    recipe = rng.SineGenRecipe.from_config(load_config(golden.bundle_dir))
    arrays = golden.arrays("hift.safetensors")
    n_used = arrays["mel"].shape[-1] * load_config(golden.bundle_dir).hift.upsample_scale
    rand_ini, sine_waves = rng.sinegen_buffers(recipe, n_used)
    np.testing.assert_array_equal(rand_ini.numpy(), arrays["sinegen_rand_ini"])
    head = arrays["sinegen_sine_waves_head"]
    np.testing.assert_array_equal(sine_waves[0, : head.shape[0]].numpy(), head)
    assert rng.tensor_sha256(sine_waves) == golden.scalar("hift.safetensors", "sinegen_sine_waves_sha256_used")
    assert rng.sine_waves_sha256(recipe) == golden.scalar("hift.safetensors", "sinegen_sine_waves_sha256_full")


def test_cfm_noise_matches_the_golden(golden: Golden) -> None:
    noise = rng.cfm_noise()
    assert noise.shape == rng.CFM_NOISE_SHAPE and noise.dtype == torch.float32
    prefix = golden.arrays("flow.safetensors")["rand_noise_prefix"]
    np.testing.assert_array_equal(noise[..., : prefix.shape[-1]].numpy(), prefix)
    assert rng.tensor_sha256(noise) == golden.scalar("flow.safetensors", "rand_noise_sha256_full")
    noise.zero_()
    assert rng.cfm_noise().abs().sum() > 0  # callers get copies


def test_real_config_buffers(golden: Golden) -> None:
    if not golden.has("real_config_rng.safetensors"):
        pytest.skip("golden folder has no real_config_rng fixtures")
    arrays = golden.arrays("real_config_rng.safetensors")
    hashes = json.loads((golden.root / "real_config_rng.json").read_text())["sha256_float32"]
    recipe = rng.SineGenRecipe(cond_channels=512)
    rand_ini, head = rng.sinegen_buffers(recipe, arrays["sine_waves_head"].shape[0])
    np.testing.assert_array_equal(rand_ini.numpy(), arrays["rand_ini"])
    np.testing.assert_array_equal(head[0].numpy(), arrays["sine_waves_head"])
    np.testing.assert_array_equal(rng.cfm_noise()[..., :64].numpy(), arrays["rand_noise_head"])
    assert rng.tensor_sha256(rand_ini) == hashes["rand_ini_[1,9]"]
    start = time.perf_counter()
    assert rng.sine_waves_sha256(recipe) == hashes["sine_waves_full_[1,7200000,9]"]
    print(f"full 259 MB sine_waves buffer generated and hashed in {time.perf_counter() - start:.2f} s")


def test_global_rng_is_untouched() -> None:
    state = torch.random.get_rng_state()
    recipe = rng.SineGenRecipe(cond_channels=24)  # not cached by other tests: forces a full replay
    rng.sinegen_buffers(recipe, 5000)
    rng.sine_waves_sha256(recipe, 1000)
    rng.cfm_noise()
    assert torch.equal(torch.random.get_rng_state(), state)


def test_growing_prefix_equals_one_shot_generation() -> None:
    recipe = rng.SineGenRecipe(cond_channels=40)
    lengths = [3, 1000, 999, 30 * 24000 + 7, 10]  # grows past the first allocation, then shrinks
    prefixes = [rng.sinegen_sine_waves(recipe, n).clone() for n in lengths]
    _, g = rng._replay_to_sinegen(recipe)
    one_shot = torch.rand(1, max(lengths), recipe.n_harmonics, generator=g)
    for n, prefix in zip(lengths, prefixes, strict=True):
        assert prefix.shape == (1, n, recipe.n_harmonics)
        assert torch.equal(prefix, one_shot[:, :n])
    assert rng.sine_waves_sha256(recipe, 1000) == rng.tensor_sha256(one_shot[:, :1000])


def test_int_recipe_means_cond_channels() -> None:
    a, _ = rng.sinegen_buffers(512, 1)
    b, _ = rng.sinegen_buffers(rng.SineGenRecipe(cond_channels=512), 1)
    assert torch.equal(a, b) and a[0, 0] == 0


def test_buffer_length_limit() -> None:
    with pytest.raises(ResourceLimitError, match="300 s"):
        rng.sinegen_sine_waves(512, rng.SINE_WAVES_SAMPLES + 1)
