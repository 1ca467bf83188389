"""Export CI: the tiny bundle's DiT and vocoder graphs pass onnx.checker and onnxruntime-CPU equals PyTorch.

Tolerance (fp32): max |onnxruntime - PyTorch| <= 1e-4 + rtol x max |PyTorch| per output, rtol 1e-4 for the
DiT (measured ~2e-6) and 2e-3 for the vocoder's waveform (measured up to ~1.3e-3 with random tiny weights: the
folded weight norm and the DFT-basis STFT round differently, and exp() of the predicted magnitude amplifies it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from cosyvoice.backends import ensure_onnx
from cosyvoice.backends.export import ATOL, MANIFEST, OPSET, RTOL, VOCODER_RTOL, export_onnx, parity_table, sha256_file
from cosyvoice.backends.graphs import DFTSpectral, modulation_inputs
from cosyvoice.backends.quant import fuse_gelu
from cosyvoice.bundle import validate_model_dir


@pytest.fixture(scope="module")
def exported(tiny_bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("onnx")
    return out, export_onnx(tiny_bundle_dir, out, fp16=True, int8=True)


def test_every_graph_passes_the_checker_and_matches_pytorch(exported: tuple[Path, dict]) -> None:
    out, manifest = exported
    assert set(manifest["graphs"]) == {f"{g}.{p}.onnx" for g in ("flow_estimator", "flow_estimator_cached")
                                       for p in ("fp32", "fp16", "int8")} | {"vocoder.fp32.onnx"}
    for name, graph in manifest["graphs"].items():
        onnx.checker.check_model(str(out / name), full_check=True)
        assert graph["sha256"] == sha256_file(out / name)
        parity = graph["parity"]
        assert parity["ok"] and parity["max_abs_diff"] <= parity["bound"], (name, parity)
        if name.startswith("flow_estimator") and graph["precision"] == "fp32":
            assert (parity["atol"], parity["rtol"]) == (ATOL, RTOL)
            assert parity["max_abs_diff"] < 1e-4, (name, parity)  # far inside the bound, as measured
    assert manifest["graphs"]["vocoder.fp32.onnx"]["parity"]["rtol"] == VOCODER_RTOL
    assert manifest["opset"] == OPSET
    assert json.loads((out / MANIFEST).read_text()) == manifest
    assert "| vocoder.fp32.onnx | fp32 |" in parity_table(manifest)


def test_graphs_have_dynamic_batch_and_time_axes(exported: tuple[Path, dict], tiny_bundle_dir: Path) -> None:
    """Shapes other than the export example run, and match PyTorch there too (batch 4, 37 frames)."""
    out, manifest = exported
    inputs = {i["name"]: i["shape"] for i in manifest["graphs"]["flow_estimator.fp32.onnx"]["inputs"]}
    assert inputs["x"] == ["batch", 80, "frames"] and inputs["mask"] == ["frames", "frames"]
    flow = validate_model_dir(tiny_bundle_dir).load_flow()
    dit = flow.decoder.estimator
    g = torch.Generator().manual_seed(1)
    x, mu, cond = (torch.randn(4, 80, 37, generator=g) for _ in range(3))
    t, spks = torch.rand(4, generator=g), torch.randn(4, 80, generator=g)
    mask = dit.attention_mask(37, streaming=True, device=x.device)
    with torch.inference_mode():
        ref = dit(x, mu, t, spks, cond, streaming=True)
        time = {name: value.numpy() for name, value in modulation_inputs(dit.modulation(t)).items()}
    session = ort.InferenceSession(str(out / "flow_estimator.fp32.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, {"x": x.numpy(), "mu": mu.numpy(), **time, "spks": spks.numpy(),
                             "cond": cond.numpy(), "mask": mask.numpy()})[0]
    assert np.abs(got - ref.numpy()).max() <= ATOL + RTOL * ref.abs().max().item()


def test_the_int8_graphs_run_one_fused_gelu_per_block(exported: tuple[Path, dict], tiny_bundle_dir: Path) -> None:
    """The int8 DiT graphs' tanh GELUs are onnxruntime FastGelu nodes, and fusing them moves the fp32 graph's
    velocity by float rounding only."""
    out, _ = exported
    dit = validate_model_dir(tiny_bundle_dir).load_flow().decoder.estimator
    depth = len(dit.transformer_blocks)
    for name in ("flow_estimator", "flow_estimator_cached"):
        ops = [n.op_type for n in onnx.load(str(out / f"{name}.int8.onnx"), load_external_data=False).graph.node]
        assert ops.count("FastGelu") == depth, name
    plain = onnx.load(str(out / "flow_estimator.fp32.onnx"))
    g = torch.Generator().manual_seed(2)
    x, mu, cond = (torch.randn(2, 80, 23, generator=g).numpy() for _ in range(3))
    with torch.inference_mode():
        time = {k: v.numpy() for k, v in modulation_inputs(dit.modulation(torch.tensor([0.3, 0.3]))).items()}
    feed = {"x": x, "mu": mu, **time, "spks": torch.randn(2, 80, generator=g).numpy(), "cond": cond,
            "mask": dit.attention_mask(23, streaming=True, device=torch.device("cpu")).numpy()}
    want = ort.InferenceSession(plain.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    fused = fuse_gelu(plain)
    assert [n.op_type for n in fused.graph.node].count("FastGelu") == depth
    got = ort.InferenceSession(fused.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_dft_basis_stft_and_istft_equal_torch() -> None:
    """The vocoder graph's spectral transforms (convolutions) against torch.stft / torch.istft."""
    window = torch.hann_window(16, periodic=True, dtype=torch.float64).float()
    spectral = DFTSpectral(16, 4, window)
    x = torch.randn(3, 4000, generator=torch.Generator().manual_seed(0))
    ref = torch.view_as_real(torch.stft(x, 16, 4, 16, window=window, return_complex=True))
    real, imag = spectral.stft(x)
    assert torch.allclose(real, ref[..., 0], atol=1e-5) and torch.allclose(imag, ref[..., 1], atol=1e-5)
    back = torch.istft(torch.complex(real, imag), 16, 4, 16, window=window)
    assert torch.allclose(spectral.istft(real, imag), back, atol=1e-5)
    assert torch.allclose(back, x, atol=1e-5)


