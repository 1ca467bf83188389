"""Text-stream (bi-streaming) decoding: the interleaving schedule, its quirks, its errors, golden §13."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import pytest
import torch

from cosyvoice.config import LLMConfig, QwenConfig
from cosyvoice.errors import ResourceLimitError
from cosyvoice.llm import CosyVoice3LM
from cosyvoice.llm.bistream import BistreamError, bistream_job, first_fill_index
from cosyvoice.llm.job import Step, TokenStream, Wait, run_eager
from cosyvoice.llm.model import MAX_SILENT_RUN
from cosyvoice.tools.parity.bistream import check

EOP = 290  # <|endofprompt|> of the toy vocabulary
SPEECH = 40  # toy speech_token_size: sos 40, eos 41, task_id 42, fill 43
SOS, EOS, TASK, FILL = 40, 41, 42, 43


@pytest.fixture(scope="module")
def lm() -> CosyVoice3LM:
    torch.manual_seed(0)
    qwen = QwenConfig(vocab_size=300, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, rope_theta=10_000.0)
    return CosyVoice3LM(LLMConfig(llm_input_size=8, llm_output_size=8, speech_token_size=SPEECH, qwen=qwen),
                        endofprompt_id=EOP).eval()


def drive(job, pieces: Sequence[Sequence[int]], decide: Callable[[int, Step], int],
          stream: TokenStream) -> tuple[list[Step], list[int], list[int]]:
    """Play the runner without a model: (steps, decisions sent, emitted tokens). ``pieces`` are put one per Wait;
    ``decide(n_decisions, step)`` answers a sampled step."""
    queue, steps, sent, emitted = list(pieces), [], [], []
    request = next(job)
    try:
        while True:
            emitted += request.emit
            if isinstance(request, Wait):
                stream.put(queue.pop(0)) if queue else stream.close()
                request = job.send(None)
                continue
            steps.append(request)
            token = decide(len(sent), request) if request.sample else None
            if request.sample:
                sent.append(token)
            request = job.send(token)
    except StopIteration as done:
        emitted += done.value
    return steps, sent, emitted


def speech_then_eos(n_speech: int) -> Callable[[int, Step], int]:
    """Speech token 7 while text streams in and for the first ``n_speech`` decisions, then eos."""
    return lambda i, step: 7 if i < n_speech or step.ban_sos else EOS


def reference_fed_lens(pieces: Sequence[int], n_prompt_speech: int, n_rest: int, prefix: int,
                       n_speech: int) -> list[int]:
    """The reference's loop (llm.py inference_bistream) reduced to lengths: one entry per forward call.
    Piece sizes in, decisions as ``speech_then_eos``; an independent transcription used as the oracle."""
    fed, lm_len, text, speech, out = [], prefix, n_rest, n_prompt_speech, []
    next_fill, decisions = (n_prompt_speech // 15 + 1) * 15 - n_prompt_speech, 0
    for size in pieces:
        text += size
        while speech:
            if text < 5:
                break
            lm_len, text, speech = lm_len + 5 + min(15, speech), text - 5, speech - min(15, speech)
        if speech:
            continue
        if out and out[-1] == "fill":
            if text < 5:
                continue
            lm_len, text = 5, text - 5
        while True:
            fed.append(lm_len)
            if len(out) == next_fill:
                tok, next_fill = "fill", next_fill + 16
            else:
                tok, decisions = "speech", decisions + 1
            out.append(tok)
            if tok == "fill":
                break
            lm_len = 1
    lm_len += text + 1
    while True:
        fed.append(lm_len)
        tok, decisions = ("speech" if decisions < n_speech else "eos"), decisions + 1
        if tok == "eos":
            return fed
        lm_len = 1


def test_first_fill_index_follows_the_reference_formula() -> None:
    assert [first_fill_index(p) for p in (0, 1, 14, 15, 16, 40)] == [15, 14, 1, 15, 14, 5]


def test_hand_derived_schedule_with_prompt_speech(lm: CosyVoice3LM) -> None:
    # prompt text [5, 6, EOP, 7, 8]: prefix = sos + 3 ids; 2 ids head the text queue; 20 prompt speech tokens
    stream = TokenStream()
    job = bistream_job(lm, [5, 6, EOP, 7, 8], list(range(20)), stream, max_len=512,
                       silent_tokens=frozenset())
    text = list(range(100, 112))
    steps, sent, emitted = drive(job, [[t] for t in text], speech_then_eos(12), stream)
    lens = [s.embeds.shape[0] for s in steps]
    # token 3 fills a block (5 text + 15 speech), token 8 the last (5 + 5); decoding starts at once with
    # everything so far: 4 prefix + 20 + 10 = 34. Fill forced at output 10 = (20 // 15 + 1) * 15 - 20.
    # Tokens 9..12 never make a block: final input = the fed speech row again + 4 text + task_id = 6.
    assert lens == [34] + [1] * 9 + [1] + [6] + [1] * 2
    assert [s.sample for s in steps] == [True] * 10 + [False] + [True] * 3
    assert [s.ban_sos for s in steps] == [True] * 10 + [False] * 4  # ignore_eos only while text streams in
    emb, sp = lm.llm.embed_tokens.weight, lm.speech_embedding.weight
    assert torch.equal(steps[0].embeds, torch.cat([sp[SOS][None], emb[[5, 6, EOP]], emb[[7, 8, 100, 101, 102]],
                                                   sp[:15], emb[103:108], sp[15:20]]))
    assert torch.equal(steps[11].embeds, torch.cat([sp[7][None], emb[108:112], sp[TASK][None]]))
    assert list(steps[-1].history) == [7] * 10 + [FILL] + [7] * 2 + [EOS]  # the fill is in the sampler's history
    assert emitted == [7] * 12 and sent == [7] * 12 + [EOS]
    assert lens == reference_fed_lens([1] * 12, 20, 2, 4, 12)


def test_hand_derived_schedule_without_prompt_speech(lm: CosyVoice3LM) -> None:
    # instruct2: no prompt speech; the reference starts decoding before any streamed text is fed (quirk)
    stream = TokenStream()
    job = bistream_job(lm, [5, 6, EOP], [], stream, max_len=512, silent_tokens=frozenset())
    steps, _, _ = drive(job, [[t] for t in range(100, 107)], speech_then_eos(32), stream)
    lens = [s.embeds.shape[0] for s in steps]
    # 15 sampled from the prefix (4), fill forced at 15; token 5 completes a block: 5 text alone, 15 sampled,
    # fill at 31; tokens 6, 7 end the stream: final = fed row again + 2 text + task_id = 4, then eos.
    assert lens == [4] + [1] * 14 + [1] + [5] + [1] * 14 + [1] + [4] + [1] * 2
    emb = lm.llm.embed_tokens.weight
    assert torch.equal(steps[16].embeds, emb[100:105])
    assert lens == reference_fed_lens([1] * 7, 0, 0, 4, 32)


def test_multi_token_pieces_resume_at_most_once_per_piece(lm: CosyVoice3LM) -> None:
    stream = TokenStream()
    job = bistream_job(lm, [EOP], [], stream, max_len=512, silent_tokens=frozenset(),
                       per_token=False)
    steps, _, _ = drive(job, [[100], list(range(101, 113)), [113]], speech_then_eos(45), stream)
    lens = [s.embeds.shape[0] for s in steps]
    # piece 2 (12 ids) resumes once with 5 of them; piece 3 brings the queue to 8 + 1 and resumes once more
    # with 5: the last 4 wait for the end of the text although a whole block was there
    assert lens == [2] + [1] * 15 + [5] + [1] * 15 + [5] + [1] * 15 + [1 + 4 + 1]
    assert lens == reference_fed_lens([1, 12, 1], 0, 0, 2, 45)


@pytest.mark.parametrize("seed", range(40))
def test_schedule_equals_the_reference_on_random_streams(lm: CosyVoice3LM, seed: int) -> None:
    rng = random.Random(seed)
    n_prompt, n_rest, per_token = rng.randrange(0, 50), rng.randrange(0, 4), rng.random() < 0.5
    sizes = [rng.randrange(1, 9) for _ in range(rng.randrange(0, 12))]
    n_speech = rng.randrange(0, 120)
    prompt_text = [5] + [EOP] + [9] * n_rest
    stream = TokenStream()
    job = bistream_job(lm, prompt_text, [3] * n_prompt, stream, max_len=4096,
                       silent_tokens=frozenset(), per_token=per_token)
    ids = iter(range(100, 300))
    pieces = [[next(ids) for _ in range(s)] for s in sizes]
    steps, _, _ = drive(job, pieces, speech_then_eos(n_speech), stream)
    expected_pieces = [1] * sum(sizes) if per_token else sizes
    assert [s.embeds.shape[0] for s in steps] == reference_fed_lens(expected_pieces, n_prompt, n_rest, 3, n_speech)


def test_model_chosen_fill_restarts_the_fill_count(lm: CosyVoice3LM) -> None:
    stream = TokenStream()
    job = bistream_job(lm, [EOP], [], stream, max_len=512, silent_tokens=frozenset())
    decide = lambda i, step: FILL if i == 3 else (7 if i < 25 or step.ban_sos else EOS)  # noqa: E731
    steps, _, _ = drive(job, [[t] for t in range(100, 110)], decide, stream)
    forced = [k for k, s in enumerate(steps) if not s.sample]  # each call decides output number k
    assert forced == [19, 35]  # the sampled fill at output 3 moves the first forced one from 15 to 3 + 15 + 1


def test_silent_runs_are_fed_but_not_emitted(lm: CosyVoice3LM) -> None:
    stream = TokenStream()
    job = bistream_job(lm, [EOP], [], stream, max_len=512, silent_tokens=frozenset({7}))
    _, sent, emitted = drive(job, [], speech_then_eos(12), stream)
    assert sent == [7] * 12 + [EOS] and emitted == [7] * MAX_SILENT_RUN


def test_the_job_waits_instead_of_blocking(lm: CosyVoice3LM) -> None:
    stream = TokenStream()
    job = bistream_job(lm, [EOP], [1] * 15, stream, max_len=512)
    assert isinstance(next(job), Wait)
    stream.put([100, 101])
    assert isinstance(job.send(None), Wait)  # 2 of the 5 text tokens a prompt block needs
    stream.put([102, 103, 104])
    step = job.send(None)  # ids taken one piece at a time: the 5th completes a prompt block, decoding starts
    assert isinstance(step, Step) and step.embeds.shape[0] == 2 + 5 + 15


def test_errors_are_clear(lm: CosyVoice3LM) -> None:
    with pytest.raises(RuntimeError, match="endofprompt"):
        bistream_job(lm, [5, 6], [], TokenStream(), max_len=64)
    with pytest.raises(RuntimeError, match="outside"):
        bistream_job(lm, [EOP], [SPEECH], TokenStream(), max_len=64)
    with pytest.raises(ResourceLimitError, match="prompt alone"):
        bistream_job(lm, [1] * 10 + [EOP], [], TokenStream(), max_len=8)
    # eos while text streams in: the reference raises ValueError; we name the cause
    stream = TokenStream()
    job = bistream_job(lm, [EOP], [], stream, max_len=512)
    with pytest.raises(BistreamError, match="token 41"):
        drive(job, [[100]], lambda i, step: EOS, stream)
    # a fill in the final phase
    stream = TokenStream()
    job = bistream_job(lm, [EOP], [], stream, max_len=512)
    with pytest.raises(BistreamError, match="token 43"):
        drive(job, [], lambda i, step: 7 if i < 15 else FILL, stream)
    # never-ending speech is bounded by the cache
    stream = TokenStream()
    job = bistream_job(lm, [EOP], [], stream, max_len=40)
    with pytest.raises(ResourceLimitError, match="40 LLM positions"):
        drive(job, [], lambda i, step: 7, stream)
    # the writer's failure reaches the runner
    stream = TokenStream()
    job = bistream_job(lm, [EOP], [], stream, max_len=512)
    next(job)
    stream.close(RuntimeError("chat model disconnected"))
    with pytest.raises(RuntimeError, match="disconnected"):
        job.send(None)


def test_run_eager_drives_the_job_with_a_real_model(lm: CosyVoice3LM) -> None:
    stream = TokenStream()
    for t in range(100, 120):
        stream.put([t])
    stream.close()
    gen = torch.Generator().manual_seed(0)

    def sample(scores: torch.Tensor, history: Sequence[int]) -> int:
        assert scores[SOS] == -float("inf") or len(history) >= 0
        return int(torch.multinomial(scores[:SPEECH].softmax(0), 1, generator=gen)) if len(history) < 60 else EOS

    job = bistream_job(lm, [5, EOP], [1, 2, 3], stream, max_len=256, silent_tokens=frozenset())
    tokens = list(run_eager(lm, job, lm.llm.new_cache(1, 256), sample, wait=stream.wait))
    assert len(tokens) == 60 - 3 and all(0 <= t < SPEECH for t in tokens)  # 3 forced fills are not emitted


def test_golden_bistream_parity(golden) -> None:
    results = check(golden)
    assert all(r.passed for r in results), "\n".join(r.row() for r in results if not r.passed)


def test_engine_mode_ends_at_any_stop_id_and_bounds_the_speech(lm: CosyVoice3LM) -> None:
    # strict=False (the engine): where the reference raises, a stop id ends the utterance, as inference() does
    stream = TokenStream()
    job = bistream_job(lm, [EOP], [], stream, max_len=512, silent_tokens=frozenset(),
                       strict=False)
    _, sent, emitted = drive(job, [[100], [101]], lambda i, step: 7 if i < 20 else SPEECH + 50, stream)
    assert sent[-1] == SPEECH + 50 and emitted == [7] * 20
    # and at most max_token_text_ratio x the streamed text tokens are spoken (2 text tokens -> 4 at ratio 2)
    stream = TokenStream()
    job = bistream_job(lm, [EOP], [], stream, max_len=512, silent_tokens=frozenset(),
                       strict=False, max_token_text_ratio=2.0)
    _, _, emitted = drive(job, [[100], [101]], lambda i, step: 7, stream)
    assert len(emitted) == 15  # the decoding before the text ended already spoke more: nothing is added
    stream = TokenStream()
    job = bistream_job(lm, [EOP], [], stream, max_len=512, silent_tokens=frozenset(),
                       strict=False, max_token_text_ratio=5.0)
    _, _, emitted = drive(job, [[t] for t in range(100, 112)], lambda i, step: 7, stream)
    assert len(emitted) == 5 * 12  # 3 x 15 while the text streamed in, 15 more in the final phase
