"""LLM parity: ``llm.safetensors`` (teacher-forced decoding) and ``sampling.safetensors`` (nucleus sets).

The golden run replaced the official sampler by one that records its scores and returns a fixed
token sequence (``forced_tokens``, ending with a stop id). We replay exactly that through our
:meth:`CosyVoice3LM.generate` (so the min_len mask, the stop rule and the yielded tokens are
checked too), and separately feed the same tokens step by step / in one full causal pass to compare
hidden states and log-probs. All sizes come from the arrays and the bundle's config.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from cosyvoice.config import SamplingConfig, load_config
from cosyvoice.llm import CosyVoice3LM, nucleus_candidates, nucleus_rows
from cosyvoice.tools.parity.common import Golden, Result, compare, compare_exact
from cosyvoice.tools.parity.tolerances import LLM_HIDDEN_ATOL, LLM_LOGP_ATOL, SAMPLING_PROB_ATOL
from cosyvoice.weights import load_weights

COMPONENT = "llm"
# two log-probs each within LLM_LOGP_ATOL of the reference may swap ranks if they are this close
NEAR_TIE = 2 * LLM_LOGP_ATOL


def compare_topk_order(name: str, ours_logp: torch.Tensor, ref_ids: np.ndarray) -> Result:
    """Top-k ids must match rank by rank, except where our scores tie (within ``NEAR_TIE``).

    At rank j the reference's token must score, in our full log-probs ``ours_logp`` [N, V], within
    ``NEAR_TIE`` of the token we rank j-th; a swap of such near-equal tokens is counted, not failed.
    """
    k = ref_ids.shape[1]
    ours_values, ours_ids = ours_logp.topk(k, dim=-1)
    ref_ids_t = torch.from_numpy(ref_ids).long()
    differs = ours_ids != ref_ids_t
    gap = (ours_logp.gather(1, ref_ids_t) - ours_values).abs()
    swaps = int(differs.sum())
    bad = int((differs & (gap > NEAR_TIE)).sum())
    return Result(COMPONENT, name, float(bad), bad / max(ref_ids.size, 1), 0.0, bad == 0,
                  f"{swaps} near-tie swaps (<= {NEAR_TIE:g})" if swaps else "identical order")


def _topk_results(prefix: str, ours_logp: torch.Tensor, ref_values: np.ndarray, ref_ids: np.ndarray) -> list[Result]:
    k = ref_ids.shape[1]
    return [
        compare(COMPONENT, f"{prefix}_top{k}_values", ours_logp.topk(k, dim=-1).values, ref_values, LLM_LOGP_ATOL),
        compare(COMPONENT, f"{prefix}_at_ref_top{k}_ids", ours_logp.gather(1, torch.from_numpy(ref_ids).long()),
                ref_values, LLM_LOGP_ATOL),
        compare_topk_order(f"{prefix}_top{k}_order", ours_logp, ref_ids),
    ]


def _check_llm(golden: Golden, model: CosyVoice3LM) -> list[Result]:
    arrays = golden.arrays("llm.safetensors")

    def scalar(name: str) -> object:
        return golden.scalar("llm.safetensors", name)

    text = torch.from_numpy(arrays["text_tokens"].reshape(-1)).long()
    prompt_text = torch.from_numpy(arrays["prompt_text_tokens"].reshape(-1)).long()
    prompt_speech = torch.from_numpy(arrays["prompt_speech_tokens"].reshape(-1)).long()
    forced = [int(t) for t in arrays["forced_tokens"]]
    min_len, max_len = model.length_limits(len(text))
    results = [
        compare_exact(COMPONENT, "min_len", min_len, scalar("min_len")),
        compare_exact(COMPONENT, "max_len", max_len, scalar("max_len")),
        compare_exact(COMPONENT, "sos", model.sos, scalar("sos")),
        compare_exact(COMPONENT, "eos", model.eos, scalar("eos_token")),
        compare_exact(COMPONENT, "task_id", model.task_id, scalar("task_id")),
        compare_exact(COMPONENT, "fill", model.fill, scalar("fill_token")),
        compare_exact(COMPONENT, "stop_token_ids", list(model.stop_token_ids), list(scalar("stop_token_ids"))),
    ]

    device = model.speech_embedding.weight.device
    with torch.inference_mode():
        lm_input = model.build_lm_input(text.to(device), prompt_text.to(device), prompt_speech.to(device))
        results.append(compare_exact(COMPONENT, "L", lm_input.shape[1], scalar("L")))
        results.append(compare(COMPONENT, "lm_input", lm_input, arrays["lm_input"], 0.0))
        results += _check_generate(model, arrays, scalar, lm_input, (text, prompt_text, prompt_speech), forced)
        results += _check_teacher_forced(model, arrays, lm_input, forced)
        results += _check_full_pass(model, arrays, lm_input, forced)
    return results


def _check_generate(model: CosyVoice3LM, arrays: dict[str, np.ndarray], scalar: Callable[[str], object],
                    lm_input: torch.Tensor, request: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                    forced: list[int]) -> list[Result]:
    """1. The sampler's view through generate(): a replaying sampler records the scores it gets."""
    seen: list[torch.Tensor] = []

    def replay(scores: torch.Tensor, decoded: Sequence[int]) -> int:
        seen.append(scores.detach().cpu().clone())
        return forced[min(len(seen), len(forced)) - 1]

    yielded = list(model.generate(*request, 0, silent_tokens=frozenset(), sampler=replay))
    results = [compare_exact(COMPONENT, "generate_yielded_tokens", np.array(yielded), np.array(forced[:-1]))]
    head = arrays["logp_kv_head"]
    seen_head = torch.stack(seen[: head.shape[0]]) if seen else torch.empty(0)
    results.append(compare(COMPONENT, "logp_kv_head (sampler input)", seen_head, head, LLM_LOGP_ATOL))
    raw_step0 = model.log_probs(model.llm(lm_input)[0, -1]).cpu()
    masked = torch.nonzero(torch.isinf(seen[0]) & ~torch.isinf(raw_step0)).flatten().tolist() if seen else []
    results.append(compare_exact(COMPONENT, "ignore_eos_masked_index", masked, [scalar("ignore_eos_masked_index")]))
    return results


