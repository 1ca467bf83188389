"""How a take was made, stored with it: one record every adapter that synthesises a take (the web UI, batches,
long-form) writes through :func:`provenance`, so a take of any of them can be compared, re-made and exported alike;
:func:`keep_take` stores a take with it."""

from __future__ import annotations

from importlib import metadata
from typing import Any

import numpy as np

from cosyvoice.bundle import bundle_digest
from cosyvoice.service import PreparedRequest, SynthesisRequest, TTSService
from cosyvoice.takes.store import Take, TakeStore


def software_version() -> str:
    try:
        return f"cosyvoice3-studio {metadata.version('cosyvoice3-studio')}"
    except metadata.PackageNotFoundError:
        return "cosyvoice3-studio (not installed)"


def provenance(service: TTSService, request: SynthesisRequest, prepared: PreparedRequest, samples: int,
               timings: dict[str, float | None], *, model_id: str | None = None,
               software: str | None = None) -> dict[str, Any]:
    """How a take was made, for :meth:`~cosyvoice.takes.store.TakeStore.add_take`: any adapter that synthesised
    ``request`` (the web UI, batches, long-form) stores its takes with this. ``prepared`` is the session's: it
    holds the seed used."""
    info = service.get_voice(prepared.voice_id)
    return {  # segments: the normalised text pieces (the pipeline keeps CosyVoice3's prompt prefix apart)
        "text": request.text, "segments": list(prepared.segments),
        "mode": prepared.mode,
        "engine_mode": prepared.engine_mode, "voice": info.name or "", "voice_id": prepared.voice_id,
        "prompt_text": info.transcript, "instruction": request.instruction if prepared.mode == "instruct" else "",
        "seed": prepared.seed, "speed": prepared.speed, "steps": prepared.steps,
        "final": prepared.schedule.final, "first_hop": prepared.schedule.first_hop,  # None: the reference's
        "settings": {"stream": prepared.stream},
        "model_id": model_id or bundle_digest(service.status().model_dir), "software": software or software_version(),
        "precision": service.precision.label,  # what the LLM and the DiT computed in (a fast path or fp32)
        "sample_rate": service.sample_rate,
        "timings": {**{k: None if v is None else round(v, 4) for k, v in timings.items()},
                    "audio_seconds": round(samples / service.sample_rate, 4)},
    }


def keep_take(store: TakeStore, service: TTSService, request: SynthesisRequest, prepared: PreparedRequest,
              pcm: np.ndarray, timings: dict[str, float | None], *, model_id: str | None = None,
              software: str | None = None, settings: dict[str, Any] | None = None, form: dict[str, Any] | None = None,
              label: str = "", owner: str | None = None, batch: str | None = None, row: int | None = None) -> Take:
    """Keep ``pcm``, what ``request`` made, in ``store`` with its :func:`provenance`: the one way a take made for a
    person or a batch row is recorded (the web page, its named API, batches), so its record always describes the
    samples stored at the service's rate. ``settings``: more of how it was made (the page's download format);
    ``form``: what the adapter's form said (the page's tab and voice label)."""
    record = provenance(service, request, prepared, pcm.size, timings, model_id=model_id, software=software)
    record["settings"].update(settings or {})
    record.update(form or {})
    return store.add_take(pcm, service.sample_rate, record, label=label, owner=owner, batch=batch, row=row)
