"""The LLM's forward step as ONE onnxruntime graph (issue 27, lever 3): int8 weights without torch's
per-op overhead around each GEMV (~48 ms a token at the released sizes on two cores).

The graph ``llm_step`` is the Qwen2 stack (:class:`~cosyvoice.llm.qwen2.Qwen2Model`, the same layers traced):
``(embeds [B, T, H], positions [B, T], past_k_i / past_v_i [B, kv_heads, P, D] for every layer) -> (hidden
[B, T, H] after the final norm, present_k / present_v [layers, B, kv_heads, T, D])``. A query at position ``q``
of a row starting at ``s`` sees the past slots ``0 .. s-1`` and the new positions up to its own, so one graph
serves prefills (T > 1), batched decode steps (T = 1, rows at different positions) and a whole sequence
(P = 0). :class:`GraphBackbone` feeds it from a :class:`~cosyvoice.llm.qwen2.KVCache` view and writes the new
keys/values to their slots: the cache stays the torch one, so the scheduler and its runner are unchanged. The
speech head (``llm_decoder``) and the embeddings stay in torch float32 (1.7% of the weights).

Precisions: ``fp32`` (the traced graph) and ``int8`` (every weight MatMul 8-bit per output channel, u8 or s8 as
the CPU's kernels need, :func:`cosyvoice.backends.quant.int8_weights`). The graphs live in ``MODEL_DIR/onnx``
beside the DiT's, exported on first use and again when ``llm.pt`` or the CPU's int8 kernels change
(``llm_step.json`` holds the checkpoint's hash and the weight type).
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path

import onnx
import torch
from torch import Tensor, nn

from cosyvoice.backends.export import OPSET, graph_file, source_hashes, sources_match
from cosyvoice.llm.qwen2 import KVCache, Qwen2Backbone
from cosyvoice.weights import give_back

logger = logging.getLogger(__name__)

NAME = "llm_step"
PRECISIONS = ("fp32", "int8")
FORMAT = 2  # bump when the graph's interface changes: stale exports are then redone
SOURCES = ("llm.pt",)


class PastCache:
    """What :class:`~cosyvoice.llm.qwen2.Qwen2Model` asks of a cache, over past keys/values given as tensors:
    each layer attends over its past then the new positions, and the new keys/values are collected."""

    def __init__(self, past_k: list[Tensor], past_v: list[Tensor]) -> None:
        self.past_k, self.past_v = past_k, past_v
        self.new_k: list[Tensor] = []
        self.new_v: list[Tensor] = []

    @property
    def batch(self) -> int:
        return self.past_k[0].shape[0]

    def update(self, layer: int, positions: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.new_k.append(k)
        self.new_v.append(v)
        return torch.cat([self.past_k[layer], k], dim=2), torch.cat([self.past_v[layer], v], dim=2)

    def mask(self, positions: Tensor) -> Tensor:
        """[B, 1, T, P + T]: past slots before the row's first position, then causal over the new ones."""
        past = torch.arange(self.past_k[0].shape[2], device=positions.device)
        seen = past[None, None, :] < positions[:, :1, None]  # [B, 1, P]
        new = torch.arange(positions.shape[1], device=positions.device)
        causal = new[None, :] <= new[:, None]  # [T, T]
        b, t = positions.shape
        return torch.cat([seen.expand(b, t, -1), causal.expand(b, t, t)], dim=2).unsqueeze(1)


