"""Reading the official ``*.pt`` checkpoints and loading them strictly.

The official loader does ``torch.load(path, weights_only=True)`` then
``load_state_dict(strict=True)``. We do the same, but turn every failure into a
:class:`WeightsError` that names the file, the keys involved and the fix.
"""

from __future__ import annotations

import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from cosyvoice.errors import WeightsError

_REDOWNLOAD = "re-download the model (e.g. modelscope FunAudioLLM/Fun-CosyVoice3-0.5B-2512)"


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """Load a state dict saved with ``torch.save`` without executing pickled code."""
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"{path.name} missing in {path.parent}: {_REDOWNLOAD}")
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, zipfile.BadZipFile, pickle.UnpicklingError, ValueError, OSError) as exc:
        raise WeightsError(f"{path.name} is corrupt or truncated ({type(exc).__name__}: {exc}); {_REDOWNLOAD}") from exc
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise WeightsError(f"{path.name} is not a state dict of tensors; {_REDOWNLOAD}")
    return sd


def _key_list(keys: list[str], limit: int = 12) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def load_state_dict_strict(module: nn.Module, sd: dict[str, torch.Tensor], source: str) -> None:
    """``module.load_state_dict(sd, strict=True)`` with an error that lists missing/unexpected/mis-shaped keys."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    mis_shaped = sorted(k for k in set(expected) & set(sd) if tuple(expected[k].shape) != tuple(sd[k].shape))
    if missing or unexpected or mis_shaped:
        parts = []
        if missing:
            parts.append(f"missing keys: {_key_list(missing)}")
        if unexpected:
            parts.append(f"unexpected keys: {_key_list(unexpected)}")
        if mis_shaped:
            parts.append("shape mismatch: " + _key_list(
                [f"{k} {tuple(sd[k].shape)} vs {tuple(expected[k].shape)} expected" for k in mis_shaped]))
        raise WeightsError(
            f"{source} does not fit {type(module).__name__} built from cosyvoice3.yaml ({'; '.join(parts)}). "
            f"The checkpoint and the yaml must come from the same model release; {_REDOWNLOAD}")
    module.load_state_dict(sd, strict=True)


def load_weights(module: nn.Module, path: str | Path,
                 rename: Callable[[str], str] | None = None) -> nn.Module:
    """Read ``path`` (optionally renaming keys, e.g. hift's ``generator.`` prefix) into ``module``."""
    sd = read_checkpoint(path)
    if rename is not None:
        sd = {rename(k): v for k, v in sd.items()}
    load_state_dict_strict(module, sd, Path(path).name)
    return module
