"""Flow model: parity with the official fixtures, then behaviour on a small random model."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F

from cosyvoice.config import CFMConfig, DiTConfig, FlowConfig
from cosyvoice.errors import ResourceLimitError
from cosyvoice.flow import CausalMaskedDiffWithDiT
from cosyvoice.flow.dit import DiT, chunk_causal_mask
from cosyvoice.flow.dit_cache import PastFrames, attend_past
from cosyvoice.flow.model import FlowStream
from cosyvoice.tools.parity import flow as flow_parity
from cosyvoice.tools.parity.tolerances import FLOW_MEL_ATOL
from cosyvoice.weights import read_checkpoint

VOCAB, LOOKAHEAD, RATIO, CHUNK = 50, 3, 2, 10


def test_parity(golden) -> None:
    results = flow_parity.check(golden)
    failed = [r.row() for r in results if not r.passed]
    assert results and not failed, "\n".join(failed)


def test_state_dict_is_flow_pt(golden) -> None:
    ours = flow_parity.build_flow(golden).state_dict()
    theirs = read_checkpoint(golden.bundle_dir / "flow.pt")
    assert set(ours) == set(theirs)
    for key in ("decoder.estimator.rotary_embed.inv_freq", "decoder.estimator.transformer_blocks.0.ff.ff.0.0.weight",
                "decoder.estimator.input_embed.conv_pos_embed.conv1.0.weight", "pre_lookahead_layer.conv1.weight"):
        assert ours[key].shape == theirs[key].shape


# ----------------------------------------------------------------------------- a small random model


def small_config(n_timesteps: int = 4) -> FlowConfig:
    dit = DiTConfig(dim=32, depth=2, heads=2, dim_head=16, ff_mult=2, static_chunk_size=CHUNK)
    return FlowConfig(input_size=80, output_size=80, spk_embed_dim=24, vocab_size=VOCAB, token_mel_ratio=RATIO,
                      pre_lookahead_len=LOOKAHEAD, pre_lookahead_channels=16, dit=dit,
                      cfm=CFMConfig(n_timesteps=n_timesteps))


def make_noise(seed: int, frames: int = 400) -> torch.Tensor:
    return torch.randn(1, 80, frames, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def flow() -> CausalMaskedDiffWithDiT:
    torch.manual_seed(0)  # test-only initialisation of random weights
    return CausalMaskedDiffWithDiT(small_config(), noise=make_noise(1)).eval()


def inputs(n_tokens: int, n_prompt: int = 7, batch: int = 1, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(token=torch.randint(0, VOCAB, (batch, n_tokens), generator=g),
                prompt_token=torch.randint(0, VOCAB, (batch, n_prompt), generator=g),
                prompt_feat=torch.randn(batch, n_prompt * RATIO, 80, generator=g),
                embedding=torch.randn(batch, 24, generator=g))


def run(flow: CausalMaskedDiffWithDiT, x: dict, streaming: bool = False, finalize: bool = True) -> torch.Tensor:
    return flow.inference(x["token"], x["token"].shape[1], x["prompt_token"], x["prompt_token"].shape[1],
                          x["prompt_feat"], x["prompt_feat"].shape[1], x["embedding"], streaming, finalize)


@pytest.mark.parametrize("n_tokens", [1, 4, 13, 30])
@pytest.mark.parametrize("streaming", [False, True])
def test_output_shapes(flow, n_tokens: int, streaming: bool) -> None:
    x = inputs(n_tokens)
    final = run(flow, x, streaming, finalize=True)
    partial = run(flow, x, streaming, finalize=False)
    assert final.shape == (1, 80, n_tokens * RATIO) and final.dtype == torch.float32
    assert partial.shape == (1, 80, max(n_tokens - LOOKAHEAD, 0) * RATIO)
    assert torch.isfinite(final).all()


def test_no_new_frames_gives_empty_mel(flow) -> None:
    x = inputs(0)
    assert run(flow, x, finalize=True).shape == (1, 80, 0)
    assert run(flow, inputs(2), finalize=False).shape == (1, 80, 0)  # only look-ahead tokens so far


def test_without_prompt(flow) -> None:
    x = inputs(9, n_prompt=0)
    assert run(flow, x).shape == (1, 80, 18)


def test_chunk_mask_structure() -> None:
    mask = chunk_causal_mask(7, 3)
    expected = torch.tensor([[1, 1, 1, 0, 0, 0, 0]] * 3 + [[1, 1, 1, 1, 1, 1, 0]] * 3 + [[1] * 7], dtype=torch.bool)
    assert torch.equal(mask, expected)
    assert torch.equal(chunk_causal_mask(7, 3, first_query=4), expected[4:])


@pytest.mark.parametrize("past", [CHUNK, 3 * CHUNK])
def test_attention_over_a_kept_past_equals_attention_over_all_frames(past: int) -> None:
    """The cached graph's attention (past and new score blocks, the new frames' mask as a -inf bias, shifted scores
    clamped before exp) equals SDPA over past + new under the chunk mask, masked keys included."""
    g = torch.Generator().manual_seed(4)
    new = 2 * CHUNK + 3  # two whole chunks and a partial one: the new frames mask each other
    q, k, v = (torch.randn(2, 4, new, 16, generator=g) * 3 for _ in range(3))
    pk, pv = (torch.randn(2, 4, past, 16, generator=g) * 3 for _ in range(2))
    mask = chunk_causal_mask(past + new, CHUNK, first_query=past)
    assert not mask[:, past:].all()
    got = attend_past(q, k, v, PastFrames(pk, pv), mask)
    want = F.scaled_dot_product_attention(q, torch.cat((pk, k), 2), torch.cat((pv, v), 2), attn_mask=mask)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_first_chunk_of_streaming_equals_full_attention_on_it(flow) -> None:
    dit: DiT = flow.decoder.estimator
    g = torch.Generator().manual_seed(3)
    x, mu, cond = (torch.randn(2, 80, 3 * CHUNK + 4, generator=g) for _ in range(3))
    spks, t = torch.randn(2, 80, generator=g), torch.tensor([0.3, 0.3])
    with torch.no_grad():
        chunked = dit(x, mu, t, spks, cond, streaming=True)
        first = dit(x[..., :CHUNK], mu[..., :CHUNK], t, spks, cond[..., :CHUNK], streaming=False)
        full = dit(x, mu, t, spks, cond, streaming=False)
    torch.testing.assert_close(chunked[..., :CHUNK], first, atol=1e-5, rtol=0)
    assert (chunked[..., CHUNK:] - full[..., CHUNK:]).abs().max() > 1e-3  # later frames do see the future


def test_the_residual_stream_is_frame_major(flow) -> None:
    """Every block reads and adds to the input embedding in place of layout: a transposed one would make each norm
    and projection copy it first and each residual add stride across it (a third of the bf16 DiT's time but its
    products, docs/perf.md)."""
    dit: DiT = flow.decoder.estimator
    g = torch.Generator().manual_seed(3)
    x, mu, cond = (torch.randn(2, 2 * CHUNK, 80, generator=g) for _ in range(3))
    with torch.no_grad():
        h, _ = dit.input_embed(x, cond, mu, torch.randn(2, 80, generator=g))
    assert h.is_contiguous()


def test_batch_of_two_equals_two_singles(flow) -> None:
    a, b = inputs(11, seed=1), inputs(11, seed=2)
    both = {k: torch.cat((a[k], b[k])) for k in a}
    for streaming in (False, True):
        batched = run(flow, both, streaming)
        torch.testing.assert_close(batched[:1], run(flow, a, streaming), atol=1e-5, rtol=0)
        torch.testing.assert_close(batched[1:], run(flow, b, streaming), atol=1e-5, rtol=0)


def test_injected_noise_is_deterministic_and_matters() -> None:
    torch.manual_seed(0)
    model = CausalMaskedDiffWithDiT(small_config(), noise=make_noise(1)).eval()
    x = inputs(6)
    first = run(model, x)
    assert torch.equal(first, run(model, x))
    model.set_noise(make_noise(2))
    assert (run(model, x) - first).abs().max() > 1e-3
    model.set_noise(make_noise(1))
    assert torch.equal(first, run(model, x))
    with pytest.raises(RuntimeError):
        model.set_noise(torch.zeros(80, 100))
    model.set_noise(make_noise(1, frames=20))
    with pytest.raises(ResourceLimitError):
        run(model, x)  # 7 + 6 tokens need 26 noise frames


def test_default_noise_is_the_official_buffer() -> None:
    from cosyvoice.rng import cfm_noise

    model = CausalMaskedDiffWithDiT(small_config())
    assert torch.equal(model.decoder.noise, cfm_noise())


@pytest.mark.parametrize("bad", ["len", "id", "feat"])
def test_invalid_inputs(flow, bad: str) -> None:
    x = inputs(5)
    token_len = 5
    if bad == "len":
        token_len = 4
    elif bad == "id":
        x["token"][0, 2] = VOCAB
    else:
        x["prompt_feat"] = x["prompt_feat"][..., :40]
    with pytest.raises(RuntimeError):
        flow.inference(x["token"], token_len, x["prompt_token"], 7, x["prompt_feat"], x["prompt_feat"].shape[1],
                       x["embedding"], False, True)


def test_float64_matches_float32(flow) -> None:
    x = inputs(8)
    ref = run(flow, x)
    model = CausalMaskedDiffWithDiT(small_config(), noise=make_noise(1))
    model.load_state_dict(flow.state_dict())
    out = run(model.to(torch.float64).eval(), x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------- incremental streaming


def test_flowstream_equals_recompute(flow) -> None:
    """Growing prefixes with hops that do and do not end on chunk boundaries, then the full-attention last call."""
    x = inputs(40, n_prompt=6)
    stream = FlowStream(flow, x["prompt_token"], x["prompt_feat"], x["embedding"])
    calls = [(2, True, False), (9, True, False), (9, True, False), (17, True, False), (31, True, False),
             (40, False, True)]
    fed = returned = 0
    for n, streaming, finalize in calls:
        sub = dict(x, token=x["token"][:, :n])
        expected = run(flow, sub, streaming, finalize)[:, :, returned:]  # only what no earlier call returned
        got = stream.inference(sub["token"][:, fed:], finalize, streaming)  # only the new tokens
        fed, returned = n, returned + got.shape[2]
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=FLOW_MEL_ATOL, rtol=0)
        assert stream.finished_frames % CHUNK == 0
        if n == 31:
            assert stream.finished_frames == (6 + 31 - LOOKAHEAD) * RATIO // CHUNK * CHUNK
    assert returned == run(flow, x, False, True).shape[2]


def test_flowstream_chunk_mask_with_finalize_and_cache_drop(flow) -> None:
    """streaming=True + finalize (zero-padded end under the chunk mask), and the budget's recompute fallback."""
    x = inputs(36, n_prompt=6)
    for drop_after in (None, 17):
        stream, fed, returned = FlowStream(flow, x["prompt_token"], x["prompt_feat"], x["embedding"]), 0, 0
        for n, finalize in ((9, False), (17, False), (31, False), (36, True)):
            got = stream.inference(x["token"][:, fed:n], finalize, streaming=True)
            expected = run(flow, dict(x, token=x["token"][:, :n]), True, finalize)[:, :, returned:]
            assert got.shape == expected.shape and got.shape[2] > 0
            torch.testing.assert_close(got, expected, atol=FLOW_MEL_ATOL, rtol=0)
            fed, returned = n, returned + got.shape[2]
            if n == drop_after:
                stream.drop_cache()
                assert stream.cache_bytes == 0 and not stream.caching


