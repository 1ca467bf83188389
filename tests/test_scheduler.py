"""The batched LLM scheduler and the engine around it: same tokens as one-at-a-time decoding, waiting jobs,
cancellation, no leftover state or threads, the asyncio form, the flow-cache budget."""

from __future__ import annotations

import asyncio
import gc
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from memory_probe import live_tensors, rss_bytes
from toy_lm import EOP, toy_lm
from waiting import until

from cosyvoice.engine import CancelToken, Engine, LLMScheduler, Session, Status, T2WState, Ticket, Token2Wav
from cosyvoice.engine.memory import FlowCacheLedger
from cosyvoice.flow import FlowStream
from cosyvoice.llm import CosyVoice3LM, KVCache
from cosyvoice.llm.job import Step, TokenStream, Wait, run_eager
from cosyvoice.llm.sampling import SeededSampler
from cosyvoice.settings import Limits


@pytest.fixture(scope="module")
def lm() -> CosyVoice3LM:
    return toy_lm()


def _request(i: int) -> tuple[list[int], list[int], list[int]]:
    """Requests of different text lengths (so different max_len) and prompt lengths."""
    return list(range(10, 12 + i % 4)), [5, 6, EOP], [3, 1, 4, 1, 5][: 1 + i % 5]


class _Collector:
    """Listeners of one ticket: tokens received, the end, and an optional action at the n-th token."""

    def __init__(self, at: int | None = None, action=None) -> None:
        self.tokens: list[int] = []
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.at, self.action = at, action

    def on_tokens(self, tokens: tuple[int, ...]) -> None:
        before = len(self.tokens)
        self.tokens.extend(tokens)
        if self.at is not None and before < self.at <= len(self.tokens):
            self.action()

    def on_done(self, error: BaseException | None) -> None:
        self.error = error
        self.done.set()


def _ticket(lm: CosyVoice3LM, i: int, seed: int, collector: _Collector) -> Ticket:
    lm_input, min_len, max_len = lm.prepare(*_request(i))
    return Ticket(lm.generate_job(lm_input, min_len, max_len), seed, collector.on_tokens, collector.on_done)


def test_batched_tokens_equal_one_at_a_time_with_sessions_joining_and_leaving(lm: CosyVoice3LM) -> None:
    scheduler = LLMScheduler(lm, rows=6, max_positions=128)
    collectors: dict[int, _Collector] = {}
    cancelled: set[int] = set()

    tickets: dict[int, Ticket] = {}

    def cancel(i: int) -> None:
        cancelled.add(i)
        scheduler.cancel(tickets[i])

    # 0-3 start together; 4 and 5 join when 0 reaches its 5th/12th token; 6, 7 join when 1 reaches 3;
    # 2 is cancelled at its 7th token and 3 at its 2nd (they leave mid-run); others end on stop ids or max_len
    plan = {0: (11, {"at": 5, "action": lambda: start(4, 40)}), 1: (12, {"at": 3, "action": lambda: [
        start(6, 60), start(7, 70)]}), 2: (13, {"at": 7, "action": lambda: cancel(2)}),
        3: (14, {"at": 2, "action": lambda: cancel(3)})}

    def start(i: int, seed: int, **kw) -> None:
        collectors[i] = _Collector(**kw)
        tickets[i] = _ticket(lm, i, seed, collectors[i])
        scheduler.submit(tickets[i])

    seeds = {i: seed for i, (seed, _) in plan.items()} | {4: 40, 6: 60, 7: 70}
    for i, (seed, kw) in plan.items():
        start(i, seed, **kw)
    for c in list(collectors.values()):
        assert c.done.wait(30)
    for c in list(collectors.values()):
        assert c.done.wait(30) and c.error is None
    assert set(collectors) == {0, 1, 2, 3, 4, 6, 7} and cancelled == {2, 3}
    assert {i: t.status for i, t in tickets.items()} == {
        i: Status.FINISHED_ABORTED if i in cancelled else Status.FINISHED_STOPPED for i in tickets}
    assert scheduler.active == 0
    assert scheduler.steps < sum(len(c.tokens) for c in collectors.values()) // 2  # rows really shared steps
    for i, c in collectors.items():
        alone = list(lm.generate(*_request(i), seeds[i]))
        if i in cancelled:
            assert c.tokens == alone[:len(c.tokens)] and len(c.tokens) < len(alone), f"request {i}"
        else:
            assert c.tokens == alone, f"request {i} differs when batched"
    assert len({tuple(c.tokens) for c in collectors.values()}) == len(collectors)  # different seeds, different speech
    scheduler.close()


