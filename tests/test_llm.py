"""CosyVoice3LM: parity with the official fixtures, KV-cache decoding, generation and sampling rules."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from toy_lm import EOP, SPEECH, toy_lm

from cosyvoice.config import SamplingConfig
from cosyvoice.llm import CosyVoice3LM, KVCache, SeededSampler, nucleus_candidates, nucleus_rows, ras_sample_rows
from cosyvoice.llm.model import MAX_SILENT_RUN
from cosyvoice.llm.qwen2 import grouped_attention
from cosyvoice.llm.sampling import history_tails, uniforms
from cosyvoice.tools.parity.llm import check
from cosyvoice.weights import read_checkpoint


@pytest.fixture(scope="module")
def lm() -> CosyVoice3LM:
    return toy_lm()


def _request(n_text: int = 3) -> tuple[list[int], list[int], list[int]]:
    return list(range(10, 10 + n_text)), [5, 6, EOP], [3, 1, 4, 1, 5]


def _replay(tokens: Sequence[int], seen: list[torch.Tensor] | None = None):
    def sampler(scores: torch.Tensor, decoded: Sequence[int]) -> int:
        if seen is not None:
            seen.append(scores.clone())
        return tokens[len(decoded)]
    return sampler


def test_parity_with_official_fixtures(golden) -> None:
    results = check(golden)
    failed = [r.row() for r in results if not r.passed]
    assert not failed, "\n".join(failed)


def test_scheduler_runner_gives_the_eager_bits_on_the_golden_bundle(golden) -> None:
    """The scheduler's plan → runner → update path and the eager runner (the golden parity's path) compute the same
    logits bit for bit and draw the same tokens for a seed: one row, so every call has the eager shapes."""
    import threading

    from cosyvoice.config import load_config
    from cosyvoice.engine import LLMScheduler, Status, Ticket
    from cosyvoice.weights import load_weights

    model = CosyVoice3LM(load_config(golden.bundle_dir).llm).eval()
    load_weights(model, golden.bundle_dir / "llm.pt")
    logits: list[torch.Tensor] = []
    model.llm_decoder.register_forward_hook(lambda _m, _i, out: logits.append(out.clone()))
    request = list(range(100, 106)), [50, 60, model.endofprompt_id], [3, 1, 4, 1, 5]
    eager = list(model.generate(*request, 7, silent_tokens=frozenset()))
    eager_logits, logits[:] = list(logits), []
    tokens: list[int] = []
    done = threading.Event()
    lm_input, min_len, max_len = model.prepare(*request)
    ticket = Ticket(model.generate_job(lm_input, min_len, max_len, frozenset()), 7, tokens.extend,
                    lambda _e: done.set())
    scheduler = LLMScheduler(model, rows=1, max_positions=lm_input.shape[0] + max_len)
    scheduler.submit(ticket)
    assert done.wait(60)
    scheduler.close()
    assert ticket.status is Status.FINISHED_STOPPED and tokens == eager and len(logits) == len(eager_logits)
    assert all(torch.equal(a, b) for a, b in zip(logits, eager_logits, strict=True))


def test_keys_equal_official_checkpoint_and_lm_head_wins(golden) -> None:
    from cosyvoice.config import load_config

    model = CosyVoice3LM(load_config(golden.bundle_dir).llm)
    sd = read_checkpoint(golden.bundle_dir / "llm.pt")
    assert list(model.state_dict()) == list(sd)
    sd["llm.model.lm_head.weight"] = sd["llm.model.lm_head.weight"] + 1.0  # untie the file's copies
    model.load_state_dict(sd, strict=True)
    assert torch.equal(model.llm.embed_tokens.weight, sd["llm.model.lm_head.weight"])


def test_kv_cache_decode_equals_full_forward(lm: CosyVoice3LM) -> None:
    with torch.inference_mode():
        seq = torch.randn(1, 12, 16)
        full = lm.llm(seq)
        cache = lm.llm.new_cache(1, 16)
        steps = [lm.decode_step(seq[:, :7], 0, cache)[0]]
        steps += [lm.decode_step(seq[:, i:i + 1], i, cache)[0] for i in range(7, 12)]
        torch.testing.assert_close(torch.cat(steps), full[0, 6:], atol=1e-5, rtol=0)

        # two sessions batched at different positions, reading every slot (the fixed-shape path):
        # row 0 prefills 9 positions but only 7 are real; slots 7-8 are stale until overwritten
        other = torch.randn(1, 12, 16)
        full_other = lm.llm(other)
        batch = KVCache.allocate(lm.cfg.qwen, batch=2, max_len=16)
        lm.llm(torch.cat([seq[:, :9], other[:, :9]]), torch.arange(9).expand(2, 9), batch)
        for a, b in ((7, 9), (8, 10)):
            out = lm.llm(torch.cat([seq[:, a:a + 1], other[:, b:b + 1]]), torch.tensor([[a], [b]]), batch)
            torch.testing.assert_close(out[0, 0], full[0, a], atol=1e-5, rtol=0)
            torch.testing.assert_close(out[1, 0], full_other[0, b], atol=1e-5, rtol=0)


@pytest.mark.parametrize("new", [1, 3])
def test_grouped_attention_equals_attention_over_repeated_heads(new: int) -> None:
    """The released shape (14 query heads over 2 kv heads): stacking each kv head's query heads gives what
    repeating the keys/values per query head gives, for decode steps and multi-position calls, rows masked
    differently (a row at an earlier position sees fewer slots)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 14, new, 64, generator=gen)
    k, v = torch.randn(2, 2, 40, 64, generator=gen), torch.randn(2, 2, 40, 64, generator=gen)
    positions = torch.tensor([[30 + i for i in range(new)], [11 + i for i in range(new)]])
    mask = (torch.arange(40)[None, None, :] <= positions[:, :, None]).unsqueeze(1)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(7, dim=1), v.repeat_interleave(7, dim=1), attn_mask=mask)
    torch.testing.assert_close(grouped_attention(q, k, v, mask), want, atol=1e-5, rtol=1e-5)
    # the second row never reads a slot past its position: changing those slots changes nothing of it
    k[1, :, 11 + new:] = 1e3
    torch.testing.assert_close(grouped_attention(q, k, v, mask)[1], want[1], atol=1e-5, rtol=1e-5)


