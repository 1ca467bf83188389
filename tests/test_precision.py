"""CPU precision paths (cosyvoice.backends.precision): the quality bounds of the fast paths against fp32 on the
golden inputs, auto's choice and where it is shown, and the engine's per-stage threads."""

from __future__ import annotations

import copy
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cosyvoice.backends import precision as fast
from cosyvoice.bundle import validate_model_dir
from cosyvoice.engine.engine import stage_threads
from cosyvoice.errors import ConfigError
from cosyvoice.flow import FlowStream
from cosyvoice.tools.parity.common import Golden

FLOW_KEYS = ("token", "prompt_token", "prompt_feat", "embedding")


@pytest.fixture(scope="module")
def golden_models(golden: Golden) -> tuple:
    bundle = validate_model_dir(golden.bundle_dir)
    return bundle.load_llm(), bundle.load_flow()


def _tensors(golden: Golden, filename: str) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in golden.arrays(filename).items()}


def _flow_inputs(golden: Golden) -> tuple[torch.Tensor, ...]:
    arrays = _tensors(golden, "flow.safetensors")
    return tuple(arrays[k] for k in FLOW_KEYS)


def _mel_errors(ref: torch.nn.Module, got: torch.nn.Module, golden: Golden) -> dict[str, dict[str, float]]:
    """Mel error of ``got`` against ``ref``: whole, chunk-masked, and streamed through FlowStream (two calls)."""
    tok, ptok, pfeat, emb = _flow_inputs(golden)
    out = {}
    with torch.inference_mode():
        for name, streaming in (("whole", False), ("chunk_masked", True)):
            args = (tok, tok.shape[1], ptok, ptok.shape[1], pfeat, pfeat.shape[1], emb, streaming, True)
            out[name] = fast.mel_error(ref.inference(*args), got.inference(*args))
        mels = []
        for model in (ref, got):
            stream = FlowStream(model, ptok, pfeat, emb)
            mels.append(torch.cat([stream.inference(tok[:, :30], False), stream.inference(tok[:, 30:], True)], 2))
        out["streamed"] = fast.mel_error(*mels)
    return out


def _golden_kl(llm: torch.nn.Module, got: torch.nn.Module, golden: Golden) -> float:
    arrays = _tensors(golden, "llm.safetensors")
    ids = {k: arrays[k].reshape(-1).long()
           for k in ("text_tokens", "prompt_text_tokens", "prompt_speech_tokens", "forced_tokens")}
    lm_input = llm.build_lm_input(ids["text_tokens"], ids["prompt_text_tokens"], ids["prompt_speech_tokens"])
    return fast.llm_kl(llm, got, lm_input, ids["forced_tokens"])


@pytest.mark.parametrize("kind", ["int8", "bf16"])
def test_dit_fast_paths_hold_the_mel_bounds_whole_chunk_masked_and_streamed(golden: Golden, golden_models: tuple,
                                                                              kind: str) -> None:
    _, flow = golden_models
    errors = _mel_errors(flow, fast.apply_flow(copy.deepcopy(flow), kind), golden)
    for name, e in errors.items():
        assert e["mel_rel_rms"] <= fast.BOUNDS["mel_rel_rms"], (name, e)
        assert e["mel_max_abs"] <= fast.BOUNDS["mel_max_abs"], (name, e)
        assert e["mel_max_abs"] > 0, "the fast path must really run (not the fp32 weights)"


def test_bf16_weights_are_stored_and_the_rest_stays_float32(golden_models: tuple) -> None:
    llm, flow = (fast.apply_llm(copy.deepcopy(golden_models[0]), "bf16"),
                 fast.apply_flow(copy.deepcopy(golden_models[1]), "bf16"))
    assert {p.dtype for p in llm.parameters()} == {torch.bfloat16}
    dit = flow.decoder.estimator
    stored = {n: m for n, m in dit.named_modules() if isinstance(m, fast.Bf16Linear)}
    # the feed-forward's first layer carries its GELU (the Sequential of both is replaced)
    projections = [n.removesuffix(".0") if n.endswith(".ff.ff.0.0") else n
                   for n in fast.dit_projections(golden_models[1].decoder.estimator)]
    assert sorted(stored) == sorted(projections)
    assert sorted(n for n, m in stored.items() if m.gelu) == sorted(n for n in projections if n.endswith(".ff.0"))
    assert all(m.weight.dtype == torch.bfloat16 for m in stored.values())
    assert all(isinstance(m, fast.PackedBf16Linear) == fast.packs_bf16() for m in stored.values())
    assert dit.proj_out.weight.dtype == flow.input_embedding.weight.dtype == torch.float32
    tok = torch.zeros(1, 10, dtype=torch.long)
    with torch.inference_mode():
        mel = flow.inference(tok, 10, tok[:, :0], 0, torch.zeros(1, 0, 80), 0, torch.ones(1, 192), False, True)
    assert mel.dtype == torch.float32


