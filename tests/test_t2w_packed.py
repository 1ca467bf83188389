"""Packed token-to-wave batching: chunks of different sessions in ONE DiT call per Euler step give each session
the mel (and audio) it gets alone, with sessions joining and leaving. CPU, float32.

Tolerance: the packed call pads rows to a common width and caches to a common length, which changes the sizes of
the reductions (attention softmax and sums, conv and GEMM blocking), so results agree to float rounding, not bit
for bit: mel within STREAM_MEL_ATOL (1e-5, the parity tool's rule for streamed mel; measured ~1.5e-6).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cosyvoice.bundle import validate_model_dir
from cosyvoice.flow.cfm import Stopped
from cosyvoice.flow.model import FlowStream, extend_packed
from cosyvoice.tools.parity.tolerances import STREAM_MEL_ATOL


@pytest.fixture(scope="module")
def flow(tiny_bundle_dir: Path):
    return validate_model_dir(tiny_bundle_dir).load_flow(torch.device("cpu"), torch.float32).eval()


def _stream(flow, seed: int) -> tuple[FlowStream, torch.Tensor]:
    """A session: its own prompt length, prompt mel, speaker and 300 speech tokens."""
    g = torch.Generator().manual_seed(seed)
    vocab = flow.cfg.vocab_size
    prompt_len = 15 + 11 * seed
    stream = FlowStream(flow, torch.randint(0, vocab, (1, prompt_len), generator=g),
                        torch.randn(1, prompt_len * flow.token_mel_ratio, flow.cfg.output_size, generator=g),
                        torch.randn(1, flow.cfg.spk_embed_dim, generator=g))
    return stream, torch.randint(0, vocab, (1, 300), generator=g)


def _plan(prompt_len: int, chunks: int) -> list[tuple[int, int]]:
    """The engine's chunk boundaries (first hop padded to the chunk grid, then 50, 100, 100...), with look-ahead."""
    hop, start, out = 25 + (-prompt_len % 25), 0, []
    for _ in range(chunks):
        out.append((start, start + hop + 3))
        start += hop
        hop = min(100, 50 if len(out) == 1 else hop * 2)
    return out


@pytest.mark.parametrize("seeds", [(0, 1, 2, 3), (4, 5, 6, 7)])
def test_packed_dit_gives_each_session_its_alone_mel(flow, seeds: tuple[int, ...]) -> None:
    # session a runs 3 chunks, b 2 (it leaves), c joins at round 1, d joins at round 2
    chunks = {seeds[0]: (0, 3), seeds[1]: (0, 2), seeds[2]: (1, 3), seeds[3]: (2, 2)}  # seed -> (first round, n)
    alone: dict[int, list[torch.Tensor]] = {}
    for seed, (_, n) in chunks.items():
        stream, tokens = _stream(flow, seed)
        fed = 0
        alone[seed] = []
        for _, stop in _plan(stream.prompt_token.shape[1], n):
            alone[seed].append(stream.inference(tokens[:, fed:stop], finalize=False))
            fed = stop
    packed: dict[int, list[torch.Tensor]] = {seed: [] for seed in chunks}
    streams = {seed: _stream(flow, seed) for seed in chunks}
    fed = dict.fromkeys(chunks, 0)
    sizes = []
    for round_ in range(4):
        members = [s for s, (first, n) in chunks.items() if first <= round_ < first + n]
        steps = []
        for seed in members:
            stream, tokens = streams[seed]
            _, stop = _plan(stream.prompt_token.shape[1], chunks[seed][1])[round_ - chunks[seed][0]]
            steps.append(stream.begin(tokens[:, fed[seed]:stop], finalize=False))
            fed[seed] = stop
        sizes.append(len(steps))
        for seed, mel in zip(members, extend_packed(steps), strict=True):
            packed[seed].append(mel)
    assert sizes == [2, 3, 3, 2]  # really packed, with sessions joining and leaving
    for seed in chunks:
        assert len(packed[seed]) == len(alone[seed])
        for a, p in zip(alone[seed], packed[seed], strict=True):
            assert a.shape == p.shape and a.shape[2] > 0
            assert torch.allclose(a, p, atol=STREAM_MEL_ATOL, rtol=0), (seed, (a - p).abs().max().item())


def test_a_stop_ends_a_packed_call_before_its_next_euler_step(flow) -> None:
    """Every session in a packed call cancelled: the call ends before its next Euler step, not after all ten."""
    steps = []
    for seed in (0, 1):
        stream, tokens = _stream(flow, seed)
        steps.append(stream.begin(tokens[:, :_plan(stream.prompt_token.shape[1], 1)[0][1]], finalize=False))
    estimator, calls, polls = flow.decoder.estimator, [], []
    packed = estimator.forward_packed

    def counted(*args, **kwargs):
        calls.append(1)
        return packed(*args, **kwargs)

    estimator.forward_packed = counted
    try:
        with pytest.raises(Stopped):
            extend_packed(steps, stop=lambda: polls.append(1) or len(polls) > 3)
    finally:
        del estimator.forward_packed
    assert len(calls) == 3 and len(polls) == 4  # polled before each step: three of the model's 10 ran


