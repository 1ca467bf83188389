"""Engine sessions: chunk policy, isolation between concurrent requests, cancellation, cleanup, limits."""

from __future__ import annotations

import argparse
import contextlib
import gc
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from memory_probe import live_tensors, rss_bytes
from waiting import until

from cosyvoice.engine import CancelToken, ChunkPolicy, ChunkSchedule, Engine
from cosyvoice.errors import ConfigError, CosyVoiceError
from cosyvoice.frontend.prompts import cross_lingual_text, instruct_text, zero_shot_prompt_text
from cosyvoice.settings import Limits, add_server_arguments, settings_from_args
from cosyvoice.tools.parity.tolerances import STREAM_MEL_ATOL

PROMPT_TEXT = zero_shot_prompt_text("Hello, this is a short prompt for testing.")
SHORT = "Hi."  # 3 text tokens: at most 60 speech tokens, still two chunks after a 1.2 s prompt


def _producer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("cosyvoice-llm-")]


def test_chunk_policy_matches_the_reference_schedule() -> None:
    policy = ChunkPolicy(prompt_len=73, hop=25, lookahead=3)
    assert policy.current_hop() == 27  # 25 + (ceil(73/25)*25 - 73)
    assert not policy.ready(29) and policy.ready(30)
    assert policy.advance() == (0, 27)
    assert policy.current_hop() == 50 and policy.ready(80) and not policy.ready(79)
    assert policy.advance() == (27, 77)
    assert policy.advance() == (77, 177)  # grows to 100 and stays there
    assert policy.advance() == (177, 277)
    assert ChunkPolicy(prompt_len=75).current_hop() == 25  # already aligned: no pad
    assert ChunkPolicy(prompt_len=0).current_hop() == 25


def test_each_request_starts_with_its_own_hop(tts, prompt_wav: Path) -> None:
    """The reference grows one hop length shared by all requests; ours restarts per session."""
    def bounds() -> list[tuple[int, int]]:
        chunks = tts.synthesize("zero_shot", "Hello there, my friend.", prompt_text=PROMPT_TEXT,
                                prompt_wav=prompt_wav, stream=True, seed=1)
        return [(c.token_start, c.token_end) for c in chunks]

    first, second = bounds(), bounds()
    assert first == second and len(first) >= 2


def _request(tts, prompt_wav: Path, i: int) -> torch.Tensor:
    mode = ("zero_shot", "cross_lingual", "instruct2")[i % 3]
    text = ["Good day.", "Hi there.", "Hello, friend."][i % 3]
    kwargs = {"prompt_wav": prompt_wav, "stream": i % 2 == 0, "seed": 100 + i}
    if mode == "zero_shot":
        kwargs["prompt_text"] = PROMPT_TEXT
    elif mode == "cross_lingual":
        text = cross_lingual_text(text)
    else:
        kwargs["instruct_text"] = instruct_text("Speak cheerfully.")
    return torch.cat([c.pcm for c in tts.synthesize(mode, text, **kwargs)])


def test_concurrent_requests_equal_sequential_ones(tts, short_prompt_wav: Path) -> None:
    # six: every mode streamed and not, all at once
    sequential = [_request(tts, short_prompt_wav, i) for i in range(6)]
    with ThreadPoolExecutor(max_workers=6) as pool:
        concurrent = list(pool.map(lambda i: _request(tts, short_prompt_wav, i), range(6)))
    for i, (a, b) in enumerate(zip(sequential, concurrent, strict=True)):
        assert a.shape == b.shape and torch.equal(a, b), f"request {i} differs when run concurrently"
    assert tts.engine.active_sessions == 0


def _engine_like(tts, **limits) -> Engine:
    e = tts.engine
    return Engine(e.config, e.llm, e.flow, e.hift, e.device, Limits(**limits))


def _model_input(tts, prompt_wav: Path, text: str = "Hello there, my friend, how are you today?"):
    voice = tts.frontend.voice(PROMPT_TEXT, prompt_wav)
    return tts.frontend.model_input(text, voice)


