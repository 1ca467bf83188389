"""TensorRT engines built from the exported ONNX graphs, cached as plan files.

- Profiles: one min/opt/max optimization profile per graph over its dynamic axes (:func:`profiles`).
- Precision: fp32 builds the fp32 ONNX with TF32 off (float32 matmuls, as the torch path); fp16 builds the
  autocast-fp16 ONNX (``export_onnx --fp16``) as a *strongly typed* network, so TensorRT keeps the types
  the graph has (norms and softmax in fp32). Setting the fp16 builder flag on the fp32 graph instead lets
  TensorRT pick fp16 for every layer, which gives NaN for this DiT (reported upstream, 2026).
- Plan cache: ``<onnx stem>.<key>.plan`` beside the ONNX, the key the sha256 of the ONNX's sha256, the GPU
  name, the TensorRT version, the profile and the precision: a plan is never reused across any of them.
- Execution: inputs and outputs are torch CUDA tensors bound by address (``execute_async_v3`` on the
  current torch stream). :class:`~cosyvoice.backends.runners.GraphVocoder` copies the audio into pinned
  host memory.

Nothing here has run on a GPU yet (this project's machines have none); docs/perf.md lists the GPU steps.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from cosyvoice.errors import ModelBundleError
from cosyvoice.flow.dit_cache import GROWTH

logger = logging.getLogger(__name__)

WORKSPACE_BYTES = 8 << 30  # large profiles (long utterances) need a big tactic workspace
MAX_FRAMES = 3000  # 60 s of mel: the longest one call handles
Profile = dict[str, tuple[tuple[int, ...], ...]]  # input name -> (min, opt, max) shapes


def _shapes(shape: Callable[..., tuple[int, ...]], *ranges: tuple[int, int, int]) -> tuple[tuple[int, ...], ...]:
    """(min, opt, max) shapes of ``shape(*values)`` over parallel (min, opt, max) ranges."""
    return tuple(shape(*values) for values in zip(*ranges, strict=True))


def profiles(graph: str, dims: dict[str, int], max_batch: int = 4) -> Profile:
    """min/opt/max shapes for every input of ``graph``; ``dims`` holds the static sizes (mel, mu, spk, dim,
    heads, dim_head, depth, context for the DiT; mels, scale, look_ahead for the vocoder)."""
    if graph == "vocoder":
        batch, frames, look_ahead = (1, 1, max_batch), (1, 60, MAX_FRAMES), dims["look_ahead"]
        # the excitation covers the output frames (finalize) or also conv_pre's look-ahead frames (streaming)
        return {"mel": _shapes(lambda b, f: (b, dims["mels"], f + look_ahead), batch, frames),
                "source": _shapes(lambda b, f: (b, 1, f * dims["scale"]), batch,
                                  (1, 60 + look_ahead, MAX_FRAMES + look_ahead))}
    rows = (2, 2, 2 * max_batch)  # the CFG batch: two rows per utterance
    cached = graph == "flow_estimator_cached"
    new = (1, 100, 600) if cached else (1, 400, MAX_FRAMES)
    shapes: Profile = {name: _shapes(lambda b, f, c=dims[key]: (b, c, f), rows, new)
                       for name, key in (("x", "mel"), ("mu", "mu"), ("cond", "mel"))}
    shapes["mod_blocks"] = _shapes(lambda b: (dims["depth"], b, 6 * dims["dim"]), rows)
    shapes["mod_final"] = _shapes(lambda b: (b, 2 * dims["dim"]), rows)
    shapes["spks"] = _shapes(lambda b: (b, dims["spk"]), rows)
    if not cached:
        shapes["mask"] = _shapes(lambda f: (f, f), new)
        return shapes
    # zero past frames at an utterance's start: unverified on TensorRT (docs/perf.md, GPU steps)
    past = (0, 200, MAX_FRAMES - new[2])
    shapes["mask"] = _shapes(lambda f, p: (f, p + f), new, past)
    for name in ("tail1", "tail2"):
        shapes[name] = _shapes(lambda b: (b, dims["dim"], dims["context"]), rows)
    # the key/value buffers hold the past and room to grow into (dit_cache.append_frames)
    capacity = (0, int(past[1] * GROWTH), int(MAX_FRAMES * GROWTH))
    for i in range(dims["depth"]):
        for kind in "kv":
            shapes[f"cache_{kind}_{i}"] = _shapes(lambda b, c: (b, dims["heads"], c, dims["dim_head"]), rows,
                                                  capacity)
    return shapes


def available() -> str | None:
    """None when TensorRT can run here, else why not (for the one log line or error)."""
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return "the tensorrt package is not installed (`pip install .[trt]`)"
    return None


def plan_key(onnx_sha256: str, profile: Profile, fp16: bool, device: torch.device) -> str:
    import tensorrt as trt

    identity = json.dumps({"onnx": onnx_sha256, "gpu": torch.cuda.get_device_name(device), "trt": trt.__version__,
                           "profile": profile, "fp16": fp16}, sort_keys=True)
    return hashlib.sha256(identity.encode()).hexdigest()[:20]


def build_plan(onnx_path: Path, profile: Profile, fp16: bool) -> bytes:
    """Serialized engine for ``onnx_path`` with one optimization profile (see the module docstring)."""
    import tensorrt as trt

    trt_logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(trt_logger)
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if fp16 else 0
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, trt_logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ModelBundleError(f"TensorRT cannot parse {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, WORKSPACE_BYTES)
    if not fp16:
        config.clear_flag(trt.BuilderFlag.TF32)  # float32 matmuls, as PyTorch computes them by default
    opt = builder.create_optimization_profile()
    for name, (lo, mid, hi) in profile.items():
        opt.set_shape(name, lo, mid, hi)
    config.add_optimization_profile(opt)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise ModelBundleError(f"TensorRT failed to build an engine from {onnx_path.name} (see its log above)")
    return bytes(plan)


class TrtGraph:
    """A TensorRT engine for one exported graph, built once per key and cached beside the ONNX."""

    def __init__(self, onnx_path: Path, onnx_sha256: str, profile: Profile, fp16: bool,
                 device: torch.device) -> None:
        import tensorrt as trt

        self.device = device
        key = plan_key(onnx_sha256, profile, fp16, device)
        self.plan_path = onnx_path.with_name(f"{onnx_path.stem}.{key}.plan")
        self.build_seconds = 0.0
        if not self.plan_path.is_file():
            start = time.perf_counter()
            logger.info("building the TensorRT engine of %s (%s); cached as %s", onnx_path.name,
                        "fp16 strongly typed" if fp16 else "fp32", self.plan_path.name)
            plan = build_plan(onnx_path, profile, fp16)
            tmp = self.plan_path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(plan)
            os.replace(tmp, self.plan_path)  # atomic: a concurrent loader never reads half a plan
            self.build_seconds = time.perf_counter() - start
        self.plan_bytes = self.plan_path.stat().st_size
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        with torch.cuda.device(device):
            self.engine = runtime.deserialize_cuda_engine(self.plan_path.read_bytes())
            if self.engine is None:
                raise ModelBundleError(f"TensorRT could not load {self.plan_path}; delete it to rebuild")
            self.context = self.engine.create_execution_context()

    def run(self, inputs: dict[str, Tensor], outputs: dict[str, Tensor], bounded: bool = False) -> None:
        """Run on the current CUDA stream (``bounded`` is the CPU arena's concern: see :meth:`OrtGraph.run`)."""
        held = []
        for name, tensor in inputs.items():
            tensor = tensor.contiguous()
            held.append(tensor)
            self.context.set_input_shape(name, tuple(tensor.shape))
            self.context.set_tensor_address(name, tensor.data_ptr())
        for name, tensor in outputs.items():
            self.context.set_tensor_address(name, tensor.data_ptr())
        stream = torch.cuda.current_stream(self.device)
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT execution failed")
        # the caller's later work is queued on the same stream; the inputs must live until the engine read them
        stream.synchronize()
