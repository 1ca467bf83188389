"""The LLM's Qwen2 stack as one onnxruntime graph per step (cosyvoice.backends.llm_step), on the tiny bundle with
heads the graph's attention kernel takes (``llm_graph_bundle_dir``).

Bounds against torch fp32 on the same weights:
- the fp32 graph: hidden states within 1e-5 of torch (float rounding of another kernel order; measured ~1e-6)
  on a whole sequence, on a prefill then single steps, and on a batch of rows at different positions, and the
  KV cache it writes equals torch's within the same bound;
- the int8 graph: mean KL per teacher-forced step <= 0.02 nats (precision.BOUNDS, the bound torch's int8 is
  held to), and above zero (the int8 weights really run).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import onnx
import pytest
import torch

from cosyvoice.backends import attach_llm, llm_step
from cosyvoice.backends import precision as fast
from cosyvoice.backends.export import graph_file
from cosyvoice.backends.quant import int8_weights, weight_matmuls
from cosyvoice.bundle import validate_model_dir
from cosyvoice.errors import ModelBundleError
from cosyvoice.llm import CosyVoice3LM

if TYPE_CHECKING:
    from cosyvoice.cli.cosyvoice import CosyVoice3

EXACT = 1e-5


@pytest.fixture(scope="module")
def models(llm_graph_bundle_dir: Path) -> dict[str, CosyVoice3LM]:
    bundle = validate_model_dir(llm_graph_bundle_dir)
    out = {"torch": bundle.load_llm()}
    for kind in fast.ORT_LLM:
        out[kind] = fast.apply_llm(bundle.load_llm(), kind, bundle.root)
    return out


def _sequences(lm: CosyVoice3LM, n: int = 20) -> torch.Tensor:
    return torch.randn(2, n, lm.cfg.llm_input_size, generator=torch.Generator().manual_seed(0))


@torch.inference_mode()
def _stepped(lm: CosyVoice3LM, seq: torch.Tensor, prefill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden states of a prefill, a second one over its past (a text stream's next piece), then single steps,
    the cache written)."""
    cache = lm.llm.new_cache(1, seq.shape[1])
    hidden = [lm.decode_step(seq[:, :prefill], 0, cache)[0], lm.decode_step(seq[:, prefill:prefill + 4], prefill,
                                                                             cache)[0]]
    hidden += [lm.decode_step(seq[:, i:i + 1], i, cache)[0] for i in range(prefill + 4, seq.shape[1])]
    return torch.cat(hidden), cache.k


@torch.inference_mode()
def _batched(lm: CosyVoice3LM, seqs: torch.Tensor) -> torch.Tensor:
    """Two rows prefilled to different lengths (9 and 5), then four batched steps, as the scheduler decodes."""
    cache = lm.llm.new_cache(2, 32)
    for row, n in enumerate((9, 5)):
        lm.llm(seqs[row:row + 1, :n], torch.arange(n)[None], cache.view(row, row + 1, slots=n))
    out = []
    for s in range(4):
        pos = torch.tensor([[9 + s], [5 + s]])
        embeds = torch.stack([seqs[0, 9 + s], seqs[1, 5 + s]])[:, None]
        out.append(lm.llm(embeds, pos, cache.view(0, 2, slots=10 + s)))
    return torch.cat(out)


def test_the_fp32_graph_is_the_torch_stack(models: dict[str, CosyVoice3LM]) -> None:
    ref, got = models["torch"], models["onnxruntime"]
    assert got.llm.runner is not None and ref.llm.runner is None
    assert got.llm.model.model.layers[0].mlp.up_proj.weight.numel() == 0  # the stack's torch weights are freed
    seqs = _sequences(ref)
    with torch.inference_mode():
        whole = (ref.llm(seqs[:1]) - got.llm(seqs[:1])).abs().max()
    (h_ref, k_ref), (h_got, k_got) = _stepped(ref, seqs[:1], 7), _stepped(got, seqs[:1], 7)
    batched = (_batched(ref, seqs) - _batched(got, seqs)).abs().max()
    diffs = {"whole": whole, "stepped": (h_ref - h_got).abs().max(), "cache": (k_ref - k_got).abs().max(),
             "batched": batched}
    for name, diff in diffs.items():
        assert diff <= EXACT, (name, float(diff))


def test_the_int8_graph_holds_the_llm_bound(models: dict[str, CosyVoice3LM]) -> None:
    ref, got = models["torch"], models["onnxruntime-int8"]
    lm_input, forced = fast._synthetic_llm_input(ref)
    kl = fast.llm_kl(ref, got, lm_input, forced)
    assert 0 < kl <= fast.BOUNDS["llm_kl_mean"], kl
    assert fast.llm_kl(ref, models["onnxruntime"], lm_input, forced) < 1e-6


def test_the_int8_graph_quantises_every_weight_matmul_for_this_cpu(models: dict[str, CosyVoice3LM],
                                                                   llm_graph_bundle_dir: Path) -> None:
    """Every stored-weight MatMul of the stack (q/k/v packed, o, gate/up packed, down per layer) is int8, u8 or s8
    as this CPU's kernels need. (``models`` writes the graphs: this test reads them.)"""
    onnx_dir = llm_graph_bundle_dir / "onnx"
    layers = validate_model_dir(llm_graph_bundle_dir).config.llm.qwen.num_hidden_layers
    assert len(weight_matmuls(onnx.load(str(onnx_dir / graph_file(llm_step.NAME))))) == 4 * layers
    model = onnx.load(str(onnx_dir / graph_file(llm_step.NAME, "int8")))
    assert not weight_matmuls(model)
    expected = onnx.TensorProto.INT8 if int8_weights(fast.cpu_features()) == "s8" else onnx.TensorProto.UINT8
    quantised = {n.input[1] for n in model.graph.node if n.op_type in ("MatMulInteger", "DynamicQuantizeMatMul")}
    assert len(quantised) == 4 * layers
    assert {t.data_type for t in model.graph.initializer if t.name in quantised} == {expected}


