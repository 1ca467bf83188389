"""Whether the project's virtual environment already holds what scripts/setup.sh would install, and which
torch build it should install.

    python scripts/install_state.py check VENV EXTRAS   # exit 0 when up to date, 1 otherwise
    python scripts/install_state.py mark VENV EXTRAS    # record a successful install of EXTRAS
    python scripts/install_state.py torch-plan VENV     # line 1: what will be downloaded; then pip's arguments
                                                        # (exit 3: not enough disk for it, said why)
    python scripts/install_state.py torch-installed     # which torch build is installed (CPU, CUDA x.y, ...)

Run with the venv's own interpreter. The stamp holds a hash of what decides the install (pyproject.toml,
scripts/setup.sh, this interpreter's version and location) and the extras installed under it, so a second
start makes no pip call and needs no network, while an edited dependency list or another Python triggers a
fresh install. Extras that name other extras of the project (dev -> ui) count as installed too, so the web
UI starts without pip after the tests' install. Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import tempfile
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INPUTS = ("pyproject.toml", "scripts/setup.sh")
STAMP = ".cosyvoice-installed"


def stamp_key(root: Path = ROOT) -> str:
    """Hash of everything an install depends on, for the running interpreter."""
    h = hashlib.sha256()
    for name in INPUTS:
        h.update(name.encode() + b"\0" + (root / name).read_bytes() + b"\0")
    h.update(f"{sys.version}\0{sys.prefix}".encode())
    return h.hexdigest()


def expand_extras(extras: str, root: Path = ROOT) -> set[str]:
    """The extras named plus those they pull in through `cosyvoice3-studio[...]` in pyproject.toml."""
    text = (root / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[-1].split("\n[", 1)[0]
    # each entry runs from its `name =` line to the next one (a list may span lines)
    parts = re.split(r"^(\w[\w-]*)\s*=", section, flags=re.M)
    table = dict(zip(parts[1::2], parts[2::2], strict=True))
    todo, seen = [e.strip() for e in extras.split(",") if e.strip()], set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            for inner in re.findall(r"cosyvoice3-studio\[([^\]]*)\]", table.get(name, "")):
                todo += [e.strip() for e in inner.split(",")]
    return seen


def _read(venv: Path) -> tuple[str, set[str]]:
    path = venv / STAMP
    if not path.is_file():
        return "", set()
    key, _, extras = path.read_text().partition("\n")
    return key.strip(), {e for e in extras.strip().split(",") if e}


def is_current(venv: Path, extras: str, root: Path = ROOT) -> bool:
    key, installed = _read(venv)
    return key == stamp_key(root) and expand_extras(extras, root) <= installed


def mark(venv: Path, extras: str, root: Path = ROOT) -> None:
    key, installed = _read(venv)
    new_key = stamp_key(root)
    done = (installed if key == new_key else set()) | expand_extras(extras, root)
    (venv / STAMP).write_text(f"{new_key}\n{','.join(sorted(done))}\n")


# ----------------------------------------------------------------------------- which torch build

TORCH_REQUIREMENT = "torch==2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # PyTorch's own index of CPU-only wheels


@dataclass(frozen=True)
class TorchPlan:
    """How setup.sh installs torch: ``build`` is cpu, cuda or configured (pip's configured indexes)."""

    build: str
    pip_args: tuple[str, ...]
    message: str


def has_nvidia_gpu(environ: Mapping[str, str], proc: Path = Path("/proc")) -> bool:
    """An NVIDIA driver is loaded (``/proc/driver/nvidia``) or its ``nvidia-smi`` is on PATH."""
    return (proc / "driver" / "nvidia").exists() or shutil.which("nvidia-smi", path=environ.get("PATH", "")) is not None


def index_reachable(url: str, timeout: float = 5.0) -> bool:
    """The index answers for torch (``<url>/torch/``) within ``timeout`` seconds."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/torch/", timeout=timeout) as reply:
            return reply.status == 200
    except (OSError, ValueError):
        return False


def torch_plan(environ: Mapping[str, str], gpu: bool, reachable: Callable[[str], bool] = index_reachable) -> TorchPlan:
    """The CUDA build where an NVIDIA GPU is seen; elsewhere the CPU build from PyTorch's CPU index (~200 MB
    instead of several GB of CUDA libraries), or pip's configured indexes where that index cannot be reached
    (an offline mirror, or a local wheel as on the CI). ``COSYVOICE_TORCH=cpu|cuda|configured`` decides
    instead; ``COSYVOICE_TORCH_CPU_INDEX`` names another CPU index (a mirror)."""
    index = environ.get("COSYVOICE_TORCH_CPU_INDEX") or CPU_INDEX
    choice = environ.get("COSYVOICE_TORCH", "").strip().lower()
    if choice not in ("", "cpu", "cuda", "configured"):
        raise ValueError(f"COSYVOICE_TORCH={choice!r}: use cpu, cuda or configured")
    if choice == "cuda" or (not choice and gpu):
        why = "COSYVOICE_TORCH=cuda" if choice else "an NVIDIA GPU was found"
        return TorchPlan("cuda", (), f"{why}: downloading {TORCH_REQUIREMENT} with CUDA (about 3 GB of wheels; "
                                     "COSYVOICE_TORCH=cpu installs the 200 MB CPU build instead)")
    if choice == "configured":
        return TorchPlan("configured", (), f"COSYVOICE_TORCH=configured: {TORCH_REQUIREMENT} from pip's configured "
                                           "indexes (which build they hold is said once it is installed)")
    if reachable(index):
        why = "COSYVOICE_TORCH=cpu" if choice else "no NVIDIA GPU found"
        return TorchPlan("cpu", ("--index-url", index),
                         f"{why}: downloading the CPU build of {TORCH_REQUIREMENT} from {index} (about 200 MB; "
                         "COSYVOICE_TORCH=cuda installs the CUDA build instead)")
    return TorchPlan("configured", (), f"no NVIDIA GPU found, but {index} cannot be reached: {TORCH_REQUIREMENT} "
                                       "from pip's configured indexes, whichever build they hold (said once it is "
                                       "installed; COSYVOICE_TORCH_CPU_INDEX=<a reachable CPU index> asks for the "
                                       "CPU build)")


#: disk a torch build's install takes at its peak, in GB: (into the venv, pip's downloaded wheels in the temp folder,
#: both on one disk). Measured on a fresh CI machine: PyPI's CUDA build and the dev extra leave a 6.3 GB venv, and
#: two such installs at once peaked at 15.3 GB (pip unpacks each wheel as it goes); the CPU build is ~1 GB.
DISK_GB = {"cpu": (2.5, 0.3, 2.8), "cuda": (6.5, 3.5, 8.5)}


def room_problem(plan: TorchPlan, venv: Path, temp: Path, free: Callable[[Path], int] | None = None,
                 device: Callable[[Path], int] | None = None) -> str | None:
    """Why the install would run out of disk part-way, or None: pip says "No space left on device" only after
    minutes of downloads, and leaves a half-made venv. A configured index may hold either build: the CUDA
    build's size is assumed and a shortfall is only a warning (the message starts with ``WARNING``)."""
    free = free or (lambda p: shutil.disk_usage(p).free)
    device = device or (lambda p: p.stat().st_dev)
    into, downloads, together = DISK_GB["cpu" if plan.build == "cpu" else "cuda"]
    folder = venv if venv.exists() else venv.parent
    needs = {folder: together} if device(folder) == device(temp) else {folder: into, temp: downloads}
    short = [(path, need, free(path) / 1e9) for path, need in needs.items() if free(path) / 1e9 < need]
    if not short:
        return None
    said = "; ".join(f"{path} has {have:.1f} GB free, the install needs about {need:.1f} GB there"
                     for path, need, have in short)
    fix = ("Free some space (e.g. `pip cache purge`, old virtual environments or build folders), or point "
           "COSYVOICE_VENV / TMPDIR at a disk with room")
    if plan.build == "configured":
        return f"WARNING: if pip's configured index holds the CUDA build, {said}. {fix}"
    return f"not enough disk for {TORCH_REQUIREMENT} ({plan.build} build): {said}. {fix}"


def torch_build(version: str, requires: list[str]) -> str:
    """Which build an installed torch is, from its metadata (``version`` with its local tag, its requirements):
    what setup.sh reports after installing, since pip's configured indexes may hold either."""
    local = version.partition("+")[2]
    if local.startswith("cu") and local[2:].isdigit():
        return f"torch {version}, the CUDA {local[2:-1]}.{local[-1]} build"
    if local.startswith("rocm"):
        return f"torch {version}, the ROCm {local[4:]} build"
    if not local and any(re.match(r"nvidia-", r) for r in requires):
        return f"torch {version}, the CUDA build (with NVIDIA's libraries from PyPI, several GB)"
    return f"torch {version}, the CPU build"


def main(argv: list[str]) -> int:
    if argv == ["torch-installed"]:
        from importlib import metadata

        print(torch_build(metadata.version("torch"), metadata.requires("torch") or []))
        return 0
    if argv[:1] == ["torch-plan"] and len(argv) == 2:
        try:
            plan = torch_plan(os.environ, has_nvidia_gpu(os.environ))
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
        problem = room_problem(plan, Path(argv[1]), Path(tempfile.gettempdir()))
        if problem:
            print(f"[setup] {problem}", file=sys.stderr)
            if not problem.startswith("WARNING"):
                return 3
        print("\n".join([plan.message, *plan.pip_args, TORCH_REQUIREMENT]))
        return 0
    if len(argv) != 3 or argv[0] not in ("check", "mark"):
        print(__doc__, file=sys.stderr)
        return 2
    command, venv, extras = argv[0], Path(argv[1]), argv[2]
    if command == "mark":
        mark(venv, extras)
        return 0
    return 0 if is_current(venv, extras) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
