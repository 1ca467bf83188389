"""The objective scorecard on the tiny bundle, with packaged models only (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cosyvoice.service import TTSService
from cosyvoice.takes.store import Answer, TakeStore
from cosyvoice.voices import VoiceLibrary
from cosyvoice.workbench import listening, listening_results
from cosyvoice.workbench.scorecard import Scorer, available_encoders, scorecard


def test_scorecard_per_take_and_condition(tts, tmp_path: Path, short_prompt_wav: Path) -> None:
    service = TTSService(tts.model, VoiceLibrary(tmp_path / "voices", tts.frontend, model_dir=tts.model_dir))
    voice = service.create_voice("Narrator", short_prompt_wav.read_bytes(), "A short test prompt.")
    store = TakeStore(tmp_path / "data")
    t = np.arange(24000 * 2) / 24000
    made = [store.add_take((0.3 * np.sin(2 * np.pi * f * t) * (1 + np.sin(2 * np.pi * 3 * t)) / 2).astype(np.float32),
                           24000, {"voice_id": voice.id}, label=label) for f, label in ((150, "sysA"), (220, "sysB"))]
    rate, recording = service.voices.recording(voice.id)
    # a "take" that is the prompt recording itself: its similarity to the prompt must be 1
    itself = store.add_take(recording.astype(np.float32) / 32768, rate, {"voice_id": voice.id}, label="prompt")
    silent = store.add_take(np.zeros(4800, np.float32), 24000, {}, label="silence")

    card = scorecard(Scorer(store, tts.model_dir, service.voices.recording), [*made, itself, silent])
    by_take = {r["take_id"]: r for r in card["takes"]}
    assert "mean nothing" in card["note"] and card["encoders"]["campplus"]
    assert by_take[itself.id]["sim_campplus"] == pytest.approx(1.0, abs=1e-4)
    for take in made:
        row = by_take[take.id]
        assert row["seconds"] == pytest.approx(take.seconds)
        assert -1.0 <= row["sim_campplus"] <= 1.0 and row["sim_campplus"] < 0.9999
        assert row["rms_dbfs"] < row["peak_dbfs"] <= 0.0
    assert by_take[silent.id]["rms_dbfs"] is None and by_take[silent.id]["sim_campplus"] is None  # no voice
    conditions = {c["condition"]: c for c in card["conditions"]}
    assert set(conditions) == {"sysA", "sysB", "prompt", "silence"} and conditions["sysA"]["n"] == 1
    assert conditions["sysA"]["seconds"] == pytest.approx(made[0].seconds)

    found = available_encoders()
    if found["resemblyzer"]:  # an independent encoder, weights shipped in its package
        assert by_take[itself.id]["sim_resemblyzer"] == pytest.approx(1.0, abs=1e-4)
        assert -1.0 <= by_take[made[0].id]["sim_resemblyzer"] < 0.9999
    if found["speechmos"]:  # DNSMOS P.835, scores on a 1-5 scale
        for take in made:
            assert all(0.5 < by_take[take.id][m] < 5.5 for m in ("dnsmos_sig", "dnsmos_bak", "dnsmos_ovrl"))

    # the scores travel with the ratings: answers.csv carries the answered take's measures
    test_id = listening.create_test(store, "mos", [{"takes": [made[0].id]}])
    rater = listening.join(store, test_id, "Ann")
    store.add_answer(Answer(test_id, rater.id, 0, 0, {"score": 3, "shown": 3}, 5.0, 1, None, 0.0))
    (row,) = listening_results.export_rows(store, test_id)
    assert row["obj_seconds"] == pytest.approx(made[0].seconds)
    assert row["obj_sim_campplus"] == by_take[made[0].id]["sim_campplus"]
