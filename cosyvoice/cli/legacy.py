"""``CosyVoice`` and ``CosyVoice2``: importable, as the official FAQ and scripts expect, but never a model.

Official code imports all three classes from ``cosyvoice.cli.cosyvoice`` even when it uses only one, so the
names must exist. This engine runs CosyVoice3 only: constructing either class explains what to use instead,
from the folder's yaml, without loading (or downloading) anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NoReturn

from cosyvoice.bundle import DEFAULT_MODEL_ID
from cosyvoice.errors import ModelBundleError

# the yaml each official model class reads from its model folder
_YAML_OF = {"cosyvoice.yaml": "CosyVoice", "cosyvoice2.yaml": "CosyVoice2", "cosyvoice3.yaml": "CosyVoice3"}


def _refuse(cls_name: str, model_dir: Any) -> NoReturn:
    folder = Path(str(model_dir)).expanduser()
    found = [kind for yaml, kind in _YAML_OF.items() if (folder / yaml).is_file()] if folder.is_dir() else []
    if "CosyVoice3" in found:
        raise ModelBundleError(
            f"{model_dir} holds a CosyVoice3 model; {cls_name} is the class of an older model generation. Use "
            f"CosyVoice3({str(model_dir)!r}) or AutoModel(model_dir={str(model_dir)!r}) (both in "
            "cosyvoice.cli.cosyvoice)")
    what = f"{model_dir} holds a {found[0]} model" if found else f"{cls_name} models are not supported"
    raise ModelBundleError(
        f"this engine runs CosyVoice3 only: {what}. Download {DEFAULT_MODEL_ID} and load it with "
        "CosyVoice3(model_dir) or AutoModel(model_dir=...)")


class CosyVoice:
    """The official CosyVoice (v1) class name; this engine cannot run that model (see the module docstring)."""

    def __init__(self, model_dir: str | Path, *args: Any, **kwargs: Any) -> None:
        _refuse(type(self).__name__, model_dir)


class CosyVoice2(CosyVoice):
    """The official CosyVoice2 class name; this engine cannot run that model (see the module docstring)."""
