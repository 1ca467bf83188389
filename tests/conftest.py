"""Shared fixtures: the golden folder (skips cleanly where it is absent)."""

from __future__ import annotations

import atexit
import importlib
import os
import shutil
import tempfile
from types import ModuleType

# MKL picks its FFT code path by CPU, and on near-silent frames the rounding difference survives the log
# of the mel/fbank features (~5e-4). The golden fixtures match MKL's CPU-independent path to ~1e-6, so the
# tests select it. It must be set before torch's first FFT, hence before any import of torch.
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")
# CosyVoice3 instances the tests build without voice_dir= keep their voice library out of the working tree, in a
# folder the process that made it removes when it ends (the workers inherit it from the controller)
if "COSYVOICE_VOICE_DIR" not in os.environ:
    os.environ["COSYVOICE_VOICE_DIR"] = tempfile.mkdtemp(prefix="cosyvoice-test-voices-")
    atexit.register(shutil.rmtree, os.environ["COSYVOICE_VOICE_DIR"], ignore_errors=True)
# The suite checks the torch modules against the golden fixtures and itself; the accelerated backends (auto
# picks onnxruntime on a CPU) are compared with torch in tests/test_backends.py, which asks for them by name.
os.environ.setdefault("COSYVOICE_BACKEND", "torch")

from pathlib import Path

import pytest
import torch

from cosyvoice.tools.parity.common import Golden

# The fixtures were made with one intra-op thread; tiny models also run fastest that way on 2 cores.
torch.set_num_threads(1)

# The longest files (minutes each on two cores), handed out first: the suite runs a worker per core, each file on
# one worker in collection order (scripts/test.sh: -n auto --dist loadfile), so a long file collected last would
# run alone at the end while the other worker idles.
LONGEST_FIRST = ("test_webui_browser.py", "test_webui_install.py", "test_service.py", "test_rest.py", "test_load.py",
                 "test_api.py", "test_backends.py", "test_workbench_browser.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: LONGEST_FIRST.index(item.path.name) if item.path.name in LONGEST_FIRST
               else len(LONGEST_FIRST))  # stable: every other file keeps its place


_DEFAULT_GOLDEN = Path(__file__).resolve().parents[2] / "shared" / "golden"  # ../shared/golden beside the clone
GOLDEN_DIR = Path(os.environ.get("COSYVOICE_GOLDEN_DIR", _DEFAULT_GOLDEN))


@pytest.fixture(scope="session")
def golden() -> Golden:
    if not (GOLDEN_DIR / "manifest.json").is_file():
        pytest.skip(f"golden fixtures not found at {GOLDEN_DIR} (set COSYVOICE_GOLDEN_DIR); parity tests need them")
    return Golden(GOLDEN_DIR)


@pytest.fixture(scope="session")
def rust_backend() -> ModuleType:
    """The PyO3 module of the Rust engine (rust/python-backend; scripts/build_rust.sh builds it into the venv).

    Skipped where it is not built; CI sets ``COSYVOICE_REQUIRE_RUST=1``, which turns that skip into a failure."""
    try:
        return importlib.import_module("cosyvoice_rust_backend")
    except ImportError as exc:
        why = f"cosyvoice_rust_backend is not importable ({exc}); build it with bash scripts/build_rust.sh"
        if os.environ.get("COSYVOICE_REQUIRE_RUST") == "1":
            pytest.fail(why)
        pytest.skip(why)


@pytest.fixture(scope="session")
def rust_model(rust_backend: ModuleType, golden: Golden) -> object:
    """The Rust engine on the golden bundle, with the official (replayed) flow noise."""
    return rust_backend.Model(str(golden.bundle_dir))


@pytest.fixture(scope="session")
def tiny_bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bundle made by our own generator (present in every clone, unlike the golden one), with half the DiT
    heads of the golden tiny bundle: the DiT's attention over long takes is the largest share of the suite's
    time (tests/test_tiny_bundle.py holds the generator's defaults to the golden bundle's layout)."""
    from cosyvoice.tools.make_tiny_bundle import TinyDims, make_tiny_bundle

    return make_tiny_bundle(tmp_path_factory.mktemp("bundle") / "tiny", seed=7, dims=TinyDims(dit_heads=2))


@pytest.fixture(scope="session")
def llm_graph_bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny bundle with LLM heads of 16 dimensions (hidden 32, two heads): the onnxruntime LLM step's attention
    kernel takes multiples of 16 (``llm_step.supported``), the golden layout's heads have 4."""
    from cosyvoice.tools.make_tiny_bundle import TinyDims, make_tiny_bundle

    return make_tiny_bundle(tmp_path_factory.mktemp("bundle") / "tiny_llm_graph", seed=7,
                            dims=TinyDims(dit_heads=2, hidden=32, heads=2))


def _voiced_wav(path: Path, seconds: float, sr: int = 24000) -> Path:
    """A voiced, vowel-like signal: harmonics of a gliding F0 under a syllable envelope."""
    import numpy as np
    import soundfile as sf

    t = np.arange(int(seconds * sr)) / sr
    f0 = 120 + 30 * np.sin(2 * np.pi * 0.8 * t)
    phase = 2 * np.pi * np.cumsum(f0) / sr
    voice = sum(np.sin(k * phase) / k for k in range(1, 12))
    envelope = 0.5 * (1 - np.cos(2 * np.pi * 3 * t)) * np.clip(t * 8, 0, 1)
    sf.write(path, (0.3 * voice * envelope).astype(np.float32), sr, subtype="PCM_16")
    return path


@pytest.fixture(scope="session")
def prompt_wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2.5 s, 24 kHz prompt recording."""
    return _voiced_wav(tmp_path_factory.mktemp("audio") / "prompt.wav", 2.5)


@pytest.fixture(scope="session")
def short_prompt_wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1.2 s, 16 kHz prompt: fewer prompt frames keep the many-request tests fast."""
    return _voiced_wav(tmp_path_factory.mktemp("audio") / "short.wav", 1.2, 16000)


@pytest.fixture(scope="module")
def audio_dir(tmp_path_factory: pytest.TempPathFactory, short_prompt_wav: Path) -> Path:
    """A server's allowed audio folder (``allowed_audio_dir``), holding ``prompt.wav``."""
    folder = tmp_path_factory.mktemp("allowed")
    (folder / "prompt.wav").write_bytes(short_prompt_wav.read_bytes())
    return folder


@pytest.fixture(scope="session")
def tts(tiny_bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """One CosyVoice3 on the generated tiny bundle, shared by the API and engine tests (like a server)."""
    from cosyvoice.cli.cosyvoice import CosyVoice3
    from cosyvoice.settings import Limits

    return CosyVoice3(tiny_bundle_dir, device="cpu", limits=Limits(max_sessions=16, queue_timeout_seconds=60),
                      voice_dir=tmp_path_factory.mktemp("voices"))