def _check_teacher_forced(model: CosyVoice3LM, arrays: dict[str, np.ndarray], lm_input: torch.Tensor,
                          forced: list[int]) -> list[Result]:
    """2. Teacher-forced step-by-step decoding with our KV cache."""
    cache = model.llm.new_cache(1, lm_input.shape[1] + len(forced))
    hidden_steps, x, start = [], lm_input, 0
    for token in forced:
        hidden, _ = model.decode_step(x, start, cache)
        hidden_steps.append(hidden[0])
        start += x.shape[1]
        x = model.speech_embedding.weight[token].view(1, 1, -1)
    hidden_kv = torch.stack(hidden_steps)
    results = [compare(COMPONENT, "hidden_kv", hidden_kv, arrays["hidden_kv"], LLM_HIDDEN_ATOL)]
    logits = model.llm_decoder(hidden_kv).float()
    results.append(compare(COMPONENT, "logp_kv_logsumexp", logits.logsumexp(-1), arrays["logp_kv_logsumexp"],
                           LLM_LOGP_ATOL))
    return results + _topk_results("logp_kv", logits.log_softmax(-1).cpu(), arrays["logp_kv_top32_values"],
                                   arrays["logp_kv_top32_indices"])


def _check_full_pass(model: CosyVoice3LM, arrays: dict[str, np.ndarray], lm_input: torch.Tensor,
                     forced: list[int]) -> list[Result]:
    """3. One causal pass over prompt + forced tokens, no cache."""
    fed = torch.tensor(forced[:-1], dtype=torch.long, device=lm_input.device)
    hidden_full = model.llm(torch.cat([lm_input, model.speech_embedding(fed)[None]], dim=1))[0]
    results = [compare(COMPONENT, "hidden_full", hidden_full, arrays["hidden_full"], LLM_HIDDEN_ATOL)]
    full_logp = model.log_probs(hidden_full[lm_input.shape[1] - 1:]).cpu()
    return results + _topk_results("logp_full", full_logp, arrays["logp_full_top32_values"],
                                   arrays["logp_full_top32_indices"])


def _check_sampling(golden: Golden, model: CosyVoice3LM) -> list[Result]:
    arrays = golden.arrays("sampling.safetensors")
    params = golden.scalar("sampling.safetensors", "ras_params")
    sampling = SamplingConfig(**params)
    results = [compare_exact(COMPONENT, "sampling_params (yaml)", model.cfg.sampling, sampling)]
    cases = {c["name"]: c for c in golden.scalar("sampling.safetensors", "cases")}
    for name in sorted(k[: -len("_candidates")] for k in arrays if k.endswith("_candidates")):
        logp = torch.from_numpy(arrays[f"{name}_logp"])
        ids, probs = nucleus_candidates(logp, sampling.top_p, sampling.top_k)
        results.append(compare_exact(COMPONENT, f"nucleus_{name}_candidates", ids.numpy(),
                                     arrays[f"{name}_candidates"]))
        # the engine's batched, on-device nucleus (what it actually samples from) must be the same set
        row_ids, _, keep = nucleus_rows(logp.reshape(1, -1), sampling.top_p, sampling.top_k)
        results.append(compare_exact(COMPONENT, f"nucleus_{name}_batched_candidates",
                                     row_ids[0, keep[0]].numpy(), arrays[f"{name}_candidates"]))
        ref_probs = arrays[f"{name}_candidate_probs"]
        results.append(compare(COMPONENT, f"nucleus_{name}_probs", probs, ref_probs, SAMPLING_PROB_ATOL))
        draws = cases.get(name, {}).get("draws_seed0to4")
        if draws is not None:
            outside = sorted(set(draws) - set(ids.tolist()))
            # the reference's seeded draws must lie in our candidate set; replaying them draw for draw is not a
            # parity target (golden README 5: RNG-matched sampling is not expected to be reproducible)
            results.append(compare_exact(COMPONENT, f"nucleus_{name}_ref_draws_in_set", outside, []))
    return results


def check(golden: Golden, device: str | torch.device = "cpu") -> list[Result]:
    """Every LLM and sampler comparison of a golden folder, float32 on ``device``."""
    cfg = load_config(golden.bundle_dir)
    model = CosyVoice3LM(cfg.llm)
    load_weights(model, golden.bundle_dir / "llm.pt")
    model = model.to(device).eval()
    return _check_llm(golden, model) + _check_sampling(golden, model)
