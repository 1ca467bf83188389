"""The packed DiT step compiled per static shape bucket (cosyvoice/engine/graphs.py) equals the eager step.

The CPU tests use dynamo's ``aot_eager`` backend (the same capture, static shapes and buckets, seconds to build);
inductor's code generation takes ~80 s for two buckets on a 2-core machine, so its test runs only with
COSYVOICE_SLOW_TESTS=1. CUDA graphs (``mode="reduce-overhead"``) are checked by benchmarks/gpu_suite.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from cosyvoice.bundle import validate_model_dir
from cosyvoice.engine.graphs import CompiledDiT, dit_buckets
from cosyvoice.flow.model import FlowStream, extend_packed
from cosyvoice.tools.parity.tolerances import STREAM_MEL_ATOL

compile_available = pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch.compile unavailable")


@pytest.fixture(scope="module")
def flow(tiny_bundle_dir: Path):
    return validate_model_dir(tiny_bundle_dir).load_flow(torch.device("cpu"), torch.float32).eval()


def _run(flow, trunk=None, buckets=None) -> list[torch.Tensor]:
    """Three sessions of different prompt lengths, two packed chunks each (the second on the cache)."""
    streams = []
    for s in range(3):
        g = torch.Generator().manual_seed(s)
        prompt = 20 + 5 * s
        streams.append((FlowStream(flow, torch.randint(0, flow.cfg.vocab_size, (1, prompt), generator=g),
                                   torch.randn(1, 2 * prompt, flow.cfg.output_size, generator=g),
                                   torch.randn(1, flow.cfg.spk_embed_dim, generator=g)),
                        torch.randint(0, flow.cfg.vocab_size, (1, 200), generator=g)))
    out = []
    for round_ in range(2):
        steps = []
        for stream, tokens in streams:
            first = 25 + (-stream.prompt_token.shape[1] % 25) + 3
            steps.append(stream.begin(tokens[:, :first] if round_ == 0 else tokens[:, first:first + 50],
                                      finalize=False))
        out += extend_packed(steps, trunk, buckets)
    return out


def test_buckets_are_few_and_cover_the_shape() -> None:
    assert dit_buckets(6, 56, 100) == (8, 64, 256) and dit_buckets(2, 106, 0) == (2, 128, 0)
    assert dit_buckets(64, 64, 256) == (64, 64, 256)
    # the policy's later chunks (50 k + 6 frames of 2 rows per session) fall into 3 width buckets
    assert {dit_buckets(2, 50 * k + 6, 0)[1] for k in (1, 2, 4)} == {64, 128, 256}


@compile_available
def test_compiled_packed_step_equals_eager(flow) -> None:
    compiled = CompiledDiT(torch.device("cpu"), backend="aot_eager")
    eager_bucketed = _run(flow, buckets=dit_buckets)
    got = _run(flow, compiled.trunk, compiled.buckets)
    assert all(torch.equal(a, b) for a, b in zip(eager_bucketed, got, strict=True))  # the same ops: exact
    for a, b in zip(_run(flow), got, strict=True):  # buckets only pad: rounding
        assert a.shape == b.shape and torch.allclose(a, b, atol=STREAM_MEL_ATOL, rtol=0)


@compile_available
@pytest.mark.skipif(not os.environ.get("COSYVOICE_SLOW_TESTS"), reason="inductor compiles for ~80 s on 2 cores")
def test_inductor_compiled_packed_step_equals_eager(flow) -> None:
    compiled = CompiledDiT(torch.device("cpu"))
    for a, b in zip(_run(flow), _run(flow, compiled.trunk, compiled.buckets), strict=True):
        assert a.shape == b.shape and torch.allclose(a, b, atol=STREAM_MEL_ATOL, rtol=0)


@compile_available
def test_the_engine_runs_its_flow_steps_compiled(tts, short_prompt_wav: Path) -> None:
    from cosyvoice.engine import Engine
    from cosyvoice.settings import Limits

    e = tts.engine
    voice = tts.frontend.voice("You are a helpful assistant.<|endofprompt|>Hello there.", short_prompt_wav)
    inp = tts.frontend.model_input("", voice)
    tokens = torch.randint(0, e.config.flow.vocab_size, (130,), generator=torch.Generator().manual_seed(0))
    mels: dict[str, list[torch.Tensor]] = {}
    for name, option in (("eager", False), ("compiled", "aot_eager")):
        engine = Engine(e.config, e.llm, e.flow, e.hift, e.device, Limits(), compile_dit=option)
        vocode, seen = engine.t2w.vocode, mels.setdefault(name, [])

        def recording(state, mel, *args, vocode=vocode, seen=seen):
            seen.append(mel.clone())
            return vocode(state, mel, *args)

        engine.t2w.vocode = recording
        calls: list[int] = []
        if engine.t2w.compiled is not None:
            trunk = engine.t2w.compiled.trunk
            engine.t2w.compiled.trunk = lambda *args, trunk=trunk, calls=calls: (calls.append(1), trunk(*args))[1]
        chunks = list(engine.vocode(tokens, inp, stream=True))
        assert len(chunks) >= 3 and chunks[-1].final
        assert (len(calls) > 0) == (name == "compiled")  # every streaming flow step went through the compiled core
        engine.close()
    assert mels["compiled"] and len(mels["compiled"]) == len(mels["eager"])
    for a, b in zip(mels["eager"], mels["compiled"], strict=True):
        assert a.shape == b.shape and torch.allclose(a, b, atol=STREAM_MEL_ATOL, rtol=0)
