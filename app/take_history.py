"""A visitor's take history as the page and its ZIP describe it: the takes this browser made one at a time, from
the take store (app/history.js draws the same store's takes on the page)."""

from __future__ import annotations

import json
import zipfile
from typing import Any

from app.files import PageFiles
from cosyvoice.encoding import audio_format, encode_audio
from cosyvoice.takes.store import Take, TakeStore


class TakeHistory:
    """The numbered takes of one owner, newest first, and all of them as one ZIP."""

    def __init__(self, store: TakeStore) -> None:
        self.store = store

    def entries(self, owner: str | None) -> list[dict[str, Any]]:
        """``owner``'s takes made one at a time (no batch or long-form ones), newest first, numbered from 1."""
        takes = self.store.takes(owner=owner, any_owner=False, single=True, limit=1_000_000)
        return [self._entry(number, take) for number, take in reversed(list(enumerate(takes, 1)))]

    def _entry(self, number: int, take: Take) -> dict[str, Any]:
        p = take.provenance
        settings = p.get("settings", {})
        return {"number": number, "id": take.id, "file": str(self.store.audio_path(take)), "text": p.get("text", ""),
                "voice": p.get("voice_label") or p.get("voice") or p.get("voice_id", ""),
                "mode": p.get("form_mode") or p.get("mode", ""), "seed": p.get("seed"), "speed": p.get("speed", 1.0),
                "stream": bool(settings.get("stream")), "format": settings.get("format", "wav"),
                "seconds": round(take.seconds, 3), "first_audio": p.get("timings", {}).get("first_chunk_seconds"),
                "wall": p.get("timings", {}).get("synthesis_seconds"), "stopped": bool(p.get("stopped")),
                "created": take.created, "provenance": p}

    def zip(self, owner: str | None, files: PageFiles) -> str | None:
        """``owner``'s takes as one ZIP, a new file handed to the page (None without takes): every take in the format
        it was made for, plus takes.json (text, voice, mode, seed, settings, and each take's whole provenance)."""
        history = self.entries(owner)
        if not history:
            return None
        path = files.folder() / f"cosyvoice-takes-{len(history)}.zip"
        described = []
        with zipfile.ZipFile(path, "w") as archive:
            for entry in history:
                take = self.store.take(entry["id"])
                audio = audio_format(entry["format"])
                name = f"take-{entry['number']}-seed{entry['seed']}.{audio.extension}"
                archive.writestr(name, encode_audio(self.store.read_audio(take), audio, take.sample_rate))
                described.append({**entry, "file": name})
            archive.writestr("takes.json", json.dumps(described, ensure_ascii=False, indent=2))
        return str(path)