def test_export_is_reused_until_a_checkpoint_changes(tiny_bundle_dir: Path, tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    shutil.copytree(tiny_bundle_dir, bundle, ignore=shutil.ignore_patterns("onnx"))
    first = ensure_onnx(bundle)
    stamp = (bundle / "onnx" / "vocoder.fp32.onnx").stat().st_mtime_ns
    assert ensure_onnx(bundle) == first
    assert (bundle / "onnx" / "vocoder.fp32.onnx").stat().st_mtime_ns == stamp  # not exported again
    state = torch.load(bundle / "hift.pt")
    state["conv_post.bias"] = state["conv_post.bias"] + 0.01  # a layer inside the vocoder graph
    torch.save(state, bundle / "hift.pt")
    second = ensure_onnx(bundle)
    assert second["sources"]["hift.pt"]["sha256"] != first["sources"]["hift.pt"]["sha256"]
    assert second["graphs"]["vocoder.fp32.onnx"]["sha256"] != first["graphs"]["vocoder.fp32.onnx"]["sha256"]


def test_command_line_prints_the_table(tiny_bundle_dir: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-m", "cosyvoice.bin.export_onnx", str(tiny_bundle_dir), "--out",
                           str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "| flow_estimator_cached.fp32.onnx | fp32 |" in done.stdout and "tolerance:" in done.stdout
    assert (tmp_path / MANIFEST).is_file() and not (tmp_path / "flow_estimator.fp16.onnx").exists()
    missing = subprocess.run([sys.executable, "-m", "cosyvoice.bin.export_onnx", str(tmp_path / "nope")],
                             capture_output=True, text=True, env=env, timeout=120)
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr
