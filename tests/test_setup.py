"""scripts/setup.sh installs only what is missing: a current stamp means no pip call (and no network)."""

from __future__ import annotations

import importlib.metadata
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


def _names(requirements: list[str], extras: dict[str, list[str]] | None = None) -> set[str]:
    """The requirements as written, an extra of our own (``cosyvoice3-studio[longform]``) replaced by its list."""
    names: set[str] = set()
    for r in requirements:
        own = re.fullmatch(r"cosyvoice3-studio\[(.+)\]", r.strip())
        if own is None:
            names.add(re.sub(r"\s+", "", r))
        elif extras is not None:
            names |= _names([req for extra in own.group(1).split(",") for req in extras[extra.strip()]], extras)
    return names


def test_space_requirements_equal_pyproject() -> None:
    """The Space installs requirements.txt (it cannot read pyproject.toml): the two lists must not drift."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    expected = _names(project["dependencies"] + extras["ui"] + extras["download"], extras)
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    assert _names([ln for ln in lines if ln.strip() and not ln.startswith("#")]) == expected


# ----------------------------------------------------------------------------- which torch build (issue 12 item 20)


def test_torch_plan_picks_cpu_without_a_gpu_and_cuda_with_one() -> None:
    asked: list[str] = []

    def reachable(url: str) -> bool:
        asked.append(url)
        return True

    plan = install_state.torch_plan({}, gpu=False, reachable=reachable)
    assert plan.build == "cpu" and plan.pip_args == ("--index-url", install_state.CPU_INDEX)
    assert asked == [install_state.CPU_INDEX] and "about 200 MB" in plan.message
    cuda = install_state.torch_plan({}, gpu=True, reachable=reachable)
    assert cuda.build == "cuda" and cuda.pip_args == () and "about 3 GB" in cuda.message
    assert asked == [install_state.CPU_INDEX]  # a GPU box never probes the CPU index
    # where PyTorch's CPU index cannot be reached (this CI: a local CPU wheel), pip's own configuration decides
    offline = install_state.torch_plan({}, gpu=False, reachable=lambda url: False)
    assert offline.build == "configured" and offline.pip_args == () and "cannot be reached" in offline.message
    assert "3 GB" not in offline.message  # which build those indexes hold is said after installing it
    # the user decides over what was seen; a mirror replaces the CPU index
    assert install_state.torch_plan({"COSYVOICE_TORCH": "cpu"}, gpu=True, reachable=reachable).build == "cpu"
    assert install_state.torch_plan({"COSYVOICE_TORCH": "cuda"}, gpu=False, reachable=reachable).build == "cuda"
    assert install_state.torch_plan({"COSYVOICE_TORCH": "configured"}, gpu=False, reachable=reachable).pip_args == ()
    mirror = install_state.torch_plan({"COSYVOICE_TORCH_CPU_INDEX": "https://mirror.example/cpu"}, gpu=False,
                                      reachable=reachable)
    assert mirror.pip_args == ("--index-url", "https://mirror.example/cpu")
    with pytest.raises(ValueError, match="use cpu, cuda or configured"):
        install_state.torch_plan({"COSYVOICE_TORCH": "rocm"}, gpu=False, reachable=reachable)


def test_an_install_the_disk_cannot_hold_is_refused_before_pip_starts(tmp_path: Path) -> None:
    """pip reports a full disk only after minutes of downloads: setup refuses first, saying where and how much."""
    cuda = install_state.TorchPlan("cuda", (), "")
    venv, temp = tmp_path / ".venv", tmp_path / "tmp"
    gb = 10 ** 9

    def one_disk(free_gb: float):
        return {"free": lambda p: int(free_gb * gb), "device": lambda p: 1}

    assert install_state.room_problem(cuda, venv, temp, **one_disk(40)) is None
    short = install_state.room_problem(cuda, venv, temp, **one_disk(8))
    assert short.startswith("not enough disk for torch==2.13.0 (cuda build)")
    assert f"{tmp_path} has 8.0 GB free, the install needs about 8.5 GB there" in short  # venv + downloads, one disk
    assert install_state.room_problem(install_state.TorchPlan("cpu", (), ""), venv, temp, **one_disk(8)) is None
    # the downloads on another disk than the venv: each is checked for its own part
    apart = install_state.room_problem(cuda, venv, temp, free=lambda p: (2 if p == temp else 9) * gb,
                                       device=lambda p: 2 if p == temp else 1)
    assert f"{temp} has 2.0 GB free, the install needs about 3.5 GB there" in apart
    assert f"{tmp_path} has" not in apart  # the venv's disk has its 6.5 GB
    # a configured index may hold the small CPU build: a warning only
    configured = install_state.TorchPlan("configured", (), "")
    assert install_state.room_problem(configured, venv, temp, **one_disk(8)).startswith("WARNING: if pip's configured")
    # the real disk, through the command setup.sh runs: this machine has room for the CPU plan at least
    assert install_state.room_problem(install_state.TorchPlan("cpu", (), ""), venv, tmp_path) is None


def test_the_installed_torch_build_is_read_from_its_metadata() -> None:
    assert install_state.torch_build("2.13.0+cpu", ["filelock"]) == "torch 2.13.0+cpu, the CPU build"
    assert install_state.torch_build("2.11.0+cu128", []) == "torch 2.11.0+cu128, the CUDA 12.8 build"
    assert install_state.torch_build("2.13.0+rocm6.4", []) == "torch 2.13.0+rocm6.4, the ROCm 6.4 build"
    pypi_linux = ["filelock", 'nvidia-cublas-cu12==12.8.4.1; platform_system == "Linux"']
    assert "the CUDA build" in install_state.torch_build("2.13.0", pypi_linux)
    assert install_state.torch_build("2.13.0", ["filelock"]) == "torch 2.13.0, the CPU build"  # e.g. macOS
    done = subprocess.run([sys.executable, "scripts/install_state.py", "torch-installed"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=True)
    import torch

    # the wheel's metadata, as pip installed it: PyPI's CUDA build says 2.13.0 there, while torch.__version__
    # reads 2.13.0+cu130
    assert done.stdout.startswith(f"torch {importlib.metadata.version('torch')}, the ")
    assert ("CUDA" in done.stdout) == (torch.version.cuda is not None)


def test_an_nvidia_gpu_is_seen_by_its_driver_or_nvidia_smi(tmp_path: Path) -> None:
    proc, bin_dir = tmp_path / "proc", tmp_path / "bin"
    proc.mkdir()
    bin_dir.mkdir()
    assert not install_state.has_nvidia_gpu({"PATH": str(bin_dir)}, proc)
    (proc / "driver" / "nvidia").mkdir(parents=True)
    assert install_state.has_nvidia_gpu({"PATH": str(bin_dir)}, proc)
    (proc / "driver" / "nvidia").rmdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n")
    smi.chmod(0o755)
    assert install_state.has_nvidia_gpu({"PATH": str(bin_dir)}, proc)


def _torch_plan_cli(env: dict[str, str]) -> list[str]:
    done = subprocess.run([sys.executable, "scripts/install_state.py", "torch-plan", str(ROOT / ".venv")], cwd=ROOT,
                          env=env,
                          capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.strip().splitlines()


def test_torch_plan_command_as_setup_sh_reads_it(tmp_path: Path) -> None:
    """The command setup.sh runs, in fake environments: a CPU index served on loopback, one that is down, a
    fake nvidia-smi on PATH. Line 1 is the message setup.sh prints, the rest are pip's arguments."""
    import http.server
    import socketserver
    import threading

    (tmp_path / "whl" / "cpu" / "torch").mkdir(parents=True)
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path))  # noqa: E731
    with socketserver.TCPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        index = f"http://127.0.0.1:{server.server_address[1]}/whl/cpu"
        base = {"PATH": "/usr/bin:/bin", "COSYVOICE_TORCH_CPU_INDEX": index}
        if install_state.has_nvidia_gpu(base):
            pytest.skip("this machine has an NVIDIA driver: the no-GPU cases cannot be faked here")
        lines = _torch_plan_cli(base)
        assert lines[1:] == ["--index-url", index, install_state.TORCH_REQUIREMENT] and "CPU build" in lines[0]
        server.shutdown()
    down = _torch_plan_cli(base)  # the server is gone: nothing answers on that port
    assert down[1:] == [install_state.TORCH_REQUIREMENT] and "cannot be reached" in down[0]
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "nvidia-smi").write_text("#!/bin/sh\n")
    (fake_bin / "nvidia-smi").chmod(0o755)
    gpu = _torch_plan_cli({**base, "PATH": f"{fake_bin}:/usr/bin:/bin"})
    assert gpu[1:] == [install_state.TORCH_REQUIREMENT] and "NVIDIA GPU was found" in gpu[0]


def test_setup_on_a_fresh_machine_without_gpu_asks_the_cpu_index(tmp_path: Path) -> None:
    """setup.sh end to end on a fake fresh machine (a Python without torch, no NVIDIA driver, a CPU index served
    on loopback with no wheels in it): it says what it will download, and pip asks that index for torch."""
    import http.server
    import socketserver
    import threading

    base_python = shutil.which("python3", path="/usr/bin:/bin")
    if base_python is None or subprocess.run([base_python, "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip("needs a system python3 without torch (a fresh machine's)")
    if install_state.has_nvidia_gpu({"PATH": "/usr/bin:/bin"}):
        pytest.skip("this machine has an NVIDIA driver: the no-GPU case cannot be faked here")
    (tmp_path / "whl" / "cpu" / "torch").mkdir(parents=True)
    asked: list[tuple[str, str]] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args) -> None:
            super().__init__(*args, directory=str(tmp_path))

        def do_GET(self) -> None:
            asked.append((self.path, self.headers.get("User-Agent", "")))
            super().do_GET()

        def log_message(self, *args) -> None:
            pass

    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        index = f"http://127.0.0.1:{server.server_address[1]}/whl/cpu"
        env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": base_python,
               "COSYVOICE_VENV": str(tmp_path / "venv"), "COSYVOICE_EXTRAS": "ui", "COSYVOICE_TORCH_CPU_INDEX": index,
               "PIP_CONFIG_FILE": os.devnull}  # pip's own configuration (this CI's local wheels) is not used
        done = subprocess.run(["bash", "scripts/setup.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
        server.shutdown()
    assert done.returncode != 0  # the fake index holds no torch
    assert f"[setup] torch: no NVIDIA GPU found: downloading the CPU build of torch==2.13.0 from {index}" in done.stderr
    assert f"Looking in indexes: {index}" in done.stdout  # pip's own progress is shown, not silenced
    assert ("/whl/cpu/torch/", asked[0][1]) == asked[0] and asked[0][1].startswith("Python-urllib")  # the probe
    assert any(path.startswith("/whl/cpu/torch") and agent.startswith("pip/") for path, agent in asked), asked
