"""Backends for the flow estimator and the vocoder: onnxruntime-CPU against torch, choice and fallback rules.

Bounds (tiny bundle, random weights, onnxruntime-CPU fp32 against torch fp32, same inputs):
- mel (DiT through the ODE, full, chunk-causal and incremental FlowStream): max |diff| <= 1e-4 (measured ~2e-6,
  mels of magnitude ~7);
- vocoder on the same mel (whole and HiFTStream): max |diff| <= 2e-3 of full scale (measured ~1e-4);
- int8 DiT (the fast CPU path) against fp32: mel max |diff| <= 0.05 and relative RMS <= 1% (measured 0.018, 0.23%);
- end to end (same LLM tokens: the LLM is torch on both): the mel's ~1e-6 moves the vocoder's F0 and so its
  phase, which random tiny weights amplify; the bound is on the signal: SNR >= 20 dB and equal lengths.
TensorRT needs a CUDA GPU: its tests skip without one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from cosyvoice.backends import attach_flow, attach_hift, resolve_backend, trt
from cosyvoice.bundle import validate_model_dir
from cosyvoice.errors import ConfigError
from cosyvoice.flow import FlowStream
from cosyvoice.flow.dit_cache import GROWTH, ROOM_FRAMES
from cosyvoice.frontend.prompts import cross_lingual_text, instruct_text, zero_shot_prompt_text
from cosyvoice.hifigan import HiFTStream

TEXT = "Hello there, my friend, how are you today?"
PROMPT_TEXT = zero_shot_prompt_text("Hello, this is a short prompt for testing.")
MEL_BOUND, VOCODER_BOUND, MIN_SNR_DB = 1e-4, 2e-3, 20.0
INT8_MEL_MAX, INT8_MEL_REL_RMS = 5e-2, 1e-2  # int8 DiT against fp32 (measured 0.018 and 0.23%)


@pytest.fixture(scope="module")
def modules(tiny_bundle_dir: Path) -> dict[str, object]:
    bundle = validate_model_dir(tiny_bundle_dir)
    return {"flow": bundle.load_flow(), "hift": bundle.load_hift(),
            "flow_ort": attach_flow(bundle.load_flow(), bundle.root, "onnxruntime", "cpu"),
            "hift_ort": attach_hift(bundle.load_hift(), bundle.root, "onnxruntime", "cpu"),
            "flow_int8": attach_flow(bundle.load_flow(), bundle.root, "onnxruntime-int8", "cpu")}


@pytest.fixture(scope="module")
def flow_inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, 6561, (1, 80), generator=g), torch.randint(0, 6561, (1, 20), generator=g),
            torch.randn(1, 40, 80, generator=g), torch.randn(1, 192, generator=g))


def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COSYVOICE_BACKEND", raising=False)
    assert resolve_backend(None, "cpu") == "torch"  # the fast CPU path is opt-in: it changes the audio
    assert resolve_backend("auto", "cuda") == "torch"
    monkeypatch.setenv("COSYVOICE_BACKEND", "torch")
    assert resolve_backend(None, "cpu") == "torch"
    assert resolve_backend("onnxruntime", "cpu") == "onnxruntime"  # the argument wins over the environment
    with pytest.raises(ConfigError, match="one of auto, torch, onnxruntime, onnxruntime-int8, tensorrt, got 'trt'"):
        resolve_backend("trt", "cpu")
    with pytest.raises(ConfigError, match="backend 'tensorrt' cannot run here: TensorRT needs a CUDA device"):
        resolve_backend("tensorrt", "cpu")
    with pytest.raises(ConfigError, match="the int8 graphs are for the CPU"):
        resolve_backend("onnxruntime-int8", "cuda")
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # what Python does for a package that is not installed
    with pytest.raises(ConfigError, match="onnxruntime package is not installed"):
        resolve_backend("onnxruntime", "cpu")
    monkeypatch.setenv("COSYVOICE_BACKEND", "auto")
    assert resolve_backend(None, "cpu") == "torch"


@pytest.mark.parametrize("streaming", [False, True])
def test_flow_mel_equals_torch(modules: dict, flow_inputs: tuple, streaming: bool) -> None:
    tok, ptok, pfeat, emb = flow_inputs
    args = (tok, tok.shape[1], ptok, ptok.shape[1], pfeat, pfeat.shape[1], emb, streaming, True)
    ref = modules["flow"].inference(*args)
    got = modules["flow_ort"].inference(*args)
    assert got.shape == ref.shape and (got - ref).abs().max() <= MEL_BOUND


def test_int8_dit_mel_within_its_bound(modules: dict, flow_inputs: tuple) -> None:
    """The fast CPU path's DiT (int8 per-frame matmuls) against fp32, whole and incremental."""
    tok, ptok, pfeat, emb = flow_inputs
    ref = modules["flow"].inference(tok, 80, ptok, 20, pfeat, 40, emb, False, True)
    got = modules["flow_int8"].inference(tok, 80, ptok, 20, pfeat, 40, emb, False, True)
    assert (got - ref).abs().max() <= INT8_MEL_MAX
    assert ((got - ref).pow(2).mean() / ref.pow(2).mean()).sqrt() <= INT8_MEL_REL_RMS
    assert (got - ref).abs().max() > MEL_BOUND  # it is really quantised, not the fp32 graph
    mel, _ = _stream(modules["flow"], modules["hift"], flow_inputs)
    mel_int8, _ = _stream(modules["flow_int8"], modules["hift"], flow_inputs)
    assert mel_int8.shape == mel.shape and (mel_int8 - mel).abs().max() <= INT8_MEL_MAX