def _recording(engine_t2w) -> dict[int, list[torch.Tensor]]:
    """Record the mel each session's vocoder gets (per T2WState), on this Token2Wav instance."""
    mels: dict[int, list[torch.Tensor]] = {}
    vocode = engine_t2w.vocode

    def recording(state, mel, *args):
        mels.setdefault(id(state), []).append(mel.clone())
        return vocode(state, mel, *args)

    engine_t2w.vocode = recording
    return mels


def test_packed_chunks_give_each_session_its_alone_mel_and_samples(tts, short_prompt_wav: Path) -> None:
    """Token2Wav.chunks (what the worker calls) on sessions that join and leave: each session's vocoder gets the mel
    it gets alone, and its chunks have the same boundaries and sample counts.

    Audio is not compared sample by sample: the tiny bundle's random vocoder turns a 1e-6 change of its input mel
    into ~0.3 of full scale (measured: mel + 1e-6 noise moves a 100-frame chunk's PCM by 0.26), so the vocoder's
    input, the only thing packing changes, is what is checked."""
    from cosyvoice.engine import Session, T2WState, Token2Wav

    e = tts.engine
    voice = tts.frontend.voice("You are a helpful assistant.<|endofprompt|>Hello there.", short_prompt_wav)
    sessions = []
    for i in range(4):
        tokens = torch.randint(0, e.config.flow.vocab_size, (120 + 60 * i,), generator=torch.Generator().manual_seed(i))
        sessions.append(Session(i, i, tts.frontend.model_input("", voice), stream=True, speed=1.0))
        sessions[-1].add_tokens(tuple(tokens.tolist()))
        sessions[-1].llm_finished(None)
    lookahead = e.config.flow.pre_lookahead_len

    def run(packed: bool) -> tuple[list[list], dict[int, list[torch.Tensor]], list[T2WState]]:
        t2w = Token2Wav(e.config, e.flow, e.hift, e.device)
        mels = _recording(t2w)
        states = [T2WState.open(s, lookahead) for s in sessions]
        chunks: list[list] = [[] for _ in sessions]
        joins = {0: 0, 1: 0, 2: 1, 3: 2}  # session -> the round it joins
        for round_ in range(8):
            due = [i for i, s in enumerate(sessions) if joins[i] <= round_ and states[i].due(s)]
            items = [(sessions[i], states[i], states[i].take(sessions[i])) for i in due]
            out = t2w.chunks(items) if packed else [t2w.chunk(*item) for item in items]
            for i, chunk in zip(due, out, strict=True):
                chunks[i].append(chunk)
        return chunks, mels, states

    alone, alone_mels, alone_states = run(packed=False)
    packed, packed_mels, packed_states = run(packed=True)
    for i in range(len(sessions)):
        assert packed[i] and packed[i][-1].final and len(packed[i]) >= 2
        assert [(c.token_start, c.token_end, c.pcm.numel()) for c in packed[i]] == \
            [(c.token_start, c.token_end, c.pcm.numel()) for c in alone[i]]
        a, p = alone_mels[id(alone_states[i])], packed_mels[id(packed_states[i])]
        assert len(a) == len(p)
        for x, y in zip(a, p, strict=True):
            assert x.shape == y.shape and torch.allclose(x, y, atol=STREAM_MEL_ATOL, rtol=0)


def test_the_engine_packs_concurrent_streams(tts, short_prompt_wav: Path) -> None:
    """Six concurrent streams through the engine with packing on and off: the same mel per session (vocoder
    input), and at least one DiT call really packed several sessions."""
    import threading

    from cosyvoice.engine import Engine
    from cosyvoice.settings import Limits

    e = tts.engine
    voice = tts.frontend.voice("You are a helpful assistant.<|endofprompt|>Hello there.", short_prompt_wav)
    inp = tts.frontend.model_input("", voice)
    tokens = [torch.randint(0, e.config.flow.vocab_size, (100 + 30 * i,), generator=torch.Generator().manual_seed(i))
              for i in range(6)]

    def run(batch: int) -> tuple[Engine, dict[int, list[torch.Tensor]], list[list]]:
        engine = Engine(e.config, e.llm, e.flow, e.hift, e.device, Limits(max_sessions=8), t2w_batch=batch)
        mels = _recording(engine.t2w)
        out: list[list] = [[] for _ in tokens]
        barrier = threading.Barrier(len(tokens))

        def go(i: int) -> None:
            barrier.wait()
            out[i] = list(engine.vocode(tokens[i], inp, stream=True))

        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(tokens))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        engine.close()
        return engine, mels, out

    one, one_mels, one_out = run(1)
    packed, packed_mels, packed_out = run(8)
    assert one.worker.packed_calls == 0 and packed.worker.packed_calls >= 1
    # a session's mels, keyed by its total length (distinct per session here), in chunk order
    by_len = [{sum(m.shape[2] for m in ms): ms for ms in mels.values()} for mels in (one_mels, packed_mels)]
    assert by_len[0].keys() == by_len[1].keys() and len(by_len[0]) == len(tokens)
    for n, ms in by_len[0].items():
        for x, y in zip(ms, by_len[1][n], strict=True):
            assert x.shape == y.shape and torch.allclose(x, y, atol=STREAM_MEL_ATOL, rtol=0)
    for a, b in zip(one_out, packed_out, strict=True):
        assert [(c.token_end, c.pcm.numel()) for c in a] == [(c.token_end, c.pcm.numel()) for c in b]
