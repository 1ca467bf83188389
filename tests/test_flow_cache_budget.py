"""The incremental flow cache's default budget follows the device's free memory, and a stream past it
recomputes with the same output."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
import torch

from cosyvoice.engine import Engine, Session, T2WState, Token2Wav
from cosyvoice.engine import engine as engine_module
from cosyvoice.engine.memory import FLOW_CACHE_MAX_MB, FlowCacheLedger, default_flow_cache_mb, free_memory_bytes
from cosyvoice.flow import FlowStream
from cosyvoice.settings import Limits

GIB = 2**30


def test_the_default_budget_is_half_the_free_memory_up_to_a_cap() -> None:
    assert default_flow_cache_mb(24 * GIB) == 12288.0  # a 24 GB CPU box, all free
    assert default_flow_cache_mb(3 * GIB) == 1536.0
    assert default_flow_cache_mb(1024 * GIB) == FLOW_CACHE_MAX_MB == 32768.0  # a large GPU: the former default
    free = free_memory_bytes(torch.device("cpu"))
    assert 0 < free <= 2**50  # read from this host (MemAvailable or its cgroup's room)


def test_limits_read_the_budget_from_the_environment_or_leave_it_to_the_engine() -> None:
    assert Limits.from_env({}).flow_cache_mb is None
    assert Limits.from_env({"COSYVOICE_FLOW_CACHE_MB": "2048"}).flow_cache_mb == 2048.0


@pytest.fixture
def free_memory(monkeypatch: pytest.MonkeyPatch):
    """Set the free memory the engine reads at its start."""
    def set_free(free_bytes: int) -> None:
        monkeypatch.setattr(engine_module, "free_memory_bytes", lambda device: free_bytes)
    return set_free


def test_the_engine_takes_its_budget_from_the_memory_free_at_start(tts, free_memory) -> None:
    e = tts.engine
    free_memory(8 * GIB)
    engine = Engine(e.config, e.llm, e.flow, e.hift, e.device, Limits(max_sessions=4))
    assert engine.flow_cache_mb == 4096.0 and engine.flow_cache_share == 1024 * 2**20  # 4 GiB over 4 sessions
    engine.close()
    free_memory(1 * GIB)  # a deployment's figure wins over the machine's
    engine = Engine(e.config, e.llm, e.flow, e.hift, e.device, Limits(max_sessions=2, flow_cache_mb=300.0))
    assert engine.flow_cache_mb == 300.0 and engine.flow_cache_share == 150 * 2**20
    engine.close()


def test_a_stream_over_a_small_machine_budget_recomputes_the_same_mel(tts, prompt_wav: Path, free_memory,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine with little free memory the default share holds the prompt and two chunks; the stream then
    drops its cache and recomputes, and its mel is what the recompute path (the reference's) gives throughout."""
    e = tts.engine
    inp = tts.frontend.model_input("Hi there, friend.", tts.frontend.voice("A prompt.", prompt_wav))
    tokens = torch.randint(0, e.config.flow.vocab_size, (300,), generator=torch.Generator().manual_seed(0))
    mels: dict[int, list[torch.Tensor]] = defaultdict(list)
    vocode = Token2Wav.vocode

    def spy(self: Token2Wav, state, mel: torch.Tensor, *args) -> torch.Tensor:
        mels[id(self)].append(mel.clone())
        return vocode(self, state, mel, *args)

    monkeypatch.setattr(Token2Wav, "vocode", spy)
    share_frames = 400  # the prompt and the first two chunks fit, the third does not
    free_memory(int(2 * share_frames * FlowStream.bytes_per_frame(e.flow)))
    bounded = Engine(e.config, e.llm, e.flow, e.hift, e.device, Limits(max_sessions=1))
    recompute = Engine(e.config, e.llm, e.flow, e.hift, e.device, Limits(max_sessions=1), incremental_flow=False)
    got, want = list(bounded.vocode(tokens, inp, stream=True)), list(recompute.vocode(tokens, inp, stream=True))
    assert bounded.flow_cache_fallbacks == 1 and bounded.flow_cache_bytes == 0
    assert [(c.token_start, c.token_end) for c in got] == [(c.token_start, c.token_end) for c in want]
    assert len(got) >= 4
    ours, reference = mels[id(bounded.t2w)], mels[id(recompute.t2w)]
    assert [m.shape for m in ours] == [m.shape for m in reference]
    torch.testing.assert_close(torch.cat(ours, dim=2), torch.cat(reference, dim=2), atol=1e-4, rtol=0)
    bounded.close()
    recompute.close()


