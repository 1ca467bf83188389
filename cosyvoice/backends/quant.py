"""int8 dynamic quantisation of the DiT graphs for the fast CPU path.

Only the per-frame projections are quantised: each block's attention q/k/v/out and feed-forward matmuls
(weights 8-bit per output channel, u8 or s8 as the CPU's kernels need: :func:`int8_weights`; activations
u8 per call), which hold nearly all of the DiT's FLOPs.
Everything else stays float32: the attention products themselves (both operands are activations), the
AdaLN and time-MLP linears (two rows per call, so reading their weights is cheap and their scales steer
every frame), the input and output projections. The quality bound against float32 is in docs/perf.md.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import onnx
import torch

from cosyvoice.backends.cpu import cpu_features, native_int8_dot


def quantized_nodes(model: onnx.ModelProto) -> list[str]:
    """The MatMul nodes quantised: the blocks' attention projections and feed-forward layers."""
    return [n.name for n in model.graph.node
            if n.op_type == "MatMul" and ("/attn/to_" in n.name or "/ff/" in n.name)]


def int8_weights(features: frozenset[str]) -> str:
    """How the int8 DiT graph stores its weights on a CPU with ``features``: ``s8`` (u8 activations x s8 weights)
    where the CPU multiplies int8 natively (VNNI, AMX), else ``u8`` (u8 x u8, all 8 bits). Without VNNI
    onnxruntime's u8 x s8 kernel sums pairs in 16 bits, which saturates unless the weights keep to 7 bits
    (``reduce_range``), and 7-bit weights miss the mel bound at the released sizes (1.23-1.29% RMS against 1%);
    its u8 x u8 kernel widens to 16 bits before multiplying, so 8-bit weights hold it (0.72-0.74%)."""
    return "s8" if native_int8_dot(features) else "u8"


