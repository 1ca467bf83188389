"""Reading a golden fixture folder and reporting comparisons.

A golden folder has the layout of ``../shared/golden`` (see its README): safetensors
files of arrays, ``manifest.json`` with scalars, and ``tiny_bundle/`` (a model dir).
Nothing here assumes the shared set's dims, seeds or lengths.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Result:
    """One comparison: ``component/name`` with its errors and the tolerance it had to meet."""

    component: str
    name: str
    max_abs: float
    mean_abs: float
    tol: float
    passed: bool
    note: str = ""

    def row(self) -> str:
        status = "PASS" if self.passed else "FAIL"
        return (f"{self.component:<10} {self.name:<40} {self.max_abs:>11.3e} {self.mean_abs:>11.3e} "
                f"{self.tol:>9.1e}  {status}  {self.note}")


def compare(component: str, name: str, ours: Any, ref: Any, atol: float, rtol: float = 0.0) -> Result:
    """Compare arrays of equal shape: pass iff ``|ours - ref| <= atol + rtol * |ref|`` everywhere."""
    a = np.asarray(_to_numpy(ours))
    b = np.asarray(_to_numpy(ref))
    if a.shape != b.shape:
        return Result(component, name, float("inf"), float("inf"), atol, False, f"shape {a.shape} != {b.shape}")
    if a.size == 0:
        return Result(component, name, 0.0, 0.0, atol, True, "empty")
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    if not np.all(np.isfinite(a64) == np.isfinite(b64)) or not np.array_equal(a64[~np.isfinite(a64)],
                                                                             b64[~np.isfinite(b64)]):
        return Result(component, name, float("inf"), float("inf"), atol, False, "non-finite entries differ")
    finite = np.isfinite(b64)
    diff = np.abs(a64[finite] - b64[finite])
    ok = bool(np.all(diff <= atol + rtol * np.abs(b64[finite]))) if diff.size else True
    note = f"rtol {rtol:g}" if rtol else ""
    return Result(component, name, float(diff.max(initial=0.0)), float(diff.mean()) if diff.size else 0.0,
                  atol, ok, note)


def compare_exact(component: str, name: str, ours: Any, ref: Any) -> Result:
    """Integer / string outputs must be identical."""
    a, b = _to_numpy(ours), _to_numpy(ref)
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        if a.shape != b.shape:
            return Result(component, name, float("inf"), float("inf"), 0.0, False, f"shape {a.shape} != {b.shape}")
        n_diff = int(np.sum(a != b))
        return Result(component, name, float(n_diff), float(n_diff) / max(a.size, 1), 0.0, n_diff == 0,
                      f"{n_diff} differing" if n_diff else "exact")
    same = a == b
    return Result(component, name, 0.0 if same else 1.0, 0.0 if same else 1.0, 0.0, bool(same),
                  "exact" if same else f"ours={a!r} ref={b!r}"[:200])


def _to_numpy(x: Any) -> Any:
    if hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    return x


class Golden:
    """A golden fixture folder: arrays by file, scalars from the manifest, the tiny bundle."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        if not (self.root / "manifest.json").is_file():
            raise FileNotFoundError(f"{self.root} is not a golden folder: manifest.json missing")

    @cached_property
    def manifest(self) -> dict[str, Any]:
        return json.loads((self.root / "manifest.json").read_text(encoding="utf-8"))

    @property
    def bundle_dir(self) -> Path:
        return self.root / "tiny_bundle"

    def has(self, filename: str) -> bool:
        return (self.root / filename).is_file()

    def arrays(self, filename: str) -> dict[str, np.ndarray]:
        from safetensors.numpy import load_file

        return load_file(str(self.root / filename))

    def scalar(self, filename: str, name: str) -> Any:
        return self.manifest[filename]["scalars"][name]["value"]

    def json(self, filename: str) -> Any:
        return json.loads((self.root / filename).read_text(encoding="utf-8"))