def test_flowstream_cache_grows_in_place(flow) -> None:
    """Chunk after chunk the keys/values are written into the stream's own buffers, which are replaced only when
    full (geometric growth), and the mel is still the recompute's."""
    x = inputs(80, n_prompt=6)
    stream = FlowStream(flow, x["prompt_token"], x["prompt_feat"], x["embedding"])
    buffers, fed, returned = [], 0, 0
    for n in range(9, 80, 4):
        got = stream.inference(x["token"][:, fed:n], finalize=False)
        expected = run(flow, dict(x, token=x["token"][:, :n]), True, False)[:, :, returned:]
        torch.testing.assert_close(got, expected, atol=FLOW_MEL_ATOL, rtol=0)
        fed, returned = n, returned + got.shape[2]
        keys = stream._caches[0].kv[0][0]
        buffers.append((keys.untyped_storage().data_ptr(), keys.shape[2]))
    lengths = [length for _, length in buffers]
    grown = len({ptr for ptr, _ in buffers})
    assert len(buffers) == 18 and lengths[-1] > 4 * lengths[0] and grown <= 6  # 18 calls, 4 copies or so


def test_flowstream_frees_each_steps_old_cache_before_the_next_step(flow, monkeypatch: pytest.MonkeyPatch) -> None:
    """A call holds one step's old and new cache at a time, not every step's (twice the cache), and a failed call
    leaves a stream that recomputes."""
    x = inputs(40, n_prompt=6)
    stream = FlowStream(flow, x["prompt_token"], x["prompt_feat"], x["embedding"])
    stream.inference(x["token"][:, :17], finalize=False)
    dit = flow.decoder.estimator
    extend = dit.forward_cached
    olds: list[weakref.ref] = []
    alive_at_next_step: list[bool] = []

    def spy(*args, **kwargs):
        alive_at_next_step.extend(old() is not None for old in olds[-1:])
        olds.append(weakref.ref(args[5].kv[0][0]))  # this step's cache before the call
        return extend(*args, **kwargs)

    monkeypatch.setattr(dit, "forward_cached", spy)
    stream.inference(x["token"][:, 17:31], finalize=False)
    assert len(olds) == stream.steps and alive_at_next_step == [False] * (stream.steps - 1)

    def failing(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(dit, "forward_cached", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        stream.inference(x["token"][:, 31:36], finalize=False)
    assert not stream.caching and stream.cache_bytes == 0


def test_flowstream_rejects_calls_after_the_last(flow) -> None:
    x = inputs(20)
    stream = FlowStream(flow, x["prompt_token"], x["prompt_feat"], x["embedding"])
    assert stream.cache_bytes == 0
    stream.inference(x["token"][:, :12], finalize=False)
    assert stream.cache_bytes == stream.finished_frames * FlowStream.bytes_per_frame(flow) > 0
    stream.inference(x["token"][:, 12:], finalize=True)
    assert stream.cache_bytes == 0  # freed before the full-attention last call, which cannot use it
    with pytest.raises(RuntimeError, match="finalised"):
        stream.inference(x["token"][:, :1], finalize=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu(flow) -> None:
    """On CUDA the convolutions run as float32 matmuls (no cuDNN algorithm choice, no TF32)."""
    x = inputs(80, n_prompt=30)
    ref = run(flow, x, streaming=True)
    model = CausalMaskedDiffWithDiT(small_config(), noise=make_noise(1))
    model.load_state_dict(flow.state_dict())
    out = run(model.cuda().eval(), x, streaming=True)
    assert out.device.type == "cuda"
    torch.testing.assert_close(out.cpu(), ref, atol=5e-5, rtol=0)
