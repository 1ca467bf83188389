"""Whether the project's virtual environment already holds what scripts/setup.sh would install.

    python scripts/install_state.py check VENV EXTRAS   # exit 0 when up to date, 1 otherwise
    python scripts/install_state.py mark VENV EXTRAS    # record a successful install of EXTRAS

Run with the venv's own interpreter. The stamp holds a hash of what decides the install (pyproject.toml,
scripts/setup.sh, this interpreter's version and location) and the extras installed under it, so a second
start makes no pip call and needs no network, while an edited dependency list or another Python triggers a
fresh install. Extras that name other extras of the project (dev -> ui) count as installed too, so the web
UI starts without pip after the tests' install. Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import hashlib
import re
import sys
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


def main(argv: list[str]) -> int:
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
