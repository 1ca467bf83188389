"""Engine performance: the batched engine (fast path), its ablations and the reference's strategy, in one run.

    python benchmarks/benchmark_performance.py --tiny                       # seconds on a CPU: a smoke run
    python benchmarks/benchmark_performance.py --random-full --device cuda --dtype fp32 bf16 --ablation \
        --concurrency 1 4 16 64 --poisson 2 5 10 --fixed-tokens 250 --llm-only --json perf.json   # issue 16

Bundles: ``--tiny`` writes the tiny test bundle (toy sizes); ``--random-full`` a randomly initialised
bundle with the released model's sizes (Qwen2-0.5B LLM, 22-block 1024-dim DiT, 512-channel HiFT), so
timings are those of the real architecture; ``--model-dir`` measures a real model. ``--fixed-tokens N``
makes every request decode exactly N speech tokens (the engine's ``fixed_tokens`` option: min = max
length, stop ids masked), so runs are comparable whatever the weights sample.

Engines (``--engines``; ``--ablation`` = all of them): ``fast`` = ``Engine`` with every optimisation on
(continuous-batching LLM scheduler, token-to-wave worker, incremental flow and vocoder, packed DiT batching
``t2w_batch=8``, leading-silence trim 40 ms, CUDA-graph decode step on CUDA); ``no-packing``, ``no-trim``,
``no-graphs``, ``no-incremental`` = ``fast`` with that one switched off; ``compiled`` = ``fast`` with the DiT
step compiled per shape bucket (CUDA graphs on CUDA; in ``--ablation`` on CUDA only); ``baseline`` = ``ReferenceEngine``
(benchmarks/reference_engine.py): the reference's shape (an LLM thread per request, flow and vocoder re-run
over the whole utterance per chunk, in the caller's thread).

Loads: ``--concurrency N ...``: N clients at once (a barrier), each sending ``--requests`` requests one after
another (closed loop); ``--poisson R ...``: open loop, ``--arrivals`` requests arriving as a Poisson process of
R requests per second (seeded), each starting at its arrival whatever is running: overload shows as growing
first-packet times, not as a lower request rate.

Per (engine, dtype, mode, load) row: first packet (request start to its first chunk) and first audible sample
(to the arrival of the chunk holding the first sample at or above -54 dBFS) p50 / p95 / p99; RTF (mean over
requests of wall time / audio seconds); aggregate audio-seconds per wall-second; simulated playback underruns
per stream (playback starts at the first audio; a chunk arriving after the playback clock reached its first
sample is an underrun, and the clock waits for it); LLM tokens per second (all requests' speech tokens / wall
time); peak memory (CUDA: max allocated; CPU: peak resident set sampled every 5 ms) above the idle engine, and
that per stream (the most requests in flight at once). ``--llm-only`` adds a table of the LLM alone: scheduler
decode tokens/s per batch size against eager one-thread-per-request decoding.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from cosyvoice.bundle import validate_model_dir
from cosyvoice.engine import Engine, LLMScheduler, Ticket
from cosyvoice.frontend.frontend import CosyVoiceFrontend
from cosyvoice.frontend.prompts import zero_shot_prompt_text
from cosyvoice.settings import PRECISIONS, Limits, parse_precision
from cosyvoice.tools.make_tiny_bundle import TinyDims, make_tiny_bundle

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling module, however this file is loaded
from reference_engine import ReferenceEngine, run_ticket_eager

RELEASED_DIMS = TinyDims(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, pre_lookahead_channels=1024,
                         dit_dim=1024, dit_depth=22, dit_heads=16, dit_dim_head=64, dit_ff_mult=2, hift_channels=512,
                         f0_channels=512)
TEXT = "Every benchmark request speaks this sentence, which is long enough for a fixed-length run."
AUDIBLE = 10 ** (-54 / 20)  # the first sample at least this loud is the first audible one (the trim's threshold)
FAST = {"t2w_batch": 8, "trim_leading_silence_ms": 40.0, "cuda_graphs": True}
ENGINES: dict[str, tuple[type, dict]] = {
    "fast": (Engine, FAST),
    "no-packing": (Engine, {**FAST, "t2w_batch": 1}),
    "no-trim": (Engine, {**FAST, "trim_leading_silence_ms": None}),
    "no-graphs": (Engine, {**FAST, "cuda_graphs": False}),
    "no-incremental": (Engine, {**FAST, "incremental_flow": False, "incremental_vocoder": False}),
    "compiled": (Engine, {**FAST, "compile_dit": True}),  # CUDA: the DiT step in CUDA graphs per shape bucket
    "baseline": (ReferenceEngine, {}),
}


@dataclass
class Row:
    engine: str
    dtype: str
    mode: str
    load: str  # "closed" (fixed concurrency) or "poisson"
    clients: int  # closed: clients at once; poisson: the most requests in flight at once
    rate: float  # poisson: requests per second (closed: 0)
    requests: int
    first_packet_p50_ms: float
    first_packet_p95_ms: float
    first_packet_p99_ms: float
    first_audible_p50_ms: float
    first_audible_p95_ms: float
    first_audible_p99_ms: float
    rtf: float
    audio_s_per_wall_s: float
    underruns_per_stream: float
    llm_tokens_per_s: float
    audio_s_per_request: float
    peak_mem_mib: float
    mem_per_stream_mib: float


def _prompt(path: Path, seconds: float = 3.0, sr: int = 24000) -> Path:
    t = np.arange(int(seconds * sr)) / sr
    phase = 2 * np.pi * np.cumsum(120 + 30 * np.sin(2 * np.pi * 0.8 * t)) / sr
    wav = sum(np.sin(k * phase) / k for k in range(1, 12)) * 0.5 * (1 - np.cos(2 * np.pi * 3 * t))
    sf.write(path, (0.3 * wav).astype(np.float32), sr)
    return path


class _PeakMemory:
    """Peak memory above the level at start: CUDA allocator peak, or the CPU's resident set sampled by a thread."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def __enter__(self) -> _PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.base = self.peak = self._rss()
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            self._thread.join()

    @property
    def used_mib(self) -> float:
        return max(self.peak - self.base, 0) / 2**20


