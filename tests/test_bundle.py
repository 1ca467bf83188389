"""Model directory handling: resolving ids, validating every file, strict checkpoint loading."""

from __future__ import annotations

import re
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch

from cosyvoice.bundle import (
    DEFAULT_MODEL_ID,
    REQUIRED_FILES,
    ModelBundle,
    bundle_digest,
    open_model_dir,
    resolve_model_dir,
    validate_model_dir,
)
from cosyvoice.errors import ConfigError, ModelBundleError, WeightsError
from cosyvoice.flow import CausalMaskedDiffWithDiT
from cosyvoice.llm import CosyVoice3LM
from cosyvoice.rng import cfm_noise
from cosyvoice.tools.parity.common import Golden
from cosyvoice.voices import model_identity
from cosyvoice.weights import load_module, load_weights


@pytest.fixture
def bundle_copy(golden: Golden, tmp_path: Path) -> Path:
    """A writable copy of the golden tiny bundle (the shared files are read-only)."""
    return Path(shutil.copytree(golden.bundle_dir, tmp_path / "bundle", copy_function=shutil.copyfile))


def _problems(exc: pytest.ExceptionInfo) -> list[str]:
    return [line for line in str(exc.value).splitlines() if line.startswith("  - ")]


def test_golden_bundle_validates(golden: Golden) -> None:
    bundle = validate_model_dir(golden.bundle_dir)
    assert isinstance(bundle, ModelBundle)
    assert bundle.config.llm.speech_token_size == 6561
    assert bundle.config.hift.upsample_scale == 480
    assert bundle.llm_path.is_file() and bundle.speech_tokenizer_path.is_file() and bundle.tokenizer_dir.is_dir()


@pytest.mark.parametrize("name", REQUIRED_FILES)
def test_missing_file_is_named_with_fix(bundle_copy: Path, name: str) -> None:
    (bundle_copy / name).unlink()
    with pytest.raises(ModelBundleError) as exc:
        validate_model_dir(bundle_copy)
    problems = _problems(exc)
    assert len(problems) == 1
    assert f"{name} missing in {bundle_copy}" in problems[0]
    assert f"modelscope download --model {DEFAULT_MODEL_ID}" in problems[0]


def test_empty_file(bundle_copy: Path) -> None:
    (bundle_copy / "flow.pt").write_bytes(b"")
    with pytest.raises(ModelBundleError, match=r"flow\.pt is empty"):
        validate_model_dir(bundle_copy)