class StepGraph(nn.Module):
    """The module traced into ``llm_step``."""

    def __init__(self, backbone: Qwen2Backbone) -> None:
        super().__init__()
        self.stack = backbone.model.model

    def forward(self, embeds: Tensor, positions: Tensor, *past: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        cache = PastCache(list(past[0::2]), list(past[1::2]))
        hidden = self.stack(embeds, positions, cache)
        return hidden, torch.stack(cache.new_k), torch.stack(cache.new_v)


def io_names(layers: int) -> tuple[list[str], list[str]]:
    inputs = ["embeds", "positions"] + [f"past_{kv}_{i}" for i in range(layers) for kv in "kv"]
    return inputs, ["hidden", "present_k", "present_v"]


def export_step(backbone: Qwen2Backbone, path: Path) -> None:
    """Trace ``backbone``'s stack (float32) into ``path`` with dynamic batch, new and past lengths."""
    cfg = backbone.cfg
    layers, (b, t, p) = cfg.num_hidden_layers, (2, 3, 4)
    inputs = [torch.zeros(b, t, cfg.hidden_size), torch.arange(p, p + t).expand(b, t).contiguous()]
    inputs += [torch.zeros(b, cfg.num_key_value_heads, p, cfg.head_dim)] * (2 * layers)
    names, outputs = io_names(layers)
    axes: dict[str, dict[int, str]] = {"embeds": {0: "batch", 1: "new"}, "positions": {0: "batch", 1: "new"},
                                       "hidden": {0: "batch", 1: "new"}, "present_k": {1: "batch", 3: "new"},
                                       "present_v": {1: "batch", 3: "new"}}
    axes.update({name: {0: "batch", 2: "past"} for name in names[2:]})
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer warnings
        torch.onnx.export(StepGraph(backbone).eval(), tuple(inputs), str(path), dynamo=False, input_names=names,
                          output_names=outputs, opset_version=OPSET, dynamic_axes=axes, do_constant_folding=True)


def ensure_step(backbone: Qwen2Backbone, model_root: Path, precision: str) -> Path:
    """The ``llm_step`` graph of ``precision`` in ``model_root/onnx``, exported (from ``backbone``, the float32
    weights of ``llm.pt``) and quantised first when missing or made from another ``llm.pt`` or CPU."""
    from cosyvoice.backends.cpu import cpu_features
    from cosyvoice.backends.quant import int8_weights, quantize_matmuls, weight_matmuls

    out = Path(model_root) / "onnx"
    record_path = out / f"{NAME}.json"
    weights = int8_weights(cpu_features())
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        record = {}
    fresh = record.get("format") == FORMAT and sources_match(Path(model_root), record, SOURCES)
    have = {k: v for k, v in record.get("graphs", {}).items() if fresh and (out / graph_file(NAME, k)).is_file()}
    if precision in have and (precision != "int8" or have["int8"] == weights):
        return out / graph_file(NAME, precision)
    out.mkdir(parents=True, exist_ok=True)
    fp32 = out / graph_file(NAME)
    if "fp32" not in have:
        logger.info("exporting the LLM step to ONNX in %s (first use of this bundle)", out)
        tmp = fp32.with_suffix(f".tmp{os.getpid()}.onnx")
        export_step(backbone, tmp)
        os.replace(tmp, fp32)
        have = {"fp32": "fp32"}
    if precision != "fp32":
        nodes = weight_matmuls(onnx.load(str(fp32), load_external_data=False))
        have[precision] = quantize_matmuls(fp32, out / graph_file(NAME, precision), nodes, weights)
    record = {"format": FORMAT, "sources": source_hashes(Path(model_root), SOURCES), "graphs": have}
    record_path.write_text(json.dumps(record, indent=1), encoding="utf-8")
    return out / graph_file(NAME, precision)


class GraphBackbone:
    """:meth:`Qwen2Backbone.forward <cosyvoice.llm.qwen2.Qwen2Backbone.forward>` on the ``llm_step`` graph:
    the view's slots before the new positions are the past; the new keys/values go to their slots."""

    def __init__(self, graph: object, backbone: Qwen2Backbone) -> None:
        cfg = backbone.cfg
        self.graph = graph
        self.layers, self.kv_heads, self.head_dim = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        self.hidden = cfg.hidden_size

    def __call__(self, embeds: Tensor, positions: Tensor | None, cache: KVCache | None) -> Tensor:
        b, t, _ = embeds.shape
        if positions is None:
            positions = torch.arange(t).expand(b, t)
        past = 0 if cache is None else cache.max_len - t
        inputs = {"embeds": embeds.float(), "positions": positions.long()}
        empty = embeds.new_zeros(b, self.kv_heads, 0, self.head_dim, dtype=torch.float32)
        for i in range(self.layers):
            inputs[f"past_k_{i}"] = empty if cache is None else cache.k[i, :, :, :past]
            inputs[f"past_v_{i}"] = empty if cache is None else cache.v[i, :, :, :past]
        present = (self.layers, b, self.kv_heads, t, self.head_dim)
        outputs = {"hidden": embeds.new_empty(b, t, self.hidden, dtype=torch.float32),
                   "present_k": embeds.new_empty(present, dtype=torch.float32),
                   "present_v": embeds.new_empty(present, dtype=torch.float32)}
        self.graph.run(inputs, outputs)  # type: ignore[attr-defined]
        if cache is not None:
            rows = torch.arange(b)[:, None]
            # advanced indices (rows, positions) around a slice put [B, T] first: [B, T, layers, kv_heads, D]
            cache.k[:, rows, :, positions] = outputs["present_k"].permute(1, 3, 0, 2, 4)
            cache.v[:, rows, :, positions] = outputs["present_v"].permute(1, 3, 0, 2, 4)
        return outputs["hidden"]


def attach_step(llm: nn.Module, model_root: Path, precision: str) -> nn.Module:
    """``llm`` (a CosyVoice3LM, float32) with its Qwen2 stack run by the ``llm_step`` graph of ``precision``;
    the stack's torch weights are left as they are (:func:`release_stack` frees them)."""
    from cosyvoice.backends.ort import OrtGraph, cpu_stage_threads

    path = ensure_step(llm.llm, model_root, precision)
    llm.llm.runner = GraphBackbone(OrtGraph(path, torch.device("cpu"), cpu_stage_threads(0)), llm.llm)
    return llm


def release_stack(llm: nn.Module) -> None:
    """Free the Qwen2 layers' weights once the graph runs them (the embeddings and the speech head stay)."""
    stack = llm.llm.model.model
    params = [*stack.layers.parameters(), *stack.norm.parameters()]
    give_back(params)  # their checkpoint pages, resident where this process exported or measured them
    for param in params:
        param.data = param.data.new_empty(0)


__all__ = ["NAME", "PRECISIONS", "GraphBackbone", "PastCache", "StepGraph", "attach_step", "ensure_step",
           "export_step", "release_stack"]
