"""Causal HiFT vocoder: parity with the official outputs and its streaming/loading behaviour."""

from __future__ import annotations

import pytest
import torch

from cosyvoice.errors import ResourceLimitError
from cosyvoice.hifigan import CausalHiFTGenerator, rename_hift_key
from cosyvoice.hifigan.f0_predictor import LOOKAHEAD
from cosyvoice.hifigan.generator import Snake
from cosyvoice.tools.parity import hift as hift_parity
from cosyvoice.tools.parity.common import Golden
from cosyvoice.tools.parity.tolerances import HIFT_AUDIO_ATOL
from cosyvoice.weights import load_state_dict_strict, read_checkpoint


@pytest.fixture(scope="module")
def vocoder(golden: Golden) -> CausalHiFTGenerator:
    return hift_parity.build_vocoder(golden)[0]


@pytest.fixture(scope="module")
def mel(golden: Golden) -> torch.Tensor:
    return torch.from_numpy(golden.arrays("hift.safetensors")["mel"])


def test_parity(golden: Golden) -> None:
    results = hift_parity.check(golden)
    failed = [r.row() for r in results if not r.passed]
    assert results and not failed, "\n".join(failed)


def test_rename_hift_key() -> None:
    assert rename_hift_key("generator.conv_pre.weight_g") == "conv_pre.parametrizations.weight.original0"
    assert rename_hift_key("resblocks.3.convs1.0.weight_v") == "resblocks.3.convs1.0.parametrizations.weight.original1"
    assert rename_hift_key("m_source.l_linear.weight") == "m_source.l_linear.weight"
    assert rename_hift_key("resblocks.0.activations1.2.alpha") == "resblocks.0.activations1.2.alpha"


def _legacy(key: str) -> str:
    key = key.replace(".parametrizations.weight.original0", ".weight_g")
    return "generator." + key.replace(".parametrizations.weight.original1", ".weight_v")


def test_legacy_and_prefixed_checkpoints_give_the_same_output(golden: Golden, vocoder: CausalHiFTGenerator,
                                                             mel: torch.Tensor) -> None:
    sd = read_checkpoint(golden.bundle_dir / "hift.pt")
    assert set(vocoder.state_dict()) == set(sd)
    legacy = {_legacy(k): v for k, v in sd.items()}
    assert any(k.endswith(".weight_g") for k in legacy)
    other = CausalHiFTGenerator(vocoder.cfg)  # default buffers: the same replay as the parity model's
    load_state_dict_strict(other, {rename_hift_key(k): v for k, v in legacy.items()}, "legacy hift.pt")
    assert torch.equal(other.inference(mel[:, :, :12])[0], vocoder.inference(mel[:, :, :12])[0])


def test_shapes_and_batch(vocoder: CausalHiFTGenerator, mel: torch.Tensor) -> None:
    frames = 10
    batch = torch.cat([mel[:, :, :frames], mel[:, :, 5:5 + frames]])
    speech, source = vocoder.inference(batch)
    n = frames * vocoder.upsample_scale
    assert speech.shape == (2, n) and source.shape == (2, 1, n)
    single, _ = vocoder.inference(batch[1:])
    torch.testing.assert_close(speech[1:], single, atol=HIFT_AUDIO_ATOL, rtol=0)  # batched conv paths round differently


def test_finalize_false_withholds_look_ahead(vocoder: CausalHiFTGenerator, mel: torch.Tensor) -> None:
    full, _ = vocoder.inference(mel, finalize=True)
    frames = 20
    look_ahead = LOOKAHEAD + vocoder.cfg.conv_pre_look_right
    part, source = vocoder.inference(mel[:, :, :frames], finalize=False)
    assert source.shape[-1] == (frames - LOOKAHEAD) * vocoder.upsample_scale
    assert part.shape[-1] == (frames - look_ahead - 1) * vocoder.upsample_scale
    # the emitted samples do not change once the future arrives
    torch.testing.assert_close(part, full[:, : part.shape[-1]], atol=HIFT_AUDIO_ATOL, rtol=0)
    shortest, _ = vocoder.inference(mel[:, :, : vocoder.min_frames(False)], finalize=False)
    assert shortest.shape == (1, 0)


def test_output_is_clipped(vocoder: CausalHiFTGenerator, mel: torch.Tensor) -> None:
    speech, _ = vocoder.inference(mel[:, :, :16] * 8 + 4)
    limit = vocoder.cfg.audio_limit
    assert speech.abs().max() <= limit
    assert (speech.abs() == limit).any()  # this input does hit the limit


def test_inputs_are_validated(vocoder: CausalHiFTGenerator, mel: torch.Tensor) -> None:
    with pytest.raises(RuntimeError, match="shape"):
        vocoder.inference(mel[:, :40])
    with pytest.raises(RuntimeError, match="at least"):
        vocoder.inference(mel[:, :, : vocoder.min_frames(False) - 1], finalize=False)
    short = CausalHiFTGenerator(vocoder.cfg)
    short.set_sinegen_noise(torch.zeros(1, vocoder.cfg.nb_harmonics + 1), torch.zeros(1, 480, 9))
    with pytest.raises(ResourceLimitError, match="480 samples"):
        short.inference(mel[:, :, :2])


def test_fold_weight_norm_keeps_output(golden: Golden, vocoder: CausalHiFTGenerator, mel: torch.Tensor) -> None:
    folded, _ = hift_parity.build_vocoder(golden)
    folded.fold_weight_norm()
    assert "conv_pre.weight" in folded.state_dict()
    assert "f0_predictor.condnet.0.parametrizations.weight.original0" in folded.state_dict()
    assert not any("weight64" in key for key in folded.state_dict())  # the F0 predictor's float64 copies are not
    assert folded.f0_predictor.weight64_0.dtype == torch.float64  # saved, and are evaluated in float64
    # the same g * v / ||v||, computed once instead of per call: bit-equal, so the engine folds at load
    assert torch.equal(folded.inference(mel)[0], vocoder.inference(mel)[0])


def test_the_engine_runs_the_folded_vocoder(tts) -> None:
    from torch.nn.utils import parametrize

    folded = [n for n, m in tts.engine.hift.named_modules() if parametrize.is_parametrized(m, "weight")]
    assert folded and all(n.startswith("f0_predictor") for n in folded)  # only the float64 F0 predictor keeps it


def test_float64_and_global_rng(golden: Golden, vocoder: CausalHiFTGenerator, mel: torch.Tensor) -> None:
    state = torch.random.get_rng_state()
    model, _ = hift_parity.build_vocoder(golden)
    torch.random.set_rng_state(state)
    speech64, _ = model.double().inference(mel.double())
    assert speech64.dtype == torch.float64
    assert torch.equal(torch.random.get_rng_state(), state)  # inference draws nothing from the global RNG
    torch.testing.assert_close(speech64.float(), vocoder.inference(mel)[0], atol=1e-3, rtol=0)


def test_snake_writes_the_next_convolutions_padding() -> None:
    snake = Snake(4)
    with torch.no_grad():
        snake.alpha.copy_(torch.tensor([0.5, 1.0, 2.0, 3.0]))
    x = torch.randn(2, 4, 37, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():  # the tensor F.pad would make, bit for bit: the convolution reads it unchanged
        padded = snake(x, 10)
        assert torch.equal(padded, torch.nn.functional.pad(snake(x), (10, 0)))
    assert torch.equal(padded[..., :10], torch.zeros(2, 4, 10))
    assert torch.equal(snake(x, 10), padded)  # with autograd (and traced): the same operations
