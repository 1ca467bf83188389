"""The parity command line: a table per component, exit 0 on the shared fixtures, 1 when anything is off."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.numpy import load_file, save_file

from cosyvoice.tools.parity.__main__ import main
from cosyvoice.tools.parity.common import Golden


def test_every_component_passes_on_the_golden_set(golden: Golden, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--golden", str(golden.root)]) == 0
    out = capsys.readouterr().out
    for component in ("text", "frontend", "llm", "bistream", "flow", "hift", "t2w"):
        assert f"({component}:" in out
    assert " FAIL " not in out and "0 failed" in out


def test_a_perturbed_reference_fails_with_exit_code_1(golden: Golden, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    copy = tmp_path / "golden"
    shutil.copytree(golden.root, copy)
    arrays = load_file(str(copy / "t2w.safetensors"))
    arrays["chunk1_pcm"] = arrays["chunk1_pcm"] + 5e-3  # above the 1e-3 token2wav tolerance
    (copy / "t2w.safetensors").chmod(0o644)
    save_file(arrays, str(copy / "t2w.safetensors"))
    assert main(["--golden", str(copy), "--only", "t2w"]) == 1
    out = capsys.readouterr().out
    assert "chunk1_pcm" in out and "FAIL" in out and "chunk0_pcm" in out


def test_a_component_that_crashes_is_reported_not_hidden(golden: Golden, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    copy = tmp_path / "golden"
    shutil.copytree(golden.root, copy)
    (copy / "hift.safetensors").chmod(0o644)
    (copy / "hift.safetensors").write_bytes(b"not safetensors")
    assert main(["--golden", str(copy), "--only", "hift"]) == 1
    assert "(error)" in capsys.readouterr().out


def test_bf16_report_needs_cuda(golden: Golden, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--golden", str(golden.root), "--dtype", "bf16"])
    assert "needs --device cuda" in capsys.readouterr().err


def test_t2w_separates_defects_from_amplification(golden: Golden, capsys: pytest.CaptureFixture[str]) -> None:
    """Per chunk: the recompute path's PCM (real defects), the incremental flow's mel against it (rounding only)."""
    assert main(["--golden", str(golden.root), "--only", "t2w"]) == 0
    out = capsys.readouterr().out
    for i in range(3):
        assert f"chunk{i}_pcm_recompute" in out and f"chunk{i}_mel_stream_vs_recompute" in out
