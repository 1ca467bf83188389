"""The LLM's forward step as ONE onnxruntime graph (issue 27, lever 3): int8 weights without torch's
per-op overhead around each GEMV (~48 ms a token at the released sizes on two cores).

The graph ``llm_step`` is the Qwen2 stack (:class:`~cosyvoice.llm.qwen2.Qwen2Model`, the same weights and
numerics), written op by op from the torch weights rather than traced: each layer is an RMSNorm
(``SimplifiedLayerNormalization``, then ``SkipSimplifiedLayerNormalization`` with the residual add), one packed
q/k/v projection, ``com.microsoft.GroupQueryAttention`` (rotary, the cache write and attention over the past and
the new positions in one kernel), the output projection, one packed gate/up projection and SiLU. The traced graph
spent ~90 small ops a layer on rotary, the mask, the softmax and concatenating the past (~2200 a step, 14% of a
decode step at 250 past positions, more beyond: issue 27's floor row); this one runs ~10.

Interface: ``(embeds [B, T, H], positions [B, T], past_k_i / past_v_i [B, kv_heads, S, D] for every layer) ->
(hidden [B, T, H] after the final norm, present_k_i / present_v_i)``. ``past_*`` is a layer's whole cache slab and
``present_*`` is bound to the same buffer: the kernel writes the new keys/values to the slots of their positions
in place and attends over the slots before them, so nothing of the past is copied. A row's positions are
consecutive: its first one is its past length, so one graph serves prefills with or without a past (T > 1, any
batch: ``query_seqlens``), batched decode steps (T = 1, rows at different positions) and whole sequences.
:class:`GraphBackbone` binds the torch :class:`~cosyvoice.llm.qwen2.KVCache`'s slabs, so the scheduler and its
runner are unchanged. The speech head (``llm_decoder``) and the embeddings stay in torch float32 (1.7% of the
weights).

Precisions: ``fp32`` and ``int8`` (every weight MatMul 8-bit per output channel, u8 or s8 as the CPU's kernels
need, :func:`cosyvoice.backends.quant.int8_weights`; packing q/k/v and gate/up changes no channel's scale, and
quantises each activation once instead of three or two times). The graphs live in ``MODEL_DIR/onnx`` beside the
DiT's, written on first use and again when ``llm.pt`` or the CPU's int8 kernels change (``llm_step.json`` holds
the checkpoint's hash and the weight type).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import Tensor, nn

from cosyvoice.backends.export import OPSET, graph_file, source_hashes, sources_match
from cosyvoice.config import QwenConfig
from cosyvoice.errors import ModelBundleError
from cosyvoice.llm.qwen2 import KVCache, Qwen2Backbone, rotary_tables
from cosyvoice.weights import give_back

logger = logging.getLogger(__name__)

NAME = "llm_step"
PRECISIONS = ("fp32", "int8")
# bump when the graph's interface changes: stale exports are then redone. 3: GroupQueryAttention on the cache slabs
FORMAT = 3
SOURCES = ("llm.pt",)
_MS = "com.microsoft"


def supported(cfg: QwenConfig) -> bool:
    """Whether the graph can run this stack: GroupQueryAttention's CPU kernel rotates heads of a multiple of 16
    dimensions (the released model's are 64; the tiny test bundle's 4 are not)."""
    return cfg.head_dim % 16 == 0


class _GraphWriter:
    """Nodes and initialisers of a graph being written."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.weights: list[onnx.TensorProto] = []

    def weight(self, name: str, value: Tensor | np.ndarray) -> str:
        array = value.detach().float().contiguous().numpy() if isinstance(value, Tensor) else value
        self.weights.append(numpy_helper.from_array(array, name))
        return name

    def op(self, op_type: str, inputs: list[str], outputs: list[str], domain: str = "", **attrs: object) -> list[str]:
        self.nodes.append(helper.make_node(op_type, inputs, outputs, name=outputs[0], domain=domain or None,
                                           **attrs))
        return outputs


def _step_scalars(g: _GraphWriter) -> None:
    """GroupQueryAttention's per-row lengths from ``positions``: ``seqlens_k`` (the last position: slots written
    after the step, minus one), ``query_seqlens`` (the new positions, T) and ``total_len`` (the longest row)."""
    g.weight("last", np.array(-1, dtype=np.int64))
    g.weight("first", np.array(0, dtype=np.int64))
    g.weight("one", np.array(1, dtype=np.int32))
    g.op("Gather", ["positions", "last"], ["position_last"], axis=1)
    g.op("Gather", ["positions", "first"], ["position_first"], axis=1)
    g.op("Cast", ["position_last"], ["seqlens_k"], to=TensorProto.INT32)
    g.op("Sub", ["position_last", "position_first"], ["span"])
    g.op("Cast", ["span"], ["span_i32"], to=TensorProto.INT32)
    g.op("Add", ["span_i32", "one"], ["query_seqlens"])
    g.op("ReduceMax", ["seqlens_k"], ["seqlens_max"], keepdims=0)
    g.op("Add", ["seqlens_max", "one"], ["total_len"])


