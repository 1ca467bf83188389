"""The AdaLN modulation cache: bit-equal to recomputing, one entry per ODE time, bounded, invalidated by weights."""

from __future__ import annotations

import copy

import pytest
import torch

from cosyvoice.config import CFMConfig, DiTConfig, FlowConfig
from cosyvoice.flow import CausalMaskedDiffWithDiT
from cosyvoice.flow.model import FlowStream

STEPS = 4


@pytest.fixture()
def flow() -> CausalMaskedDiffWithDiT:
    dit = DiTConfig(dim=32, depth=2, heads=2, dim_head=16, ff_mult=2, static_chunk_size=10)
    cfg = FlowConfig(input_size=80, output_size=80, spk_embed_dim=24, vocab_size=50, token_mel_ratio=2,
                     pre_lookahead_len=3, pre_lookahead_channels=16, dit=dit, cfm=CFMConfig(n_timesteps=STEPS))
    torch.manual_seed(0)  # test-only initialisation of random weights
    return CausalMaskedDiffWithDiT(cfg, noise=torch.randn(1, 80, 400, generator=torch.Generator().manual_seed(1)))


def _inputs(n_tokens: int = 30) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, 50, (1, n_tokens), generator=g), torch.randint(0, 50, (1, 7), generator=g),
            torch.randn(1, 14, 80, generator=g), torch.randn(1, 24, generator=g))


def _mel(flow: CausalMaskedDiffWithDiT, streaming: bool) -> torch.Tensor:
    tok, ptok, pfeat, emb = _inputs()
    return flow.inference(tok, tok.shape[1], ptok, ptok.shape[1], pfeat, pfeat.shape[1], emb, streaming, True)


def _streamed(flow: CausalMaskedDiffWithDiT) -> torch.Tensor:
    tok, ptok, pfeat, emb = _inputs()
    stream = FlowStream(flow, ptok, pfeat, emb)
    return torch.cat([stream.inference(tok[:, :17], False), stream.inference(tok[:, 17:], False, streaming=True)], 2)


def test_cached_modulation_is_bit_equal_to_recomputing(flow: CausalMaskedDiffWithDiT) -> None:
    dit = flow.decoder.estimator
    dit.modulation_cache.max_bytes = 0  # nothing fits: every step recomputes its modulation, as before the cache
    reference = {streaming: _mel(flow, streaming) for streaming in (False, True)}
    streamed = _streamed(flow)
    assert len(dit.modulation_cache) == 0 and dit.modulation_cache.hits == 0
    dit.modulation_cache.max_bytes = 64 << 20
    for streaming in (False, True):
        assert torch.equal(_mel(flow, streaming), reference[streaming])
    # one entry per Euler step (both guidance rows share t), reused by the second call of the same grid
    assert len(dit.modulation_cache) == STEPS and dit.modulation_cache.hits >= STEPS
    hits = dit.modulation_cache.hits
    assert torch.equal(_streamed(flow), streamed)
    assert dit.modulation_cache.hits > hits
    twin = copy.deepcopy(flow)  # a copy starts with an empty cache of its own
    assert len(twin.decoder.estimator.modulation_cache) == 0 and torch.equal(_streamed(twin), streamed)


def test_new_weights_and_step_counts_are_new_entries(flow: CausalMaskedDiffWithDiT) -> None:
    dit = flow.decoder.estimator
    before = _mel(flow, False)
    with torch.no_grad():
        dit.transformer_blocks[0].attn_norm.linear.weight.mul_(1.5)  # an in-place edit of an AdaLN weight
    after = _mel(flow, False)
    assert not torch.equal(before, after)
    dit.modulation_cache.clear()
    assert torch.equal(_mel(flow, False), after)
    tok, ptok, pfeat, emb = _inputs()
    flow.inference(tok, tok.shape[1], ptok, 7, pfeat, 14, emb, False, True, n_steps=3)
    assert len(dit.modulation_cache) == STEPS + 3 - 1  # every grid starts at t = 0: one entry serves both


def test_the_cache_keeps_within_its_byte_budget(flow: CausalMaskedDiffWithDiT) -> None:
    dit = flow.decoder.estimator
    one = dit._modulation(torch.zeros(2)).nbytes
    dit.modulation_cache.max_bytes = 2 * one
    _mel(flow, False)  # four steps, room for two
    assert len(dit.modulation_cache) == 2 and dit.modulation_cache.nbytes == 2 * one
    reference = _mel(flow, False)
    dit.modulation_cache.max_bytes = 0  # nothing fits: every call computes, as without a cache
    dit.modulation_cache.clear()
    assert torch.equal(_mel(flow, False), reference) and len(dit.modulation_cache) == 0