class _PacedStream(TokenStream):
    """A text stream that tells its writer when the job has taken what was put (``taken``)."""

    def __init__(self) -> None:
        super().__init__()
        self.taken = threading.Event()

    def take(self) -> tuple[list[int], bool]:
        ids, closed = super().take()
        if ids:
            self.taken.set()
        return ids, closed

    def feed(self, pieces: list[list[int]]) -> None:
        """Put each piece and wait until the job took it (the job parks and is woken for every piece)."""
        for ids in pieces:
            self.taken.clear()
            self.put(ids)
            assert not ids or self.taken.wait(60), "the job was not woken by its stream"
        self.close()


def _waiting_job(lm: CosyVoice3LM, lm_input: torch.Tensor, text: TokenStream):
    """A job that feeds each id arriving on ``text`` (as a speech embedding) and samples after each."""
    decoded: list[int] = []
    token = yield Step(lm_input, history=decoded)
    while True:
        ids, closed = text.take()
        while not ids and not closed:
            yield Wait()
            ids, closed = text.take()
        if not ids:
            return (token,)
        for i in ids:
            decoded.append(token)
            token = yield Step(lm.speech_embedding.weight[i].view(1, -1), history=decoded, emit=(token,))


def test_waiting_jobs_are_parked_and_woken(lm: CosyVoice3LM) -> None:
    lm_input, _, _ = lm.prepare(*_request(0))
    script = [[3, 4], [], [5], [6, 7, 8]]

    # the oracle: the same job alone, eager, blocking on the stream
    oracle_stream = _PacedStream()
    writer = threading.Thread(target=oracle_stream.feed, args=(script,))
    writer.start()
    oracle = list(run_eager(lm, _waiting_job(lm, lm_input, oracle_stream), lm.llm.new_cache(1, 64),
                            SeededSampler(5, lm.cfg.sampling), wait=oracle_stream.wait))
    writer.join()

    scheduler = LLMScheduler(lm, rows=3, max_positions=128)
    stream, waiting = _PacedStream(), _Collector()
    ticket = Ticket(_waiting_job(lm, lm_input, stream), 5, waiting.on_tokens, waiting.on_done)
    scheduler.submit(ticket)
    stream.subscribe(lambda: scheduler.wake(ticket))
    busy = _Collector()  # a normal session runs beside the waiting one
    scheduler.submit(_ticket(lm, 1, 9, busy))
    assert busy.done.wait(30)  # the waiting job parked at its first step, before the busy one ended
    assert ticket.status is Status.PARKED and not waiting.done.is_set()
    with scheduler._cond:  # nothing can run: the thread sleeps on its condition until a wake (no polling steps)
        assert not scheduler._runnable()
    stream.feed(script)
    assert waiting.done.wait(30) and waiting.error is None
    assert waiting.tokens == oracle and len(waiting.tokens) == 1 + sum(map(len, script))
    assert scheduler.active == 0
    scheduler.close()


def test_kv_cache_views_share_storage(lm: CosyVoice3LM) -> None:
    pool = KVCache.allocate(lm.cfg.qwen, batch=4, max_len=8)
    view = pool.view(1, 3, slots=5)
    view.k[:, 0] = 1.0
    assert (view.batch, view.max_len) == (2, 5) and bool((pool.k[:, 1, :, :5] == 1).all())
    assert not bool(pool.k[:, 0].any()) and not bool(pool.k[:, 1, :, 5:].any())


