"""The service layer on the tiny bundle: one request type, field-named errors, voices, admission, async."""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import soundfile as sf
import torch

from cosyvoice.errors import (
    AlreadyExistsError,
    CancelledByShutdown,
    InvalidInputError,
    NotFoundError,
    ResourceLimitError,
)
from cosyvoice.frontend.prompts import cross_lingual_text, instruct_text, zero_shot_prompt_text
from cosyvoice.service import Outcome, SynthesisRequest, TTSService, allowed_path, draw_seed
from cosyvoice.settings import Limits
from cosyvoice.voices import VoiceLibrary

TEXT = "Hi there, friend."
TRANSCRIPT = "Hello, this is a short prompt for testing."


@pytest.fixture(scope="module")
def library(tts, tmp_path_factory: pytest.TempPathFactory) -> VoiceLibrary:
    return VoiceLibrary(tmp_path_factory.mktemp("voices"), tts.frontend, model_dir=tts.model_dir)


@pytest.fixture(scope="module")
def service(tts, library: VoiceLibrary) -> TTSService:
    return TTSService(tts.model, library, Limits(max_sessions=4, max_queued_requests=2, queue_timeout_seconds=30))


@pytest.fixture()
def outcomes(service: TTSService) -> list[Outcome]:
    seen: list[Outcome] = []
    service.add_listener(seen.append)
    yield seen
    service._listeners.remove(seen.append)


def _pcm(chunks) -> torch.Tensor:
    return torch.cat([c.pcm for c in chunks])


@pytest.mark.parametrize(("mode", "stream"), [("zero_shot", False), ("cross_lingual", True), ("instruct2", True)])
def test_modes_follow_the_prompt_conventions(service: TTSService, tts, short_prompt_wav: Path, mode: str,
                                             stream: bool) -> None:
    """Plain transcript / instruction / text in; the same audio as the official API given the prefixed forms."""
    request = SynthesisRequest(TEXT, mode, prompt_audio=short_prompt_wav.read_bytes(), transcript=TRANSCRIPT,
                               instruction="Speak slowly.", seed=4, stream=stream)
    if mode == "zero_shot":
        reference = tts.synthesize(mode, TEXT, prompt_text=zero_shot_prompt_text(TRANSCRIPT),
                                   prompt_wav=short_prompt_wav, stream=stream, seed=4, split_prefixed=True)
    elif mode == "cross_lingual":
        reference = tts.synthesize(mode, cross_lingual_text(TEXT), prompt_wav=short_prompt_wav, stream=stream, seed=4,
                                   split_prefixed=True)
    else:
        reference = tts.synthesize(mode, TEXT, instruct_text=instruct_text("Speak slowly."),
                                   prompt_wav=short_prompt_wav, stream=stream, seed=4, split_prefixed=True)
    with service.synthesize(request) as session:
        ours = list(session)
    assert session.prepared.mode == mode.replace("instruct2", "instruct")
    assert torch.equal(_pcm(ours), _pcm(reference))
    assert (len(ours) > 1) == stream
    assert ours[-1].final and ours[0].sample_rate == 24000


@pytest.mark.parametrize(("request_kwargs", "field"), [
    ({"text": ""}, "text"),
    ({"text": 5}, "text"),
    ({"text": "x" * 6000}, "text"),
    ({"mode": "sing"}, "mode"),
    ({"speed": 9.0}, "speed"),
    ({"speed": "fast"}, "speed"),
    ({"seed": -1}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"stream": "yes"}, "stream"),
    ({"format": "ogg"}, "format"),
    ({"mode": "instruct", "instruction": "  "}, "instruction"),
    ({"transcript": ""}, "transcript"),
    ({"prompt_audio": b"not audio at all"}, "prompt_audio"),
    ({"prompt_audio": None}, "voice"),
    ({"voice": "nobody"}, "voice"),
    ({"voice": "nobody", "mode": "sft", "prompt_audio": None}, "voice"),
    ({"mode": "sft"}, "voice"),
])
def test_bad_input_names_its_field(service: TTSService, short_prompt_wav: Path, outcomes: list[Outcome],
                                   request_kwargs: dict, field: str) -> None:
    kwargs = {"text": TEXT, "mode": "zero_shot", "prompt_audio": short_prompt_wav.read_bytes(),
              "transcript": TRANSCRIPT} | request_kwargs
    with pytest.raises(InvalidInputError) as info:
        service.synthesize(SynthesisRequest(**kwargs))
    assert info.value.field == field, str(info.value)
    assert service.status().active_sessions == 0
    assert outcomes[-1].reason in ("invalid_input", "not_found")