@contextlib.contextmanager
def _on_llm_forward(llm, hook):
    """Run ``hook(module, inputs, logits)`` on every forward call of the real LLM's head (one per decode step)."""
    handle = llm.llm_decoder.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def test_closing_the_stream_stops_the_llm_within_one_step(tts, prompt_wav: Path) -> None:
    engine = _engine_like(tts)
    calls = []

    def count_and_pace(*_) -> None:  # a step of a real-size model: the LLM must still be running at close()
        calls.append(1)
        time.sleep(0.02)

    with _on_llm_forward(engine.llm, count_and_pace):
        stream = engine.synthesize(_model_input(tts, prompt_wav), stream=True, seed=0)
        next(stream)
        at_close = len(calls)
        stream.close()
        after_close = len(calls)
        assert after_close - at_close <= 1
        assert engine.active_sessions == 0 and not _producer_threads()
        assert at_close < 20 * 12  # it had not simply run to max_len before we closed
        until(lambda: engine.scheduler.active == 0, 10, "the ticket's end")  # no step can follow
        assert len(calls) == after_close  # and nothing ran after close() returned
    engine.close()




def _cancel_while_held(engine: Engine, read: Callable[[CancelToken], None], entered: threading.Event,
                       proceed: threading.Event, what: str) -> None:
    """Run ``read(token)`` on a thread and cancel its token once the worker is held inside a flow step
    (``entered``): the reader ends at once while the worker still holds the session, which it frees after the
    step once let go on (``proceed``)."""
    token, ended = CancelToken(), threading.Event()

    def run() -> None:
        read(token)
        ended.set()

    threading.Thread(target=run, daemon=True).start()
    assert entered.wait(60), f"{what} never ran"
    token.cancel()
    assert ended.wait(10), "the cancelled reader waited for the flow call to end"
    assert engine.active_sessions == 1  # the worker still holds the session
    proceed.set()
    until(lambda: engine.active_sessions == 0, 30, "the worker's release after its flow step")


def test_a_cancel_from_another_thread_ends_the_reader_while_the_worker_computes(tts, prompt_wav: Path) -> None:
    """A whole (unstreamed) utterance is one flow call of seconds on a real model: a token cancelled meanwhile
    (a Stop button, a server draining) ends the reader at once; the worker's flow stops before its next Euler step,
    the vocoder never runs, and the session is freed."""
    engine = _engine_like(tts)
    entered, proceed = threading.Event(), threading.Event()
    flow_steps, vocoder_calls = [], []

    def hold(*_) -> None:  # the worker is inside the flow's first step until the test lets it go on
        flow_steps.append(1)
        entered.set()
        assert proceed.wait(60), "the test never let the flow go on"

    handles = [engine.flow.decoder.estimator.register_forward_pre_hook(hold),
               engine.hift.f0_predictor.register_forward_pre_hook(lambda *_: vocoder_calls.append(1))]
    try:
        chunks: list[torch.Tensor] = []

        def read(token: CancelToken) -> None:
            chunks.extend(c.pcm for c in engine.synthesize(_model_input(tts, prompt_wav), seed=0, fixed_tokens=30,
                                                           cancel=token))

        _cancel_while_held(engine, read, entered, proceed, "the flow")
        assert chunks == [] and len(flow_steps) == 1 and vocoder_calls == []
    finally:
        proceed.set()
        for handle in handles:
            handle.remove()
    engine.close()


@pytest.mark.parametrize("final", ["full", "chunked"])
def test_a_cancel_ends_a_streamed_flow_call_before_its_next_euler_step(tts, prompt_wav: Path, final: str) -> None:
    """A stream's flow calls are ten Euler steps each, its last one (full attention over the whole utterance, or
    the chunked extension) the longest: a token cancelled during one ends it before its next step, so the worker
    is free for the next request at once instead of finishing a chunk nobody will hear."""
    engine = _engine_like(tts)
    armed, entered, proceed = threading.Event(), threading.Event(), threading.Event()
    steps_after_arming = []

    def hold(*_) -> None:  # once armed, the worker waits inside the step it is in until the test lets it go on
        if armed.is_set():
            steps_after_arming.append(1)
            entered.set()
            assert proceed.wait(60), "the test never let the flow go on"

    handle = engine.flow.decoder.estimator.input_embed.register_forward_pre_hook(hold)
    try:
        chunks: list[torch.Tensor] = []

        def read(token: CancelToken) -> None:
            for chunk in engine.synthesize(_model_input(tts, prompt_wav), stream=True, seed=0, fixed_tokens=60,
                                           cancel=token, schedule=ChunkSchedule(final=final)):
                chunks.append(chunk.pcm)
                armed.set()  # the first chunk is out: the next flow call is the last one

        _cancel_while_held(engine, read, entered, proceed, "the last flow call")
        assert len(chunks) == 1 and len(steps_after_arming) == 1  # of the call's 10
    finally:
        proceed.set()
        handle.remove()
    engine.close()