# ----------------------------------------------------------------------------- the engine on the tiny bundle

PROMPT_TEXT = "You are a helpful assistant.<|endofprompt|>Hello, this is a short prompt for testing."


def _inp(tts, wav: Path, text: str = "Hi there, friend."):
    return tts.frontend.model_input(text, tts.frontend.voice(PROMPT_TEXT, wav))


def _engine(tts, **kw) -> Engine:
    e = tts.engine
    return Engine(e.config, e.llm, e.flow, e.hift, e.device, Limits(max_sessions=16, queue_timeout_seconds=60), **kw)


def test_sixteen_sessions_half_cancelled_leave_nothing_behind(tts, short_prompt_wav: Path) -> None:
    engine = _engine(tts)
    inp = _inp(tts, short_prompt_wav, "Hi.")
    barrier = threading.Barrier(16)

    def run(i: int) -> int:
        stream = engine.synthesize(inp, stream=True, seed=i, fixed_tokens=60)
        barrier.wait()  # all sixteen are in flight together
        if i % 2:
            next(stream)
            stream.close()  # cancelled mid-stream
            return 1
        return len(list(stream))

    def round_() -> list[int]:
        with ThreadPoolExecutor(max_workers=16) as pool:
            return list(pool.map(run, range(16)))

    round_()  # warm-up: the engine's two threads start, caches fill
    gc.collect()
    threads_before = {t.name for t in threading.enumerate()}
    tensors_before, rss_before = live_tensors(), rss_bytes()
    counts = round_() + round_()
    gc.collect()
    assert all(n >= 2 for n in counts[::2])  # the completed half streamed in several chunks
    assert engine.active_sessions == 0 and engine.scheduler.active == 0 and engine.flow_cache_bytes == 0
    assert {t.name for t in threading.enumerate()} == threads_before
    assert {"cosyvoice-scheduler", "cosyvoice-t2w"} <= threads_before
    assert not [t for t in threading.enumerate() if t.name.startswith("cosyvoice-llm-")]
    assert live_tensors() <= tensors_before
    rss_growth = rss_bytes() - rss_before
    assert rss_growth < 64 * 2**20, f"resident memory grew by {rss_growth / 2**20:.1f} MiB over 32 requests"
    engine.close()


def test_asynthesize_streams_and_cancels(tts, short_prompt_wav: Path) -> None:
    engine = _engine(tts)
    inp = _inp(tts, short_prompt_wav)
    sync = [c.pcm for c in engine.synthesize(inp, stream=True, seed=4)]

    async def main() -> tuple[list[torch.Tensor], int]:
        got = [c.pcm async for c in engine.asynthesize(inp, stream=True, seed=4)]
        async for _ in engine.asynthesize(inp, stream=True, seed=5):
            break  # leaving the loop cancels the request
        return got, 0

    got, _ = asyncio.run(main())
    assert len(got) == len(sync) >= 2 and all(torch.equal(x, y) for x, y in zip(got, sync, strict=True))
    until(lambda: engine.active_sessions == 0, 10, "the sessions' release")  # in the background, within a step
    engine.close()


def test_fixed_tokens_decodes_exactly_n_tokens(tts, short_prompt_wav: Path) -> None:
    engine = _engine(tts)
    chunks = list(engine.synthesize(_inp(tts, short_prompt_wav), stream=True, seed=1, fixed_tokens=80))
    assert chunks[-1].token_end == 80  # stop ids masked, min = max length (no silent runs in these tokens)
    with pytest.raises(Exception, match="fixed_tokens must be a positive integer"):
        engine.synthesize(_inp(tts, short_prompt_wav), fixed_tokens=0)
    engine.close()


