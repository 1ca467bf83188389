"""Flow parity: our CausalMaskedDiffWithDiT against ``flow.safetensors`` (golden README section 6).

Builds the model from the golden bundle's yaml, loads its flow.pt, injects the stored noise
prefix, and compares the conditions, the first estimator call, the three direct
``inference`` calls and the streaming calls listed in the manifest's ``stream_calls``. Also
checks that :func:`cosyvoice.rng.cfm_noise` replays the official noise buffer bit-exactly.
Where the folder has ``t2w.safetensors``, the flow part of its streamed token2wav run
(``chunk*_flow_mel_used``) is checked too, by the recompute path and by :class:`FlowStream`.
"""

from __future__ import annotations

import numpy as np
import torch

from cosyvoice.config import load_config
from cosyvoice.flow.cfm import guidance_batch
from cosyvoice.flow.model import CausalMaskedDiffWithDiT, FlowStream
from cosyvoice.rng import cfm_noise, tensor_sha256
from cosyvoice.tools.parity.common import Golden, Result, compare, compare_exact
from cosyvoice.tools.parity.tolerances import FLOW_MEL_ATOL, STREAM_MEL_ATOL
from cosyvoice.weights import load_weights

FILE = "flow.safetensors"
T2W_FILE = "t2w.safetensors"
COMPONENT = "flow"


def build_flow(golden: Golden, device: str | torch.device = "cpu") -> CausalMaskedDiffWithDiT:
    """The golden bundle's flow model with its weights, noise = the fixture's stored prefix, eval mode."""
    arrays = golden.arrays(FILE)
    flow = CausalMaskedDiffWithDiT(load_config(golden.bundle_dir).flow, noise=torch.from_numpy(
        arrays["rand_noise_prefix"]))
    load_weights(flow, golden.bundle_dir / "flow.pt")
    return flow.to(device).eval()


@torch.inference_mode()
def check(golden: Golden, device: str | torch.device = "cpu") -> list[Result]:
    """Every comparison of ``flow.safetensors`` (and the flow part of ``t2w.safetensors``) on ``device``.

    The flow runs no cuDNN convolution on CUDA (see :func:`cosyvoice.flow.dit.conv1d`), so it needs no TF32
    flags: on an H100 every comparison stays below 1e-5 with torch's defaults.
    """
    arrays = golden.arrays(FILE)
    flow = build_flow(golden, device)
    t = {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in arrays.items()}
    token, prompt_token, prompt_feat, embedding = t["token"], t["prompt_token"], t["prompt_feat"], t["embedding"]
    results = []

    # conditions and the first estimator call of the non-streaming run
    tokens = torch.cat((prompt_token, token), dim=1).long()
    mu = flow.token_condition(tokens, finalize=True).transpose(1, 2)
    spks = flow.speaker_condition(embedding)
    results.append(compare(COMPONENT, "nonstream_mu", mu, t["nonstream_mu"], FLOW_MEL_ATOL))
    results.append(compare(COMPONENT, "nonstream_spks", spks, t["nonstream_spks"], FLOW_MEL_ATOL))
    cfm = flow.decoder
    t0 = cfm.time_grid(mu)[0].expand(2 * mu.shape[0])
    results.append(compare_exact(COMPONENT, "nonstream_est0_t", t0, t["nonstream_est0_t"]))
    z = cfm.start_noise(0, mu.shape[2], mu)
    cond = flow.prompt_condition(prompt_feat, mu.shape[2])
    mu_in, spks_in, cond_in = guidance_batch(mu, spks, cond)
    est0 = cfm.estimator(torch.cat((z, z)), mu_in, t0, spks_in, cond_in, streaming=False)
    results.append(compare(COMPONENT, "nonstream_est0_out", est0, t["nonstream_est0_out"], FLOW_MEL_ATOL))

    def run(n_tokens: int, streaming: bool, finalize: bool) -> torch.Tensor:
        return flow.inference(token[:, :n_tokens], n_tokens, prompt_token, prompt_token.shape[1], prompt_feat,
                              prompt_feat.shape[1], embedding, streaming=streaming, finalize=finalize)

    n_all = token.shape[1]
    results.append(compare(COMPONENT, "nonstream_mel", run(n_all, False, True), t["nonstream_mel"], FLOW_MEL_ATOL))
    results.append(compare(COMPONENT, "chunkmask_final_mel", run(n_all, True, True), t["chunkmask_final_mel"],
                           FLOW_MEL_ATOL))
    for i, call in enumerate(golden.scalar(FILE, "stream_calls")):
        mel = run(int(call["token_len"]), bool(call["streaming"]), bool(call["finalize"]))
        results.append(compare(COMPONENT, f"stream{i}_mel", mel, t[f"stream{i}_mel"], FLOW_MEL_ATOL))

    if golden.has(T2W_FILE):
        results.extend(_check_t2w_flow(golden, flow, prompt_token, prompt_feat, embedding))

    # the default noise recipe replays the official buffer bit-exactly
    noise = cfm_noise()
    prefix = t["rand_noise_prefix"].cpu()
    results.append(compare_exact(COMPONENT, "rng_cfm_noise_prefix", noise[:, :, :prefix.shape[2]], prefix))
    results.append(compare_exact(COMPONENT, "rng_cfm_noise_sha256", tensor_sha256(noise),
                                 golden.scalar(FILE, "rand_noise_sha256_full")))
    return results