def test_saved_voice_by_id_and_name_created_after_start(service: TTSService, short_prompt_wav: Path) -> None:
    info = service.create_voice("Ada", short_prompt_wav.read_bytes(), TRANSCRIPT)
    assert info.name == "Ada" and info.transcript == TRANSCRIPT
    assert [v.name for v in service.list_voices()] == ["Ada"]
    by_name = _pcm(service.synthesize(SynthesisRequest(TEXT, "zero_shot", voice="Ada", seed=1, stream=False)))
    by_id = _pcm(service.synthesize(SynthesisRequest(TEXT, "zero_shot", voice=info.id, seed=1, stream=False)))
    sft = _pcm(service.synthesize(SynthesisRequest(TEXT, "sft", voice="Ada", seed=1, stream=False)))
    assert by_name.numel() > 0 and torch.equal(by_name, by_id) and torch.equal(by_name, sft)
    with pytest.raises(AlreadyExistsError) as taken:
        service.create_voice(" Ada ", short_prompt_wav.read_bytes())
    assert taken.value.field == "name"
    with pytest.raises(AlreadyExistsError) as same:
        service.create_voice("Bob", short_prompt_wav.read_bytes(), TRANSCRIPT)
    assert same.value.field == "audio" and "'Ada'" in str(same.value)
    assert service.delete_voice("Ada").id == info.id
    with pytest.raises(NotFoundError) as gone:
        service.delete_voice("Ada")
    assert gone.value.field == "voice"


def test_voice_without_transcript_speaks_cross_lingual_but_not_zero_shot(service: TTSService,
                                                                         short_prompt_wav: Path) -> None:
    samples, rate = sf.read(short_prompt_wav, dtype="float32")
    service.create_voice("Quiet", (samples, rate))  # no transcript
    try:
        with pytest.raises(InvalidInputError, match="no transcript") as info:
            service.synthesize(SynthesisRequest(TEXT, "zero_shot", voice="Quiet"))
        assert info.value.field == "voice"
        session = service.synthesize(SynthesisRequest(TEXT, "sft", voice="Quiet", seed=2, stream=False))
        assert session.prepared.engine_mode == "cross_lingual"
        assert _pcm(session).numel() > 0
    finally:
        service.delete_voice("Quiet")


def test_busy_is_refused_at_once_and_slots_come_back(tts, library: VoiceLibrary, short_prompt_wav: Path) -> None:
    service = TTSService(tts.model, library, Limits(max_sessions=1, max_queued_requests=0, queue_timeout_seconds=30))
    seen: list[Outcome] = []
    service.add_listener(seen.append)
    request = SynthesisRequest(TEXT, "cross_lingual", prompt_audio=short_prompt_wav.read_bytes(), seed=3)
    first = service.synthesize(request)
    assert service.status().active_sessions == 1
    with pytest.raises(ResourceLimitError, match="busy"):
        service.synthesize(request)
    assert seen[-1].reason == "busy"
    next(first)  # mid-stream
    first.close()
    assert seen[-1].reason == "cancelled" and service.status().active_sessions == 0
    assert _pcm(service.synthesize(request)).numel() > 0
    assert seen[-1].reason is None and seen[-1].audio_seconds > 0 and seen[-1].first_chunk_seconds is not None


def test_a_waiting_request_gets_the_next_free_slot(tts, library: VoiceLibrary, short_prompt_wav: Path) -> None:
    service = TTSService(tts.model, library, Limits(max_sessions=1, max_queued_requests=1, queue_timeout_seconds=30))
    request = SynthesisRequest(TEXT, "cross_lingual", prompt_audio=short_prompt_wav.read_bytes(), seed=3)
    first = service.synthesize(request)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(service.synthesize(request)))
    waiter.start()
    while service.status().queued_requests == 0:
        waiter.join(0.01)
    with pytest.raises(ResourceLimitError):  # the queue (1) is full
        service.synthesize(request)
    first.close()
    waiter.join(30)
    assert got and _pcm(got[0]).numel() > 0
    assert service.status().active_sessions == 0 and service.status().queued_requests == 0


