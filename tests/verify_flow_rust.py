"""The Rust flow (rust/native-server through ``cosyvoice_rust_backend``) against our Python flow and the official
golden fixtures (``flow.safetensors``, ``t2w.safetensors``): every flow call token2wav issues, from the same
tokens, prompt features and fixed noise.

Each mel must lie within the parity tool's flow tolerance (max-abs ``FLOW_MEL_ATOL``) of both the reference and
our Python flow, and its mean absolute difference (L1) under ``FLOW_L1_FLOOR``. pytest collects this file by
pyproject's ``python_files``; run with ``-s`` to see the rows.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest
import torch

from cosyvoice.config import load_config
from cosyvoice.tools.parity.common import Golden, Result, compare
from cosyvoice.tools.parity.flow import FILE, T2W_FILE, build_flow
from cosyvoice.tools.parity.tolerances import FLOW_MEL_ATOL, FLOW_NOISE_ATOL
from tests.rust_parity import assert_rows

FLOW_L1_FLOOR = 2e-3  # mean |Rust - other| over a mel: the design's floor, checked beside the max-abs bound


def _rows(name: str, rust: np.ndarray, python: torch.Tensor, reference: np.ndarray | None) -> list[Result]:
    """Rust against Python (max-abs and L1), and against the reference where the fixtures hold this call."""
    rows = [compare("flow", f"{name} rust~python", rust, python, FLOW_MEL_ATOL)]
    l1 = rows[0].mean_abs
    rows.append(Result("flow", f"{name} rust~python L1", l1, l1, FLOW_L1_FLOOR, l1 < FLOW_L1_FLOOR))
    if reference is not None:
        rows.append(compare("flow", f"{name} rust~reference", rust, reference, FLOW_MEL_ATOL))
        l1 = rows[-1].mean_abs
        rows.append(Result("flow", f"{name} rust~reference L1", l1, l1, FLOW_L1_FLOOR, l1 < FLOW_L1_FLOOR))
    return rows


def _calls(golden: Golden) -> list[tuple[str, int, bool, bool]]:
    """(name, tokens, streaming, finalize) of every flow call the fixtures hold (golden README 6 and 7)."""
    n_all = golden.arrays(FILE)["token"].shape[1]
    calls = [("nonstream_mel", n_all, False, True), ("chunkmask_final_mel", n_all, True, True)]
    calls += [(f"stream{i}_mel", int(c["token_len"]), bool(c["streaming"]), bool(c["finalize"]))
              for i, c in enumerate(golden.scalar(FILE, "stream_calls"))]
    return calls


def test_rust_flow_matches_python_and_reference(golden: Golden, rust_backend: ModuleType) -> None:
    arrays = golden.arrays(FILE)
    # the noise handed over explicitly: the fixture's stored prefix, as our Python flow gets it
    rust = rust_backend.Model(str(golden.bundle_dir), noise=arrays["rand_noise_prefix"])
    python = build_flow(golden)
    token, prompt_token = arrays["token"], arrays["prompt_token"]
    prompt_feat, embedding = arrays["prompt_feat"], arrays["embedding"]
    t = {k: torch.from_numpy(np.ascontiguousarray(arrays[k])) for k in ("token", "prompt_token", "prompt_feat",
                                                                       "embedding")}
    results = []
    for name, n, streaming, finalize in _calls(golden):
        ours = rust.flow_mel(token[:, :n], prompt_token, prompt_feat, embedding, streaming=streaming,
                             finalize=finalize)
        with torch.inference_mode():
            theirs = python.inference(t["token"][:, :n], n, t["prompt_token"], prompt_token.shape[1],
                                      t["prompt_feat"], prompt_feat.shape[1], t["embedding"], streaming=streaming,
                                      finalize=finalize)
        results += _rows(name, ours, theirs, arrays[name])
    assert_rows(results)


@pytest.mark.parametrize("n_steps", [1, 5])
def test_rust_flow_other_step_counts_match_python(golden: Golden, rust_model: object, n_steps: int) -> None:
    """Fewer Euler steps (the fast path's setting): no fixture, so Rust is held to our Python flow; the mel must
    also differ from the 10-step one, so the step count really reached the solver."""
    arrays = golden.arrays(FILE)
    args = (arrays["token"], arrays["prompt_token"], arrays["prompt_feat"], arrays["embedding"])
    ours = rust_model.flow_mel(*args, n_steps=n_steps)
    t = [torch.from_numpy(np.ascontiguousarray(a)) for a in args]
    with torch.inference_mode():
        theirs = build_flow(golden).inference(t[0], t[0].shape[1], t[1], t[1].shape[1], t[2], t[2].shape[1], t[3],
                                              streaming=False, finalize=True, n_steps=n_steps)
    assert np.abs(ours - arrays["nonstream_mel"]).max() > 10 * FLOW_MEL_ATOL
    assert_rows(_rows(f"nonstream_mel {n_steps} steps", ours, theirs, None))


def test_rust_flow_of_the_streamed_token2wav(golden: Golden, rust_model: object) -> None:
    """The mel each streamed chunk hands the vocoder (``chunk*_flow_mel_used``), sliced at its token offset as
    token2wav keeps it; the model runs on the official noise it replays itself (its head is the fixture's)."""
    flow, t2w = golden.arrays(FILE), golden.arrays(T2W_FILE)
    ratio = load_config(golden.bundle_dir).token_mel_ratio
    results = []
    for i, chunk in enumerate(golden.scalar(T2W_FILE, "chunks")):
        n = int(chunk["flow_token_len"])
        mel = rust_model.flow_mel(t2w["token"][:, :n], flow["prompt_token"], flow["prompt_feat"], flow["embedding"],
                                  streaming=bool(chunk["flow_streaming"]), finalize=bool(chunk["finalize"]))
        first = int(chunk["token_offset"]) * ratio
        results.append(compare("flow", f"t2w chunk{i} mel used rust~reference", mel[:, :, first:],
                               t2w[f"chunk{i}_flow_mel_used"], FLOW_MEL_ATOL))
    assert_rows(results)


def test_rust_replays_the_official_noise(golden: Golden, rust_backend: ModuleType) -> None:
    prefix = golden.arrays(FILE)["rand_noise_prefix"]
    noise = rust_backend.cfm_noise()
    assert noise.shape == (1, prefix.shape[1], 15000)
    assert_rows([compare("flow", "cfm_noise prefix rust~reference", noise[:, :, : prefix.shape[2]], prefix,
                         FLOW_NOISE_ATOL)])
