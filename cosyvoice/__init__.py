"""CosyVoice3 Studio: our implementation of Fun-CosyVoice3-0.5B-2512 inference.

``from cosyvoice import CosyVoice3, AutoModel`` works as well as the official import path
``cosyvoice.cli.cosyvoice``; the heavy imports happen only when one of them is first used.
"""

from typing import Any

__all__ = ["AutoModel", "CosyVoice3"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from cosyvoice.cli import cosyvoice as api

        return getattr(api, name)
    raise AttributeError(f"module 'cosyvoice' has no attribute {name!r}")
