"""Export the flow estimator (DiT) and the vocoder of a model bundle to ONNX, check them, compare with PyTorch.

``export_onnx`` writes into its output folder (default ``MODEL_DIR/onnx``) the three graphs of
:mod:`cosyvoice.backends.graphs` (dynamic batch and time axes, opset 18), runs ``onnx.checker`` on each, runs
onnxruntime on CPU against PyTorch on fixed inputs, and writes ``manifest.json``: opset, versions, the sha256
of every ONNX file and of the checkpoints it came from (the backends re-export when those change), inputs and
outputs with their symbolic shapes, and the parity results. ``fp16`` also writes autocast-fp16 variants of the
two DiT graphs (matmuls in fp16, norms and softmax in fp32, fp32 I/O), the input TensorRT builds as a strongly
typed network; ``int8`` int8 dynamic-quantised variants of them for the CPU (:mod:`cosyvoice.backends.quant`).
The vocoder stays fp32 (half precision audibly moves its phases). The command is ``cosyvoice.bin.export_onnx``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import Tensor, nn

from cosyvoice.backends.graphs import (
    CachedEstimatorGraph,
    EstimatorGraph,
    VocoderGraph,
    cached_io_names,
    modulation_inputs,
)
from cosyvoice.backends.quant import half_cache, quantize_dit
from cosyvoice.bundle import ModelBundle, validate_model_dir
from cosyvoice.errors import ModelBundleError
from cosyvoice.flow.dit import chunk_causal_mask

logger = logging.getLogger(__name__)

OPSET = 18
MANIFEST = "manifest.json"
# bump when the graphs' interface changes: stale exports are then redone (and auto measures again,
# auto_store.machine_key). 2: flow_estimator_cached returns only the new frames' keys/values; 3: its int8 variant
# takes and returns them in float16 (quant.half_cache); 4: the DiT graphs take the time's AdaLN modulation, not t;
# 5: the same interface, redone for speed: the attention's mask as a bias (dit_cache.attend_past), the int8 GELUs fused
FORMAT = 5
# Parity bound of onnxruntime-CPU against PyTorch (fp32): max |diff| <= ATOL + RTOL * max |reference|.
# Both run float32 kernels in a different order (fused attention, folded weight norm, the DFT as a conv):
# the DiT differs by ~1e-6 relative. The vocoder turns a predicted log-magnitude into a magnitude with exp(),
# which amplifies rounding: ~1e-3 of full scale with random tiny weights, hence its own relative bound.
ATOL, RTOL = 1e-4, 1e-4
VOCODER_RTOL = 2e-3
# fp16 or int8 matmuls against fp32 PyTorch: a sanity bound per call (the quality bound is on the mel, docs/perf.md)
LOW_PRECISION_ATOL, LOW_PRECISION_RTOL = 5e-2, 5e-2
PRECISIONS = ("fp32", "fp16", "int8")


def graph_file(name: str, precision: str = "fp32") -> str:
    return f"{name}.{precision}.onnx"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class GraphSpec:
    """One graph to export: the module, fixed example inputs, names and dynamic axes, the PyTorch reference."""

    name: str
    module: nn.Module
    inputs: dict[str, Tensor]
    outputs: list[str]
    dynamic_axes: dict[str, dict[int, str]]
    reference: list[Tensor]
    low_precision_variants: bool
    rtol: float = RTOL


def _estimator_specs(bundle: ModelBundle, generator: torch.Generator) -> list[GraphSpec]:
    flow = bundle.load_flow()
    dit = flow.decoder.estimator
    cfg = bundle.config.flow.dit
    chunk, batch = cfg.static_chunk_size, 2  # the CFG batch: one conditioned row and its unconditional twin
    frames = 2 * chunk + 7  # two whole chunks and a partial one: the chunk mask matters

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=generator)

    x, mu, cond = randn(batch, cfg.mel_dim, frames), randn(batch, cfg.mu_dim, frames), randn(batch, cfg.mel_dim, frames)
    t, spks = torch.tensor([0.3, 0.3]), randn(batch, cfg.spk_dim)
    mask = chunk_causal_mask(frames, chunk)
    with torch.inference_mode():
        time = dit.modulation(t)
        ref_plain = dit.trunk(x, mu, time, spks, cond, mask)[0]
        # the cached graph continues after the first chunk (computed here as the stream does)
        _, first = dit.forward_cached(x[..., :chunk], mu[..., :chunk], t, spks, cond[..., :chunk], None, chunk)
        new = slice(chunk, frames)
        c_mask = chunk_causal_mask(frames, chunk, first_query=chunk)
        c_out, c_convs, c_kv = dit.trunk(x[..., new], mu[..., new], time, spks, cond[..., new], c_mask, first)
    mod = modulation_inputs(time)
    axes = {"x": {0: "batch", 2: "frames"}, "mu": {0: "batch", 2: "frames"}, "cond": {0: "batch", 2: "frames"},
            "mod_blocks": {1: "batch"}, "mod_final": {0: "batch"}, "spks": {0: "batch"}}
    plain = GraphSpec("flow_estimator", EstimatorGraph(dit),
                      {"x": x, "mu": mu, **mod, "spks": spks, "cond": cond, "mask": mask}, ["velocity"],
                      {**axes, "mask": {0: "frames", 1: "frames"}, "velocity": {0: "batch", 2: "frames"}},
                      [ref_plain], True)
    in_names, out_names = cached_io_names(len(dit.transformer_blocks))
    inputs = {"x": x[..., new], "mu": mu[..., new], **mod, "spks": spks, "cond": cond[..., new], "mask": c_mask,
              "tail1": first.conv_tails[0], "tail2": first.conv_tails[1]}
    c_axes = {**axes, "mask": {0: "frames", 1: "keys"}, "tail1": {0: "batch"}, "tail2": {0: "batch"},
              "velocity": {0: "batch", 2: "frames"}, "conv_in1": {0: "batch", 2: "conv_frames"},
              "conv_in2": {0: "batch", 2: "conv_frames"}}
    room = torch.full_like(first.kv[0][0][:, :, :5], float("nan"))
    for i, (k, v) in enumerate(first.kv):  # buffers with room after the past: NaN there, which must never be read
        inputs[f"cache_k_{i}"], inputs[f"cache_v_{i}"] = torch.cat((k, room), dim=2), torch.cat((v, room), dim=2)
        c_axes[f"cache_k_{i}"] = c_axes[f"cache_v_{i}"] = {0: "batch", 2: "capacity"}
        c_axes[f"new_k_{i}"] = c_axes[f"new_v_{i}"] = {0: "batch", 2: "frames"}
    assert list(inputs) == in_names
    reference = [c_out, *c_convs, *(y[:, :, chunk:] for pair in c_kv for y in pair)]
    cached = GraphSpec("flow_estimator_cached", CachedEstimatorGraph(dit), inputs, out_names, c_axes, reference, True)
    return [plain, cached]


def _vocoder_spec(bundle: ModelBundle, generator: torch.Generator) -> GraphSpec:
    hift = bundle.load_hift()
    frames = 23
    mel = torch.randn(1, hift.cfg.in_channels, frames + hift.conv_pre.look_ahead, generator=generator)
    with torch.inference_mode():
        f0 = hift.f0_predictor(mel).float()
        per_sample = torch.nn.functional.interpolate(f0[:, None], scale_factor=hift.upsample_scale).transpose(1, 2)
        # the streaming shape: the excitation also covers conv_pre's look-ahead frames
        source = hift.m_source(per_sample)[0].transpose(1, 2)
        reference = hift.decode_window(mel, source)
    return GraphSpec("vocoder", VocoderGraph(hift), {"mel": mel, "source": source}, ["wav"],
                     {"mel": {0: "batch", 2: "frames"}, "source": {0: "batch", 2: "samples"},
                      "wav": {0: "batch", 1: "wav_samples"}}, [reference], False, VOCODER_RTOL)


def _export(spec: GraphSpec, path: Path, fp16: bool) -> None:
    autocast = torch.autocast("cpu", dtype=torch.float16) if fp16 else torch.autocast("cpu", enabled=False)
    with warnings.catch_warnings(), torch.no_grad(), autocast:
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer warnings
        torch.onnx.export(spec.module.eval(), tuple(spec.inputs.values()), str(path), dynamo=False,
                          input_names=list(spec.inputs), output_names=spec.outputs, opset_version=OPSET,
                          dynamic_axes=spec.dynamic_axes, do_constant_folding=True)


def _half_cache(path: Path, spec: GraphSpec) -> str:
    """Rewrite the int8 cached DiT ``path`` with its keys/values in float16 (:func:`~cosyvoice.backends.quant.
    half_cache`), atomically; the dtype the runner feeds it."""
    model = onnx.load(str(path))
    kv = [n for n in spec.inputs if n.startswith("cache_")], [n for n in spec.outputs if n.startswith("new_")]
    tmp = path.with_suffix(f".tmp{os.getpid()}.onnx")
    onnx.save(half_cache(model, *kv), str(tmp))
    os.replace(tmp, path)
    return "float16"


def _value_info(values: list[onnx.ValueInfoProto]) -> list[dict[str, object]]:
    def dim(d: onnx.TensorShapeProto.Dimension) -> int | str:
        return d.dim_param or d.dim_value

    return [{"name": v.name, "dtype": onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name,
             "shape": [dim(d) for d in v.type.tensor_type.shape.dim]} for v in values]


def _parity(path: Path, spec: GraphSpec, precision: str) -> dict[str, object]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    halves = {i.name for i in session.get_inputs() if i.type == "tensor(float16)"}
    outputs = session.run(None, {k: (v.half() if k in halves else v).numpy() for k, v in spec.inputs.items()})
    atol, rtol = (ATOL, spec.rtol) if precision == "fp32" else (LOW_PRECISION_ATOL, LOW_PRECISION_RTOL)
    worst, worst_name, worst_bound = 0.0, "", 0.0
    for name, got, ref in zip(spec.outputs, outputs, spec.reference, strict=True):
        ref_np = ref.float().numpy()
        if got.shape != ref_np.shape:
            raise ModelBundleError(f"{path.name}: output {name} has shape {got.shape}, PyTorch {ref_np.shape}")
        got = got.astype(np.float32)
        diff = float(np.abs(got - ref_np).max()) if got.size else 0.0
        bound = atol + rtol * float(np.abs(ref_np).max(initial=0.0))
        if not np.isfinite(got).all():
            diff = float("inf")
        if diff / bound >= worst / max(worst_bound, 1e-30) or not worst_name:
            worst, worst_name, worst_bound = diff, name, bound
    return {"worst_output": worst_name, "max_abs_diff": worst, "bound": worst_bound, "ok": worst <= worst_bound,
            "atol": atol, "rtol": rtol}


#: the checkpoints the DiT and vocoder graphs are made from
SOURCES = ("flow.pt", "hift.pt")


def source_hashes(model_root: Path, names: tuple[str, ...] = SOURCES) -> dict[str, dict[str, object]]:
    """sha256 (and size, mtime) of the checkpoints ``names`` the graphs are made from: an export is stale when
    they differ."""
    paths = [model_root / name for name in names]
    return {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns}
            for p in paths}


def sources_match(model_root: Path, manifest: dict[str, object], names: tuple[str, ...] = SOURCES) -> bool:
    """Whether the checkpoints are those the manifest was exported from (hashed only when size or mtime moved)."""
    recorded = manifest.get("sources", {})
    for path in (model_root / name for name in names):
        entry = recorded.get(path.name)  # type: ignore[union-attr]
        if not isinstance(entry, dict) or not path.is_file():
            return False
        stat = path.stat()
        if (stat.st_size, stat.st_mtime_ns) != (entry["bytes"], entry["mtime_ns"]) and \
                sha256_file(path) != entry["sha256"]:
            return False
    return True


def export_onnx(model_dir: str | Path, out_dir: str | Path | None = None, fp16: bool = False, int8: bool = False,
                seed: int = 0, int8_weights: str | None = None) -> dict[str, object]:
    """Export, check and compare every graph; write and return the manifest. Raises if a parity check fails.
    ``int8_weights``: ``u8`` or ``s8`` (None: what this CPU needs, :func:`cosyvoice.backends.quant.int8_weights`)."""
    bundle = validate_model_dir(model_dir)
    out = Path(out_dir) if out_dir is not None else bundle.root / "onnx"
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    specs = [*_estimator_specs(bundle, generator), _vocoder_spec(bundle, generator)]
    graphs: dict[str, object] = {}
    for spec in specs:
        wanted = ["fp32"] + (["fp16"] if fp16 else []) + (["int8"] if int8 else [])
        for precision in wanted if spec.low_precision_variants else ["fp32"]:
            path = out / graph_file(spec.name, precision)
            logger.info("exporting %s", path.name)
            start = time.perf_counter()
            extra: dict[str, object] = {}
            if precision == "int8":
                extra["int8_weights"] = quantize_dit(out / graph_file(spec.name), path, int8_weights)
                if spec.name == "flow_estimator_cached":
                    extra["cache_dtype"] = _half_cache(path, spec)
            else:
                _export(spec, path, precision == "fp16")
            seconds = time.perf_counter() - start
            onnx.checker.check_model(str(path), full_check=False)
            model = onnx.load(str(path), load_external_data=False)
            parity = _parity(path, spec, precision)
            graphs[path.name] = {
                "graph": spec.name, "precision": precision, "sha256": sha256_file(path),
                "bytes": path.stat().st_size, "export_seconds": round(seconds, 2),
                "inputs": _value_info(list(model.graph.input)), "outputs": _value_info(list(model.graph.output)),
                "example_shapes": {k: list(v.shape) for k, v in spec.inputs.items()}, "parity": parity, **extra}
            if not parity["ok"]:
                raise ModelBundleError(f"{path.name}: onnxruntime differs from PyTorch by {parity['max_abs_diff']:.3g} "
                                       f"on {parity['worst_output']} (bound {parity['bound']:.3g})")
    import onnxruntime as ort

    manifest = {"format": FORMAT, "opset": OPSET, "sources": source_hashes(bundle.root),
                "versions": {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": ort.__version__,
                             "python": platform.python_version()},
                "graphs": graphs}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    return manifest


def parity_table(manifest: dict[str, object]) -> str:
    """The onnxruntime-CPU vs PyTorch table (one row per graph) as printed by the command."""
    rows = ["| graph | precision | size MB | worst output | max abs diff | bound (atol + rtol x max ref) | ok |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, g in manifest["graphs"].items():  # type: ignore[union-attr]
        p = g["parity"]
        rows.append(f"| {name} | {g['precision']} | {g['bytes'] / 1e6:.1f} | {p['worst_output']} | "
                    f"{p['max_abs_diff']:.2e} | {p['bound']:.2e} | {'yes' if p['ok'] else 'NO'} |")
    return "\n".join(rows)