def test_flow_cache_budget_falls_back_to_recompute(tts, prompt_wav: Path) -> None:
    """A stream whose flow cache would pass its share (flow_cache_mb / max_sessions) recomputes instead."""
    e = tts.engine
    inp = _inp(tts, prompt_wav)
    tokens = torch.randint(0, e.config.flow.vocab_size, (300,), generator=torch.Generator().manual_seed(0))
    unbounded = Engine(e.config, e.llm, e.flow, e.hift, e.device, Limits())
    reference = list(unbounded.vocode(tokens, inp, stream=True))
    share_frames = 400  # the prompt and the first two chunks fit, the third does not
    budget_mb = share_frames * FlowStream.bytes_per_frame(e.flow) / 2**20
    bounded = Engine(e.config, e.llm, e.flow, e.hift, e.device, Limits(max_sessions=1, flow_cache_mb=budget_mb))
    chunks = list(bounded.vocode(tokens, inp, stream=True))
    assert bounded.flow_cache_fallbacks == 1 and unbounded.flow_cache_fallbacks == 0
    assert bounded.flow_cache_bytes == 0 and bounded.active_sessions == 0
    # the same session driven chunk by chunk in this thread, to read the cache between chunks
    share = bounded.flow_cache_share  # one session: its share is the whole budget
    t2w = Token2Wav(e.config, e.flow, e.hift, e.device, flow_cache=FlowCacheLedger(share, share))
    session = Session(0, 0, inp, stream=True, speed=1.0)
    session.add_tokens(tuple(tokens.tolist()))
    session.llm_finished(None)
    state = T2WState.open(session, e.config.flow.pre_lookahead_len)
    held, direct = [], []
    while state.due(session):
        direct.append(t2w.chunk(session, state, state.take(session)))
        held.append(state.flow_stream.cache_bytes)
    assert len(chunks) >= 4 and max(held) <= bounded.flow_cache_share
    assert held[0] > 0 and held[1] > held[0] and held[2:] == [0] * (len(held) - 2)  # dropped at chunk 2 (streaming)
    assert all(torch.equal(a.pcm, b.pcm) for a, b in zip(chunks, direct, strict=True))
    assert [(c.token_start, c.token_end, c.pcm.numel()) for c in chunks] == \
        [(c.token_start, c.token_end, c.pcm.numel()) for c in reference]
    assert torch.equal(chunks[0].pcm, reference[0].pcm)  # before the fallback: the same computation
    unbounded.close()
    bounded.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decode_gives_the_eager_tokens(lm: CosyVoice3LM) -> None:
    """The graphed decode step (per batch bucket, static cache length) against one-at-a-time eager decoding."""
    model = CosyVoice3LM(lm.cfg, lm.endofprompt_id).eval()
    model.load_state_dict(lm.state_dict())
    model.cuda()
    scheduler = LLMScheduler(model, rows=8, max_positions=128, cuda_graphs=True)
    collectors = {i: _Collector() for i in range(5)}
    for i, c in collectors.items():
        scheduler.submit(_ticket(model, i, 100 + i, c))
    for c in collectors.values():
        assert c.done.wait(60) and c.error is None
    assert scheduler.runner.graphed is not None  # captured, not fallen back to eager
    for i, c in collectors.items():
        assert c.tokens == list(model.generate(*_request(i), 100 + i)), f"request {i}"
    scheduler.close()


def test_an_engine_dropped_without_close_stops_its_threads(tts, short_prompt_wav: Path) -> None:
    engine = _engine(tts)
    list(engine.synthesize(_inp(tts, short_prompt_wav, "Hi."), seed=0, fixed_tokens=5))
    threads = [engine.scheduler._thread, engine.worker._thread]
    assert all(t.is_alive() for t in threads)
    del engine

    def stopped() -> bool:
        gc.collect()  # the scheduler may still hold the last step's tickets for a moment
        return not any(t.is_alive() for t in threads)

    until(stopped, 10, "the end of the engine's threads")


