"""A request's chunk schedule (``final``, ``first_hop``): it reaches the flow, changes only what it says, and is
validated once, in the service, for every API."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from cosyvoice.engine import ChunkPolicy, ChunkSchedule
from cosyvoice.errors import InvalidInputError
from cosyvoice.frontend.prompts import cross_lingual_text, zero_shot_prompt_text
from cosyvoice.service import SynthesisRequest, TTSService
from cosyvoice.settings import Limits
from cosyvoice.voices import VoiceLibrary

PROMPT_TEXT = zero_shot_prompt_text("Hello, this is a short prompt for testing.")
TRANSCRIPT = "Hello, this is a short prompt for testing."
TEXT = "Hello there, my friend, how are you today?"
TOKENS = 120  # decoded exactly: three chunks after any prompt, whatever the random tiny LLM would say


def test_a_first_hop_splits_the_reference_first_chunk() -> None:
    """The first chunk speaks ``first_hop`` tokens; the next ends where the reference's first chunk does, so every
    later boundary is the reference's."""
    reference = ChunkPolicy(prompt_len=73)
    bounds = [reference.advance() for _ in range(4)]
    assert bounds == [(0, 27), (27, 77), (77, 177), (177, 277)]
    split = ChunkPolicy(prompt_len=73, first_hop=10)
    assert split.current_hop() == 10 and not split.ready(12) and split.ready(13)  # + 3 look-ahead tokens
    assert [split.advance() for _ in range(5)] == [(0, 10), (10, 27), *bounds[1:]]
    aligned = ChunkPolicy(prompt_len=75, first_hop=25)  # the reference's hop on an aligned prompt: the same
    assert [aligned.advance() for _ in range(3)] == [(0, 25), (25, 75), (75, 175)]


@pytest.mark.parametrize(("final", "first_hop", "field"), [
    ("partial", None, "final"), ("FULL", None, "final"), (1, None, "final"),
    (None, 0, "first_hop"), (None, 26, "first_hop"), (None, 2.5, "first_hop"), (None, True, "first_hop"),
    (None, "10", "first_hop")])
def test_invalid_schedules_are_refused_by_name(final: object, first_hop: object, field: str) -> None:
    with pytest.raises(InvalidInputError) as caught:
        ChunkSchedule.checked(final, first_hop)
    assert caught.value.field == field
    assert ("'full', 'chunked'" if field == "final" else "from 1 to 25") in str(caught.value)


def test_valid_schedules() -> None:
    assert ChunkSchedule.checked() == ChunkSchedule() == ChunkSchedule.checked("full") and ChunkSchedule().reference
    assert ChunkSchedule.checked("chunked", 8) == ChunkSchedule(8, "chunked")
    assert not ChunkSchedule(final="chunked").reference and not ChunkSchedule(first_hop=25).reference


@contextlib.contextmanager
def _dit_frames(estimator: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, int]]]:
    """Every DiT evaluation as (``full`` or ``cached``, frames computed): the whole-utterance call of a full
    final, or the chunk-causal continuation over new frames."""
    calls: list[tuple[str, int]] = []
    cached = estimator.forward_cached

    def counted(x: torch.Tensor, *args: object, **kwargs: object):
        calls.append(("cached", x.shape[2]))
        return cached(x, *args, **kwargs)

    monkeypatch.setattr(estimator, "forward_cached", counted)
    handle = estimator.register_forward_pre_hook(lambda _module, args: calls.append(("full", args[0].shape[2])))
    try:
        yield calls
    finally:
        handle.remove()
        monkeypatch.undo()


def _speak(tts, inp, schedule: ChunkSchedule | None, stream: bool = True) -> list:
    return list(tts.engine.synthesize(inp, stream=stream, seed=5, fixed_tokens=TOKENS, schedule=schedule))


@pytest.fixture(scope="module")
def model_input(tts, prompt_wav: Path):
    return tts.frontend.model_input(TEXT, tts.frontend.voice(PROMPT_TEXT, prompt_wav))


