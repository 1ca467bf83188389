"""The incremental flow cache's default budget follows the device's free memory, and a stream past it
recomputes with the same output."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
import torch

from cosyvoice.engine import Engine, Token2Wav
from cosyvoice.engine import engine as engine_module
from cosyvoice.engine.memory import FLOW_CACHE_MAX_MB, default_flow_cache_mb, free_memory_bytes
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