def test_engine_runs_a_text_stream_job_woken_by_its_stream(tts, short_prompt_wav: Path) -> None:
    """``synthesize(text_stream=...)`` runs the bi-streaming job in the scheduler and wakes it on every put:
    audio streams while the text still arrives, and the request ends once the stream is closed."""
    engine = _engine(tts)
    inp = _inp(tts, short_prompt_wav, "Hi.")
    text = _PacedStream()
    chunks: list = []
    consumer = threading.Thread(target=lambda: chunks.extend(engine.synthesize(inp, stream=True, seed=2,
                                                                                text_stream=text)))
    consumer.start()
    ids = tts.frontend.encode("Hello there, my friend. How are you doing on this fine day? " * 3)[0].tolist()
    text.feed([ids[i:i + 6] for i in range(0, len(ids), 6)])
    consumer.join(120)
    assert not consumer.is_alive() and chunks and chunks[-1].final
    assert len(chunks) >= 2 and engine.active_sessions == 0 and engine.scheduler.active == 0
    engine.close()


def test_a_session_outgrowing_its_row_fails_alone(lm: CosyVoice3LM) -> None:
    from cosyvoice.errors import ResourceLimitError

    lm_input, _, _ = lm.prepare(*_request(0))
    limit = lm_input.shape[0] + 6
    scheduler = LLMScheduler(lm, rows=2, max_positions=limit)
    long, short = _Collector(), _Collector()
    tickets = [Ticket(lm.generate_job(lm_input, 50, 50), 1, long.on_tokens, long.on_done),
               Ticket(lm.generate_job(lm_input, 3, 3), 2, short.on_tokens, short.on_done)]
    for t in tickets:
        scheduler.submit(t)
    assert long.done.wait(30) and short.done.wait(30)
    assert isinstance(long.error, ResourceLimitError) and "COSYVOICE_MAX_LLM_POSITIONS" in str(long.error)
    assert (tickets[0].status, tickets[1].status) == (Status.FINISHED_LENGTH, Status.FINISHED_STOPPED)
    assert len(long.tokens) == limit - lm_input.shape[0] + 1  # every position of its row was used
    assert short.error is None and short.tokens == list(lm.generate(*_request(0), 2))[:3]
    assert scheduler.active == 0
    scheduler.close()


def test_a_cancel_token_stops_a_blocked_reader_from_another_thread(tts, short_prompt_wav: Path) -> None:
    engine = _engine(tts)
    token = CancelToken()
    # non-streaming: the reader blocks in next() until the very end, so only the token can stop it early
    chunks = engine.synthesize(_inp(tts, short_prompt_wav), stream=False, seed=1, fixed_tokens=2000, cancel=token)
    got: list = []
    reader = threading.Thread(target=lambda: got.extend(chunks))
    reader.start()
    session = until(lambda: next((s for s in engine._sessions.values() if len(s.tokens) >= 5), None), 60,
                    "five tokens decoded")
    token.cancel()
    decoded_at_cancel = len(session.tokens)
    reader.join(timeout=60)
    assert not reader.is_alive() and got == []  # ended without a final chunk
    assert len(session.tokens) <= decoded_at_cancel + 1  # the LLM stopped within one step
    # the reader did not wait for the worker: it frees the session once the chunk it may be computing ends
    until(lambda: engine.active_sessions == 0 and engine.scheduler.active == 0, 30, "the session's release")
    assert list(engine.synthesize(_inp(tts, short_prompt_wav), seed=1, cancel=token)) == []  # already cancelled
    engine.close()


def test_a_row_admitted_below_a_decoding_row_keeps_its_prompt(lm: CosyVoice3LM) -> None:
    # A leaves row 0 while B decodes in row 1; C is prefilled into row 0 in the same iteration as B's batched
    # step, which must not write C's dummy over the prompt slot C has just filled
    scheduler = LLMScheduler(lm, rows=2, max_positions=128)
    tickets: dict[str, Ticket] = {}
    collectors = {"b": _Collector(), "c": _Collector()}
    collectors["a"] = _Collector(at=2, action=lambda: (scheduler.cancel(tickets["a"]), submit("c", 2, 7)))

    def submit(name: str, i: int, seed: int) -> None:
        tickets[name] = _ticket(lm, i, seed, collectors[name])
        scheduler.submit(tickets[name])

    submit("a", 0, 11)
    submit("b", 1, 12)
    for c in collectors.values():
        assert c.done.wait(30) and c.error is None
    assert collectors["c"].tokens == list(lm.generate(*_request(2), 7))
    scheduler.close()