def test_async_sessions_match_sync_and_cancel(service: TTSService, short_prompt_wav: Path,
                                              outcomes: list[Outcome]) -> None:
    request = SynthesisRequest(TEXT * 2, "cross_lingual", prompt_audio=short_prompt_wav.read_bytes(), seed=8)
    expected = _pcm(service.synthesize(request))

    async def run() -> tuple[torch.Tensor, int]:
        whole = [chunk async for chunk in await service.asynthesize(request)]
        session = await service.asynthesize(request)
        await session.__anext__()
        await session.aclose()
        await session.wait_closed()
        with pytest.raises(InvalidInputError) as info:
            await service.asynthesize(SynthesisRequest("", "cross_lingual", prompt_audio=b"x"))
        assert info.value.field == "text"
        return _pcm(whole), service.status().active_sessions

    pcm, active = asyncio.run(run())
    assert torch.equal(pcm, expected) and active == 0
    assert [o.reason for o in outcomes[-3:]] == [None, "cancelled", "invalid_input"]


def test_allowed_path(tmp_path: Path) -> None:
    (tmp_path / "a.wav").write_bytes(b"x")
    assert allowed_path("a.wav", tmp_path) == (tmp_path / "a.wav").resolve()
    for bad, root in (("../etc/passwd", tmp_path), ("/etc/passwd", tmp_path), ("missing.wav", tmp_path),
                      ("a.wav", None)):
        with pytest.raises(InvalidInputError) as info:
            allowed_path(bad, root)
        assert info.value.field == "prompt_audio"


def test_server_settings_from_env_and_flags() -> None:
    import argparse

    from cosyvoice.errors import ConfigError
    from cosyvoice.settings import ServerSettings, add_server_arguments, settings_from_args

    env = {"COSYVOICE_MODEL_DIR": "/models/cv3", "COSYVOICE_API_KEYS": "k1, k2", "COSYVOICE_PORT": "8080",
           "COSYVOICE_MAX_SESSIONS": "3"}
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    settings, limits = settings_from_args(parser.parse_args([]), env)
    assert settings.model_dir == "/models/cv3" and settings.api_keys == ("k1", "k2") and settings.port == 8080
    assert settings.cors_origins == () and limits.max_sessions == 3  # CORS closed unless configured
    args = parser.parse_args(["--model_dir", "m", "--port", "9", "--cors-origin", "https://a.example",
                              "--max-sessions", "2", "--max-queued-requests", "0"])
    settings, limits = settings_from_args(args, env)
    assert (settings.model_dir, settings.port, settings.cors_origins) == ("m", 9, ("https://a.example",))
    assert (limits.max_sessions, limits.max_queued_requests) == (2, 0)
    with pytest.raises(ConfigError, match="COSYVOICE_PORT"):
        ServerSettings.from_env({"COSYVOICE_PORT": "http"})
    with pytest.raises(ConfigError, match="CORS"):
        ServerSettings(api_keys=("k",), cors_origins=("*",))


class TypedText:
    """Text still being typed: the test ``put``s pieces, then ``end()``s it; the service's pump iterates it."""

    def __init__(self) -> None:
        self._pieces: queue.SimpleQueue[str | None] = queue.SimpleQueue()

    def put(self, piece: str) -> None:
        self._pieces.put(piece)

    def end(self) -> None:
        self._pieces.put(None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._pieces.get, None)


