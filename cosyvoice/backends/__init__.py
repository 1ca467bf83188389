"""Accelerated backends for the flow estimator (the DiT), the vocoder and, on a CPU, the LLM's stack: torch,
onnxruntime, tensorrt.

``backend`` is chosen once per engine (constructor keyword, ``--backend`` flags, ``COSYVOICE_BACKEND``):

- ``torch``: the modules themselves.
- ``onnxruntime``: the graphs of :mod:`cosyvoice.backends.graphs` in onnxruntime, on the CPU or with the
  CUDA execution provider (``onnxruntime-gpu``) on a CUDA device; on the CPU the LLM's Qwen2 stack too, as its
  float32 step graph (:func:`attach_llm`).
- ``onnxruntime-int8``: the same with the DiT's per-frame matmuls int8 dynamic-quantised
  (:mod:`cosyvoice.backends.quant`); CPU only (the LLM's step graph stays float32).
- ``tensorrt``: TensorRT engines built from the same ONNX (:mod:`cosyvoice.backends.trt`); CUDA only.
- ``auto`` (the default): torch, on a CPU too. The fast CPU path (``onnxruntime-int8``: ~2x on two cores,
  docs/perf.md) changes the audio beyond the golden tolerances (its int8 bound is stated there) and exports
  its graphs into the model folder on first use (minutes at the released size), so it is opt-in until it is
  judged on the real checkpoint; TensorRT stays opt-in until measured on a GPU. A backend asked for by name
  that cannot run here is an error. (``COSYVOICE_PRECISION=auto`` measures the DiT's onnxruntime graphs beside
  its torch paths and may run it on one of them: :mod:`cosyvoice.backends.precision`.)

Attaching a backend sets ``DiT.runner`` / ``CausalHiFTGenerator.runner``; everything around them (the
ODE solver, CFG, F0 and the sine source, :class:`FlowStream` and :class:`HiFTStream` state) stays in torch.
The ONNX files live in ``MODEL_DIR/onnx`` and are exported there on first use, or again when the
checkpoints they came from change (``manifest.json`` holds their hashes).
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import TypeVar

import torch

from cosyvoice.errors import ConfigError
from cosyvoice.weights import give_back

logger = logging.getLogger(__name__)

BACKENDS = ("torch", "onnxruntime", "onnxruntime-int8", "tensorrt")
CHOICES = ("auto", *BACKENDS)
FlowT = TypeVar("FlowT", bound=torch.nn.Module)
HiftT = TypeVar("HiftT", bound=torch.nn.Module)
LlmT = TypeVar("LlmT", bound=torch.nn.Module)


def resolve_backend(requested: str | None, device: torch.device | str) -> str:
    """The backend to run: ``requested`` (None: ``COSYVOICE_BACKEND``, else ``auto``) checked against this machine."""
    from cosyvoice.settings import backend_from_env

    name = requested or backend_from_env()
    if name not in CHOICES:
        raise ConfigError(f"backend must be one of {', '.join(CHOICES)}, got {name!r}")
    device = torch.device(device)
    if name == "auto":  # parity with the reference first: see the module docstring
        return "torch"
    problem = unavailable(name, device)
    if problem:
        raise ConfigError(f"backend {name!r} cannot run here: {problem}")
    return name


def unavailable(name: str, device: torch.device) -> str | None:
    """None when backend ``name`` can run on ``device``, else why not."""
    if name == "torch":
        return None
    if name.startswith("onnxruntime"):
        if importlib.util.find_spec("onnxruntime") is None:
            return "the onnxruntime package is not installed"
        if name == "onnxruntime-int8" and device.type != "cpu":
            return "the int8 graphs are for the CPU; use onnxruntime or tensorrt on CUDA"
        from cosyvoice.backends.ort import cuda_provider_available

        if device.type == "cuda" and not cuda_provider_available():
            return "onnxruntime has no CUDA execution provider (install onnxruntime-gpu: `pip install .[gpu]`)"
        return None
    if device.type != "cuda":
        return f"TensorRT needs a CUDA device, the engine runs on {device}"
    from cosyvoice.backends import trt

    return trt.available()


def ensure_onnx(model_root: Path, precision: str = "fp32") -> dict[str, object]:
    """The manifest of ``model_root/onnx`` with the DiT graphs in ``precision``, exporting first when they are
    missing or stale (the precisions exported before are kept)."""
    from cosyvoice.backends import export as ex
    from cosyvoice.backends.cpu import cpu_features
    from cosyvoice.backends.quant import int8_weights

    out = model_root / "onnx"
    manifest_path = out / ex.MANIFEST
    have: set[str] = set()
    weights = int8_weights(cpu_features())
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        graphs = manifest.get("graphs", {})
        if (manifest.get("format") == ex.FORMAT and all((out / name).is_file() for name in graphs)
                and ex.sources_match(model_root, manifest)):
            # an int8 graph quantised for another CPU's kernels (u8 or s8 weights) is redone for this one
            have = {g["precision"] for g in graphs.values()
                    if g["precision"] != "int8" or g.get("int8_weights") == weights}
            if precision in have:
                return manifest
    want = have | {precision}
    logger.info("exporting the flow estimator and vocoder to ONNX (%s) in %s (first use of this bundle)",
                ", ".join(sorted(want)), out)
    return ex.export_onnx(model_root, out, fp16="fp16" in want, int8="int8" in want, int8_weights=weights)


def _graph(name: str, backend: str, manifest: dict[str, object], root: Path, device: torch.device,
           precision: str, dims: dict[str, int]) -> object:
    from cosyvoice.backends.export import graph_file

    path = root / "onnx" / graph_file(name, precision)
    if backend.startswith("onnxruntime"):
        from cosyvoice.backends.ort import OrtGraph, cpu_stage_threads

        # the DiT and the vocoder run in the engine's token-to-wave stage
        graph = OrtGraph(path, device, cpu_stage_threads(1) if device.type == "cpu" else None)
        if name == "flow_estimator_cached":
            from cosyvoice.backends.graphs import check_cached_io

            check_cached_io(str(path), [i.name for i in graph.session.get_inputs()],
                            [o.name for o in graph.session.get_outputs()], dims["depth"])
        return graph
    from cosyvoice.backends import trt

    sha = manifest["graphs"][path.name]["sha256"]  # type: ignore[index]
    return trt.TrtGraph(path, sha, trt.profiles(name, dims), precision == "fp16", device)


def _dims(flow: torch.nn.Module | None, hift: torch.nn.Module | None) -> dict[str, int]:
    dims: dict[str, int] = {}
    if flow is not None:
        dit = flow.decoder.estimator
        attn = dit.transformer_blocks[0].attn
        cfg = flow.cfg.dit
        dims.update(mel=cfg.mel_dim, mu=cfg.mu_dim, spk=cfg.spk_dim, dim=cfg.dim, heads=attn.heads,
                    dim_head=attn.dim_head, depth=len(dit.transformer_blocks),
                    context=dit.input_embed.conv_pos_embed.context)
    if hift is not None:
        dims.update(mels=hift.cfg.in_channels, scale=hift.upsample_scale, look_ahead=hift.conv_pre.look_ahead)
    return dims


def flow_runner(flow: torch.nn.Module, model_root: Path, backend: str, device: torch.device | str) -> object:
    """The :class:`~cosyvoice.backends.runners.GraphEstimator` that runs ``flow``'s DiT on ``backend`` (a resolved
    name other than torch); fp16 graphs when the flow is half precision on CUDA. The module is left as it is."""
    from cosyvoice.backends.runners import GraphEstimator

    device = torch.device(device)
    dit = flow.decoder.estimator
    if backend == "onnxruntime-int8":
        precision = "int8"
    else:
        precision = "fp16" if device.type == "cuda" and dit.proj_out.weight.dtype != torch.float32 else "fp32"
    manifest = ensure_onnx(model_root, precision)
    dims = _dims(flow, None)
    cached = _graph("flow_estimator_cached", backend, manifest, model_root, device, precision, dims)
    # the plain graph saves returning keys/values on a GPU; on the CPU one copy of the weights is worth more
    plain = _graph("flow_estimator", backend, manifest, model_root, device, precision, dims) \
        if device.type == "cuda" else None
    return GraphEstimator(plain, cached, dit, cache_dtype(manifest, precision))  # type: ignore[arg-type]


def cache_dtype(manifest: dict[str, object], precision: str) -> torch.dtype:
    """The dtype of the keys/values the ``precision`` cached DiT graph takes and returns (float16 for int8)."""
    from cosyvoice.backends.export import graph_file

    entry = manifest["graphs"][graph_file("flow_estimator_cached", precision)]  # type: ignore[index]
    return getattr(torch, entry.get("cache_dtype", "float32"))


def release_blocks(flow: torch.nn.Module) -> None:
    """Free the DiT blocks' weights once a runner replaces every use of them (FlowStream reads only shapes and
    dtypes of the rest); their AdaLN linears stay: the runner feeds the graphs the modulation they compute."""
    dit = flow.decoder.estimator
    kept = {id(p) for p in dit.modulation_weights()}
    params = [p for p in dit.transformer_blocks.parameters() if id(p) not in kept]
    give_back(params)  # their checkpoint pages, resident where this process exported or measured them
    for param in params:
        param.data = param.data.new_empty(0)


def attach_flow(flow: FlowT, model_root: Path, backend: str, device: torch.device | str) -> FlowT:
    """``flow`` with its DiT run on ``backend`` (a resolved name; :func:`flow_runner`). The bundle loads plain
    torch modules; the backend is attached here, so the bundle knows no backend."""
    if backend == "torch":
        return flow
    flow.decoder.estimator.runner = flow_runner(flow, model_root, backend, device)
    release_blocks(flow)
    return flow


def attach_llm(llm: LlmT, model_root: Path, backend: str, device: torch.device | str) -> LlmT:
    """``llm`` (float32) with its Qwen2 stack run by the float32 step graph (:mod:`cosyvoice.backends.llm_step`) on
    an onnxruntime backend on the CPU, where the graph can run the stack: the same numbers within float rounding
    (hidden states within ~1e-6, the auto check's KL ~1e-8 nats) at 1.1-1.5x torch's fp32 decode (docs/perf.md),
    which is what the exact fp32 path spends most of its LLM time in. The stack's torch weights are freed."""
    if not backend.startswith("onnxruntime") or torch.device(device).type != "cpu":
        return llm
    from cosyvoice.backends.llm_step import attach_step, release_stack, supported

    if supported(llm.llm.cfg):  # type: ignore[union-attr]
        release_stack(attach_step(llm, model_root, "fp32"))
    return llm


def attach_hift(hift: HiftT, model_root: Path, backend: str, device: torch.device | str) -> HiftT:
    """``hift`` with its decoder (mel + excitation -> audio) run on ``backend`` (F0 and the source stay torch);
    it stays float32."""
    if backend == "torch":
        return hift
    from cosyvoice.backends.runners import GraphVocoder

    device = torch.device(device)
    manifest = ensure_onnx(model_root)
    graph = _graph("vocoder", backend, manifest, model_root, device, "fp32", _dims(None, hift))
    hift.runner = GraphVocoder(graph, hift, host_output=backend == "tensorrt")  # type: ignore[arg-type]
    return hift


__all__ = ["BACKENDS", "CHOICES", "attach_flow", "attach_hift", "attach_llm", "cache_dtype", "ensure_onnx",
           "flow_runner", "release_blocks", "resolve_backend", "unavailable"]