@pytest.mark.skipif(not fast.packs_bf16(), reason="oneDNN packs bf16 weights where the CPU computes bf16 natively")
@pytest.mark.parametrize("gelu", [False, True])
def test_a_packed_bf16_layer_computes_what_the_plain_one_does(gelu: bool) -> None:
    """The same bf16 products; the packed layer applies its GELU to the float32 accumulator, so it rounds once
    where the plain one rounds twice: it is never further from float32 arithmetic on the same bf16 operands."""
    torch.manual_seed(0)  # test-only random weights
    linear = torch.nn.Linear(96, 160)
    x = torch.randn(2, 7, 96) * 4
    plain, packed = fast.Bf16Linear(linear, gelu), fast.PackedBf16Linear(linear, gelu)
    want = F.linear(*(t.bfloat16().float() for t in (x, linear.weight, linear.bias)))
    want = F.gelu(want, approximate="tanh") if gelu else want
    errors = {}
    with torch.inference_mode():
        for name, layer in (("plain", plain), ("packed", packed)):
            got = layer(x)
            assert got.dtype == torch.bfloat16 and got.shape == want.shape
            errors[name] = ((got.float() - want).abs() / (want.abs() + 1e-2)).max().item()
    # one rounding; the plain GELU also carries its input's rounding through its slope
    assert errors["packed"] <= 2 ** -8 and errors["plain"] <= 2 ** -5, errors
    assert errors["packed"] <= errors["plain"], errors


def test_the_bf16_dit_attends_in_bf16_and_a_stream_caches_half_the_bytes(golden: Golden, golden_models: tuple
                                                                           ) -> None:
    """Its keys/values are bf16 (the projections' outputs are already), so a stream holds half the cache of fp32,
    and what it says it holds (the engine's cache budget) is what it holds. (Its sound against fp32, streamed
    too: the bounds test above.)"""
    fp32 = golden_models[1]
    flow = fast.apply_flow(copy.deepcopy(fp32), "bf16")
    assert {b.attn.compute_dtype for b in flow.decoder.estimator.transformer_blocks} == {torch.bfloat16}
    assert 2 * FlowStream.bytes_per_frame(flow) == FlowStream.bytes_per_frame(fp32)
    tok, ptok, pfeat, emb = _flow_inputs(golden)
    with torch.inference_mode():
        stream = FlowStream(flow, ptok, pfeat, emb)
        stream.inference(tok[:, :20], False)
        stream.inference(tok[:, 20:30], False)
    kv = [t for cache in stream._caches for pair in cache.kv for t in pair]
    assert {t.dtype for t in kv} == {torch.bfloat16}
    assert stream.cache_bytes == sum(t.shape[0] * t.shape[1] * t.shape[2] * t.shape[3] * 2 for t in kv) > 0


def test_int8_quantises_exactly_the_projections_of_the_onnx_int8_graph(golden_models: tuple) -> None:
    dit = fast.apply_flow(copy.deepcopy(golden_models[1]), "int8").decoder.estimator
    dynamic = torch.ao.nn.quantized.dynamic.Linear
    quantized = sorted(n for n, m in dit.named_modules() if isinstance(m, dynamic))
    assert quantized and all(".attn.to_" in n or ".ff." in n for n in quantized)
    assert len(quantized) == 6 * len(dit.transformer_blocks)  # q, k, v, out, and the two feed-forward layers
    assert isinstance(dit.proj_out, torch.nn.Linear) and isinstance(dit.transformer_blocks[0].attn_norm.linear,
                                                                     torch.nn.Linear)


