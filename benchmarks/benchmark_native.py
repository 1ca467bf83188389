"""The native Rust server beside the Python server, in one run: ``cosyvoice-native-server`` and the Python REST
server on the same model folder, the same requests, one after another.

    python benchmarks/benchmark_native.py [--model-dir DIR] [--requests N] [--seeds 1 2 3]

For each server it sends ``POST /synthesize`` (a short zero-shot request, WAV answered whole, so the first
audio arrives with the last) once per seed, ``--requests`` times over, and reports: model load time, the
median first-audio latency, the real-time factor (wall seconds per audio second), the audio length per seed
(equal seeds decode equal speech tokens in both engines, so the lengths should agree), the server's resident
memory (RSS) after the run and at its peak, and the CPU time it spent on the requests. Without ``--model-dir``
a random tiny bundle is made. Build the native server first (``bash scripts/build_rust.sh``).
"""

from __future__ import annotations

import argparse
import base64
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from benchmark_bridge import Process, _cpu_seconds, _memory_mib, _prompt  # this folder (run as a script)

from cosyvoice.tools.make_tiny_bundle import make_tiny_bundle

ROOT = Path(__file__).resolve().parents[1]
NATIVE_BINARY = ROOT / "rust" / "target" / "release" / "cosyvoice-native-server"
TEXT = "Hello there, my friend."
TRANSCRIPT = "A short prompt for the benchmark."


@dataclass
class Row:
    server: str
    load_s: float
    requests: int
    first_audio_ms: float
    rtf: float
    audio_s: dict[int, float]
    rss_mib: float
    peak_rss_mib: float
    cpu_s: float


def measure(name: str, command: list[str], work: Path, seeds: list[int], rounds: int, body: dict) -> Row:
    started = time.perf_counter()
    server = Process(name, command, work)
    load = time.perf_counter() - started
    try:
        cpu_before = _cpu_seconds(server.process.pid)
        walls, audio, rtfs = [], {}, []
        for _ in range(rounds):
            for seed in seeds:
                sent = time.perf_counter()
                answer = httpx.post(f"{server.url}/synthesize", json={**body, "seed": seed}, timeout=600)
                wall = time.perf_counter() - sent
                if answer.status_code != 200:
                    raise SystemExit(f"{name}: {answer.status_code} {answer.text}")
                audio[seed] = float(answer.headers["x-audio-duration"])
                walls.append(wall)
                rtfs.append(wall / audio[seed])
        cpu = _cpu_seconds(server.process.pid) - cpu_before
        return Row(name, load, len(walls), 1000 * statistics.median(walls), statistics.median(rtfs), audio,
                   _memory_mib(server.process.pid, "VmRSS"), _memory_mib(server.process.pid, "VmHWM"), cpu)
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, help="a model folder (default: a random tiny bundle)")
    parser.add_argument("--requests", type=int, default=2, help="rounds over the seeds")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    args = parser.parse_args(argv)
    if not NATIVE_BINARY.is_file():
        raise SystemExit(f"build the native server first: bash scripts/build_rust.sh ({NATIVE_BINARY} is missing)")
    with tempfile.TemporaryDirectory(prefix="bench-native-") as tmp:
        work = Path(tmp)
        model_dir = args.model_dir or make_tiny_bundle(work / "tiny", seed=0)
        prompt = base64.b64encode(_prompt(work / "prompt.wav").read_bytes()).decode()
        body = {"text": TEXT, "prompt_audio": prompt, "prompt_text": TRANSCRIPT}
        flags = ["--model-dir", str(model_dir), "--device", "cpu", "--log-level", "warning"]
        os.environ.setdefault("COSYVOICE_BACKEND", "torch")
        load_before = os.getloadavg()
        rows = [measure(name, [*command, *flags, "--voice-dir", str(work / f"voices-{name}")], work, args.seeds,
                        args.requests, body)
                for name, command in (("python", [sys.executable, "-m", "cosyvoice.server.rest"]),
                                      ("native", [str(NATIVE_BINARY)]))]
        load_after = os.getloadavg()
    print(f"device: cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores); "
          f"Python {platform.python_version()}")
    print(f"model: {args.model_dir or 'random tiny bundle'}; /synthesize: {len(TEXT)} characters, zero-shot, "
          f"1.5 s prompt, seeds {args.seeds} x {args.requests}; load average before {load_before[0]:.1f}, "
          f"after {load_after[0]:.1f}")
    print("| server | load s | requests | first audio p50 ms | RTF p50 | audio s per seed | RSS MiB | peak RSS MiB | "
          "CPU s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        audio = ", ".join(f"{r.audio_s[s]:.2f}" for s in args.seeds)
        print(f"| {r.server} | {r.load_s:.1f} | {r.requests} | {r.first_audio_ms:.0f} | {r.rtf:.2f} | {audio} | "
              f"{r.rss_mib:.0f} | {r.peak_rss_mib:.0f} | {r.cpu_s:.1f} |")
    return rows


if __name__ == "__main__":
    main()
