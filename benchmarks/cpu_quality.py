"""The quality section of ``benchmark_cpu.py`` (its module docstring, 3.): each fast path against fp32 on the
golden inputs, and the mel errors the floor section reports for the DiT's paths."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch

from cosyvoice.backends import precision as fast
from cosyvoice.bundle import validate_model_dir
from cosyvoice.flow import FlowStream

FLOW_INPUTS = ("token", "prompt_token", "prompt_feat", "embedding")


def golden_tensors(golden_dir: Path, name: str, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The ``keys`` of the golden file ``name`` as tensors."""
    from safetensors.numpy import load_file

    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in load_file(golden_dir / name).items()
            if k in keys}


def golden_flow_inputs(golden_dir: Path) -> dict[str, torch.Tensor]:
    """The flow's golden inputs (tokens, prompt tokens and features, speaker embedding)."""
    return golden_tensors(golden_dir, "flow.safetensors", FLOW_INPUTS)


@torch.inference_mode()
def quality(golden_dir: Path, bundles: dict[str, Path], paths: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Each fast path against fp32 on the golden inputs (see ``benchmark_cpu.py``'s module docstring)."""
    flow_in = golden_flow_inputs(golden_dir)
    llm_in = {k: v.reshape(-1).long() for k, v in golden_tensors(golden_dir, "llm.safetensors", (
        "text_tokens", "prompt_text_tokens", "prompt_speech_tokens", "forced_tokens")).items()}
    out: dict[str, dict[str, float]] = {}
    for label, root in bundles.items():
        bundle = validate_model_dir(root)
        ref_flow, ref_llm = bundle.load_flow(), bundle.load_llm()
        lm_input = ref_llm.build_lm_input(llm_in["text_tokens"], llm_in["prompt_text_tokens"],
                                          llm_in["prompt_speech_tokens"])
        for kind in paths:
            row = flow_quality(ref_flow, fast.apply_flow(copy.deepcopy(ref_flow), kind), flow_in)
            row["llm_kl_mean"] = fast.llm_kl(ref_llm, fast.apply_llm(copy.deepcopy(ref_llm), kind), lm_input,
                                             llm_in["forced_tokens"])
            row["holds"] = float(fast.holds(row))
            out[f"{label}: {kind}"] = row
    return out


def flow_quality(ref: torch.nn.Module, got: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, float]:
    """The worst mel error of ``got`` against ``ref`` whole, chunk-masked and streamed (FlowStream, two calls)."""
    return mel_errors(quality_mels(ref, inputs), quality_mels(got, inputs))


def quality_mels(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """``model``'s mels of ``inputs`` whole, chunk-masked and streamed (FlowStream, two calls)."""
    tok, ptok, pfeat, emb = (inputs[k] for k in FLOW_INPUTS)
    mels = [model.inference(tok, tok.shape[1], ptok, ptok.shape[1], pfeat, pfeat.shape[1], emb, streaming, True)
            for streaming in (False, True)]
    half = tok.shape[1] // 2
    stream = FlowStream(model, ptok, pfeat, emb)
    return [*mels, torch.cat([stream.inference(tok[:, :half], False), stream.inference(tok[:, half:], True)], 2)]


def mel_errors(ref: list[torch.Tensor], got: list[torch.Tensor]) -> dict[str, float]:
    errors = [fast.mel_error(r, g) for r, g in zip(ref, got, strict=True)]
    return {k: max(e[k] for e in errors) for k in errors[0]}
