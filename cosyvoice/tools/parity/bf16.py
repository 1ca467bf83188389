"""``--dtype bf16``: how far the bf16 LLM and flow (CUDA only) move outputs from our float32 ones.

A report, not a gate: no golden fixture exists for half precision. Rows give bf16 - fp32 on the golden
inputs: the teacher-forced LLM log-probs (and how often the top token changes), the non-streaming flow mel,
and the streamed token2wav mel and PCM through the engine (the vocoder always runs in float32).
"""

from __future__ import annotations

import numpy as np
import torch

from cosyvoice.tools.parity.common import Golden, Result, compare
from cosyvoice.tools.parity.t2w import build_engine, model_input

COMPONENT = "bf16"


def _report(name: str, bf16: torch.Tensor, fp32: torch.Tensor, note: str = "bf16 - fp32") -> Result:
    r = compare(COMPONENT, name, bf16.float().cpu(), fp32.float().cpu(), float("inf"))
    return Result(COMPONENT, name, r.max_abs, r.mean_abs, float("inf"), r.passed, note if r.passed else r.note)


@torch.inference_mode()
def check(golden: Golden, device: str | torch.device = "cuda") -> list[Result]:
    device = torch.device(device)
    if device.type != "cuda":
        return [Result(COMPONENT, "(skipped)", 0.0, 0.0, 0.0, False, "bf16 runs on CUDA only: pass --device cuda")]
    full, half = build_engine(golden, device), build_engine(golden, device, torch.bfloat16)
    results = []

    llm = golden.arrays("llm.safetensors")
    text, prompt_text, prompt_speech, forced = (torch.from_numpy(llm[k].reshape(-1)).long().to(device) for k in (
        "text_tokens", "prompt_text_tokens", "prompt_speech_tokens", "forced_tokens"))
    logps = []
    for engine in (full, half):
        lm = engine.llm
        lm_input = lm.build_lm_input(text, prompt_text, prompt_speech)
        fed = lm.speech_embedding(forced[:-1])[None]
        hidden = lm.llm(torch.cat([lm_input, fed], dim=1))[0, lm_input.shape[1] - 1:]
        logps.append(lm.log_probs(hidden))
    top = logps[0].topk(32, dim=-1).indices
    results.append(_report("llm_logp_top32", logps[1].gather(1, top), logps[0].gather(1, top)))
    changed = float((logps[1].argmax(-1) != logps[0].argmax(-1)).float().mean())
    results.append(Result(COMPONENT, "llm_top1_changed_fraction", changed, changed, float("inf"), True,
                          "share of steps whose most likely token differs"))

    flow = {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in golden.arrays(
        "flow.safetensors").items()}
    mels = [engine.flow.inference(flow["token"], flow["token"].shape[1], flow["prompt_token"],
                                  flow["prompt_token"].shape[1], flow["prompt_feat"], flow["prompt_feat"].shape[1],
                                  flow["embedding"], streaming=False, finalize=True) for engine in (full, half)]
    results.append(_report("flow_nonstream_mel", mels[1], mels[0]))

    tokens = torch.from_numpy(golden.arrays("t2w.safetensors")["token"]).reshape(-1)
    inp = model_input(golden)
    streamed = [list(engine.vocode(tokens, inp, stream=True)) for engine in (full, half)]
    for i, (a, b) in enumerate(zip(*streamed, strict=True)):
        results.append(_report(f"t2w_chunk{i}_pcm", b.pcm, a.pcm))
    full.close()
    half.close()
    return results
