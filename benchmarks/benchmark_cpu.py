"""The CPU path, stage by stage and end to end: today's fp32 path, each optimisation added alone, and all together.

    python benchmarks/benchmark_cpu.py                          # released sizes, random weights
    python benchmarks/benchmark_cpu.py --tiny                   # a smoke run in a minute
    python benchmarks/benchmark_cpu.py --golden ../shared/golden   # also the quality bounds of the fast paths

One run, one bundle (released sizes with random weights unless ``--model-dir``: random weights cost what real
ones do), the same seed and text, one streamed request at a time, exactly ``--fixed-tokens`` speech tokens.

1. **Profile** (fp32, each stage alone, with the thread count the engine gives that stage): featurising the
   3 s prompt (frontend), the LLM's prefill of the request's prompt and its decode per token, the DiT per
   Euler step (one CFG-pair call) at the shapes of a stream's first chunk (prompt + first hop) and second
   chunk (new frames over the cached prompt), and the vocoder per chunk.
2. **Rows** (:data:`ROWS`), each in its own process (clean peak RSS, clean thread state): ``fp32`` is today's
   path (precision fp32, both engine threads on every core, as before per-stage threads); each further row
   adds one optimisation to it; ``all`` adds them together. A row that cannot run on this CPU is skipped
   with the reason (bf16 without AVX512-BF16 or AMX). ``reference strategy`` is the reference's engine
   (``benchmarks/reference_engine.py``) over the same modules, in the same run. Per row: first audio p50/p90
   over ``--requests`` requests (each cancelled at its first chunk), the RTF of one request per ``--lengths``
   (10 s and 60 s of speech: how cost grows with length), seconds of compute per second of audio of the LLM
   (every scheduler step, or the reference's LLM thread), the flow and the vocoder (the worker's chunks) in the
   first of them (LLM and worker overlap: the sum may exceed the wall time), load seconds (auto's self-check
   included), peak RSS (VmHWM). A new optimisation is one more entry in :data:`ROWS`.
3. **Quality** (``--golden``): each fast path against fp32 on the golden inputs (the DiT's mel whole, chunk-
   masked and streamed; the LLM's mean KL per teacher-forced step), at the benchmark's sizes and on the golden
   tiny bundle, against :data:`cosyvoice.backends.precision.BOUNDS`.
4. **Threads** (:func:`thread_layouts`): the two stages' intra-op thread counts, measured in isolation from
   the model (wall and CPU seconds of the same work per layout).

5. **Floor** (``--floor``): this machine's own peaks in the same run, one thread, CPU time: fp32 GEMM at the
   DiT's shapes (GFLOPS) and GEMV read bandwidth over a weight far larger than the caches (GB/s); then the DiT
   per Euler step on each path (:data:`DIT_PATHS`: today's torch fp32 recomputing the AdaLN modulation, torch
   with the modulation cache, onnxruntime fp32, onnxruntime int8) at the stream's shapes, beside the step's
   floor (its FLOPs over the GEMM peak, plus its AdaLN weights over the bandwidth where it reads them), and each
   path's mel error against torch fp32 whole, chunk-masked and streamed (the quality bounds at these sizes);
   the LLM on each of :data:`LLM_PATHS` (prefill and decode per token against their floors: FLOPs over the GEMM
   peak, weight bytes over the GEMV bandwidth; KL against fp32) and the vocoder per audio second (its FLOPs,
   counted by torch, over the GEMM peak).

The CPU flags and ``/proc/loadavg`` before and after are printed: other work sharing the cores shows there.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import reference_engine
from benchmark_performance import TEXT, _git_commit, _prompt, bench_bundle

from cosyvoice.backends import precision as fast
from cosyvoice.backends.cpu import cpu_model
from cosyvoice.bundle import validate_model_dir
from cosyvoice.cli.cosyvoice import CosyVoice3
from cosyvoice.engine.engine import stage_threads
from cosyvoice.engine.runner import LLMRunner
from cosyvoice.engine.session import ChunkSchedule
from cosyvoice.engine.t2w import Token2Wav
from cosyvoice.flow import FlowStream
from cosyvoice.frontend.prompts import zero_shot_prompt_text
from cosyvoice.hifigan import HiFTStream
from cosyvoice.settings import Limits


@dataclass(frozen=True)
class Row:
    """One ablation row: the precision, per-stage threads (else both engine threads on every core, as before),
    the voice's flow prefix (``COSYVOICE_PROMPT_CACHE``), the flow's Euler steps (None: the model's 10), the
    stream's final call (``full``: the reference's; ``chunked``), the DiT's backend, and ``reference``: the
    reference's strategy (:class:`ReferenceEngine`, fp32 torch: an LLM thread per request, flow and vocoder
    recomputed over the whole utterance per chunk)."""

    precision: str = "fp32"
    staged: bool = False
    prefix: bool = False
    steps: int | None = None
    final: str = "full"
    backend: str = "torch"
    reference: bool = False


#: "fp32" is today's path; the rows after it add one optimisation each, the "all" rows add them together.
ROWS: dict[str, Row] = {
    "fp32": Row(),
    "+bf16": Row(precision="bf16"),
    "+int8": Row(precision="int8"),
    "+threads": Row(staged=True),
    "+prefix": Row(prefix=True),
    "+6 steps": Row(steps=6),
    "all (auto)": Row("auto", True, True),
    "all (auto), 6 steps": Row("auto", True, True, 6),
    "all (auto), final chunked": Row("auto", True, True, final="chunked"),
    "fp32 exact: onnxruntime DiT, threads, prefix": Row(staged=True, prefix=True, backend="onnxruntime"),
    "reference strategy (fp32)": Row(reference=True),
}
PROMPT_TEXT = "A prompt recording of three seconds."


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM: unlike ru_maxrss it is not inherited across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class StageTimer:
    """Sums the wall time of the scheduler's steps (LLM), the worker's chunk computations (flow + vocoder) and
    its vocoder calls (methods wrapped for this benchmark only); flow = chunks - vocoder."""

    TARGETS = ((LLMRunner, "execute", "llm"), (reference_engine, "run_ticket_eager", "llm_reference"),
               (Token2Wav, "chunks", "t2w"), (Token2Wav, "vocode", "vocoder"))

    def __init__(self) -> None:
        self.seconds = {stage: 0.0 for _, _, stage in self.TARGETS}
        self._saved: list[tuple[type, str, Callable]] = []

    def __enter__(self) -> StageTimer:
        for cls, name, stage in self.TARGETS:
            original = getattr(cls, name)
            self._saved.append((cls, name, original))

            def timed(obj, *args, _original=original, _stage=stage, **kwargs):
                start = time.perf_counter()
                try:
                    return _original(obj, *args, **kwargs)
                finally:
                    self.seconds[_stage] += time.perf_counter() - start

            setattr(cls, name, timed)
        return self

    def __exit__(self, *exc: object) -> None:
        for cls, name, original in self._saved:
            setattr(cls, name, original)
        self.seconds["flow"] = self.seconds.pop("t2w") - self.seconds["vocoder"]
        self.seconds["llm"] += self.seconds.pop("llm_reference")


def _median_time(fn: Callable[[], object], repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


@torch.inference_mode()
def profile(tts: CosyVoice3, prompt_wav: Path, fixed: int) -> dict[str, float]:
    """Each stage alone, fp32, with its engine thread count (see the module docstring)."""
    llm_threads, t2w_threads = stage_threads(torch.get_num_threads())
    frontend = tts.frontend
    out: dict[str, float] = {"llm_threads": llm_threads, "t2w_threads": t2w_threads}
    out["frontend_voice_s"] = _median_time(lambda: frontend.voice(zero_shot_prompt_text(PROMPT_TEXT), prompt_wav))
    voice = frontend.voice(zero_shot_prompt_text(PROMPT_TEXT), prompt_wav)
    inp = frontend.model_input(TEXT, voice)
    llm, flow, hift = tts.engine.llm, tts.engine.flow, tts.engine.hift

    torch.set_num_threads(llm_threads)
    lm_input = llm.build_lm_input(inp.text.reshape(-1).long(), inp.prompt_text.reshape(-1).long(),
                                  inp.llm_prompt_speech_token.reshape(-1).long())
    out["prefill_positions"] = lm_input.shape[1]
    steps = min(fixed, 25)

    def prefill_and_decode() -> tuple[float, float]:
        cache = llm.llm.new_cache(1, lm_input.shape[1] + steps + 1)
        start = time.perf_counter()
        llm.decode_step(lm_input, 0, cache)
        prefill = time.perf_counter() - start
        token = llm.speech_embedding.weight[:1][None]
        start = time.perf_counter()
        for i in range(steps):
            llm.decode_step(token, lm_input.shape[1] + i, cache)
        return prefill, (time.perf_counter() - start) / steps

    runs = [prefill_and_decode() for _ in range(2)]
    out["prefill_s"], out["decode_s_per_token"] = runs[-1]

    torch.set_num_threads(t2w_threads)
    prompt_tokens = inp.flow_prompt_speech_token.shape[1]
    first = 25 + (-prompt_tokens) % 25 + 3  # the chunk policy's first hop (padded to the 25-token grid) + look-ahead
    tokens = torch.randint(0, flow.cfg.vocab_size, (1, first + 50), generator=torch.Generator().manual_seed(0))
    n_steps = flow.decoder.n_timesteps
    stream = FlowStream(flow, inp.flow_prompt_speech_token, inp.prompt_speech_feat, inp.flow_embedding)
    for name, piece in (("first", tokens[:, :first]), ("second", tokens[:, first:first + 50])):
        start = time.perf_counter()
        mel = stream.inference(piece, finalize=False)
        out[f"dit_{name}_chunk_s_per_step"] = (time.perf_counter() - start) / n_steps
        out[f"dit_{name}_chunk_frames"] = 2 * (prompt_tokens * (name == "first") + piece.shape[1])
        if name == "first":
            first_mel = mel
    vocoder = HiFTStream(hift)
    start = time.perf_counter()
    wav = vocoder.inference(first_mel, finalize=False)
    out["vocoder_s_per_audio_s"] = (time.perf_counter() - start) / (wav.shape[-1] / tts.sample_rate)
    torch.set_num_threads(llm_threads + t2w_threads)
    return out


def _ended(returncode: int) -> str:
    """How a row's process ended when it said nothing: a signal (the kernel's OOM killer sends SIGKILL) or a code."""
    if returncode < 0:
        name = signal.Signals(-returncode).name
        return f"killed by {name}" + (" (out of memory? see dmesg)" if name == "SIGKILL" else "")
    return f"exited with code {returncode}"


def thread_layouts(repeats: int = 2) -> list[dict[str, object]]:
    """The two engine stages at once, each in its own thread with its own intra-op count: an LLM-like decode
    (GEMV over a released-size MLP weight) and a DiT-like step (a released-size projection over 412 frames),
    the same work per layout; wall seconds and the process's CPU seconds (spinning OpenMP teams show as CPU
    spent for nothing, which a loaded machine cannot hide the way it hides wall time)."""
    weights = {"llm": (torch.randn(1, 896), torch.randn(4864, 896), 400),
               "dit": (torch.randn(412, 1024), torch.randn(1024, 1024), 60)}
    def stage(name: str, threads: int, seconds: dict[str, float]) -> None:
        torch.set_num_threads(threads)
        x, w, n = weights[name]
        start = time.perf_counter()
        for _ in range(n):
            torch.nn.functional.linear(x, w)
        seconds[name] = time.perf_counter() - start

    rows = []
    for layout in [(2, 2), (1, 1), (2, 1), (1, 2)] * repeats:
        seconds: dict[str, float] = {}
        cpu, start = process_cpu_s(), time.perf_counter()
        threads = [threading.Thread(target=stage, args=(name, n, seconds))
                   for name, n in zip(("llm", "dit"), layout, strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rows.append({"layout": layout, "wall_s": time.perf_counter() - start, "cpu_s": process_cpu_s() - cpu,
                     **{f"{k}_s": v for k, v in seconds.items()}, "load": load_average()})
    return rows


def process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _engine(tts: CosyVoice3, spec: Row, cores: int) -> object:
    """The engine a row measures: the production one (both threads on every core unless ``staged``), or the
    reference's strategy over the same modules."""
    engine = tts.engine
    if spec.reference:
        engine.close()
        return reference_engine.ReferenceEngine(engine.config, engine.llm, engine.flow, engine.hift,
                                                torch.device("cpu"), engine.limits)
    if not spec.staged:  # today's layout: both engine threads run torch's global count (both ask for every core)
        engine.scheduler.threads = engine.worker.threads = cores
    return engine


