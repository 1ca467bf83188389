"""The tiny bundle's ONNX stand-ins for the speech tokenizer and CAM++: random weights behind the official
inputs and outputs (:mod:`cosyvoice.tools.make_tiny_bundle` writes them)."""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper


def _normal(gen: torch.Generator, *shape: int, std: float) -> np.ndarray:
    return (torch.randn(shape, generator=gen) * std).numpy()


def _onnx_model(graph: onnx.GraphProto) -> onnx.ModelProto:
    model = helper.make_model(graph, producer_name="cosyvoice-tiny-bundle", opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # readable by every onnxruntime the frontend supports
    onnx.checker.check_model(model, full_check=True)
    return model


def speech_tokenizer_onnx(gen: torch.Generator, channels: int) -> onnx.ModelProto:
    """``feats`` [1,128,T] float32, ``feats_length`` [1] int32 -> ``indices`` [1, ceil(T/4)] int32 in 0..6560.

    Two stride-2 convolutions give 25 frames/s; an 8-dim tanh projection rounded to {-1,0,1} is read as an
    8-digit base-3 number, so every id 0..3**8-1 = 6560 is reachable.
    """
    digits = 8
    weights = {
        "conv1_w": _normal(gen, channels, 128, 3, std=(128 * 3) ** -0.5), "conv1_b": _normal(gen, channels, std=0.1),
        "conv2_w": _normal(gen, channels, channels, 3, std=(channels * 3) ** -0.5),
        "conv2_b": _normal(gen, channels, std=0.1),
        "proj_w": _normal(gen, channels, digits, std=3.0 * channels ** -0.5),
        "place_values": (3.0 ** np.arange(digits, dtype=np.float32)).reshape(digits, 1),
    }
    constants = {"one_f": np.array([1.0], np.float32), "three_i": np.array([3], np.int32),
                 "four_i": np.array([4], np.int32), "zero_l": np.array([0], np.int64),
                 "axis_l": np.array([1], np.int64), "row_shape": np.array([1, -1], np.int64)}
    conv = {"kernel_shape": [3], "strides": [2], "pads": [1, 1]}
    nodes = [
        helper.make_node("Conv", ["feats", "conv1_w", "conv1_b"], ["h1"], **conv),
        helper.make_node("Tanh", ["h1"], ["a1"]),
        helper.make_node("Conv", ["a1", "conv2_w", "conv2_b"], ["h2"], **conv),
        helper.make_node("Tanh", ["h2"], ["a2"]),
        helper.make_node("Transpose", ["a2"], ["frames"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["frames", "proj_w"], ["z"]),
        helper.make_node("Tanh", ["z"], ["tz"]),
        helper.make_node("Round", ["tz"], ["trit"]),  # -1, 0 or 1
        helper.make_node("Add", ["trit", "one_f"], ["digit"]),  # 0, 1 or 2
        helper.make_node("MatMul", ["digit", "place_values"], ["code_f"]),
        helper.make_node("Cast", ["code_f"], ["code_i"], to=TensorProto.INT32),
        helper.make_node("Reshape", ["code_i", "row_shape"], ["codes"]),
        helper.make_node("Add", ["feats_length", "three_i"], ["len_plus"]),
        helper.make_node("Div", ["len_plus", "four_i"], ["n_tokens_i"]),  # ceil(T / 4) for integer T
        helper.make_node("Cast", ["n_tokens_i"], ["n_tokens"], to=TensorProto.INT64),
        helper.make_node("Slice", ["codes", "zero_l", "n_tokens", "axis_l"], ["indices"]),
    ]
    graph = helper.make_graph(
        nodes, "speech_tokenizer_standin",
        [helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, "T"]),
         helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1])],
        [helper.make_tensor_value_info("indices", TensorProto.INT32, [1, "T_tok"])],
        initializer=[numpy_helper.from_array(np.ascontiguousarray(v), k) for k, v in {**weights, **constants}.items()])
    return _onnx_model(graph)


def campplus_onnx(gen: torch.Generator, hidden: int) -> onnx.ModelProto:
    """``input`` [B,T,80] float32 -> ``output`` [B,192]: per-frame linear+ReLU, mean over time, linear."""
    weights = {"frame_w": _normal(gen, 80, hidden, std=80 ** -0.5), "frame_b": _normal(gen, hidden, std=0.1),
               "out_w": _normal(gen, hidden, 192, std=hidden ** -0.5), "out_b": _normal(gen, 192, std=0.1)}
    nodes = [
        helper.make_node("MatMul", ["input", "frame_w"], ["h"]),
        helper.make_node("Add", ["h", "frame_b"], ["hb"]),
        helper.make_node("Relu", ["hb"], ["a"]),
        helper.make_node("ReduceMean", ["a"], ["pooled"], axes=[1], keepdims=0),
        helper.make_node("MatMul", ["pooled", "out_w"], ["o"]),
        helper.make_node("Add", ["o", "out_b"], ["output"]),
    ]
    graph = helper.make_graph(
        nodes, "campplus_standin",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["B", "T", 80])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["B", 192])],
        initializer=[numpy_helper.from_array(np.ascontiguousarray(v), k) for k, v in weights.items()])
    return _onnx_model(graph)
