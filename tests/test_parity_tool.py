"""The parity command line: a table per component, exit 0 on the shared fixtures, 1 when anything is off."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from cosyvoice.tools.parity.__main__ import main
from cosyvoice.tools.parity.common import Golden


def test_every_component_passes_on_the_golden_set(golden: Golden, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--golden", str(golden.root)]) == 0
    out = capsys.readouterr().out
    for component in ("text", "frontend", "llm", "bistream", "flow", "hift", "t2w", "e2e"):
        assert f"({component}:" in out
    assert " FAIL " not in out and "0 failed" in out


def _perturbed_copy(golden: Golden, tmp_path: Path, filename: str, **changes) -> Path:
    """A copy of the golden folder where ``filename``'s arrays are replaced by ``changes[name](array)``."""
    copy = tmp_path / "golden"
    shutil.copytree(golden.root, copy)
    arrays = load_file(str(copy / filename))
    for name, change in changes.items():
        arrays[name] = change(arrays[name])
    (copy / filename).chmod(0o644)
    save_file(arrays, str(copy / filename))
    return copy


def _row(out: str, name: str) -> str:
    return next(line for line in out.splitlines() if line.split()[1:2] == [name])


def test_a_vocoder_defect_fails_below_the_end_to_end_pcm_bound(golden: Golden, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """5e-4 on one chunk's PCM is within the end-to-end bound, but the vocoder fed the reference's mel shows it."""
    copy = _perturbed_copy(golden, tmp_path, "t2w.safetensors", chunk1_pcm=lambda a: a + 5e-4)
    assert main(["--golden", str(copy), "--only", "t2w"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in _row(out, "chunk1_vocoder_on_ref_mel") and "PASS" in _row(out, "chunk1_pcm")
    assert "PASS" in _row(out, "chunk0_vocoder_on_ref_mel") and "PASS" in _row(out, "chunk1_mel")


def test_a_flow_defect_fails_the_mel_row(golden: Golden, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    copy = _perturbed_copy(golden, tmp_path, "t2w.safetensors", chunk2_flow_mel_used=lambda a: a + 2e-5)
    assert main(["--golden", str(copy), "--only", "t2w"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in _row(out, "chunk2_mel") and "PASS" in _row(out, "chunk1_mel")


def test_features_are_judged_with_atol_plus_rtol(golden: Golden, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The golden README's feature rule, atol 1e-4 + rtol 1e-5: a 1.17e-4 move of a large fbank value (as one AMD
    EPYC CPU gives) passes; 3e-4 fails."""
    def move(delta: float):
        def change(a: np.ndarray) -> np.ndarray:
            a = a.copy()
            i = np.unravel_index(np.argmax(np.abs(a)), a.shape)
            assert abs(a[i]) > 5.0
            a[i] += np.float32(delta)
            return a
        return change

    copy = _perturbed_copy(golden, tmp_path, "frontend.safetensors", kaldi_fbank80_raw=move(1.17e-4))
    assert main(["--golden", str(copy), "--only", "frontend"]) == 0
    assert "1.173e-04" in _row(capsys.readouterr().out, "kaldi_fbank80_raw")
    shutil.rmtree(copy)
    copy = _perturbed_copy(golden, tmp_path, "frontend.safetensors", kaldi_fbank80_raw=move(3e-4))
    assert main(["--golden", str(copy), "--only", "frontend"]) == 1
    assert "FAIL" in _row(capsys.readouterr().out, "kaldi_fbank80_raw")


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


def test_t2w_rows_where_a_defect_would_show(golden: Golden, capsys: pytest.CaptureFixture[str]) -> None:
    """Per chunk: the mel that feeds the vocoder, the vocoder on the reference's mel, the end-to-end PCM."""
    assert main(["--golden", str(golden.root), "--only", "t2w"]) == 0
    out = capsys.readouterr().out
    for i in range(3):
        assert "1.0e-05" in _row(out, f"chunk{i}_mel") and "2.0e-04" in _row(out, f"chunk{i}_vocoder_on_ref_mel")
        assert "5.0e-03" in _row(out, f"chunk{i}_pcm")
