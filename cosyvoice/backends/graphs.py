"""The exported graphs, as torch modules over the real ones (so export and PyTorch share every layer).

Three graphs, each with dynamic batch and time axes:

- ``flow_estimator``: the DiT, ``(x, mu, mod_blocks, mod_final, spks, cond, mask) -> velocity``. The CFG batch
  of two is the batch axis (rows B.. unconditional, as :func:`cosyvoice.flow.cfm.guidance_batch` stacks them); the
  attention mask is an input ``[N, N]`` (bool), so one graph serves full and chunk-causal attention. The ODE time
  comes in as its AdaLN modulation (:func:`modulation_inputs`; since export format 4): it depends on the time
  alone, so the runner takes it from the DiT's :class:`~cosyvoice.flow.modulation.ModulationCache`, computed once
  per time grid, instead of the graph reading the 22 blocks' ``dim -> 6 dim`` weights at every Euler step
  (553 MB of float32 at the released sizes, kept float32 in the int8 graph: ~15 % of its step).
- ``flow_estimator_cached``: the DiT extending an utterance (:meth:`DiT.forward_cached`): the new frames
  plus the finished frames' state, the position convs' tails and every block's key/value buffers
  ``cache_k_i``/``cache_v_i`` [B, H, capacity, D] (the stream's own, with room after the past), in; the
  velocity, the convs' padded inputs and every block's keys/values of the NEW frames only (``new_k_i``/
  ``new_v_i``) out, which the runner appends into the buffers in place. The past length is the mask's keys less
  its queries ([n, past + n]); RoPE positions start there and each block reads its buffer's first past frames
  (a Slice, one block at a time: cheaper on onnxruntime-CPU than attending over the capacity with the room
  masked, docs/perf.md). Past length 0 with zero tails is the start. Since export format 2: format 1 took the past
  exactly and returned past + new, a copy of the whole cache per call (:func:`check_cached_io` refuses it).
- ``vocoder``: :meth:`CausalHiFTGenerator.decode_window`, ``(mel with conv_pre's look-ahead, excitation)
  -> waveform``. Both spectral transforms are in the graph: ONNX has no inverse STFT operator (and
  TensorRT no STFT either), so here they are convolutions with a fixed windowed DFT basis: the STFT a
  strided conv, the inverse a transposed conv (overlap-add) divided by the overlap-added squared window,
  which is what ``torch.istft`` computes. The F0 predictor (float64, a few small convs) and the sine
  source (a float64 phase carry and a noise buffer indexed by absolute sample, both streaming state)
  stay in PyTorch: they are a small share of the work and need that precision and state.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyvoice.errors import ModelBundleError
from cosyvoice.flow.dit import DiT
from cosyvoice.flow.dit_cache import DiTCache, PastFrames
from cosyvoice.flow.modulation import Modulation
from cosyvoice.hifigan.generator import CausalHiFTGenerator


def modulation_inputs(mod: Modulation) -> dict[str, Tensor]:
    """The DiT graphs' time inputs: every block's AdaLN modulation ``mod_blocks`` [depth, B, 6 dim] and the output
    norm's ``mod_final`` [B, 2 dim]."""
    return {"mod_blocks": torch.stack(mod.blocks), "mod_final": mod.final}


def modulation_of(mod_blocks: Tensor, mod_final: Tensor) -> Modulation:
    """The :class:`Modulation` a graph's :func:`modulation_inputs` stand for."""
    return Modulation(tuple(mod_blocks.unbind(0)), mod_final)


class EstimatorGraph(nn.Module):
    def __init__(self, dit: DiT) -> None:
        super().__init__()
        self.dit = dit

    def forward(self, x: Tensor, mu: Tensor, mod_blocks: Tensor, mod_final: Tensor, spks: Tensor, cond: Tensor,
                mask: Tensor) -> Tensor:
        out, _, _ = self.dit.trunk(x, mu, modulation_of(mod_blocks, mod_final), spks, cond, mask)
        return out


