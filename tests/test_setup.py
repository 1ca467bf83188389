"""scripts/setup.sh installs only what is missing: a current stamp means no pip call (and no network)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import install_state  # noqa: E402  (a script, not a package)


def _copy_inputs(dst: Path) -> Path:
    for name in install_state.INPUTS:
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, dst / name)
    return dst


def test_stamp_follows_pyproject_and_extras(tmp_path: Path) -> None:
    root = _copy_inputs(tmp_path / "repo")
    env = tmp_path / "venv"
    env.mkdir()
    assert not install_state.is_current(env, "dev", root)  # nothing recorded yet
    install_state.mark(env, "dev", root)
    assert install_state.is_current(env, "dev", root)
    assert install_state.is_current(env, "ui", root)  # dev pulls in ui (cosyvoice3-studio[ui])
    assert not install_state.is_current(env, "ui,download", root)  # download was never installed (dev does not pull it)
    install_state.mark(env, "download", root)
    assert install_state.is_current(env, "ui,download", root)  # extras accumulate under one key
    pyproject = root / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('"numpy>=1.24"', '"numpy>=1.25"'))
    assert not install_state.is_current(env, "dev", root)  # an edited dependency list means a new install
    install_state.mark(env, "ui", root)
    assert install_state.is_current(env, "ui", root)
    assert not install_state.is_current(env, "download", root)  # extras from before the edit no longer count


def _setup(env_dir: Path, extras: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COSYVOICE_VENV": str(env_dir), "COSYVOICE_EXTRAS": extras,
           # no package index and no pip configuration: a pip install would fail here
           "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull}
    env.pop("PIP_FIND_LINKS", None)
    return subprocess.run(["bash", "scripts/setup.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="setup.sh would install ffmpeg with apt first")
def test_a_current_stamp_means_no_pip_call(tmp_path: Path) -> None:
    # A venv without pip: if setup.sh ran pip at all it would fail with "No module named pip".
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = str(env_dir / "bin" / "python")
    assert subprocess.run([python, "-c", "import pip"], capture_output=True).returncode != 0

    subprocess.run([python, "scripts/install_state.py", "mark", str(env_dir), "ui"], cwd=ROOT, check=True)
    done = _setup(env_dir, "ui")
    assert done.returncode == 0, done.stderr
    assert "installing" not in done.stderr
    assert _setup(env_dir, "ui", "--check").returncode == 0

    (env_dir / install_state.STAMP).write_text("stale\nui\n")  # e.g. pyproject.toml changed since
    check = _setup(env_dir, "ui", "--check")
    assert check.returncode == 1 and "python packages not installed" in check.stderr


def _names(requirements: list[str]) -> set[str]:
    return {re.sub(r"\s+", "", r) for r in requirements if not r.startswith("cosyvoice3-studio")}


def test_space_requirements_equal_pyproject() -> None:
    """The Space installs requirements.txt (it cannot read pyproject.toml): the two lists must not drift."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    expected = _names(project["dependencies"] + extras["ui"] + extras["download"])
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    assert _names([ln for ln in lines if ln.strip() and not ln.startswith("#")]) == expected
