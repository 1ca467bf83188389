"""Engine performance: the batched engine (fast path) beside the reference's strategy (baseline), in one run.

    python benchmarks/benchmark_performance.py --tiny                       # seconds on a CPU: a smoke run
    python benchmarks/benchmark_performance.py --random-full --device cuda --dtype fp32 bf16 \\
        --concurrency 1 4 16 64 --fixed-tokens 250 --json perf.json        # the issue-6 measurement

Bundles: ``--tiny`` writes the tiny test bundle (toy sizes); ``--random-full`` a randomly initialised
bundle with the released model's sizes (Qwen2-0.5B LLM, 22-block 1024-dim DiT, 512-channel HiFT), so
timings are those of the real architecture; ``--model-dir`` measures a real model. ``--fixed-tokens N``
makes every request decode exactly N speech tokens (the engine's ``fixed_tokens`` option: min = max
length, stop ids masked), so runs are comparable whatever the weights sample.

Engines: ``fast`` = ``Engine`` (one LLM scheduler thread with batched decode and sampling, a token-to-wave
worker, incremental flow and vocoder); ``baseline`` = ``ReferenceEngine`` (benchmarks/reference_engine.py):
the reference's shape (an LLM thread per request, flow and vocoder re-run over the whole utterance per
chunk, in the caller's thread).

Per (engine, dtype, mode, clients) row: first audio p50 / p90 (request start to its first chunk), RTF
(mean over requests of wall time / audio seconds), aggregate audio-seconds per wall-second, LLM tokens
per second (all requests' speech tokens / wall time), peak memory (CUDA: max allocated; CPU: peak
resident set sampled every 5 ms) above the idle engine, and that per stream. ``--llm-only`` adds a table
of the LLM alone: scheduler decode tokens/s per batch size against eager one-thread-per-request decoding.
Every client starts at once (a barrier) and sends ``--requests`` requests one after another.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
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
ENGINES = {"fast": Engine, "baseline": ReferenceEngine}


@dataclass
class Row:
    engine: str
    dtype: str
    mode: str
    clients: int
    requests: int
    first_audio_p50_ms: float
    first_audio_p90_ms: float
    rtf: float
    audio_s_per_wall_s: float
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
    first = None
    samples = tokens = 0
    for chunk in engine.synthesize(inp, stream=stream, seed=seed):
        if first is None:
            first = time.perf_counter() - start  # chunks are on the CPU: the device work is done
        samples += chunk.pcm.numel()
        tokens = chunk.token_end
    total = time.perf_counter() - start
    return {"first": first if first is not None else total, "total": total, "audio": samples / engine.sample_rate,
            "tokens": tokens}


def measure(engine: Engine | ReferenceEngine, inp, stream: bool, clients: int,
            requests: int) -> tuple[list[dict[str, float]], float]:
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
    return results, time.perf_counter() - start


def _row(engine: str, dtype: str, mode: str, clients: int, requests: int, results: list[dict[str, float]],
         wall: float, mem_mib: float) -> Row:
    firsts = sorted(r["first"] for r in results)
    audio = sum(r["audio"] for r in results)
    return Row(engine, dtype, mode, clients, len(results), 1e3 * statistics.median(firsts),
               1e3 * float(np.percentile(firsts, 90)),
               statistics.mean(r["total"] / max(r["audio"], 1e-9) for r in results), audio / wall,
               sum(r["tokens"] for r in results) / wall, audio / len(results), mem_mib, mem_mib / clients)


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


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).parent)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--tiny", action="store_true", help="the tiny test bundle: a smoke run in seconds on a CPU")
    which.add_argument("--random-full", action="store_true", help="released sizes, random weights (the default)")
    parser.add_argument("--model-dir", type=Path, help="a model bundle to measure (with --tiny: reuse this one)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(PRECISIONS), nargs="+", default=["fp32"],
                        help="LLM and flow precision (half precision is CUDA-only; the vocoder is always fp32)")
    parser.add_argument("--concurrency", type=int, nargs="+", help="clients at once (default 1 4 16 64; tiny: 1 4)")
    parser.add_argument("--modes", choices=["stream", "nonstream"], nargs="+", default=["stream", "nonstream"])
    parser.add_argument("--engines", choices=sorted(ENGINES), nargs="*", default=["fast", "baseline"],
                        help="engines to measure (none: with --llm-only, the LLM alone)")
    parser.add_argument("--fixed-tokens", type=int, help="decode exactly N speech tokens per request "
                        "(default 250; tiny: 30)")
    parser.add_argument("--requests", type=int, default=1, help="requests per client, one after another")
    parser.add_argument("--llm-only", action="store_true", help="also measure the LLM decode alone")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="fast path: capture the batched decode step in CUDA graphs (CUDA only)")
    parser.add_argument("--json", type=Path, help="write settings and rows here")
    args = parser.parse_args(argv)
    concurrency = args.concurrency or ([1, 4] if args.tiny else [1, 4, 16, 64])
    fixed = args.fixed_tokens or (30 if args.tiny else 250)
    device = torch.device(args.device)
    dtypes = [d for d in args.dtype if d == "fp32" or device.type == "cuda"]
    skipped = sorted(set(args.dtype) - set(dtypes))

    work = Path(tempfile.mkdtemp(prefix="cosyvoice-bench-"))
    if args.model_dir:
        model_dir, model = args.model_dir, str(args.model_dir)
    elif args.tiny:
        model_dir, model = make_tiny_bundle(work / "tiny", seed=0), "tiny test bundle (random)"
    else:
        model_dir, model = make_tiny_bundle(work / "full", seed=0, dims=RELEASED_DIMS), "released sizes, random"
    bundle = validate_model_dir(model_dir)
    limits = Limits(max_sessions=max(concurrency), queue_timeout_seconds=600)
    frontend = CosyVoiceFrontend(bundle, limits)
    voice = frontend.voice(zero_shot_prompt_text("A prompt recording of three seconds."), _prompt(work / "p.wav"),
                           text_frontend=False)
    inp = frontend.model_input(TEXT, voice)
    cpu = f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads)"
    settings = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu,
        "torch": torch.__version__, "python": sys.version.split()[0],
        "commit": _git_commit(), "model": model, "fixed_tokens": fixed, "prompt_tokens":
        int(inp.flow_prompt_speech_token.shape[1]), "concurrency": concurrency, "requests_per_client": args.requests,
        "dtypes": dtypes, "skipped_dtypes (CUDA only)": skipped, "cuda_graphs": args.cuda_graphs,
        "modes": args.modes, "engines": args.engines,
    }
    print(" | ".join(f"{k} {v}" for k, v in settings.items()), flush=True)
    header = ("| engine | dtype | mode | clients | requests | first audio p50 ms | p90 ms | RTF | audio s / wall s "
              "| LLM tok/s | audio s / request | peak MiB | MiB / stream |")
    print(header)
    print("|" + " --- |" * (header.count("|") - 1))
    rows: list[Row] = []
    llm_rows: list[dict] = []
    hift = bundle.load_hift(device)
    for dtype_name in dtypes:
        dtype = parse_precision(dtype_name)
        llm, flow = bundle.load_llm(device, dtype), bundle.load_flow(device, dtype)
        for name in args.engines:
            graphs = {"cuda_graphs": args.cuda_graphs} if name == "fast" else {}
            engine = ENGINES[name](bundle.config, llm, flow, hift, device, limits,
                                   endofprompt_id=frontend.tokenizer.end_of_prompt_id, fixed_tokens=fixed, **graphs)
            for stream in (True, False):
                mode = "stream" if stream else "nonstream"
                if mode not in args.modes:
                    continue
                _one_request(engine, inp, stream, seed=0)  # warm-up: allocator, kernels, noise buffers
                for clients in concurrency:
                    with _PeakMemory(device) as mem:
                        results, wall = measure(engine, inp, stream, clients, args.requests)
                    row = _row(name, dtype_name, mode, clients, args.requests, results, wall, mem.used_mib)
                    rows.append(row)
                    print(f"| {row.engine} | {row.dtype} | {row.mode} | {row.clients} | {row.requests} | "
                          f"{row.first_audio_p50_ms:.0f} | {row.first_audio_p90_ms:.0f} | {row.rtf:.3f} | "
                          f"{row.audio_s_per_wall_s:.2f} | {row.llm_tokens_per_s:.0f} | {row.audio_s_per_request:.2f} "
                          f"| {row.peak_mem_mib:.0f} | {row.mem_per_stream_mib:.1f} |", flush=True)
            engine.close()
        if args.llm_only:
            for r in llm_only(llm, concurrency, fixed, device, args.cuda_graphs):
                llm_rows.append({"dtype": dtype_name, **r})
        del llm, flow
    if llm_rows:
        print("\n| LLM runner | dtype | batch | tokens/s (all rows) | ms per step |\n| --- | --- | --- | --- | --- |")
        for r in llm_rows:
            print(f"| {r['runner']} | {r['dtype']} | {r['batch']} | {r['tokens_per_s']:.0f} | {r['ms_per_step']:.2f} |")
    report = {"settings": settings, "rows": [asdict(r) for r in rows], "llm_only": llm_rows}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