def quantize_matmuls(src: Path, dst: Path, nodes: list[str], weights: str) -> str:
    """Write ``src`` with its MatMul ``nodes`` int8 to ``dst`` (atomically): weights 8-bit per output channel,
    ``weights`` u8 or s8 (:func:`int8_weights`), activations u8 per call. Returns ``weights``."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    tmp = dst.with_suffix(f".tmp{os.getpid()}.onnx")
    quantize_dynamic(src, tmp, weight_type=QuantType.QInt8 if weights == "s8" else QuantType.QUInt8,
                     op_types_to_quantize=["MatMul"], per_channel=True, reduce_range=False, nodes_to_quantize=nodes)
    os.replace(tmp, dst)
    return weights


def quantize_dit(src: Path, dst: Path, weights: str | None = None) -> str:
    """Write the int8 variant of the DiT graph ``src`` to ``dst``: its :func:`quantized_nodes` int8, then its tanh
    GELUs fused (:func:`fuse_gelu`; after quantising, whose shape inference knows no contrib ops); ``weights``:
    ``u8`` or ``s8`` (None: :func:`int8_weights` of this CPU). Returns the weight type written."""
    nodes = quantized_nodes(onnx.load(str(src), load_external_data=False))
    written = quantize_matmuls(src, dst, nodes, weights or int8_weights(cpu_features()))
    tmp = dst.with_suffix(f".tmp{os.getpid()}.onnx")
    onnx.save(fuse_gelu(onnx.load(str(dst))), str(tmp))
    os.replace(tmp, dst)
    return written


def fuse_gelu(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each feed-forward's tanh GELU, exported as nine elementwise ops over the [B, N, ff dim]
    activations, as one onnxruntime ``FastGelu`` (com.microsoft, CPU and CUDA; not TensorRT, so only the int8
    graph, which is CPU-only, gets it): 34 -> 10 ms of a 364 ms int8 step at the released sizes (docs/perf.md).
    The same formula in one pass (float32 rounding apart)."""
    from onnxruntime.transformers.fusion_fastgelu import FusionFastGelu
    from onnxruntime.transformers.onnx_model import OnnxModel

    wrapped = OnnxModel(model)
    FusionFastGelu(wrapped).apply()
    wrapped.topological_sort()  # the fused nodes are appended at the end
    if not any(op.domain == "com.microsoft" for op in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return wrapped.model


def half_cache(model: onnx.ModelProto, inputs: list[str], outputs: list[str]) -> onnx.ModelProto:
    """``model`` (in place) taking its key/value ``inputs`` and returning its key/value ``outputs`` in float16, cast
    to and from float32 inside: the int8 cached DiT's cache, 3.6 MB per mel frame at 10 steps in float32, halves
    (the rounding, 2^-11 relative, is well inside the int8 graph's own error). An input is cast after its Slice to
    the past frames, so the buffer's room is never read."""
    from onnx import TensorProto, helper

    graph = model.graph
    value = {v.name: v for v in [*graph.input, *graph.output]}

    def rewire(old: str, new: str) -> None:
        for node in graph.node:
            node.input[:] = [new if name == old else name for name in node.input]

    for name in inputs:
        value[name].type.tensor_type.elem_type = TensorProto.FLOAT16
        users = [n for n in graph.node if name in n.input]
        at = users[0].output[0] if len(users) == 1 and users[0].op_type == "Slice" else name
        for info in [v for v in graph.value_info if v.name == at]:  # the Slice now yields float16
            graph.value_info.remove(info)
        cast = helper.make_node("Cast", [at], [f"{at}_float"], to=TensorProto.FLOAT, name=f"{name}_to_float")
        rewire(at, cast.output[0])
        graph.node.insert(list(graph.node).index(users[0]) + (at != name), cast)
    for name in outputs:
        value[name].type.tensor_type.elem_type = TensorProto.FLOAT16
        producer = next(n for n in graph.node if name in n.output)
        producer.output[:] = [f"{name}_float" if out == name else out for out in producer.output]
        rewire(name, f"{name}_float")
        graph.node.append(helper.make_node("Cast", [f"{name}_float"], [name], to=TensorProto.FLOAT16,
                                           name=f"{name}_to_half"))
    return model


def weight_matmuls(model: onnx.ModelProto) -> list[str]:
    """The MatMul nodes whose second input is a stored weight (the attention products multiply activations): the
    LLM step graph's int8 nodes."""
    stored = {init.name for init in model.graph.initializer}
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in stored]


def quantize_llm(llm: torch.nn.Module) -> torch.nn.Module:
    """The LLM with every linear but the unused text head replaced by torch's dynamic int8 linear (weights int8
    per tensor, activations quantised per call; fbgemm/oneDNN kernels on x86). CPU only."""
    from torch.ao.quantization import default_dynamic_qconfig

    names = [n for n, m in llm.named_modules() if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")]
    return quantize_linears(llm, names, default_dynamic_qconfig)


def quantize_linears(model: torch.nn.Module, names: list[str], qconfig: object) -> torch.nn.Module:
    """``model`` with its linears ``names`` replaced by torch's dynamic int8 linear under ``qconfig``, a parent
    module at a time, each one's float weights handed back as soon as they are replaced (:func:`~cosyvoice.weights.
    give_back`): the pages of a mapped checkpoint read while quantising would otherwise stay resident, all of them
    (1.4 GB of the released LLM's) by the end. Each linear is quantised on its own, so the result is the same."""
    from torch.ao.quantization import quantize_dynamic

    from cosyvoice.weights import give_back

    by_parent: dict[str, list[str]] = {}
    for name in names:
        parent, _, child = name.rpartition(".")
        by_parent.setdefault(parent, []).append(child)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice (the API still ships)
        for parent, children in by_parent.items():
            owner = model.get_submodule(parent)
            replaced = [t for c in children for t in owner.get_submodule(c).parameters()]
            quantize_dynamic(owner, dict.fromkeys(children, qconfig), inplace=True)
            give_back(replaced)
    return model