class CachedEstimatorGraph(nn.Module):
    """Inputs ``x, mu, mod_blocks, mod_final, spks, cond, mask [n, past + n], tail1, tail2, cache_k_0, cache_v_0,
    ...`` (buffers of at least ``past`` frames); outputs the velocity, the convs' inputs and the new frames'
    keys/values per block."""

    def __init__(self, dit: DiT) -> None:
        super().__init__()
        self.dit = dit

    def forward(self, x: Tensor, mu: Tensor, mod_blocks: Tensor, mod_final: Tensor, spks: Tensor, cond: Tensor,
                mask: Tensor, tail1: Tensor, tail2: Tensor, *buffers: Tensor) -> tuple[Tensor, ...]:
        length = mask.shape[1] - x.shape[2]  # the true past: the buffers' frames after it are room
        kv = [PastFrames(buffers[2 * i][:, :, :length], buffers[2 * i + 1][:, :, :length])
              for i in range(len(buffers) // 2)]
        out, conv_inputs, new = self.dit.trunk(x, mu, modulation_of(mod_blocks, mod_final), spks, cond, mask,
                                               DiTCache(length, (tail1, tail2), kv))
        return (out, *conv_inputs, *(y for pair in new for y in pair))


def cached_io_names(depth: int) -> tuple[list[str], list[str]]:
    """Input and output names of ``flow_estimator_cached`` for a DiT of ``depth`` blocks."""
    inputs = ["x", "mu", "mod_blocks", "mod_final", "spks", "cond", "mask", "tail1", "tail2"]
    outputs = ["velocity", "conv_in1", "conv_in2"]
    for i in range(depth):
        inputs += [f"cache_k_{i}", f"cache_v_{i}"]
        outputs += [f"new_k_{i}", f"new_v_{i}"]
    return inputs, outputs


def check_cached_io(path: str, inputs: list[str], outputs: list[str], depth: int) -> None:
    """Refuse a ``flow_estimator_cached`` file whose interface is not this version's (a format-1 export returned
    past + new keys/values, formats 1-3 take the time ``t``), saying how to redo it."""
    if (sorted(inputs), sorted(outputs)) != tuple(sorted(names) for names in cached_io_names(depth)):
        raise ModelBundleError(
            f"{path} is not the flow_estimator_cached graph this version runs (an older export's inputs or outputs): "
            "delete the model folder's onnx/ to have it exported again on the next start, "
            "or run `python -m cosyvoice.bin.export_onnx MODEL_DIR`")


class DFTSpectral(nn.Module):
    """``torch.stft`` / ``torch.istft`` (centered, reflect-padded, periodic Hann) as convolutions."""

    def __init__(self, n_fft: int, hop: int, window: Tensor) -> None:
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        n = torch.arange(n_fft, dtype=torch.float64)
        k = torch.arange(n_fft // 2 + 1, dtype=torch.float64)
        angle = 2 * math.pi * k[:, None] * n[None, :] / n_fft  # [bins, n_fft]
        win = window.to(torch.float64)
        # forward: X_k = sum_n w[n] x[n] e^{-i angle}
        self.register_buffer("analysis", torch.cat((win * angle.cos(), -win * angle.sin()))[:, None].float())
        # inverse (irfft, one-sided): bins 1..n/2-1 count twice; the imaginary parts of DC and Nyquist are unused
        weight = torch.full((k.shape[0], 1), 2.0, dtype=torch.float64)
        weight[0] = weight[-1] = 1.0
        synthesis = torch.cat((weight * angle.cos(), -weight * angle.sin())) / n_fft * win
        self.register_buffer("synthesis", synthesis[:, None].float())
        self.register_buffer("window_sq", (win ** 2)[None, None].float())

    def stft(self, x: Tensor) -> tuple[Tensor, Tensor]:
        pad = self.n_fft // 2
        frames = F.conv1d(F.pad(x[:, None], (pad, pad), mode="reflect"), self.analysis, stride=self.hop)
        bins = self.n_fft // 2 + 1
        return frames[:, :bins], frames[:, bins:]

    def istft(self, real: Tensor, imag: Tensor) -> Tensor:
        frames = torch.cat((real, imag), dim=1)
        wav = F.conv_transpose1d(frames, self.synthesis, stride=self.hop)[:, 0]
        envelope = F.conv_transpose1d(torch.ones_like(frames[:1, :1]), self.window_sq, stride=self.hop)[:, 0]
        pad = self.n_fft // 2
        return (wav / envelope)[:, pad: wav.shape[1] - pad]


class VocoderGraph(nn.Module):
    """:meth:`CausalHiFTGenerator.decode_window` of a copy of the vocoder with weight norm folded and the
    DFT-basis spectral transforms in place of ``torch.stft``/``torch.istft``."""

    def __init__(self, hift: CausalHiFTGenerator) -> None:
        super().__init__()
        # a new module, not a deepcopy: removing a parametrization edits the parametrized class the copy shares
        self.hift = CausalHiFTGenerator(hift.cfg)
        self.hift.load_state_dict(hift.state_dict())
        self.hift.fold_weight_norm()
        self.spectral = DFTSpectral(hift.n_fft, hift.hop, hift._window)
        self.hift.source_stft, self.hift.istft = self.spectral.stft, self.spectral.istft

    def forward(self, mel: Tensor, source: Tensor) -> Tensor:
        return self.hift.decode_window(mel, source)