@pytest.mark.parametrize("voice_transcript", [TRANSCRIPT, ""])
def test_text_stream_speaks_before_the_text_ends(service: TTSService, short_prompt_wav: Path,
                                                 voice_transcript: str, outcomes: list[Outcome]) -> None:
    """Zero-shot voices use the engine's text-stream input, transcript-less ones sentence by sentence."""
    name = "Streamer" if voice_transcript else "Plain"
    service.create_voice(name, short_prompt_wav.read_bytes(), voice_transcript)
    try:
        pieces = TypedText()
        pieces.put("Hello there, my friend. ")  # enough text for a first chunk (bi-streaming: 5 text : 15 speech)
        pieces.put("How are you doing today, and how")
        session = service.synthesize_text_stream(SynthesisRequest("", "sft", voice=name, seed=5), pieces)
        assert session.prepared.engine_mode == ("zero_shot" if voice_transcript else "cross_lingual")
        first = next(session)  # audio before the text is complete
        assert first.index == 0 and first.pcm.numel() > 0
        pieces.put(" is the family?")
        pieces.end()
        rest = list(session)
        chunks = [first, *rest]
        assert [c.index for c in chunks] == list(range(len(chunks)))
        assert all(b.sample_offset == a.sample_offset + a.pcm.numel() for a, b in itertools.pairwise(chunks))
        assert chunks[-1].final and outcomes[-1].reason is None
        if not voice_transcript:
            assert sum(c.final for c in chunks) == 2  # two sentences
        # cancelling while the text is still open ends the session and frees its slot
        pieces = TypedText()
        pieces.put("One more sentence, with a few more words. And")
        session = service.synthesize_text_stream(SynthesisRequest("", "sft", voice=name, seed=5), pieces)
        next(session)
        session.close()
        assert outcomes[-1].reason == "cancelled" and service.status().active_sessions == 0
    finally:
        service.delete_voice(name)


def test_text_feed_hands_over_complete_sentences(tts) -> None:
    from cosyvoice.engine import CancelToken
    from cosyvoice.pipeline import TextFeed

    feed = TextFeed(tts.frontend, 100, "sentences")
    for piece in ["Hel", "lo. It costs 3", ".14 now! 你好。", "Bye"]:
        feed.write(piece)
    feed.close()
    assert list(feed.sentences(CancelToken())) == ["Hello.", "It costs 3.14 now!", "你好。", "Bye"]
    feed = TextFeed(tts.frontend, 100, "sentences")
    with pytest.raises(InvalidInputError) as info:
        feed.write(5)
    assert info.value.field == "text"
    with pytest.raises(InvalidInputError):  # the reader fails with the writer's error
        list(feed.sentences(CancelToken()))


@pytest.mark.parametrize(("text", "mode"), [("<|endofprompt|>", "cross_lingual"),
                                           ("Hello there.<|endofprompt|>  ", "zero_shot"),
                                           ("You are a helpful assistant.<|endofprompt|>", "cross_lingual")])
def test_text_with_only_a_prompt_marker_names_the_field(service: TTSService, text: str, mode: str) -> None:
    request = SynthesisRequest(text, mode, prompt_audio=b"never decoded", transcript=TRANSCRIPT)
    with pytest.raises(InvalidInputError, match="nothing to speak after <\\|endofprompt\\|>") as info:
        service.synthesize(request)
    assert info.value.field == "text"


def test_admission_serves_threads_and_tasks_in_arrival_order() -> None:
    """One queue for threads and asyncio tasks: a freed slot goes to the longest waiter (no overtaking)."""
    from cosyvoice.admission import Admission

    admission = Admission(max_active=1, max_waiting=3, timeout=30)
    admission.acquire()
    order: list[str] = []

    def thread_waiter(name: str) -> threading.Thread:
        def run() -> None:
            admission.acquire()
            order.append(name)
        t = threading.Thread(target=run)
        t.start()
        while admission.waiting < int(name[-1]):  # queued in this order
            t.join(0.005)
        return t

    async def scenario() -> None:
        first = thread_waiter("thread-1")
        task = asyncio.create_task(admission.aacquire())
        while admission.waiting < 2:
            await asyncio.sleep(0.005)
        third = thread_waiter("thread-3")
        with pytest.raises(ResourceLimitError, match="busy"):  # the queue (3) is full
            admission.acquire()
        admission.release()  # -> thread-1
        first.join(5)
        admission.release()  # -> the task
        await asyncio.wait_for(task, 5)
        order.append("task-2")
        admission.release()  # -> thread-3
        third.join(5)
        admission.release()

    asyncio.run(scenario())
    assert order == ["thread-1", "task-2", "thread-3"]
    assert admission.active == 0 and admission.waiting == 0


