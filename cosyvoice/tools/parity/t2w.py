"""Streaming token2wav parity: the engine's chunk policy + flow + HiFT against ``t2w.safetensors``.

The reference drove ``CosyVoice3Model.tts(stream=True)`` with given speech tokens (its voice-conversion
path) on a fresh model; we drive :meth:`Engine.vocode` the same way, with the default (officially
replayed) random buffers, and compare every emitted chunk and its bookkeeping.
"""

from __future__ import annotations

import torch

from cosyvoice.bundle import validate_model_dir
from cosyvoice.engine import Engine
from cosyvoice.frontend.frontend import ModelInput
from cosyvoice.settings import Limits
from cosyvoice.tools.parity.common import Golden, Result, compare, compare_exact
from cosyvoice.tools.parity.tolerances import T2W_PCM_ATOL, T2W_PCM_CUDA_ATOL

FILE = "t2w.safetensors"


def build_engine(golden: Golden, device: str | torch.device = "cpu") -> Engine:
    bundle = validate_model_dir(golden.bundle_dir)
    device = torch.device(device)
    return Engine(bundle.config, bundle.load_llm(device), bundle.load_flow(device), bundle.load_hift(device),
                  device, Limits())


def check(golden: Golden, device: str | torch.device = "cpu") -> list[Result]:
    t2w = golden.arrays(FILE)
    flow = golden.arrays("flow.safetensors")
    engine = build_engine(golden, device)
    atol = T2W_PCM_CUDA_ATOL if engine.device.type == "cuda" else T2W_PCM_ATOL
    inp = ModelInput(
        text=torch.zeros(1, 0, dtype=torch.int32), prompt_text=torch.zeros(1, 0, dtype=torch.int32),
        llm_prompt_speech_token=torch.zeros(1, 0, dtype=torch.int32),
        flow_prompt_speech_token=torch.from_numpy(flow["prompt_token"]),
        prompt_speech_feat=torch.from_numpy(flow["prompt_feat"]), flow_embedding=torch.from_numpy(flow["embedding"]))
    tokens = torch.from_numpy(t2w["token"]).reshape(-1)
    chunks = list(engine.vocode(tokens, inp, stream=True))
    ref = golden.scalar(FILE, "chunks")
    results = [compare_exact("t2w", "chunk count", len(chunks), len(ref))]
    for i, (ours, theirs) in enumerate(zip(chunks, ref, strict=False)):
        results.append(compare_exact("t2w", f"chunk{i} token_offset", ours.token_start, theirs["token_offset"]))
        results.append(compare_exact("t2w", f"chunk{i} sample offset", ours.sample_offset,
                                     theirs["speech_offset_before"]))
        results.append(compare_exact("t2w", f"chunk{i} final", ours.final, bool(theirs["finalize"])))
        results.append(compare("t2w", f"chunk{i}_pcm", ours.pcm, t2w[f"chunk{i}_pcm"].reshape(-1), atol))
    whole = list(engine.vocode(tokens, inp, stream=False))
    results.append(compare_exact("t2w", "non-stream samples", sum(c.pcm.numel() for c in whole),
                                 golden.scalar(FILE, "nonstream_pcm_len")))
    return results