def test_thirty_requests_half_abandoned_leave_nothing_behind(tts, short_prompt_wav: Path) -> None:
    engine = tts.engine
    inp = _model_input(tts, short_prompt_wav, SHORT)

    def run(i: int) -> None:
        stream = engine.synthesize(inp, stream=True, seed=i, fixed_tokens=60)  # SHORT's max_len: always 2+ chunks
        if i % 2:
            next(stream)
            del stream  # abandoned mid-stream without close(): the generator's finaliser must clean up
        else:
            chunks = list(stream)
            assert len(chunks) >= 2, "SHORT must stream in more than one chunk for this test to mean anything"

    for i in range(4):  # warm caches (mel bases, noise prefixes) before measuring
        run(i)
    gc.collect()
    tensors_before, objects_before, rss_before = live_tensors(), len(gc.get_objects()), rss_bytes()
    for i in range(30):
        run(i)
    gc.collect()
    assert engine.active_sessions == 0
    assert not _producer_threads()
    assert live_tensors() <= tensors_before
    objects_growth = len(gc.get_objects()) - objects_before
    assert objects_growth < 500, f"{objects_growth} more live Python objects after 30 requests"
    rss_growth = rss_bytes() - rss_before
    assert rss_growth < 64 * 2**20, f"resident memory grew by {rss_growth / 2**20:.1f} MiB over 30 requests"


def test_sessions_beyond_the_rows_wait_for_one(tts, prompt_wav: Path) -> None:
    """No admission in the engine: with one LLM row, a second session waits in the scheduler's queue (no "busy"
    error, no timeout) and runs once the first leaves its row; both give their audio for their seeds."""
    alone = _engine_like(tts)
    inp = _model_input(tts, prompt_wav, SHORT)
    lengths = (100, 40)
    expected = [torch.cat([c.pcm for c in alone.synthesize(inp, stream=True, seed=s, fixed_tokens=n)])
                for s, n in enumerate(lengths)]
    alone.close()
    engine = _engine_like(tts, max_sessions=1, queue_timeout_seconds=0.01)
    with _on_llm_forward(engine.llm, lambda *_: time.sleep(0.01)):  # the first session's LLM is still running
        first = engine.synthesize(inp, stream=True, seed=0, fixed_tokens=lengths[0])
        head = next(first)  # the first session holds the only row
        second = engine.synthesize(inp, stream=True, seed=1, fixed_tokens=lengths[1])
        got_second: list[torch.Tensor] = []
        reader = threading.Thread(target=lambda: got_second.extend(c.pcm for c in second))
        reader.start()
        time.sleep(0.2)  # far beyond queue_timeout_seconds: nothing refuses the waiting session
        waiting = [s for s in engine._sessions.values() if s.seed == 1]
        assert engine.active_sessions == 2 and engine.scheduler.active == 2 and waiting[0].tokens == []
        rest = [c.pcm for c in first]
        reader.join(60)
    assert not reader.is_alive()
    assert torch.equal(torch.cat([head.pcm, *rest]), expected[0]) and torch.equal(torch.cat(got_second), expected[1])
    assert engine.active_sessions == 0 and engine.scheduler.active == 0
    engine.close()


def test_llm_failure_reaches_the_caller_and_frees_the_session(tts, prompt_wav: Path) -> None:
    engine = _engine_like(tts)
    calls = []

    def fail_on_second_step(*_) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("device lost")

    with _on_llm_forward(engine.llm, fail_on_second_step), pytest.raises(CosyVoiceError, match="device lost"):
        list(engine.synthesize(_model_input(tts, prompt_wav), stream=True, seed=0))
    assert engine.active_sessions == 0 and not _producer_threads()
    # the scheduler survives: the next request runs
    assert list(engine.synthesize(_model_input(tts, prompt_wav, SHORT), seed=1, fixed_tokens=5))[-1].final
    engine.close()