def test_a_cancel_token_ends_asynthesize_and_vocode_from_another_thread(tts, short_prompt_wav: Path) -> None:
    engine = _engine(tts)
    inp = _inp(tts, short_prompt_wav)
    steps: list[int] = []
    token = CancelToken()
    steps_at_cancel: list[int] = []
    token.subscribe(lambda: steps_at_cancel.append(len(steps)))

    async def consume() -> list:
        got = []
        async for chunk in engine.asynthesize(inp, stream=True, seed=1, fixed_tokens=2000, cancel=token):
            got.append(chunk)
            if len(got) == 1:
                threading.Timer(0.05, token.cancel).start()  # a Stop button, from another thread
        return got

    handle = engine.llm.llm_decoder.register_forward_hook(lambda *_: steps.append(1))
    try:
        got = asyncio.run(consume())
        # every step the cancelled session could take is counted before its ticket has left the scheduler
        until(lambda: engine.active_sessions == 0 and engine.scheduler.active == 0, 10, "the session's end")
    finally:
        handle.remove()
    assert got and not got[-1].final  # ended without its final chunk
    assert len(steps) - steps_at_cancel[0] <= 1  # the LLM stopped within one step

    tokens = torch.randint(0, engine.config.flow.vocab_size, (400,), generator=torch.Generator().manual_seed(0))
    whole = list(engine.vocode(tokens, inp, stream=True))
    stop = CancelToken()
    chunks = []
    for chunk in engine.vocode(tokens, inp, stream=True, cancel=stop):
        chunks.append(chunk)
        canceller = threading.Thread(target=stop.cancel)  # a Stop button, from another thread
        canceller.start()
        canceller.join()
    assert 1 <= len(chunks) < len(whole) and not chunks[-1].final
    assert torch.equal(chunks[0].pcm, whole[0].pcm)
    until(lambda: engine.active_sessions == 0, 30, "the session's release")  # after the worker's chunk
    engine.close()


def test_a_ticket_cancelled_before_it_is_submitted_never_runs(lm: CosyVoice3LM) -> None:
    scheduler = LLMScheduler(lm, rows=1, max_positions=128)
    early, busy = _Collector(), _Collector()
    ticket = _ticket(lm, 0, 3, early)
    scheduler.cancel(ticket)
    scheduler.submit(ticket)
    scheduler.submit(_ticket(lm, 1, 4, busy))  # the only row: it runs once the cancelled ticket is gone
    assert early.done.wait(30) and busy.done.wait(30)
    assert early.error is None and early.tokens == [] and ticket.status is Status.FINISHED_ABORTED
    assert busy.error is None and busy.tokens and scheduler.active == 0
    scheduler.close()


def test_a_held_ticket_keeps_its_row_but_steps_only_once_released(lm: CosyVoice3LM) -> None:
    """hold(): the engine holds a session's LLM back while its first chunk is computed; the other rows go on and
    the held job's tokens, once released, are the ones it would have made unheld."""
    scheduler = LLMScheduler(lm, rows=2, max_positions=128)
    held: list[Ticket] = []
    first = _Collector(at=2, action=lambda: scheduler.hold(held[0], True))  # from the scheduler thread, mid-update
    held.append(_ticket(lm, 0, 11, first))
    other = _Collector()
    scheduler.submit(held[0])
    scheduler.submit(_ticket(lm, 1, 12, other))
    assert other.done.wait(30) and other.error is None
    assert len(first.tokens) == 2 and not first.done.is_set()  # no step after the hold, the row still its own
    assert held[0].status is Status.RUNNING
    scheduler.hold(held[0], False)
    assert first.done.wait(30) and first.error is None
    assert first.tokens == list(lm.generate(*_request(0), 11))
    scheduler.close()
