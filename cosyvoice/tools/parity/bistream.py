"""Text-stream (bi-streaming) parity: our :func:`bistream_job` against ``bistream.safetensors`` (golden §13).

The reference ran ``inference_bistream`` with the text given as pieces (``piece_sizes``) and a forced
sampler. We run our job through :func:`run_eager` on a :class:`TokenStream` that receives the next piece
only when the job waits for text (the reference pulls the next piece at exactly that point), replay the
forced decisions, and record every input the job feeds: the schedule (``fed_lens``) must be exact, the
fed embeddings bit for bit, and the sampler's log-probs (after the ``ignore_eos`` ban) within the LLM
tolerance.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from cosyvoice.config import load_config
from cosyvoice.llm import CosyVoice3LM
from cosyvoice.llm.bistream import bistream_job
from cosyvoice.llm.job import Job, Step, TokenStream, run_eager
from cosyvoice.tools.parity.common import Golden, Result, compare, compare_exact
from cosyvoice.tools.parity.tolerances import LLM_LOGP_ATOL
from cosyvoice.weights import load_weights

COMPONENT = "bistream"
FILE = "bistream.safetensors"


def recorded(job: Job, fed: list[torch.Tensor]) -> Job:
    """``job`` unchanged, appending each Step's embeddings to ``fed``."""
    request = next(job)
    while True:
        if isinstance(request, Step):
            fed.append(request.embeds.detach().cpu().clone())
        reply = yield request
        try:
            request = job.send(reply)
        except StopIteration as done:
            return done.value


def replay(model: CosyVoice3LM, prompt_text: torch.Tensor, prompt_speech: torch.Tensor, pieces: Sequence[list[int]],
           decisions: Sequence[int]) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int], list[int]]:
    """(fed embeddings per call, the sampler's log-probs per decision, the call of each decision, yielded
    tokens) of one forced run."""
    stream = TokenStream()
    queue = list(pieces)

    def next_piece() -> None:  # the job waits: hand it the next piece, or end the text
        if queue:
            stream.put(queue.pop(0))
        else:
            stream.close()

    seen: list[torch.Tensor] = []
    calls: list[int] = []

    def sampler(scores: torch.Tensor, history: Sequence[int]) -> int:
        seen.append(scores.detach().cpu().clone())
        calls.append(len(fed) - 1)
        return int(decisions[len(seen) - 1])

    fed: list[torch.Tensor] = []
    job = bistream_job(model, prompt_text, prompt_speech, stream, max_len=4096, silent_tokens=frozenset(),
                       per_token=False)
    cache = model.llm.new_cache(1, 4096)
    yielded = list(run_eager(model, recorded(job, fed), cache, sampler, wait=next_piece))
    return fed, seen, calls, yielded


def check(golden: Golden, device: str | torch.device = "cpu") -> list[Result]:
    arrays = golden.arrays(FILE)
    meta = golden.json("bistream.json")
    cfg = load_config(golden.bundle_dir)
    model = CosyVoice3LM(cfg.llm)
    load_weights(model, golden.bundle_dir / "llm.pt")
    model = model.to(device).eval()
    text = arrays["text_pieces"].reshape(-1).tolist()
    bounds = np.cumsum([0, *meta["piece_sizes"]])
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    fed, seen, calls, yielded = replay(model, torch.from_numpy(arrays["prompt_text"]), torch.from_numpy(
        arrays["prompt_speech_token"]), pieces, arrays["sampled"].tolist())
    lens = np.array([f.shape[0] for f in fed])
    results = [
        compare_exact(COMPONENT, "fill_token", model.fill, meta["fill_token"]),
        compare_exact(COMPONENT, "piece_sizes sum", int(bounds[-1]), len(text)),
        compare_exact(COMPONENT, "fed_lens", lens, arrays["fed_lens"].astype(lens.dtype)),
        compare(COMPONENT, "fed_embeddings", torch.cat(fed) if fed else torch.empty(0), arrays["fed_embeddings"], 0.0),
        compare(COMPONENT, "logp (sampler input)", torch.stack(seen) if seen else torch.empty(0), arrays["logp"],
                LLM_LOGP_ATOL),
        compare_exact(COMPONENT, "logp_call", np.array(calls), arrays["logp_call"].astype(np.int64)),
        compare_exact(COMPONENT, "yielded", np.array(yielded), arrays["yielded"].astype(np.int64)),
    ]
    return results
