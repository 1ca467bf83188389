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
   over ``--requests`` requests (each cancelled at its first chunk), wall and the process's CPU seconds from
   the request to its first chunk (until 2026-12-06 the CPU column ran until the cancelled request was freed, so it
   also counted the second chunk the worker had begun and the LLM beside it; that is now the "CPU to release"
   column), the RTF of one request per ``--lengths``
   (10 s and 60 s of speech: how cost grows with length), seconds of compute per second of audio of the LLM
   (every scheduler step, or the reference's LLM thread), the flow and the vocoder (the worker's chunks) in
   each of them (wall seconds; LLM and worker overlap: the sum may exceed the wall time), load seconds (auto's
   self-check included), peak RSS (VmHWM). A new optimisation is one more entry in :data:`ROWS`.
3. **Quality** (``--golden``): each fast path against fp32 on the golden inputs (the DiT's mel whole, chunk-
   masked and streamed; the LLM's mean KL per teacher-forced step), at the benchmark's sizes and on the golden
   tiny bundle, against :data:`cosyvoice.backends.precision.BOUNDS`.
4. **Threads** (:func:`thread_layouts`): the two stages' intra-op thread counts, measured in isolation from
   the model (wall and CPU seconds of the same work per layout).

5. **Floor** (``--floor``): this machine's own peaks in the same run, one thread, CPU time: fp32 GEMM at the
   DiT's shapes (GFLOPS; the better of torch's BLAS and onnxruntime's MLAS), int8 GEMM at the same shapes
   (onnxruntime's ``MatMulInteger``, the kernel of the int8 graphs' projections; GOPS) and GEMV read bandwidth
   over a weight far larger than the caches (GB/s), and bf16 GEMM (torch's); then the DiT per Euler step on each
   path (:data:`DIT_PATHS`: today's torch fp32 recomputing the AdaLN modulation, torch with the modulation cache,
   onnxruntime fp32, onnxruntime int8, torch bf16 where native) at the stream's shapes, beside the step's floor
   (its FLOPs over the GEMM peak of their precision, the int8 graph's projections over the int8 one, the bf16
   DiT's projections and attention over the bf16 one, plus its AdaLN weights over the bandwidth where it reads
   them), and each
   path's mel error against torch fp32 whole, chunk-masked and streamed (the quality bounds at these sizes);
   the LLM on each of :data:`LLM_PATHS` (prefill and decode per token against their floors: FLOPs over the GEMM
   peak, weight bytes over the GEMV bandwidth; KL against fp32) and the vocoder per audio second (its FLOPs,
   counted by torch, over the GEMM peak).

The CPU flags and ``/proc/loadavg`` before and after are printed: other work sharing the cores shows there.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import reference_engine
from benchmark_performance import TEXT, _git_commit, _prompt, bench_bundle, scratch_dir
from cpu_floor import floor_section, process_cpu_s
from cpu_quality import quality

from cosyvoice.backends import precision as fast
from cosyvoice.backends.cpu import cpu_model
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
    stream's final call (``full``: the reference's; ``chunked``), the DiT's backend, ``reference``: the
    reference's strategy (:class:`ReferenceEngine`, fp32 torch: an LLM thread per request, flow and vocoder
    recomputed over the whole utterance per chunk), ``first_hop``: the request's first hop in speech tokens (None:
    the reference's), and ``held``: whether the engine holds the LLM back while a first chunk is computed
    (``Engine.first_chunk_priority``; None: the engine's default, on a CPU)."""

    precision: str = "fp32"
    staged: bool = False
    prefix: bool = False
    steps: int | None = None
    final: str = "full"
    backend: str = "torch"
    reference: bool = False
    first_hop: int | None = None
    held: bool | None = None


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
    "all (auto), LLM not held": Row("auto", True, True, held=False),
    "all (auto), 6 steps, LLM not held": Row("auto", True, True, 6, held=False),
    "all (auto), first hop 15": Row("auto", True, True, first_hop=15),
    "all (auto), 6 steps, first hop 15": Row("auto", True, True, 6, first_hop=15),
    "fp32 exact: onnxruntime DiT, threads, prefix": Row(staged=True, prefix=True, backend="onnxruntime"),
    "fp32 exact: torch, threads, prefix": Row(staged=True, prefix=True),
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
    if spec.held is not None:
        engine.first_chunk_priority = spec.held
    return engine


def run_row(model_dir: Path, row: str, requests: int, lengths: list[int], work: Path,
            flow_cache_mb: float | None = None, max_sessions: int = 1) -> dict[str, object]:
    """One row in this process: load, warm up, first audio of ``requests`` streamed requests (each stopped at
    its first chunk), then one streamed request per length in ``lengths`` (seconds of speech: 25 tokens each)
    for the RTF, each with its per-stage seconds (see the module docstring). Each request's
    process CPU seconds too: on a shared machine they are the work, whatever the wall clock says.
    ``flow_cache_mb``: the flow cache's budget (None: the engine's default, half the free memory);
    ``max_sessions``: the engine's (a stream is sure of the budget over it, and borrows the rest when alone)."""
    spec = ROWS[row]
    os.environ["COSYVOICE_PROMPT_CACHE"] = "on" if spec.prefix else "off"
    start = time.perf_counter()
    limits = Limits(max_sessions=max_sessions, queue_timeout_seconds=3600, flow_cache_mb=flow_cache_mb)
    tts = CosyVoice3(model_dir, device="cpu", limits=limits,
                     voice_dir=work / f"voices-{row}", backend=spec.backend, precision=spec.precision)
    load_s = time.perf_counter() - start
    engine = _engine(tts, spec, torch.get_num_threads())
    voice = tts.frontend.voice(zero_shot_prompt_text(PROMPT_TEXT), _prompt(work / "prompt.wav"))
    inp = tts.frontend.model_input(TEXT, voice)
    options = {} if spec.reference else {
        "steps": spec.steps, "schedule": ChunkSchedule(first_hop=spec.first_hop, final=spec.final)}

    def request(tokens: int, first_only: bool = False) -> dict[str, float]:
        start, cpu, first, first_cpu, samples = time.perf_counter(), process_cpu_s(), None, None, 0
        chunks = engine.synthesize(inp, stream=True, seed=0, fixed_tokens=tokens, **options)
        for chunk in chunks:
            if first is None:
                first, first_cpu = time.perf_counter() - start, process_cpu_s() - cpu
            samples += chunk.pcm.numel()
            if first_only:
                chunks.close()  # cancels the request (returns once it is freed): only its first audio is measured
                break
        return {"first": first, "first_cpu": first_cpu, "total": time.perf_counter() - start,
                "audio": samples / tts.sample_rate, "cpu": process_cpu_s() - cpu}

    warm = request(30)  # warm-up: allocations, the KV pool, noise buffers, the voice's flow prefix
    first_runs = [request(25 * max(lengths), first_only=True) for _ in range(requests)]
    firsts = [r["first"] for r in first_runs]
    result: dict[str, object] = {
        "first_audio_cpu_s_p50": float(np.percentile([r["first_cpu"] for r in first_runs], 50)),
        "first_audio_cpu_to_release_s_p50": float(np.percentile([r["cpu"] for r in first_runs], 50)),
        "first_hop": spec.first_hop, "held": not spec.reference and engine.first_chunk_priority,
        "precision": tts.model.plan.label, "backend": spec.backend, "reference": spec.reference,
        "threads": [] if spec.reference else [engine.scheduler.threads, engine.worker.threads,
                                              engine.worker.wide_threads],
        "first_audio_p50_s": float(np.percentile(firsts, 50)), "first_audio_p90_s": float(np.percentile(firsts, 90)),
        "steps": spec.steps or tts.engine.default_steps, "prefix": spec.prefix, "final": spec.final,
        "warm_up_first_audio_s": warm["first"]}
    for seconds in lengths:
        with StageTimer() as timer:
            run = request(25 * seconds)
        result[f"rtf_{seconds}s"] = run["total"] / run["audio"]
        result[f"cpu_s_per_audio_s_{seconds}s"] = run["cpu"] / run["audio"]
        result[f"stages_{seconds}s"] = {stage: s / run["audio"] for stage, s in timer.seconds.items()}
    result.update(load_average_after=load_average(), load_s=load_s, peak_rss_mb=peak_rss_mb(),
                  checks=tts.model.plan.checks, flow_cache_mb=round(tts.engine.flow_cache_mb),
                  flow_cache_fallbacks=tts.engine.flow_cache_fallbacks)
    tts.engine.close()
    return result


def skip_reason(row: str, features: frozenset[str]) -> str | None:
    if ROWS[row].precision == "bf16" and not fast.native_bf16(features):
        return "no AVX512-BF16 or AMX: bf16 is converted op by op here, which auto never picks"
    return None


def rows_table(results: dict[str, object], lengths: list[int]) -> str:
    """One line per row: its settings, first audio, RTF per length, per-stage seconds per audio second."""
    head = ["row", "precision", "DiT backend", "threads (LLM, t2w, t2w while the LLM has no step)", "prefix",
            "steps", "final", "first hop", "LLM held", "first audio p50 / p90 s", "first audio CPU s p50",
            "CPU to release s p50",
            *(f"RTF {n} s" for n in lengths),
            *(f"CPU s per audio s, {n} s" for n in lengths),
            *(f"LLM / flow / vocoder s per audio s, {n} s" for n in lengths),
            "load s", "peak RSS MB", "load average after"]
    lines = ["| " + " | ".join(head) + " |", "| --- " * len(head) + "|"]
    for row, r in results.items():
        if not isinstance(r, dict) or "first_audio_p50_s" not in r:
            lines.append(f"| {row} | {r} |")
            continue
        rtfs = [f"{r[f'rtf_{n}s']:.2f}" if f"rtf_{n}s" in r else "not run" for n in lengths]
        cpus = [f"{r[f'cpu_s_per_audio_s_{n}s']:.2f}" if f"rtf_{n}s" in r else "not run" for n in lengths]
        stages = [" / ".join(f"{r[f'stages_{n}s'][k]:.2f}" for k in ("llm", "flow", "vocoder"))
                  if f"rtf_{n}s" in r else "not run" for n in lengths]
        cells = [row, r["precision"], "reference strategy" if r["reference"] else r["backend"], r["threads"],
                 "yes" if r["prefix"] else "no", r["steps"], r["final"], r["first_hop"] or "reference",
                 "yes" if r["held"] and not r["reference"] else "no",
                 f"{r['first_audio_p50_s']:.2f} / {r['first_audio_p90_s']:.2f}", f"{r['first_audio_cpu_s_p50']:.2f}",
                 f"{r['first_audio_cpu_to_release_s_p50']:.2f}", *rtfs, *cpus, *stages, f"{r['load_s']:.1f}",
                 f"{r['peak_rss_mb']:.0f}", r["load_average_after"]]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny test bundle (a smoke run)")
    parser.add_argument("--model-dir", type=Path, help="a bundle to measure (default: released sizes, random)")
    parser.add_argument("--fixed-tokens", type=int, default=75, help="speech tokens of the profile (75 = 3 s)")
    parser.add_argument("--requests", type=int, default=5, help="measured requests per row (first audio p50/p90)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[10, 60],
                        help="seconds of speech of each row's RTF requests")
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
    parser.add_argument("--max-sessions", type=int, default=1,
                        help="the engine's max_sessions (a server's default: 8); requests still run one at a time")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # internal: run one row in this process, print JSON
    return parser


def _print_layouts(layouts: list[dict[str, object]]) -> None:
    print("| layout (LLM, t2w) | wall s | CPU s | LLM s | DiT s | load |\n| --- | --- | --- | --- | --- | --- |")
    for r in layouts:
        print(f"| {r['layout']} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | {r['llm_s']:.2f} | {r['dit_s']:.2f} | "
              f"{r['load']} |", flush=True)


def _rows(args: argparse.Namespace, model_dir: Path, features: frozenset[str]) -> dict[str, object]:
    """Each asked row in a process of its own (``--row``), or the reason it is skipped on this CPU."""
    results: dict[str, object] = {}
    for row in args.rows:
        reason = skip_reason(row, features)
        if reason:
            results[row] = {"skipped": reason}
        else:
            done = subprocess.run([sys.executable, __file__, "--row", row, "--model-dir", str(model_dir),
                                   "--requests", str(args.requests),
                                   *(["--flow-cache-mb", str(args.flow_cache_mb)] if args.flow_cache_mb else []),
                                   "--max-sessions", str(args.max_sessions),
                                   "--lengths",
                                   *map(str, args.lengths if args.long_rows is None or row in args.long_rows
                                        else args.lengths[:1])],
                                  capture_output=True, text=True)
            lines = done.stdout.strip().splitlines()
            results[row] = json.loads(lines[-1]) if done.returncode == 0 and lines else {
                "failed": done.stderr.strip().splitlines()[-1:] or [_ended(done.returncode)]}
        print(row, json.dumps(results[row]), flush=True)
    return results


def _profile(model_dir: Path, work: Path, fixed_tokens: int) -> dict[str, float]:
    tts = CosyVoice3(model_dir, device="cpu", voice_dir=work / "voices", backend="torch", precision="fp32")
    prof = profile(tts, _prompt(work / "prompt.wav"), fixed_tokens)
    tts.engine.close()
    print("profile (fp32)", json.dumps({k: round(v, 4) for k, v in prof.items()}), flush=True)
    return prof


def main(argv: list[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    work = scratch_dir("cosyvoice-cpu-bench-")
    if args.row:
        print(json.dumps(run_row(args.model_dir, args.row, args.requests, args.lengths, work, args.flow_cache_mb,
                                 args.max_sessions)))
        return {}
    model_dir, model = bench_bundle(args.model_dir, args.tiny, work)
    features = fast.cpu_features()
    settings = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "cpu": cpu_model(), "cpu_flags": sorted(features), "cores": torch.get_num_threads(),
                "torch": torch.__version__, "python": platform.python_version(), "commit": _git_commit(),
                "model": model, "lengths_s": args.lengths, "requests": args.requests,
                "mode": "stream, 1 request at a time, batched engine, seed 0", "load_before": load_average(),
                "flow_cache_mb": args.flow_cache_mb, "max_sessions": args.max_sessions}
    print(" | ".join(f"{k} {v}" for k, v in settings.items()), flush=True)
    report: dict[str, object] = {"settings": settings}
    if args.floor:
        report.update(floor_section(Path(model_dir), args.golden))
        settings["load_after_floor"] = load_average()
        print("load average after the floor section", settings["load_after_floor"], flush=True)
    prof = {} if args.skip_profile else _profile(model_dir, work, args.fixed_tokens)
    layouts = thread_layouts()
    _print_layouts(layouts)
    results = _rows(args, model_dir, features)
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