def write_step(backbone: Qwen2Backbone, path: Path) -> None:
    """Write ``backbone``'s stack (float32) as the ``llm_step`` graph to ``path``."""
    cfg = backbone.cfg
    stack = backbone.model.model
    layers, kv, dim, eps = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    g = _GraphWriter()
    # the rotary tables of every position the model takes, from the function the torch stack uses
    cos, sin = rotary_tables(torch.arange(cfg.max_position_embeddings)[None], dim, cfg.rope_theta, torch.float32)
    g.weight("cos_cache", cos[0, :, :dim // 2])
    g.weight("sin_cache", sin[0, :, :dim // 2])
    _step_scalars(g)
    residual, sublayer = "embeds", ""
    with torch.no_grad():
        for i, layer in enumerate(stack.layers):
            attn, mlp, p = layer.self_attn, layer.mlp, f"layer{i}."
            norm = g.weight(p + "input_norm", layer.input_layernorm.weight)
            if sublayer:
                x, residual = g.op("SkipSimplifiedLayerNormalization", [sublayer, residual, norm],
                                   [p + "attn_in", "", "", p + "residual_attn"], _MS, epsilon=eps)[::3]
            else:
                x = g.op("SimplifiedLayerNormalization", [residual, norm], [p + "attn_in"], axis=-1, epsilon=eps)[0]
            qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).T
            bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
            x = g.op("MatMul", [x, g.weight(p + "qkv_proj", qkv)], [p + "qkv_nobias"])[0]
            x = g.op("Add", [x, g.weight(p + "qkv_bias", bias)], [p + "qkv"])[0]
            x = g.op("GroupQueryAttention", [x, "", "", f"past_k_{i}", f"past_v_{i}", "seqlens_k", "total_len",
                                             "cos_cache", "sin_cache"] + [""] * 7 + ["query_seqlens"],
                     [p + "attn", f"present_k_{i}", f"present_v_{i}"], _MS, num_heads=cfg.num_attention_heads,
                     kv_num_heads=kv, do_rotary=1, rotary_interleaved=0)[0]
            x = g.op("MatMul", [x, g.weight(p + "o_proj", attn.o_proj.weight.T)], [p + "attn_out"])[0]
            norm = g.weight(p + "post_attention_norm", layer.post_attention_layernorm.weight)
            x, residual = g.op("SkipSimplifiedLayerNormalization", [x, residual, norm],
                               [p + "mlp_in", "", "", p + "residual_mlp"], _MS, epsilon=eps)[::3]
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).T
            x = g.op("MatMul", [x, g.weight(p + "gate_up_proj", gate_up)], [p + "gate_up"])[0]
            split = g.weight(p + "split", np.array([mlp.gate_proj.out_features] * 2, dtype=np.int64))
            gate, up = g.op("Split", [x, split], [p + "gate", p + "up"], axis=-1)
            sigmoid = g.op("Sigmoid", [gate], [p + "sigmoid"])[0]
            x = g.op("Mul", [g.op("Mul", [gate, sigmoid], [p + "silu"])[0], up], [p + "mlp_act"])[0]
            sublayer = g.op("MatMul", [x, g.weight(p + "down_proj", mlp.down_proj.weight.T)], [p + "mlp_out"])[0]
        g.op("SkipSimplifiedLayerNormalization", [sublayer, residual, g.weight("norm", stack.norm.weight)],
             ["hidden"], _MS, epsilon=eps)
    f32 = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("embeds", f32, ["batch", "new", cfg.hidden_size]),
              helper.make_tensor_value_info("positions", TensorProto.INT64, ["batch", "new"])]
    outputs = [helper.make_tensor_value_info("hidden", f32, ["batch", "new", cfg.hidden_size])]
    for i in range(layers):
        for kind in "kv":
            inputs.append(helper.make_tensor_value_info(f"past_{kind}_{i}", f32, ["batch", kv, "slots", dim]))
            outputs.append(helper.make_tensor_value_info(f"present_{kind}_{i}", f32, ["batch", kv, "slots", dim]))
    # the activations' type, which shape inference cannot carry past the contrib ops (quantize_dynamic needs it)
    ends = {v.name for v in inputs + outputs}
    floats = [helper.make_tensor_value_info(name, f32, None) for node in g.nodes for name in node.output
              if name.startswith("layer") and name not in ends]
    graph = helper.make_graph(g.nodes, NAME, inputs, outputs, g.weights, value_info=floats)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(_MS, 1)])
    model.ir_version = 9  # onnx writes its newest IR version, which onnxruntime may not read yet
    onnx.save(model, str(path))


