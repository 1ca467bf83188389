"""Streaming token2wav parity: the engine's chunk policy + flow + HiFT against ``t2w.safetensors``.

The reference drove ``CosyVoice3Model.tts(stream=True)`` with given speech tokens (its voice-conversion
path) on a fresh model; we drive :meth:`Engine.vocode` the same way, with the default (officially
replayed) random buffers, and compare every emitted chunk, its bookkeeping, the mel that fed it and what our
vocoder makes of the reference's own mel.
"""

from __future__ import annotations

import torch

from cosyvoice.bundle import validate_model_dir
from cosyvoice.engine import Engine
from cosyvoice.frontend.frontend import ModelInput
from cosyvoice.hifigan import CausalHiFTGenerator, HiFTStream
from cosyvoice.settings import Limits
from cosyvoice.tools.parity.common import Golden, Result, compare, compare_exact
from cosyvoice.tools.parity.flow import t2w_stream_mels
from cosyvoice.tools.parity.tolerances import (
    HIFT_AUDIO_ATOL,
    T2W_MEL_ATOL,
    T2W_MEL_CUDA_ATOL,
    T2W_PCM_ATOL,
    T2W_VOCODER_CUDA_ATOL,
)

FILE = "t2w.safetensors"


def build_engine(golden: Golden, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 **options) -> Engine:
    bundle = validate_model_dir(golden.bundle_dir)
    device = torch.device(device)
    return Engine(bundle.config, bundle.load_llm(device, dtype), bundle.load_flow(device, dtype),
                  bundle.load_hift(device), device, Limits(), **options)


def model_input(golden: Golden) -> ModelInput:
    """The flow prompt and speaker of ``flow.safetensors`` (the t2w run's inputs); no text."""
    flow = golden.arrays("flow.safetensors")
    return ModelInput(
        text=torch.zeros(1, 0, dtype=torch.int32), prompt_text=torch.zeros(1, 0, dtype=torch.int32),
        llm_prompt_speech_token=torch.zeros(1, 0, dtype=torch.int32),
        flow_prompt_speech_token=torch.from_numpy(flow["prompt_token"]),
        prompt_speech_feat=torch.from_numpy(flow["prompt_feat"]), flow_embedding=torch.from_numpy(flow["embedding"]))


def vocode_stream(golden: Golden, hift: CausalHiFTGenerator) -> list[torch.Tensor]:
    """The engine's streaming vocoder (:class:`HiFTStream`) fed the reference's own per-chunk mel
    (``chunk*_flow_mel_used``): the chunks' PCM with every flow difference taken out."""
    t2w = golden.arrays(FILE)
    n = len(golden.scalar(FILE, "chunks"))
    stream = HiFTStream(hift)
    device = next(hift.parameters()).device
    return [stream.inference(torch.from_numpy(t2w[f"chunk{i}_flow_mel_used"]).to(device), finalize=i == n - 1)[0]
            for i in range(n)]


def check(golden: Golden, device: str | torch.device = "cpu") -> list[Result]:
    """Streamed token2wav through the engine, judged where a defect would show (docs/differences.md).

    Per chunk: the bookkeeping (exact); ``mel``: what the engine's flow hands the vocoder against the
    reference's mel, within ``T2W_MEL_ATOL`` (a flow or chunking defect fails here);
    ``vocoder_on_ref_mel``: the engine's streaming vocoder fed the reference's own mel, within the vocoder
    tolerance (a vocoder defect fails here); ``pcm``: the engine end to end, within ``T2W_PCM_ATOL``, a bound
    stated to cover the vocoder's phase amplification of rounding-level mel differences across CPUs.
    """
    t2w = golden.arrays(FILE)
    engine = build_engine(golden, device)
    cuda = engine.device.type == "cuda"
    mel_atol = T2W_MEL_CUDA_ATOL if cuda else T2W_MEL_ATOL
    vocoder_atol = T2W_VOCODER_CUDA_ATOL if cuda else HIFT_AUDIO_ATOL
    inp = model_input(golden)
    tokens = torch.from_numpy(t2w["token"]).reshape(-1)
    chunks = list(engine.vocode(tokens, inp, stream=True))
    dev = engine.device
    with torch.inference_mode():
        mels = t2w_stream_mels(golden, engine.flow, inp.flow_prompt_speech_token.to(dev),
                               inp.prompt_speech_feat.to(dev), inp.flow_embedding.to(dev))
    on_reference_mel = vocode_stream(golden, engine.hift)
    ref = golden.scalar(FILE, "chunks")
    results = [compare_exact("t2w", "chunk count", len(chunks), len(ref))]
    for i, theirs in enumerate(ref):
        expected = t2w[f"chunk{i}_pcm"].reshape(-1)
        results.append(compare("t2w", f"chunk{i}_mel", mels[i][2], t2w[f"chunk{i}_flow_mel_used"], mel_atol))
        results.append(compare("t2w", f"chunk{i}_vocoder_on_ref_mel", on_reference_mel[i], expected, vocoder_atol))
        if i >= len(chunks):
            results.append(Result("t2w", f"chunk{i}_pcm", float("inf"), float("inf"), T2W_PCM_ATOL, False, "missing"))
            continue
        ours = chunks[i]
        results.append(compare_exact("t2w", f"chunk{i} token_offset", ours.token_start, theirs["token_offset"]))
        results.append(compare_exact("t2w", f"chunk{i} sample offset", ours.sample_offset,
                                     theirs["speech_offset_before"]))
        results.append(compare_exact("t2w", f"chunk{i} final", ours.final, bool(theirs["finalize"])))
        results.append(compare("t2w", f"chunk{i}_pcm", ours.pcm, expected, T2W_PCM_ATOL))
    whole = list(engine.vocode(tokens, inp, stream=False))
    results.append(compare_exact("t2w", "non-stream samples", sum(c.pcm.numel() for c in whole),
                                 golden.scalar(FILE, "nonstream_pcm_len")))
    engine.close()
    return results
