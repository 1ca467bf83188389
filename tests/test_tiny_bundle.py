"""The tiny bundle generator: official layout, loadable by our modules, working ONNX and tokenizer, seeded."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from cosyvoice.bundle import ModelBundle, validate_model_dir
from cosyvoice.config import load_config, read_hyperpyyaml
from cosyvoice.frontend.tokenizer import CosyVoice3Tokenizer
from cosyvoice.tools.make_tiny_bundle import STOP_ROWS, main, make_tiny_bundle
from cosyvoice.tools.parity.common import Golden


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bundle(tmp_path_factory.mktemp("tiny") / "bundle", seed=0)


@pytest.fixture(scope="module")
def bundle(bundle_dir: Path) -> ModelBundle:
    return validate_model_dir(bundle_dir)


def test_same_layout_and_config_as_golden_bundle(bundle_dir: Path, golden: Golden) -> None:
    ours, reference = bundle_dir, golden.bundle_dir
    assert set(_files(ours)) == set(_files(reference))
    assert load_config(ours) == load_config(reference)
    assert list(read_hyperpyyaml(ours / "cosyvoice3.yaml")) == list(read_hyperpyyaml(reference / "cosyvoice3.yaml"))
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        assert json.loads((ours / "CosyVoice-BlankEN" / name).read_text()) == \
            json.loads((reference / "CosyVoice-BlankEN" / name).read_text()), name
    for name in ("llm.pt", "flow.pt", "hift.pt"):
        mine = torch.load(ours / name, weights_only=True)
        theirs = torch.load(reference / name, weights_only=True)
        assert {k: v.shape for k, v in mine.items()} == {k: v.shape for k, v in theirs.items()}, name


def test_checkpoints_load_strictly_into_our_modules(bundle: ModelBundle) -> None:
    llm, flow, hift = bundle.load_llm(), bundle.load_flow(), bundle.load_hift()
    for module, path in ((llm, bundle.llm_path), (flow, bundle.flow_path), (hift, bundle.hift_path)):
        saved = torch.load(path, weights_only=True)
        loaded = module.state_dict()
        assert loaded.keys() == saved.keys()
        assert all(torch.equal(loaded[k], v) for k, v in saved.items())
        assert all(v.dtype == torch.float32 for v in saved.values())


def test_llm_checkpoint_details(bundle: ModelBundle) -> None:
    state = torch.load(bundle.llm_path, weights_only=True)
    # tied embedding stored under both names, one storage (as the released file)
    assert state["llm.model.lm_head.weight"].data_ptr() == state["llm.model.model.embed_tokens.weight"].data_ptr()
    decoder = state["llm_decoder.weight"]
    n_speech = bundle.config.llm.speech_token_size
    assert decoder.shape[0] == n_speech + STOP_ROWS
    assert decoder[n_speech:].norm(dim=1).max() < 0.2 * decoder[:n_speech].norm(dim=1).mean()


def test_every_parameter_is_randomised(bundle: ModelBundle) -> None:
    hift = torch.load(bundle.hift_path, weights_only=True)
    llm = torch.load(bundle.llm_path, weights_only=True)
    alphas = [v for k, v in hift.items() if k.endswith(".alpha")]
    gains = [v for k, v in hift.items() if k.endswith("parametrizations.weight.original0")]
    norms = [v for k, v in llm.items() if "norm" in k]
    for group in (alphas, gains, norms):
        assert group and all(v.unique().numel() == v.numel() for v in group)


def test_speech_tokenizer_onnx_contract(bundle: ModelBundle) -> None:
    session = ort.InferenceSession(str(bundle.speech_tokenizer_path), providers=["CPUExecutionProvider"])
    feats_name, length_name = (i.name for i in session.get_inputs())
    rng = np.random.default_rng(0)
    for frames in (1, 4, 5, 294, 297):
        feats = rng.standard_normal((1, 128, frames)).astype(np.float32)
        (indices,) = session.run(None, {feats_name: feats, length_name: np.array([frames], np.int32)})
        assert indices.shape == (1, -(-frames // 4)) and indices.dtype == np.int32
        assert indices.min() >= 0 and indices.max() <= 6560
    assert len(np.unique(indices)) > indices.size // 2  # varied tokens, not a constant


def test_campplus_onnx_contract(bundle: ModelBundle) -> None:
    session = ort.InferenceSession(str(bundle.campplus_path), providers=["CPUExecutionProvider"])
    (name,) = (i.name for i in session.get_inputs())
    feats = np.random.default_rng(0).standard_normal((2, 93, 80)).astype(np.float32)
    (embedding,) = session.run(None, {name: feats})
    assert embedding.shape == (2, 192) and embedding.dtype == np.float32
    assert np.isfinite(embedding).all() and embedding.std() > 0
    (single,) = session.run(None, {name: feats[1:]})
    np.testing.assert_allclose(single[0], embedding[1], atol=1e-5)


def test_tokenizer_encodes_english_chinese_and_specials(bundle: ModelBundle) -> None:
    tokenizer = CosyVoice3Tokenizer.from_model_dir(bundle.root)
    for text in ("Hello, how are you doing today?", "今天天气很好，我们去散步吧。", "Mixed 中文 and English 123."):
        ids = tokenizer.encode(text)
        assert ids and all(i < 151643 for i in ids)
        assert tokenizer.decode(ids) == text
    assert tokenizer.end_of_prompt_id == 151646
    assert tokenizer.encode("Speak slowly.<|endofprompt|>")[-1] == 151646
    assert tokenizer.token_to_id("[breath]") == 151647
    vocab = json.loads((bundle.tokenizer_dir / "vocab.json").read_text(encoding="utf-8"))
    assert [vocab[t] for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [151643, 151644, 151645]


def test_modules_synthesise_finite_audio(bundle: ModelBundle) -> None:
    flow, hift = bundle.load_flow(), bundle.load_hift()
    gen = torch.Generator().manual_seed(0)
    token = torch.randint(0, 6561, (1, 12), generator=gen)
    prompt_token = torch.randint(0, 6561, (1, 6), generator=gen)
    prompt_feat = torch.randn(1, 12, 80, generator=gen) - 5.0
    embedding = torch.randn(1, 192, generator=gen)
    with torch.inference_mode():
        mel = flow.inference(token, torch.tensor([12]), prompt_token, torch.tensor([6]), prompt_feat,
                             torch.tensor([12]), embedding, streaming=False, finalize=True)
        speech, _ = hift.inference(mel, finalize=True)
    assert mel.shape == (1, 80, 24) and torch.isfinite(mel).all()
    assert speech.shape == (1, 24 * 480) and torch.isfinite(speech).all()
    assert 0 < speech.abs().max() <= bundle.config.hift.audio_limit


def test_deterministic_for_a_seed(bundle_dir: Path, tmp_path: Path) -> None:
    again = make_tiny_bundle(tmp_path / "again", seed=0)
    assert _files(again) == _files(bundle_dir)


def test_different_seed_changes_the_weights(bundle_dir: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    main([str(tmp_path / "other"), "--seed", "1"])
    other = Path(capsys.readouterr().out.strip())
    assert other == tmp_path / "other"
    validate_model_dir(other)
    for name in ("llm.pt", "flow.pt", "hift.pt"):
        a = torch.load(bundle_dir / name, weights_only=True)
        b = torch.load(other / name, weights_only=True)
        assert a.keys() == b.keys()
        assert not any(torch.equal(a[k], b[k]) for k in a if k.endswith("weight")), name
    for name in ("speech_tokenizer_v3.onnx", "campplus.onnx"):
        assert (bundle_dir / name).read_bytes() != (other / name).read_bytes()
    assert (bundle_dir / "CosyVoice-BlankEN/vocab.json").read_bytes() == \
        (other / "CosyVoice-BlankEN/vocab.json").read_bytes()


def test_two_processes_starting_at_once_share_one_complete_demo_bundle(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Two CLIs (or a server and a CLI) on a fresh clone both find the demo model missing (here: a folder an
    interrupted run left incomplete): each writes its own copy and renames it into place; neither loads a
    half-written bundle, and no partial copy is left behind."""
    from concurrent.futures import ProcessPoolExecutor

    from cosyvoice.tools import make_tiny_bundle as tool

    monkeypatch.setattr(tool, "DEFAULT_MODEL_DIR", tmp_path / "absent")  # the workers are forked: they see it
    demo = tmp_path / "pretrained_models" / ".tiny-demo"
    demo.mkdir(parents=True)
    (demo / "cosyvoice3.yaml").write_text("interrupted")
    with ProcessPoolExecutor(2) as pool:
        found = list(pool.map(tool.model_dir_or_demo, [None, None], [demo, demo]))
    assert found == [(demo, True), (demo, True)]
    validate_model_dir(demo)
    assert [p.name for p in demo.parent.iterdir()] == [".tiny-demo"]