def test_final_reaches_the_flow_and_changes_the_last_chunk_only(tts, model_input,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``full`` (named or not) is today's stream bit for bit; ``chunked`` has the same chunks but the last, whose
    DiT call computes the frames after the finished chunks only instead of the whole utterance."""
    steps = tts.engine.default_steps
    estimator = tts.engine.flow.decoder.estimator
    with _dit_frames(estimator, monkeypatch) as full_calls:
        today = _speak(tts, model_input, None)
    named = _speak(tts, model_input, ChunkSchedule(final="full"))
    with _dit_frames(estimator, monkeypatch) as chunked_calls:
        chunked = _speak(tts, model_input, ChunkSchedule(final="chunked"))
    bounds = [(c.token_start, c.token_end) for c in today]
    assert len(today) >= 3 and [(c.token_start, c.token_end) for c in chunked] == bounds
    assert all(torch.equal(a.pcm, b.pcm) for a, b in zip(today, named, strict=True))
    assert all(torch.equal(a.pcm, b.pcm) for a, b in zip(today[:-1], chunked[:-1], strict=True))
    assert not torch.allclose(today[-1].pcm, chunked[-1].pcm, atol=1e-4)
    assert today[-1].pcm.shape == chunked[-1].pcm.shape  # the same frames, computed another way

    # the final call: full attention over prompt + every token, against the unfinished frames only
    prompt_frames = model_input.prompt_speech_feat.shape[1]
    all_frames = prompt_frames + TOKENS * tts.engine.config.flow.token_mel_ratio
    full_final = [n for kind, n in full_calls if kind == "full"]
    assert full_final == [all_frames] * steps
    assert [kind for kind, _ in chunked_calls] == ["cached"] * len(chunked_calls)
    chunked_final = [n for _, n in chunked_calls[-steps:]]
    chunk = estimator.chunk_size
    finished = (prompt_frames + bounds[-1][0] * 2) // chunk * chunk  # whole chunks before the last one's tokens
    assert chunked_final == [all_frames - finished] * steps and sum(chunked_final) < sum(full_final) / 2


def test_a_first_hop_reaches_the_flow(tts, model_input, monkeypatch: pytest.MonkeyPatch) -> None:
    """A first hop of 8 tokens: the first chunk ends after 8 tokens and its DiT call is smaller; from the end of
    the reference's first chunk on, the boundaries are the reference's."""
    estimator = tts.engine.flow.decoder.estimator
    with _dit_frames(estimator, monkeypatch) as today_calls:
        today = _speak(tts, model_input, None)
    with _dit_frames(estimator, monkeypatch) as early_calls:
        early = _speak(tts, model_input, ChunkSchedule(first_hop=8))
    bounds = [(c.token_start, c.token_end) for c in today]
    assert [(c.token_start, c.token_end) for c in early] == [(0, 8), (8, bounds[0][1]), *bounds[1:]]
    assert 0 < early[0].pcm.numel() < today[0].pcm.numel()
    assert early_calls[0][1] < today_calls[0][1]  # the first DiT call computes fewer frames
    assert sum(c.pcm.numel() for c in early) == sum(c.pcm.numel() for c in today)


def test_a_whole_request_with_a_schedule_is_computed_in_chunks(tts, model_input) -> None:
    """Delivered whole (batch rows, long-form renders), a schedule other than the reference's is still computed
    chunk by chunk, so takes differ from a stream's only where the options say; the reference's is one call."""
    assert len(_speak(tts, model_input, None, stream=False)) == 1
    assert len(_speak(tts, model_input, ChunkSchedule(final="full"), stream=False)) == 1
    chunked = _speak(tts, model_input, ChunkSchedule(final="chunked"), stream=False)
    assert len(chunked) >= 3 and chunked[-1].final


def test_the_service_validates_and_hands_the_schedule_over(tts, short_prompt_wav: Path, tmp_path: Path) -> None:
    service = TTSService(tts.model, VoiceLibrary(tmp_path, tts.frontend, model_dir=tts.model_dir),
                         Limits(max_sessions=2))
    request = SynthesisRequest("Hi there.", prompt_audio=short_prompt_wav, transcript=TRANSCRIPT, seed=1)
    for field, bad in (("final", "half"), ("first_hop", 40)):
        with pytest.raises(InvalidInputError) as caught:
            service.prepare(SynthesisRequest(**{**request.__dict__, field: bad}))
        assert caught.value.field == field
    assert service.prepare(request).schedule == ChunkSchedule()
    prepared = service.prepare(SynthesisRequest(**{**request.__dict__, "final": "chunked", "first_hop": 12}))
    assert prepared.schedule == ChunkSchedule(12, "chunked")


def test_batch_columns_reach_the_takes_and_their_provenance(tts, tmp_path: Path) -> None:
    """A listening test's conditions: rows with ``final`` and ``first_hop`` columns, their takes recorded with
    them (the reference's as ``full`` / empty); a bad cell is that row's error, naming the column."""
    from cosyvoice.takes.export import takes_csv_rows
    from cosyvoice.takes.store import TakeStore
    from cosyvoice.workbench.batch import parse_rows, run_batch

    library = VoiceLibrary(tmp_path / "voices", tts.frontend, model_dir=tts.model_dir,
                           builtin_dir=Path(__file__).resolve().parents[1] / "assets" / "voices")
    service = TTSService(tts.model, library, Limits(max_sessions=2))
    store = TakeStore(tmp_path / "data")
    rows = parse_rows("text,voice,seed,final,first_hop,label\n"
                      "Hello there.,en-allison,11,,,reference\nHello there.,en-allison,11,chunked,6,early\n"
                      "Hello there.,en-allison,11,,soon,bad\nHello there.,en-allison,11,half,,bad\n")
    result = run_batch(service, store, rows)
    assert [(e.row, e.field) for e in result.errors] == [(3, "first_hop"), (4, "final")]
    reference, early = result.takes
    assert [(t.provenance["final"], t.provenance["first_hop"]) for t in (reference, early)] == [
        ("full", None), ("chunked", 6)]
    assert [(r["final"], r["first_hop"]) for r in takes_csv_rows(store.takes())] == [("full", None), ("chunked", 6)]
    assert store.take(early.id).provenance["first_hop"] == 6  # as stored
    assert store.audio_path(reference).read_bytes() != store.audio_path(early).read_bytes()


def test_the_official_api_takes_the_schedule_as_keywords(tts, prompt_wav: Path) -> None:
    """Scripts on the official API make the same A/B conditions: ``first_hop`` and ``steps`` reach the engine from
    every method, and a bad value is the service's error naming the keyword."""
    def bounds(**schedule) -> list[tuple[int, int]]:
        chunks = tts.synthesize("zero_shot", TEXT, prompt_text=PROMPT_TEXT, prompt_wav=prompt_wav, stream=True,
                                seed=5, **schedule)
        return [(c.token_start, c.token_end) for c in chunks]

    today, early = bounds(), bounds(first_hop=8)
    assert early[:2] == [(0, 8), (8, today[0][1])] and early[2:] == today[1:]

    def speech(**schedule) -> torch.Tensor:
        return torch.cat([o["tts_speech"] for o in tts.inference_cross_lingual(cross_lingual_text(TEXT), prompt_wav,
                                                                               seed=5, **schedule)], dim=1)

    assert not torch.equal(speech(), speech(steps=2))
    for method, args in ((tts.inference_zero_shot, (TEXT, PROMPT_TEXT, prompt_wav)),
                         (tts.inference_instruct2, (TEXT, PROMPT_TEXT, prompt_wav))):
        with pytest.raises(InvalidInputError) as caught:
            method(*args, final="half")
        assert caught.value.field == "final"