def test_a_cancelled_async_wait_leaves_no_slot_behind() -> None:
    from cosyvoice.admission import Admission

    admission = Admission(max_active=1, max_waiting=2, timeout=30)

    async def scenario() -> None:
        admission.acquire()
        task = asyncio.create_task(admission.aacquire())
        while admission.waiting == 0:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        admission.release()

    asyncio.run(scenario())
    assert admission.active == 0 and admission.waiting == 0


def test_drain_refuses_new_requests_then_cancels_running_ones(tts, library: VoiceLibrary,
                                                              short_prompt_wav: Path) -> None:
    service = TTSService(tts.model, library, Limits(max_sessions=2, max_queued_requests=2, queue_timeout_seconds=30))
    seen: list[Outcome] = []
    service.add_listener(seen.append)
    request = SynthesisRequest(TEXT * 4, "cross_lingual", prompt_audio=short_prompt_wav.read_bytes(), seed=3)

    async def scenario() -> list:
        running = await service.asynthesize(request)
        await running.__anext__()  # mid-stream, and nobody reads further: only the drain can end it
        drain = asyncio.create_task(service.drain(grace_seconds=0.2))
        await asyncio.sleep(0.05)
        with pytest.raises(ResourceLimitError, match="shutting down"):
            await service.asynthesize(request)
        await asyncio.wait_for(drain, 10)
        assert tts.engine.active_sessions == 0  # the drain returns once the engine computes for nobody
        rest = []
        with pytest.raises(CancelledByShutdown, match="retry on another server"):  # not an end that looks whole
            async for chunk in running:
                rest.append(chunk)
        return rest

    rest = asyncio.run(scenario())
    assert not any(c.final for c in rest)
    assert service.active_sessions == 0 and "cancelled" in [o.reason for o in seen]


def test_a_request_whose_last_chunk_was_read_ends_whole_when_the_shutdown_lands_after_it(
        service: TTSService, short_prompt_wav: Path) -> None:
    """The drain's cancel can land between the last chunk and the reader's next call: the audio is whole, so the
    iteration ends (a server answers 200, a batch keeps the take) and the outcome is not a cancel."""
    seen: list[Outcome] = []
    service.add_listener(seen.append)
    request = SynthesisRequest(TEXT, "cross_lingual", prompt_audio=short_prompt_wav.read_bytes(), seed=3,
                               stream=True)
    with service.synthesize(request) as session:
        chunks = [next(session)]
        while not chunks[-1].final:
            chunks.append(next(session))
        assert len(session.prepared.segments) == 1
        service.cancel_all()
        assert list(session) == []  # no CancelledByShutdown
    assert [o.reason for o in seen] == [None]


def test_a_request_its_reader_cancels_is_not_reported_as_shut_down(service: TTSService,
                                                                   short_prompt_wav: Path) -> None:
    request = SynthesisRequest(TEXT * 4, "cross_lingual", prompt_audio=short_prompt_wav.read_bytes(), seed=3)
    with service.synthesize(request) as session:
        next(session)
        session.cancel()  # a Stop button, a client that hung up: the iteration just ends, as its reader expects
        assert not any(chunk.final for chunk in session)


def test_an_unseeded_request_gets_the_one_seed_draw_below_2_53(service: TTSService, short_prompt_wav: Path) -> None:
    """The service draws every missing seed (adapters read it back as ``session.seed``), from torch's global
    generator and in a range a JavaScript number or a spreadsheet cell holds exactly."""
    assert all(0 <= draw_seed() < 2**53 for _ in range(2000))
    request = SynthesisRequest("Hello there.", "cross_lingual", prompt_audio=short_prompt_wav.read_bytes())
    seeds = []
    for _ in range(2):
        torch.manual_seed(11)
        seeds.append(service.prepare(request).seed)
    assert seeds[0] == seeds[1] < 2**53
    with service.synthesize(request) as session:
        assert session.seed == session.prepared.seed < 2**53