def run_row(model_dir: Path, row: str, requests: int, lengths: list[int], work: Path,
            flow_cache_mb: float | None = None) -> dict[str, object]:
    """One row in this process: load, warm up, first audio of ``requests`` streamed requests (each stopped at
    its first chunk), then one streamed request per length in ``lengths`` (seconds of speech: 25 tokens each)
    for the RTF; the per-stage seconds come from the first of them (see the module docstring). Each request's
    process CPU seconds too: on a shared machine they are the work, whatever the wall clock says.
    ``flow_cache_mb``: the flow cache's budget (None: the engine's default, half the free memory)."""
    spec = ROWS[row]
    os.environ["COSYVOICE_PROMPT_CACHE"] = "on" if spec.prefix else "off"
    start = time.perf_counter()
    limits = Limits(max_sessions=1, queue_timeout_seconds=3600, flow_cache_mb=flow_cache_mb)
    tts = CosyVoice3(model_dir, device="cpu", limits=limits,
                     voice_dir=work / f"voices-{row}", backend=spec.backend, precision=spec.precision)
    load_s = time.perf_counter() - start
    engine = _engine(tts, spec, torch.get_num_threads())
    voice = tts.frontend.voice(zero_shot_prompt_text(PROMPT_TEXT), _prompt(work / "prompt.wav"))
    inp = tts.frontend.model_input(TEXT, voice)
    options = {} if spec.reference else {"steps": spec.steps, "schedule": ChunkSchedule(final=spec.final)}

    def request(tokens: int, first_only: bool = False) -> dict[str, float]:
        start, cpu, first, samples = time.perf_counter(), process_cpu_s(), None, 0
        chunks = engine.synthesize(inp, stream=True, seed=0, fixed_tokens=tokens, **options)
        for chunk in chunks:
            first = first if first is not None else time.perf_counter() - start
            samples += chunk.pcm.numel()
            if first_only:
                chunks.close()  # cancels the request: only its first audio is measured
                break
        return {"first": first, "total": time.perf_counter() - start, "audio": samples / tts.sample_rate,
                "cpu": process_cpu_s() - cpu}

    warm = request(30)  # warm-up: allocations, the KV pool, noise buffers, the voice's flow prefix
    first_runs = [request(25 * max(lengths), first_only=True) for _ in range(requests)]
    firsts = [r["first"] for r in first_runs]
    result: dict[str, object] = {
        "first_audio_cpu_s_p50": float(np.percentile([r["cpu"] for r in first_runs], 50)),
        "precision": tts.model.plan.label, "backend": spec.backend, "reference": spec.reference,
        "threads": [] if spec.reference else [engine.scheduler.threads, engine.worker.threads],
        "first_audio_p50_s": float(np.percentile(firsts, 50)), "first_audio_p90_s": float(np.percentile(firsts, 90)),
        "steps": spec.steps or tts.engine.default_steps, "prefix": spec.prefix, "final": spec.final,
        "warm_up_first_audio_s": warm["first"]}
    for i, seconds in enumerate(lengths):
        with StageTimer() as timer:
            run = request(25 * seconds)
        result[f"rtf_{seconds}s"] = run["total"] / run["audio"]
        result[f"cpu_s_per_audio_s_{seconds}s"] = run["cpu"] / run["audio"]
        if i == 0:
            result.update({f"{stage}_s_per_audio_s": s / run["audio"] for stage, s in timer.seconds.items()})
    result.update(load_average_after=load_average(), load_s=load_s, peak_rss_mb=peak_rss_mb(),
                  checks=tts.model.plan.checks, flow_cache_mb=round(tts.engine.flow_cache_mb),
                  flow_cache_fallbacks=tts.engine.flow_cache_fallbacks)
    tts.engine.close()
    return result