def _one_request(engine: Engine | ReferenceEngine, inp, stream: bool, seed: int) -> dict[str, float]:
    start = time.perf_counter()
    first = audible = None
    samples = tokens = 0
    arrivals: list[tuple[float, int, int]] = []  # (arrival time, first sample, samples) per non-empty chunk
    for chunk in engine.synthesize(inp, stream=stream, seed=seed):
        now = time.perf_counter() - start  # chunks are on the CPU: the device work is done
        first = now if first is None else first
        if chunk.pcm.numel():
            arrivals.append((now, samples, chunk.pcm.numel()))
            if audible is None and bool((chunk.pcm.abs() >= AUDIBLE).any()):
                audible = now
        samples += chunk.pcm.numel()
        tokens = chunk.token_end
    total = time.perf_counter() - start
    return {"first": first if first is not None else total, "audible": audible if audible is not None else total,
            "total": total, "audio": samples / engine.sample_rate, "tokens": tokens,
            "underruns": playback_underruns(arrivals, engine.sample_rate)}


def playback_underruns(arrivals: list[tuple[float, int, int]], sample_rate: int) -> int:
    """Stalls of a player that starts at the first audio and plays at real time: a chunk that arrives after the
    clock reached its first sample is an underrun, and the clock waits for it."""
    underruns, stall = 0, 0.0
    for t, offset, _ in arrivals[1:]:
        due = arrivals[0][0] + stall + (offset - arrivals[0][1]) / sample_rate
        if t > due:
            underruns += 1
            stall += t - due
    return underruns


def measure(engine: Engine | ReferenceEngine, inp, stream: bool, clients: int,
            requests: int) -> tuple[list[dict[str, float]], float, int]:
    """Closed loop: ``clients`` at once, each sending ``requests`` one after another; (results, wall, in flight)."""
    results: list[dict[str, float]] = []
    lock = threading.Lock()
    barrier = threading.Barrier(clients + 1)

    def client(k: int) -> None:
        barrier.wait()
        for r in range(requests):
            out = _one_request(engine, inp, stream, seed=1000 * k + r)
            with lock:
                results.append(out)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start, clients