@pytest.mark.parametrize("kind", ["int8", "bf16"])
def test_llm_fast_paths_are_measured_by_mean_kl_on_the_golden_sequence(golden: Golden, golden_models: tuple,
                                                                        kind: str) -> None:
    """The bound (0.02 nats per teacher-forced step) on the golden sequence; whether a path holds it on these
    random tiny weights decides auto's choice (see the next test), so only bf16, which holds it by far, is
    asserted to pass; int8 is asserted to be measured and finite."""
    llm = golden_models[0]
    kl = _golden_kl(llm, fast.apply_llm(copy.deepcopy(llm), kind), golden)
    assert 0 < kl < 1
    if kind == "bf16":
        assert kl <= fast.BOUNDS["llm_kl_mean"]


@pytest.mark.parametrize("features", [frozenset({"avx2"}), frozenset({"avx512_bf16", "avx512_vnni"})])
def test_auto_picks_per_stage_the_fastest_candidate_that_holds_the_bounds(golden_models: tuple,
                                                                          features: frozenset[str]) -> None:
    """Data-driven: every candidate of this CPU is measured against fp32 on the model's own weights (quality and
    seconds); a stage runs the fastest that holds the bounds and beats fp32, else fp32."""
    llm, flow = (copy.deepcopy(m) for m in golden_models)
    plan, llm, flow = fast.plan_and_apply("auto", lambda: llm, lambda: flow, features)
    paths = fast.candidates(features)
    assert paths == (("int8", "bf16") if "avx512_bf16" in features else ("int8",))
    for stage in ("llm", "flow"):
        fp32 = plan.checks[f"{stage}_fp32"]["seconds"]
        ok = {k: plan.checks[f"{stage}_{k}"]["seconds"] for k in paths
              if fast.holds(plan.checks[f"{stage}_{k}"]) and plan.checks[f"{stage}_{k}"]["seconds"] < fp32}
        assert getattr(plan, stage) == (min(ok, key=ok.get) if ok else "fp32"), plan.checks
    assert plan.checks["flow_int8"]["mel_rel_rms"] <= fast.BOUNDS["mel_rel_rms"]  # int8 DiT holds on these weights
    assert plan.vocoder == "fp32"
    to_q = flow.decoder.estimator.transformer_blocks[0].attn.to_q
    assert isinstance(to_q, torch.ao.nn.quantized.dynamic.Linear) == (plan.flow == "int8")


def test_explicit_precisions_and_their_errors() -> None:
    cpu = torch.device("cpu")
    assert fast.resolve("int8", cpu, "torch") == "int8"
    with pytest.raises(ConfigError, match="precision must be one of"):
        fast.resolve("fp8", cpu, "torch")
    with pytest.raises(ConfigError, match="for the CPU"):
        fast.resolve("int8", torch.device("cuda"), "torch")
    with pytest.raises(ConfigError, match="backend 'onnxruntime-int8'"):
        fast.resolve("auto", cpu, "onnxruntime-int8")


