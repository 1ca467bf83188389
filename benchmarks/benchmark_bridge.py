"""The bridge contract's servers side by side: the Python REST server, the Rust bridge ``cosyvoice-server``
(hyper in front of the Python engine) and the native Rust server ``cosyvoice-native-server`` (no Python).

    python benchmarks/benchmark_bridge.py [--model-dir DIR] [--servers python rust native] [--clients 1 8 32]

Each runs as a process on loopback with the same model folder and settings (without one, a random tiny bundle
is made). For each server and each number of concurrent clients it measures ``GET /health`` and
``POST /synthesize`` (a short zero-shot request, WAV answered whole, so its latency is also its first audio):
p50/p95 latency, requests per second, errors, the real-time factor (latency over the answer's
``X-Audio-Duration``), the server process's CPU seconds per request (user + system, from ``/proc``: the work,
whatever the clock of a busy machine says) and its resident memory after the run and at its peak. It prints one
markdown table with the device, versions, settings and load averages: on a shared machine the wall-clock
numbers move with the load beside them. Build the Rust servers first (``bash scripts/build_rust.sh``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import soundfile as sf
import torch

from cosyvoice.tools.make_tiny_bundle import make_tiny_bundle

ROOT = Path(__file__).resolve().parents[1]
RUST_BINARY = ROOT / "rust" / "target" / "release" / "cosyvoice-server"
NATIVE_BINARY = ROOT / "rust" / "target" / "release" / "cosyvoice-native-server"
COMMANDS = {"python": [sys.executable, "-m", "cosyvoice.server.rest"], "rust": [str(RUST_BINARY)],
            "native": [str(NATIVE_BINARY)]}
TEXT = "Hello there, my friend."
TRANSCRIPT = "A short prompt for the benchmark."


@dataclass
class Row:
    server: str
    route: str
    clients: int
    requests: int
    errors: int
    p50_ms: float
    p95_ms: float
    per_second: float
    rtf: float  # median latency / audio seconds (synthesis only)
    cpu_s: float  # the server's CPU seconds per request
    rss_mib: float
    peak_rss_mib: float


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _prompt(path: Path, seconds: float = 1.5, sr: int = 16000) -> Path:
    t = np.arange(int(seconds * sr)) / sr
    phase = 2 * np.pi * np.cumsum(120 + 30 * np.sin(2 * np.pi * 0.8 * t)) / sr
    wav = sum(np.sin(k * phase) / k for k in range(1, 12)) * 0.5 * (1 - np.cos(2 * np.pi * 3 * t))
    sf.write(path, (0.3 * wav).astype(np.float32), sr, subtype="PCM_16")
    return path


def _memory_mib(pid: int, field: str) -> float:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak) of a process, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its threads so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Process:
    """A server process on a free loopback port, ready once ``/ready`` says so."""

    def __init__(self, name: str, command: list[str], work: Path) -> None:
        self.name, self.port = name, _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(self.port)], cwd=work,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while True:
            if self.process.poll() is not None:
                raise SystemExit(f"{name} server exited with {self.process.returncode}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/ready").status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"{name} server was not ready within 300 s")
            time.sleep(0.2)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()


async def _load(url: str, route: str, clients: int, total: int,
                body: dict | None) -> tuple[list[float], list[float], int, float]:
    """``total`` requests by ``clients`` concurrent clients: (latencies in s, audio seconds answered, errors,
    wall seconds)."""
    latencies: list[float] = []
    audio: list[float] = []
    errors = 0
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(total):
        queue.put_nowait(i)

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal errors
        while not queue.empty():
            queue.get_nowait()
            started = time.perf_counter()
            try:
                response = await (http.post(url + route, json=body) if body else http.get(url + route))
                ok = response.status_code == 200
                if ok and "x-audio-duration" in response.headers:
                    audio.append(float(response.headers["x-audio-duration"]))
            except httpx.HTTPError:
                ok = False
            latencies.append(time.perf_counter() - started)
            errors += not ok

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(limits=limits, timeout=600) as http:
        started = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        return latencies, audio, errors, time.perf_counter() - started


def measure(server: Process, clients: list[int], synth_requests: int, health_requests: int,
            body: dict) -> list[Row]:
    rows = []
    for n in clients:
        for route, total, payload in (("/health", health_requests, None),
                                      ("/synthesize", max(synth_requests, n), body)):
            pid = server.process.pid
            cpu_before = _cpu_seconds(pid)
            latencies, audio, errors, wall = asyncio.run(_load(server.url, route, n, total, payload))
            ms = sorted(x * 1000 for x in latencies)
            rtf = statistics.median(ms) / 1000 / statistics.median(audio) if audio else float("nan")
            rows.append(Row(server.name, route, n, total, errors, statistics.median(ms),
                            ms[min(len(ms) - 1, int(0.95 * len(ms)))], total / wall, rtf,
                            (_cpu_seconds(pid) - cpu_before) / total, _memory_mib(pid, "VmRSS"),
                            _memory_mib(pid, "VmHWM")))
    return rows


def _versions() -> str:
    found = shutil.which("rustc") or shutil.which("rustc", path=str(Path.home() / ".cargo" / "bin"))
    rustc = subprocess.run([found, "--version"], capture_output=True, text=True).stdout.strip() if found else ""
    return f"Python {platform.python_version()}, torch {torch.__version__}, {rustc or 'rustc ?'}"


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, help="a model folder (default: a random tiny bundle)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--synth-requests", type=int, default=8,
                        help="/synthesize requests per client count (at least one per client)")
    parser.add_argument("--health-requests", type=int, default=2000)
    parser.add_argument("--max-sessions", type=int, default=8)
    parser.add_argument("--servers", nargs="+", choices=list(COMMANDS), default=list(COMMANDS))
    args = parser.parse_args(argv)
    for name in args.servers:
        binary = Path(COMMANDS[name][0])
        if binary.is_absolute() and not binary.is_file():
            raise SystemExit(f"build the Rust servers first: bash scripts/build_rust.sh ({binary} is missing)")

    with tempfile.TemporaryDirectory(prefix="bench-bridge-") as tmp:
        work = Path(tmp)
        model_dir = args.model_dir or make_tiny_bundle(work / "tiny", seed=0)
        prompt = base64.b64encode(_prompt(work / "prompt.wav").read_bytes()).decode()
        body = {"text": TEXT, "prompt_audio": prompt, "prompt_text": TRANSCRIPT, "seed": 1}
        flags = ["--model-dir", str(model_dir), "--log-level", "warning",
                 "--max-sessions", str(args.max_sessions), "--max-queued-requests", "64",
                 "--queue-timeout-seconds", "600"]
        os.environ.setdefault("COSYVOICE_BACKEND", "torch")
        os.environ["COSYVOICE_DEVICE"] = args.device  # the Python engines' device; the native server runs on the CPU
        load_before = os.getloadavg()
        rows: list[Row] = []
        for name in args.servers:
            server = Process(name, [*COMMANDS[name], *flags, "--voice-dir", str(work / f"voices-{name}")], work)
            try:
                rows += measure(server, args.clients, args.synth_requests, args.health_requests, body)
            finally:
                server.stop()
        load_after = os.getloadavg()

    print(f"device: {args.device} ({platform.processor() or platform.machine()}, {os.cpu_count()} cores); "
          f"{_versions()}")
    print(f"model: {args.model_dir or 'random tiny bundle'}; max_sessions {args.max_sessions}; "
          f"/synthesize: {len(TEXT)} characters, zero-shot, 1.5 s prompt; "
          f"load average before {load_before[0]:.1f} / {load_before[1]:.1f} / {load_before[2]:.1f}, "
          f"after {load_after[0]:.1f} / {load_after[1]:.1f} / {load_after[2]:.1f}")
    print("| server | route | clients | requests | errors | p50 ms | p95 ms | requests/s | RTF (p50) | "
          "server CPU s per request | RSS MiB | peak RSS MiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        rtf = "" if r.rtf != r.rtf else f"{r.rtf:.2f}"
        print(f"| {r.server} | {r.route} | {r.clients} | {r.requests} | {r.errors} | {r.p50_ms:.1f} | "
              f"{r.p95_ms:.1f} | {r.per_second:.1f} | {rtf} | {r.cpu_s:.4f} | {r.rss_mib:.0f} | "
              f"{r.peak_rss_mib:.0f} |")
    return rows


if __name__ == "__main__":
    main()
