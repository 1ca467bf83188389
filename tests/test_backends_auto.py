"""The DiT's and the LLM's onnxruntime paths as auto's candidates, and auto's kept measurements.

Bounds on the tiny bundle (random weights), against torch fp32 on the same inputs:
- onnxruntime fp32 (the exact fast path): mel within 1e-6 relative RMS and 1e-4 max (float rounding of another
  kernel order; measured ~1e-7 / ~2e-6);
- onnxruntime int8 with 8-bit weights (u8 x u8 without VNNI, u8 x s8 with it): mel <= 1% relative RMS and
  <= 0.05 max, whole, chunk-masked and streamed (precision.BOUNDS; the numbers are asserted below).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import onnx
import pytest
import torch

from cosyvoice.backends import ensure_onnx, flow_runner
from cosyvoice.backends import precision as fast
from cosyvoice.backends.auto_store import AutoStore, machine_key
from cosyvoice.backends.export import graph_file
from cosyvoice.backends.quant import int8_weights, quantize_dit
from cosyvoice.bundle import validate_model_dir
from cosyvoice.flow import FlowStream

EXACT_REL_RMS, EXACT_MAX = 1e-6, 1e-4


@pytest.fixture(scope="module")
def flow_inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, 6561, (1, 80), generator=g), torch.randint(0, 6561, (1, 20), generator=g),
            torch.randn(1, 40, 80, generator=g), torch.randn(1, 192, generator=g))


def _errors(ref: torch.nn.Module, got: torch.nn.Module, inputs: tuple) -> dict[str, dict[str, float]]:
    tok, ptok, pfeat, emb = inputs
    out = {}
    with torch.inference_mode():
        for name, streaming in (("whole", False), ("chunk_masked", True)):
            args = (tok, 80, ptok, 20, pfeat, 40, emb, streaming, True)
            out[name] = fast.mel_error(ref.inference(*args), got.inference(*args))
        mels = []
        for model in (ref, got):
            stream = FlowStream(model, ptok, pfeat, emb)
            mels.append(torch.cat([stream.inference(tok[:, :30], False), stream.inference(tok[:, 30:55], False),
                                   stream.inference(tok[:, 55:], True)], 2))
        out["streamed"] = fast.mel_error(*mels)
    return out


@pytest.fixture(scope="module")
def flows(tiny_bundle_dir: Path) -> dict[str, torch.nn.Module]:
    bundle = validate_model_dir(tiny_bundle_dir)
    ref = bundle.load_flow()
    out = {"fp32": ref}
    for kind in fast.ORT_FLOW:
        out[kind] = fast.apply_flow(bundle.load_flow(), kind, bundle.root)
    return out


def test_onnxruntime_fp32_is_the_exact_fast_path(flows: dict, flow_inputs: tuple) -> None:
    for name, err in _errors(flows["fp32"], flows["onnxruntime"], flow_inputs).items():
        assert err["mel_rel_rms"] <= EXACT_REL_RMS and err["mel_max_abs"] <= EXACT_MAX, (name, err)


def test_onnxruntime_int8_holds_the_mel_bound(flows: dict, flow_inputs: tuple) -> None:
    errors = _errors(flows["fp32"], flows["onnxruntime-int8"], flow_inputs)
    for name, err in errors.items():
        assert fast.holds(err), (name, err)
        assert err["mel_rel_rms"] <= 0.01 and err["mel_max_abs"] <= 0.05, (name, err)
    assert max(e["mel_max_abs"] for e in errors.values()) > EXACT_MAX  # really quantised


def _weight_types(path: Path) -> set[int]:
    model = onnx.load(str(path))
    names = {i for n in model.graph.node if n.op_type in ("MatMulInteger", "DynamicQuantizeMatMul")
             for i in n.input[1:2]}
    return {t.data_type for t in model.graph.initializer if t.name in names}


@pytest.mark.parametrize(("features", "weights"), [(frozenset({"avx2"}), "u8"),
                                                   (frozenset({"avx2", "avx_vnni"}), "s8"),
                                                   (frozenset({"avx512f", "avx512_vnni"}), "s8")])
def test_int8_weights_follow_the_cpu(tiny_bundle_dir: Path, tmp_path: Path, features: frozenset[str],
                                     weights: str) -> None:
    """Without VNNI, 8-bit u8 weights (u8 x u8 kernels); with it, s8; both full range (no 7-bit reduce_range)."""
    assert int8_weights(features) == weights
    ensure_onnx(tiny_bundle_dir)
    src = tiny_bundle_dir / "onnx" / graph_file("flow_estimator_cached")
    assert quantize_dit(src, tmp_path / "q.onnx", weights) == weights
    expected = onnx.TensorProto.UINT8 if weights == "u8" else onnx.TensorProto.INT8
    assert _weight_types(tmp_path / "q.onnx") == {expected}


def test_an_int8_graph_for_another_cpu_is_exported_again(tiny_bundle_dir: Path, monkeypatch) -> None:
    manifest = ensure_onnx(tiny_bundle_dir, "int8")
    name = graph_file("flow_estimator_cached", "int8")
    mine = manifest["graphs"][name]["int8_weights"]
    assert mine == int8_weights(fast.cpu_features())
    assert ensure_onnx(tiny_bundle_dir, "int8")["graphs"][name]["sha256"] == manifest["graphs"][name]["sha256"]
    other = frozenset({"avx2"}) if mine == "s8" else frozenset({"avx2", "avx512_vnni"})
    monkeypatch.setattr("cosyvoice.backends.cpu.cpu_features", lambda *a: other)
    again = ensure_onnx(tiny_bundle_dir, "int8")
    assert again["graphs"][name]["int8_weights"] == int8_weights(other) != mine
    monkeypatch.undo()
    assert ensure_onnx(tiny_bundle_dir, "int8")["graphs"][name]["int8_weights"] == mine


class Neighbours:
    """Stands in for :class:`~cosyvoice.system.cpu_load.OtherWork` where a test decides how busy the machine was
    while auto measured (the suite's own workers keep the cores busy: what is measured would be the suite)."""

    def __init__(self, share: float | None) -> None:
        self._share = share

    def __call__(self) -> Neighbours:
        return self

    def share(self) -> float | None:
        return self._share


def test_auto_measures_the_onnxruntime_paths_and_keeps_its_choice(llm_graph_bundle_dir: Path, tmp_path: Path,
                                                                  monkeypatch) -> None:
    monkeypatch.setattr(fast, "OtherWork", Neighbours(0.0))
    bundle = validate_model_dir(llm_graph_bundle_dir)
    features = fast.cpu_features()
    store = AutoStore(tmp_path / "auto.json")
    digest = {"value": "model-a"}

    def plan(feats: frozenset[str] = features) -> fast.PrecisionPlan:
        made, llm, flow = fast.plan_and_apply("auto", bundle.load_llm, bundle.load_flow, feats, bundle.root, store,
                                              lambda: digest["value"])
        assert (flow.decoder.estimator.runner is not None) == (made.flow in fast.ORT_FLOW)
        assert (llm.llm.runner is not None) == (made.llm in fast.ORT_LLM)
        return made

    first = plan()
    assert not first.kept and first.measured_at
    assert {f"flow_{k}" for k in fast.ORT_FLOW} <= set(first.checks)
    assert first.checks["flow_onnxruntime"]["mel_rel_rms"] <= EXACT_REL_RMS
    assert fast.holds(first.checks["flow_onnxruntime-int8"])
    assert first.flow == fast.fastest("flow", fast.flow_candidates(features, bundle.root), first.checks)
    assert {f"llm_{k}" for k in fast.ORT_LLM} <= set(first.checks)
    assert first.checks["llm_onnxruntime"]["llm_kl_mean"] <= 1e-6 and fast.holds(first.checks["llm_onnxruntime-int8"])
    assert first.llm == fast.fastest("llm", fast.llm_candidates(features, bundle.root), first.checks)
    assert "*" in first.summary and "measured" in first.summary

    def no_measuring(*args: object, **kwargs: object) -> None:
        raise AssertionError("a kept measurement was measured again")

    monkeypatch.setattr(fast, "check_llm", no_measuring)
    monkeypatch.setattr(fast, "check_flow", no_measuring)
    kept = plan()  # a restart on the same CPU and model: applied, not measured
    assert kept.kept and (kept.llm, kept.flow, kept.checks, kept.measured_at) == (
        first.llm, first.flow, first.checks, first.measured_at)
    assert "kept from" in kept.summary
    monkeypatch.undo()
    digest["value"] = "model-b"  # another model: measured afresh
    assert not plan().kept
    other_cpu = features ^ {"avx512_vnni"}  # another CPU: measured afresh
    assert not plan(frozenset(other_cpu)).kept
    data = json.loads((tmp_path / "auto.json").read_text())
    assert {r["key"]["model"] for r in data.values()} == {"model-a", "model-b"}
    assert machine_key(features, "model-a") in [r["key"] for r in data.values()]


def test_a_choice_measured_beside_other_work_is_measured_again_at_the_next_start(tiny_bundle_dir: Path,
                                                                                  tmp_path: Path, monkeypatch) -> None:
    """A neighbour that starts or stops between two candidates ranks them by itself: such a choice runs, says so
    on the page and in /ready, and the next start measures again; a quiet measurement is then kept for good."""
    bundle = validate_model_dir(tiny_bundle_dir)
    store = AutoStore(tmp_path / "auto.json")
    features = fast.cpu_features()

    def plan(others: float | None) -> fast.PrecisionPlan:
        monkeypatch.setattr(fast, "OtherWork", Neighbours(others))
        return fast.plan_and_apply("auto", bundle.load_llm, bundle.load_flow, features, None, store, lambda: "m")[0]

    busy = plan(0.6)
    assert busy.busy and not busy.kept and busy.describe()["others"] == 0.6
    assert "beside other work on 60% of the cores: measured again at the next start" in busy.summary
    again = plan(0.05)
    assert not again.kept and not again.busy and again.measured_at >= busy.measured_at
    kept = plan(0.9)  # a quiet measurement is kept, whatever the machine does at later starts
    assert kept.kept and kept.others == 0.05 and not kept.busy and "beside" not in kept.summary
    assert plan(None).kept  # unknown (no /proc/stat) counts as quiet


def test_a_new_graph_format_is_measured_afresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """auto's kept choice was timed on the graphs of one export format and the torch paths of one version: another
    (the cached DiT graph's format 2 stopped copying the cache per call, the torch bf16 DiT's 2 caches bf16) is
    another key, as is a record kept before the key named formats."""
    from cosyvoice.backends import export, llm_step

    store = AutoStore(tmp_path / "auto.json")
    key = machine_key(frozenset({"avx2"}), "m")
    assert key["graphs"] == {"dit": export.FORMAT, "llm_step": llm_step.FORMAT, "torch": fast.TORCH_FORMAT}
    store.put(key, "int8", "onnxruntime-int8", {"flow_fp32": {"seconds": 1.0}})
    assert store.get(machine_key(frozenset({"avx2"}), "m"))["flow"] == "onnxruntime-int8"
    for module, name in ((export, "FORMAT"), (llm_step, "FORMAT"), (fast, "TORCH_FORMAT")):
        monkeypatch.setattr(module, name, getattr(module, name) + 1)
        assert store.get(machine_key(frozenset({"avx2"}), "m")) is None
        monkeypatch.undo()
    before = {k: v for k, v in key.items() if k != "graphs"}  # a store written before formats were in the key
    store.put(before, "int8", "onnxruntime-int8", {"flow_fp32": {"seconds": 1.0}})
    assert store.get(before) is not None and store.get(key)["key"] == key


def test_candidates_are_timed_on_the_threads_the_engine_gives_their_stage(tmp_path: Path) -> None:
    """torch's candidates were timed on every core while onnxruntime's ran on the stage's threads (the engine's
    layout): the check then measured the layout, not the kernels. Now both run as the engine will, and a record
    timed before that is not kept (the threads are in the key)."""
    before = torch.get_num_threads()
    try:
        for cores, layout in ((2, [1, 2]), (3, [1, 3]), (4, [2, 4])):
            torch.set_num_threads(cores)
            seen = [fast._timed(torch.get_num_threads, stage)[0] for stage in (0, 1)]
            assert seen == layout and torch.get_num_threads() == cores  # restored after each timing
            assert machine_key(frozenset({"avx2"}), "m")["stage_threads"] == layout
    finally:
        torch.set_num_threads(before)
    store = AutoStore(tmp_path / "auto.json")
    old = {k: v for k, v in machine_key(frozenset({"avx2"}), "m").items() if k != "stage_threads"}
    store.put(old, "int8", "bf16", {"flow_fp32": {"seconds": 1.0}})
    assert store.get(machine_key(frozenset({"avx2"}), "m")) is None


def test_an_unwritable_store_never_stops_a_start(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    store = AutoStore(blocker / "auto.json")  # its folder is a file: it cannot be written
    key = machine_key(frozenset({"avx2"}), "m")
    assert store.put(key, "int8", "fp32", {"llm_fp32": {"seconds": 1.0}})
    assert store.get(key) is None
    (tmp_path / "bad.json").write_text("{not json")
    assert AutoStore(tmp_path / "bad.json").get(key) is None


def test_onnxruntime_candidates_do_not_touch_the_fp32_flow(tiny_bundle_dir: Path) -> None:
    """A rejected onnxruntime candidate leaves the torch DiT whole (its shadow shares the weights)."""
    flow = validate_model_dir(tiny_bundle_dir).load_flow()
    before = copy.deepcopy(flow.state_dict())
    shadow = fast.shadow(flow)
    shadow.decoder.estimator.runner = flow_runner(shadow, tiny_bundle_dir, "onnxruntime", "cpu")
    assert all(torch.equal(v, flow.state_dict()[k]) for k, v in before.items())