def test_no_speech_tokens_gives_an_empty_final_chunk(tts, prompt_wav: Path) -> None:
    engine = _engine_like(tts)
    eos = engine.llm.eos

    def only_eos(_module, _inputs, logits: torch.Tensor) -> torch.Tensor:
        return torch.full_like(logits, -1e4).index_fill(-1, torch.tensor([eos]), 0.0)

    with _on_llm_forward(engine.llm, only_eos):
        chunks = list(engine.synthesize(_model_input(tts, prompt_wav), stream=True, seed=0))
    assert len(chunks) == 1 and chunks[0].final and chunks[0].pcm.numel() == 0
    engine.close()


class _BrokenFlow:
    """A flow that fails like a device would, to see the failure reach the caller as our error type."""

    def eval(self):
        return self

    def inference(self, **kwargs):
        raise RuntimeError("illegal memory access")


def test_vocoder_side_failure_is_a_cosyvoice_error_and_frees_the_session(tts, prompt_wav: Path) -> None:
    e = tts.engine
    engine = Engine(e.config, e.llm, _BrokenFlow(), e.hift, e.device, Limits(), incremental_flow=False)
    with pytest.raises(CosyVoiceError, match="speech synthesis failed: RuntimeError: illegal memory access"):
        list(engine.synthesize(_model_input(tts, prompt_wav), stream=False, seed=0))
    assert engine.active_sessions == 0 and not _producer_threads()


def test_limits_refuse_prompts_longer_than_the_tokenizer_accepts() -> None:
    from cosyvoice.errors import ConfigError

    with pytest.raises(ConfigError, match="at most 30 s"):
        Limits(max_prompt_seconds=45)
    assert Limits.from_env({"COSYVOICE_MAX_SESSIONS": "3"}).max_sessions == 3


class _RecordingVocoder:
    """The real vocoder, recording the mel each call is given."""

    def __init__(self, hift) -> None:
        self.hift, self.mels = hift, []

    def eval(self):
        return self

    def inference(self, speech_feat, finalize):
        self.mels.append(speech_feat.clone())
        return self.hift.inference(speech_feat=speech_feat, finalize=finalize)


def test_incremental_streaming_equals_the_reference_recompute_strategy(tts, prompt_wav: Path) -> None:
    """FlowStream and HiFTStream give what re-running flow and vocoder over the whole utterance gives."""
    e = tts.engine
    inp = _model_input(tts, prompt_wav)
    tokens = torch.randint(0, e.config.flow.vocab_size, (180,), generator=torch.Generator().manual_seed(0))

    def run(incremental_flow: bool, incremental_vocoder: bool, hift=e.hift):
        engine = Engine(e.config, e.llm, e.flow, hift, e.device, Limits(), incremental_flow=incremental_flow,
                        incremental_vocoder=incremental_vocoder)
        return list(engine.vocode(tokens, inp, stream=True))

    # the flow: compare the mel the vocoder gets (the random tiny vocoder amplifies 1e-6 differences)
    ours, theirs = _RecordingVocoder(e.hift), _RecordingVocoder(e.hift)
    chunks, reference = run(True, False, ours), run(False, False, theirs)
    assert len(chunks) >= 3
    assert [(c.token_start, c.token_end, c.pcm.numel()) for c in chunks] == \
        [(c.token_start, c.token_end, c.pcm.numel()) for c in reference]
    for a, b in zip(ours.mels, theirs.mels, strict=True):  # rounding only (the parity tool's rule)
        assert a.shape == b.shape and torch.allclose(a, b, atol=STREAM_MEL_ATOL, rtol=0)
    # the vocoder: the same samples from a bounded window as from the whole mel
    for a, b in zip(run(False, True), reference, strict=True):
        assert torch.allclose(a.pcm, b.pcm, atol=1e-5, rtol=0)


def _first_chunk_run(tts, inp, priority: bool) -> tuple[bool, torch.Tensor]:
    """(whether the LLM made 3 steps while the first chunk was computed, the request's audio) on an engine with
    ``first_chunk_priority``; the LLM steps every few ms when it may, so 3 steps come at once unless held back."""
    e = tts.engine
    engine = Engine(e.config, e.llm, e.flow, e.hift, e.device, Limits(), first_chunk_priority=priority)
    in_first, stepped, during, seen = threading.Event(), threading.Event(), [0], []
    computed = engine.t2w.chunks

    def chunks(items):
        first = items[0][1].next_index == 0
        if first:
            in_first.set()
        out = computed(items)
        if first:
            seen.append(stepped.wait(0.5 if priority else 30))  # held: none come (one in flight at most)
            in_first.clear()
        return out

    def count(*_) -> None:
        if in_first.is_set():
            during[0] += 1
            if during[0] >= 3:
                stepped.set()

    engine.t2w.chunks = chunks
    with _on_llm_forward(engine.llm, count):
        pcm = torch.cat([c.pcm for c in engine.synthesize(inp, stream=True, seed=3, fixed_tokens=120)])
    engine.close()
    return seen[0], pcm