def test_a_changed_llm_is_exported_again(llm_graph_bundle_dir: Path, tmp_path: Path) -> None:
    root = Path(shutil.copytree(llm_graph_bundle_dir, tmp_path / "bundle", ignore=shutil.ignore_patterns("onnx")))
    path = llm_step.ensure_step(validate_model_dir(root).load_llm().llm, root, "fp32")
    before = path.stat().st_mtime_ns
    assert llm_step.ensure_step(validate_model_dir(root).load_llm().llm, root, "fp32").stat().st_mtime_ns == before
    state = torch.load(root / "llm.pt", map_location="cpu", weights_only=True)
    key = next(k for k in state if k.endswith("mlp.up_proj.weight"))
    state[key] = state[key] + 1
    torch.save(state, root / "llm.pt")
    lm = validate_model_dir(root).load_llm()
    ran = fast.apply_llm(validate_model_dir(root).load_llm(), "onnxruntime", root)
    assert path.stat().st_mtime_ns != before
    with torch.inference_mode():
        seq = _sequences(lm)[:1]
        assert (ran.llm(seq) - lm.llm(seq)).abs().max() <= EXACT  # the graph follows the new weights


def _speak(model: CosyVoice3, prompt_wav: Path, stream: bool) -> torch.Tensor:
    """A short zero-shot utterance of ``model``, seed 3."""
    voice = model.frontend.voice("<|endofprompt|>a prompt", prompt_wav)
    inp = model.frontend.model_input("Some words to speak.", voice)
    return torch.cat([c.pcm for c in model.engine.synthesize(inp, stream=stream, seed=3)])


def test_the_engine_decodes_through_the_graph(llm_graph_bundle_dir: Path, tmp_path: Path,
                                              short_prompt_wav: Path) -> None:
    """The scheduler's prefills and batched steps on the fp32 graph give the torch engine's audio (same seed,
    streamed and whole): the runner reads and writes the scheduler's own KV cache."""
    from cosyvoice.cli.cosyvoice import CosyVoice3

    models = [CosyVoice3(llm_graph_bundle_dir, device="cpu", voice_dir=tmp_path / name, backend="torch",
                         precision="fp32") for name in ("torch", "graphed")]
    try:
        fast.apply_llm(models[1].engine.llm, "onnxruntime", llm_graph_bundle_dir)
        for stream in (True, False):
            pcm = [_speak(model, short_prompt_wav, stream) for model in models]
            assert pcm[0].shape == pcm[1].shape and (pcm[0] - pcm[1]).abs().max() <= 1e-3
    finally:
        for model in models:
            model.engine.close()


def test_a_stack_the_graph_cannot_run_is_left_to_torch(tiny_bundle_dir: Path) -> None:
    """The golden layout's 4-dimensional heads are not the attention kernel's: the graph is refused, auto leaves
    its candidates out, an onnxruntime backend keeps the torch stack."""
    lm = validate_model_dir(tiny_bundle_dir).load_llm()
    assert not llm_step.supported(lm.llm.cfg)
    with pytest.raises(ModelBundleError, match="multiple of 16"):
        llm_step.ensure_step(lm.llm, tiny_bundle_dir, "fp32")
    kind, _, checks = fast.check_llm(lm, tuple(fast.ORT_LLM), tiny_bundle_dir)
    assert kind == "fp32" and set(checks) == {"llm_fp32"}
    assert attach_llm(lm, tiny_bundle_dir, "onnxruntime", "cpu").llm.runner is None  # an onnxruntime backend too


def test_an_onnxruntime_backend_runs_the_stack_in_the_fp32_graph(llm_graph_bundle_dir: Path, tmp_path: Path,
                                                                  short_prompt_wav: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``backend="onnxruntime"`` decodes the LLM in the fp32 step graph, its stack's torch weights freed, and speaks
    as the same backend over the torch stack does (same seed, streamed); the torch backend keeps the stack."""
    import cosyvoice.pipeline
    from cosyvoice.backends.llm_step import GraphBackbone
    from cosyvoice.cli.cosyvoice import CosyVoice3

    root = Path(shutil.copytree(llm_graph_bundle_dir, tmp_path / "bundle", ignore=shutil.ignore_patterns("onnx")))
    graphed = CosyVoice3(root, device="cpu", voice_dir=tmp_path / "graphed", backend="onnxruntime", precision="fp32")
    monkeypatch.setattr(cosyvoice.pipeline, "attach_llm", lambda llm, *_: llm)
    stacked = CosyVoice3(root, device="cpu", voice_dir=tmp_path / "stacked", backend="onnxruntime", precision="fp32")
    torch_backend = CosyVoice3(root, device="cpu", voice_dir=tmp_path / "torch", backend="torch", precision="fp32")
    models = [graphed, stacked, torch_backend]
    try:
        stack = graphed.engine.llm.llm
        assert isinstance(stack.runner, GraphBackbone) and torch_backend.engine.llm.llm.runner is None
        assert Path(stack.runner.graph.session._model_path).name == graph_file(llm_step.NAME, "fp32")
        assert all(p.numel() == 0 for p in stack.model.model.layers.parameters())
        pcm = [_speak(model, short_prompt_wav, stream=True) for model in (graphed, stacked)]
        assert pcm[0].shape == pcm[1].shape and (pcm[0] - pcm[1]).abs().max() <= 1e-3
    finally:
        for model in models:
            model.engine.close()