def test_the_int8_graph_keeps_the_stream_cache_in_float16_and_the_fp32_graph_in_float32(modules: dict) -> None:
    """Half the fast path's cache memory (3.6 MB per mel frame at 10 steps in float32); the exact path unchanged."""
    g = torch.Generator().manual_seed(5)
    for name, dtype in (("flow_int8", torch.float16), ("flow_ort", torch.float32), ("flow", torch.float32)):
        flow = modules[name]
        dit = flow.decoder.estimator
        chunk = dit.chunk_size
        x, mu, cond = (torch.randn(2, 80, chunk, generator=g) for _ in range(3))
        _, cache = dit.forward_cached(x, mu, torch.tensor([0.3, 0.3]), torch.randn(2, 80, generator=g), cond, None,
                                      chunk)
        assert {t.dtype for kv in cache.kv for t in kv} == {dtype}, name
        assert FlowStream.bytes_per_frame(flow) == FlowStream.bytes_per_frame(modules["flow"]) * dtype.itemsize // 4


def _stream(flow: object, hift: object, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    tok, ptok, pfeat, emb = inputs
    flow_stream, hift_stream = FlowStream(flow, ptok, pfeat, emb), HiFTStream(hift)
    mels, wavs = [], []
    for lo, hi in ((0, 30), (30, 55), (55, 80)):
        mel = flow_stream.inference(tok[:, lo:hi], finalize=hi == 80)
        mels.append(mel)
        wavs.append(hift_stream.inference(mel, finalize=hi == 80))
    return torch.cat(mels, dim=2), torch.cat(wavs, dim=1)


def test_only_a_streams_chunk_calls_keep_onnxruntimes_arena(modules: dict, flow_inputs: tuple) -> None:
    """A stream's chunk calls leave onnxruntime's CPU arena to the next one (faulting it in afresh cost the int8
    DiT's chunk steps 5 %); a call without a past (a whole utterance's, this stream's first) hands it back."""
    flow = modules["flow_int8"]
    runner, seen = flow.decoder.estimator.runner, []
    graph = runner.cached

    class Recording:
        def run(self, inputs: dict, outputs: dict, bounded: bool = False) -> None:
            seen.append((inputs["mask"].shape[1] > inputs["x"].shape[2], bounded))
            graph.run(inputs, outputs, bounded)

    tok, ptok, pfeat, emb = flow_inputs
    hop = flow.decoder.estimator.chunk_size // flow.cfg.token_mel_ratio
    runner.cached = Recording()
    try:
        stream = FlowStream(flow, ptok, pfeat, emb)
        for lo in range(0, tok.shape[1], hop):
            stream.inference(tok[:, lo:lo + hop], finalize=lo + hop >= tok.shape[1])
    finally:
        runner.cached = graph
    assert {past for past, _ in seen} == {False, True}  # the first call and the last (the reference's, whole)
    assert all(bounded == past for past, bounded in seen)


def test_incremental_streams_work_on_onnxruntime(modules: dict, flow_inputs: tuple) -> None:
    """FlowStream (cached DiT graph with per-chunk K/V) and HiFTStream (bounded window) on onnxruntime."""
    mel, wav = _stream(modules["flow"], modules["hift"], flow_inputs)
    mel_ort, wav_ort = _stream(modules["flow_ort"], modules["hift_ort"], flow_inputs)
    assert mel_ort.shape == mel.shape and (mel_ort - mel).abs().max() <= MEL_BOUND
    # the vocoder on the same mel: torch's stream against onnxruntime's stream and whole-mel call
    _, wav_same_mel = _stream(modules["flow"], modules["hift_ort"], flow_inputs)
    assert wav_same_mel.shape == wav.shape and (wav_same_mel - wav).abs().max() <= VOCODER_BOUND
    whole, _ = modules["hift_ort"].inference(mel)
    assert (whole - wav_same_mel).abs().max() <= VOCODER_BOUND
    assert wav_ort.shape == wav.shape and _snr_db(wav, wav_ort) >= MIN_SNR_DB


def _snr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    return 10 * torch.log10(ref.pow(2).sum() / (got - ref).pow(2).sum().clamp(min=1e-20)).item()


@pytest.fixture(scope="module")
def tts_ort(tiny_bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from cosyvoice.cli.cosyvoice import CosyVoice3

    return CosyVoice3(tiny_bundle_dir, device="cpu", voice_dir=tmp_path_factory.mktemp("voices"),
                      backend="onnxruntime")


def _speech(outputs: list[dict]) -> torch.Tensor:
    return torch.cat([o["tts_speech"] for o in outputs], dim=1)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mode", ["zero_shot", "cross_lingual", "instruct2"])
def test_synthesis_on_onnxruntime_matches_torch(tts, tts_ort, prompt_wav: Path, mode: str, stream: bool) -> None:
    assert tts_ort.engine.flow.decoder.estimator.runner is not None and tts_ort.engine.hift.runner is not None
    assert tts.engine.flow.decoder.estimator.runner is None  # the shared fixture runs torch (COSYVOICE_BACKEND)

    def run(model) -> torch.Tensor:
        if mode == "zero_shot":
            return _speech(list(model.inference_zero_shot(TEXT, PROMPT_TEXT, str(prompt_wav), stream=stream, seed=3)))
        if mode == "cross_lingual":
            return _speech(list(model.inference_cross_lingual(cross_lingual_text(TEXT), str(prompt_wav),
                                                              stream=stream, seed=3)))
        return _speech(list(model.inference_instruct2(TEXT, instruct_text("Speak slowly and calmly."),
                                                      str(prompt_wav), stream=stream, seed=3)))

    ref, got = run(tts), run(tts_ort)
    assert got.shape == ref.shape and ref.shape[1] > 0
    assert torch.isfinite(got).all() and got.abs().max() <= 1.0
    assert _snr_db(ref, got) >= MIN_SNR_DB, _snr_db(ref, got)


@pytest.mark.skipif(trt.available() is not None, reason=f"TensorRT cannot run here: {trt.available()}")
def test_tensorrt_fp32_matches_torch(tiny_bundle_dir: Path, flow_inputs: tuple) -> None:
    bundle = validate_model_dir(tiny_bundle_dir)
    flow, flow_trt = bundle.load_flow("cuda"), attach_flow(bundle.load_flow("cuda"), bundle.root, "tensorrt", "cuda")
    hift, hift_trt = bundle.load_hift("cuda"), attach_hift(bundle.load_hift("cuda"), bundle.root, "tensorrt", "cuda")
    inputs = tuple(x.cuda() for x in flow_inputs)
    mel, wav = _stream(flow, hift, inputs)
    mel_trt, wav_trt = _stream(flow_trt, hift_trt, inputs)
    assert (mel_trt - mel).abs().max() <= 1e-3 and wav_trt.device.type == "cpu" and wav_trt.is_pinned()
    assert _snr_db(wav.cpu(), wav_trt) >= MIN_SNR_DB


def test_tensorrt_profiles_cover_the_streaming_shapes() -> None:
    """The optimization profiles (pure shapes: no GPU needed) span what FlowStream and HiFTStream feed."""
    dims = {"mel": 80, "mu": 80, "spk": 80, "dim": 64, "heads": 4, "dim_head": 16, "depth": 2, "context": 30,
            "mels": 80, "scale": 480, "look_ahead": 4}
    for graph in ("flow_estimator", "flow_estimator_cached", "vocoder"):
        for name, (lo, opt, hi) in trt.profiles(graph, dims).items():
            assert all(a <= b <= c for a, b, c in zip(lo, opt, hi, strict=True)), (graph, name)
    cached = trt.profiles("flow_estimator_cached", dims)
    assert set(cached) == {"x", "mu", "mod_blocks", "mod_final", "spks", "cond", "mask", "tail1", "tail2",
                           "cache_k_0", "cache_v_0", "cache_k_1", "cache_v_1"}
    assert cached["cache_k_0"][0][2] == 0  # an utterance's first chunk has no past keys
    for (n, keys), x, buffer in zip(cached["mask"], cached["x"], cached["cache_k_0"], strict=True):
        assert n == x[2] and keys - n <= buffer[2] <= GROWTH * keys  # the past, and room up to the growth factor
    vocoder = trt.profiles("vocoder", dims)
    assert vocoder["mel"][0][2] == 5 and vocoder["source"][0][2] == 480  # one frame, finalised


def test_the_cached_graph_appends_into_the_streams_buffer(modules: dict) -> None:
    """The cached graph returns the new frames' keys/values only and reads the past where the stream keeps it: they
    are appended into the buffer's room in place (the same storage), and a full buffer grows (GROWTH, ROOM_FRAMES);
    velocities and keys/values equal torch's on every call."""
    dit, ref = modules["flow_ort"].decoder.estimator, modules["flow"].decoder.estimator
    chunk = dit.chunk_size
    g = torch.Generator().manual_seed(3)
    x, mu, cond = (torch.randn(2, 80, 2 * chunk, generator=g) for _ in range(3))
    t, spks = torch.tensor([0.4, 0.4]), torch.randn(2, 80, generator=g)

    def both(lo: int, hi: int, past: tuple, keep: int) -> tuple:
        got = [d.forward_cached(x[..., lo:hi], mu[..., lo:hi], t, spks, cond[..., lo:hi], p, keep)
               for d, p in ((dit, past[0]), (ref, past[1]))]
        assert (got[0][0] - got[1][0]).abs().max() <= MEL_BOUND
        for (k, v), (k_ref, v_ref) in zip(got[0][1].kv, got[1][1].kv, strict=True):
            assert k.shape == k_ref.shape and max((k - k_ref).abs().max(), (v - v_ref).abs().max()) <= MEL_BOUND
        return got[0][1], got[1][1]

    def capacity(cache: object) -> int:
        k = cache.kv[0][0]
        return k.stride(1) // k.shape[3]

    first = both(0, chunk, (None, None), chunk)
    assert capacity(first[0]) == chunk  # the start: the graph's outputs themselves, no room
    partial = both(chunk, chunk + chunk // 2, first, 0)  # no room: a new buffer with room to grow
    buffer = partial[0].kv[0][0]
    frames = chunk + chunk // 2
    assert capacity(partial[0]) == max(int(frames * GROWTH), frames + ROOM_FRAMES) and partial[0].length == chunk
    second = both(chunk, 2 * chunk, partial, chunk)  # fits the room: written in place
    assert second[0].kv[0][0].data_ptr() == buffer.data_ptr() and capacity(second[0]) == capacity(partial[0])


def test_an_old_cached_graph_is_exported_again_or_refused(tiny_bundle_dir: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A format-1 export (past keys/values in, past + new out) is never run by this runner: its manifest's format
    has it exported again, and such a file met anyway is refused by name, saying what to do."""
    import json

    import onnx
    from onnx import TensorProto, helper

    from cosyvoice.backends import _graph, ensure_onnx
    from cosyvoice.backends import export as ex
    from cosyvoice.errors import ModelBundleError

    names = ["x", "mu", "t", "spks", "cond", "mask", "tail1", "tail2", "past_k_0", "past_v_0"]
    outputs = ["velocity", "conv_in1", "conv_in2", "k_0", "v_0"]
    graph = helper.make_graph([helper.make_node("Identity", [names[i]], [o]) for i, o in enumerate(outputs)], "old",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs])
    (tmp_path / "onnx").mkdir()
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]),
              tmp_path / "onnx" / ex.graph_file("flow_estimator_cached"))
    with pytest.raises(ModelBundleError, match="an older export's inputs or outputs"):
        _graph("flow_estimator_cached", "onnxruntime", {}, tmp_path, torch.device("cpu"), "fp32", {"depth": 1})
    manifest = json.loads((tiny_bundle_dir / "onnx" / ex.MANIFEST).read_text())
    stale = tmp_path / "bundle"
    stale.mkdir()
    (stale / "onnx").mkdir()
    for name in [*ex.SOURCES, *(f"onnx/{g}" for g in manifest["graphs"])]:
        (stale / name).symlink_to(tiny_bundle_dir / name)
    exported = []
    monkeypatch.setattr(ex, "export_onnx", lambda root, *a, **k: exported.append(root) or {})
    for fmt in (ex.FORMAT, 1):  # this format's export is reused; format 1's is redone
        (stale / "onnx" / ex.MANIFEST).write_text(json.dumps({**manifest, "format": fmt}))
        ensure_onnx(stale)
    assert exported == [stale]