def t2w_stream_mels(golden: Golden, flow: CausalMaskedDiffWithDiT, prompt_token: torch.Tensor,
                    prompt_feat: torch.Tensor, embedding: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """The mel each streamed token2wav chunk hands the vocoder, two ways: (first frame, the reference's recompute
    call sliced at its token offset, :class:`FlowStream`'s new frames), per chunk of ``t2w.safetensors``."""
    token = torch.from_numpy(golden.arrays(T2W_FILE)["token"]).long().to(prompt_token.device)
    stream = FlowStream(flow, prompt_token, prompt_feat, embedding)
    out, fed = [], 0
    for chunk in golden.scalar(T2W_FILE, "chunks"):
        n, streaming, finalize = int(chunk["flow_token_len"]), bool(chunk["flow_streaming"]), bool(chunk["finalize"])
        first = int(chunk["token_offset"]) * flow.token_mel_ratio
        recomputed = flow.inference(token[:, :n], n, prompt_token, prompt_token.shape[1], prompt_feat,
                                    prompt_feat.shape[1], embedding, streaming=streaming, finalize=finalize)
        # FlowStream takes only the new tokens and returns only the frames no earlier call returned
        incremental = stream.inference(token[:, fed:n], finalize=finalize, streaming=streaming)
        out.append((first, recomputed[:, :, first:], incremental))
        fed = n
    return out


def _check_t2w_flow(golden: Golden, flow: CausalMaskedDiffWithDiT, prompt_token: torch.Tensor,
                    prompt_feat: torch.Tensor, embedding: torch.Tensor) -> list[Result]:
    """The flow calls of the streamed token2wav run, each sliced at its token offset as token2wav keeps it."""
    arrays = golden.arrays(T2W_FILE)
    results, returned = [], 0
    for i, (first, recomputed, incremental) in enumerate(
            t2w_stream_mels(golden, flow, prompt_token, prompt_feat, embedding)):
        ref = arrays[f"chunk{i}_flow_mel_used"]
        results.append(compare(COMPONENT, f"t2w_chunk{i}_mel_used", recomputed, ref, FLOW_MEL_ATOL))
        results.append(compare_exact(COMPONENT, f"t2w_chunk{i}_flowstream_first_frame", returned, first))
        returned += incremental.shape[2]
        results.append(compare(COMPONENT, f"t2w_chunk{i}_mel_used_flowstream", incremental, ref, FLOW_MEL_ATOL))
        results.append(compare(COMPONENT, f"t2w_chunk{i}_flowstream_vs_recompute", incremental, recomputed,
                               STREAM_MEL_ATOL))
    return results
