"""The DiT and vocoder runners that stand in for the torch modules, over any graph with ``run(inputs, outputs)``.

A runner allocates the outputs (their shapes follow from the inputs) and runs the graph; the streaming
state stays where it is: :class:`~cosyvoice.flow.FlowStream` keeps the per-chunk K/V cache, which the cached
graph reads in place and extends by the new frames it returns (:class:`~cosyvoice.flow.dit_cache.DiTCache`, the
same buffers with room as the torch path) and
:class:`~cosyvoice.hifigan.HiFTStream` its phase carry and window, so both stream on every backend.
The graphs take and return float32 (the fp16 variants cast inside); a half-precision flow's tensors are
cast at the boundary.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from cosyvoice.backends.graphs import modulation_inputs
from cosyvoice.flow.dit import DiT
from cosyvoice.flow.dit_cache import DiTCache, append_frames, owns_room
from cosyvoice.flow.modulation import Modulation
from cosyvoice.hifigan.generator import CausalHiFTGenerator


class Graph(Protocol):
    def run(self, inputs: dict[str, Tensor], outputs: dict[str, Tensor], bounded: bool = False) -> None: ...


class GraphEstimator:
    """:class:`cosyvoice.flow.dit.EstimatorRunner` over the ``flow_estimator_cached`` graph and optionally the
    ``flow_estimator`` one. Without the latter, a whole-utterance call runs the cached graph with no past (the
    same computation: zero tails are the convs' left padding) and drops the keys/values it also returns; on
    the CPU that keeps one copy of the weights instead of two. ``cache_dtype``: the dtype of the cached graph's
    keys/values (float16 for the int8 graph: :func:`~cosyvoice.backends.quant.half_cache`), which the stream's
    cache then holds."""

    def __init__(self, plain: Graph | None, cached: Graph, dit: DiT, cache_dtype: torch.dtype = torch.float32) -> None:
        self.plain, self.cached, self.cache_dtype = plain, cached, cache_dtype
        attn = dit.transformer_blocks[0].attn
        self.depth, self.heads, self.dim_head = len(dit.transformer_blocks), attn.heads, attn.dim_head
        self.dim = dit.proj_out.in_features
        self.mel_dim = dit.proj_out.out_features
        self.context = dit.input_embed.conv_pos_embed.context
        self.chunk_frames = 4 * dit.chunk_size  # a stream's chunk call (a chunk or two and the look-ahead) is fewer

    @staticmethod
    def _inputs(x: Tensor, mu: Tensor, mod: Modulation, spks: Tensor, cond: Tensor, mask: Tensor) -> dict[str, Tensor]:
        time = {name: value.float() for name, value in modulation_inputs(mod).items()}
        return {"x": x.float(), "mu": mu.float(), **time, "spks": spks.float(), "cond": cond.float(), "mask": mask}

    def velocity(self, x: Tensor, mu: Tensor, mod: Modulation, spks: Tensor, cond: Tensor, mask: Tensor) -> Tensor:
        if self.plain is None:
            return self.velocity_cached(x, mu, mod, spks, cond, mask, None)[0]
        out = x.new_empty(x.shape[0], self.mel_dim, x.shape[2], dtype=torch.float32)
        self.plain.run(self._inputs(x, mu, mod, spks, cond, mask), {"velocity": out})
        return out.to(x.dtype)

    def velocity_cached(self, x: Tensor, mu: Tensor, mod: Modulation, spks: Tensor, cond: Tensor, mask: Tensor,
                        past: DiTCache | None) -> tuple[Tensor, tuple[Tensor, Tensor], list[tuple[Tensor, Tensor]]]:
        """What :meth:`DiT.trunk` returns: the graph reads each block's past where the stream keeps it (the
        whole buffer with its room, :func:`buffer_of`) and returns the new frames' keys/values only, which are
        appended into that buffer in place (:func:`append_frames`, grown by its factor when full)."""
        batch, n = x.shape[0], x.shape[2]
        f32 = {"dtype": torch.float32, "device": x.device}
        kv_type = {"dtype": self.cache_dtype, "device": x.device}
        if past is None:  # the start of an utterance: zeros are the convs' left padding, no keys yet
            tails = (torch.zeros(batch, self.dim, self.context, **f32),) * 2
            kv = [(torch.zeros(batch, self.heads, 0, self.dim_head, **kv_type),) * 2] * self.depth
        else:
            tails, kv = past.conv_tails, [(k.to(self.cache_dtype), v.to(self.cache_dtype)) for k, v in past.kv]
        inputs = self._inputs(x, mu, mod, spks, cond, mask)
        inputs["tail1"], inputs["tail2"] = tails[0].float(), tails[1].float()
        outputs = {"velocity": torch.empty(batch, self.mel_dim, n, **f32),
                   "conv_in1": torch.empty(batch, self.dim, self.context + n, **f32),
                   "conv_in2": torch.empty(batch, self.dim, self.context + n, **f32)}
        for i, (k, v) in enumerate(kv):
            inputs[f"cache_k_{i}"], inputs[f"cache_v_{i}"] = buffer_of(k), buffer_of(v)
            outputs[f"new_k_{i}"] = torch.empty(batch, self.heads, n, self.dim_head, **kv_type)
            outputs[f"new_v_{i}"] = torch.empty(batch, self.heads, n, self.dim_head, **kv_type)
        self.cached.run(inputs, outputs, bounded=past is not None and n <= self.chunk_frames)
        present = [(outputs[f"new_k_{i}"], outputs[f"new_v_{i}"]) for i in range(self.depth)]
        if past is not None:  # at the start they are the outputs: a whole-utterance call copies nothing
            present = [(append_frames(k, new_k), append_frames(v, new_v))
                       for (k, v), (new_k, new_v) in zip(kv, present, strict=True)]
        return outputs["velocity"].to(x.dtype), (outputs["conv_in1"], outputs["conv_in2"]), present


def buffer_of(past: Tensor) -> Tensor:
    """The whole [B, H, capacity, D] buffer whose leading frames ``past`` is (:func:`owns_room`), so the graph reads
    it in place; any other tensor as it is (the graph then makes it contiguous, and :func:`append_frames` copies it
    into a buffer with room after the call: once per stream, e.g. after a shared voice prefix)."""
    b, h, length, d = past.shape
    if not owns_room(past, length):
        return past
    return past.as_strided((b, h, past.stride(1) // d, d), past.stride())


class GraphVocoder:
    """:meth:`CausalHiFTGenerator.decode_window` over the ``vocoder`` graph.

    ``host_output``: the waveform lands in pinned host memory (one asynchronous copy, then a sync), the
    TensorRT path: audio leaves the GPU anyway, and the caller gets it without another transfer.
    """

    def __init__(self, graph: Graph, hift: CausalHiFTGenerator, host_output: bool = False) -> None:
        self.graph = graph
        self.look_ahead = hift.conv_pre.look_ahead
        self.scale = hift.upsample_scale
        self.host_output = host_output

    def __call__(self, mel: Tensor, source: Tensor) -> Tensor:
        frames = mel.shape[2] - self.look_ahead
        wav = mel.new_empty(mel.shape[0], frames * self.scale, dtype=torch.float32)
        self.graph.run({"mel": mel.float(), "source": source.float()}, {"wav": wav})
        if not self.host_output:
            return wav
        host = torch.empty(wav.shape, dtype=wav.dtype, pin_memory=True)  # torch caches pinned blocks
        host.copy_(wav, non_blocking=True)
        torch.cuda.current_stream(wav.device).synchronize()
        return host