def test_generation_reproducible_per_seed(lm: CosyVoice3LM) -> None:
    def run(seed: int) -> list[int]:
        return list(lm.generate(*_request(), seed))

    torch.manual_seed(123)
    first = run(7)
    torch.manual_seed(456)  # the global RNG must not matter
    assert run(7) == first
    others = [run(seed) for seed in (0, 1, 2, 3)]
    assert first and all(other != first for other in others)
    # with real sampling some runs end on a sampled stop id, some at max_len (3 text tokens * 20)
    assert {len(o) == 60 for o in [first, *others]} == {True, False}


def test_stops_on_any_stop_id_and_min_len_quirk(lm: CosyVoice3LM) -> None:
    seen: list[torch.Tensor] = []
    out = list(lm.generate(*_request(), 0, sampler=_replay([7, 8, lm.eos], seen)))
    assert out == [7, 8]
    assert len(seen) == 3
    # before min_len only index speech_token_size (sos) is banned; eos and the other stop ids are not
    assert all(s[lm.sos] == -float("inf") and torch.isfinite(s[lm.eos:]).all() for s in seen)
    late = list(lm.generate(*_request(), 0,
                            sampler=_replay([9] * 6 + [SPEECH + 150])))
    assert late == [9] * 6
    _, max_len = lm.length_limits(3)
    seen.clear()
    list(lm.generate(*_request(), 0, sampler=_replay([9] * max_len, seen)))
    min_len, _ = lm.length_limits(3)
    assert torch.isinf(seen[min_len - 1][lm.sos]) and torch.isfinite(seen[min_len][lm.sos])


def test_max_len_respected(lm: CosyVoice3LM) -> None:
    stops = torch.tensor(list(lm.stop_token_ids))

    seeded = SeededSampler(0, lm.cfg.sampling)

    def never_stop(scores: torch.Tensor, decoded: Sequence[int]) -> int:
        return seeded(scores.index_fill(0, stops, -float("inf")), decoded)

    out = list(lm.generate(*_request(2), 0,
                           silent_tokens=frozenset(), sampler=never_stop))
    assert len(out) == lm.length_limits(2)[1] == 40


def test_closing_the_iterator_stops_work(lm: CosyVoice3LM) -> None:
    seen: list[torch.Tensor] = []
    tokens = lm.generate(*_request(), 0, sampler=_replay([7] * 60, seen))
    assert seen == []  # nothing runs before the first next()
    assert [next(tokens), next(tokens)] == [7, 7]
    tokens.close()
    assert len(seen) == 2
    with pytest.raises(StopIteration):
        next(tokens)


def test_long_silence_is_dropped_but_fed_back(lm: CosyVoice3LM) -> None:
    script = [1] * 8 + [7] + [2] * 3 + [lm.eos]
    out = list(lm.generate(*_request(), 0, sampler=_replay(script)))
    assert out == [1] * MAX_SILENT_RUN + [7] + [2] * 3
    everything = list(lm.generate(*_request(), 0,
                                  silent_tokens=frozenset(), sampler=_replay(script)))
    assert everything == script[:-1]


def test_invalid_requests_raise_at_call_time(lm: CosyVoice3LM) -> None:
    text, prompt, speech = _request()
    with pytest.raises(RuntimeError, match="endofprompt"):
        lm.generate(text, [5, 6], speech, 0)
    lm.generate([*text, EOP], [], [], 0)  # cross-lingual: fine
    with pytest.raises(RuntimeError, match="prompt_speech_token"):
        lm.generate(text, prompt, [SPEECH], 0)
    with pytest.raises(RuntimeError, match="1-D"):
        lm.generate(torch.zeros(2, 3, dtype=torch.long), prompt, speech, 0)
    with pytest.raises(RuntimeError, match="KV cache"):
        lm.generate(text, prompt, speech, 0, cache=lm.llm.new_cache(1, 8))