def ensure_step(backbone: Qwen2Backbone, model_root: Path, precision: str) -> Path:
    """The ``llm_step`` graph of ``precision`` in ``model_root/onnx``, written (from ``backbone``, the float32
    weights of ``llm.pt``) and quantised first when missing or made from another ``llm.pt`` or CPU."""
    from cosyvoice.backends.cpu import cpu_features
    from cosyvoice.backends.quant import int8_weights, quantize_matmuls, weight_matmuls

    if not supported(backbone.cfg):
        raise ModelBundleError(f"the onnxruntime LLM step needs a head size that is a multiple of 16, this model's is "
                               f"{backbone.cfg.head_dim}: use a torch precision")
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
        logger.info("writing the LLM step's ONNX graph in %s (first use of this bundle)", out)
        tmp = fp32.with_suffix(f".tmp{os.getpid()}.onnx")
        write_step(backbone, tmp)
        os.replace(tmp, fp32)
        have = {"fp32": "fp32"}
    if precision != "fp32":
        nodes = weight_matmuls(onnx.load(str(fp32), load_external_data=False))
        have[precision] = quantize_matmuls(fp32, out / graph_file(NAME, precision), nodes, weights)
    record = {"format": FORMAT, "sources": source_hashes(Path(model_root), SOURCES), "graphs": have}
    record_path.write_text(json.dumps(record, indent=1), encoding="utf-8")
    return out / graph_file(NAME, precision)


class GraphBackbone:
    """:meth:`Qwen2Backbone.forward <cosyvoice.llm.qwen2.Qwen2Backbone.forward>` on the ``llm_step`` graph: each
    layer's cache slab is bound as its past and its present, so the graph writes the new keys/values into the torch
    cache itself and reads the past where it lies."""

    def __init__(self, graph: object, backbone: Qwen2Backbone) -> None:
        cfg = backbone.cfg
        self.graph = graph
        self.layers, self.kv_heads, self.head_dim = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        self.hidden = cfg.hidden_size

    def slabs(self, cache: KVCache) -> tuple[Tensor, Tensor]:
        """The view's rows with all the slots of the cache it views, [layers, B, kv_heads, slots, D]: one contiguous
        block per layer, as the kernel takes a cache (a view's first slots are not, the slots being the inner axis).
        The kernel reads only the slots before a row's last position and writes only its new positions'."""
        out = []
        for tensor in (cache.k, cache.v):
            slots = tensor.stride(2) // tensor.stride(3)
            slab = tensor.as_strided((*tensor.shape[:3], slots, tensor.shape[4]), tensor.stride())
            if not slab[0].is_contiguous():
                raise RuntimeError(f"the LLM graph needs a cache laid out as KVCache.allocate's, got strides "
                                   f"{tuple(tensor.stride())}")
            out.append(slab)
        return out[0], out[1]

    def __call__(self, embeds: Tensor, positions: Tensor | None, cache: KVCache | None) -> Tensor:
        b, t, _ = embeds.shape
        if positions is None:
            positions = torch.arange(t).expand(b, t)
        if cache is None:  # a whole sequence: a scratch cache of its own slots
            shape = (self.layers, b, self.kv_heads, t, self.head_dim)
            k, v = embeds.new_empty(shape, dtype=torch.float32), embeds.new_empty(shape, dtype=torch.float32)
        else:
            k, v = self.slabs(cache)
        inputs = {"embeds": embeds.float(), "positions": positions.long()}
        outputs = {"hidden": embeds.new_empty(b, t, self.hidden, dtype=torch.float32)}
        for i in range(self.layers):
            inputs[f"past_k_{i}"] = outputs[f"present_k_{i}"] = k[i]
            inputs[f"past_v_{i}"] = outputs[f"present_v_{i}"] = v[i]
        self.graph.run(inputs, outputs)  # type: ignore[attr-defined]
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


__all__ = ["NAME", "PRECISIONS", "GraphBackbone", "attach_step", "ensure_step", "release_stack", "supported",
           "write_step"]