def test_truncated_checkpoint(bundle_copy: Path) -> None:
    data = (bundle_copy / "llm.pt").read_bytes()
    (bundle_copy / "llm.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError) as exc:
        validate_model_dir(bundle_copy)
    (problem,) = _problems(exc)
    assert "llm.pt is truncated" in problem and "modelscope download" in problem


def test_damaged_pickle_inside_checkpoint(bundle_copy: Path) -> None:
    data = bytearray((bundle_copy / "hift.pt").read_bytes())
    pickle_at = data.index(b"\x80\x02")  # data.pkl is the first record; corrupt its opcodes in place
    data[pickle_at + 2: pickle_at + 40] = b"\xff" * 38
    (bundle_copy / "hift.pt").write_bytes(bytes(data))
    with pytest.raises(WeightsError, match=r"hift\.pt"):
        validate_model_dir(bundle_copy)


def test_truncated_and_swapped_onnx(bundle_copy: Path) -> None:
    data = (bundle_copy / "campplus.onnx").read_bytes()
    (bundle_copy / "campplus.onnx").write_bytes(data[:-100])
    shutil.copyfile(bundle_copy / "CosyVoice-BlankEN" / "vocab.json", bundle_copy / "speech_tokenizer_v3.onnx")
    with pytest.raises(ModelBundleError) as exc:
        validate_model_dir(bundle_copy)
    problems = _problems(exc)
    assert len(problems) == 2
    assert "campplus.onnx is truncated or not an ONNX model" in problems[0]
    assert "speech_tokenizer_v3.onnx" in problems[1]


def test_onnx_with_wrong_input_count(bundle_copy: Path) -> None:
    shutil.copyfile(bundle_copy / "campplus.onnx", bundle_copy / "speech_tokenizer_v3.onnx")
    with pytest.raises(ModelBundleError, match=r"speech_tokenizer_v3\.onnx has 1 graph inputs \['input'\]"):
        validate_model_dir(bundle_copy)


def test_all_problems_reported_at_once(bundle_copy: Path) -> None:
    (bundle_copy / "hift.pt").unlink()
    (bundle_copy / "CosyVoice-BlankEN" / "vocab.json").write_text("{not json", encoding="utf-8")
    (bundle_copy / "CosyVoice-BlankEN" / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    with pytest.raises(ModelBundleError) as exc:
        validate_model_dir(bundle_copy)
    assert type(exc.value) is ModelBundleError
    problems = _problems(exc)
    assert [p.split()[1] for p in problems] == ["hift.pt", "CosyVoice-BlankEN/vocab.json",
                                                "CosyVoice-BlankEN/merges.txt"]
    assert "3 problem(s)" in str(exc.value)


def test_wrong_speech_token_size(bundle_copy: Path) -> None:
    yaml_path = bundle_copy / "cosyvoice3.yaml"
    text = yaml_path.read_text(encoding="utf-8")
    assert text.count("speech_token_size: 6561") == 1
    yaml_path.write_text(text.replace("speech_token_size: 6561", "speech_token_size: 6000"), encoding="utf-8")
    with pytest.raises(ConfigError) as exc:
        validate_model_dir(bundle_copy)
    assert "6000" in str(exc.value) and "6561" in str(exc.value)


def test_malformed_yaml(bundle_copy: Path) -> None:
    (bundle_copy / "cosyvoice3.yaml").write_text("llm: !new:cosyvoice.llm.llm.CosyVoice3LM\n  a: [1, 2\n",
                                                 encoding="utf-8")
    with pytest.raises(ConfigError, match=r"cosyvoice3\.yaml is not valid yaml"):
        validate_model_dir(bundle_copy)


def test_yaml_is_never_executed(bundle_copy: Path, tmp_path: Path) -> None:
    marker = tmp_path / "executed"
    yaml_path = bundle_copy / "cosyvoice3.yaml"
    payload = f"__evil: !apply:pathlib.Path.touch [!apply:pathlib.Path ['{marker}']]\n"
    yaml_path.write_text(payload + yaml_path.read_text(encoding="utf-8"), encoding="utf-8")
    validate_model_dir(bundle_copy)
    assert not marker.exists()


def test_renamed_checkpoint_key_fails_strict_load(bundle_copy: Path) -> None:
    state = torch.load(bundle_copy / "llm.pt", weights_only=True)
    state["llm_decoder.weight_renamed"] = state.pop("llm_decoder.weight")
    torch.save(state, bundle_copy / "llm.pt")
    bundle = validate_model_dir(bundle_copy)  # the file itself is intact
    with pytest.raises(WeightsError) as exc:
        bundle.load_llm()
    message = str(exc.value)
    assert "llm.pt" in message
    assert "missing keys: llm_decoder.weight" in message
    assert "unexpected keys: llm_decoder.weight_renamed" in message


def test_golden_llm_loads_strictly(golden: Golden) -> None:
    llm = validate_model_dir(golden.bundle_dir).load_llm()
    reference = torch.load(golden.bundle_dir / "llm.pt", weights_only=True)
    assert torch.equal(llm.state_dict()["speech_embedding.weight"], reference["speech_embedding.weight"])
    assert not llm.training


def test_golden_hift_loads_with_training_prefix_and_legacy_names(bundle_copy: Path) -> None:
    state = torch.load(bundle_copy / "hift.pt", weights_only=True)
    legacy = {}
    for key, value in state.items():
        key = key.replace("parametrizations.weight.original0", "weight_g")
        key = key.replace("parametrizations.weight.original1", "weight_v")
        legacy["generator." + key] = value
    torch.save(legacy, bundle_copy / "hift.pt")
    hift = validate_model_dir(bundle_copy).load_hift()
    loaded = hift.state_dict()
    assert all(torch.equal(loaded[key], value) for key, value in state.items())


def _copy_loaded(module: torch.nn.Module, path: Path) -> dict[str, torch.Tensor]:
    """The state of ``module`` (built on the CPU, randomly initialised) after copying the checkpoint into it."""
    load_weights(module, path)
    return module.state_dict()


def test_llm_and_flow_take_the_checkpoints_tensors_bit_equal_to_a_copying_load(golden: Golden) -> None:
    """Built on the meta device and given the checkpoint's tensors (weights.load_module): the same values, ties and
    buffers as building on the CPU and copying the checkpoint in, with no initialised weights beside them."""
    bundle = validate_model_dir(golden.bundle_dir)
    llm, flow = bundle.load_llm(), bundle.load_flow()
    for module, built, path in ((llm, CosyVoice3LM(bundle.config.llm), bundle.llm_path),
                                (flow, CausalMaskedDiffWithDiT(bundle.config.flow), bundle.flow_path)):
        copied = _copy_loaded(built, path)
        loaded = module.state_dict()
        assert sorted(loaded) == sorted(copied)
        assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in copied.items())
        assert all(p.device.type == "cpu" and p.is_contiguous() for p in module.parameters())
    assert llm.llm.model.lm_head.weight is llm.llm.embed_tokens.weight  # still one tensor under two names
    assert torch.equal(flow.decoder.noise, cfm_noise())  # not in flow.pt: made on the CPU, not the meta device


def test_tied_weights_take_the_last_loaded_tensor_and_other_dtypes_convert_as_a_copy_would(bundle_copy: Path) -> None:
    state = torch.load(bundle_copy / "llm.pt", weights_only=True)
    head = "llm.model.lm_head.weight"
    state[head] = state[head] + 1  # a file whose tied matrices differ: the one loaded last (the head) wins
    state["speech_embedding.weight"] = state["speech_embedding.weight"].half()
    state["llm_decoder.weight"] = state["llm_decoder.weight"].t().contiguous().t()  # a transposed layout
    torch.save(state, bundle_copy / "llm.pt")
    bundle = validate_model_dir(bundle_copy)
    copied = _copy_loaded(CosyVoice3LM(bundle.config.llm), bundle.llm_path)
    llm = bundle.load_llm()
    assert all(torch.equal(llm.state_dict()[k], v) for k, v in copied.items())
    assert torch.equal(llm.llm.embed_tokens.weight, state[head]) and llm.llm.model.lm_head.weight is \
        llm.llm.embed_tokens.weight
    assert llm.speech_embedding.weight.dtype == torch.float32 and llm.llm_decoder.weight.is_contiguous()


def test_a_module_holding_a_tensor_its_checkpoint_lacks_cannot_be_built_on_the_meta_device(tmp_path: Path) -> None:
    class WithTable(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(3, 2)
            self.register_buffer("table", torch.arange(4.0), persistent=False)  # made in __init__, not in the file

    torch.save(torch.nn.Linear(3, 2).state_dict(), tmp_path / "w.pt")
    torch.save({f"linear.{k}": v for k, v in torch.nn.Linear(3, 2).state_dict().items()}, tmp_path / "m.pt")
    assert torch.equal(load_module(lambda: torch.nn.Linear(3, 2), tmp_path / "w.pt").weight,
                       torch.load(tmp_path / "w.pt")["weight"])
    with pytest.raises(AssertionError, match="table"):
        load_module(WithTable, tmp_path / "m.pt")


# ----------------------------------------------------------------------------- resolving ids and paths


@pytest.fixture
def fake_modelscope(monkeypatch: pytest.MonkeyPatch, golden: Golden) -> list[tuple[str, str]]:
    """Install a stand-in ``modelscope`` whose snapshot_download copies the golden bundle."""
    calls: list[tuple[str, str]] = []

    def snapshot_download(model_id: str, local_dir: str) -> str:
        calls.append((model_id, local_dir))
        shutil.copytree(golden.bundle_dir, local_dir, copy_function=shutil.copyfile, dirs_exist_ok=True)
        return local_dir

    module = types.ModuleType("modelscope")
    module.snapshot_download = snapshot_download  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "modelscope", module)
    return calls


def test_model_id_is_downloaded_under_root(fake_modelscope: list, tmp_path: Path) -> None:
    root = tmp_path / "models"
    bundle = open_model_dir(DEFAULT_MODEL_ID, download_root=root)
    assert len(fake_modelscope) == 1
    model_id, local_dir = fake_modelscope[0]
    assert model_id == DEFAULT_MODEL_ID
    assert Path(local_dir) == root / "Fun-CosyVoice3-0.5B-2512"
    assert bundle.root == Path(local_dir)
    # a complete earlier download is reused without the network
    assert resolve_model_dir(DEFAULT_MODEL_ID, download_root=root) == Path(local_dir)
    assert len(fake_modelscope) == 1


def test_local_directory_is_used_as_is(golden: Golden, fake_modelscope: list) -> None:
    assert resolve_model_dir(golden.bundle_dir) == golden.bundle_dir
    assert resolve_model_dir(str(golden.bundle_dir)) == golden.bundle_dir
    assert fake_modelscope == []


def test_modelscope_not_installed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "modelscope", None)  # makes `import modelscope` raise ImportError
    with pytest.raises(ModelBundleError, match=r"pip install modelscope`, or download the model yourself"):
        resolve_model_dir(DEFAULT_MODEL_ID, download_root=tmp_path)


