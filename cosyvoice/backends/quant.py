"""int8 dynamic quantisation of the DiT graphs for the fast CPU path.

Only the per-frame projections are quantised: each block's attention q/k/v/out and feed-forward matmuls
(weights int8 per output channel, activations int8 per call), which hold nearly all of the DiT's FLOPs.
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


def quantized_nodes(model: onnx.ModelProto) -> list[str]:
    """The MatMul nodes quantised: the blocks' attention projections and feed-forward layers."""
    return [n.name for n in model.graph.node
            if n.op_type == "MatMul" and ("/attn/to_" in n.name or "/ff/" in n.name)]


def quantize_dit(src: Path, dst: Path) -> None:
    """Write the int8 variant of the DiT graph ``src`` to ``dst`` (atomically)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from cosyvoice.backends.cpu import cpu_features, native_int8_dot

    nodes = quantized_nodes(onnx.load(str(src), load_external_data=False))
    tmp = dst.with_suffix(f".tmp{os.getpid()}.onnx")
    # 7-bit weights where the CPU lacks VNNI: its 16-bit pairwise sums would otherwise saturate (measured on an
    # AVX2-only EPYC: a cached-DiT key 1.04 off against a bound of 0.28)
    quantize_dynamic(src, tmp, weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"], per_channel=True,
                     reduce_range=not native_int8_dot(cpu_features()), nodes_to_quantize=nodes)
    os.replace(tmp, dst)


def quantize_llm(llm: torch.nn.Module) -> torch.nn.Module:
    """The LLM with every linear but the unused text head replaced by torch's dynamic int8 linear (weights int8
    per tensor, activations quantised per call; fbgemm/oneDNN kernels on x86). CPU only."""
    from torch.ao.quantization import quantize_dynamic

    names = {n for n, m in llm.named_modules() if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice (the API still ships)
        return quantize_dynamic(llm, names, dtype=torch.qint8, inplace=True)