def test_the_llm_waits_while_a_first_chunk_is_computed_and_the_audio_is_the_same(tts, prompt_wav: Path) -> None:
    """first_chunk_priority: the session's LLM makes no step while its first chunk is computed (without it, it
    keeps decoding), and the tokens and audio are bit-identical either way."""
    inp = _model_input(tts, prompt_wav)
    stepped_held, held = _first_chunk_run(tts, inp, priority=True)
    stepped_free, free = _first_chunk_run(tts, inp, priority=False)
    assert not stepped_held and stepped_free
    assert torch.equal(held, free)


def _teams(tts, inp, priority: bool) -> list[tuple[int, int]]:
    """(chunk index, the worker's torch team when it began) of each chunk of a request on an engine whose worker
    runs 1 thread while the LLM steps and 3 when it has none; the LLM is kept mid-request (a step waits) until the
    first chunk has begun, so "stepping" is decided by the hold alone, never by timing."""
    e = tts.engine
    engine = Engine(e.config, e.llm, e.flow, e.hift, e.device, Limits(), threads=(1, 1),
                    first_chunk_priority=priority)
    engine.worker.wide_threads = 3
    teams, begun, steps = [], threading.Event(), [0]
    computed = engine.t2w.chunks

    def chunks(items):
        teams.append((items[0][1].next_index, torch.get_num_threads()))
        begun.set()
        return computed(items)

    def wait_for_the_first_chunk(*_) -> None:
        steps[0] += 1
        if steps[0] > 60:  # past the first chunk's tokens (its hop, padded to whole hops with the prompt: < 50)
            assert begun.wait(30)

    engine.t2w.chunks = chunks
    with _on_llm_forward(engine.llm, wait_for_the_first_chunk):
        list(engine.synthesize(inp, stream=True, seed=3, fixed_tokens=120))
    engine.close()
    return teams


def test_the_worker_takes_every_core_while_the_llm_has_no_step(tts, prompt_wav: Path) -> None:
    """The worker's torch team is narrow for a chunk begun while the LLM decodes, and every core's for one begun
    while it has no step: the first chunk with the session's LLM held, the last one after it finished."""
    inp = _model_input(tts, prompt_wav)
    held, free = _teams(tts, inp, priority=True), _teams(tts, inp, priority=False)
    assert held[0] == (0, 3) and free[0] == (0, 1)
    assert held[-1][1] == 3 and free[-1][1] == 3 and len(held) == len(free) > 2


def test_first_chunk_priority_is_a_deployment_setting(tts, monkeypatch: pytest.MonkeyPatch) -> None:
    """COSYVOICE_FIRST_CHUNK_PRIORITY (and --first-chunk-priority) reach the engine; a typo is refused by name.
    Unset, a CPU engine holds the LLM (its first chunk then has every core) and a GPU one does not."""
    assert Limits.from_env({}).first_chunk_priority is None
    e = tts.engine
    engine = Engine(e.config, e.llm, e.flow, e.hift, e.device, Limits())
    assert engine.first_chunk_priority is (e.device.type == "cpu")
    engine.close()
    assert Limits.from_env({"COSYVOICE_FIRST_CHUNK_PRIORITY": "on"}).first_chunk_priority is True
    assert Limits.from_env({"COSYVOICE_FIRST_CHUNK_PRIORITY": "false"}).first_chunk_priority is False
    with pytest.raises(ConfigError, match="COSYVOICE_FIRST_CHUNK_PRIORITY='sometimes' is not a valid flag"):
        Limits.from_env({"COSYVOICE_FIRST_CHUNK_PRIORITY": "sometimes"})
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    _, limits = settings_from_args(parser.parse_args(["--first-chunk-priority", "on"]), environ={})
    assert limits.first_chunk_priority is True
    engine = Engine(e.config, e.llm, e.flow, e.hift, e.device, limits)
    assert engine.first_chunk_priority is True
    engine.first_chunk_priority = False  # switchable between requests
    assert engine.first_chunk_priority is False
    engine.close()