def test_reusing_a_session_cache_gives_the_same_tokens(lm: CosyVoice3LM) -> None:
    cache = lm.llm.new_cache(1, 200)
    runs = [list(lm.generate(*_request(), 3, cache=cache))
            for _ in range(2)]
    assert runs[0] == runs[1] == list(lm.generate(*_request(), 3))


def test_bf16_generation_runs(lm: CosyVoice3LM) -> None:
    half = CosyVoice3LM(lm.cfg, lm.endofprompt_id).eval()
    half.load_state_dict(lm.state_dict())
    half.to(torch.bfloat16)
    out = list(half.generate(*_request(), 0))
    assert all(0 <= t < SPEECH for t in out)


def test_nucleus_rule_includes_the_crossing_token() -> None:
    scores = torch.tensor([0.5, 0.1, 0.25, 0.15]).log()
    ids, probs = nucleus_candidates(scores, top_p=0.8, top_k=25)
    assert ids.tolist() == [0, 2, 3]  # 0.5 + 0.25 < 0.8, so 0.15 (crossing) is still taken
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.25, 0.15]))
    assert nucleus_candidates(scores, top_p=0.8, top_k=2)[0].tolist() == [0, 2]
    ties = torch.zeros(6)  # equal scores keep index order (stable sort)
    assert nucleus_candidates(ties, top_p=0.5, top_k=25)[0].tolist() == [0, 1, 2]


def test_sampling_stays_in_candidate_set_and_ras_bans_repeats() -> None:
    cfg = SamplingConfig(top_p=0.8, top_k=25, win_size=10, tau_r=0.1)
    gen = torch.Generator().manual_seed(0)
    for trial in range(30):
        scores = (torch.randn(500, generator=gen) * (trial % 5 + 1)).log_softmax(0)
        allowed = set(nucleus_candidates(scores, cfg.top_p, cfg.top_k)[0].tolist())
        for seed in range(5):
            token = SeededSampler(seed, cfg)(scores, [])
            assert token in allowed
            # the same draw repeated in the window is banned: the fallback picks anything else
            repeat = SeededSampler(seed, cfg)(scores, [token])
            assert repeat != token
    peaky = torch.full((50,), -50.0)
    peaky[3] = 0.0
    assert SeededSampler(0, cfg)(peaky.log_softmax(0), [3] * 10) != 3


def test_batched_nucleus_equals_the_reference_rule() -> None:
    gen = torch.Generator().manual_seed(1)
    scores = torch.cat([(torch.randn(12, 300, generator=gen) * s).log_softmax(-1) for s in (0.5, 2.0, 8.0)])
    scores[0] = torch.zeros(300).log_softmax(0)  # all ties: index order, as the stable sort
    ids, probs, keep = nucleus_rows(scores, 0.8, 25)
    for row in range(scores.shape[0]):
        ref_ids, ref_probs = nucleus_candidates(scores[row], 0.8, 25)
        n = int(keep[row].sum())
        assert bool(keep[row, :n].all()) and ids[row, :n].tolist() == ref_ids.tolist()
        assert torch.equal(probs[row, :n], ref_probs)


def test_counter_rng_is_uniform_and_independent_of_the_batch() -> None:
    seeds = torch.tensor([0, 1, 2**62 + 5, 12345], dtype=torch.int64)
    u = uniforms(seeds[:, None].expand(4, 4096).reshape(-1), torch.arange(4096).repeat(4))
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    assert len(set(u.tolist())) == u.numel()  # no collisions across seeds and counters
    alone = uniforms(seeds[2:3], torch.tensor([7]))
    assert float(alone) == float(u.view(4, 4096)[2, 7])


def test_rows_sample_as_each_row_alone() -> None:
    """A row's token depends only on its own scores, tail, seed and counter, not on its batch neighbours."""
    cfg = SamplingConfig(top_p=0.8, top_k=25, win_size=10, tau_r=0.1)
    gen = torch.Generator().manual_seed(2)
    scores = (torch.randn(16, 400, generator=gen) * 3).log_softmax(-1)
    histories = [[int(t) for t in torch.randint(0, 400, (i,), generator=gen)] for i in range(16)]
    tails = history_tails(histories, cfg.win_size)
    seeds, counters = torch.arange(16) * 1000 + 3, torch.arange(16) % 5
    batched = ras_sample_rows(scores, tails, seeds, counters, cfg)
    for row in range(16):
        sampler = SeededSampler(int(seeds[row]), cfg)
        sampler.counter = int(counters[row])
        assert sampler(scores[row], histories[row]) == int(batched[row])
