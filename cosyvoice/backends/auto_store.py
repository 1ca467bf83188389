"""``auto``'s measurements, kept across restarts: which path each stage runs, per CPU and model.

``auto`` times and checks every candidate against fp32 at load (a minute at the released sizes). The result
depends only on the CPU (its flags, model name and core count), the libraries whose kernels ran, the formats of
the graphs it timed and the weights (the bundle's digest), so it is kept in one JSON file under that key and the
next start on the same machine and model applies it without measuring. Another CPU, model, library version or
graph format is another key: it is measured afresh (the newest :data:`KEEP` keys stay). An unreadable file counts
as empty, an unwritable one is logged and skipped: the cache saves time, it never stops a start.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import threading
from pathlib import Path

import torch

from cosyvoice.backends.cpu import cpu_model
from cosyvoice.backends.ort import cpu_stage_threads

logger = logging.getLogger(__name__)

KEEP = 8  # keys kept in one file (CPUs x models x library versions)


def _ort_version() -> str:
    try:
        import onnxruntime

        return onnxruntime.__version__
    except ImportError:
        return "none"


def graph_formats() -> dict[str, int]:
    """The formats of what auto times: the exported graphs' interfaces (the DiT's and the LLM step's) and what the
    torch candidates compute (:data:`~cosyvoice.backends.precision.TORCH_FORMAT`). A new one runs differently
    (format 2 of the DiT's cached graph stopped copying the cache per call), so what was measured on the old
    no longer holds."""
    from cosyvoice.backends import export, llm_step, precision

    return {"dit": export.FORMAT, "llm_step": llm_step.FORMAT, "torch": precision.TORCH_FORMAT}


def machine_key(features: frozenset[str], model_digest: str) -> dict[str, object]:
    """What ``auto``'s choice depends on: the CPU's flags, model and cores, the threads each stage's candidates
    are timed on (as the engine runs them; measurements from before they were are not kept), the kernels'
    libraries, the graphs' formats, the weights."""
    return {"cpu_flags": sorted(features), "cpu_model": cpu_model(), "cores": torch.get_num_threads(),
            "stage_threads": [cpu_stage_threads(0), cpu_stage_threads(1)],
            "torch": torch.__version__, "onnxruntime": _ort_version(), "graphs": graph_formats(),
            "model": model_digest}


class AutoStore:
    """One JSON file of ``{key digest: {"key": ..., "measured_at": ..., "llm": ..., "flow": ..., "checks": ...,
    "others": ...}}``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    @classmethod
    def beside(cls, model_root: Path) -> AutoStore:
        """The store in a model folder (``auto-precision.json``), where the DiT's graphs are exported too."""
        return cls(Path(model_root) / "auto-precision.json")

    @staticmethod
    def digest(key: dict[str, object]) -> str:
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]

    def _read(self) -> dict[str, dict[str, object]]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: dict[str, object]) -> dict[str, object] | None:
        """The record kept for ``key``, or None (never measured here, or the CPU or the model changed)."""
        with self._lock:
            found = self._read().get(self.digest(key))
        return found if isinstance(found, dict) and found.get("key") == key else None

    def put(self, key: dict[str, object], llm: str, flow: str, checks: dict[str, dict[str, float]],
            others: float | None = None) -> str:
        """Keep a measurement for ``key`` (``others``: the share of the cores other work took meanwhile, None when
        unknown); returns when it was measured (ISO time)."""
        when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        record = {"key": key, "measured_at": when, "llm": llm, "flow": flow, "checks": checks, "others": others}
        with self._lock:
            data = self._read()
            data[self.digest(key)] = record
            newest = sorted(data.items(), key=lambda kv: str(kv[1].get("measured_at", "")))[-KEEP:]
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp.write_text(json.dumps(dict(newest), indent=1), encoding="utf-8")
                os.replace(tmp, self.path)
            except OSError as exc:
                logger.warning("auto's measurements are not kept (%s): the next start measures again", exc)
        return when
