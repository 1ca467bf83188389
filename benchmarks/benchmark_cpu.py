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
   with the reason (bf16 without AVX512-BF16 or AMX). Per row: first audio p50/p90 over ``--requests``
   requests, RTF, seconds of compute per second of audio of the LLM (every scheduler step), the flow and the
   vocoder (the worker's chunks) inside the run (LLM and worker overlap: the sum may exceed the wall time),
   load seconds (auto's self-check included), peak RSS (VmHWM). A new optimisation is one more entry in :data:`ROWS`.
3. **Quality** (``--golden``): each fast path against fp32 on the golden inputs (the DiT's mel whole, chunk-
   masked and streamed; the LLM's mean KL per teacher-forced step), at the benchmark's sizes and on the golden
   tiny bundle, against :data:`cosyvoice.backends.precision.BOUNDS`.
4. **Threads** (:func:`thread_layouts`): the two stages' intra-op thread counts, measured in isolation from
   the model (wall and CPU seconds of the same work per layout).

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

from benchmark_performance import TEXT, _git_commit, _prompt, bench_bundle

from cosyvoice.backends import precision as fast
from cosyvoice.bundle import validate_model_dir
from cosyvoice.cli.cosyvoice import CosyVoice3
from cosyvoice.engine.engine import stage_threads
from cosyvoice.engine.runner import LLMRunner
from cosyvoice.engine.t2w import Token2Wav
from cosyvoice.flow import FlowStream
from cosyvoice.frontend.prompts import zero_shot_prompt_text
from cosyvoice.hifigan import HiFTStream
from cosyvoice.settings import Limits


@dataclass(frozen=True)
class Row:
    """One ablation row: the precision, per-stage threads (else both engine threads on every core, as before),
    the voice's flow prefix (``COSYVOICE_PROMPT_CACHE``) and the flow's Euler steps (None: the model's 10)."""

    precision: str = "fp32"
    staged: bool = False
    prefix: bool = False
    steps: int | None = None


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
}
PROMPT_TEXT = "A prompt recording of three seconds."


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


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

    TARGETS = ((LLMRunner, "execute", "llm"), (Token2Wav, "chunks", "t2w"), (Token2Wav, "vocode", "vocoder"))

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


def run_row(model_dir: Path, row: str, fixed: int, requests: int, work: Path) -> dict[str, object]:
    """One row in this process: load, warm up, ``requests`` streamed requests (see the module docstring)."""
    spec = ROWS[row]
    cores = torch.get_num_threads()
    os.environ["COSYVOICE_PROMPT_CACHE"] = "on" if spec.prefix else "off"
    start = time.perf_counter()
    tts = CosyVoice3(model_dir, device="cpu", limits=Limits(max_sessions=1, queue_timeout_seconds=600),
                     voice_dir=work / f"voices-{row}", backend="torch", precision=spec.precision)
    load_s = time.perf_counter() - start
    engine = tts.engine
    if not spec.staged:  # today's layout: both engine threads run torch's global count (both ask for every core)
        engine.scheduler.threads = engine.worker.threads = cores
    voice = tts.frontend.voice(zero_shot_prompt_text(PROMPT_TEXT), _prompt(work / "prompt.wav"))
    inp = tts.frontend.model_input(TEXT, voice)

    def request(tokens: int) -> dict[str, float]:
        start = time.perf_counter()
        first, samples = None, 0
        for chunk in engine.synthesize(inp, stream=True, seed=0, fixed_tokens=tokens, steps=spec.steps):
            first = first if first is not None else time.perf_counter() - start
            samples += chunk.pcm.numel()
        total = time.perf_counter() - start
        return {"first": first or total, "total": total, "audio": samples / engine.sample_rate}

    warm = request(min(fixed, 30))  # warm-up: allocations, the KV pool, noise buffers, the voice's flow prefix
    with StageTimer() as timer:
        runs = [request(fixed) for _ in range(requests)]
    audio = sum(r["audio"] for r in runs)
    firsts = [r["first"] for r in runs]
    result: dict[str, object] = {
        "precision": tts.model.plan.label, "threads": [engine.scheduler.threads, engine.worker.threads],
        "first_audio_p50_s": float(np.percentile(firsts, 50)), "first_audio_p90_s": float(np.percentile(firsts, 90)),
        "rtf": sum(r["total"] for r in runs) / audio, "audio_s_per_request": audio / len(runs),
        **{f"{stage}_s_per_audio_s": s / audio for stage, s in timer.seconds.items()},
        "steps": spec.steps or engine.default_steps, "prefix": spec.prefix, "warm_up_first_audio_s": warm["first"],
        "load_average_after": load_average(), "load_s": load_s, "peak_rss_mb": peak_rss_mb(),
        "checks": tts.model.plan.checks}
    engine.close()
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
    tok, ptok, pfeat, emb = (inputs[k] for k in ("token", "prompt_token", "prompt_feat", "embedding"))
    errors = []
    for streaming in (False, True):
        args = (tok, tok.shape[1], ptok, ptok.shape[1], pfeat, pfeat.shape[1], emb, streaming, True)
        errors.append(fast.mel_error(ref.inference(*args), got.inference(*args)))
    half = tok.shape[1] // 2
    streamed = []
    for model in (ref, got):
        stream = FlowStream(model, ptok, pfeat, emb)
        streamed.append(torch.cat([stream.inference(tok[:, :half], False), stream.inference(tok[:, half:], True)], 2))
    errors.append(fast.mel_error(*streamed))
    return {k: max(e[k] for e in errors) for k in errors[0]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny test bundle (a smoke run)")
    parser.add_argument("--model-dir", type=Path, help="a bundle to measure (default: released sizes, random)")
    parser.add_argument("--fixed-tokens", type=int, default=75, help="speech tokens per request (75 = 3 s)")
    parser.add_argument("--requests", type=int, default=5, help="measured requests per row (first audio p50/p90)")
    parser.add_argument("--rows", nargs="*", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--golden", type=Path, help="golden fixtures: also measure the quality bounds")
    parser.add_argument("--skip-profile", action="store_true", help="only the rows (and --golden)")
    parser.add_argument("--quality-paths", nargs="*", choices=["int8", "bf16"],
                        help="fast paths to hold to the bounds (default: this CPU's candidates for auto)")
    parser.add_argument("--json", type=Path, help="write settings and results here")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # internal: run one row in this process, print JSON
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="cosyvoice-cpu-bench-"))
    if args.row:
        print(json.dumps(run_row(args.model_dir, args.row, args.fixed_tokens, args.requests, work)))
        return {}
    model_dir, model = bench_bundle(args.model_dir, args.tiny, work)
    features = fast.cpu_features()
    settings = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "cpu": cpu_model(), "cpu_flags": sorted(features), "cores": torch.get_num_threads(),
                "torch": torch.__version__, "python": platform.python_version(), "commit": _git_commit(),
                "model": model, "fixed_tokens": args.fixed_tokens, "requests": args.requests,
                "mode": "stream, 1 request at a time, batched engine, seed 0", "load_before": load_average()}
    print(" | ".join(f"{k} {v}" for k, v in settings.items()), flush=True)
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
                                   "--fixed-tokens", str(args.fixed_tokens), "--requests", str(args.requests)],
                                  capture_output=True, text=True)
            lines = done.stdout.strip().splitlines()
            results[row] = json.loads(lines[-1]) if done.returncode == 0 and lines else {
                "failed": done.stderr.strip().splitlines()[-1:]}
        print(row, json.dumps(results[row]), flush=True)
    settings["load_after"] = load_average()
    report: dict[str, object] = {"settings": settings, "profile": prof, "threads": layouts, "rows": results}
    print(f"\nload average before {settings['load_before']}, after {settings['load_after']}")
    print("| row | precision | threads (LLM, t2w) | prefix | steps | first audio p50 / p90 s | RTF | LLM s/s "
          "| flow s/s | vocoder s/s | load s | warm-up first audio s | peak RSS MB | load average after |")
    print("| --- " * 14 + "|")
    for row, r in results.items():
        if "rtf" not in r:  # type: ignore[operator]
            print(f"| {row} | {r} |")
            continue
        print(f"| {row} | {r['precision']} | {r['threads']} | {'yes' if r['prefix'] else 'no'} | "  # type: ignore[index]
              f"{r['steps']} | {r['first_audio_p50_s']:.2f} / "  # type: ignore[index]
              f"{r['first_audio_p90_s']:.2f} | {r['rtf']:.2f} | {r['llm_s_per_audio_s']:.2f} | "  # type: ignore[index]
              f"{r['flow_s_per_audio_s']:.2f} | {r['vocoder_s_per_audio_s']:.2f} | {r['load_s']:.1f} | "  # type: ignore[index]
              f"{r['warm_up_first_audio_s']:.2f} | "  # type: ignore[index]
              f"{r['peak_rss_mb']:.0f} | {r['load_average_after']} |")  # type: ignore[index]
    if args.golden:
        bundles = {"benchmark bundle": Path(model_dir), "golden tiny bundle": args.golden / "tiny_bundle"}
        report["quality"] = quality(args.golden, bundles, tuple(args.quality_paths or fast.candidates(features)))
        for label, q in report["quality"].items():  # type: ignore[union-attr]
            print(label, json.dumps({k: float(f"{v:.3g}") for k, v in q.items()}))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
