"""Reading the official ``*.pt`` checkpoints and loading them strictly.

The official loader does ``torch.load(path, weights_only=True)`` then
``load_state_dict(strict=True)``. We do the same, but turn every failure into a
:class:`WeightsError` that names the file, the keys involved and the fix. The two large modules are built
without weights of their own and take the checkpoint's tensors (:func:`load_module`): one copy of the weights
in memory while loading, not two.
"""

from __future__ import annotations

import pickle
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from cosyvoice.errors import WeightsError
from cosyvoice.system.pages import drop_pages, file_mappings

M = TypeVar("M", bound=nn.Module)
_REDOWNLOAD = "re-download the model (e.g. modelscope FunAudioLLM/Fun-CosyVoice3-0.5B-2512)"
_MAPPED: set[str] = set()  # the checkpoints read_checkpoint mapped (resolved paths): what give_back may drop


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """Load a state dict saved with ``torch.save`` without executing pickled code."""
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"{path.name} missing in {path.parent}: {_REDOWNLOAD}")
    try:
        # mapped, not read: a tensor's pages load when first used, so the weights that another backend replaces
        # (the LLM's stack and the DiT's blocks under onnxruntime) never become resident
        mapped = zipfile.is_zipfile(path)
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=mapped)
        if mapped:
            _MAPPED.add(str(path.resolve()))
    except (RuntimeError, EOFError, zipfile.BadZipFile, pickle.UnpicklingError, ValueError, OSError) as exc:
        raise WeightsError(f"{path.name} is corrupt or truncated ({type(exc).__name__}: {exc}); {_REDOWNLOAD}") from exc
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise WeightsError(f"{path.name} is not a state dict of tensors; {_REDOWNLOAD}")
    return sd


def give_back(tensors: Iterable[torch.Tensor]) -> int:
    """Hand the system the pages of the checkpoint that ``tensors`` (weights being replaced: by int8 or bf16 copies,
    by an onnxruntime graph, by a converted copy) were read from; returns the bytes given back. Their pages stay
    resident while the checkpoint stays mapped, which is as long as any of its tensors lives (:mod:`cosyvoice.
    system.pages`): 1.4 GB of the released llm.pt beside its int8 replacement. Tensors not in a mapped checkpoint
    are left alone; call it before the last reference goes (the storage must still be the checkpoint's)."""
    storages = {id(s): s for s in (t.untyped_storage() for t in tensors if not t.is_meta and t.device.type == "cpu")}
    spans = [(s.data_ptr(), s.nbytes()) for s in storages.values() if s.nbytes()]
    return drop_pages(spans, file_mappings(_MAPPED)) if spans else 0


def _key_list(keys: list[str], limit: int = 12) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def check_fits(module: nn.Module, sd: dict[str, torch.Tensor], source: str) -> None:
    """A :class:`WeightsError` listing the missing, unexpected and mis-shaped keys of ``sd`` for ``module``."""
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


def load_state_dict_strict(module: nn.Module, sd: dict[str, torch.Tensor], source: str) -> None:
    """``module.load_state_dict(sd, strict=True)`` with an error that lists missing/unexpected/mis-shaped keys."""
    check_fits(module, sd, source)
    module.load_state_dict(sd, strict=True)


def load_weights(module: nn.Module, path: str | Path,
                 rename: Callable[[str], str] | None = None) -> nn.Module:
    """Read ``path`` (optionally renaming keys, e.g. hift's ``generator.`` prefix) into ``module``."""
    sd = read_checkpoint(path)
    if rename is not None:
        sd = {rename(k): v for k, v in sd.items()}
    load_state_dict_strict(module, sd, Path(path).name)
    return module


def _as_copied(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``tensor`` as copying it into the built tensor ``like`` would have left it: in ``like``'s dtype, contiguous,
    alone in its storage (a view into a larger one would keep all of it alive); unchanged when it already is."""
    tensor = tensor.to(like.dtype)
    if not tensor.is_contiguous() or tensor.storage_offset() or tensor.untyped_storage().nbytes() != tensor.nbytes:
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def load_module(build: Callable[[], M], path: str | Path) -> M:
    """``build()`` holding the weights of the checkpoint ``path``, loaded strictly.

    Copying a checkpoint into a built module holds two copies of its weights at once, the module's randomly
    initialised ones and the checkpoint's (4 GB for the released LLM). Here the module is built on the meta device
    (no memory, no initialisation) and takes the checkpoint's tensors themselves (``load_state_dict(assign=True)``),
    converted only where a copy would have changed them (:func:`_as_copied`), so the weights are bit-equal to a
    copy's. Parameters the module ties (one parameter under two names) are tied again, to the tensor loaded last,
    which is what a copy into their shared storage leaves. ``build`` must make every tensor the checkpoint does not
    hold (non-persistent buffers) from a CPU tensor it was given: built on the meta device, it would hold no values.
    """
    with torch.device("meta"):
        module = build()
    sd = read_checkpoint(path)
    source = Path(path).name
    check_fits(module, sd, source)
    built = module.state_dict(keep_vars=True)
    tied: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        tied.setdefault(id(param), []).append(name)
    loaded = {k: _as_copied(v, built[k]) for k, v in sd.items()}
    give_back(v for k, v in sd.items() if loaded[k].data_ptr() != v.data_ptr())  # the sources of converted copies
    module.load_state_dict(loaded, strict=True, assign=True)
    del sd, built, loaded  # the module holds the only references to the weights now
    for names in (n for n in tied.values() if len(n) > 1):
        last = module.get_parameter(names[-1])
        for name in names[:-1]:
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner), leaf, last)
    empty = [n for n, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta]
    assert not empty, f"{type(module).__name__} built tensors that {source} does not hold on the meta device: {empty}"
    return module
