"""A second process for the voice tests: it opens a voice library or the official API and runs the calls it is
sent, one JSON object per line on stdin (``{"open": "library"|"api", ...}`` or ``{"call": method, "args": [...],
"on": "library"|"api"}``), answering one JSON line each: ``{"ok": result}`` or ``{"error": type, "message": ...}``.
The tests drive it through :class:`Worker`."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import traceback
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def worker_env() -> dict[str, str]:
    """This environment, with this checkout first on PYTHONPATH."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


class Worker:
    """This script in another process; ``worker(open=...)`` / ``worker(call=..., args=[...])`` return the result."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=REPO, env=worker_env())
        self._answers: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._answers.put(line)
        self._answers.put("")

    def send(self, **request: object) -> None:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()

    def answer(self, timeout: float = 300) -> dict:
        line = self._answers.get(timeout=timeout)
        assert line, f"the worker died (exit code {self.proc.poll()})"
        return json.loads(line)

    def __call__(self, **request: object) -> object:
        self.send(**request)
        answer = self.answer()
        assert "ok" in answer, answer
        return answer["ok"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


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