def skip_reason(row: str, features: frozenset[str]) -> str | None:
    if ROWS[row].precision == "bf16" and not fast.native_bf16(features):
        return "no AVX512-BF16 or AMX: bf16 is converted op by op here, which auto never picks"
    return None


@torch.inference_mode()
def quality(golden_dir: Path, bundles: dict[str, Path], paths: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Each fast path against fp32 on the golden inputs (see the module docstring)."""
    from safetensors.numpy import load_file

    def tensors(name: str, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
        return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in load_file(golden_dir / name).items()
                if k in keys}

    flow_in = tensors("flow.safetensors", ("token", "prompt_token", "prompt_feat", "embedding"))
    llm_in = {k: v.reshape(-1).long() for k, v in tensors(
        "llm.safetensors", ("text_tokens", "prompt_text_tokens", "prompt_speech_tokens", "forced_tokens")).items()}
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
    tok, ptok, pfeat, emb = (inputs[k] for k in ("token", "prompt_token", "prompt_feat", "embedding"))
    mels = [model.inference(tok, tok.shape[1], ptok, ptok.shape[1], pfeat, pfeat.shape[1], emb, streaming, True)
            for streaming in (False, True)]
    half = tok.shape[1] // 2
    stream = FlowStream(model, ptok, pfeat, emb)
    return [*mels, torch.cat([stream.inference(tok[:, :half], False), stream.inference(tok[:, half:], True)], 2)]


def mel_errors(ref: list[torch.Tensor], got: list[torch.Tensor]) -> dict[str, float]:
    errors = [fast.mel_error(r, g) for r, g in zip(ref, got, strict=True)]
    return {k: max(e[k] for e in errors) for k in errors[0]}


#: the DiT's paths the floor section measures (label -> torch, or an onnxruntime graph precision)
DIT_PATHS = {"torch fp32, AdaLN recomputed (before)": "torch-recompute", "torch fp32 + AdaLN cache": "torch",
             "onnxruntime fp32": "fp32", "onnxruntime int8": "int8"}


def _cpu_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The best process CPU seconds of ``repeats`` calls (one thread: CPU time is its work, whatever the load)."""
    best = float("inf")
    for _ in range(repeats):
        start = process_cpu_s()
        fn()
        best = min(best, process_cpu_s() - start)
    return best


def machine_floor() -> dict[str, float]:
    """One thread's fp32 GEMM peak at the DiT's shapes (2 x 100 frames by the 1024 x 1024 and 1024 x 2048
    projections, the best of them) and its GEMV read bandwidth over a 256 MB weight."""
    torch.set_num_threads(1)
    out: dict[str, float] = {}
    for name, (m, k, n) in {"gemm_200x1024x1024": (200, 1024, 1024), "gemm_200x1024x2048": (200, 1024, 2048),
                            "gemm_900x1024x1024": (900, 1024, 1024)}.items():
        a, b = torch.randn(m, k), torch.randn(k, n)
        seconds = _cpu_seconds(lambda a=a, b=b: [a @ b for _ in range(10)], 3) / 10
        out[f"{name}_gflops"] = 2 * m * k * n / seconds / 1e9
    out["gemm_peak_gflops"] = max(v for k, v in out.items() if k.startswith("gemm_"))
    w, x = torch.randn(8192, 8192), torch.randn(8192)
    seconds = _cpu_seconds(lambda: [torch.mv(w, x) for _ in range(5)], 3) / 5
    out["gemv_gb_per_s"] = w.numel() * 4 / seconds / 1e9
    return out


def dit_step_work(dit: torch.nn.Module, new: int, past: int, batch: int = 2) -> dict[str, float]:
    """FLOPs of one DiT call over ``new`` frames after ``past`` cached ones (a CFG pair), and the bytes of AdaLN
    weights it reads when it recomputes the modulation."""
    block = dit.transformer_blocks[0]
    dim, inner = dit.proj_out.in_features, block.attn.heads * block.attn.dim_head
    ff = block.ff.ff[0][0].out_features
    conv = dit.input_embed.conv_pos_embed.conv1[0]
    per_block = 2 * new * (3 * dim * inner + inner * dim + 2 * dim * ff) + 4 * new * (past + new) * inner
    convs = 2 * 2 * new * dim * (dim // conv.groups) * conv.kernel_size[0]
    flops = batch * (len(dit.transformer_blocks) * per_block + convs)
    adaln = sum(b.attn_norm.linear.weight.numel() for b in dit.transformer_blocks) * 4
    return {"gflop": flops / 1e9, "adaln_gb": adaln / 1e9}


@torch.inference_mode()
def dit_paths(model_dir: Path, golden: Path | None) -> dict[str, dict[str, float]]:
    """Each of :data:`DIT_PATHS` per Euler step, one thread, at a stream's shapes (see the module docstring)."""
    from cosyvoice.backends import ensure_onnx
    from cosyvoice.backends.export import graph_file
    from cosyvoice.backends.ort import OrtGraph
    from cosyvoice.backends.runners import GraphEstimator

    torch.set_num_threads(1)
    ensure_onnx(model_dir, "int8")  # both graphs exported (once per bundle and CPU) before the flow is loaded
    flow = validate_model_dir(model_dir).load_flow()
    dit = flow.decoder.estimator
    cfg = flow.cfg.dit
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    t, spks = torch.full((2,), 0.3), randn(2, cfg.spk_dim)
    shapes = {"first chunk from the voice prefix (2 x 100 new over 100)": (100, 100),
              "final call, full attention (2 x 450)": (450, 0)}
    inputs = {}
    for label, (new, past) in shapes.items():
        x, mu, cond = (randn(2, cfg.mel_dim, past + new) for _ in range(3))
        cache = dit.forward_cached(x[..., :past], mu[..., :past], t, spks, cond[..., :past], None, past)[1] \
            if past else None
        inputs[label] = (x[..., past:], mu[..., past:], cond[..., past:], cache, new, past)
    root = model_dir / "onnx"
    golden_inputs = _golden_flow_inputs(golden) if golden is not None else None
    reference = quality_mels(flow, golden_inputs) if golden_inputs is not None else None
    results: dict[str, dict[str, float]] = {}
    for name, path in DIT_PATHS.items():
        dit.runner = None if path.startswith("torch") else GraphEstimator(
            None, OrtGraph(root / graph_file("flow_estimator_cached", path), torch.device("cpu"), threads=1), dit)
        dit.modulation_cache.max_bytes = 0 if path == "torch-recompute" else 64 << 20
        dit.modulation_cache.clear()
        row: dict[str, float] = {}
        for label, (x, mu, cond, cache, new, _) in inputs.items():
            def call(x=x, mu=mu, cond=cond, cache=cache) -> object:
                return dit.forward_cached(x, mu, t, spks, cond, cache, 0)

            call()  # warm-up: packing, the modulation of this t
            row[f"{label} s"] = _cpu_seconds(call, 2 if new <= 100 else 1)
        if reference is not None:
            row.update(mel_errors(reference, quality_mels(flow, golden_inputs)))
        results[name] = row
        print(name, json.dumps({k: round(v, 5) for k, v in row.items()}), flush=True)
    results["_work"] = {f"{label} {k}": v for label, (*_, new, past) in inputs.items()
                        for k, v in dit_step_work(dit, new, past).items()}
    return results


def _golden_flow_inputs(golden: Path) -> dict[str, torch.Tensor]:
    from safetensors.numpy import load_file

    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in load_file(golden / "flow.safetensors").items()
            if k in ("token", "prompt_token", "prompt_feat", "embedding")}


#: the LLM's paths the floor section measures (label -> precision.apply_llm's kind)
LLM_PATHS = {"torch fp32": "fp32", "torch int8 (dynamic linears)": "int8",
             "onnxruntime fp32, one graph per step": "onnxruntime",
             "onnxruntime int8, one graph per step": "onnxruntime-int8"}
PREFILL, DECODE = 160, 16  # the prefill (3 s prompt + text) and the decode steps timed after it


def llm_work(lm: torch.nn.Module) -> dict[str, float]:
    """The weight bytes a decode step reads (Qwen2 stack + speech head, fp32; int8 stores the stack's linears in
    a quarter) and the FLOPs of a :data:`PREFILL`-position prefill (its linears + causal attention)."""
    stack = lm.llm.model.model
    linears = [m for m in stack.modules() if isinstance(m, torch.nn.Linear)]
    linear_params = sum(m.weight.numel() for m in linears)
    read = sum(p.numel() for n, p in stack.named_parameters() if not n.startswith("embed_tokens."))  # one row read
    other = read - linear_params + lm.llm_decoder.weight.numel()
    attn = stack.layers[0].self_attn
    attention = 2 * len(stack.layers) * PREFILL * PREFILL * attn.n_heads * attn.head_dim  # QK and AV, half masked
    return {"decode_gb_fp32": 4 * (linear_params + other) / 1e9, "decode_gb_int8": (linear_params + 4 * other) / 1e9,
            "prefill_gflop": (2 * PREFILL * (linear_params + lm.llm_decoder.weight.numel()) + attention) / 1e9}


def _llm_path(ref: torch.nn.Module, kind: str, model_dir: Path) -> torch.nn.Module:
    """``ref``'s shadow on ``kind``; an onnxruntime graph on one intra-op thread (the floor is per thread)."""
    from cosyvoice.backends.llm_step import GraphBackbone, ensure_step
    from cosyvoice.backends.ort import OrtGraph

    if kind not in fast.ORT_LLM:
        return fast.apply_llm(fast.shadow(ref), kind)
    lm = fast.shadow(ref)
    path = ensure_step(ref.llm, model_dir, fast.ORT_LLM[kind])
    lm.llm.runner = GraphBackbone(OrtGraph(path, torch.device("cpu"), threads=1), lm.llm)
    return lm


@torch.inference_mode()
def llm_paths(model_dir: Path) -> dict[str, dict[str, float]]:
    """Each of :data:`LLM_PATHS`, one thread, CPU time: a :data:`PREFILL`-position prefill and the decode steps
    after it (per token, the best of two runs of :data:`DECODE`), and the mean KL per step against fp32 on auto's
    synthetic check (:func:`cosyvoice.backends.precision.check_llm`'s input)."""
    torch.set_num_threads(1)
    ref = validate_model_dir(model_dir).load_llm()
    seq, start = fast.forced_sequence(ref, *fast._synthetic_llm_input(ref))
    ref_lp = fast.teacher_forced_log_probs(ref, seq, start)
    prompt = torch.randn(1, PREFILL, ref.cfg.llm_input_size, generator=torch.Generator().manual_seed(0))
    steps = [prompt[:, i:i + 1] for i in range(DECODE)]
    results: dict[str, dict[str, float]] = {}
    for name, kind in LLM_PATHS.items():
        lm = _llm_path(ref, kind, model_dir)
        cache = lm.llm.new_cache(1, PREFILL + DECODE)
        lm.decode_step(prompt, 0, cache)  # warm-up: packing, the session's first run
        row = {"prefill s": _cpu_seconds(lambda lm=lm, cache=cache: lm.decode_step(prompt, 0, cache), 2)}
        row["decode s per token"] = _cpu_seconds(lambda lm=lm, cache=cache: [
            lm.decode_step(x, PREFILL + i, cache) for i, x in enumerate(steps)], 2) / DECODE
        row["llm_kl_mean"] = 0.0 if kind == "fp32" else fast.kl_mean(ref_lp, fast.teacher_forced_log_probs(lm, seq,
                                                                                                            start))
        results[name] = row
        print(name, json.dumps({k: round(v, 5) for k, v in row.items()}), flush=True)
        del lm, cache
    results["_work"] = llm_work(ref)
    return results


@torch.inference_mode()
def vocoder_path(model_dir: Path, seconds: int = 2) -> dict[str, float]:
    """The vocoder (weight norm folded, as the engine runs it) on ``seconds`` of mel, one thread: CPU seconds and
    FLOPs (torch's counter: its convolutions and matmuls) per audio second."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.set_num_threads(1)
    hift = validate_model_dir(model_dir).load_hift()
    hift.fold_weight_norm()
    mel = torch.randn(1, hift.cfg.in_channels, 50 * seconds, generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with counter:
        wav = HiFTStream(hift).inference(mel, finalize=True)
    audio = wav.shape[-1] / hift.cfg.sampling_rate
    cpu = _cpu_seconds(lambda: HiFTStream(hift).inference(mel, finalize=True), 2)
    return {"s per audio s": cpu / audio, "gflop per audio s": counter.get_total_flops() / 1e9 / audio}


def stage_floor_table(floor: dict[str, float], llm: dict[str, dict[str, float]], vocoder: dict[str, float]) -> str:
    """The LLM's paths and the vocoder against this machine's floor: decode per token = its weight bytes over
    the GEMV bandwidth, prefill and vocoder = their FLOPs over the GEMM peak."""
    work, peak, bandwidth = llm["_work"], floor["gemm_peak_gflops"], floor["gemv_gb_per_s"]
    rows = ["| stage, path (1 thread) | measured CPU s | floor s | floor / measured | LLM KL vs fp32 (nats) |",
            "| --- | --- | --- | --- | --- |"]
    for name, row in llm.items():
        if name == "_work":
            continue
        weights = "decode_gb_int8" if "int8" in name else "decode_gb_fp32"
        for label, seconds, floor_s in (("prefill, 160 positions", row["prefill s"], work["prefill_gflop"] / peak),
                                        ("decode, per token", row["decode s per token"], work[weights] / bandwidth)):
            rows.append(f"| LLM {label}, {name} | {seconds:.4f} | {floor_s:.4f} | {floor_s / seconds:.2f} | "
                        f"{row['llm_kl_mean']:.2e} |")
    voc_floor = vocoder["gflop per audio s"] / peak
    rows.append(f"| vocoder per audio second, torch fp32 | {vocoder['s per audio s']:.3f} | {voc_floor:.3f} | "
                f"{voc_floor / vocoder['s per audio s']:.2f} | |")
    return "\n".join(rows)


def floor_table(floor: dict[str, float], paths: dict[str, dict[str, float]]) -> str:
    """Per path and shape: seconds per step, the step's floor, the fraction of the floor reached."""
    work = paths["_work"]
    peak, bandwidth = floor["gemm_peak_gflops"], floor["gemv_gb_per_s"]
    rows = ["| DiT path (1 thread, per Euler step) | shape | CPU s | floor s | floor / measured | mel rel. RMS "
            "| mel max abs |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, row in paths.items():
        if name == "_work":
            continue
        for key, seconds in row.items():
            if not key.endswith(" s"):
                continue
            label = key[:-2]
            reads = work[f"{label} adaln_gb"] / bandwidth if name.endswith("(before)") else 0.0
            floor_s = work[f"{label} gflop"] / peak + reads
            rms, mx = row.get("mel_rel_rms"), row.get("mel_max_abs")
            rows.append(f"| {name} | {label} | {seconds:.3f} | {floor_s:.3f} | {floor_s / seconds:.2f} | "
                        f"{'' if rms is None else f'{rms:.2e}'} | {'' if mx is None else f'{mx:.2e}'} |")
    return "\n".join(rows)


def rows_table(results: dict[str, object], lengths: list[int]) -> str:
    """One line per row: its settings, first audio, RTF per length, per-stage seconds per audio second."""
    head = ["row", "precision", "DiT backend", "threads (LLM, t2w)", "prefix", "steps", "final",
            "first audio p50 / p90 s", "first audio CPU s p50", *(f"RTF {n} s" for n in lengths),
            *(f"CPU s per audio s, {n} s" for n in lengths), "LLM s/s", "flow s/s", "vocoder s/s",
            "load s", "peak RSS MB", "load average after"]
    lines = ["| " + " | ".join(head) + " |", "| --- " * len(head) + "|"]
    for row, r in results.items():
        if not isinstance(r, dict) or "first_audio_p50_s" not in r:
            lines.append(f"| {row} | {r} |")
            continue
        rtfs = [f"{r[f'rtf_{n}s']:.2f}" if f"rtf_{n}s" in r else "not run" for n in lengths]
        cpus = [f"{r[f'cpu_s_per_audio_s_{n}s']:.2f}" if f"rtf_{n}s" in r else "not run" for n in lengths]
        cells = [row, r["precision"], "reference strategy" if r["reference"] else r["backend"], r["threads"],
                 "yes" if r["prefix"] else "no", r["steps"], r["final"],
                 f"{r['first_audio_p50_s']:.2f} / {r['first_audio_p90_s']:.2f}", f"{r['first_audio_cpu_s_p50']:.2f}",
                 *rtfs, *cpus,
                 *(f"{r[f'{k}_s_per_audio_s']:.2f}" for k in ("llm", "flow", "vocoder")), f"{r['load_s']:.1f}",
                 f"{r['peak_rss_mb']:.0f}", r["load_average_after"]]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny test bundle (a smoke run)")
    parser.add_argument("--model-dir", type=Path, help="a bundle to measure (default: released sizes, random)")
    parser.add_argument("--fixed-tokens", type=int, default=75, help="speech tokens of the profile (75 = 3 s)")
    parser.add_argument("--requests", type=int, default=5, help="measured requests per row (first audio p50/p90)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[10, 60],
                        help="seconds of speech of each row's RTF requests (the first gives the per-stage split)")
    parser.add_argument("--long-rows", nargs="*", choices=list(ROWS),
                        help="rows that run every --lengths (default: all); the others only the first")
    parser.add_argument("--rows", nargs="*", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--golden", type=Path, help="golden fixtures: also measure the quality bounds")
    parser.add_argument("--skip-profile", action="store_true", help="only the rows (and --golden)")
    parser.add_argument("--quality-paths", nargs="*", choices=["int8", "bf16"],
                        help="fast paths to hold to the bounds (default: this CPU's candidates for auto; given "
                             "empty: none, e.g. with --floor, which measures the DiT's paths itself)")
    parser.add_argument("--json", type=Path, help="write settings and results here")
    parser.add_argument("--floor", action="store_true", help="this machine's floor and the DiT's paths against it")
    parser.add_argument("--flow-cache-mb", type=float,
                        help="the rows' flow-cache budget (default: the engine's, half the free memory at start)")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # internal: run one row in this process, print JSON
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="cosyvoice-cpu-bench-"))
    if args.row:
        print(json.dumps(run_row(args.model_dir, args.row, args.requests, args.lengths, work, args.flow_cache_mb)))
        return {}
    model_dir, model = bench_bundle(args.model_dir, args.tiny, work)
    features = fast.cpu_features()
    settings = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "cpu": cpu_model(), "cpu_flags": sorted(features), "cores": torch.get_num_threads(),
                "torch": torch.__version__, "python": platform.python_version(), "commit": _git_commit(),
                "model": model, "lengths_s": args.lengths, "requests": args.requests,
                "mode": "stream, 1 request at a time, batched engine, seed 0", "load_before": load_average(),
                "flow_cache_mb": args.flow_cache_mb}
    print(" | ".join(f"{k} {v}" for k, v in settings.items()), flush=True)
    report: dict[str, object] = {"settings": settings}
    if args.floor:
        floor = machine_floor()
        print("floor (1 thread, CPU time)", json.dumps({k: round(v, 2) for k, v in floor.items()}), flush=True)
        paths = dit_paths(Path(model_dir), args.golden)
        print(floor_table(floor, paths), flush=True)
        llm, vocoder = llm_paths(Path(model_dir)), vocoder_path(Path(model_dir))
        print(stage_floor_table(floor, llm, vocoder), flush=True)
        report.update(floor=floor, dit_paths=paths, llm_paths=llm, vocoder=vocoder)
        settings["load_after_floor"] = load_average()
        print("load average after the floor section", settings["load_after_floor"], flush=True)
    prof: dict[str, float] = {}
    if not args.skip_profile:
        tts = CosyVoice3(model_dir, device="cpu", voice_dir=work / "voices", backend="torch", precision="fp32")
        prof = profile(tts, _prompt(work / "prompt.wav"), args.fixed_tokens)
        tts.engine.close()
        del tts
        print("profile (fp32)", json.dumps({k: round(v, 4) for k, v in prof.items()}), flush=True)
    layouts = thread_layouts()
    print("| layout (LLM, t2w) | wall s | CPU s | LLM s | DiT s | load |\n| --- | --- | --- | --- | --- | --- |")
    for r in layouts:
        print(f"| {r['layout']} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | {r['llm_s']:.2f} | {r['dit_s']:.2f} | "
              f"{r['load']} |", flush=True)
    results: dict[str, object] = {}
    for row in args.rows:
        reason = skip_reason(row, features)
        if reason:
            results[row] = {"skipped": reason}
        else:
            done = subprocess.run([sys.executable, __file__, "--row", row, "--model-dir", str(model_dir),
                                   "--requests", str(args.requests),
                                   *(["--flow-cache-mb", str(args.flow_cache_mb)] if args.flow_cache_mb else []),
                                   "--lengths",
                                   *map(str, args.lengths if args.long_rows is None or row in args.long_rows
                                        else args.lengths[:1])],
                                  capture_output=True, text=True)
            lines = done.stdout.strip().splitlines()
            results[row] = json.loads(lines[-1]) if done.returncode == 0 and lines else {
                "failed": done.stderr.strip().splitlines()[-1:] or [_ended(done.returncode)]}
        print(row, json.dumps(results[row]), flush=True)
    settings["load_after"] = load_average()
    report.update(profile=prof, threads=layouts, rows=results)
    print(f"\nload average before {settings['load_before']}, after {settings['load_after']}")
    print(rows_table(results, args.lengths))
    if args.golden and args.quality_paths != []:
        bundles = {"benchmark bundle": Path(model_dir), "golden tiny bundle": args.golden / "tiny_bundle"}
        report["quality"] = quality(args.golden, bundles, tuple(args.quality_paths or fast.candidates(features)))
        for label, q in report["quality"].items():  # type: ignore[union-attr]
            print(label, json.dumps({k: float(f"{v:.3g}") for k, v in q.items()}))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