def measure_poisson(engine: Engine | ReferenceEngine, inp, stream: bool, rate: float,
                    arrivals: int, seed: int = 0) -> tuple[list[dict[str, float]], float, int]:
    """Open loop: ``arrivals`` requests at Poisson times of ``rate`` per second; (results, wall, most in flight)."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, arrivals)
    gaps[0] = 0.0
    results: list[dict[str, float]] = []
    lock = threading.Lock()
    in_flight = [0, 0]  # now, most

    def request(k: int) -> None:
        with lock:
            in_flight[0] += 1
            in_flight[1] = max(in_flight[1], in_flight[0])
        out = _one_request(engine, inp, stream, seed=5000 + k)
        with lock:
            results.append(out)
            in_flight[0] -= 1

    threads = []
    start = time.perf_counter()
    for k, at in enumerate(np.cumsum(gaps)):
        time.sleep(max(0.0, start + at - time.perf_counter()))
        threads.append(threading.Thread(target=request, args=(k,)))
        threads[-1].start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start, in_flight[1]


def _row(engine: str, dtype: str, mode: str, load: str, clients: int, rate: float,
         results: list[dict[str, float]], wall: float, mem_mib: float) -> Row:
    def pct(key: str) -> list[float]:
        values = [r[key] for r in results]
        return [1e3 * float(np.percentile(values, q)) for q in (50, 95, 99)]

    audio = sum(r["audio"] for r in results)
    return Row(engine, dtype, mode, load, clients, rate, len(results), *pct("first"), *pct("audible"),
               statistics.mean(r["total"] / max(r["audio"], 1e-9) for r in results), audio / wall,
               statistics.mean(r["underruns"] for r in results), sum(r["tokens"] for r in results) / wall,
               audio / len(results), mem_mib, mem_mib / max(clients, 1))


def llm_only(llm, batch_sizes: list[int], tokens: int, device: torch.device,
             cuda_graphs: bool = False) -> list[dict[str, float]]:
    """Decode tokens/s of the LLM alone: the scheduler at each batch size vs eager threads (fixed length)."""
    prompt = llm.speech_embedding.weight[:64].detach()  # any 64-embedding prompt: the cost is what matters
    rows = []
    for batch in batch_sizes:
        for name in ("scheduler", "eager threads"):
            done = threading.Semaphore(0)
            tickets = [Ticket(llm.generate_job(prompt, tokens, tokens, ban_stop=True), seed, lambda _t: None,
                              lambda _e, done=done: done.release())
                       for seed in range(batch)]
            scheduler = LLMScheduler(llm, rows=batch, max_positions=64 + tokens, cuda_graphs=cuda_graphs)
            start = time.perf_counter()
            if name == "scheduler":
                for t in tickets:
                    scheduler.submit(t)
            else:
                for t in tickets:
                    threading.Thread(target=run_ticket_eager, args=(llm, t, 64 + tokens)).start()
            for _ in tickets:
                done.acquire()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            wall = time.perf_counter() - start
            scheduler.close()
            rows.append({"runner": name, "batch": batch, "tokens_per_s": batch * tokens / wall,
                         "ms_per_step": 1e3 * wall / tokens})
    return rows


def _git_commit(where: Path = Path(__file__).parent) -> str:
    """The short commit of the checkout holding ``where`` (by default, these benchmarks')."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=where)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def markdown_table(rows: list[Row]) -> str:
    """The rows as one markdown table (also used by benchmarks/gpu_suite.py)."""
    lines = ["| engine | dtype | mode | load | clients | rate /s | requests | first packet p50 / p95 / p99 ms "
             "| first audible p50 / p95 / p99 ms | RTF | audio s / wall s | underruns / stream | LLM tok/s "
             "| audio s / request | peak MiB | MiB / stream |", "|" + " --- |" * 16]
    lines += [_table_line(r) for r in rows]
    return "\n".join(lines)


def _table_line(r: Row) -> str:
    return (f"| {r.engine} | {r.dtype} | {r.mode} | {r.load} | {r.clients} | {r.rate:g} | {r.requests} | "
            f"{r.first_packet_p50_ms:.0f} / {r.first_packet_p95_ms:.0f} / {r.first_packet_p99_ms:.0f} | "
            f"{r.first_audible_p50_ms:.0f} / {r.first_audible_p95_ms:.0f} / {r.first_audible_p99_ms:.0f} | "
            f"{r.rtf:.3f} | {r.audio_s_per_wall_s:.2f} | {r.underruns_per_stream:.2f} | {r.llm_tokens_per_s:.0f} | "
            f"{r.audio_s_per_request:.2f} | {r.peak_mem_mib:.0f} | {r.mem_per_stream_mib:.1f} |")


def scratch_dir(prefix: str) -> Path:
    """A new temporary folder, removed when the process exits however ``main`` ends (a released-size bundle
    made in it takes ~3.5 GB of disk, and a benchmark is often stopped part-way)."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, work, True)
    return work


def bench_bundle(model_dir: Path | None, tiny: bool, work: Path) -> tuple[Path, str]:
    """(the model folder to measure, its label): the one given, else a random bundle made in ``work`` at the tiny
    or the released sizes (random weights cost what real ones do)."""
    if model_dir:
        return model_dir, str(model_dir)
    if tiny:
        return make_tiny_bundle(work / "tiny", seed=0), "tiny test bundle (random)"
    return make_tiny_bundle(work / "full", seed=0, dims=RELEASED_DIMS), "released sizes, random"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--tiny", action="store_true", help="the tiny test bundle: a smoke run in seconds on a CPU")
    which.add_argument("--random-full", action="store_true", help="released sizes, random weights (the default)")
    parser.add_argument("--model-dir", type=Path, help="a model bundle to measure (with --tiny: reuse this one)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(PRECISIONS), nargs="+", default=["fp32"],
                        help="LLM and flow precision (half precision is CUDA-only; the vocoder is always fp32)")
    parser.add_argument("--concurrency", type=int, nargs="*", help="closed loop: clients at once "
                        "(default 1 4 16 64; tiny: 1 4; none: no closed-loop rows)")
    parser.add_argument("--poisson", type=float, nargs="*", default=[],
                        help="open loop: Poisson arrival rates, requests per second")
    parser.add_argument("--arrivals", type=int, default=32, help="requests per Poisson rate (tiny: 4)")
    parser.add_argument("--modes", choices=["stream", "nonstream"], nargs="+", default=["stream", "nonstream"])
    parser.add_argument("--engines", choices=list(ENGINES), nargs="*", default=["fast", "baseline"],
                        help="engines to measure (none: with --llm-only, the LLM alone)")
    parser.add_argument("--ablation", action="store_true", help="every engine: fast, each optimisation off, baseline")
    parser.add_argument("--fixed-tokens", type=int, help="decode exactly N speech tokens per request "
                        "(default 250; tiny: 30)")
    parser.add_argument("--requests", type=int, default=1, help="requests per client, one after another")
    parser.add_argument("--llm-only", action="store_true", help="also measure the LLM decode alone")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="also graph the LLM-only scheduler rows (the engines' graphs follow --engines)")
    parser.add_argument("--json", type=Path, help="write settings and rows here")
    return parser


def _engine_rows(engine, name: str, dtype_name: str, inp, args: argparse.Namespace, concurrency: list[int],
                 arrivals: int, device: torch.device) -> list[Row]:
    """One engine's rows: every asked mode under every load, each printed as it is measured."""
    rows: list[Row] = []
    for stream in (True, False):
        mode = "stream" if stream else "nonstream"
        if mode not in args.modes:
            continue
        _one_request(engine, inp, stream, seed=0)  # warm-up: allocator, kernels, noise buffers
        loads = [("closed", c, 0.0) for c in concurrency] + [("poisson", 0, r) for r in args.poisson]
        for load, clients, rate in loads:
            with _PeakMemory(device) as mem:
                if load == "closed":
                    results, wall, in_flight = measure(engine, inp, stream, clients, args.requests)
                else:
                    results, wall, in_flight = measure_poisson(engine, inp, stream, rate, arrivals)
            rows.append(_row(name, dtype_name, mode, load, in_flight, rate, results, wall, mem.used_mib))
            print(_table_line(rows[-1]), flush=True)
    return rows


def _print_llm_rows(llm_rows: list[dict]) -> None:
    print("\n| LLM runner | dtype | batch | tokens/s (all rows) | ms per step |\n| --- | --- | --- | --- | --- |")
    for r in llm_rows:
        print(f"| {r['runner']} | {r['dtype']} | {r['batch']} | {r['tokens_per_s']:.0f} | {r['ms_per_step']:.2f} |")


def main(argv: list[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    concurrency = args.concurrency if args.concurrency is not None else ([1, 4] if args.tiny else [1, 4, 16, 64])
    device = torch.device(args.device)
    # the compiled engine only where it pays: inductor's CPU compile takes minutes per bucket on small machines
    engines = [e for e in ENGINES if e != "compiled" or device.type == "cuda"] if args.ablation else args.engines
    arrivals = 4 if args.tiny and args.arrivals == 32 else args.arrivals
    fixed = args.fixed_tokens or (30 if args.tiny else 250)
    dtypes = [d for d in args.dtype if d == "fp32" or device.type == "cuda"]
    skipped = sorted(set(args.dtype) - set(dtypes))

    work = scratch_dir("cosyvoice-bench-")
    model_dir, model = bench_bundle(args.model_dir, args.tiny, work)
    bundle = validate_model_dir(model_dir)
    # rows for every closed-loop client; open-loop requests beyond them wait in the scheduler's queue
    limits = Limits(max_sessions=max([*concurrency, 16 if args.poisson else 1]), queue_timeout_seconds=600)
    frontend = CosyVoiceFrontend(bundle, limits)
    voice = frontend.voice(zero_shot_prompt_text("A prompt recording of three seconds."), _prompt(work / "p.wav"))
    inp = frontend.model_input(TEXT, voice)
    cpu = f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads)"
    settings = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu,
        "torch": torch.__version__, "python": sys.version.split()[0],
        "commit": _git_commit(), "model": model, "fixed_tokens": fixed, "prompt_tokens":
        int(inp.flow_prompt_speech_token.shape[1]), "concurrency": concurrency, "requests_per_client": args.requests,
        "poisson_rates": args.poisson, "arrivals_per_rate": arrivals, "llm_rows": limits.max_sessions,
        "dtypes": dtypes, "skipped_dtypes (CUDA only)": skipped, "modes": args.modes, "engines": engines,
        "engine_options": {name: dict(ENGINES[name][1]) for name in engines},
    }
    print(" | ".join(f"{k} {v}" for k, v in settings.items()), flush=True)
    print(markdown_table([]), flush=True)
    rows: list[Row] = []
    llm_rows: list[dict] = []
    hift = bundle.load_hift(device)
    for dtype_name in dtypes:
        dtype = parse_precision(dtype_name)
        llm = bundle.load_llm(device, dtype, frontend.tokenizer.end_of_prompt_id)
        flow = bundle.load_flow(device, dtype)
        for name in engines:
            cls, options = ENGINES[name]
            options = {k: v for k, v in options.items() if k != "cuda_graphs" or device.type == "cuda"}
            engine = cls(bundle.config, llm, flow, hift, device, limits, fixed_tokens=fixed, **options)
            rows += _engine_rows(engine, name, dtype_name, inp, args, concurrency, arrivals, device)
            engine.close()
        if args.llm_only:
            llm_rows += [{"dtype": dtype_name, **r} for r in llm_only(llm, concurrency or [1], fixed, device,
                                                                        args.cuda_graphs)]
        del llm, flow
    if llm_rows:
        _print_llm_rows(llm_rows)
    report = {"settings": settings, "rows": [asdict(r) for r in rows], "llm_only": llm_rows}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
