"""A second process for the voice tests: it opens a voice library or the official API and runs the calls it is
sent, one JSON object per line on stdin (``{"open": "library"|"api", ...}`` or ``{"call": method, "args": [...],
"on": "library"|"api"}``), answering one JSON line each: ``{"ok": result}`` or ``{"error": type, "message": ...}``.
Run: ``python tests/voice_worker.py`` with the repository on PYTHONPATH."""

from __future__ import annotations

import json
import sys
import traceback
from dataclasses import asdict, is_dataclass
from typing import Any


def _plain(value: Any) -> Any:
    if is_dataclass(value):
        return asdict(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def main() -> None:
    objects: dict[str, Any] = {}
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if "open" in request:
                if request["open"] == "library":
                    from cosyvoice.voices import VoiceLibrary

                    objects["library"] = VoiceLibrary(request["root"], None, model_dir=request["model_dir"],
                                                      **request.get("bounds", {}))
                else:
                    from cosyvoice.cli.cosyvoice import CosyVoice3

                    objects["api"] = CosyVoice3(request["model_dir"], device="cpu", voice_dir=request["voice_dir"])
                    objects["library"] = objects["api"].voices
                result: Any = True
            else:
                target = objects[request.get("on", "library")]
                result = getattr(target, request["call"])(*request.get("args", []), **request.get("kwargs", {}))
            answer = {"ok": _plain(result)}
        except Exception as exc:  # answered to the test, which asserts on it
            answer = {"error": type(exc).__name__, "message": str(exc), "trace": traceback.format_exc()}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