def test_download_failure_is_wrapped(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def snapshot_download(model_id: str, local_dir: str) -> str:
        raise ConnectionError("Name or service not known")

    module = types.ModuleType("modelscope")
    module.snapshot_download = snapshot_download  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "modelscope", module)
    with pytest.raises(ModelBundleError, match=r"downloading 'owner/missing' .* failed \(ConnectionError: Name or"):
        resolve_model_dir("owner/missing", download_root=tmp_path)


@pytest.mark.parametrize("name", ["no_such_dir", "./a/b/c", "/definitely/not/here", "pretrained_models/absent",
                                  "models/absent"])
def test_nonexistent_path_that_is_not_an_id(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            fake_modelscope: list) -> None:
    """A missing folder is said to be missing, with the download hint, also where it reads like owner/name: under
    the download folder, or under a folder that exists here."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    said = rf"^model directory {re.escape(str(Path(name)))} does not exist; download the model with `modelscope"
    with pytest.raises(ModelBundleError, match=said):
        resolve_model_dir(name)
    assert fake_modelscope == []  # nothing was downloaded


def test_file_instead_of_directory(golden: Golden) -> None:
    with pytest.raises(ModelBundleError, match=r"is a file"):
        resolve_model_dir(golden.bundle_dir / "llm.pt")
    with pytest.raises(ModelBundleError, match=r"does not exist"):
        validate_model_dir(golden.bundle_dir / "llm.pt")


def test_bundle_digest_covers_every_weight_file(tiny_bundle_dir: Path, tmp_path: Path) -> None:
    """A take's model id tells checkpoints apart (the voice library's cheaper identity ignores the .pt files)."""
    copy = tmp_path / "bundle"
    shutil.copytree(tiny_bundle_dir, copy)
    digest = bundle_digest(tiny_bundle_dir)
    assert re.fullmatch(r"[0-9a-f]{64}", digest) and bundle_digest(copy) == digest
    data = bytearray((copy / "flow.pt").read_bytes())
    data[len(data) // 2] ^= 1  # one bit of the checkpoint
    (copy / "flow.pt").write_bytes(bytes(data))
    changed = bundle_digest(copy)
    assert changed != digest and model_identity(copy) == model_identity(tiny_bundle_dir)
    assert bundle_digest(copy) == changed  # remembered, and still the same on asking again