def test_cpu_features_read_the_flags_and_torch_capability(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni amx_int8\n")
    features = fast.cpu_features(info)
    assert {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_int8"} <= features
    assert fast.native_bf16(features)
    assert f"cpu_capability:{torch.backends.cpu.get_cpu_capability()}" in features
    assert not fast.native_bf16(fast.cpu_features(tmp_path / "absent"))


def test_fp32_leaves_the_modules_bit_equal(tiny_bundle_dir: Path, tmp_path: Path, short_prompt_wav: Path) -> None:
    from cosyvoice.cli.cosyvoice import CosyVoice3

    bundle = validate_model_dir(tiny_bundle_dir)
    tts = CosyVoice3(tiny_bundle_dir, device="cpu", voice_dir=tmp_path, backend="torch", precision="fp32")
    try:
        plan = tts.model.plan
        assert (plan.requested, plan.llm, plan.flow, plan.vocoder) == ("fp32", "fp32", "fp32", "fp32")
        for name, ref in (("llm", bundle.load_llm()), ("flow", bundle.load_flow())):
            got = getattr(tts.engine, name).state_dict()
            assert all(torch.equal(v, got[k]) for k, v in ref.state_dict().items()), name
    finally:
        tts.engine.close()


@pytest.mark.parametrize("precision", ["int8", "bf16"])
def test_fast_paths_synthesise_streamed_and_whole(tts, tiny_bundle_dir: Path, tmp_path: Path, short_prompt_wav: Path,
                                                  precision: str) -> None:
    """End to end through the engine (FlowStream's cached keys/values, the scheduler's KV cache in the LLM's
    dtype): the same chunking and length as fp32 (the shared ``tts``), finite audio."""
    from cosyvoice.cli.cosyvoice import CosyVoice3

    fast_tts = CosyVoice3(tiny_bundle_dir, device="cpu", voice_dir=tmp_path, backend="torch", precision=precision)
    try:
        assert (fast_tts.model.plan.llm, fast_tts.model.plan.flow) == (precision, precision)
        for stream in (True, False):
            lengths = []
            for model in (tts, fast_tts):
                voice = model.frontend.voice("<|endofprompt|>a prompt", short_prompt_wav)
                inp = model.frontend.model_input("Some words to speak.", voice)
                chunks = list(model.engine.synthesize(inp, stream=stream, seed=3, fixed_tokens=60))
                assert all(torch.isfinite(c.pcm).all() for c in chunks)
                lengths.append([c.pcm.numel() for c in chunks])
            assert lengths[0] == lengths[1] and len(lengths[0]) > stream  # streamed: the cached path too
    finally:
        fast_tts.engine.close()


def test_auto_is_reported_by_ready_and_shown_on_the_page(tiny_bundle_dir: Path, tmp_path: Path) -> None:
    from app.ui import Studio, build_ui
    from cosyvoice.context import StudioContext
    from cosyvoice.server.rest import create_app
    from cosyvoice.service import TTSService
    from cosyvoice.settings import ServerSettings
    from tests.test_rest import Server

    service = TTSService.load(tiny_bundle_dir, tmp_path / "voices", device="cpu", backend="torch", precision="auto")
    try:
        plan = service.model.plan
        assert plan.requested == "auto" and plan.checks
        server = Server(create_app(ServerSettings(), service))
        try:
            ready = httpx.get(f"{server.url}/ready").json()["precision"]
        finally:
            server.stop()
        assert ready == json_like(plan.describe())
        assert ready["llm"] == plan.llm and ready["flow"] == plan.flow and "label" in ready
        page = build_ui(Studio(StudioContext(service=service, data_dir=tmp_path / "data")))
        shown = [b for b in page.blocks.values() if getattr(b, "elem_id", None) == "precision"]
        assert len(shown) == 1 and shown[0].value == plan.label and "auto" in plan.label
        # the measurements behind the choice, on the page and in /ready (kept per CPU and model: a restart reads them)
        assert shown[0].info == plan.summary == ready["summary"] and "flow: " in plan.summary
        assert all(f"{name.split('_', 1)[1]} " in plan.summary for name in plan.checks)
        assert ready["measured_at"] and (tiny_bundle_dir / "auto-precision.json").is_file()
    finally:
        service.model.close()


def json_like(value: object) -> object:
    """``value`` as it comes back from JSON (tuples become lists)."""
    import json

    return json.loads(json.dumps(value))


def test_torch_thread_counts_are_per_calling_thread() -> None:
    """What the engine's per-stage threads rest on: ``torch.set_num_threads`` in one thread leaves another
    thread's count alone (the scheduler and the worker each set their own)."""
    before = torch.get_num_threads()
    seen = {}

    def stage() -> None:
        torch.set_num_threads(1)
        torch.ones(64, 64) @ torch.ones(64, 64)
        seen["stage"] = torch.get_num_threads()

    torch.set_num_threads(2)
    try:
        worker = threading.Thread(target=stage)
        worker.start()
        worker.join()
        assert seen["stage"] == 1 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_stage_threads_never_oversubscribe_the_cores(tts) -> None:
    for cores in range(1, 9):
        llm, t2w = stage_threads(cores)
        assert llm >= 1 and t2w >= 1 and (llm + t2w <= cores or cores == 1)
    engine = tts.engine
    assert (engine.scheduler.threads, engine.worker.threads) == stage_threads(torch.get_num_threads())
    assert engine.worker.wide_threads == torch.get_num_threads()  # only while the LLM has no step to run