def _chunks_so_far(t2w: Token2Wav, session: Session, state: T2WState, n: int) -> list:
    """Run ``n`` of ``session``'s due chunks through ``t2w`` in this thread."""
    return [t2w.chunk(session, state, state.take(session)) for _ in range(n) if state.due(session)]


def _session(t2w: Token2Wav, sid: int, inp, tokens: torch.Tensor) -> tuple[Session, T2WState]:
    """A streamed session whose LLM has finished with ``tokens``, and its token-to-wave state."""
    session = Session(sid, 0, inp, stream=True, speed=1.0)
    session.add_tokens(tuple(tokens.tolist()))
    session.llm_finished(None)
    return session, t2w.open(session)


def test_a_stream_alone_keeps_its_cache_past_its_share(tts, prompt_wav: Path) -> None:
    """With eight sessions' shares of the budget and one stream running, that stream borrows the rest: it keeps
    its cache to the end (no recompute, the same audio as an unbounded engine's), where its share alone ended
    it after two chunks."""
    e = tts.engine
    inp = tts.frontend.model_input("Hi there, friend.", tts.frontend.voice("A prompt.", prompt_wav))
    tokens = torch.randint(0, e.config.flow.vocab_size, (300,), generator=torch.Generator().manual_seed(0))
    frames = (inp.flow_prompt_speech_token.shape[1] + 300) * e.config.flow.token_mel_ratio
    budget_mb = 1.1 * frames * FlowStream.bytes_per_frame(e.flow) / 2**20
    lone = Engine(e.config, e.llm, e.flow, e.hift, e.device, Limits(max_sessions=8, flow_cache_mb=budget_mb))
    unbounded = Engine(e.config, e.llm, e.flow, e.hift, e.device, Limits(max_sessions=1))
    assert lone.flow_cache_share < frames * FlowStream.bytes_per_frame(e.flow) / 4  # its share: about a chunk
    got, want = list(lone.vocode(tokens, inp, stream=True)), list(unbounded.vocode(tokens, inp, stream=True))
    assert len(got) >= 4 and lone.flow_cache_fallbacks == 0 and lone.flow_cache_bytes == 0
    assert all(torch.equal(a.pcm, b.pcm) for a, b in zip(got, want, strict=True))
    lone.close()
    unbounded.close()


def test_a_stream_within_its_share_takes_back_what_another_borrowed(tts, prompt_wav: Path) -> None:
    """Stream A borrows past its share while alone; stream B starts and asks for its share: A is dropped to
    recomputing (its audio goes on), B keeps its cache, and the reservations never pass the budget."""
    e = tts.engine
    inp = tts.frontend.model_input("Hi there, friend.", tts.frontend.voice("A prompt.", prompt_wav))
    tokens = torch.randint(0, e.config.flow.vocab_size, (300,), generator=torch.Generator().manual_seed(0))
    per_frame = FlowStream.bytes_per_frame(e.flow)
    budget = (inp.flow_prompt_speech_token.shape[1] + 300) * e.config.flow.token_mel_ratio * per_frame
    ledger = FlowCacheLedger(budget, budget / 2)
    t2w = Token2Wav(e.config, e.flow, e.hift, e.device, flow_cache=ledger)
    a, a_state = _session(t2w, 0, inp, tokens)
    b, b_state = _session(t2w, 1, inp, tokens)
    reserved = []
    for _ in range(4):
        _chunks_so_far(t2w, a, a_state, 1)
        reserved.append(ledger.reserved)
    assert a_state.flow_stream.caching and reserved[-1] > ledger.share  # A borrowed
    assert ledger.fallbacks == 0
    _chunks_so_far(t2w, b, b_state, 1)
    assert not a_state.flow_stream.caching and b_state.flow_stream.caching and ledger.fallbacks == 1
    assert ledger.reserved <= ledger.share
    rest = _chunks_so_far(t2w, a, a_state, 100)  # A goes on, recomputing
    assert rest and rest[-1].final and ledger.fallbacks == 1
    t2w.release(a)
    t2w.release(b)
    assert ledger.reserved == 0
