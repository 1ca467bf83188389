"""onnxruntime sessions for the exported graphs, fed and drained as torch tensors (I/O binding, no copies).

Inputs are bound by pointer and outputs into torch tensors allocated here (their shapes follow from the
inputs), on the CPU or on CUDA with the CUDA execution provider. The runners of
:mod:`cosyvoice.backends.runners` call :meth:`OrtGraph.run` with the names of the graphs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from cosyvoice.errors import ModelBundleError

_NP_TYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.bool: np.bool_, torch.int64: np.int64}


def cuda_provider_available() -> bool:
    import onnxruntime as ort

    return "CUDAExecutionProvider" in ort.get_available_providers()


def cpu_stage_threads(stage: int) -> int:
    """Intra-op threads of engine stage ``stage``'s sessions (0: the LLM, 1: token-to-wave): the LLM's share of
    torch's thread count (:func:`~cosyvoice.engine.engine.stage_threads`); token-to-wave all of it. Its sessions'
    pools never spin (``allow_spinning`` 0): while the LLM decodes, a pool thread that finds no core waits
    instead of burning one, and whenever the LLM has no step to run (its session held for the first chunk, the
    request decoded) the DiT has the whole machine: on two cores the RTF 6.6 -> 4.9 with the reference's last
    call (docs/perf.md, 2026-12-06, 12:20)."""
    from cosyvoice.engine.engine import stage_threads

    cores = torch.get_num_threads()
    return stage_threads(cores)[0] if stage == 0 else cores


class OrtGraph:
    """One onnxruntime session on ``device`` (CPU, or CUDA through the CUDA execution provider).

    ``threads``: its intra-op threads (None: onnxruntime's default, one per physical core). On the CPU the callers
    pass their engine stage's (:func:`cpu_stage_threads`): each session owns a pool, and the LLM's and the
    token-to-wave stage's run at once. On the CPU each run
    hands its memory arena back when it ends (``memory.enable_memory_arena_shrinkage``): within a run the ops reuse
    the arena's memory instead of mapping and faulting in fresh pages for every large activation (the DiT's last
    call over a whole utterance faulted ~3 M pages a 10 s request without an arena), and a kept arena would hold the
    largest activations (the DiT's over the longest call) for the process's life.
    """

    def __init__(self, path: Path, device: torch.device, threads: int | None = None) -> None:
        import onnxruntime as ort

        self.device = device
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1  # the sequential executor: a graph's ops run one after another
        # no busy-waiting between ops: the LLM's thread shares the cores with these sessions
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.enable_cpu_mem_arena = True
        if device.type == "cuda":
            if not cuda_provider_available():
                raise ModelBundleError("onnxruntime has no CUDA execution provider here: install onnxruntime-gpu "
                                       "(`pip install .[gpu]`) or use backend='torch'")
            # cudnn_conv_algo_search: the default exhaustive search runs again for every new length
            providers: list[object] = [("CUDAExecutionProvider", {"device_id": device.index or 0,
                                                                  "cudnn_conv_algo_search": "HEURISTIC"})]
        else:
            providers = ["CPUExecutionProvider"]
        self.session = ort.InferenceSession(str(path), options, providers=providers)
        self._kind = "cuda" if device.type == "cuda" else "cpu"
        self._index = device.index or 0
        self._keeping, self._shrinking = ort.RunOptions(), ort.RunOptions()
        if device.type == "cpu":
            self._shrinking.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")

    def run(self, inputs: dict[str, Tensor], outputs: dict[str, Tensor], bounded: bool = False) -> None:
        """Run with ``inputs`` and write into the preallocated ``outputs`` (all on this graph's device).
        ``bounded``: the run's activations are a stream chunk's, small and about the same from run to run, so the
        CPU arena keeps them for the next one instead of handing them back: faulting them in afresh cost the int8
        DiT's chunk steps 5 % (docs/perf.md). Other runs (a whole utterance's: 235 MB of activations kept at 9 s of
        speech, 622 MB at 18 s) give the arena back."""
        binding = self.session.io_binding()
        held = []  # contiguous copies must outlive the run
        for name, tensor in inputs.items():
            tensor = tensor.contiguous()
            if tensor.numel() == 0:  # an empty view of a real allocation: an empty tensor's null pointer is refused
                base = tensor.new_empty([max(size, 1) for size in tensor.shape])
                tensor = base[tuple(slice(0, size) for size in tensor.shape)]
            held.append(tensor)
            binding.bind_input(name, self._kind, self._index, _NP_TYPES[tensor.dtype], tuple(tensor.shape),
                               tensor.data_ptr())
        for name, tensor in outputs.items():
            assert tensor.is_contiguous()
            binding.bind_output(name, self._kind, self._index, _NP_TYPES[tensor.dtype], tuple(tensor.shape),
                                tensor.data_ptr())
        if self._kind == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # onnxruntime runs on its own stream
        self.session.run_with_iobinding(binding, self._keeping if bounded else self._shrinking)
